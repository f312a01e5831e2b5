"""Helpers of the llm_node tests: a slow-enough model, node processes, a ROS client.

The node runs as a real process (the console script's module); the client is an rclpy node
spinning in a background executor.

The "medium" random model (hidden 512, 8 layers, 2048 context) decodes a few hundred
tokens/s here: slow enough to cancel mid-stream and to overlap requests, fast enough for CI.
Random weights end with EOS at unpredictable points, so long generations use a JSON-schema
constraint ({"type": "string", "minLength": 5000}) that forbids EOS until max_tokens.
"""
import contextlib
import pathlib
import threading
import time
from typing import Dict, Iterator, List, Optional, Tuple

from diagnostic_msgs.msg import DiagnosticArray
from lifecycle_msgs.msg import Transition
from lifecycle_msgs.srv import ChangeState, GetState
import rclpy
from rclpy.executors import MultiThreadedExecutor
from rclpy.qos import QoSProfile, ReliabilityPolicy
from tiny_model import build_tiny_gguf, TinyDims

from edge_llm_ros import node_process
from edge_llm_ros.client import LLMClient
from edge_llm_ros.lifecycle_state import LifecycleStateError, wait_for_state


MEDIUM_DIMS = TinyDims(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1024,
                       context=2048)
LONG_SCHEMA = '{"type": "string", "minLength": 5000}'
# Tokens of a long goal: seconds of decoding here, still inside the 2048-token context.
LONG_TOKENS = 2000
_MODELS: Dict[str, pathlib.Path] = {}
_MODELS_LOCK = threading.Lock()


def medium_model_dir(root: pathlib.Path) -> pathlib.Path:
    """Build and convert the medium random model under root once per process."""
    from edge_llm_ros.convert.converter import convert
    with _MODELS_LOCK:
        key = str(root)
        if key not in _MODELS:
            root.mkdir(parents=True, exist_ok=True)
            src = build_tiny_gguf(root / 'medium.gguf', dims=MEDIUM_DIMS)
            _MODELS[key] = pathlib.Path(convert(str(src), str(root / 'medium'),
                                                progress=False))
        return _MODELS[key]


class NodeProcess(node_process.NodeProcess):
    """One llm_node process under `name`, its output kept for assertions; stopped by SIGINT."""

    def __init__(self, name: str, params: Dict[str, object],
                 env: Optional[Dict[str, str]] = None) -> None:
        super().__init__('llm_node', name=name, params=params, env=env, stop_timeout=60.0)


class RosClient:
    """An rclpy node spinning in a background MultiThreadedExecutor, with helpers."""

    def __init__(self, name: str) -> None:
        self.node = rclpy.create_node(name)
        self.executor = MultiThreadedExecutor(num_threads=4)
        self.executor.add_node(self.node)
        self._thread = threading.Thread(target=self.executor.spin, daemon=True)
        self._thread.start()
        self.diagnostics: List[DiagnosticArray] = []
        self._diag_lock = threading.Lock()
        self.node.create_subscription(DiagnosticArray, '/diagnostics', self._on_diag, 50)

    def _on_diag(self, msg: DiagnosticArray) -> None:
        with self._diag_lock:
            self.diagnostics.append(msg)

    def record(self, msg_type, topic: str, timeout: float = 30.0) -> list:
        """Subscribe (reliable, depth 100) and wait until a publisher is discovered."""
        received: list = []
        self.node.create_subscription(
            msg_type, topic, received.append,
            QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE))
        wait_for(lambda: self.node.count_publishers(topic) > 0, timeout,
                 f'a publisher on {topic}')
        return received

    def llm(self, server: str) -> LLMClient:
        client = LLMClient(self.node, server)
        assert client.wait_for_server(timeout=30), f'{server}/generate not discovered'
        return client

    def call(self, srv_type, name: str, request, timeout: float = 30.0):
        client = self.node.create_client(srv_type, name)
        try:
            assert client.wait_for_service(timeout_sec=timeout), f'{name} not available'
            done = threading.Event()
            future = client.call_async(request)
            future.add_done_callback(lambda _: done.set())
            assert done.wait(timeout), f'{name} did not answer within {timeout} s'
            return future.result()
        finally:
            self.node.destroy_client(client)

    def state(self, server: str, timeout: float = 30.0) -> str:
        return self.call(GetState, f'{server}/get_state', GetState.Request(),
                         timeout).current_state.label

    def transition(self, server: str, transition_id: int, timeout: float = 60.0) -> bool:
        request = ChangeState.Request(transition=Transition(id=transition_id))
        return self.call(ChangeState, f'{server}/change_state', request, timeout).success

    def wait_state(self, server: str, label: str, timeout: float = 60.0) -> None:
        """Poll get_state until it reports `label`, for `timeout` s in all (AssertionError).

        Requests lost while the node is still being discovered, or sent to the endpoints of
        a killed predecessor of the same name, are sent again until the deadline.
        """
        try:
            wait_for_state(self.node, server, label, timeout)
        except LifecycleStateError as exc:
            raise AssertionError(str(exc)) from None

    def next_status(self, server: str, timeout: float = 30.0) -> Dict[str, object]:
        """Return the first /diagnostics status of `server` published after this call.

        The result maps its keys to values, plus 'level' and 'message'.
        """
        with self._diag_lock:
            start = len(self.diagnostics)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._diag_lock:
                received = list(self.diagnostics[start:])
            for msg in received:
                for status in msg.status:
                    if status.name.startswith(server + ':'):
                        values: Dict[str, object] = {kv.key: kv.value for kv in status.values}
                        values['level'] = ord(status.level) if isinstance(
                            status.level, bytes) else int(status.level)
                        values['message'] = status.message
                        return values
            time.sleep(0.05)
        raise AssertionError(f'no /diagnostics status from {server} within {timeout} s')

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=2)
        self.node.destroy_node()
        self._thread.join(timeout=5)


@contextlib.contextmanager
def served_process(name: str, params: Dict[str, object], client_name: str,
                   timeout: float = 120.0) -> Iterator[Tuple[NodeProcess, RosClient, LLMClient]]:
    """Run llm_node `name` with `params`; yield its process, a RosClient and its LLMClient.

    The process is there for its log. rclpy is initialized for the block; at the end the
    client closes, rclpy shuts down and the node must stop cleanly (exit 0).
    """
    proc = NodeProcess(name, params)
    rclpy.init()
    client = RosClient(client_name)
    try:
        client.wait_state('/' + name, 'active', timeout=timeout)
        yield proc, client, client.llm('/' + name)
    finally:
        client.close()
        rclpy.shutdown()
        assert proc.stop() == 0, proc.log()


@contextlib.contextmanager
def served(name: str, params: Dict[str, object], client_name: str,
           timeout: float = 120.0) -> Iterator[RosClient]:
    """Run llm_node `name` with `params` and yield a RosClient once it is active (see above)."""
    with served_process(name, params, client_name, timeout) as (_, client, _llm):
        yield client


def wait_feedback_delivered(llm: LLMClient, timeout: float = 60.0) -> None:
    """Send short goals until one streams every one of its tokens to this client.

    DDS discovery is done by each side on its own: a client that just discovered the action
    server is not yet known to the server's feedback publisher, and feedback published
    before that match is lost (volatile QoS). Tests that check a stream is complete use a
    client only once its feedback provably arrives; a node that never delivers feedback
    fails here.
    """
    deadline = time.monotonic() + timeout
    attempts = []
    while time.monotonic() < deadline:
        chunks: list = []
        outcome = llm.generate('Hello', max_tokens=3, json_schema=LONG_SCHEMA,
                               on_feedback=chunks.append).result(timeout=max(
                                   1.0, deadline - time.monotonic()))
        assert outcome.status == 'succeeded', outcome

        def streamed() -> int:
            return sum(len(c.token_ids) for c in list(chunks) if c.queue_position == 0)
        # The last feedback may still be in flight after the result (topic vs service).
        end = min(deadline, time.monotonic() + 10.0)
        while streamed() < outcome.completion_tokens and time.monotonic() < end:
            time.sleep(0.01)
        if streamed() == outcome.completion_tokens:
            return
        attempts.append(f'{streamed()}/{outcome.completion_tokens}')
    raise AssertionError(f'no goal streamed all its feedback to {llm.server} within '
                         f'{timeout} s (tokens streamed per attempt: {attempts})')


def wait_for(predicate, timeout: float, what) -> None:
    """Poll predicate() until it holds; on timeout fail with `what`.

    `what` is a string, or a callable that describes the state seen at that moment.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f'timed out after {timeout} s waiting for '
                         f'{what() if callable(what) else what}')


TRANSITIONS = {
    'configure': Transition.TRANSITION_CONFIGURE,
    'activate': Transition.TRANSITION_ACTIVATE,
    'deactivate': Transition.TRANSITION_DEACTIVATE,
    'cleanup': Transition.TRANSITION_CLEANUP,
    'shutdown': Transition.TRANSITION_INACTIVE_SHUTDOWN,
}
