#!/usr/bin/env bash
# Run the whole edge_llm_ros test suite inside the project venv (set up first,
# idempotently). Extra arguments go to pytest, e.g. scripts/test.sh -k engine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
# A random domain for this run, not the one ros_env.sh gives this checkout's terminals.
EDGE_LLM_DOMAIN=run
# shellcheck source=scripts/ros_env.sh
source scripts/ros_env.sh
echo "test: ROS_DOMAIN_ID=$ROS_DOMAIN_ID (discovery: $ROS_AUTOMATIC_DISCOVERY_RANGE)"
rc=0
"$ROOT/.venv/bin/python" -m pytest test "$@" || rc=$?
if [ "$rc" = 5 ]; then
  echo "test: pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
