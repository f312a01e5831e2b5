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
# On a machine with ROS 2 installed, setup.sh built against it (bringup/ros_install.py) and
# recorded its setup.bash; the interfaces it built live in the venv's prefix.
_edge_venv="${EDGE_LLM_VENV:-$_EDGE_ROOT/.venv}"
_edge_ros_setup="$(cat "$_edge_venv/.edge_llm_stamps/ros_setup" 2>/dev/null || true)"
if [ -n "$_edge_ros_setup" ]; then
  if [ -z "${AMENT_PREFIX_PATH:-}" ]; then
    # ROS's setup scripts read unset variables: relax `set -u` while they run.
    case $- in
      *u*) set +u; source "$_edge_ros_setup"; set -u ;;
      *) source "$_edge_ros_setup" ;;
    esac
  fi
  case ":${AMENT_PREFIX_PATH:-}:" in
    *":$_edge_venv:"*) ;;
    *) export AMENT_PREFIX_PATH="$_edge_venv${AMENT_PREFIX_PATH:+:$AMENT_PREFIX_PATH}"
       export LD_LIBRARY_PATH="$_edge_venv/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
  esac
fi
export PATH="$_edge_venv/bin:$PATH"
unset _EDGE_ROOT _edge_venv _edge_ros_setup
