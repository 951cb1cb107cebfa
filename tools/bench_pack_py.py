#!/usr/bin/env python3
"""Python side of dataloader/benches/pack.rs: best-fit decreasing as a user would write it.

Reads little-endian u32 sample lengths written by the Rust bench (same generator, same seed, lengths
already clipped to the row length) and packs them with a textbook best-fit decreasing: sort longest
first, keep the bins' remaining capacities in a sorted list, `bisect` for the fullest bin that still
fits. Prints one JSON line per file: {"file", "n", "seconds" (median), "packs", "fill"}.

    python tools/bench_pack_py.py --cap 4096 [--runs 3] FILE...
"""
import argparse
import bisect
import json
import statistics
import sys
import time
from array import array


def best_fit_decreasing(lengths, cap):
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    free = []  # sorted list of (remaining, bin id)
    bins = []
    for i in order:
        n = lengths[i]
        if n <= 0 or n > cap:
            continue
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            rem, b = free.pop(k)
        else:
            rem, b = cap, len(bins)
            bins.append([])
        bins[b].append(i)
        if rem - n > 0:
            bisect.insort(free, (rem - n, b))
    return bins


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cap", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()
    for f in a.files:
        lengths = array("I")
        with open(f, "rb") as fh:
            lengths.frombytes(fh.read())
        if sys.byteorder != "little":
            lengths.byteswap()
        lengths = lengths.tolist()
        times, bins = [], None
        for _ in range(a.runs):
            t = time.perf_counter()
            bins = best_fit_decreasing(lengths, a.cap)
            times.append(time.perf_counter() - t)
        used = sum(n for n in lengths if 0 < n <= a.cap)
        print(json.dumps({"file": f, "n": len(lengths), "seconds": statistics.median(times),
                          "packs": len(bins), "fill": used / (len(bins) * a.cap)}), flush=True)


if __name__ == "__main__":
    main()
