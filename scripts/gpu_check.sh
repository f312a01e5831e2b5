#!/usr/bin/env bash
# The GPU check (issue 44): on any machine with an NVIDIA GPU, in a few minutes, build every
# kernel in kernels/ for that GPU, run each against its CPU reference, and time the K-quant
# matmul at one Qwen2.5-1.5B Q4_K_M layer's weight shapes and its head.
#
#   bash scripts/gpu_check.sh [OUTDIR]            # default ./gpu_check/
#   bash scripts/gpu_check.sh --emulate [OUTDIR]  # no GPU: the same harness on the CPU through
#                                                 # native/tests/cuda_emulation.h, reduced cases
#
# Needs the checkout, nvcc, a C++ compiler and python3 with numpy: no pip, no network, no
# pycuda, no onnxruntime-gpu. (native/CMakeLists.txt is not used: it needs ONNX Runtime's
# headers, which scripts/ort_headers.sh downloads; the harness needs only ref.cpp and glu.cpp.)
#   1. the GPU: nvidia-smi's compute capability (a Jetson Orin without it: the device tree);
#      nvcc must list that arch (`nvcc --list-gpu-arch`);
#   2. the build: native/tests/gpu_check.cu (kquant.cu, int4_gemv.cu, rmsnorm.cu, rope.cu,
#      kv_int8.cu in one program) by nvcc for that arch, ref.cpp and glu.cpp by the host
#      compiler with native/'s flags (-ffp-contract=off: the reference's bits);
#   3. the run: edge_llm_ros/bringup/gpu_check.py writes the older kernels' cases and the shapes,
#      runs the harness and writes OUTDIR/gpu_check.json and OUTDIR/gpu_check.txt (the table).
# Exit 0 when everything matched, 1 on any mismatch or failure, 2 at once without a GPU.
# Environment: PYTHON (default python3), CXX (default g++), NVCC (default: found as below).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { echo "gpu_check: $*" >&2; exit 1; }
say() { echo "gpu_check: [${SECONDS}s] $*"; }

emulate=0
if [[ "${1:-}" == "--emulate" ]]; then
  emulate=1
  shift
fi
[[ $# -le 1 ]] || die "usage: bash scripts/gpu_check.sh [--emulate] [OUTDIR]"
OUT="${1:-./gpu_check}"

# "sm_XY NAME" of GPU 0, or nothing.
gpu_arch() {
  local line
  if command -v nvidia-smi >/dev/null 2>&1 &&
     line="$(nvidia-smi --query-gpu=compute_cap,name --format=csv,noheader 2>/dev/null |
             head -n 1)" &&
     [[ "$line" =~ ^[[:space:]]*([0-9]+)\.([0-9]+),[[:space:]]*(.+)$ ]]; then
    echo "sm_${BASH_REMATCH[1]}${BASH_REMATCH[2]} ${BASH_REMATCH[3]}"
    return 0
  fi
  # JetPack's nvidia-smi may be missing or not report compute_cap; Orin is tegra234 (sm_87).
  if [[ -r /proc/device-tree/compatible ]] &&
     tr '\0' '\n' < /proc/device-tree/compatible | grep -qx 'nvidia,tegra234'; then
    echo "sm_87 Jetson Orin (tegra234)"
    return 0
  fi
  return 1
}

if (( emulate )); then
  arch="cpu-emulation"
  name="cuda_emulation.h on the CPU"
else
  if ! found="$(gpu_arch)"; then
    if command -v nvidia-smi >/dev/null 2>&1; then
      why="nvidia-smi reports none"
    else
      why="no nvidia-smi, no Jetson Orin"
    fi
    echo "gpu_check: no NVIDIA GPU on this machine ($why): nothing to check, exit 2" >&2
    exit 2
  fi
  arch="${found%% *}"
  name="${found#* }"
fi

PYTHON="${PYTHON:-python3}"
CXX="${CXX:-g++}"
command -v "$PYTHON" >/dev/null 2>&1 || die "no $PYTHON (set PYTHON to a python3 with numpy)"
"$PYTHON" -c 'import numpy' 2>/dev/null || die "$PYTHON has no numpy (set PYTHON to one that has)"
command -v "$CXX" >/dev/null 2>&1 || die "no C++ compiler $CXX (set CXX)"

if (( ! emulate )); then
  NVCC="${NVCC:-}"
  if [[ -z "$NVCC" ]]; then
    for candidate in "$(command -v nvcc || true)" "${CUDA_HOME:-}/bin/nvcc" \
                     /usr/local/cuda/bin/nvcc; do
      if [[ -n "$candidate" && -x "$candidate" ]]; then
        NVCC="$candidate"
        break
      fi
    done
  fi
  [[ -n "$NVCC" ]] ||
    die "a $name ($arch) is here but no nvcc (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin; or set NVCC)"
  version="$("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
  "$NVCC" --list-gpu-arch 2>/dev/null | grep -qx "compute_${arch#sm_}" ||
    die "nvcc $version ($NVCC) cannot build for $arch ($name); it lists:" \
        "$("$NVCC" --list-gpu-arch 2>/dev/null | tr '\n' ' ')"
fi

BUILD="$OUT/build"
mkdir -p "$BUILD"
NATIVE="$ROOT/native"
# native/CMakeLists.txt's flags for elk_kernels: the reference keeps its float expressions.
CXXFLAGS=(-O3 -DNDEBUG -std=c++17 -ffp-contract=off -I "$NATIVE/include" -I "$ROOT/kernels")
INCLUDES=(-I "$NATIVE/include" -I "$NATIVE/src" -I "$ROOT/kernels")

say "building the CPU references (ref.cpp, glu.cpp) with $CXX"
"$CXX" "${CXXFLAGS[@]}" -c "$NATIVE/src/ref.cpp" -o "$BUILD/ref.o" || die "ref.cpp did not build"
"$CXX" "${CXXFLAGS[@]}" -fno-trapping-math -c "$NATIVE/src/glu.cpp" -o "$BUILD/glu.o" ||
  die "glu.cpp did not build"

if (( emulate )); then
  say "building native/tests/gpu_check.cu as C++ against cuda_emulation.h"
  "$CXX" -O2 -std=c++17 -ffp-contract=off -Wall -Wextra -Wno-unknown-pragmas -x c++ \
    -I "$NATIVE/tests/cuda_shim" "${INCLUDES[@]}" "$NATIVE/tests/gpu_check.cu" -x none \
    "$BUILD/ref.o" "$BUILD/glu.o" -o "$BUILD/gpu_check" || die "the emulated harness did not build"
  quick=(--quick)
else
  say "building native/tests/gpu_check.cu for $arch ($name) with nvcc $version"
  nvcc_build=("$NVCC" -O3 -std=c++17 -arch="$arch" -ccbin "$CXX" -Xcompiler -ffp-contract=off
              "${INCLUDES[@]}" "$NATIVE/tests/gpu_check.cu" "$BUILD/ref.o" "$BUILD/glu.o"
              -o "$BUILD/gpu_check")
  if ! "${nvcc_build[@]}" 2> "$BUILD/nvcc.log"; then
    cat "$BUILD/nvcc.log" >&2
    # A host compiler newer than this nvcc knows: its check, not the code, refuses; try anyway
    # (the time a lent GPU has is too short to install another g++).
    grep -q 'unsupported GNU version' "$BUILD/nvcc.log" ||
      die "nvcc could not build the harness for $arch (above)"
    say "nvcc refuses $CXX's version: building again with -allow-unsupported-compiler"
    "${nvcc_build[@]}" -allow-unsupported-compiler ||
      die "nvcc could not build the harness for $arch (above)"
  fi
  quick=()
fi

say "running the checks and timings"
status=0
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m edge_llm_ros.bringup.gpu_check \
  --harness "$BUILD/gpu_check" --out "$OUT" --arch "$arch" ${quick[@]+"${quick[@]}"} || status=$?
if (( status == 0 )); then
  say "done: every kernel matched its reference"
else
  say "FAILED (exit $status): see $OUT/gpu_check.txt and the lines above"
fi
exit "$status"
