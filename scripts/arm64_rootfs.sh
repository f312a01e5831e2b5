#!/usr/bin/env bash
# The arm64 stage's userland, built once into .cache/arm64/ (scripts/test.sh calls this):
# - rootfs/: a Debian arm64 root filesystem from the machine's configured apt sources
#   (mmdebstrap, packages only extracted: nothing of it runs at build time);
# - site/: the engine's dependencies (requirements-engine.txt) as aarch64 wheels, without
#   ROS, installed by the host's pip for the rootfs's Python.
# test/test_arm64_stage.py then runs `edge-llm generate` in it under qemu-aarch64-static.
# Exit 0: ready. Exit 4: the tools are missing and cannot be installed here (not root); the
# reason is in .cache/arm64/unavailable. Anything else is a failure.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${EDGE_LLM_ARM64_DIR:-$ROOT/.cache/arm64}"
VPY="${EDGE_LLM_VENV:-$ROOT/.venv}/bin/python"
# Only extracted, never configured: the engine needs the interpreter and its C++ runtime.
PACKAGES="python3,libstdc++6,libgomp1"
mkdir -p "$OUT"
rm -f "$OUT/unavailable"

die() { echo "arm64: $*" >&2; exit 1; }
unavailable() { echo "$*" > "$OUT/unavailable"; echo "arm64: stage unavailable: $*" >&2; exit 4; }

# --- tools: Debian's mmdebstrap, qemu-user-static and the aarch64 cross compiler ---------------------------------------
if ! command -v mmdebstrap >/dev/null || ! command -v qemu-aarch64-static >/dev/null || ! command -v aarch64-linux-gnu-g++ >/dev/null; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    unavailable "mmdebstrap, qemu-user-static or g++-aarch64-linux-gnu is not installed (as root: apt-get install mmdebstrap qemu-user-static g++-aarch64-linux-gnu)"
  fi
  echo "arm64: installing mmdebstrap, qemu-user-static and g++-aarch64-linux-gnu"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q mmdebstrap qemu-user-static g++-aarch64-linux-gnu > "$OUT/apt.log" 2>&1 \
    || { apt-get update -q >> "$OUT/apt.log" 2>&1 && apt-get install -y -q mmdebstrap qemu-user-static g++-aarch64-linux-gnu >> "$OUT/apt.log" 2>&1; } \
    || { tail -20 "$OUT/apt.log"; die "apt-get install mmdebstrap qemu-user-static g++-aarch64-linux-gnu failed (log: $OUT/apt.log)"; }
fi

# --- rootfs --------------------------------------------------------------------------------
SUITE="$(. /etc/os-release && echo "${VERSION_CODENAME:-}")"
[ -n "$SUITE" ] || die "no VERSION_CODENAME in /etc/os-release: cannot tell mmdebstrap which suite"
key="$SUITE $PACKAGES"
if [ "$(cat "$OUT/rootfs.stamp" 2>/dev/null)" != "$key" ]; then
  echo "arm64: building a Debian $SUITE arm64 rootfs ($PACKAGES)"
  rm -rf "$OUT/rootfs" "$OUT/rootfs.tar"
  mmdebstrap --quiet --arch=arm64 --variant=extract --include="$PACKAGES" \
    "$SUITE" "$OUT/rootfs.tar" > "$OUT/mmdebstrap.log" 2>&1 \
    || { tail -20 "$OUT/mmdebstrap.log"; die "mmdebstrap failed (log: $OUT/mmdebstrap.log)"; }
  mkdir -p "$OUT/rootfs"
  tar -xf "$OUT/rootfs.tar" -C "$OUT/rootfs"
  rm -f "$OUT/rootfs.tar"
  echo "$key" > "$OUT/rootfs.stamp"
fi
# ONNX Runtime reads /proc/cpuinfo to pick its kernels. Under qemu-user that is the host's
# x86 file, with no Arm fields, and onnxruntime segfaults on import. qemu's -L prefix serves
# files that exist under it first, so the rootfs carries the cpuinfo of the emulated CPU
# (-cpu cortex-a76: implementer 0x41, part 0xd0b, dotprod).
mkdir -p "$OUT/rootfs/proc"
: > "$OUT/rootfs/proc/cpuinfo"
for cpu in 0 1; do
  printf 'processor\t: %s\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x4\nCPU part\t: 0xd0b\nCPU revision\t: 1\n\n' "$cpu" >> "$OUT/rootfs/proc/cpuinfo"
done

# --- the engine's aarch64 wheels -----------------------------------------------------------
PYVER="$(basename "$(ls -d "$OUT"/rootfs/usr/lib/python3.[0-9]* | head -1)")"   # python3.11
PYVER="${PYVER#python}"
[ -n "$PYVER" ] || die "no python3 in the rootfs (see $OUT/mmdebstrap.log)"
site_key="$PYVER $(sha256sum requirements-engine.txt | cut -c1-16)"
if [ "$(cat "$OUT/site.stamp" 2>/dev/null)" != "$site_key" ]; then
  echo "arm64: installing requirements-engine.txt as aarch64 wheels for Python $PYVER"
  rm -rf "$OUT/site"
  "$VPY" -m pip -q install --target "$OUT/site" --only-binary=:all: --implementation cp \
    --python-version "$PYVER" --platform manylinux_2_28_aarch64 \
    --platform manylinux_2_17_aarch64 --platform manylinux2014_aarch64 \
    -r requirements-engine.txt > "$OUT/pip.log" 2>&1 \
    || { grep -v "is ignored: it is neither" "$OUT/pip.log" | tail -20; die "pip could not install the aarch64 wheels (log: $OUT/pip.log)"; }
  echo "$site_key" > "$OUT/site.stamp"
fi
echo "arm64: ready ($OUT: rootfs Debian $SUITE arm64, Python $PYVER)"
