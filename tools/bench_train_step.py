#!/usr/bin/env python3
"""One MLLM training step in PyTorch eager, on the model of a Braid run config.

    python3 tools/bench_train_step.py [--config configs/demo.toml] [--set model.llm.layers=8 ...]
        [--rows 8] [--seq 512] [--samples-per-row 5] [--images 20] [--clips 20]
        [--microbatches 2] [--steps 20] [--warmup 3] [--threads 2] [--text-only] [--parts 10]

The PyTorch side of `cargo bench -p braid-train --bench step` (train/benches/step.rs, which
runs this script with the same shapes when BRAID_BENCH_PYTHON is set); it can also run alone.
Needs torch and transformers.

The model is the config's [model.*] sections built from transformers classes:
LlamaForCausalLM (sdpa), SiglipVisionModel without head, WhisperEncoder, and the LLaVA-style
projectors (vision: Linear-GELU-Linear per patch token; audio: `stride` consecutive frames
stacked, the last group zero padded, then Linear-GELU-Linear). HF's Whisper encoder only takes
exactly 2 * max_source_positions frames, so it is built with max_source_positions =
frames / 2 (the weights it drops are not used by a shorter clip in Braid either).

The batch is the one step.rs builds: `rows` rows of `samples_per_row` samples of
L = seq // samples_per_row tokens each (so a row holds samples_per_row * L tokens: 510 for
the default 512 / 5). PyTorch gets its best eager path: the samples as a (rows * S, L)
batch with a plain causal mask (the same attention work as Braid's packed rows, no padding).
Media item k (the images, then the clips) goes to sample k % (rows * S); a sample's items
fill consecutive placeholder positions from its second token on. The rows are split into
`microbatches` contiguous groups (as the demo does: 8 rows as 2 x 4), each a forward and a
backward, with the loss normalized by the whole step's target count.

One timed step = zero_grad -> forward (encoders, projectors, placeholder rows written into
the LLM input embeddings, LLM, summed cross-entropy / targets) -> backward, per microbatch
-> clip_grad_norm_(clip) -> AdamW step (fused when torch has it for CPU; weight decay on
matrices only, as Braid). Prints per-step phase times, then
`RESULT torch <median_s> <min_s>` and `PHASES torch <zero> <fwd> <bwd> <clip> <optim>`
(medians, seconds); with --parts N, `PART torch <module> <fwd_s> <bwd_s>` for the vision
encoder, the audio encoder and the LLM (+ loss) each run alone (see time_parts).
"""

import argparse
import statistics
import sys
import time
import tomllib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
IGNORE = -100


def parse_value(text):
    """A --set value: TOML when it parses as one, else a string (as Braid's --set)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_config(path, sets):
    cfg = tomllib.loads(Path(path).read_text())
    for s in sets:
        key, _, value = s.partition("=")
        *parents, last = key.strip().split(".")
        t = cfg
        for p in parents:
            t = t.setdefault(p, {})
        t[last] = parse_value(value.strip())
    return cfg


class Projector(nn.Module):
    """linear_1 -> GELU (erf) -> linear_2, as Braid's MlpProjector / AudioProjector."""

    def __init__(self, d_in, d_out, act):
        super().__init__()
        if act != "gelu":
            sys.exit(f"projector act {act!r}: only 'gelu' is mirrored here")
        self.linear_1 = nn.Linear(d_in, d_out)
        self.act = nn.GELU()
        self.linear_2 = nn.Linear(d_out, d_out)

    def forward(self, x):
        return self.linear_2(self.act(self.linear_1(x)))


def build_model(cfg, frames):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        SiglipVisionConfig,
        SiglipVisionModel,
        WhisperConfig,
    )
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    m = cfg["model"]
    lc = m["llm"]
    if lc.get("family", "llama") != "llama":
        sys.exit("only model.llm.family = 'llama' is mirrored here")
    rope = dict(lc.get("rope", {"theta": 10000.0}))
    theta = rope.pop("theta", 10000.0)
    if rope:
        sys.exit(f"rope scaling {rope} is not mirrored here")
    llm = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=lc["vocab"],
            hidden_size=lc["hidden"],
            intermediate_size=lc["intermediate"],
            num_hidden_layers=lc["layers"],
            num_attention_heads=lc["heads"],
            num_key_value_heads=lc["kv_heads"],
            head_dim=lc["head_dim"],
            rms_norm_eps=lc.get("rms_norm_eps", 1e-5),
            max_position_embeddings=lc.get("max_position_embeddings", 4096),
            rope_parameters={"rope_type": "default", "rope_theta": float(theta)},
            tie_word_embeddings=lc.get("tie_embeddings", False),
            attention_bias=lc.get("qkv_bias", False),
            attn_implementation="sdpa",
        )
    )
    vc = m["vision"]
    if vc.get("family") != "siglip":
        sys.exit("only model.vision.family = 'siglip' is mirrored here")
    vision = SiglipVisionModel(
        SiglipVisionConfig(
            hidden_size=vc["hidden_size"],
            intermediate_size=vc["intermediate_size"],
            num_hidden_layers=vc["num_layers"],
            num_attention_heads=vc["num_heads"],
            num_channels=vc["num_channels"],
            image_size=vc["image_size"],
            patch_size=vc["patch_size"],
            hidden_act=vc["act"],
            layer_norm_eps=vc["layer_norm_eps"],
            vision_use_head=False,
            attn_implementation="sdpa",
        )
    )
    ac = m["audio"]
    audio = WhisperEncoder(
        WhisperConfig(
            num_mel_bins=ac["num_mel_bins"],
            d_model=ac["d_model"],
            encoder_layers=ac["encoder_layers"],
            encoder_attention_heads=ac["encoder_attention_heads"],
            encoder_ffn_dim=ac["encoder_ffn_dim"],
            max_source_positions=frames // 2,
            activation_function=ac["act"],
            attn_implementation="sdpa",
        )
    )
    pv, pa = m["projector"]["vision"], m["projector"]["audio"]
    if pv.get("spatial_merge", 1) != 1:
        sys.exit("only projector.vision.spatial_merge = 1 is mirrored here")
    vproj = Projector(pv["in_dim"], pv["out_dim"], pv["act"])
    aproj = Projector(pa["in_dim"] * pa["stride"], pa["out_dim"], pa["act"])
    return nn.ModuleDict(
        {"llm": llm, "vision": vision, "vproj": vproj, "audio": audio, "aproj": aproj}
    ), pa["stride"]


def split_even(n, parts):
    """Contiguous groups of sizes differing by at most one (train/src/data.rs::split_even)."""
    parts = max(1, min(parts, max(n, 1)))
    return [range(i * n // parts, (i + 1) * n // parts) for i in range(parts)]


def layout(a, tok_img, tok_clip):
    """Placeholder positions of every item, as global token indices of the (rows * S * L)
    token stream; the same rule as step.rs."""
    n_samples = a.rows * a.samples_per_row
    L = a.seq // a.samples_per_row
    fill = [1] * n_samples  # next free offset in each sample: token 0 stays text
    img_pos, clip_pos = [], []
    for k in range(a.images + a.clips):
        s = k % n_samples
        n = tok_img if k < a.images else tok_clip
        if fill[s] + n > L:
            sys.exit(f"sample {s} of {L} tokens cannot hold its media ({fill[s] + n} tokens)")
        pos = list(range(s * L + fill[s], s * L + fill[s] + n))
        fill[s] += n
        (img_pos if k < a.images else clip_pos).append((s, pos))
    return img_pos, clip_pos


def make_batches(a, cfg, tok_img, tok_clip, frames):
    """One dict per microbatch: ids and targets (n_seq, L), images, clips, positions
    (flat, relative to the microbatch, image rows then clip rows)."""
    S, L = a.samples_per_row, a.seq // a.samples_per_row
    vocab = cfg["model"]["llm"]["vocab"]
    g = torch.Generator().manual_seed(a.seed)
    n_tok = a.rows * S * L
    ids = torch.randint(0, min(vocab, 256), (n_tok,), generator=g)
    img_pos, clip_pos = layout(a, tok_img, tok_clip)
    if a.text_only:
        img_pos, clip_pos = [], []
    for _, p in img_pos + clip_pos:
        ids[p] = vocab - 1  # a placeholder id: its own embedding is overwritten
    ids = ids.view(a.rows * S, L)
    targets = torch.full_like(ids, IGNORE)
    targets[:, :-1] = ids[:, 1:]  # next token within each sample; none after its last
    vc = cfg["model"]["vision"]
    n_mels = cfg["model"]["audio"]["num_mel_bins"]
    out = []
    for rows in split_even(a.rows, a.microbatches):
        s0, s1 = rows.start * S, rows.stop * S
        mine = lambda items: [p for s, p in items if s0 <= s < s1]  # noqa: E731
        ip, cp = mine(img_pos), mine(clip_pos)
        pos = [q - s0 * L for p in ip + cp for q in p]
        out.append(
            {
                "ids": ids[s0:s1].contiguous(),
                "targets": targets[s0:s1].contiguous(),
                "images": torch.randn(
                    len(ip), vc["num_channels"], vc["image_size"], vc["image_size"], generator=g
                )
                if ip
                else None,
                "clips": torch.randn(len(cp), n_mels, frames, generator=g) if cp else None,
                "pos": torch.tensor(pos, dtype=torch.long),
            }
        )
    return out


def forward_loss(model, stride, mb, n_targets):
    llm = model["llm"]
    n, L = mb["ids"].shape
    emb = llm.get_input_embeddings()(mb["ids"]).view(n * L, -1)  # (n*L, C)
    rows = []
    if mb["images"] is not None:
        h = model["vision"](pixel_values=mb["images"]).last_hidden_state  # (B_img, N, D)
        rows.append(model["vproj"](h).flatten(0, 1))
    if mb["clips"] is not None:
        h = model["audio"](mb["clips"]).last_hidden_state  # (B_clip, F/2, D)
        b, f, d = h.shape
        g = -(-f // stride)
        h = F.pad(h, (0, 0, 0, g * stride - f))  # zero frames complete the last group
        rows.append(model["aproj"](h.reshape(b, g, stride * d)).flatten(0, 1))
    if rows:
        emb = emb.index_copy(0, mb["pos"], torch.cat(rows))
    logits = llm(inputs_embeds=emb.view(n, L, -1)).logits  # (n, L, V)
    loss = F.cross_entropy(
        logits.flatten(0, 1), mb["targets"].flatten(), ignore_index=IGNORE, reduction="sum"
    )
    return loss / n_targets


def time_parts(model, batches, n_targets, reps):
    """Forward and backward of each big module alone, summed over the microbatches (median
    of `reps` after one warm-up): the vision encoder and the audio encoder (backward from
    a random output grad) and the LLM on the token ids with its loss. What the full step
    spends beyond their sum is the projectors, the embedding scatter and the glue."""
    llm = model["llm"]
    out = {}
    for name in ("vision", "audio", "llm"):
        fw, bw = [], []
        for _ in range(reps + 1):
            model.zero_grad(set_to_none=True)
            f = b = 0.0
            for mb in batches:
                t0 = time.perf_counter()
                if name == "vision":
                    if mb["images"] is None:
                        continue
                    y = model["vision"](pixel_values=mb["images"]).last_hidden_state
                elif name == "audio":
                    if mb["clips"] is None:
                        continue
                    y = model["audio"](mb["clips"]).last_hidden_state
                else:
                    logits = llm(input_ids=mb["ids"]).logits
                    y = F.cross_entropy(
                        logits.flatten(0, 1),
                        mb["targets"].flatten(),
                        ignore_index=IGNORE,
                        reduction="sum",
                    ) / n_targets
                t1 = time.perf_counter()
                dy = torch.randn_like(y) if y.dim() > 0 else None  # not timed
                t2 = time.perf_counter()
                y.backward(dy)
                t3 = time.perf_counter()
                f += t1 - t0
                b += t3 - t2
            fw.append(f)
            bw.append(b)
        out[name] = (statistics.median(fw[1:]), statistics.median(bw[1:]))
    model.zero_grad(set_to_none=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs/demo.toml"))
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE, as `braid --set`")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--samples-per-row", type=int, default=5)
    p.add_argument("--images", type=int, default=20)
    p.add_argument("--clips", type=int, default=20)
    p.add_argument("--frames", type=int, default=100, help="mel frames per clip")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--text-only", action="store_true", help="no images or clips (LLM only)")
    p.add_argument("--parts", type=int, default=0, help="also time each module alone, N reps")
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    cfg = load_config(a.config, a.set)
    model, stride = build_model(cfg, a.frames)
    model.train()
    vc = cfg["model"]["vision"]
    tok_img = (vc["image_size"] // vc["patch_size"]) ** 2
    tok_clip = -(-((a.frames + 1) // 2) // stride)
    batches = make_batches(a, cfg, tok_img, tok_clip, a.frames)
    n_targets = sum(int((b["targets"] != IGNORE).sum()) for b in batches)

    params = [q for q in model.parameters() if q.requires_grad]
    groups = [
        {"params": [q for q in params if q.dim() >= 2], "weight_decay": a.weight_decay},
        {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0},
    ]
    try:
        opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
        kind = "fused"
    except (RuntimeError, ValueError):
        opt = torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
        kind = "default"
    n_par = sum(q.numel() for q in params)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, {n_par} params, "
        f"AdamW {kind}, {len(batches)} microbatches, {a.rows * a.samples_per_row} x "
        f"{a.seq // a.samples_per_row} tokens, {n_targets} targets"
    )

    phases = []  # (zero, fwd, bwd, clip, optim) per step
    for i in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        fwd = bwd = 0.0
        loss_sum = 0.0
        for mb in batches:
            f0 = time.perf_counter()
            loss = forward_loss(model, stride, mb, n_targets)
            f1 = time.perf_counter()
            loss.backward()
            f2 = time.perf_counter()
            fwd += f1 - f0
            bwd += f2 - f1
            loss_sum += loss.item()
        t2 = time.perf_counter()
        norm = torch.nn.utils.clip_grad_norm_(params, a.clip)
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        ph = (t1 - t0, fwd, bwd, t3 - t2, t4 - t3)
        tag = "warmup" if i < a.warmup else "step"
        print(
            f"{tag} {i:3d}: {t4 - t0:.4f} s (fwd {fwd:.4f} bwd {bwd:.4f} clip {ph[3]:.4f} "
            f"optim {ph[4]:.4f})  loss {loss_sum:.4f} grad_norm {float(norm):.3f}",
            flush=True,
        )
        if i >= a.warmup:
            phases.append(ph)
    totals = [sum(ph) for ph in phases]
    med = [statistics.median(col) for col in zip(*phases)]
    print(f"RESULT torch {statistics.median(totals):.6f} {min(totals):.6f}")
    print("PHASES torch " + " ".join(f"{x:.6f}" for x in med))
    if a.parts:
        for name, (f, b) in time_parts(model, batches, n_targets, a.parts).items():
            print(f"PART torch {name} {f:.6f} {b:.6f}")


if __name__ == "__main__":
    main()
