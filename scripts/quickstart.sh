#!/usr/bin/env bash
# README command 1: set everything up (idempotent), start llm_node on the embedded
# SmolLM2, send a prompt through the ROS 2 action, stream the answer, shut down.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
# shellcheck source=scripts/ros_env.sh
source scripts/ros_env.sh
exec "${EDGE_LLM_VENV:-$ROOT/.venv}/bin/python" -m edge_llm_ros.nodes.demo "${@:-Why is the sky blue? Answer in two sentences.}"
