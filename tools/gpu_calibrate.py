#!/usr/bin/env python3
"""Measures one NVIDIA GPU for the planner's cost model, with PyTorch (cuBLAS, flash SDPA).

    python3 tools/gpu_calibrate.py --out h200.json [--quick]

What it times (CUDA events; each figure the median of 5 timed loops after warm-up, each
loop long enough to hide launch gaps the way a training step's back-to-back kernels do):

  gemm       bf16 x @ w for token counts M and the weight shapes of the reference
             workloads' blocks (7B, 70B, ViT-L, Whisper, their TP shards): the achieved
             rate as a function of 2*M*K*N, which is the cluster file's `matmul` table
  attention  flash SDPA (forced), forward and forward+backward, at the encoders' and the
             LLMs' sequence lengths: attention's share of the matmul rate
  block      whole pre-norm transformer blocks (a stack of 4, per block), forward and
             forward+backward: Llama
             (RMSNorm, RoPE, causal SDPA, SwiGLU) and CLIP/Whisper (LayerNorm, SDPA,
             GELU MLP) at the reference models' sizes and TP shards; what the cost model
             must predict (balancer/tests/gpu_calibration.rs compares)
  copy       device-to-device copy bandwidth

Writes one JSON object; `braid` reads nothing from it at run time. The committed copy
(balancer/tests/fixtures/h200.json) is the source of the h100/h200 presets' tables.
"""

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

DEV = "cuda"
DT = torch.bfloat16
DEPTH = 4  # blocks per timed stack


def timed(fn, min_s=0.02, loops=5):
    """Median seconds per call of fn over `loops` timed loops of n calls each."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = max(time.perf_counter() - t0, 1e-6)
    n = max(1, min(1000, math.ceil(min_s / once)))
    out = []
    for _ in range(loops):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / n)
    return statistics.median(out)


def gemms(quick):
    ms = [128, 512, 2048, 8192] if quick else [128, 512, 2048, 8192, 32768]
    # (K, N): 7B qkv/o, MLP up/down and its TP-2/4 shards; ViT-L/Whisper-medium; 70B and
    # its TP-8 shards; the 6B ViT.
    kn = [
        (4096, 4096), (4096, 11008), (11008, 4096), (4096, 5504), (4096, 2752),
        (1024, 1024), (1024, 4096), (4096, 1024),
        (8192, 8192), (8192, 28672), (8192, 3584), (3584, 8192),
        (3200, 12800), (1280, 5120),
    ]
    if quick:
        kn = kn[:6]
    rows = []
    for m in ms:
        for k, n in kn:
            x = torch.randn(m, k, device=DEV, dtype=DT)
            w = torch.randn(k, n, device=DEV, dtype=DT)
            s = timed(lambda: x @ w)
            flops = 2.0 * m * k * n
            rows.append({"m": m, "k": k, "n": n, "flops": flops, "s": s,
                         "tflops": flops / s / 1e12})
            print(f"gemm {m:6d} x {k:5d} x {n:5d}  {flops:9.3e} FLOP  "
                  f"{flops / s / 1e12:7.1f} TFLOP/s", flush=True)
            del x, w
    return rows


def attn_flops(b, h, s, d, causal):
    return 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)


def attention(quick):
    cases = [
        # (name, B, H, S, D, causal)
        ("vit-l", 32, 16, 577, 64, False),
        ("whisper-medium", 8, 16, 1500, 64, False),
        ("llm-7b", 2, 32, 4096, 128, True),
        ("llm-7b-short", 8, 32, 1024, 128, True),
        ("llm-70b-tp8", 1, 8, 8192, 128, True),
        ("vit-6b", 8, 32, 256, 100, False),
    ]
    if quick:
        cases = cases[:3]
    rows = []
    for name, b, h, s, d, causal in cases:
        q, k, v = (torch.randn(b, h, s, d, device=DEV, dtype=DT, requires_grad=True)
                   for _ in range(3))
        g = torch.randn(b, h, s, d, device=DEV, dtype=DT)
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))

                def fb():
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    o.backward(g)
                both = timed(fb)
        except RuntimeError as e:  # head_dim 100 has no flash kernel on some builds
            print(f"attention {name}: {e}", flush=True)
            continue
        fl = attn_flops(b, h, s, d, causal)
        rows.append({"name": name, "b": b, "heads": h, "s": s, "d": d, "causal": causal,
                     "fwd_s": fwd, "fwdbwd_s": both, "fwd_flops": fl,
                     "fwd_tflops": fl / fwd / 1e12,
                     "bwd_tflops": 2.5 * fl / max(both - fwd, 1e-9) / 1e12})
        print(f"attention {name:16s} fwd {fl / fwd / 1e12:6.1f} TFLOP/s, "
              f"fwd+bwd {both * 1e3:8.3f} ms", flush=True)
    return rows


def rope(x, cos, sin):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)


class Block(torch.nn.Module):
    """A pre-norm block: llama (RMSNorm, RoPE, causal, SwiGLU) or encoder (LayerNorm,
    bidirectional, GELU)."""

    def __init__(self, hidden, heads, kv_heads, head_dim, ffn, llama):
        super().__init__()
        self.h, self.kv, self.d, self.llama = heads, kv_heads, head_dim, llama
        q, kv = heads * head_dim, kv_heads * head_dim
        self.n1 = torch.nn.RMSNorm(hidden) if llama else torch.nn.LayerNorm(hidden)
        self.n2 = torch.nn.RMSNorm(hidden) if llama else torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, q + 2 * kv, bias=not llama)
        self.o = torch.nn.Linear(q, hidden, bias=not llama)
        self.up = torch.nn.Linear(hidden, (2 if llama else 1) * ffn, bias=not llama)
        self.down = torch.nn.Linear(ffn, hidden, bias=not llama)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).split(
            [self.h * self.d, self.kv * self.d, self.kv * self.d], -1)
        q = q.view(b, s, self.h, self.d).transpose(1, 2)
        k = k.view(b, s, self.kv, self.d).transpose(1, 2)
        v = v.view(b, s, self.kv, self.d).transpose(1, 2)
        if self.llama:
            q, k = rope(q, cos, sin), rope(k, cos, sin)
        if self.kv != self.h:
            k = k.repeat_interleave(self.h // self.kv, 1)
            v = v.repeat_interleave(self.h // self.kv, 1)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            a = F.scaled_dot_product_attention(q, k, v, is_causal=self.llama)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        y = self.n2(x)
        if self.llama:
            g, u = self.up(y).chunk(2, -1)
            y = F.silu(g) * u
        else:
            y = F.gelu(self.up(y), approximate="tanh")
        return x + self.down(y)


def blocks(quick):
    # (name, hidden, heads, kv_heads, head_dim, ffn, llama, sequences, length)
    cases = [
        ("7b tp1 1x4096", 4096, 32, 32, 128, 11008, True, 1, 4096),
        ("7b tp1 2x2048", 4096, 32, 32, 128, 11008, True, 2, 2048),
        ("7b tp1 4x4096", 4096, 32, 32, 128, 11008, True, 4, 4096),
        ("7b tp2 1x4096", 4096, 16, 16, 128, 5504, True, 1, 4096),
        ("7b tp4 1x4096", 4096, 8, 8, 128, 2752, True, 1, 4096),
        ("7b tp4 4x4096", 4096, 8, 8, 128, 2752, True, 4, 4096),
        ("7b tp1 1x1024", 4096, 32, 32, 128, 11008, True, 1, 1024),
        ("70b tp8 1x8192", 8192, 8, 1, 128, 3584, True, 1, 8192),
        ("70b tp4 1x8192", 8192, 16, 2, 128, 7168, True, 1, 8192),
        ("70b tp1 1x2048", 8192, 64, 8, 128, 28672, True, 1, 2048),
        ("vit-l 5x577", 1024, 16, 16, 64, 4096, False, 5, 577),
        ("vit-l 40x577", 1024, 16, 16, 64, 4096, False, 40, 577),
        ("vit-l tp4 40x577", 1024, 4, 4, 64, 1024, False, 40, 577),
        ("whisper-m 2x1500", 1024, 16, 16, 64, 4096, False, 2, 1500),
        ("whisper-m 8x1500", 1024, 16, 16, 64, 4096, False, 8, 1500),
        ("whisper-l 4x1500", 1280, 20, 20, 64, 5120, False, 4, 1500),
        ("vit-6b 8x1024", 3200, 32, 32, 100, 12800, False, 8, 1024),
        ("vit-6b tp4 8x1024", 3200, 8, 8, 100, 3200, False, 8, 1024),
    ]
    if quick:
        cases = cases[:3] + cases[10:12]
    rows = []
    for name, hid, h, kv, d, f, llama, b, s in cases:
        torch.manual_seed(0)
        # A stack of DEPTH blocks, times divided by DEPTH: one backward() call per stack,
        # as in a model, so autograd's fixed start-up cost is not charged to one block.
        stack = [Block(hid, h, kv, d, f, llama).to(DEV, DT) for _ in range(DEPTH)]

        def blk(x, cos, sin):
            for b_ in stack:
                x = b_(x, cos, sin)
            return x
        x = torch.randn(b, s, hid, device=DEV, dtype=DT, requires_grad=True)
        pos = torch.arange(s, device=DEV, dtype=torch.float32)[:, None]
        inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device=DEV, dtype=torch.float32) / d)
        cos, sin = (t(pos * inv).to(DT) for t in (torch.cos, torch.sin))
        g = torch.randn(b, s, hid, device=DEV, dtype=DT)
        try:
            with torch.no_grad():
                fwd = timed(lambda: blk(x, cos, sin))

            def fb():
                blk(x, cos, sin).backward(g)
            both = timed(fb)
        except RuntimeError as e:
            print(f"block {name}: {e}", flush=True)
            continue
        fwd, both = fwd / DEPTH, both / DEPTH
        rows.append({"name": name, "hidden": hid, "heads": h, "kv_heads": kv,
                     "head_dim": d, "ffn": f, "llama": llama, "seqs": b, "len": s,
                     "depth": DEPTH, "fwd_s": fwd, "fwdbwd_s": both})
        print(f"block {name:20s} fwd {fwd * 1e3:8.3f} ms  fwd+bwd {both * 1e3:8.3f} ms",
              flush=True)
        del stack, x, g
    return rows


def copy_bw():
    n = 1 << 30  # 2 GiB of bf16
    a = torch.empty(n, device=DEV, dtype=DT)
    b = torch.empty_like(a)
    s = timed(lambda: b.copy_(a))
    return {"bytes": 2 * n, "s": s, "gbs_read_write": 2 * 2 * n / s / 1e9}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_calibrate: no CUDA device visible to torch")
    props = torch.cuda.get_device_properties(0)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    res = {"device": props.name, "sms": props.multi_processor_count,
           "memory_gib": props.total_memory / 2**30, "torch": torch.__version__,
           "cuda": torch.version.cuda, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(res), flush=True)
    for key, fn in (("gemm", gemms), ("attention", attention), ("block", blocks)):
        try:
            res[key] = fn(a.quick)
        except Exception as e:  # keep what the others measured
            res[key + "_error"] = repr(e)
            print(f"{key}: {e!r}", flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    res["copy"] = copy_bw()
    print(f"copy {res['copy']['gbs_read_write']:.0f} GB/s (read + write)", flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
