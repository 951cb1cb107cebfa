#!/usr/bin/env python3
"""Braid's CPU kernels side by side with PyTorch eager on the same shapes, in one run.

    python3 tools/bench_vs_torch.py [--threads 1 2]

Needs torch (`pip install torch`). For each thread count it runs Braid's benchmarks
(`cargo bench`, with RAYON_NUM_THREADS) and the same work in PyTorch
(`torch.set_num_threads`), then prints both and the ratio torch_time / braid_time
(> 1: Braid is faster). Every figure is a median of several timed runs after warm-up.

Cases, matching the Rust benches:
  gemm      f32 1024^3 matmul                      (kernels/benches/gemm.rs)
  attention causal, T=2048, NH=NKV=8, HS=64, fwd and bwd (kernels/benches/kernels.rs)
            torch: F.scaled_dot_product_attention(is_causal=True)
  act       activations on 2^20 values of N(0, 2), forward and backward
            (kernels/benches/kernels.rs): exact GELU (Whisper), tanh GELU (SigLIP),
            SiLU, SwiGLU silu(g) * u; torch: F.gelu, F.gelu(approximate="tanh"),
            F.silu, autograd for the backward
  ce        cross-entropy forward + backward, N = 2048 tokens, V = 8192
            (kernels/benches/kernels.rs; torch: F.cross_entropy(reduction="sum")
            scaled by 1/N, autograd)
  block     pre-norm block, T=4096 as 4 x 1024 causal sequences, C=512, NH=8, HS=64,
            RMSNorm, RoPE, SwiGLU ff=1408, fwd and bwd (nn/benches/nn.rs)
            torch: the same block in nn.Module form, batch (4, 1024) with causal SDPA
            (Braid runs it packed/varlen; the FLOPs are identical)
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent


def median_ms(fn, runs=5, warmup=1):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def torch_gemm_gflops():
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    ms = median_ms(lambda: torch.matmul(a, b), runs=9, warmup=2)
    return 2 * 1024**3 / (ms * 1e-3) / 1e9


def torch_attention():
    t, nh, hs = 2048, 8, 64
    q, k, v = (torch.randn(1, nh, t, hs, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, nh, t, hs)
    fwd = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def fwd_bwd():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(dout)

    total = median_ms(fwd_bwd)
    return fwd, total - fwd


def torch_activations():
    """{name: (fwd ms, bwd ms)} for the cases of Braid's bench_activations."""
    n = 1 << 20
    x = (torch.randn(n) * 2).requires_grad_()
    up = torch.randn(n).requires_grad_()
    dy = torch.randn(n)
    cases = {
        "gelu_erf": lambda: F.gelu(x),
        "gelu_tanh": lambda: F.gelu(x, approximate="tanh"),
        "silu": lambda: F.silu(x),
        "swiglu": lambda: F.silu(x) * up,
    }
    out = {}
    for name, f in cases.items():
        fwd = median_ms(f, runs=15, warmup=2)
        total = median_ms(lambda: f().backward(dy), runs=15, warmup=2)
        out[name] = (fwd, total - fwd)
    return out


def torch_cross_entropy():
    n, v = 2048, 8192
    logits = (torch.randn(n, v) * 2).requires_grad_()
    targets = torch.tensor([i * 7919 % v for i in range(n)])

    def fwd_bwd():
        loss = F.cross_entropy(logits, targets, reduction="sum") / n
        loss.backward()

    return median_ms(fwd_bwd, runs=11, warmup=2)


class Block(nn.Module):
    """Llama-style pre-norm block, as braid_nn::TransformerBlock is configured in
    nn/benches/nn.rs."""

    def __init__(self, c=512, nh=8, hs=64, ff=1408):
        super().__init__()
        self.nh, self.hs = nh, hs
        self.input_layernorm = nn.RMSNorm(c, eps=1e-6)
        self.q_proj = nn.Linear(c, nh * hs, bias=False)
        self.k_proj = nn.Linear(c, nh * hs, bias=False)
        self.v_proj = nn.Linear(c, nh * hs, bias=False)
        self.o_proj = nn.Linear(nh * hs, c, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(c, eps=1e-6)
        self.gate_proj = nn.Linear(c, ff, bias=False)
        self.up_proj = nn.Linear(c, ff, bias=False)
        self.down_proj = nn.Linear(ff, c, bias=False)

    @staticmethod
    def rope(x, cos, sin):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(self, x, cos, sin):
        b, t, c = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, self.nh, self.hs).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.nh, self.hs).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.nh, self.hs).transpose(1, 2)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, t, c))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def torch_block():
    b, t, c, hs = 4, 1024, 512, 64
    block = Block()
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, hs, 2).float() / hs))
    ang = torch.arange(t).float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1), torch.cat((ang.sin(), ang.sin()), -1)
    x = torch.randn(b, t, c, requires_grad=True)
    dy = torch.randn(b, t, c)
    fwd = median_ms(lambda: block(x, cos, sin))

    def fwd_bwd():
        block(x, cos, sin).backward(dy)

    total = median_ms(fwd_bwd)
    return fwd, total - fwd


def braid(bench_args, threads):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    out = subprocess.run(
        ["cargo", "bench", "-q", *bench_args],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True,
    ).stdout
    vals = {}
    for line in out.splitlines():
        if line.startswith("BENCH "):
            for k, v in re.findall(r"(\w+)=([0-9.eE+-]+)", line):
                vals[k] = float(v)
    return vals


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus", file=sys.stderr)
    print("building Braid's benches (cargo bench --no-run) ...", file=sys.stderr)
    subprocess.run(["cargo", "bench", "-q", "--no-run", "-p", "braid-kernels", "-p", "braid-nn"],
                   cwd=ROOT, check=True)
    rows = []
    for th in args.threads:
        torch.set_num_threads(th)
        g = braid(["-p", "braid-kernels", "--bench", "gemm"], th)
        a = braid(["-p", "braid-kernels", "--bench", "kernels"], th)
        b = braid(["-p", "braid-nn", "--bench", "nn"], th)
        # The gemm bench measures both thread counts itself; pick the one asked for.
        braid_gemm = g["gemm1024_t1_gflops"] if th == 1 else g["gemm1024_t2_gflops"]
        tg = torch_gemm_gflops()
        ta_f, ta_b = torch_attention()
        tb_f, tb_b = torch_block()
        tact = torch_activations()
        tce = torch_cross_entropy()
        # (case, unit, braid, torch, torch/braid as a speed ratio: > 1 means Braid faster)
        rows += [
            (th, "gemm 1024^3", "GFLOP/s", braid_gemm, tg, braid_gemm / tg),
            (th, "attention fwd", "ms", a["attention_fwd_ms"], ta_f, ta_f / a["attention_fwd_ms"]),
            (th, "attention bwd", "ms", a["attention_bwd_ms"], ta_b, ta_b / a["attention_bwd_ms"]),
        ]
        for name, (tf, tbw) in tact.items():
            bf, bb = a[f"{name}_fwd_ms"], a[f"{name}_bwd_ms"]
            rows += [
                (th, f"{name} fwd", "ms", bf, tf, tf / bf),
                (th, f"{name} bwd", "ms", bb, tbw, tbw / bb),
            ]
        rows.append((th, "ce fwd+bwd", "ms", a["cross_entropy_ms"], tce, tce / a["cross_entropy_ms"]))
        rows += [
            (th, "block fwd", "ms", b["block_fwd_ms"], tb_f, tb_f / b["block_fwd_ms"]),
            (th, "block bwd", "ms", b["block_bwd_ms"], tb_b, tb_b / b["block_bwd_ms"]),
        ]
    print(f"{'threads':>7}  {'case':<16} {'unit':<8} {'braid':>10} {'torch':>10} {'braid speed / torch':>20}")
    for th, case, unit, bv, tv, ratio in rows:
        print(f"{th:>7}  {case:<16} {unit:<8} {bv:>10.2f} {tv:>10.2f} {ratio:>19.2f}x")


if __name__ == "__main__":
    main()
