#!/usr/bin/env bash
# Builds what tools/gpu/check.sh runs on the GPU machine (which has no Rust toolchain):
# the release `braid` binary and the test binaries whose bodies run on every device,
# stripped, into gpu-bundle/ (ignored by git; carry it with the device tool: 64 MiB max).
#
#   tools/gpu/bundle.sh && du -sh gpu-bundle
set -euo pipefail
cd "$(dirname "$0")/../.."
out=gpu-bundle
rm -rf "$out" && mkdir -p "$out/tests"
cargo build --release -p braid
cp target/release/braid "$out/"
# Test binaries of the crates whose tests use test_on_devices (their `::cuda` arms).
cargo test --release --no-run --message-format=json \
    -p braid-kernels -p braid-nn -p braid-llm -p braid-encoders -p braid-train 2>/dev/null |
    python3 -c '
import json, sys, shutil, os
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        exe = m["executable"]; name = m["target"]["name"]
        crate = m["package_id"].split("#")[0].rsplit("/", 1)[-1]
        dst = os.path.join(sys.argv[1], f"{crate}--{name}")
        shutil.copy(exe, dst)
' "$out/tests"
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
strip "$out/braid" "$out/bench-step" "$out"/tests/* 2>/dev/null || true
# The kernels compiled for sm_90a here, as the GPU machine's kernel cache (NVRTC takes
# minutes for attention.cu; the device's time is better spent running it).
eval "$(tools/cuda-tools.sh)"
BRAID_PREBUILD_KERNELS="$PWD/$out/kernel-cache" \
    cargo test --release -p braid-kernels --test cuda_compile every_kernel_compiles_through_nvrtc
cp tools/gpu/check.sh "$out/"
du -sh "$out"
