"""One way to run a plain (non-lifecycle) node from a console script."""
import sys
from typing import Callable, Tuple, Type

import rclpy
from rclpy.executors import ExternalShutdownException
from rclpy.node import Node


def run_node(program: str, factory: Callable[[], Node],
             fatal_errors: Tuple[Type[BaseException], ...], args=None) -> int:
    """Spin the node `factory` builds; 0 after Ctrl-C, 2 (with one clear line) on fatal_errors.

    The node must have a shutdown() that releases what it owns (pools, sockets).
    """
    rclpy.init(args=args)
    node = None
    try:
        node = factory()
        rclpy.spin(node)
    except fatal_errors as exc:
        print(f'{program}: error: {exc}', file=sys.stderr)
        return 2
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        if node is not None:
            node.shutdown()
            node.destroy_node()
        rclpy.try_shutdown()
    return 0
