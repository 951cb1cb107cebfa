"""Image preprocessing throughput on one core, Braid (Rust) vs PIL + numpy, on the same 640x480 JPEGs.

Usage: /work/venv/bin/python tools/bench_image_py.py [--n 200] [--reps 5] [--dir DIR] [--no-rust] [--hf]

Runs `cargo bench -p braid-dataloader --bench image` (which writes the JPEGs and times Braid's decode_image with
the CLIP preset), then the same pipeline in Python on the same files, and prints images/s and the ratio:
  open (from bytes in memory), convert("RGB"), resize shortest edge to 224 (bicubic, HF's output size), center
  crop 224 (HF's offsets), to float32, rescale 1/255, normalize with CLIP mean/std, HWC -> contiguous CHW.
No draft()/reduce shortcuts (they change the result). Pinned to one core with taskset when available, and numpy's
thread pools limited to 1. `--hf` also times transformers' CLIPImageProcessorPil per image, for reference.

Measured on the 2-core dev machine (shared, load ~3.5; medians of 5 passes over 200 images, three runs):
  braid 286-324 images/s (decode 2.6-2.8 ms + resize/crop/normalize 0.5 ms), PIL + numpy 88-133 images/s
  (decode 3.2 ms + 4.4 ms), transformers CLIPImageProcessorPil 108-124 images/s: ratio 2.2-3.7x. JPEG decoding
  (zune-jpeg vs libjpeg-turbo, about equal) is ~80% of braid's time; resize + normalize alone is ~9x PIL + numpy.
"""

import argparse
import io
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)
SIZE = 224


def preprocess(data: bytes) -> np.ndarray:
    im = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = im.size
    if w <= h:
        nw, nh = SIZE, int(SIZE * h / w)
    else:
        nw, nh = int(SIZE * w / h), SIZE
    im = im.resize((nw, nh), Image.BICUBIC)
    top, left = (nh - SIZE) // 2, (nw - SIZE) // 2
    x = np.asarray(im)[top : top + SIZE, left : left + SIZE]
    x = (x.astype(np.float32) * np.float32(1 / 255) - MEAN) / STD
    return np.ascontiguousarray(x.transpose(2, 0, 1))  # (3, 224, 224)


def timed(fn, files, reps):
    fn(files[0])
    rates = []
    for _ in range(reps):
        t = time.perf_counter()
        for b in files:
            fn(b)
        rates.append(len(files) / (time.perf_counter() - t))
    return statistics.median(rates)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=os.path.join(ROOT, "target", "bench-images"))
    ap.add_argument("--no-rust", action="store_true", help="only Python, on existing files in --dir")
    ap.add_argument("--hf", action="store_true", help="also time transformers' CLIPImageProcessorPil")
    args = ap.parse_args()

    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    rust = None
    if not args.no_rust:
        cmd = pin + ["cargo", "bench", "-q", "-p", "braid-dataloader", "--bench", "image", "--"]
        cmd += ["--dir", args.dir, "--n", str(args.n), "--reps", str(args.reps)]
        out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
        print(out.strip())
        rust = float(re.search(r"BRAID_IMAGES_PER_S ([0-9.]+)", out).group(1))

    names = sorted(f for f in os.listdir(args.dir) if f.endswith(".jpg"))[: args.n]
    files = [open(os.path.join(args.dir, f), "rb").read() for f in names]
    if not files:
        sys.exit(f"no .jpg files in {args.dir}")
    py = timed(preprocess, files, args.reps)
    print(f"python PIL {Image.__version__} + numpy {np.__version__}: {py:.1f} images/s/core ({1e3 / py:.3f} ms/image)")
    dec = timed(lambda b: Image.open(io.BytesIO(b)).convert("RGB").load(), files, args.reps)
    print(f"  split: decode+convert {1e3 / dec:.3f} ms/image, the rest {1e3 / py - 1e3 / dec:.3f} ms/image")
    if args.hf:
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        proc = CLIPImageProcessorPil()
        hf = timed(lambda b: proc(Image.open(io.BytesIO(b)), return_tensors="np"), files, max(1, args.reps // 2))
        print(f"transformers CLIPImageProcessorPil: {hf:.1f} images/s/core ({1e3 / hf:.3f} ms/image)")
    if rust is not None:
        print(f"ratio braid / python: {rust / py:.2f}x per core")
        if args.hf:
            print(f"ratio braid / transformers CLIPImageProcessorPil: {rust / hf:.2f}x per core")


if __name__ == "__main__":
    main()
