#!/usr/bin/env bash
# Set up everything edge_llm_ros needs inside this checkout, from nothing:
# a venv (.venv), the ROS 2 Jazzy wheels (requirements-ros-wheels.txt) and the runtime
# libraries (requirements.txt), the edge_llm_msgs interfaces built with cmake, this package,
# and the embedded SmolLM2 model converted to ONNX (.cache/).
# Idempotent: a second run only checks stamps and takes seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${EDGE_LLM_VENV:-$ROOT/.venv}"
STAMPS="$VENV/.edge_llm_stamps"
PY_MIN="3.10"

die() { echo "setup: $*" >&2; exit 1; }

# --- preflight: one clear line per missing tool -------------------------------
PYTHON="${PYTHON:-$(command -v python3 || true)}"
[ -n "$PYTHON" ] || die "python3 not found: install Python >= $PY_MIN (apt-get install python3 python3-venv)"
"$PYTHON" -c "import sys; sys.exit(0 if sys.version_info[:2] >= (3, 10) else 1)" \
  || die "Python >= $PY_MIN required, found $("$PYTHON" -V 2>&1) at $PYTHON (set PYTHON=/path/to/python3.x)"
"$PYTHON" -c "import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)" \
  || echo "setup: warning: the ROS 2 Jazzy wheels are built for CPython 3.11; $("$PYTHON" -V) may not find them" >&2
"$PYTHON" -c "import venv, ensurepip" 2>/dev/null \
  || die "Python venv/ensurepip missing: apt-get install python3-venv"
command -v cmake >/dev/null || die "cmake not found: apt-get install cmake (needed to build edge_llm_msgs)"
command -v gcc >/dev/null || command -v cc >/dev/null || die "C compiler not found: apt-get install gcc"
command -v g++ >/dev/null || command -v c++ >/dev/null || die "C++ compiler not found: apt-get install g++"

# Without HOME (CI) pip and ROS want somewhere to write.
export HOME="${HOME:-$ROOT/.cache/home}"
mkdir -p "$HOME" "$ROOT/.cache"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# pip with this machine's noise (missing local mirror folders) filtered out.
pip_quiet() {
  local rc=0
  "$VPY" -m pip -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; } || rc=$?
  # rc is pip's status (pipefail; the grep group always succeeds). PIPESTATUS cannot
  # tell: after `|| rc=$?` it describes that assignment, so a failure went unnoticed.
  [ "$rc" = 0 ] || die "pip $* failed (see above)"
}

hash_of() { cat "$@" 2>/dev/null | sha256sum | cut -c1-16; }

# --- venv + wheels -----------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating venv $VENV"
  "$PYTHON" -m venv "$VENV"
fi
mkdir -p "$STAMPS"
VPY="$VENV/bin/python"
# The ROS 2 wheels (no ROS install here) and the runtime libraries, resolved together; the
# test tools are scripts/test.sh's (requirements-test.txt).
REQUIREMENTS=(requirements-ros-wheels.txt requirements.txt)
req_hash=$(hash_of "${REQUIREMENTS[@]}")
if [ "$(cat "$STAMPS/requirements" 2>/dev/null)" != "$req_hash" ]; then
  echo "setup: installing wheels (ROS 2 Jazzy, onnxruntime, ...)"
  pip_quiet install --upgrade pip setuptools wheel
  pip_quiet install -r requirements-ros-wheels.txt -r requirements.txt
  # The wheels' exported CMake files carry the build host's Python/numpy include paths.
  "$VPY" "$ROOT/scripts/fix_wheel_cmake_paths.py" "$VENV"
  echo "$req_hash" > "$STAMPS/requirements"
fi

# --- interfaces --------------------------------------------------------------------
msgs_hash=$(hash_of $(find edge_llm_msgs -type f | sort))
if [ "$(cat "$STAMPS/msgs" 2>/dev/null)" != "$msgs_hash" ]; then
  echo "setup: building edge_llm_msgs (cmake + rosidl)"
  BUILD="$ROOT/build/edge_llm_msgs"
  rm -rf "$BUILD"; mkdir -p "$ROOT/build"
  CMAKE_PREFIX_PATH="$VENV" AMENT_PREFIX_PATH="$VENV" PATH="$VENV/bin:$PATH" \
    cmake -S edge_llm_msgs -B "$BUILD" -DCMAKE_INSTALL_PREFIX="$VENV" \
      -DPython3_EXECUTABLE="$VPY" -DBUILD_TESTING=OFF -DCMAKE_BUILD_TYPE=Release > "$ROOT/build/msgs-configure.log" 2>&1 \
    || { tail -30 "$ROOT/build/msgs-configure.log"; die "cmake configure of edge_llm_msgs failed (log: build/msgs-configure.log)"; }
  PATH="$VENV/bin:$PATH" cmake --build "$BUILD" -j"$(nproc)" > "$ROOT/build/msgs-build.log" 2>&1 \
    || { tail -30 "$ROOT/build/msgs-build.log"; die "building edge_llm_msgs failed (log: build/msgs-build.log)"; }
  cmake --install "$BUILD" > /dev/null
  echo "$msgs_hash" > "$STAMPS/msgs"
fi

# --- this package --------------------------------------------------------------------
pkg_hash=$(hash_of setup.py setup.cfg package.xml)
if [ "$(cat "$STAMPS/package" 2>/dev/null)" != "$pkg_hash" ]; then
  echo "setup: installing edge_llm_ros (editable)"
  pip_quiet install --no-deps --no-build-isolation -e .
  echo "$pkg_hash" > "$STAMPS/package"
fi

# --- embedded model ----------------------------------------------------------------------
if [ "${EDGE_LLM_SKIP_MODEL:-0}" != "1" ]; then
  "$VENV/bin/python" -m edge_llm_ros.convert.default_model --ensure
fi
echo "setup: ready (venv: $VENV)"
