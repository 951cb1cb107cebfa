#!/usr/bin/env python3
"""The PyTorch side of the GPU benchmark (docs/benchmarks.md): what a user would otherwise run.

One training step of the LLM of configs/gpu-1b.toml (a Llama-3.2-1B shape) as
transformers' LlamaForCausalLM: f32 master weights under bf16 autocast, SDPA attention
(flash on the GPU), fused AdamW, grad clipping at 1.0, ROWS x SEQ tokens a step in
MICROBATCHES microbatches; eager and under torch.compile. Also attention forward +
backward at T = SEQ against scaled_dot_product_attention, and a bf16 GEMM against
torch.matmul. Prints a JSON line after each part, the last holding all (medians over the
timed steps).

  python3 tools/gpu/bench_llm_torch.py --device cuda            # on the H200
  python3 tools/gpu/bench_llm_torch.py --device cpu --tiny      # a smoke test anywhere

MFU = (6 x params x tokens + attention FLOPs) / step time / peak, with attention FLOPs
12 x layers x heads x head_dim x sum over sequences of T^2 / 2 (causal) — forward and
backward, the same count docs/benchmarks.md uses for Braid — and peak 989 TFLOP/s (the
H200's dense bf16).
"""

import argparse
import json
import statistics
import time

import torch

H200_BF16_PEAK = 989e12

LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
TINY = dict(LLAMA_1B, vocab_size=512, hidden_size=128, intermediate_size=256,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, steps, warmup):
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return times


def llm_step_bench(a, device, shape, compile_model):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(a.seed)
    cfg = LlamaConfig(**shape, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(device)  # f32 master weights
    params = sum(p.numel() for p in model.parameters())
    fwd = torch.compile(model) if compile_model else model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    rows_per_mb = a.rows // a.microbatches
    ids = torch.randint(0, shape["vocab_size"], (a.microbatches, rows_per_mb, a.seq), device=device)
    amp = device.type == "cuda"

    def step():
        opt.zero_grad(set_to_none=True)
        for m in range(a.microbatches):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                out = fwd(input_ids=ids[m], labels=ids[m])
            (out.loss / a.microbatches).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = timed(step, device, a.steps, a.warmup)
    med = statistics.median(times)
    tokens = a.rows * a.seq
    heads, hd, layers = shape["num_attention_heads"], shape["head_dim"], shape["num_hidden_layers"]
    attn_flops = 12 * layers * heads * hd * a.rows * a.seq * a.seq / 2
    flops = 6 * params * tokens + attn_flops
    r = {
        "params": params,
        "tokens_per_step": tokens,
        "step_s_median": med,
        "step_s_min": min(times),
        "tokens_per_s": tokens / med,
        "tflops": flops / med / 1e12,
        "mfu": flops / med / H200_BF16_PEAK,
    }
    if device.type == "cuda":
        r["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del model, opt, fwd
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return r


def attention_bench(a, device, shape):
    import torch.nn.functional as F

    heads, kv, hd = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    b = a.rows
    q = torch.randn(b, heads, a.seq, hd, device=device, dtype=dt, requires_grad=True)
    k = torch.randn(b, kv, a.seq, hd, device=device, dtype=dt, requires_grad=True)
    v = torch.randn(b, kv, a.seq, hd, device=device, dtype=dt, requires_grad=True)
    g = torch.randn(b, heads, a.seq, hd, device=device, dtype=dt)

    def run():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o.backward(g)

    times = timed(run, device, a.steps, a.warmup)
    med = statistics.median(times)
    flops = 4 * b * heads * hd * a.seq * a.seq / 2 * 3.5  # fwd 2 GEMMs, bwd 5: 3.5x fwd
    return {"shape": [b, heads, kv, a.seq, hd], "causal": True, "fwd_bwd_s_median": med,
            "tflops": flops / med / 1e12}


def gemm_bench(a, device):
    n = a.gemm
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(n, n, device=device, dtype=dt)
    y = torch.randn(n, n, device=device, dtype=dt)
    times = timed(lambda: torch.matmul(x, y), device, a.steps, a.warmup)
    med = statistics.median(times)
    return {"n": n, "dtype": str(dt), "s_median": med, "tflops": 2 * n**3 / med / 1e12}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a toy shape (smoke test on a CPU)")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--gemm", type=int, default=8192)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-compile", action="store_true")
    a = p.parse_args()
    device = torch.device(a.device)
    shape = TINY if a.tiny else LLAMA_1B
    out = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "config": {"rows": a.rows, "seq": a.seq, "microbatches": a.microbatches, "tiny": a.tiny},
    }
    # One JSON line after each section, the newest holding all so far: a run cut short by
    # its time limit still reports what finished. torch.compile last: it takes longest.
    sections = [
        ("eager", lambda: llm_step_bench(a, device, shape, False)),
        ("attention", lambda: attention_bench(a, device, shape)),
        ("gemm", lambda: gemm_bench(a, device)),
    ]
    if not a.no_compile:
        sections.append(("compile", lambda: llm_step_bench(a, device, shape, True)))
    for name, bench in sections:
        try:
            out[name] = bench()
        except Exception as e:  # noqa: BLE001 - reported, not fatal: the others still run
            out[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        print(json.dumps(out), flush=True)

if __name__ == "__main__":
    main()
