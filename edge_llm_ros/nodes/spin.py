"""Spin an executor until Ctrl-C (SIGINT) or SIGTERM, and stop it before rclpy shuts down.

rclpy's own signal handler shuts the context down inside the signal, while an executor
thread may be between its ``context.ok()`` check and building the next wait set: that spin
then dies with "RCLError: failed to initialize wait set: the given context is not valid".
Here rclpy installs no handler (SignalHandlerOptions.NO, Humble and later): a signal only
raises KeyboardInterrupt in the main thread, which waits for it while a background thread
spins. The caller then releases what it holds (the executor still runs, so the answers to
cancelled requests go out), stops the spin loop with stop(), waits for the callbacks still
running (shutdown_executor), and only then destroys the node and shuts the context down:
nothing ever runs on a node or context that is being destroyed.

    init(args)
    spinning = BackgroundSpin(executor)
    try:
        spinning.wait()     # returns on SIGINT/SIGTERM; raises what the spin thread raised
    finally:
        ...release...; spinning.stop(); shutdown_executor(executor)
        node.destroy_node(); rclpy.try_shutdown()
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from types import FrameType
from typing import Any, List, Optional

import rclpy
from rclpy.executors import Executor
from rclpy.signals import SignalHandlerOptions

from edge_llm_ros import rclpy_internals

# How long one spin_once may wait for work: the latency of stop() (a wake without work does
# not end spin_once); also how often wait() wakes up.
SPIN_TIMEOUT_S = 0.1


# Whether the next SIGINT/SIGTERM raises KeyboardInterrupt. One signal raises once; a burst
# (Ctrl-C pressed again, a launch's SIGINT then SIGTERM) must not raise again inside the
# cleanup the first one started, nor when ignore_signals() is called with a signal pending:
# signal.signal() runs pending handlers first, and would raise before it installs SIG_IGN.
_armed = False


def _on_signal(signum: int, frame: Optional[FrameType]) -> None:
    global _armed
    if _armed:
        _armed = False
        raise KeyboardInterrupt


def init(args: Optional[List[str]] = None) -> None:
    """rclpy.init without rclpy's signal handlers; SIGINT or SIGTERM raises KeyboardInterrupt once.

    Installed even where SIGINT was inherited as ignored (a background job of a script).
    """
    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    arm()
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)


def arm() -> None:
    """Let the next SIGINT/SIGTERM raise KeyboardInterrupt again (after init, once per signal)."""
    global _armed
    _armed = True


def ignore_signals() -> None:
    """Let a cleanup that has started finish: further SIGINT/SIGTERM are ignored.

    SIG_IGN, not a Python handler: interpreter finalization resets Python handlers to
    SIG_DFL, and a late Ctrl-C would then kill the process (-2). A signal that arrives while
    SIG_IGN is being installed makes CPython print "Signal 2 ignored due to race condition"
    as an unraisable traceback; it was ignored as asked, so that report is dropped.
    """
    global _armed
    _armed = False   # first: a signal pending in signal.signal() below then raises nothing
    if sys.unraisablehook is not _drop_ignored_signal_report:
        global _next_unraisablehook
        _next_unraisablehook = sys.unraisablehook
        sys.unraisablehook = _drop_ignored_signal_report
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


_next_unraisablehook = sys.unraisablehook


def _drop_ignored_signal_report(unraisable) -> None:
    exc = unraisable.exc_value
    if isinstance(exc, OSError) and 'ignored due to race condition' in str(exc):
        return
    _next_unraisablehook(unraisable)


class BackgroundSpin:
    """Spins an executor on its own thread, from construction until stop()."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor
        self._stop = threading.Event()
        self._ended = threading.Event()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name='executor_spin', daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._executor.spin_once(timeout_sec=SPIN_TIMEOUT_S)
        except BaseException as exc:  # noqa: B902 - re-raised in the main thread by wait()
            self._error = exc
        finally:
            self._ended.set()

    def wait(self) -> None:
        """Block until SIGINT/SIGTERM, then ignore further ones; re-raise a spin failure.

        Sleeps rather than joining the thread: a join interrupted by KeyboardInterrupt can
        mark a running thread as stopped (CPython 3.11), and stop() must really wait for it.
        The sleep also lets a signal that another thread received be handled in time.
        """
        try:
            while not self._ended.is_set():
                time.sleep(SPIN_TIMEOUT_S)
        except KeyboardInterrupt:
            ignore_signals()
            return
        if self._error is not None:
            raise self._error

    def stop(self, timeout: float = 5.0) -> None:
        """End the spin loop and wait for its thread (callbacks in flight may go on)."""
        self._stop.set()
        self._executor.wake()
        self._thread.join(timeout)


def shutdown_executor(executor: Executor, timeout: float = 5.0) -> None:
    """Shut a stopped executor down once the callbacks it started have finished.

    rclpy's MultiThreadedExecutor joins its thread pool in shutdown() only since
    ros2/rclpy#1309 (Jazzy backport #1670, rclpy 7.1.8); Humble and older Jazzy return while
    callbacks still run there, and destroying the node under them raises InvalidHandle. So
    the pool is joined here too (a no-op where shutdown() did it, or for another executor).
    Call only after the spin loop has ended: nothing may submit to the pool any more.
    """
    executor.shutdown(timeout_sec=timeout)
    pool = rclpy_internals.executor_thread_pool(executor)
    if pool is not None:
        pool.shutdown(wait=True)


def close_client(spinning: BackgroundSpin, executor: Executor, node: Any,
                 *clients: Any) -> None:
    """Take a client program's rclpy down in order (benchmarks, tools).

    Signals ignored (the cleanup finishes), the spin loop, the executor and the callbacks it
    started, the clients (anything with destroy()), the node, the context: a context shut
    down under a spinning executor aborts the process ("terminate called without an
    active exception").
    """
    ignore_signals()
    spinning.stop()
    shutdown_executor(executor)
    for client in clients:
        client.destroy()
    node.destroy_node()
    rclpy.try_shutdown()
