"""Checks a `braid demo-data` folder from Python: every FLAC/WAV clip and PNG/JPEG image decodes
with libsndfile (libFLAC) and PIL, and linear probes (ridge, one-vs-rest) on raw media read the
labels far above the text-only priors, a floor for what a tiny ViT / audio encoder can learn.

    braid demo-data --output /tmp/demo && /work/venv/bin/python tools/demo_probe.py /tmp/demo

Needs numpy, pillow, soundfile.
"""
import json
import sys

import numpy as np
import soundfile as sf
from PIL import Image

D = sys.argv[1].rstrip("/") + "/"
C = ["red", "green", "blue", "yellow"]
S = ["circle", "square", "triangle", "cross"]
P = ["one", "two", "three", "four", "five"]


def load(split):
    return [json.loads(line) for line in open(D + split + ".jsonl")]


def media(r, kind):
    return [c["path"] for c in r["messages"][0]["content"] if c["type"] == kind][0]


def ridge(xtr, ytr, xte, yte, k):
    mu, sd = xtr.mean(0), xtr.std(0) + 1e-6
    xtr, xte = (xtr - mu) / sd, (xte - mu) / sd
    w = np.linalg.solve(xtr.T @ xtr + 10 * np.eye(xtr.shape[1]), xtr.T @ np.eye(k)[ytr])
    return ((xte @ w).argmax(1) == yte).mean()


def images(rs):
    rs = [r for r in rs if "image" in r["labels"]]
    x = np.stack(
        [np.asarray(Image.open(D + media(r, "image")).convert("RGB"), np.float32).ravel() for r in rs]
    )
    lab = [r["labels"]["image"] for r in rs]
    return (
        x,
        np.array([C.index(v["colour"]) for v in lab]),
        np.array([v["count"] - 1 for v in lab]),
        np.array([S.index(v["shape"]) for v in lab]),
    )


def clips(rs):
    rs = [r for r in rs if "audio" in r["labels"]]
    feats, n, first = [], [], []
    for r in rs:
        x, sr = sf.read(D + media(r, "audio"), dtype="float32")
        assert sr == 16000 and x.ndim == 1, (r["id"], sr, x.shape)
        hop = len(x) // 40
        frames = x[: 40 * hop].reshape(40, hop) * np.hanning(hop)
        spec = np.abs(np.fft.rfft(frames, axis=1))
        # 40 frames x bins up to 1.6 kHz (the highest tone is 1.32 kHz)
        keep = int(1600 * hop / sr) + 1
        feats.append(np.log(spec[:, :keep] + 1e-3).ravel())
        tones = r["labels"]["audio"]["tones"]
        n.append(len(tones) - 1)
        first.append(P.index(tones[0]))
    return np.stack(feats), np.array(n), np.array(first)


tr, te = load("train"), load("heldout")
(xa, ca, na, sa), (xb, cb, nb, sb) = images(tr), images(te)
print(
    "image probes: colour %.2f (prior 0.25)  count %.2f (prior 0.50)  shape %.2f (prior 0.25)"
    % (ridge(xa, ca, xb, cb, 4), ridge(xa, na, xb, nb, 2), ridge(xa, sa, xb, sb, 4))
)
(xa, na, fa), (xb, nb, fb) = clips(tr), clips(te)
print(
    "audio probes: tone count %.2f (prior 0.33)  first tone %.2f (prior 0.20)"
    % (ridge(xa, na, xb, nb, 3), ridge(xa, fa, xb, fb, 5))
)
