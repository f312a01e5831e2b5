"""llm_node served as a real process, driven by real rclpy clients over loopback DDS.

One node (autostart, medium random model, queue.depth 2, feedback every 3 tokens) serves
every test of this module; the lifecycle tests have their own processes.
"""
import os
import pathlib
import signal
import subprocess
import sys
import threading

from llm_node_harness import (LONG_SCHEMA, LONG_TOKENS, medium_model_dir, NodeProcess,
                              RosClient, wait_feedback_delivered, wait_for)
import numpy as np
import pytest
from rcl_interfaces.msg import Parameter as ParameterMsg
from rcl_interfaces.msg import ParameterType, ParameterValue
from rcl_interfaces.srv import SetParameters
import rclpy
from tiny_model import EOS_ID

from edge_llm_msgs.msg import TensorHandle, Transcript
from edge_llm_ros import client as client_module
from edge_llm_ros.client import GoalRejectedError
from edge_llm_ros.ipc.pool import PoolConfig, TensorPool
from edge_llm_ros.qos import TRANSCRIPT_DEPTH, TRANSCRIPT_QOS

NODE = f'llm_node_test_{os.getpid()}'
SERVER = '/' + NODE
NODE_MAX_TOKENS = 8
QUEUE_DEPTH = 2
FEEDBACK_TOKENS = 3
# The medium tiny model's display name (family, size, architecture, weight types); its GGUF
# says 'tiny-llama' (docs/architectures.md, "The model's name").
MODEL_NAME = 'Llama 19M (llama, Q4_0 + Q4_1 + Q8_0)'
# How long a stream waits for feedback still in flight after the result. The client's 1 s
# is a latency trade-off for robots; these tests check completeness, on a loaded CI machine.
STREAM_GRACE_S = 30.0


@pytest.fixture(scope='module', autouse=True)
def patient_streams():
    patch = pytest.MonkeyPatch()
    patch.setattr(client_module, 'FEEDBACK_GRACE_S', STREAM_GRACE_S)
    yield
    patch.undo()


@pytest.fixture(scope='module')
def model_dir(tmp_path_factory) -> pathlib.Path:
    return medium_model_dir(tmp_path_factory.mktemp('llm_node_models'))


@pytest.fixture(scope='module')
def ipc_dir(tmp_path_factory) -> str:
    """Where tensor pools of these tests put their sockets (the node is told by env)."""
    return str(tmp_path_factory.mktemp('llm_node_ipc'))


@pytest.fixture(scope='module')
def node_proc(model_dir, ipc_dir):
    proc = NodeProcess(NODE, {'autostart': True, 'model.path': str(model_dir),
                              'queue.depth': QUEUE_DEPTH, 'max_tokens': NODE_MAX_TOKENS,
                              'feedback.period_tokens': FEEDBACK_TOKENS,
                              'feedback.period_ms': 0},
                       env={'EDGE_LLM_IPC_DIR': ipc_dir})
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope='module')
def ros(node_proc):
    rclpy.init()
    client = RosClient(f'llm_node_test_client_{os.getpid()}')
    client.wait_state(SERVER, 'active', timeout=60)
    yield client
    client.close()
    rclpy.shutdown()


@pytest.fixture(scope='module')
def llm(ros):
    client = ros.llm(SERVER)
    wait_feedback_delivered(client)   # the node's feedback publisher has matched us
    return client


@pytest.fixture(scope='module')
def transcripts(ros):
    """Every ~/transcript message of the node (subscribed before the tests send goals)."""
    return ros.record(Transcript, SERVER + '/transcript')


def _long(llm, prompt='Count', **kwargs):
    """Send a goal that runs until max_tokens (the schema forbids EOS)."""
    return llm.generate(prompt, max_tokens=LONG_TOKENS, json_schema=LONG_SCHEMA, **kwargs)


def _check_valid_goal_succeeds(llm) -> None:
    outcome = llm.generate('Hello sky', max_tokens=2).result(timeout=60)
    assert outcome.status == 'succeeded', outcome


def test_stream_is_ordered_and_complete(llm):
    chunks = []
    handle = llm.generate('Hello sky', max_tokens=40, json_schema=LONG_SCHEMA,
                          on_feedback=chunks.append)
    streamed = ''.join(handle.stream(timeout=60))
    outcome = handle.result(timeout=60)
    assert outcome.status == 'succeeded' and outcome.finish_reason == 'length', outcome
    assert outcome.completion_tokens == 40
    assert streamed == outcome.text
    token_chunks = [c for c in chunks if c.queue_position == 0]
    assert [i for c in token_chunks for i in c.token_ids] == outcome.token_ids
    counts = [c.completion_tokens for c in token_chunks]
    assert counts == sorted(counts) and counts[-1] == outcome.completion_tokens
    # The first token goes out alone (low latency), then batches of feedback.period_tokens.
    assert len(token_chunks[0].token_ids) == 1
    assert max(len(c.token_ids) for c in token_chunks) == FEEDBACK_TOKENS
    t = outcome.timings
    assert 0 < t.time_to_first_token_s <= t.total_s
    assert t.decode_tokens_per_second > 0 and t.prefill_tokens > 0


def test_cancel_mid_stream_returns_partial_text(llm):
    handle = _long(llm)
    stream = handle.stream(timeout=120)
    head = [next(stream) for _ in range(3)]
    assert handle.cancel(), 'cancel request refused'
    outcome = handle.result(timeout=60)
    assert outcome.status == 'canceled', outcome
    assert outcome.finish_reason == 'cancelled'
    assert 0 < outcome.completion_tokens < LONG_TOKENS
    assert ''.join(head) + ''.join(stream) == outcome.text
    assert len(outcome.token_ids) == outcome.completion_tokens
    _check_valid_goal_succeeds(llm)


def test_queue_positions_full_queue_rejection_and_queued_cancel(llm, ros, transcripts):
    running = _long(llm, 'first')
    wait_for(lambda: running.first_feedback_at is not None, 60, 'the first goal to run')
    second = llm.generate('second', max_tokens=3)
    third = llm.generate('third', max_tokens=3)
    wait_for(lambda: second.queue_position == 1 and third.queue_position == 2, 30,
             lambda: f'queue positions 1 and 2 (seen: {second.queue_position}, '
                     f'{third.queue_position}; first goal done: {running.done()})')
    assert not running.done(), 'the first goal ended too early; the test needs it running'
    refused = llm.generate('fourth', max_tokens=3)
    with pytest.raises(GoalRejectedError):
        refused.result(timeout=30)
    # Cancelling a waiting goal ends it at once; the one behind moves up.
    assert second.cancel()
    cancelled = second.result(timeout=30)
    assert cancelled.status == 'canceled' and cancelled.finish_reason == 'cancelled'
    assert cancelled.completion_tokens == 0 and cancelled.text == ''
    wait_for(lambda: third.queue_position == 1, 30, 'the third goal to move up')
    assert running.cancel()
    assert running.result(timeout=60).finish_reason == 'cancelled'
    last = third.result(timeout=60)
    assert last.status == 'succeeded' and last.timings.queue_wait_s > 0
    status = ros.next_status(SERVER)
    assert int(status['rejected_queue_full']) >= 1
    wait_for(lambda: any(not t.accepted for t in transcripts), 30, 'refusal transcript')
    refusal = next(t for t in transcripts if not t.accepted)
    assert refusal.prompt == 'fourth' and 'queue full' in refusal.error_message


def test_two_concurrent_clients_get_their_own_results(llm, ros):
    other_node = RosClient(f'llm_node_test_other_{os.getpid()}')
    try:
        other = other_node.llm(SERVER)
        wait_feedback_delivered(other)
        prompts = {'mine': ('Hello sky', 12, llm), 'theirs': ('the blue color of it', 21, other)}
        handles = {k: c.generate(p, max_tokens=n, json_schema=LONG_SCHEMA)
                   for k, (p, n, c) in prompts.items()}
        streamed = {}
        threads = [threading.Thread(target=lambda k=k: streamed.__setitem__(
            k, ''.join(handles[k].stream(timeout=120)))) for k in handles]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for key, (prompt, max_tokens, client) in prompts.items():
            outcome = handles[key].result(timeout=60)
            assert outcome.status == 'succeeded', outcome
            assert outcome.completion_tokens == max_tokens
            assert streamed[key] == outcome.text
            prompt_ids = client.tokenize(messages=[('user', prompt)], timeout=30).token_ids
            assert outcome.prompt_tokens == len(prompt_ids)
    finally:
        other_node.close()


def test_tokenize_and_complete_answered_during_a_long_action(llm, ros):
    running = _long(llm, 'first')
    wait_for(lambda: running.first_feedback_at is not None, 60, 'the action to run')
    tokens = llm.tokenize('Hello sky', timeout=30)
    # Tokenize never waits for the worker: answered while the action still runs.
    assert not running.done()
    assert tokens.success and list(tokens.tokens) == ['Hello', 'Ġsky']
    assert tokens.context_length == 2048
    responses = []
    callers = [threading.Thread(target=lambda: responses.append(
        llm.complete('Hello', max_tokens=4, json_schema=LONG_SCHEMA, timeout=120)))
        for _ in range(2)]
    for caller in callers:
        caller.start()
    # Both calls wait in the queue behind the action (the executor stays free meanwhile).
    wait_for(lambda: ros.next_status(SERVER)['queue_waiting'] == '2', 30, 'two queued calls')
    assert not running.done() and not responses
    assert running.cancel()
    for caller in callers:
        caller.join()
    assert running.result(timeout=60).status == 'canceled'
    assert len(responses) == 2
    for response in responses:
        assert response.success, response.error_message
        assert response.completion_tokens == 4 and response.finish_reason == 'length'
        assert response.timings.queue_wait_s > 0


def test_tokenize_chat_messages(llm):
    plain = llm.tokenize('Hello sky', timeout=30)
    chat = llm.tokenize(messages=[('user', 'Hello sky')], timeout=30)
    bare = llm.tokenize(messages=[('user', 'Hello sky')], add_generation_prompt=False,
                        timeout=30)
    assert chat.success and bare.success
    assert len(chat.token_ids) > len(bare.token_ids) > len(plain.token_ids)
    assert list(chat.token_ids[:len(bare.token_ids)]) == list(bare.token_ids)
    bad = llm.tokenize(messages=[('robot', 'hi')], timeout=30)
    assert not bad.success and 'role' in bad.error_message


BAD_GOALS = {
    'empty prompt and no messages': ({'prompt': ''}, 'empty'),
    'unknown chat role': ({'messages': [('robot', 'hi')]}, 'unknown role'),
    'prompt over the context': ({'prompt': 'x ' * 1500}, 'context'),
    'max_tokens absurdly large': ({'prompt': 'hi', 'max_tokens': 10 ** 9}, 'max_tokens'),
    'negative temperature': ({'prompt': 'hi', 'temperature': -0.5}, 'temperature'),
    'top_p above 1': ({'prompt': 'hi', 'top_p': 1.5}, 'top_p'),
    'negative seed': ({'prompt': 'hi', 'seed': -5}, 'seed'),
    'invalid json schema': ({'prompt': 'hi', 'json_schema': '{"type": "strin'}, 'schema'),
    'unresolvable tensor handle': ({'prompt': 'hi', 'prefix_embeddings': [TensorHandle(
        pool_id='no_such_pool', dtype='float32', shape=[4, 512], nbytes=8192)]},
        'prefix_embeddings'),
}


@pytest.mark.parametrize('case', sorted(BAD_GOALS))
def test_bad_goal_is_aborted_with_a_message_and_node_keeps_serving(llm, case):
    kwargs, expected = BAD_GOALS[case]
    prompt = kwargs.pop('prompt', '')
    outcome = llm.generate(prompt, **kwargs).result(timeout=60)
    assert outcome.status == 'aborted', outcome
    assert outcome.finish_reason == 'error'
    assert expected in outcome.error_message.lower(), outcome.error_message
    _check_valid_goal_succeeds(llm)


def test_prefix_embeddings_come_from_a_tensor_pool_and_are_released(llm, ipc_dir):
    embeddings = (np.random.default_rng(0).standard_normal((4, 512)) * 0.02).astype(np.float32)
    config = PoolConfig(pool_id=f'llm_test_emb_{os.getpid()}', slot_nbytes=embeddings.nbytes,
                        slots=4, socket_dir=ipc_dir)
    with TensorPool(config) as pool:
        handle = pool.publish_array(embeddings).to_msg(TensorHandle())
        plain = llm.generate('Hello sky', max_tokens=2).result(timeout=60)
        outcome = llm.generate('Hello sky', max_tokens=2,
                               prefix_embeddings=[handle]).result(timeout=60)
        assert outcome.status == 'succeeded', outcome
        assert outcome.prompt_tokens == plain.prompt_tokens + 4
        # The node held the frame only while generating. Its release travels on the pool's
        # socket and the result over DDS: the pool's thread may read it just after.
        assert pool.stats().consumers, 'the node never connected to the pool'
        wait_for(lambda: all(c.held == 0 for c in pool.stats().consumers), 30,
                 lambda: f'the node to release the frame ({pool.stats().consumers})')
        # Rewriting every slot makes the handle stale: aborted with the producer's reason.
        for _ in range(config.slots):
            pool.publish_array(embeddings)
        stale = llm.generate('Hello sky', max_tokens=2,
                             prefix_embeddings=[handle]).result(timeout=60)
        assert stale.status == 'aborted' and 'prefix_embeddings[0]' in stale.error_message
        _check_valid_goal_succeeds(llm)


def test_bad_complete_request_fails_with_the_same_message(llm):
    response = llm.complete('hi', temperature=-0.5, timeout=30)
    assert not response.success and response.finish_reason == 'error'
    assert 'temperature' in response.error_message
    ok = llm.complete('hi', max_tokens=3, timeout=60)
    assert ok.success and ok.completion_tokens <= 3


def test_max_tokens_zero_takes_the_node_default(llm):
    outcome = llm.generate('Hello', json_schema=LONG_SCHEMA).result(timeout=60)
    assert outcome.status == 'succeeded' and outcome.completion_tokens == NODE_MAX_TOKENS


def test_session_second_turn_reuses_the_kv_prefix(llm):
    def conversation(first_prompt: str, session: str) -> tuple:
        first = llm.generate(messages=[('user', first_prompt)], session_id=session,
                             max_tokens=4).result(timeout=60)
        # Another request with a different system prompt overwrites the live KV cache.
        llm.generate('the color', system_prompt='another system prompt',
                     max_tokens=2).result(timeout=60)
        second = llm.generate(messages=[('user', first_prompt), ('assistant', first.text),
                                        ('user', 'and then?')], session_id=session,
                              max_tokens=2).result(timeout=60)
        assert first.status == second.status == 'succeeded'
        return first, second

    first, second = conversation('Hello sky is blue', 'robot-session-1')
    assert second.timings.cached_prompt_tokens >= first.prompt_tokens
    assert second.timings.prefill_tokens < second.prompt_tokens
    # The same two turns without a session id: the first turn's prefix is gone.
    first, second = conversation('Colors on a sky at night', '')
    assert second.timings.cached_prompt_tokens < first.prompt_tokens


def test_diagnostics_report_the_engine(llm, ros):
    llm.generate('Hello sky', max_tokens=5).result(timeout=60)
    status = ros.next_status(SERVER)
    assert status['level'] == 0, status
    assert status['state'] == 'active' and status['message'] == 'ready'
    assert status['model'] == MODEL_NAME and status['gguf_name'] == 'tiny-llama'
    assert status['queue_depth'] == str(QUEUE_DEPTH) and status['queue_waiting'] == '0'
    assert float(status['last_ttft_ms']) > 0
    assert float(status['decode_tokens_per_second']) > 0
    assert status['kv_capacity_tokens'] == '2048'
    assert 0 < int(status['kv_used_tokens']) <= 2048
    assert 50 < float(status['rss_mb']) < 4096
    assert 'soc_temperature_c' in status and 'thermal.level' in status
    assert int(status['goals_succeeded']) >= 1
    assert status['load_error'] == ''


def _set_parameter(ros, name: str, value: ParameterValue):
    request = SetParameters.Request(parameters=[ParameterMsg(name=name, value=value)])
    return ros.call(SetParameters, SERVER + '/set_parameters', request).results[0]


def test_runtime_parameters_change_defaults_and_transcript_shows_them(
        llm, ros, transcripts):
    try:
        result = _set_parameter(ros, 'sampling.top_k', ParameterValue(
            type=ParameterType.PARAMETER_INTEGER, integer_value=5))
        assert result.successful, result.reason
        # top_p's range is (0, 1]: ROS ranges are closed, the schema check refuses 0.
        refused = _set_parameter(ros, 'sampling.top_p', ParameterValue(
            type=ParameterType.PARAMETER_DOUBLE, double_value=0.0))
        assert not refused.successful and 'top_p' in refused.reason
        read_only = _set_parameter(ros, 'queue.depth', ParameterValue(
            type=ParameterType.PARAMETER_INTEGER, integer_value=5))
        assert not read_only.successful
        prompt = 'Hello sky with new defaults'
        # <|endoftext|> (0) and EOS biased away: exactly max_tokens tokens whatever the draws.
        outcome = llm.generate(prompt, max_tokens=3, seed=7,
                               logit_bias={0: -100.0, EOS_ID: -100.0}).result(timeout=60)
        wait_for(lambda: any(t.prompt == prompt for t in transcripts), 30,
                 'the transcript of the goal')
        record = next(t for t in transcripts if t.prompt == prompt)
        assert record.accepted
        assert record.source == Transcript.SOURCE_ACTION
        assert record.effective_sampling.top_k == 5 and record.effective_sampling.seed == 7
        assert record.sampling.top_k == -1   # the request as received
        assert record.text == outcome.text and record.finish_reason == outcome.finish_reason
        assert record.model == MODEL_NAME and record.completion_tokens == 3
    finally:
        _set_parameter(ros, 'sampling.top_k', ParameterValue(
            type=ParameterType.PARAMETER_INTEGER, integer_value=0))


def test_a_transcript_subscriber_that_starts_late_gets_the_last_records(llm, ros):
    # ~/transcript is transient-local: a recorder started after the goals ended still gets
    # the last TRANSCRIPT_DEPTH records, in order.
    prompts = [f'late subscriber {os.getpid()} {i}' for i in range(3)]
    for prompt in prompts:
        assert llm.generate(prompt, max_tokens=2).result(timeout=60).status == 'succeeded'
    received: list = []
    subscription = ros.node.create_subscription(
        Transcript, SERVER + '/transcript', received.append, TRANSCRIPT_QOS)
    try:
        wait_for(lambda: sum(t.prompt in prompts for t in list(received)) == len(prompts), 30,
                 lambda: f'the late subscriber received {[t.prompt for t in received]}')
    finally:
        ros.node.destroy_subscription(subscription)
    assert [t.prompt for t in received][-len(prompts):] == prompts
    # Two tokens end at the length limit, or earlier at an end token (the prompt holds the pid,
    # so the text differs from run to run).
    assert all(t.accepted and t.finish_reason in ('length', 'stop')
               for t in received[-len(prompts):])
    assert len(received) <= TRANSCRIPT_DEPTH


def _ask(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, '-m', 'edge_llm_ros.cli', 'ask', *args,
                             '--server', SERVER], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ))


def test_ask_streams_the_answer_with_timings(llm):
    proc = _ask('Hello sky', '--max-tokens', '6', '--json-schema', LONG_SCHEMA)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.startswith('"')   # the constrained JSON string (random bytes may be partial)
    assert '[length: ' in err and '6 generated' in err and 'TTFT' in err


def test_ask_without_a_node_says_what_to_check():
    proc = subprocess.run([sys.executable, '-m', 'edge_llm_ros.cli', 'ask', 'Hi', '--server',
                           f'/no_llm_node_{os.getpid()}', '--wait', '1'], capture_output=True,
                          text=True, env=dict(os.environ), timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert 'never answered on get_state' in proc.stderr and 'ROS_DOMAIN_ID' in proc.stderr
    assert 'Traceback' not in proc.stderr and 'terminate called' not in proc.stderr


def test_ask_ctrl_c_cancels_the_goal_and_prints_the_partial_answer(llm):
    proc = _ask('Count', '--max-tokens', str(LONG_TOKENS), '--json-schema', LONG_SCHEMA)
    # One raw byte: a buffered read could take more from the pipe than it returns, and
    # communicate() below reads the pipe itself, so what the buffer held would be lost.
    first = os.read(proc.stdout.fileno(), 1).decode()   # the answer is streaming
    assert first == '"', proc.stderr.read()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert '--- partial answer ---' in out and '[cancelled: ' in err
    streamed, partial = (first + out).split('\n--- partial answer ---\n', 1)
    # What was printed before Ctrl-C is the start of the partial answer the node returned.
    assert partial.rstrip('\n').startswith(streamed) and partial.startswith('"')
    _check_valid_goal_succeeds(llm)
