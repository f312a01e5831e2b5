"""A node (llm_node, frame_source, perception) as a child process: start, wait, stop.

    with NodeProcess('llm_node', name='llm_demo', params={'autostart': True}) as node:
        client = LLMClient(ros_node, node.fqn)
        node.wait_until_active(client, timeout=600)   # NodeStartError with its last output
        ...
    # leaving the block: SIGINT, then SIGTERM, then SIGKILL (NodeStopError) if it hangs

The child runs the node's module with the current interpreter (what its console script
runs), parameters given as `--ros-args -p`. Its stdout and stderr are read on a thread;
the last lines are kept for error messages and tests, and can be echoed. No rclpy here:
waiting for a lifecycle state goes through an LLMClient the caller owns.
"""
from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Deque, Mapping, Optional, TextIO, TYPE_CHECKING

import yaml

if TYPE_CHECKING:   # only for type hints: importing this module never loads rclpy
    from edge_llm_ros.client import LLMClient

# After SIGINT times out: SIGTERM, and this long before SIGKILL.
TERM_GRACE_S = 5.0
TAIL_LINES = 40


class NodeProcessError(RuntimeError):
    """Base class of the errors about a node's child process."""


class NodeStartError(NodeProcessError):
    """The node exited, or did not reach its state or print its line in time."""


class NodeStopError(NodeProcessError):
    """The node ignored SIGINT for the whole stop timeout and had to be killed."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


def _plain_yaml_string(text: str) -> bool:
    """Tell whether rcl reads text as a string (already quoted text included)."""
    try:
        return isinstance(yaml.safe_load(text), str)
    except yaml.YAMLError:
        return False


def parameter_text(value: object) -> str:
    """Write a parameter value as `-p name:=VALUE` wants it (read as YAML by rcl)."""
    if isinstance(value, bool):
        return 'true' if value else 'false'
    if isinstance(value, str):
        # Quoted where YAML would read another type ('off' is false, '2-3' a date-ish
        # number to some parsers) or nothing (a bare `name:=` does not parse).
        if value and _plain_yaml_string(value):
            return value
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, (list, tuple)):
        return '[' + ','.join(repr(v) if isinstance(v, str) else parameter_text(v)
                              for v in value) + ']'
    return str(value)


def node_command(node: str, name: str = '', namespace: str = '',
                 params: Optional[Mapping[str, object]] = None) -> list:
    """Command line of `node` (a module of edge_llm_ros.nodes, or a full module path)."""
    module = node if '.' in node else f'edge_llm_ros.nodes.{node}'
    command = [sys.executable, '-m', module, '--ros-args']
    if name:
        command += ['-r', f'__node:={name}']
    if namespace.strip('/'):
        command += ['-r', f'__ns:=/{namespace.strip("/")}']   # rcl wants it fully qualified
    for key, value in (params or {}).items():
        command += ['-p', f'{key}:={parameter_text(value)}']
    return command


class NodeProcess:
    """One node child process, started on construction; see the module docstring.

    `env` adds to (or overrides) this process's environment. `echo` receives every output
    line, prefixed with the node's name. `own_session` puts the child in its own process
    group, so that a Ctrl-C in the terminal reaches only the parent, which then stops it.
    """

    def __init__(self, node: str = 'llm_node', *, name: str = '', namespace: str = '',
                 params: Optional[Mapping[str, object]] = None,
                 env: Optional[Mapping[str, str]] = None, echo: Optional[TextIO] = None,
                 own_session: bool = False, keep_lines: int = 400,
                 stop_timeout: float = 30.0) -> None:
        self.node = node
        self.name = name or node.rsplit('.', 1)[-1]   # unnamed: the node's default name
        namespace = namespace.strip('/')
        self.fqn = f'/{namespace}/{self.name}' if namespace else f'/{self.name}'
        self.stop_timeout = stop_timeout
        self.command = node_command(node, name, namespace, params)
        self._lines: Deque[str] = collections.deque(maxlen=keep_lines)
        self._echo = echo
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors='replace',
                                     env={**os.environ, **(env or {})},
                                     start_new_session=own_session)
        self._reader = threading.Thread(target=self._drain, name=f'{self.name}-output',
                                        daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip('\n')
            self._lines.append(line)
            if self._echo is not None:
                print(f'[{self.name}] {line}', file=self._echo, flush=True)
        self.proc.stdout.close()

    # ---- state -------------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> Optional[int]:
        """Exit code once it exited (negative: killed by that signal), else None."""
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        """Return the kept output lines (the last `keep_lines`)."""
        return '\n'.join(list(self._lines))

    def tail(self, lines: int = TAIL_LINES) -> str:
        return '\n'.join(list(self._lines)[-lines:])

    def exit_reason(self) -> Optional[str]:
        """Why the node can no longer start ('exited with code N'), or None while it runs."""
        code = self.proc.poll()
        return None if code is None else f'{self.name} exited with code {code}'

    # ---- waiting -----------------------------------------------------------------------------
    def wait_until_active(self, client: 'LLMClient', timeout: float) -> None:
        """Wait until the node (llm_node) is active, as `client` (its LLMClient) sees it.

        Raises NodeStartError with the node's last output when it exits first or is not
        active after `timeout` s (model load failed, or autostart is off).
        """
        from edge_llm_ros.client import NodeNotActiveError
        try:
            client.wait_until_active(timeout, give_up=self.exit_reason)
        except NodeNotActiveError as exc:
            raise self._start_error(str(exc)) from None

    def wait_output(self, text: str, timeout: float) -> None:
        """Wait until a line of its output contains `text` (NodeStartError otherwise)."""
        self.wait_until(lambda: any(text in line for line in list(self._lines)), timeout,
                        f'{text!r} in its output')

    def wait_until(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll `predicate` while the node runs; NodeStartError naming `what` otherwise."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if not self.alive():
                self._reader.join(timeout=2.0)   # its last lines may tell why
                if predicate():
                    return
                raise self._start_error(f'{self.exit_reason()} before {what}')
            if time.monotonic() > deadline:
                raise self._start_error(f'no {what} from {self.name} within {timeout:g} s')
            time.sleep(0.02)

    def wait_exit(self, timeout: float) -> int:
        """Exit code of a node expected to stop by itself (subprocess.TimeoutExpired)."""
        code = self.proc.wait(timeout)
        self._reader.join(timeout=5.0)
        return code

    def _start_error(self, message: str) -> NodeStartError:
        return NodeStartError(f'{message}. Last output of {self.name}:\n{self.tail()}')

    # ---- stopping ----------------------------------------------------------------------------
    def stop(self, timeout: Optional[float] = None) -> int:
        """SIGINT (the node frees its model and exits) and wait; return the exit code.

        A node still running after `timeout` s (default: stop_timeout) gets SIGTERM, then
        SIGKILL after TERM_GRACE_S, and NodeStopError says so. An exited one is only reaped.
        """
        timeout = self.stop_timeout if timeout is None else timeout
        escalated = ''
        if self.alive():
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                escalated = self._escalate()
        self._reader.join(timeout=5.0)
        code = self.proc.returncode
        if escalated:
            raise NodeStopError(f'{self.name} ignored SIGINT for {timeout:g} s: {escalated} '
                                f'(exit code {code}). Last output:\n{self.tail()}', code)
        return code

    def _escalate(self) -> str:
        self.proc.terminate()
        try:
            self.proc.wait(TERM_GRACE_S)
            return 'stopped by SIGTERM'
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return f'killed (SIGTERM ignored for {TERM_GRACE_S:g} s too)'

    def kill(self) -> None:
        """SIGKILL now, like a crash."""
        self.proc.kill()
        self.proc.wait(10.0)

    def __enter__(self) -> 'NodeProcess':
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.stop()
            return
        try:   # do not hide the error that ended the block behind one of stopping
            self.stop()
        except NodeStopError as stop_error:
            print(f'node_process: {stop_error}', file=sys.stderr)
