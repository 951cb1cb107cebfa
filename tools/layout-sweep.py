#!/usr/bin/env python3
"""Random layouts of configs/tiny.toml under both schedules against one rank.

Draws disjoint layouts (TP, CP, PP, DP per module, microbatches, encoder recomputation,
an encoder's stages reversed, the LLM's backward split), or with `--colocated` colocated ones (every grid spanning
one world), trains each for 4
steps under `parallel.schedule = "phased"` and `"overlapped"` with the given `braid`
binary, and where the LLM has pipeline stages also with interleaved stages under both
schedules (`parallel.llm.virtual_stages`, a count that splits a stage's layers), and prints
the largest relative difference of each run's per-step losses from the one-rank run. A
config the binary rejects (exit 2, a message naming the key) is printed as REJECT and
drawn again; any other failure is FAIL. `--llm-layers N` trains every run (the one-rank
one too) with an N-layer LLM, room for more stages and chunks than tiny's 4 layers.

    tools/layout-sweep.py [--bin target/debug/braid] [--seed 1] [--layouts 14] [--max-world 14] [--llm-layers 8] [--colocated]
"""
import argparse
import json
import random
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


BASE = []  # --set's every run takes (--llm-layers)


def train(binary, out, name, sets):
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    args = [binary, "train", "--config", "configs/tiny.toml",
            "--set", f"run.dir={run_dir}", "--set", "train.steps=4",
            "--set", "optim.warmup_steps=1", "--set", "checkpoint.interval=0",
            "--set", "log.interval=1"]
    for s in BASE + sets:
        args += ["--set", s]
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["?"])[-1][:200]
        return None, (p.returncode, last)
    losses = []
    for line in open(run_dir / "metrics.jsonl"):
        v = json.loads(line)
        if "loss" in v and "step" in v:
            losses.append(v["loss"])
    return losses, None


def of_world(rng, world, tps, pps):
    """A module's grid of exactly `world` ranks: PP, TP and CP drawn among the divisors
    of what is left, DP the rest."""
    left, out = world, {}
    for k, choices in (("pp", pps), ("tp", tps), ("cp", [1, 2])):
        ok = [c for c in choices if left % c == 0]
        out[k] = rng.choice(ok)
        left //= out[k]
    out["dp"] = left
    return out


def rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=str(ROOT / "target/debug/braid"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--layouts", type=int, default=14)
    ap.add_argument("--max-world", type=int, default=14)
    ap.add_argument("--llm-layers", type=int, default=4, help="tiny.toml's LLM has 4")
    ap.add_argument("--colocated", action="store_true", help="every grid over one world")
    a = ap.parse_args()
    if a.llm_layers != 4:
        BASE.append(f"model.llm.layers={a.llm_layers}")
    rng = random.Random(a.seed)
    out = Path(tempfile.mkdtemp(prefix="braid-sweep-"))
    one, err = train(a.bin, out, "one", [])
    if one is None:
        raise SystemExit(f"one rank failed: {err}")
    print("one rank", one, flush=True)
    done = tried = failed = 0
    while done < a.layouts and tried < 20 * a.layouts:
        tried += 1
        if a.colocated:
            world = rng.randint(2, a.max_world)
            mods = {m: of_world(rng, world, tps, pps)
                    for m, tps, pps in (("llm", [1, 2], [1, 2, 4]), ("vision", [1, 2, 4], [1, 2]),
                                        ("audio", [1, 2], [1, 2]))}
        else:
            mods = {
                "llm": dict(tp=rng.choice([1, 2]), cp=rng.choice([1, 2]),
                            pp=rng.choice([1, 2, 4]), dp=rng.choice([1, 2, 3])),
                "vision": dict(tp=rng.choice([1, 2, 4]), cp=rng.choice([1, 2]),
                               pp=rng.choice([1, 2]), dp=rng.choice([1, 2, 3])),
                "audio": dict(tp=rng.choice([1, 2]), cp=rng.choice([1, 2]),
                              pp=rng.choice([1, 2]), dp=rng.choice([1, 2])),
            }
            world = sum(x["tp"] * x["cp"] * x["pp"] * x["dp"] for x in mods.values())
        if world > a.max_world:
            continue
        sets = [f"parallel.world_size={world}",
                f"train.microbatches={rng.choice([1, 2, 3, 4, 8])}"]
        if a.colocated:
            sets.append('parallel.placement="colocated"')
        for m, x in mods.items():
            sets += [f"parallel.{m}.{k}={v}" for k, v in x.items() if v != 1]
        if rng.random() < 0.3:
            sets.append("parallel.vision.recompute=true")
        # An encoder of two stages or more, half the time with its stages reversed.
        for m in ("vision", "audio"):
            if mods[m]["pp"] >= 2 and rng.random() < 0.5:
                sets.append(f"parallel.{m}.reverse_stages=true")
        # A pipelined LLM, half the time with its backward split (zero-bubble); the
        # interleaved runs below then go without it.
        zero_bubble = mods["llm"]["pp"] >= 2 and rng.random() < 0.5
        if zero_bubble:
            sets.append("parallel.llm.zero_bubble=true")
        tag = " ".join(s.replace("parallel.", "") for s in sets)
        phased, e1 = train(a.bin, out, "phased", sets)
        over, e2 = train(a.bin, out, "overlapped", sets + ['parallel.schedule="overlapped"'])
        # Interleaved: V chunks per LLM stage, V splitting a stage's layers.
        pp = mods["llm"]["pp"]
        per_stage = a.llm_layers // pp if a.llm_layers % pp == 0 else 0
        vs = [v for v in range(2, per_stage + 1) if per_stage % v == 0] if pp > 1 else []
        inter = e3 = inter_over = e4 = None
        tried_inter = bool(vs) and phased is not None
        if tried_inter:
            v = rng.choice(vs)
            tag += f" | virtual_stages={v}"
            plain = [x for x in sets if x != "parallel.llm.zero_bubble=true"]
            inter, e3 = train(a.bin, out, "interleaved", plain + [f"parallel.llm.virtual_stages={v}"])
            inter_over, e4 = train(a.bin, out, "interleaved-overlapped",
                                   plain + [f"parallel.llm.virtual_stages={v}",
                                            'parallel.schedule="overlapped"'])
        if phased is None or over is None:
            if e1 and e2 and e1[0] == 2 and e2[0] == 2:
                print("REJECT", tag, e1[1], flush=True)
                continue
            print("FAIL", tag, e1, e2, flush=True)
            failed += 1
            done += 1
            continue
        done += 1
        d_over, d_phased = rel(over, one), rel(phased, one)
        # An interleaved run that failed counts as a difference (once, with the layout).
        miss = float("inf") if tried_inter else 0.0
        d_inter = rel(inter, one) if inter is not None else miss
        d_inter_over = rel(inter_over, one) if inter_over is not None else miss
        ok = d_over < 1e-4 and d_phased < 1e-4 and d_inter < 1e-4 and d_inter_over < 1e-4
        failed += not ok
        extra = (f" interleaved {d_inter:.1e}, overlapped {d_inter_over:.1e}"
                 if tried_inter else "")
        if tried_inter and (inter is None or inter_over is None):
            extra += f" (failed: {e3 or e4})"
        print(f"{'OK  ' if ok else 'DIFF'} overlapped {d_over:.1e} phased {d_phased:.1e}{extra} | {tag}",
              flush=True)
    shutil.rmtree(out, ignore_errors=True)
    print(f"{done} layouts, {failed} failed or differed", flush=True)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
