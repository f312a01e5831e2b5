#!/usr/bin/env bash
# Run the whole edge_llm_ros test suite inside the project venv (set up first,
# idempotently, then the test tools of requirements-test.txt). Extra arguments go to
# pytest, e.g. scripts/test.sh -k engine, or scripts/test.sh test/test_layers.py (only that).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
VENV="${EDGE_LLM_VENV:-$ROOT/.venv}"
STAMPS="$VENV/.edge_llm_stamps"
VPY="$VENV/bin/python"
# A random domain for this run, not the one ros_env.sh gives this checkout's terminals.
EDGE_LLM_DOMAIN=run
# shellcheck source=scripts/ros_env.sh
source scripts/ros_env.sh
echo "test: ROS_DOMAIN_ID=$ROS_DOMAIN_ID (discovery: $ROS_AUTOMATIC_DISCOVERY_RANGE)"

die() { echo "test: $*" >&2; exit 1; }
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip with this machine's noise (missing local mirror folders) filtered out, as in setup.sh.
pip_quiet() {
  local rc=0
  "$VPY" -m pip -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; } || rc=$?
  # rc is pip's status (pipefail; the grep group always succeeds). PIPESTATUS cannot
  # tell: after `|| rc=$?` it describes that assignment, so a failure went unnoticed.
  [ "$rc" = 0 ] || die "pip $* failed (see above)"
}
# A missing file hashes as empty: pip then says what is wrong, not a silent `set -e` exit.
hash_of() { { cat "$@" 2>/dev/null || true; } | sha256sum | cut -c1-16; }

# --- test tools (pytest, hypothesis, rosdep, colcon, linters, ...): once per change -------
# Also after setup.sh reinstalled its wheels: its `--upgrade setuptools` can move a version
# a test tool pins (colcon-core wants setuptools<80), and this resolve puts it back.
mkdir -p "$STAMPS"
test_hash=$(hash_of requirements-ros-wheels.txt requirements.txt requirements-engine.txt requirements-test.txt)
if [ "$(cat "$STAMPS/test-requirements" 2>/dev/null)" != "$test_hash" ]; then
  echo "test: installing the test tools (requirements-test.txt)"
  if [ "$(cut -d' ' -f1 "$STAMPS/ros" 2>/dev/null)" = installed ]; then
    # An installed ROS brings its own ament linters: leave out what it already has.
    mkdir -p build
    "$VPY" edge_llm_ros/bringup/ros_install.py requirements --file requirements-test.txt \
      --skip-provided > build/requirements-test-setup.txt
    pip_quiet install -r build/requirements-test-setup.txt
  else
    pip_quiet install -r requirements-test.txt
  fi
  echo "$test_hash" > "$STAMPS/test-requirements"
fi

# The arm64 stage's userland (test/test_arm64_stage.py): built once, then only stamps are
# checked. Exit 4: its tools are missing here and cannot be installed (not root); its test
# then says so and skips. Any other failure stops the run.
arm64_rc=0
bash scripts/arm64_rootfs.sh || arm64_rc=$?
[ "$arm64_rc" = 0 ] || [ "$arm64_rc" = 4 ] || die "building the arm64 stage failed (scripts/arm64_rootfs.sh, exit $arm64_rc)"

# The whole suite, unless the arguments name tests (test/x.py, test/x.py::y): pytest would
# collect all of test/ again beside them.
targets=(test)
for arg in "$@"; do
  case "$arg" in test/*|./test/*) targets=() ;; esac
done
rc=0
"$VPY" -m pytest ${targets[@]+"${targets[@]}"} "$@" || rc=$?
if [ "$rc" = 5 ]; then
  echo "test: pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
