"""One way to run a node from a console script: llm_node, frame_source, perception.

Shut down as nodes/spin.py describes: SIGINT/SIGTERM end the wait, `release_while_spinning`
runs while the executor still spins (answers to the requests it ended can go out), the spin
loop stops, the executor is joined (no callback of the node runs any more),
`release_after_spin` frees what the node owns, and only then are the node destroyed and
the context shut down: no callback ever runs on a dead context.
"""
import sys
from typing import Any, Callable, Optional, Tuple, Type

import rclpy
from rclpy.executors import Executor, SingleThreadedExecutor
from rclpy.node import Node

from edge_llm_ros.nodes import spin


def _shutdown(node: Any) -> None:
    """Call the node's own shutdown() (frame_source, perception: not an rclpy method)."""
    node.shutdown()


def run_node(program: str, factory: Callable[[], Node],
             fatal_errors: Tuple[Type[BaseException], ...], args=None, *,
             executor_factory: Callable[[], Executor] = SingleThreadedExecutor,
             release_while_spinning: Optional[Callable[[Node], None]] = None,
             release_after_spin: Callable[[Node], None] = _shutdown,
             hint: str = '') -> int:
    """Spin the node `factory` builds; 0 after Ctrl-C, 2 (with one clear line) on fatal_errors.

    By default the node must have a shutdown() that releases what it owns (pools, sockets);
    it runs once its callbacks have stopped. `hint` follows a fatal error's message.
    """
    spin.init(args)
    node: Optional[Node] = None
    executor: Optional[Executor] = None
    spinning: Optional[spin.BackgroundSpin] = None
    code = 0
    try:
        node = factory()
        executor = executor_factory()
        executor.add_node(node)
        spinning = spin.BackgroundSpin(executor)
        spinning.wait()
    except fatal_errors as exc:
        print(f'{program}: error: {exc}' + (f' ({hint})' if hint else ''), file=sys.stderr)
        code = 2
    except KeyboardInterrupt:   # before the spin started: nothing served yet
        pass
    finally:
        spin.ignore_signals()
        if node is not None and spinning is not None and release_while_spinning is not None:
            release_while_spinning(node)
        if spinning is not None:
            spinning.stop()
        if executor is not None:
            spin.shutdown_executor(executor)
        if node is not None:
            release_after_spin(node)
            node.destroy_node()
        rclpy.try_shutdown()
    return code
