"""Python counterparts of dataloader/benches/loader.rs, on the same files and the same shards, ONE core.

    /work/venv/bin/python tools/bench_loader_py.py target/bench-loader [--reps 5]

or let the Rust bench run it: BRAID_BENCH_PYTHON=/work/venv/bin/python cargo bench -p braid-dataloader --bench loader

Pipelines (each produces what Braid's loader yields: CLIP-224 normalized (3, 224, 224) f32 pixels, or an
80-bin Whisper log-mel of the whole clip):
  raw_files/pil+numpy          images: PIL decode of the original JPEG, shortest-edge bicubic resize, centre
                               crop, rescale + normalize in numpy (tools/bench_image_py.py's `preprocess`):
                               what a user without a packed dataset runs every epoch.
  raw_files/librosa+whisper_fe audio: librosa.load(sr=16000) (soundfile + soxr) + WhisperFeatureExtractor
                               (padding="do_not_pad", torch STFT), tools/bench_audio_py.py's pipeline.
  raw_files/librosa+librosa_mel audio: librosa.load(sr=16000) + librosa.feature.melspectrogram (n_fft 400,
                               hop 160, 80 Slaney mels, reflect padding) + Whisper's log10 / clamp / scaling:
                               the "librosa-style mel" pipeline the issue names.
  same_shards/pyarrow+numpy    images: read Braid's shards with pyarrow, the stored (224, 224, 3) RGB8 ->
                               normalize in numpy -> CHW: the same work Braid's loader does.
  same_shards/pyarrow+whisper_fe audio: read the shards, stored 16 kHz s16 PCM -> float32 ->
                               WhisperFeatureExtractor: the same work Braid's loader does.
Prints `RESULT <pipeline> <images|audio> <items per wall s> <items per CPU s>` (medians over the reps).
"""

import argparse
import glob
import json
import os
import statistics
import sys
import time

for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(var, "1")

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_image_py import MEAN, STD, preprocess  # noqa: E402

try:
    import torch  # noqa: E402

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
except ImportError:
    torch = None


def timed(fn, reps):
    fn()  # warm-up
    walls, cpus, n = [], [], 0
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        n = fn()
        walls.append(n / (time.perf_counter() - t0))
        cpus.append(n / (time.process_time() - c0))
    return statistics.median(walls), statistics.median(cpus)


def manifest_paths(root, name):
    out = []
    with open(os.path.join(root, f"{name}.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            out.append(os.path.join(root, rec["messages"][0]["content"][0]["path"]))
    return out


def shard_rows(folder):
    """Every row's media list, read the way a pyarrow user would: one table per shard."""
    for path in sorted(glob.glob(os.path.join(folder, "shard-*.parquet"))):
        yield pq.read_table(path, columns=["images", "audio"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})
    root = args.dir
    images = [open(p, "rb").read() for p in manifest_paths(root, "images")]
    clips = manifest_paths(root, "audio")

    def raw_images():
        for b in images:
            preprocess(b)
        return len(images)

    size = 224

    def shard_images():
        n = 0
        for t in shard_rows(os.path.join(root, "packed-images")):
            for row in t.column("images").to_pylist():
                for im in row:
                    x = np.frombuffer(im["data"], np.uint8).reshape(size, size, 3)
                    x = (x.astype(np.float32) * np.float32(1 / 255) - MEAN) / STD
                    np.ascontiguousarray(x.transpose(2, 0, 1))
                    n += 1
        return n

    r = timed(raw_images, args.reps)
    print(f"RESULT raw_files/pil+numpy images {r[0]:.3f} {r[1]:.3f}")
    r = timed(shard_images, args.reps)
    print(f"RESULT same_shards/pyarrow+numpy images {r[0]:.3f} {r[1]:.3f}")

    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=80)

    def mel(x):
        return fe(x, sampling_rate=16000, padding="do_not_pad", return_tensors="np")["input_features"][0]

    try:
        import librosa

        def raw_audio():
            for p in clips:
                x, _ = librosa.load(p, sr=16000, mono=True)
                mel(x)
            return len(clips)

        r = timed(raw_audio, args.reps)
        print(f"RESULT raw_files/librosa+whisper_fe audio {r[0]:.3f} {r[1]:.3f}")

        def librosa_mel(x):
            s = librosa.feature.melspectrogram(
                y=x, sr=16000, n_fft=400, hop_length=160, n_mels=80, power=2.0, center=True,
                pad_mode="reflect", norm="slaney", htk=False, fmin=0.0, fmax=8000.0)
            m = np.log10(np.maximum(s[:, :-1], 1e-10))
            return (np.maximum(m, m.max() - 8.0) + 4.0) / 4.0

        def raw_audio_librosa():
            for p in clips:
                x, _ = librosa.load(p, sr=16000, mono=True)
                librosa_mel(x)
            return len(clips)

        r = timed(raw_audio_librosa, args.reps)
        print(f"RESULT raw_files/librosa+librosa_mel audio {r[0]:.3f} {r[1]:.3f}")
    except ImportError:
        print("librosa not installed: skipping the raw-file audio pipeline")

    def shard_audio():
        n = 0
        for t in shard_rows(os.path.join(root, "packed-audio")):
            for row in t.column("audio").to_pylist():
                for a in row:
                    x = np.frombuffer(a["data"], "<i2").astype(np.float32) / np.float32(32767)
                    mel(x)
                    n += 1
        return n

    r = timed(shard_audio, args.reps)
    print(f"RESULT same_shards/pyarrow+whisper_fe audio {r[0]:.3f} {r[1]:.3f}")


if __name__ == "__main__":
    main()
