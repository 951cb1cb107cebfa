#!/usr/bin/env python3
"""Checkpoint at step 2 under a random layout, resume to step 4 under another: losses against one rank.

    python3 tools/sweep/resume.py BRAID N SEED      # from the repository root

Each pair: configs/tiny.toml for 4 steps under layout A (threads or processes at
random), its step-4 checkpoint removed, `--resume` under layout B; steps 3 and 4 must
match one rank's losses (1e-4). Runs go to /tmp/braid-sweep. Not part of CI.
"""
import json, os, random, shutil, subprocess, sys
BRAID = sys.argv[1]; N = int(sys.argv[2]); SEED = int(sys.argv[3])
rng = random.Random(SEED)
ROOT = os.getcwd(); OUT = f"/tmp/braid-sweep/resume-{SEED}"; os.makedirs(OUT, exist_ok=True)
BASE = ["train.steps=4", "optim.warmup_steps=1", "checkpoint.interval=2", "checkpoint.keep=2", "log.interval=1"]

def run(sets, d, resume=False, procs=False):
    w = next((int(x.split("=")[1]) for x in sets if x.startswith("parallel.world_size=")), 1)
    args = [BRAID, "train", "--config", "configs/tiny.toml"]
    if procs and w > 1:
        args = [BRAID, "launch", "--nproc-per-node", str(w), "--master-port", str(20000 + rng.randrange(9000)), "--"] + args[1:]
    for s in BASE + sets + [f"run.dir={d}"]:
        args += ["--set", s]
    if resume: args.append("--resume")
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        open(f"{d}.fail.txt", "a").write(" ".join(args) + "\n" + p.stdout[-5000:] + "\n---\n" + p.stderr[-5000:])
        return p.returncode, (p.stderr.strip().splitlines() or ["?"])[-1]
    return 0, None

def losses(d):
    out = {}
    for l in open(f"{d}/metrics.jsonl"):
        j = json.loads(l)
        if "loss" in j: out[j["step"]] = j["loss"]
    return out

def grid(m):
    if m == "llm":
        tp = rng.choice([1, 2]); cp = rng.choice([1, 1, 2]); pp = rng.choice([1, 2, 4]); dp = rng.choice([1, 2])
        v = rng.choice([1, 2]) if pp == 2 else 1
        return dict(tp=tp, cp=cp, pp=pp, dp=dp, virtual_stages=v)
    return dict(tp=rng.choice([1, 2, 4]), cp=rng.choice([1, 1, 2]), pp=rng.choice([1, 2]), dp=rng.choice([1, 2, 3]))

def layout():
    while True:
        placement = rng.choice(["disjoint", "disjoint", "colocated"])
        g = {m: grid(m) for m in ["llm", "vision", "audio"]}
        size = lambda x: x["tp"] * x["cp"] * x["pp"] * x["dp"]
        if placement == "colocated":
            w = size(g["llm"])
            for m in ["vision", "audio"]:
                inner = g[m]["tp"] * g[m]["cp"] * g[m]["pp"]
                if w % inner: g[m] = dict(tp=1, cp=1, pp=1, dp=w)
                else: g[m]["dp"] = w // inner
        else:
            w = sum(size(x) for x in g.values())
        if w <= 12: break
    sets = [f'parallel.placement="{placement}"', f'parallel.schedule="{rng.choice(["overlapped", "phased"])}"',
            f"parallel.world_size={w}", f"train.microbatches={rng.choice([1, 2, 4])}", f"parallel.zero1={rng.choice(['true', 'false'])}"]
    for m, x in g.items():
        sets += [f"parallel.{m}.{k}={v}" for k, v in x.items()]
    return sets

ref_dir = f"{OUT}/ref"
if not os.path.exists(f"{ref_dir}/metrics.jsonl"):
    assert run([], ref_dir)[0] == 0
ref = losses(ref_dir)
stats = {"ok": 0, "mismatch": 0, "fail": 0}
for i in range(N):
    a, b = layout(), layout()
    d = f"{OUT}/r{i}"
    pa, pb = rng.random() < 0.5, rng.random() < 0.5
    rc, e = run(a, d, procs=pa)
    if rc != 0:
        stats["fail"] += 1; print("FAIL-A", rc, a, e, flush=True); continue
    # Drop the step-4 checkpoint and the metrics after step 2: resume from step 2.
    ck = f"{d}/checkpoints"
    for c in os.listdir(ck):
        if c.endswith("00004"): shutil.rmtree(f"{ck}/{c}")
    rc, e = run(b, d, resume=True, procs=pb)
    if rc != 0:
        stats["fail"] += 1; print("FAIL-B", rc, "A:", a, "B:", b, e, flush=True); continue
    got = losses(d)
    bad = [(k, got.get(k), ref[k]) for k in (3, 4) if got.get(k) is None or abs(got[k] - ref[k]) > 1e-4 * max(1, abs(ref[k]))]
    if bad:
        stats["mismatch"] += 1; print("MISMATCH", "A:", a, pa, "B:", b, pb, bad, flush=True)
    else:
        stats["ok"] += 1
    shutil.rmtree(d)
print(stats, flush=True)
