#!/usr/bin/env bash
# Regenerates the reference-workload table of docs/planning.md: `braid plan --json` on
# each reference config at 64, 256, 1,024 and 4,096 GPUs, one markdown row each.
#
#   tools/plan-table.sh [BRAID_BINARY] [extra braid plan args...]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/braid}
shift || true
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "| workload | GPUs | chosen plan | step (s) | LLM-centric (s) | speedup | LLM alone (s) | ceiling | bound (s) | plan / bound | gap: memory-forced, sync, imbalance, bridge, bubbles (s) |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
for w in 7b 70b 120b-hires; do
    for n in 64 256 1024 4096; do
        "$bin" plan --config "configs/plan-$w.toml" --gpus "$n" --json --out "$out/plan.toml" "$@" > "$out/p.json"
        python3 - "$w" "$n" "$out/p.json" <<'PY'
import json, sys
w, n, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
v = json.load(open(path))
def lay(m, chunks=1):
    l = v[m]
    if not l:
        return None
    parts = [f"{k}{l[k]}" for k in ("tp", "cp", "pp", "dp") if l[k] > 1 or k == "dp"]
    if chunks > 1:
        parts.insert(-1, f"v{chunks}")  # interleaved: chunks per stage
    return f"{m} " + " ".join(parts)
mods = [x for x in (lay("llm", v.get("llm_virtual_stages") or 1), lay("vision"), lay("audio")) if x]
# The vision encoder's recomputation, and the audio one's (its own where it differs).
vis, aud = v["recompute_encoders"], v.get("recompute_audio", v["recompute_encoders"])
rec = {(True, True): " (enc. recompute)", (True, False): " (vision recompute)",
       (False, True): " (audio recompute)"}.get((vis, aud), "") if v["vision"] or v["audio"] else ""
rev = " (encoder stages reversed)" if v.get("reverse_encoder_stages") else ""
rev += " (zero-bubble)" if v.get("llm_zero_bubble") else ""
chosen = f"{v['placement']}/{v['schedule']}: {mods[0]}, {v['microbatches']} mb; {', '.join(mods[1:])}{rec}{rev}"
b = v["baseline"]["llm"]
bv = v["baseline"].get("llm_virtual_stages") or 1
enc_tps = ", ".join(f"{m} tp{v['baseline'][m]['tp']}" for m in ("vision", "audio") if v["baseline"].get(m))
enc_tps = f"; {enc_tps}" if enc_tps else ""
base = f"{v['baseline_step_time_s']:.4g} (tp{b['tp']} cp{b['cp']} pp{b['pp']}{f' v{bv}' if bv > 1 else ''} dp{b['dp']}, {v['baseline']['microbatches']} mb{enc_tps})"
gap = ", ".join(f"{v['gap_' + k + '_s']:.3g}" for k in ("memory_forced", "grad_sync", "imbalance", "bridge", "bubbles"))
alone = v["llm_alone_step_time_s"]
print(f"| {w} | {n:,} | {chosen} | {v['step_time_s']:.4g} | {base} | {v['speedup']:.2f}x | {alone:.4g} | {v['speedup_ceiling']:.2f}x | {v['bound_step_time_s']:.4g} | {v['from_bound']:.2f}x | {gap} |")
PY
    done
done
