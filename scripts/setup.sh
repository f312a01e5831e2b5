#!/usr/bin/env bash
# Set up everything edge_llm_ros needs inside this checkout, from nothing:
# a venv (.venv), ROS 2 (the machine's Humble/Jazzy if installed, else the Jazzy wheels of
# requirements-ros-wheels.txt on x86_64), the runtime libraries (requirements.txt), the
# edge_llm_msgs interfaces built with cmake, this package, and the embedded SmolLM2 model
# converted to ONNX (.cache/). The path is edge_llm_ros/bringup/ros_install.py's decision;
# EDGE_LLM_SETUP_DRY_RUN=1 prints its commands and stops.
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

# --- which ROS 2: the installed one, the x86_64 wheels, or a stop before any download ----
plan=$("$PYTHON" edge_llm_ros/bringup/ros_install.py shell) || exit $?
eval "$plan"
if [ "${EDGE_LLM_SETUP_DRY_RUN:-0}" = 1 ]; then
  echo "setup: ROS 2 $EDGE_ROS_DISTRO ($EDGE_ROS_MODE); would run:"
  "$PYTHON" edge_llm_ros/bringup/ros_install.py commands --venv "$VENV"
  exit 0
fi
if [ "$EDGE_ROS_MODE" = installed ]; then
  echo "setup: using the installed ROS 2 $EDGE_ROS_DISTRO ($EDGE_ROS_SETUP)"
  if [ -n "$EDGE_ROS_PYTHON" ]; then
    # rclpy's C extension is built for one Python: the venv must be made from it.
    PYTHON="$(command -v "$EDGE_ROS_PYTHON" || true)"
    [ -n "$PYTHON" ] || die "ROS 2 $EDGE_ROS_DISTRO's rclpy is built for $EDGE_ROS_PYTHON, which is not on PATH (apt-get install $EDGE_ROS_PYTHON-venv)"
  fi
  if [ "$EDGE_ROS_SOURCED" != 1 ]; then
    # ROS's setup scripts read unset variables.
    set +u; source "$EDGE_ROS_SETUP"; set -u
  fi
else
  "$PYTHON" -c "import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)" \
    || echo "setup: warning: the ROS 2 Jazzy wheels are built for CPython 3.11; $("$PYTHON" -V) may not find them" >&2
fi
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
# A venv made for the other path (or another ROS) is made again: it cannot be converted.
ros_key="$EDGE_ROS_MODE $EDGE_ROS_DISTRO $EDGE_ROS_PYTHON"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMPS/ros" 2>/dev/null || echo "wheels jazzy ")" != "$ros_key" ]; then
  echo "setup: $VENV was made for another ROS 2 path; making it again"
  rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating venv $VENV"
  # shellcheck disable=SC2086  # EDGE_ROS_VENV_ARGS is empty or one flag
  "$PYTHON" -m venv $EDGE_ROS_VENV_ARGS "$VENV"
fi
mkdir -p "$STAMPS"
echo "$ros_key" > "$STAMPS/ros"
# ros_env.sh sources this in new terminals.
echo "$EDGE_ROS_SETUP" > "$STAMPS/ros_setup"
VPY="$VENV/bin/python"
# The runtime libraries, with the ROS 2 wheels on the wheels path (resolved together); the
# test tools are scripts/test.sh's (requirements-test.txt).
ros_tag="$EDGE_ROS_MODE-$EDGE_ROS_DISTRO"
req_hash="$(hash_of requirements-ros-wheels.txt requirements.txt requirements-engine.txt) $ros_tag"
if [ "$(cat "$STAMPS/requirements" 2>/dev/null)" != "$req_hash" ]; then
  pip_quiet install --upgrade pip setuptools wheel
  if [ "$EDGE_ROS_MODE" = wheels ]; then
    echo "setup: installing wheels (ROS 2 Jazzy, onnxruntime, ...)"
    pip_quiet install -r requirements-ros-wheels.txt -r requirements.txt
    # The wheels' exported CMake files carry the build host's Python/numpy include paths.
    "$VPY" "$ROOT/scripts/fix_wheel_cmake_paths.py" "$VENV"
  else
    echo "setup: installing the Python libraries ROS 2 does not provide"
    mkdir -p "$ROOT/build"
    # The venv sees the system's packages (JetPack's onnxruntime-gpu, ...): those stay.
    "$VPY" edge_llm_ros/bringup/ros_install.py requirements --skip-provided > "$ROOT/build/requirements-setup.txt"
    pip_quiet install -r "$ROOT/build/requirements-setup.txt"
  fi
  echo "$req_hash" > "$STAMPS/requirements"
fi

# --- interfaces --------------------------------------------------------------------
msgs_hash="$(hash_of $(find edge_llm_msgs -type f | sort)) $ros_tag"
if [ "$(cat "$STAMPS/msgs" 2>/dev/null)" != "$msgs_hash" ]; then
  echo "setup: building edge_llm_msgs (cmake + rosidl)"
  BUILD="$ROOT/build/edge_llm_msgs"
  rm -rf "$BUILD"; mkdir -p "$ROOT/build"
  if [ "$EDGE_ROS_MODE" = wheels ]; then prefix="$VENV"; else prefix="$VENV:${CMAKE_PREFIX_PATH:-}"; fi
  CMAKE_PREFIX_PATH="$prefix" AMENT_PREFIX_PATH="$VENV${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}" PATH="$VENV/bin:$PATH" \
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

# --- the op library (native/): GGUF-block matmul kernels for ONNX Runtime --------------------
# Models convert to kquant (GGUF blocks read as they are) only where it is built.
# EDGE_LLM_NATIVE=0 skips it on purpose: models then convert to matmulnbits.
if [ "${EDGE_LLM_NATIVE:-1}" = 1 ]; then
  native_hash="$(hash_of $(find native kernels/kquant.cu kernels/glu.h -type f | sort)) $(uname -m)"
  # The stamp lives beside the library it describes (a venv may serve several checkouts).
  native_stamp="$ROOT/build/native/.edge_llm_source_hash"
  if [ "$(cat "$native_stamp" 2>/dev/null)" != "$native_hash" ] || [ ! -f "$ROOT/build/native/libedge_llm_ort_ops.so" ]; then
    echo "setup: building the op library (native/, cmake)"
    ORT_INC=$(bash "$ROOT/scripts/ort_headers.sh") \
      || die "no ONNX Runtime headers for native/ (see above): install libonnxruntime-dev, set ORT_INCLUDE_DIR to ONNX Runtime's include folder, or EDGE_LLM_NATIVE=0 to run on MatMulNBits only"
    mkdir -p "$ROOT/build"
    cmake -S native -B "$ROOT/build/native" -DCMAKE_BUILD_TYPE=Release -DORT_INCLUDE_DIR="$ORT_INC" > "$ROOT/build/native-configure.log" 2>&1 \
      || { tail -30 "$ROOT/build/native-configure.log"; die "cmake configure of native/ failed (log: build/native-configure.log)"; }
    cmake --build "$ROOT/build/native" -j"$(nproc)" > "$ROOT/build/native-build.log" 2>&1 \
      || { tail -30 "$ROOT/build/native-build.log"; die "building native/ failed (log: build/native-build.log)"; }
    echo "$native_hash" > "$native_stamp"
  fi
else
  echo "setup: EDGE_LLM_NATIVE=0: the op library is not built; models convert to matmulnbits"
fi

# --- embedded model ----------------------------------------------------------------------
if [ "${EDGE_LLM_SKIP_MODEL:-0}" != "1" ]; then
  "$VENV/bin/python" -m edge_llm_ros.convert.default_model --ensure
fi
echo "setup: ready (venv: $VENV)"
