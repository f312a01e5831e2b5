"""Property tests: random Generate goals through llm_node's own validation, and over ROS.

Contract (issue 4/8): a goal is either run to a terminal outcome or refused with a message;
no exception escapes the node's validation (Admission.prepare, shared by ~/generate and
~/complete) or ~/tokenize, and a refused goal gives its queue reservation back. The second
half sends the inputs fuzzing found dangerous to a real llm_node process, which must answer
each with a message and keep serving.
"""
import os
import pathlib
import struct
import threading
import types

from fuzz_support import bounded, fuzz, HOSTILE_TEXT, private_ipc_dir
from hypothesis import event, example, given, strategies as st
from llm_node_harness import NodeProcess, RosClient
import pytest
import rclpy
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.parameter import Parameter
from tiny_model import tiny_model_dir

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import ChatMessage, SamplingParams, TensorHandle
from edge_llm_msgs.srv import Complete, Tokenize
from edge_llm_ros.errors import InvalidRequestError, ModelLoadError
from edge_llm_ros.ipc.pool import PoolConfig, TensorPool
from edge_llm_ros.nodes.llm_admission import NodeGoal
from edge_llm_ros.nodes.llm_node import LLMNode
from edge_llm_ros.runtime.types import StopReason
from edge_llm_ros.serving.worker import WorkerStoppedError

QUEUE_DEPTH = 2
TINY_CONTEXT = 256   # the tiny model's whole context
POOL = 'fzgoal'
POOL_SLOT_BYTES = 4096


@pytest.fixture(scope='module')
def model_dir(tmp_path_factory) -> pathlib.Path:
    return tiny_model_dir(tmp_path_factory.mktemp('fuzz_goal_model'))


@pytest.fixture(scope='module')
def ipc_dir():
    """Serve a live pool the handles can name, in a private EDGE_LLM_IPC_DIR."""
    with private_ipc_dir('fg') as path:
        pool = TensorPool(PoolConfig(pool_id=POOL, slot_nbytes=POOL_SLOT_BYTES, slots=4,
                                     allocator='memfd', socket_dir=path))
        loan = pool.loan()
        loan.ndarray('float32', (16, 64))[...] = 0.5
        pool.good = loan.publish()
        loan = pool.loan()
        loan.ndarray('uint8', (16, 16, 3))[...] = 7
        pool.frame = loan.publish()   # an RGB frame, for a model that has no vision encoder
        yield types.SimpleNamespace(path=path, pool=pool)
        pool.close()


@pytest.fixture(scope='module')
def ros_context():
    rclpy.init()
    yield
    rclpy.shutdown()


@pytest.fixture(scope='module')
def node(ros_context, model_dir, ipc_dir):
    """Run an active LLMNode in this process (not spinning: methods are called directly)."""
    llm = LLMNode(parameter_overrides=[
        Parameter('model.path', value=str(model_dir)),
        Parameter('queue.depth', value=QUEUE_DEPTH), Parameter('max_tokens', value=4),
        Parameter('kv.max_context', value=TINY_CONTEXT)])
    assert llm.trigger_configure() == TransitionCallbackReturn.SUCCESS, llm.load_error
    assert llm.trigger_activate() == TransitionCallbackReturn.SUCCESS
    yield llm
    llm.release()
    llm.destroy_node()


def f32(x: float) -> float:
    return struct.unpack('f', struct.pack('f', x))[0]


float32s = st.one_of(st.floats(width=32), st.sampled_from([-1.0, 0.0, 1.0, 1e-45, 3.4e38]))
int32s = st.one_of(st.integers(-2**31, 2**31 - 1), st.integers(-2, 60_000))
uint32s = st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 300))
uint64s = st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 70_000))


@st.composite
def samplings(draw) -> SamplingParams:
    return SamplingParams(
        temperature=draw(float32s), top_k=draw(int32s), top_p=draw(float32s),
        min_p=draw(float32s), repetition_penalty=draw(float32s),
        presence_penalty=draw(float32s),
        seed=draw(st.one_of(st.integers(-2**63, 2**63 - 1), st.integers(-2, 5))))


@st.composite
def handles(draw) -> TensorHandle:
    return TensorHandle(
        pool_id=draw(st.one_of(st.just(POOL), st.text(max_size=10), st.just('../etc'))),
        slot=draw(st.one_of(st.integers(0, 5), uint32s)),
        generation=draw(st.one_of(st.integers(0, 2), uint64s)),
        sequence=draw(st.one_of(st.integers(0, 3), uint64s)),
        buffer_kind=draw(st.integers(0, 255)),
        dtype=draw(st.sampled_from(['float32', 'float16', 'uint8', 'float64', 'bogus'])),
        shape=draw(st.lists(st.one_of(st.sampled_from([1, 16, 64]), uint64s), max_size=4)),
        strides=draw(st.lists(st.integers(-2**63, 2**63 - 1), max_size=3)),
        byte_offset=draw(st.one_of(st.just(0), uint64s)),
        nbytes=draw(st.one_of(st.just(4096), uint64s)))


schemas = st.one_of(
    st.just(''), st.text(max_size=30),
    st.sampled_from(['{"type": "string"}', '{"type": "integer", "maximum": 9}', '[' * 3000,
                     '{"enum": ["a", "b"]}', '{"$ref": "#/$defs/x"}', 'true', '{"type": 7}',
                     '{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}']))


HOSTILE_FIELDS = {
    'prompt': st.one_of(st.just(''), HOSTILE_TEXT),
    'messages': st.lists(st.tuples(
        st.one_of(st.sampled_from(['system', 'user', 'assistant', 'tool']), st.text(max_size=5)),
        HOSTILE_TEXT).map(lambda t: ChatMessage(role=t[0], content=t[1])), max_size=3),
    'system_prompt': HOSTILE_TEXT,
    'sampling': samplings(),
    'max_tokens': st.one_of(st.integers(0, 6), uint32s),
    'stop': st.lists(st.one_of(st.just(''), HOSTILE_TEXT), max_size=3),
    'json_schema': schemas,
    'prefix_embeddings': st.lists(handles(), max_size=2),
    'session_id': st.text(max_size=12),
    'images': st.lists(handles(), max_size=2),    # this model has no vision encoder
    'raw_prompt': st.booleans(),
}


@st.composite
def goals(draw) -> Generate.Goal:
    """Draw a runnable goal with 0-3 fields replaced by hostile values (so some run)."""
    goal = Generate.Goal(prompt='Hello sky', max_tokens=draw(st.integers(1, 6)))
    for field in draw(st.lists(st.sampled_from(sorted(HOSTILE_FIELDS)), max_size=3,
                               unique=True)):
        setattr(goal, field, draw(HOSTILE_FIELDS[field]))
    return goal


def _reservations_all_free(llm: LLMNode) -> None:
    """Every queue slot can be reserved again: no refused goal kept one."""
    worker = llm.worker
    got = [worker.reserve() for _ in range(QUEUE_DEPTH + 1)]
    for ok in got:
        if ok:
            worker.unreserve()
    assert all(got), f'only {sum(got)} of {QUEUE_DEPTH + 1} queue slots are free'


def _validate_and_run(llm: LLMNode, goal) -> str:
    """Do what llm_node does with a goal: refuse it with a message, or run it to the end."""
    job = NodeGoal(None)
    assert llm.admission.admit(job) == ''
    try:
        worker = llm.admission.prepare(goal, job)
    except (InvalidRequestError, WorkerStoppedError) as exc:
        assert str(exc).strip(), f'{type(exc).__name__} without a message'
        return 'refused'
    done = threading.Event()
    box = []
    job.on_done = lambda outcome: (box.append(outcome), done.set())
    worker.submit(job, reserved=True)
    assert done.wait(60), 'the accepted goal never ended'
    result = box[0].result
    assert result.stop_reason in set(StopReason)
    if result.stop_reason is StopReason.ERROR:
        assert result.error.strip()
        return 'error'
    return 'ran'


@fuzz(250)
@given(goal=goals())
@example(goal=Generate.Goal(prompt='x', json_schema='[' * 5000))
@example(goal=Generate.Goal(prompt='x', max_tokens=2**32 - 1))
@example(goal=Generate.Goal(prompt='x', sampling=SamplingParams(temperature=f32(1e-45),
                                                                top_p=0.9)))
@example(goal=Generate.Goal(prompt='x', prefix_embeddings=[TensorHandle(
    pool_id=POOL, slot=0, generation=0, sequence=1, dtype='float32', shape=[16, 64],
    nbytes=4096)]))
def test_random_goals_are_refused_with_a_message_or_run(node, goal):
    event(bounded(lambda: _validate_and_run(node, goal), 90.0, '_prepare + run'))
    _reservations_all_free(node)


def test_a_handle_larger_than_its_pool_is_refused_before_allocating(node, ipc_dir):
    # 256 MiB of float32 [n, hidden=64] rows, named in a pool whose slots hold 4 KiB: the
    # size must be checked against the pool (or the context) from the declared shape, never
    # by allocating, hashing or copying an array of that size while validating.
    rows = (256 << 20) // (64 * 4)
    goal = Generate.Goal(prompt='x', prefix_embeddings=[TensorHandle(
        pool_id=POOL, slot=0, generation=0, sequence=1, dtype='float32', shape=[rows, 64],
        nbytes=rows * 64 * 4)])
    before = _peak_rss()
    with pytest.raises(InvalidRequestError) as err:
        node.admission.prepare(goal, NodeGoal(None))
    grown = _peak_rss() - before
    assert grown < 64 << 20, f'validating the handle raised the peak RSS by {grown >> 20} MiB'
    assert str(POOL_SLOT_BYTES) in str(err.value) or 'context' in str(err.value)


def test_an_image_for_a_text_only_model_is_refused(node, ipc_dir):
    from edge_llm_ros.nodes.handles import to_handle
    goal = Generate.Goal(prompt='<__media__> what is it?', raw_prompt=True,
                         images=[to_handle(ipc_dir.pool.frame)])
    with pytest.raises(InvalidRequestError, match='no vision encoder'):
        node.admission.prepare(goal, NodeGoal(None))
    _reservations_all_free(node)


class _FakeHandle:
    """What on_accepted uses of rclpy's ServerGoalHandle."""

    def __init__(self, request, number: int) -> None:
        self.request = request
        self.goal_id = types.SimpleNamespace(uuid=bytes([number] * 16))
        self.feedback = []
        self.executing = False

    def execute(self) -> None:
        self.executing = True

    def publish_feedback(self, msg) -> None:
        assert self.executing, 'feedback before the goal was executing'
        self.feedback.append(msg)


def test_goals_are_admitted_in_on_goal_and_queued_in_on_accepted(node):
    from rclpy.action import GoalResponse
    action, worker = node.action, node.worker
    # An admitted goal whose accepted callback never comes gives its place back at the next.
    for _ in range(QUEUE_DEPTH + worker.slots + 2):
        assert action.on_goal(Generate.Goal(prompt='Hello sky')) == GoalResponse.ACCEPT
    # The one admitted last is queued with its handle: its feedback goes to it, in order.
    msg = Generate.Goal(prompt='Hello sky', max_tokens=4)
    assert action.on_goal(msg) == GoalResponse.ACCEPT
    handle = _FakeHandle(msg, 1)
    action.on_accepted(handle)
    assert worker.wait_idle(60)
    counts = [chunk.completion_tokens for chunk in handle.feedback if chunk.token_ids]
    assert counts and counts == sorted(counts) and counts[-1] == 4, counts
    # An invalid request is accepted, then ended with its reason in on_accepted: no place kept.
    bad = Generate.Goal(prompt='')
    assert action.on_goal(bad) == GoalResponse.ACCEPT
    action.on_accepted(_FakeHandle(bad, 2))
    _reservations_all_free(node)


def _peak_rss() -> int:
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('VmHWM:'):
                return int(line.split()[1]) * 1024
    raise RuntimeError('no VmHWM')


@fuzz(120)
@given(text=HOSTILE_TEXT, turns=st.lists(st.tuples(st.text(max_size=8), HOSTILE_TEXT),
                                         max_size=3), generation_prompt=st.booleans())
def test_tokenize_answers_every_request(node, text, turns, generation_prompt):
    request = Tokenize.Request(text=text, add_generation_prompt=generation_prompt,
                               messages=[ChatMessage(role=r, content=c) for r, c in turns])
    response = bounded(lambda: node.llm_services.on_tokenize(request, Tokenize.Response()), 30.0,
                       '~/tokenize')
    assert response.success or response.error_message.strip()
    if response.success:
        assert len(response.token_ids) == len(response.tokens)


@pytest.mark.parametrize('error', [
    ModelLoadError('the chat template cannot be rendered: sandbox refused it'),
    RuntimeError('an unexpected bug')])
def test_services_answer_any_error_from_validation_or_the_tokenizer(node, monkeypatch, error):
    # Not only InvalidRequestError: e.g. a template the sandbox refuses raises ModelLoadError
    # from prepare, and an exception escaping a service callback ends the node's process.
    def fail(*args, **kwargs):
        raise error
    engine = node.engine
    monkeypatch.setattr(engine, 'prepare', fail)
    monkeypatch.setattr(engine, 'tokenize', fail)
    answer = node.complete.on_complete(Complete.Request(prompt='x'), Complete.Response())
    with pytest.raises(StopIteration) as finished:
        answer.send(None)  # a refused request is answered before the coroutine awaits
    reply = finished.value.value
    assert not reply.success and str(error) in reply.error_message, reply
    reply = node.llm_services.on_tokenize(Tokenize.Request(text='x'), Tokenize.Response())
    assert not reply.success and str(error) in reply.error_message, reply
    _reservations_all_free(node)


# --- over ROS, against a real node process -------------------------------------------------
def test_dangerous_requests_over_ros_leave_the_node_serving(ros_context, model_dir):
    """Inputs fuzzing found, sent through the real action and services."""
    name = f'llm_fuzz_{os.getpid()}'
    server = '/' + name
    proc = NodeProcess(name, {'autostart': True, 'model.path': str(model_dir),
                              'max_tokens': 4, 'kv.max_context': TINY_CONTEXT})
    ros = None
    try:
        ros = RosClient(f'llm_fuzz_client_{os.getpid()}')
        ros.wait_state(server, 'active', timeout=60)
        llm = ros.llm(server)
        deep = '[' * 5000
        reply = llm.complete('x', json_schema=deep, timeout=60)
        assert not reply.success and 'nested' in reply.error_message, reply
        outcome = llm.generate('x', json_schema=deep).result(timeout=60)
        assert outcome.status == 'aborted' and 'nested' in outcome.error_message
        outcome = llm.generate('x', temperature=f32(1e-45), top_p=0.9).result(timeout=60)
        assert outcome.status == 'succeeded' or outcome.error_message.strip(), outcome
        outcome = llm.generate('x', prefix_embeddings=[TensorHandle(
            pool_id='nobody_serves_this', shape=[1, 64], dtype='float32', nbytes=256)]
        ).result(timeout=60)
        assert outcome.status == 'aborted' and 'nobody_serves_this' in outcome.error_message
        tokens = llm.tokenize(messages=[('root', 'x')], timeout=30)
        assert not tokens.success and 'root' in tokens.error_message
        final = llm.generate('Hello sky', max_tokens=2).result(timeout=60)
        assert final.status == 'succeeded', final
        assert proc.proc.poll() is None, proc.log()
    finally:
        if ros is not None:
            ros.close()
        code = proc.stop()
    assert code == 0, proc.log()
    assert 'Traceback' not in proc.log(), proc.log()
