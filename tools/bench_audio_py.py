"""The Python audio pipeline a user would write, on the WAVs that dataloader/benches/audio.rs
generates, on ONE core: decode -> mono -> resample 44.1 kHz -> 16 kHz -> 80-bin Whisper log-mel.

    /work/venv/bin/python tools/bench_audio_py.py target/audio-bench [--clips N] [--repeats R]

or let the Rust bench run it: BRAID_BENCH_PYTHON=/work/venv/bin/python cargo bench -p
braid-dataloader --bench audio. Needs numpy, soundfile, transformers; librosa (soxr) and/or scipy
for resampling (pipelines whose package is missing are skipped). Prints `RESULT <name>
<wall clips/s> <cpu clips/s>` lines (medians over the repeats; CPU = process time, all
threads) for the Rust bench to compare against.

Pipelines:
  librosa_load+fe_nopad    librosa.load(path, sr=16000) (soundfile + mean downmix + soxr "HQ")
                           + WhisperFeatureExtractor(padding="do_not_pad"): the same work as Rust.
  librosa_load+fe_pad30s   the same with the extractor's default padding to 30 s, as most
                           Whisper code calls it (3x the mel frames of a 10 s clip).
  soundfile+scipy+fe_nopad soundfile.read + mean + scipy.signal.resample_poly(160, 441)
                           + WhisperFeatureExtractor(padding="do_not_pad").
"""

import argparse
import os
import statistics
import sys
import time

for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import numpy as np  # noqa: E402
import soundfile as sf  # noqa: E402
from transformers import WhisperFeatureExtractor  # noqa: E402

try:
    import torch  # noqa: E402

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
except ImportError:  # the extractor then uses its numpy path
    torch = None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--clips", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    files = [os.path.join(args.dir, f"clip_{i:03d}.wav") for i in range(args.clips)]
    for f in files:
        if not os.path.exists(f):
            sys.exit(f"{f} missing: run the Rust bench first (it writes the clips)")
    fe = WhisperFeatureExtractor(feature_size=80)

    def mel_nopad(x):
        return fe(x, sampling_rate=16000, padding="do_not_pad", return_tensors="np")[
            "input_features"
        ][0]

    def mel_pad(x):
        return fe(x, sampling_rate=16000, return_tensors="np")["input_features"][0]

    pipelines = {}
    try:
        import librosa

        def librosa_nopad(path):
            x, _ = librosa.load(path, sr=16000, mono=True)
            return mel_nopad(x)

        def librosa_pad(path):
            x, _ = librosa.load(path, sr=16000, mono=True)
            return mel_pad(x)

        pipelines["librosa_load+fe_nopad"] = librosa_nopad
        pipelines["librosa_load+fe_pad30s"] = librosa_pad
    except ImportError:
        print("librosa not installed: skipping the librosa pipelines")
    try:
        from scipy.signal import resample_poly

        def scipy_nopad(path):
            x, sr = sf.read(path, dtype="float32", always_2d=True)
            x = x.mean(axis=1)
            g = np.gcd(sr, 16000)
            x = resample_poly(x, 16000 // g, sr // g).astype(np.float32)
            return mel_nopad(x)

        pipelines["soundfile+scipy+fe_nopad"] = scipy_nopad
    except ImportError:
        print("scipy not installed: skipping the scipy pipeline")

    torch_note = f"torch {torch.__version__} (1 thread)" if torch else "numpy path"
    print(f"python {sys.version.split()[0]}, WhisperFeatureExtractor via {torch_note}")
    for name, fn in pipelines.items():
        for f in files[:2]:  # warm-up
            fn(f)
        times, cpus = [], []
        frames = 0
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            for f in files:
                frames = fn(f).shape[-1]
            times.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        t, c = statistics.median(times), statistics.median(cpus)
        n = len(files)
        print(f"{name}: {1e3 * t / n:.2f} ms/clip wall, {1e3 * c / n:.2f} ms/clip CPU (all "
              f"threads), {frames} mel frames per clip")
        print(f"RESULT {name} {n / t:.3f} {n / c:.3f}")


if __name__ == "__main__":
    main()
