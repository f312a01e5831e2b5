# Source me: ROS 2 environment for this checkout (loopback discovery, own domain, no HOME needed).
_EDGE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export HOME="${HOME:-$_EDGE_ROOT/.cache/home}"
export ROS_AUTOMATIC_DISCOVERY_RANGE="${ROS_AUTOMATIC_DISCOVERY_RANGE:-LOCALHOST}"
# This checkout's own domain (1..101), the same in every terminal that sources this file, so
# a node started in one is found by `edge-llm ask` in another; derived from the user and the
# checkout path, so other users and checkouts on the machine usually get another one.
EDGE_LLM_DOMAIN_ID="$(( $(printf '%s:%s' "$(id -u)" "$_EDGE_ROOT" | cksum | cut -d' ' -f1) % 101 + 1 ))"
if [ "${EDGE_LLM_DOMAIN:-}" = run ]; then
  # A test run (scripts/test.sh): a fresh random domain, never the checkout's own, so the
  # tests neither see a node left running there nor each other's parallel runs.
  _edge_domain=$(( ($$ + RANDOM) % 100 + 1 ))
  if [ "$_edge_domain" -ge "$EDGE_LLM_DOMAIN_ID" ]; then _edge_domain=$(( _edge_domain + 1 )); fi
  export ROS_DOMAIN_ID="$_edge_domain"
  unset _edge_domain
else
  export ROS_DOMAIN_ID="${ROS_DOMAIN_ID:-$EDGE_LLM_DOMAIN_ID}"
fi
export ROS_HOME="${ROS_HOME:-$_EDGE_ROOT/.cache/ros_home}"
mkdir -p "$ROS_HOME" "$HOME"
export PATH="$_EDGE_ROOT/.venv/bin:$PATH"
unset _EDGE_ROOT
