#!/usr/bin/env bash
# Builds what tools/gpu/check.sh runs on the GPU machine (which has no Rust toolchain):
# the release `braid` binary and the test binaries whose bodies run on every device,
# stripped and xz-compressed into gpu-bundle/gpu-bundle.tar.xz (ignored by git; carry
# gpu-bundle with the device tool: 64 MiB max).
#
#   tools/gpu/bundle.sh && du -sh gpu-bundle
set -euo pipefail
cd "$(dirname "$0")/../.."
out=gpu-bundle
rm -rf "$out" && mkdir -p "$out/tests"
cargo build --release -p braid
cp target/release/braid "$out/"
# The test binaries that have `::cuda` arms: the test files that use test_on_devices!.
with_cuda=$(grep -l "test_on_devices!" kernels/tests/*.rs nn/tests/*.rs llm/tests/*.rs \
    encoders/tests/*.rs train/tests/*.rs | sed 's|.*/||; s|\.rs$||' | sort -u | tr '\n' ' ')
cargo test --release --no-run --message-format=json \
    -p braid-kernels -p braid-nn -p braid-llm -p braid-encoders -p braid-train 2>/dev/null |
    python3 -c '
import json, sys, shutil, os
keep = set(sys.argv[2].split())
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        exe = m["executable"]; name = m["target"]["name"]
        if name not in keep or "lib" in m["target"]["kind"]:
            continue
        crate = m["package_id"].split("#")[0].rsplit("/", 1)[-1]
        shutil.copy(exe, os.path.join(sys.argv[1], f"{crate}--{name}"))
' "$out/tests" "$with_cuda"
# The step benchmark (train/benches/step.rs), for the 1B LLM on the GPU.
cargo bench --no-run --message-format=json -p braid-train --bench step 2>/dev/null |
    python3 -c '
import json, sys, shutil
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "step":
        shutil.copy(m["executable"], sys.argv[1])
' "$out/bench-step"
# NcclComm's GPU tests (comm/tests/nccl.rs, #[ignore]d: a world of one against SingleRank,
# a peer that never joins timing out); check.sh runs them apart from the ::cuda arms.
mkdir -p "$out/tests-nccl"
cargo test --release --no-run --message-format=json -p braid-comm --test nccl 2>/dev/null |
    python3 -c '
import json, sys, shutil
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "nccl":
        shutil.copy(m["executable"], sys.argv[1])
' "$out/tests-nccl/comm--nccl"
strip "$out/braid" "$out/bench-step" "$out"/tests/* "$out"/tests-nccl/* 2>/dev/null || true
# The kernels compiled for sm_90a here, as the GPU machine's kernel cache (NVRTC takes
# minutes for attention.cu; the device's time is better spent running it).
eval "$(tools/cuda-tools.sh)"
BRAID_PREBUILD_KERNELS="$PWD/$out/kernel-cache" \
    cargo test --release -p braid-kernels --test cuda_compile every_kernel_compiles_through_nvrtc
cp tools/gpu/check.sh "$out/"
# One compressed archive: the carry limit is 64 MiB for everything (the binaries are
# ~110 MB unpacked). check.sh unpacks it.
tar -C "$out" -cf - braid bench-step tests tests-nccl kernel-cache | xz -T2 -6 > gpu-bundle.tar.xz
rm -rf "$out" && mkdir -p "$out" && mv gpu-bundle.tar.xz "$out/"
# What the bundle was built from (check.sh reports it): a bundle older than the tree
# tests old code.
{ git rev-parse HEAD; git status --porcelain | head -20; } > "$out/built-from.txt"
du -sh "$out"/gpu-bundle.tar.xz
