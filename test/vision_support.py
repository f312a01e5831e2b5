"""Helpers of the vision tests: node processes, an in-process ROS probe, frame bookkeeping."""
import os
import threading
import time
from typing import Callable, Dict, List, Optional

import rclpy
from rclpy.executors import SingleThreadedExecutor

from edge_llm_ros.node_process import NodeProcess
from edge_llm_ros.nodes.tensor_input import TensorInput
from edge_llm_ros.nodes.tensor_output import CopyKind


class NodeProc(NodeProcess):
    """A frame_source / perception process (the console script's module), stopped by SIGINT."""

    def __init__(self, module: str, name: str, params: Dict[str, object],
                 env: Optional[Dict[str, str]] = None) -> None:
        super().__init__(module, name=name, params=params, env=env, stop_timeout=15.0)

    wait_log = NodeProcess.wait_output   # NodeStartError with the output's tail

    def fd_count(self) -> int:
        """Open fds of the process."""
        return len(os.listdir(f'/proc/{self.pid}/fd'))

    kill9 = NodeProcess.kill   # SIGKILL, like a crash


class Probe:
    """An rclpy node spinning in a background thread, with TensorInputs on demand."""

    def __init__(self, name: str) -> None:
        self.node = rclpy.create_node(name)
        self.executor = SingleThreadedExecutor()
        self.executor.add_node(self.node)
        self._thread = threading.Thread(target=self.executor.spin, daemon=True)
        self._thread.start()
        self.inputs: List[TensorInput] = []

    def tensors(self, topic: str, kind: CopyKind, **kwargs) -> TensorInput:
        """Open a TensorInput on topic (closed with the probe)."""
        inp = TensorInput(self.node, topic, kind, **kwargs)
        self.inputs.append(inp)
        return inp

    def close(self) -> None:
        for inp in self.inputs:
            inp.close()
        self.executor.shutdown(timeout_sec=2)
        self.node.destroy_node()
        self._thread.join(timeout=5)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll predicate until true (AssertionError naming what after timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f'timed out after {timeout} s waiting for {what}')


def stamp_key(header) -> tuple:
    """Hashable header stamp (frames and their embeddings share it)."""
    return (header.stamp.sec, header.stamp.nanosec)
