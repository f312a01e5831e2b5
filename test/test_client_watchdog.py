"""LLMClient's watchdog: lost goal and result responses are recovered, a vanished server fails.

A real rclpy action server (in this process, its own node) stands in for llm_node so the
faults can be made exact: one that ignores the first result request of each goal (a result
response lost on the way), one whose node is destroyed while a goal runs, and a client that
drops the goal response it takes (a goal response lost on the way).
"""
import threading
import time

from rclpy.action import ActionServer
from rclpy.callback_groups import ReentrantCallbackGroup

from edge_llm_msgs.action import Generate
from edge_llm_ros import client as client_module
from edge_llm_ros.client import LLMClient, ServerUnavailableError, WatchdogConfig

FAST = WatchdogConfig(period_s=0.2, server_gone_s=1.0, response_grace_s=1.0, result_grace_s=1.0)
# The re-requested result must come before the watchdog would ask a third time: a grace far
# above any in-process round trip, even on a loaded machine, keeps the count exact.
PATIENT_RESULT = WatchdogConfig(period_s=0.2, server_gone_s=30.0, response_grace_s=5.0,
                                result_grace_s=5.0)
TIMEOUT_S = 60.0


class DroppingServer(ActionServer):
    """Ignore the first get_result request of every goal (its response is 'lost')."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.dropped = 0
        self._seen = set()

    async def _execute_get_result_request(self, request_header_and_message):
        goal = bytes(request_header_and_message[1].goal_id.uuid)
        if goal not in self._seen:
            self._seen.add(goal)
            self.dropped += 1
            return
        await super()._execute_get_result_request(request_header_and_message)


class LosingClient(client_module._GoalClient):
    """Drop every goal response taken (as if lost on the way): only the status shows it."""

    lost = 0

    async def execute(self, taken_data) -> None:
        if 'goal' in taken_data:
            LosingClient.lost += 1
            taken_data = {key: value for key, value in taken_data.items() if key != 'goal'}
        if taken_data:
            await super().execute(taken_data)


def _serve(node, server_class, release: threading.Event):
    def execute(goal_handle):
        release.wait(120)
        goal_handle.succeed()
        return Generate.Result(text=f'echo {goal_handle.request.prompt}', finish_reason='stop')
    return server_class(node, Generate, '~/generate', execute_callback=execute,
                        callback_group=ReentrantCallbackGroup())


def test_a_lost_result_response_is_requested_again(ros):
    release = threading.Event()
    release.set()
    server_node = ros('wd_drop_server')
    server = _serve(server_node, DroppingServer, release)
    client = LLMClient(ros('wd_drop_client'), f'/{server_node.get_name()}',
                       watchdog=PATIENT_RESULT)
    assert client.wait_for_server(timeout=TIMEOUT_S)
    handles = [client.generate(f'q{i}') for i in range(3)]
    outcomes = [h.result(timeout=TIMEOUT_S) for h in handles]
    assert [o.text for o in outcomes] == ['echo q0', 'echo q1', 'echo q2']
    assert {o.status for o in outcomes} == {'succeeded'}
    assert server.dropped == 3
    assert [h.result_requests for h in handles] == [2, 2, 2]
    client.destroy()


def test_result_without_timeout_raises_when_the_server_disappears(ros):
    release = threading.Event()
    server_node = ros('wd_gone_server')
    server = _serve(server_node, ActionServer, release)
    client = LLMClient(ros('wd_gone_client'), f'/{server_node.get_name()}', watchdog=FAST)
    assert client.wait_for_server(timeout=TIMEOUT_S)
    handle = client.generate('never answered')
    deadline = time.monotonic() + TIMEOUT_S
    while not handle.responded and time.monotonic() < deadline:
        time.sleep(0.01)
    assert handle.responded and handle.accepted
    box = []

    def wait_forever():
        try:
            box.append(handle.result())   # no timeout
        except Exception as exc:   # the assertion below names what came instead
            box.append(exc)
    waiter = threading.Thread(target=wait_forever, daemon=True)
    waiter.start()
    time.sleep(0.5)
    assert not box   # still running: the server is there
    ros.executor.remove_node(server_node)
    server.destroy()   # its endpoints go away, as when llm_node exits mid-goal
    started = time.monotonic()
    waiter.join(timeout=TIMEOUT_S)
    gone_after = time.monotonic() - started
    release.set()
    assert box and isinstance(box[0], ServerUnavailableError), box
    assert 'disappeared' in str(box[0]) and handle.goal_id in str(box[0])
    assert handle.done() and gone_after < TIMEOUT_S
    client.destroy()


def test_a_lost_goal_response_is_recovered_from_the_status(ros, monkeypatch):
    monkeypatch.setattr(client_module, '_GoalClient', LosingClient)
    LosingClient.lost = 0
    release = threading.Event()
    release.set()
    server_node = ros('wd_lost_server')
    _serve(server_node, ActionServer, release)
    client = LLMClient(ros('wd_lost_client'), f'/{server_node.get_name()}', watchdog=FAST)
    assert isinstance(client._action, LosingClient)
    assert client.wait_for_server(timeout=TIMEOUT_S)
    handle = client.generate('lost response')
    outcome = handle.result(timeout=TIMEOUT_S)
    assert outcome.status == 'succeeded' and outcome.text == 'echo lost response'
    assert LosingClient.lost == 1 and handle.result_requests == 1
    # rclpy_internals.accepted_goal_handle made the handle: rclpy's future never completed.
    assert not handle._goal_future.done()
    client.destroy()
