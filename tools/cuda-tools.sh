#!/usr/bin/env bash
# Fetches the CUDA compiler tools that check Braid's kernels on a machine with no GPU
# (NVRTC, nvcc, ptxas, the CUDA headers: pinned wheels from the Python package index, the
# 13.0 API of the H200 machines' driver), and prints the environment that points the
# compile checks (kernels/tests/cuda_compile.rs) at them.
#
#   eval "$(tools/cuda-tools.sh)"      # then: cargo test -p braid-kernels --test cuda_compile
#
# Cached under $BRAID_CUDA_TOOLS_DIR (default ~/.cache/braid/cuda-tools-13.0): ~190 MB,
# ~15 s the first time, nothing after.
set -euo pipefail
dir=${BRAID_CUDA_TOOLS_DIR:-$HOME/.cache/braid/cuda-tools-13.0}
tk=$dir/P/nvidia/cu13
if [ ! -x "$tk/bin/ptxas" ] || [ ! -e "$tk/lib/libnvrtc.so.13" ]; then
    mkdir -p "$dir"
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$dir/W" \
        nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-nvcc==13.0.88 \
        nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85 >&2
    # Wheels are zip files; Python unpacks them (unzip may be missing) and the
    # executables get their exec bit back.
    python3 - "$dir" >&2 <<'PY'
import pathlib, sys, zipfile
d = pathlib.Path(sys.argv[1])
for w in sorted((d / "W").glob("*.whl")):
    with zipfile.ZipFile(w) as z:
        for info in z.infolist():
            out = z.extract(info, d / "P")
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                pathlib.Path(out).chmod(mode)
PY
    chmod +x "$tk"/bin/* "$tk"/nvvm/bin/* 2>/dev/null || true
fi
[ -x "$tk/bin/ptxas" ] || { echo "cuda-tools: $tk/bin/ptxas missing after unpacking" >&2; exit 1; }
echo "export BRAID_CUDA_TOOLKIT=$tk"
echo "export LD_LIBRARY_PATH=$tk/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
