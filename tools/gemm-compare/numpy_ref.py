#!/usr/bin/env python3
"""numpy f32 matmul GFLOP/s for the same shapes as gemm-compare: the BLAS baseline.

C (M, N) = A (M, K) @ B (K, N), row-major float32, values uniform in [-1, 1).
Thread count per run is set with threadpoolctl (it limits the BLAS numpy links).
Usage: python3 numpy_ref.py [--threads 1,2] [--budget-ms 400] [--shapes MxNxK,...]
Needs: pip install numpy threadpoolctl
"""

import argparse
import os
import statistics
import time

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

DEFAULT_SHAPES = (
    "256x256x256,1024x1024x1024,2048x2048x2048,4096x512x512,4096x2048x512,4096x512x2048"
)


def bench(m, n, k, budget_s):
    rng = np.random.default_rng(m * 31 + k)
    a = rng.uniform(-1.0, 1.0, (m, k)).astype(np.float32)  # (M, K)
    b = rng.uniform(-1.0, 1.0, (k, n)).astype(np.float32)  # (K, N)
    c = np.empty((m, n), dtype=np.float32)  # (M, N), preallocated like the Rust libs
    t0 = time.perf_counter()
    np.matmul(a, b, out=c)  # warmup
    warm = time.perf_counter() - t0
    # Correctness: a few entries against an f64 dot product.
    ref_err = max(
        abs(float(c[i, j]) - float(a[i].astype(np.float64) @ b[:, j].astype(np.float64)))
        for i, j in [((s * 7919 + 13) % m, (s * 104729 + 5) % n) for s in range(64)]
    )
    reps = min(200, max(5, round(budget_s / max(warm, 1e-9))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.matmul(a, b, out=c)
        times.append(time.perf_counter() - t0)
    flop = 2.0 * m * n * k
    return flop / statistics.median(times) / 1e9, flop / min(times) / 1e9, reps, ref_err


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--budget-ms", type=float, default=400.0)
    p.add_argument("--shapes", default=DEFAULT_SHAPES)
    args = p.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]

    print(f"numpy {np.__version__}")
    blas = np.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
    print(f"numpy build BLAS: {blas.get('name')} {blas.get('version')}")
    for info in threadpool_info():
        print(
            "runtime pool: {} {} {} arch={} num_threads={}".format(
                info.get("user_api"),
                info.get("internal_api"),
                info.get("version"),
                info.get("architecture"),
                info.get("num_threads"),
            )
        )
    for var in ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        print(f"{var}={os.environ.get(var, '<unset>')}")

    print("\n| M x N x K | threads | numpy median GFLOP/s | numpy best GFLOP/s | reps | max err vs f64 |")
    print("|---|---|---|---|---|---|")
    for m, n, k in shapes:
        for t in threads:
            with threadpool_limits(limits=t, user_api="blas"):
                med, best, reps, err = bench(m, n, k, args.budget_ms / 1e3)
            print(f"| {m}x{n}x{k} | {t} | {med:.1f} | {best:.1f} | {reps} | {err:.1e} |")


if __name__ == "__main__":
    main()
