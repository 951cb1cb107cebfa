#!/bin/bash
# `braid plan` for configs/tiny.toml on 1-16 GPUs under each schedule and placement,
# then `braid train` with the plan written: losses against one rank (1e-4).
#
#   tools/sweep/plan-train.sh BRAID                 # from the repository root
#   PLANARGS="--cluster small.toml" tools/sweep/plan-train.sh BRAID
#
# A cluster file with small memory_gib (`braid profile --quick`, edited) makes the plans
# use TP, PP and interleaving. Runs go to /tmp/braid-sweep. Not part of CI.
set -u
B=$1
PLANARGS=${PLANARGS:-}
mkdir -p /tmp/braid-sweep
ref=/tmp/braid-sweep/pt-ref
[ -f $ref/metrics.jsonl ] || $B train --config configs/tiny.toml --set train.steps=4 --set optim.warmup_steps=1 --set checkpoint.interval=1000 --set log.interval=1 --set run.dir=$ref > /dev/null 2>&1
for g in 1 2 3 4 5 6 7 8 9 10 12 16; do
  for sch in best phased overlapped; do
    for pl in any colocated disjoint; do
      p=/tmp/braid-sweep/pt-$g-$sch-$pl.toml
      extra=""; [ $pl != any ] && extra="--set plan.placement=\"$pl\""
      out=$($B plan --config configs/tiny.toml --data data/demo/packed $PLANARGS --gpus $g --schedule $sch $extra --out $p 2>&1) || { echo "PLANFAIL $g $sch $pl: $(echo "$out" | tail -1)"; continue; }
      d=/tmp/braid-sweep/pt-run; rm -rf $d
      procs=$(grep -E "^gpus" $p | head -1 | tr -dc 0-9)
      tout=$($B train --config configs/tiny.toml --set train.steps=4 --set optim.warmup_steps=1 --set checkpoint.interval=1000 --set log.interval=1 --set run.dir=$d --set parallel.plan=$p 2>&1) || { echo "TRAINFAIL $g $sch $pl: $(echo "$tout" | grep -m1 error)"; continue; }
      python3 - $ref $d "$g $sch $pl $(grep -E "^(placement|schedule|microbatches)" $p | tr '\n' ' ')" <<'PY'
import json,sys
l=lambda d:[json.loads(x)["loss"] for x in open(d+"/metrics.jsonl") if '"loss"' in x]
a,b=l(sys.argv[1]),l(sys.argv[2])
ok=len(a)==len(b) and all(abs(x-y)<=1e-4*max(1,abs(y)) for x,y in zip(b,a))
print(("ok " if ok else "MISMATCH ")+sys.argv[3], "" if ok else (a,b))
PY
    done
  done
done
