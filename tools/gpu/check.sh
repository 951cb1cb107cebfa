#!/usr/bin/env bash
# The device check, run on the lent H200 through the `device` tool in one call:
#
#   run(command="bash tools/gpu/check.sh", carry=["gpu-bundle"], timeout_s=450)
#
# after tools/gpu/bundle.sh here. At most 8 files come back from $OUT, so the logs of
# every step go to one archive, $OUT/results.tgz (re-made after each step, so a call cut
# short still returns what finished), beside summary.txt (a line per step), tests.json
# (every CUDA test arm: name, pass/fail and the failure text), demo.json, layouts.json,
# bench-braid.txt and bench-torch.json. Steps are time-boxed so one hang cannot eat the
# call: BRAID_CHECK_BUDGET_S (default 440) is the whole script's; BRAID_CHECK_ONLY (a
# space-separated subset of "tests nccl demo torchrun layouts nccl2 resume bench sanitize")
# reruns some steps (nccl2 compares with the CPU run of `layouts`, resume needs `demo`).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/braid-gpu-out}; mkdir -p "$OUT"
W=/tmp/braid-check; rm -rf "$W"; mkdir -p "$W"
B=${BRAID_BUNDLE:-gpu-bundle}
ONLY=${BRAID_CHECK_ONLY:-tests nccl demo torchrun layouts nccl2 resume bench sanitize}
want() { [[ " $ONLY " == *" $1 "* ]]; }
START=$(date +%s); BUDGET=${BRAID_CHECK_BUDGET_S:-440}
# A step's time limit: at most its cap, never more than what is left of the budget.
cap() { local left=$(( BUDGET - ($(date +%s) - START) )); [ "$left" -lt 3 ] && left=3; [ "$1" -lt "$left" ] && echo "$1" || echo "$left"; }
say() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/summary.txt"; }
snap() { tar -C "$W" -czf "$OUT/results.tgz.part" . 2>/dev/null && mv "$OUT/results.tgz.part" "$OUT/results.tgz"; }

if [ -f "$B/gpu-bundle.tar.xz" ] && [ ! -d "$B/tests" ]; then
    tar -C "$B" -xJf "$B/gpu-bundle.tar.xz" || { say "cannot unpack $B/gpu-bundle.tar.xz"; exit 2; }
fi
[ -d "$B/tests" ] || { say "no $B/tests: run tools/gpu/bundle.sh and carry gpu-bundle"; exit 2; }
B=$(cd "$B" && pwd); BRAID=$B/braid
# The test binaries find their fixtures through the paths they were built at
# (CARGO_MANIFEST_DIR, CARGO_TARGET_TMPDIR): point those at this copy of the tree.
BUILT_AT=${BRAID_BUILT_AT:-/work/main}
if [ "$BUILT_AT" != "$PWD" ] && [ ! -e "$BUILT_AT" ]; then
    mkdir -p "$(dirname "$BUILT_AT")" && ln -s "$PWD" "$BUILT_AT"
fi
mkdir -p target/tmp

# cuBLASLt, NVRTC, cuDNN and NCCL come from the CUDA toolkit or Python's nvidia-* wheels.
libs=$(python3 - <<'PY' 2>/dev/null
import glob, os
try:
    import nvidia
    roots = list(nvidia.__path__)
except Exception:
    roots = []
dirs = set()
for r in roots:
    for lib in glob.glob(os.path.join(r, "**", "lib"), recursive=True):
        dirs.add(lib)
print(":".join(sorted(dirs)))
PY
)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# The nvidia-nccl wheel ships only libnccl.so.2, and cudarc loads libnccl.so: a symlink.
NCCL_DIR=/tmp/braid-nccl-lib; mkdir -p "$NCCL_DIR"
nccl2=$(IFS=:; for d in $LD_LIBRARY_PATH; do ls "$d"/libnccl.so.2 2>/dev/null; done | head -n1)
[ -n "$nccl2" ] && ln -sf "$nccl2" "$NCCL_DIR/libnccl.so"
export LD_LIBRARY_PATH="$NCCL_DIR:$LD_LIBRARY_PATH"
# The bundle's pre-built cubins (same cache key: NVRTC 13.0, sm_90a); missing ones are
# compiled here and added.
export BRAID_KERNEL_CACHE=/tmp/braid-kernel-cache
mkdir -p "$BRAID_KERNEL_CACHE" && cp "$B"/kernel-cache/*.cubin "$BRAID_KERNEL_CACHE"/ 2>/dev/null
{
    nvidia-smi; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; echo "libnccl.so.2: ${nccl2:-not found}"
    ldconfig -p | grep -E "libcuda|libnvrtc|libcublas|libnccl|libcudnn" | head -20
    ls "$BRAID_KERNEL_CACHE" | head -50; ldd "$BRAID"; nproc; free -g
} > "$W/gpu.txt" 2>&1
say "start: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -1)"
say "bundle built from $(head -n 1 "$B/built-from.txt" 2>/dev/null || echo '?'), tree at $(git rev-parse HEAD 2>/dev/null || echo '?')"

# The CPU reference runs go in the background now (16 cores, while the GPU tests run):
# the demo, and the layouts of step 5. They also generate and pack the demo data that
# the GPU runs read.
LAYOUTS=(
    "tp2|parallel.world_size=4 parallel.llm.tp=2 model.llm.kv_heads=2 model.llm.vocab=262"
    "pp2|parallel.world_size=4 parallel.llm.pp=2 model.llm.layers=2"
    "pp2zb|parallel.world_size=4 parallel.llm.pp=2 model.llm.layers=2 parallel.llm.zero_bubble=true"
    "colocated4|parallel.world_size=4 parallel.placement=\"colocated\" parallel.llm.dp=4 parallel.vision.dp=4 parallel.audio.tp=2 parallel.audio.dp=2"
    "colocated2|parallel.world_size=2 parallel.placement=\"colocated\" parallel.llm.tp=2 model.llm.kv_heads=2 model.llm.vocab=262 parallel.vision.dp=2 parallel.audio.dp=2"
)
sets() { local s; for s in $1; do printf -- '--set\n%s\n' "$s"; done; }
# Each run starts from an empty run.dir: on a warm machine a rerun finds the last call's
# runs/ (ignored, so kept), where `braid train` would refuse to start and the comparisons
# would read the old metrics as new.
( if want demo; then
      rm -rf runs/gpu-check-cpu
      ( time timeout 200 "$BRAID" train --config configs/demo.toml --set run.dir=runs/gpu-check-cpu ) \
          > "$W/demo-cpu.log" 2>&1
  fi
  if want layouts; then
      for l in "${LAYOUTS[@]}"; do
          name=${l%%|*}; mapfile -t args < <(sets "${l#*|}")
          rm -rf "runs/gpu-check-$name-cpu"
          timeout 120 "$BRAID" train --config configs/tiny.toml --set run.dir="runs/gpu-check-$name-cpu" \
              --set train.steps=20 "${args[@]}" > "$W/layout-$name-cpu.log" 2>&1
      done
  fi ) &
CPU_JOBS=$!

# 1. Every op, layer and model test body on cuda:0 (the `::cuda` arms are #[ignore]d
#    so that CPU machines count them as skipped): the kernels first, the models last.
if want tests; then
    : > "$W/tests.log"
    for t in "$B"/tests/braid-kernels--* "$B"/tests/braid-nn--* "$B"/tests/braid-llm--* \
             "$B"/tests/braid-encoders--* "$B"/tests/braid-train--*; do
        [ -x "$t" ] || continue
        echo "== $(basename "$t")" >> "$W/tests.log"
        timeout "$(cap 40)" "$t" --ignored --test-threads=1 '::cuda' >> "$W/tests.log" 2>&1
        echo "== exit $?" >> "$W/tests.log"
        [ $(( $(date +%s) - START )) -gt 200 ] && { echo "== stopped: the tests' 200 s are spent" >> "$W/tests.log"; break; }
    done
    python3 - "$W/tests.log" "$OUT/tests.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, re, sys
results, binary, failures, cur = [], None, {}, None
for line in open(sys.argv[1], errors="replace"):
    if line.startswith("== ") and not line.startswith("== exit"):
        binary = line[3:].strip(); continue
    m = re.match(r"^test (\S+) \.\.\. (ok|FAILED|ignored)", line)
    if m:
        results.append({"binary": binary, "test": m.group(1), "result": m.group(2)}); continue
    m = re.match(r"^---- (\S+) stdout ----", line)
    if m:
        cur = (binary, m.group(1)); failures[cur] = ""; continue
    if cur and not line.startswith("failures:"):
        failures[cur] += line
    if line.startswith("failures:") or line.startswith("test result"):
        cur = None
for r in results:
    r["failure"] = failures.get((r["binary"], r["test"]), "")[:3000]
n_ok = sum(r["result"] == "ok" for r in results)
json.dump({"passed": n_ok, "failed": len(results) - n_ok, "tests": results}, open(sys.argv[2], "w"), indent=1)
print(f"cuda tests: {n_ok} passed, {len(results) - n_ok} failed; failing: "
      + ", ".join(f"{r['binary'].split('--')[-1]}::{r['test']}" for r in results if r["result"] != "ok")[:1500])
PY
    snap
fi

# 2. NcclComm on this one GPU (a world of one; multi-rank NCCL needs several GPUs).
if want nccl && [ -x "$B/tests-nccl/comm--nccl" ]; then
    timeout "$(cap 40)" "$B/tests-nccl/comm--nccl" --ignored --test-threads=1 > "$W/nccl.log" 2>&1
    say "nccl tests: exit $? ($(grep -E '^test result' "$W/nccl.log" | head -1))"
    snap
fi

# 3. The demo on the GPU (bf16, then f32: like for like with the CPU run, so the 2 %
#    check tests the kernels apart from bf16) against the same run on the CPU.
if want demo; then
    rm -rf runs/gpu-check-cuda runs/gpu-check-cuda-f32
    ( time timeout "$(cap 90)" "$BRAID" train --config configs/demo.toml --set run.dir=runs/gpu-check-cuda \
        --set parallel.device=cuda ) > "$W/demo-cuda.log" 2>&1
    say "demo cuda bf16: $(tail -n 4 "$W/demo-cuda.log" | tr '\n' ' ' | cut -c1-300)"
    ( time timeout "$(cap 60)" "$BRAID" train --config configs/demo.toml --set run.dir=runs/gpu-check-cuda-f32 \
        --set parallel.device=cuda --set 'train.precision="f32"' ) > "$W/demo-cuda-f32.log" 2>&1
    say "demo cuda f32: $(tail -n 4 "$W/demo-cuda-f32.log" | tr '\n' ' ' | cut -c1-300)"
    cp runs/gpu-check-cuda/loss.png "$W/demo-cuda-loss.png" 2>/dev/null
    snap
fi

# 4. Issue 21: one process on the GPU launched by the real torchrun (NCCL, a world of
#    one, Braid's store beside torchrun's), against the plain CUDA run of step 3.
if want torchrun; then
    rm -rf runs/gpu-check-torchrun
    ( time timeout "$(cap 60)" python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29611 \
        --no-python "$BRAID" train --config configs/demo.toml --set run.dir=runs/gpu-check-torchrun \
        --set parallel.device=cuda ) > "$W/torchrun.log" 2>&1
    say "torchrun cuda: $(tail -n 4 "$W/torchrun.log" | tr '\n' ' ' | cut -c1-300)"
    snap
fi

wait "$CPU_JOBS" 2>/dev/null
python3 - "$OUT/demo.json" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
def run(d):
    r = {}
    try:
        rows = [json.loads(l) for l in open(f"runs/{d}/metrics.jsonl")]
        r["steps"] = len(rows)
        r["final_loss"] = rows[-1]["loss"] if rows else None
        r["losses"] = [x["loss"] for x in rows]
        times = sorted(x["step_time_s"] for x in rows if "step_time_s" in x)
        r["step_time_s_median"] = times[len(times) // 2] if times else None
        r["peak_mem_gib"] = rows[-1].get("peak_mem_gib") if rows else None
    except Exception as e:
        r["error"] = f"metrics: {e}"
    try:
        r["eval"] = json.load(open(f"runs/{d}/eval.json"))
    except Exception as e:
        r["eval_error"] = str(e)
    return r
out = {dev: run(f"gpu-check-{dev}") for dev in ("cpu", "cuda", "cuda-f32", "torchrun")}
c = out["cpu"]
for dev in ("cuda", "cuda-f32", "torchrun"):
    g = out[dev]
    if c.get("final_loss") and g.get("final_loss"):
        out[f"{dev}_final_loss_rel_diff"] = abs(g["final_loss"] - c["final_loss"]) / abs(c["final_loss"])
if out["cuda"].get("losses") and out["torchrun"].get("losses"):
    out["torchrun_equals_plain_cuda"] = out["cuda"]["losses"] == out["torchrun"]["losses"]
json.dump(out, open(sys.argv[1], "w"), indent=1)
print("demo:", {k: (v.get("final_loss"), v.get("eval", {}).get("heldout"), v.get("step_time_s_median"))
                if isinstance(v, dict) else v for k, v in out.items()})
PY

# 5. Several thread ranks on the one GPU (LocalComm moving device tensors), in f32,
#    against the same layouts on the CPU (run in the background above).
if want layouts; then
    for l in "${LAYOUTS[@]}"; do
        name=${l%%|*}; mapfile -t args < <(sets "${l#*|}")
        rm -rf "runs/gpu-check-$name-cuda"
        timeout "$(cap 40)" "$BRAID" train --config configs/tiny.toml --set run.dir="runs/gpu-check-$name-cuda" \
            --set train.steps=20 --set parallel.device=cuda --set 'train.precision="f32"' "${args[@]}" \
            > "$W/layout-$name-cuda.log" 2>&1
        echo "exit $?" >> "$W/layout-$name-cuda.log"
    done
    python3 - "$OUT/layouts.json" "${LAYOUTS[@]%%|*}" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
def losses(d):
    try:
        return [json.loads(l)["loss"] for l in open(f"runs/{d}/metrics.jsonl")]
    except Exception as e:
        return str(e)
out = {}
for name in sys.argv[2:]:
    c, g = losses(f"gpu-check-{name}-cpu"), losses(f"gpu-check-{name}-cuda")
    r = {"cpu": c, "cuda": g}
    if isinstance(c, list) and isinstance(g, list) and c and len(c) == len(g):
        r["max_rel_diff"] = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(c, g))
    out[name] = r
json.dump(out, open(sys.argv[1], "w"), indent=1)
print("layouts (f32, cuda vs cpu, max relative loss difference):",
      {k: v.get("max_rel_diff", "no comparison") for k, v in out.items()})
PY
    snap
fi

# 5b. Two NCCL processes on the one GPU (NCCL >= 2.30.3 allows it with
#     NCCL_MULTI_RANK_GPU_ENABLE=1; LOCAL_RANK 1 falls back to cuda:0): TP 2 of the LLM
#     through NcclComm's collectives and point-to-point channels, in f32, against the
#     same layout on CPU threads. Multi-rank NCCL proper needs several GPUs.
if want nccl2; then
    mapfile -t args < <(sets "${LAYOUTS[3]#*|}")
    rm -rf runs/gpu-check-nccl2
    NCCL_MULTI_RANK_GPU_ENABLE=1 timeout "$(cap 60)" "$BRAID" launch --nproc-per-node 2 --master-port 29631 -- \
        train --config configs/tiny.toml --set run.dir=runs/gpu-check-nccl2 --set train.steps=20 \
        --set parallel.device=cuda --set 'train.precision="f32"' --set parallel.timeout_s=40 \
        "${args[@]:2}" > "$W/nccl2.log" 2>&1
    echo "exit $?" >> "$W/nccl2.log"
    python3 - <<'PY' | tee -a "$OUT/summary.txt"
import json
def losses(d):
    try:
        return [json.loads(l)["loss"] for l in open(f"runs/{d}/metrics.jsonl")]
    except Exception as e:
        return str(e)
c, g = losses("gpu-check-colocated2-cpu"), losses("gpu-check-nccl2")
if isinstance(c, list) and isinstance(g, list) and c and len(c) == len(g):
    print("nccl2 (2 NCCL processes on one GPU vs CPU threads, f32): max relative loss difference",
          max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(c, g)))
else:
    print("nccl2: no comparison:", str(c)[:200], str(g)[:200])
PY
    tail -n 5 "$W/nccl2.log" | cut -c1-300 >> "$OUT/summary.txt"
    snap
fi

# 6. Checkpoints are device-independent: the f32 CUDA demo's step-300 checkpoint resumes
#    on the CPU, and the CPU demo's on CUDA (f32); steps 301-400 against the run that
#    wrote the checkpoint.
if want resume && want demo; then
    for pair in "cuda-f32:cpu" "cpu:cuda"; do
        from=${pair%%:*}; on=${pair#*:}; d=runs/gpu-check-resume-$from-on-$on
        rm -rf "$d"; mkdir -p "$d/checkpoints"
        if [ ! -d "runs/gpu-check-$from/checkpoints/step-00000300" ]; then
            # Nothing to resume (the source run failed): not a fresh run from step 0.
            printf 'no step-300 checkpoint in runs/gpu-check-%s\nexit -1\n' "$from" > "$W/resume-$from-on-$on.log"
            continue
        fi
        cp -r "runs/gpu-check-$from/checkpoints/step-00000300" "$d/checkpoints/" 2>/dev/null
        # Only the steps up to the checkpoint: a resumed run that fails at once must not
        # leave the source's own steps 301-400 to be compared with themselves.
        python3 -c 'import json,sys; [sys.stdout.write(l) for l in open(sys.argv[1]) if json.loads(l).get("step", 0) <= 300]' \
            "runs/gpu-check-$from/metrics.jsonl" > "$d/metrics.jsonl" 2>/dev/null
        dev_args=(--set "parallel.device=$on"); [ "$on" = cuda ] && dev_args+=(--set 'train.precision="f32"')
        timeout "$(cap 45)" "$BRAID" train --config configs/demo.toml --set run.dir="$d" "${dev_args[@]}" \
            --resume > "$W/resume-$from-on-$on.log" 2>&1
        echo "exit $?" >> "$W/resume-$from-on-$on.log"
    done
    python3 - "$OUT/resume.json" "$W" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
def by_step(d):
    try:
        return {r["step"]: r["loss"] for r in map(json.loads, open(f"runs/{d}/metrics.jsonl")) if "loss" in r}
    except Exception as e:
        return str(e)
out = {}
for src, on in (("cuda-f32", "cpu"), ("cpu", "cuda")):
    ref, got = by_step(f"gpu-check-{src}"), by_step(f"gpu-check-resume-{src}-on-{on}")
    try:
        tail = open(f"{sys.argv[2]}/resume-{src}-on-{on}.log").read().split()
        code = int(tail[-1]) if tail[-2:-1] == ["exit"] else None
    except Exception:
        code = None
    r = {"exit": code}
    if isinstance(ref, dict) and isinstance(got, dict):
        steps = [s for s in range(301, 401) if s in ref and s in got]
        r["steps_compared"] = len(steps)
        if steps:
            r["max_rel_diff"] = max(abs(ref[s] - got[s]) / abs(ref[s]) for s in steps)
            r["final"] = (ref[steps[-1]], got[steps[-1]])
    else:
        r["error"] = [ref, got] if not isinstance(ref, dict) else got
    out[f"{src}-resumed-on-{on}"] = r
json.dump(out, open(sys.argv[1], "w"), indent=1)
print("resume across devices:", out)
PY
    snap
fi

# 7. The benchmark, side by side in this one run on this card: the LLM of
#    configs/gpu-1b.toml at 8 x 4096 tokens a step, Braid (train/benches/step.rs) against
#    LlamaForCausalLM eager and compiled (tools/gpu/bench_llm_torch.py), plus attention
#    and GEMM alone.
if want bench; then
    BRAID_BENCH_DEVICE=cuda BRAID_BENCH_CONFIG=configs/gpu-1b.toml BRAID_BENCH_TEXT_ONLY=1 \
        BRAID_BENCH_ROWS=8 BRAID_BENCH_SEQ=4096 BRAID_BENCH_SAMPLES=1 BRAID_BENCH_MICROBATCHES=8 \
        BRAID_BENCH_STEPS=5 BRAID_BENCH_WARMUP=2 BRAID_BENCH_PARTS=0 BRAID_BENCH_THREADS=16 \
        timeout "$(cap 80)" "$B/bench-step" > "$OUT/bench-braid.txt" 2>&1
    echo "exit $?" >> "$OUT/bench-braid.txt"
    say "bench braid: $(tail -n 3 "$OUT/bench-braid.txt" | tr '\n' ' ' | cut -c1-400)"
    PYTHONUNBUFFERED=1 timeout "$(cap 150)" python3 tools/gpu/bench_llm_torch.py --device cuda --steps 5 --warmup 2 \
        > "$OUT/bench-torch.json" 2> "$W/bench-torch.log"
    say "bench torch: exit $? $(tail -n 1 "$OUT/bench-torch.json" | cut -c1-600)"
fi
# 8. The attention kernels under compute-sanitizer (memcheck, then racecheck): what a
#    comparison with the CPU cannot see. Last: slow, and cut off by the budget.
if want sanitize && command -v compute-sanitizer > /dev/null; then
    for tool in memcheck racecheck; do
        for t in "$B"/tests/braid-kernels--attention "$B"/tests/braid-kernels--attention_ranges; do
            [ -x "$t" ] || continue
            timeout "$(cap 60)" compute-sanitizer --tool "$tool" --error-exitcode 9 \
                "$t" --ignored --test-threads=1 '::cuda' > "$W/sanitize-$tool-$(basename "$t").log" 2>&1
            say "compute-sanitizer $tool $(basename "$t"): exit $? $(grep -E 'ERROR SUMMARY|test result' \
                "$W/sanitize-$tool-$(basename "$t").log" | tr '\n' ' ' | cut -c1-200)"
        done
    done
fi
snap
say "done"
