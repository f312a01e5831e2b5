# Source me: ROS 2 environment for this checkout (loopback discovery, own domain, no HOME needed).
_EDGE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export HOME="${HOME:-$_EDGE_ROOT/.cache/home}"
export ROS_AUTOMATIC_DISCOVERY_RANGE="${ROS_AUTOMATIC_DISCOVERY_RANGE:-LOCALHOST}"
# A distinct domain per run so parallel runs on one machine never see each other.
export ROS_DOMAIN_ID="${ROS_DOMAIN_ID:-$(( ($$ + RANDOM) % 101 + 1 ))}"
export ROS_HOME="${ROS_HOME:-$_EDGE_ROOT/.cache/ros_home}"
mkdir -p "$ROS_HOME" "$HOME"
export PATH="$_EDGE_ROOT/.venv/bin:$PATH"
unset _EDGE_ROOT
