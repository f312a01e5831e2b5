"""Wait until a lifecycle node (llm_node) reports a state, through its ~/get_state service.

One polling loop for every caller: LLMClient.wait_until_active, the test harness and the
tools that start a node process and must wait for its model to load.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from lifecycle_msgs.srv import GetState
from rclpy.node import Node

# One get_state request's answer time. A request sent while discovery is half done (or to
# the endpoints of a killed predecessor of the same name, listed until their lease ends)
# is never answered: it is abandoned after this and sent again.
REQUEST_TIMEOUT_S = 5.0
POLL_S = 0.1


class LifecycleStateError(RuntimeError):
    """The node did not reach the state in time, or the caller's give_up said why not."""

    def __init__(self, message: str, server: str, seen: str, gave_up: str = '') -> None:
        super().__init__(message)
        self.server = server
        self.seen = seen          # the last state it reported ('' if it never answered)
        self.gave_up = gave_up    # give_up()'s reason ('' when the time ran out)


def wait_for_state(node: Node, server: str, label: str, timeout: float,
                   pump: Callable[[float], None] = time.sleep,
                   give_up: Optional[Callable[[], Optional[str]]] = None) -> None:
    """Poll `server`'s get_state until it reports `label` ('active', 'unconfigured', ...).

    `pump(seconds)` lets `node` be spun for that long (time.sleep when an executor on another
    thread spins it). `give_up()`, checked between polls, returns a reason to stop waiting
    (e.g. the node's process exited) or None. Raises LifecycleStateError.
    """
    client = node.create_client(GetState, f'{server}/get_state')
    deadline = time.monotonic() + timeout
    seen = ''
    try:
        while True:
            reason = give_up() if give_up is not None else None
            if reason:
                raise LifecycleStateError(f'{server} did not become {label}: {reason}',
                                          server, seen, reason)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if not client.service_is_ready():
                pump(min(POLL_S, left))
                continue
            future = client.call_async(GetState.Request())
            answer_by = time.monotonic() + min(REQUEST_TIMEOUT_S, left)
            while not future.done() and time.monotonic() < answer_by:
                pump(0.01)
            if not future.done():
                client.remove_pending_request(future)
                continue
            if future.result() is not None:
                seen = future.result().current_state.label
                if seen == label:
                    return
            pump(min(POLL_S, max(deadline - time.monotonic(), 0.0)))
    finally:
        node.destroy_client(client)
    where = f"is '{seen}'" if seen else 'never answered on get_state'
    raise LifecycleStateError(f"{server} {where}, not '{label}', after {timeout:g} s",
                              server, seen)
