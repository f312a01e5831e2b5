"""openai_bridge: an OpenAI-compatible HTTP server in front of llm_node's ~/generate action.

    ros2 run edge_llm_ros openai_bridge --ros-args -p port:=8000
    # OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='unused').chat.completions.create(
    #     model='edge-llm', messages=[...], stream=True)

Every request becomes one goal of the llm_node named by the `llm_node` parameter (through
LLMClient), so the node's queue, diagnostics and transcripts see HTTP clients like any other;
a client that disconnects cancels its goal. Parameters: bringup.parameters' openai_bridge
schema (host 127.0.0.1 by default, port, api_key or api_key_env, max_body_bytes, llm_node,
model_id). The FastAPI app runs on uvicorn's thread; the node spins in a
MultiThreadedExecutor on another; Ctrl-C (SIGINT) or SIGTERM stops the HTTP server first
(open streams are cancelled, so their goals end), then the node; the process exits 0.
Once listening it logs `serving http://HOST:PORT/v1` (with the bound port when port is 0).
"""
from __future__ import annotations

import os
import re
import sys
from typing import Any, Dict, Optional, TYPE_CHECKING

import rclpy
from rclpy.executors import MultiThreadedExecutor
from rclpy.node import Node

from edge_llm_ros.bridge.config import BridgeConfig
from edge_llm_ros.bridge.server import BridgeStartError, run_bridge, RunningBridge
from edge_llm_ros.bringup import parameters as schema_mod
from edge_llm_ros.client import LLMClient
from edge_llm_ros.nodes import node_params, spin
from edge_llm_ros.nodes.llm_client_backend import LLMClientBackend
from edge_llm_ros.nodes.node_params import ConfigError

if TYPE_CHECKING:
    from edge_llm_ros.node_process import NodeProcess

NODE_NAME = 'openai_bridge'
SERVING = re.compile(r'serving (http://\S+/v1) ')
SCHEMA = schema_mod.schema(NODE_NAME)
# Streams still open at Ctrl-C get this long to end before they are cancelled.
SHUTDOWN_GRACE_S = 2.0


def bridge_config(values: Dict[str, Any]) -> BridgeConfig:
    """Build the HTTP settings from the node's validated parameters (ConfigError if bad)."""
    key = values['api_key']
    if not key and values['api_key_env']:
        key = os.environ.get(values['api_key_env'], '')
        if not key:
            raise ConfigError(f"api_key_env names {values['api_key_env']}, which is not set in "
                              "this process's environment")
    try:
        return BridgeConfig(host=values['host'], port=values['port'], api_key=key,
                            max_body_bytes=values['max_body_bytes'],
                            shutdown_timeout_s=SHUTDOWN_GRACE_S,
                            fetch_image_urls=values['images.fetch_urls'],
                            image_fetch_timeout_s=values['images.fetch_timeout_s'],
                            image_fetch_max_bytes=values['images.fetch_max_bytes'])
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class OpenAIBridgeNode(Node):
    """The node: parameters and the LLMClient the bridge's backend sends goals through."""

    def __init__(self, **kwargs) -> None:
        super().__init__(NODE_NAME, **kwargs)
        values = node_params.declare_and_read(self, SCHEMA)
        self.config = bridge_config(values)
        self.llm_node = values['llm_node']
        self.client = LLMClient(self, self.llm_node)
        self.backend = LLMClientBackend(self.client, model_id=values['model_id'])

    def serve(self) -> RunningBridge:
        """Start the HTTP server (BridgeStartError when the port is taken)."""
        bridge = run_bridge(self.backend, self.config)
        self.get_logger().info(f'serving {bridge.base_url} (model {self.backend.model_id!r}) '
                               f'through {self.llm_node}/generate')
        return bridge


def wait_serving(proc: 'NodeProcess', timeout: float) -> str:
    """Wait until a bridge child process listens; return its base URL (http://...:PORT/v1)."""
    proc.wait_output('serving http://', timeout)
    for line in proc.log().splitlines():
        match = SERVING.search(line)
        if match:
            return match.group(1)
    raise RuntimeError(f'{proc.name} said it serves, but not where: {proc.tail()}')


def main(args=None) -> int:
    """Console script `openai_bridge`: serve until Ctrl-C or SIGTERM; exit 0 (2: bad setup)."""
    spin.init(args)
    node: Optional[OpenAIBridgeNode] = None
    executor: Optional[MultiThreadedExecutor] = None
    spinning: Optional[spin.BackgroundSpin] = None
    bridge: Optional[RunningBridge] = None
    code = 0
    try:
        node = OpenAIBridgeNode()
        executor = MultiThreadedExecutor(num_threads=max(4, os.cpu_count() or 1))
        executor.add_node(node)
        spinning = spin.BackgroundSpin(executor)
        bridge = node.serve()
        spinning.wait()
    except (ConfigError, BridgeStartError) as exc:
        print(f'{NODE_NAME}: {exc}', file=sys.stderr)
        code = 2
    except KeyboardInterrupt:   # before the spin started: nothing served yet
        pass
    finally:
        spin.ignore_signals()
        if bridge is not None:
            bridge.stop()    # still spinning: the cancels of open streams go out
        if spinning is not None:
            spinning.stop()
        if executor is not None:
            spin.shutdown_executor(executor)
        if node is not None:
            node.client.destroy()
            node.destroy_node()
        rclpy.try_shutdown()
    return code


if __name__ == '__main__':
    raise SystemExit(main())
