"""Helpers of the vision tests: node processes, an in-process ROS probe, frame bookkeeping."""
import collections
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Deque, Dict, List, Optional

import rclpy
from rclpy.executors import SingleThreadedExecutor

from edge_llm_ros.nodes.tensor_input import TensorInput
from edge_llm_ros.nodes.tensor_output import CopyKind


class NodeProc:
    """A frame_source / perception process (the console script's module), stopped by SIGINT."""

    def __init__(self, module: str, name: str, params: Dict[str, object],
                 env: Optional[Dict[str, str]] = None) -> None:
        cmd = [sys.executable, '-m', f'edge_llm_ros.nodes.{module}', '--ros-args',
               '-r', f'__node:={name}']
        for key, value in params.items():
            if isinstance(value, bool):
                value = str(value).lower()
            cmd += ['-p', f'{key}:={value}']
        self.name = name
        self.lines: Deque[str] = collections.deque(maxlen=400)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=dict(os.environ, **(env or {})))
        self.pid = self.proc.pid
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def log(self) -> str:
        """Everything the process printed so far."""
        return '\n'.join(self.lines)

    def wait_log(self, text: str, timeout: float) -> None:
        """Wait until text appears in the output (AssertionError with the log otherwise)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in list(self.lines)):
                return
            if self.proc.poll() is not None:
                self._reader.join(timeout=2)
                if any(text in line for line in list(self.lines)):
                    return
                break
            time.sleep(0.05)
        raise AssertionError(f'{self.name}: no {text!r} in its output:\n{self.log()}')

    def fd_count(self) -> int:
        """Open fds of the process."""
        return len(os.listdir(f'/proc/{self.pid}/fd'))

    def wait_exit(self, timeout: float) -> int:
        """Exit code of a process expected to stop by itself."""
        code = self.proc.wait(timeout)
        self._reader.join(timeout=5)
        return code

    def kill9(self) -> None:
        """SIGKILL, like a crash."""
        self.proc.kill()
        self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGINT and wait; a process that ignores it fails the test."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f'{self.name} ignored SIGINT for {timeout} s:\n{self.log()}')
        self._reader.join(timeout=5)
        return self.proc.returncode


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
