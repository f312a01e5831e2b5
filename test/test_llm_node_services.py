"""llm_node's issue-13 interfaces, served by a real node process on the embedded SmolLM2.

~/get_model_info, ~/detokenize and ~/reset_session; a tool call through the action (tools,
tool_choice required, streamed argument deltas, logprobs); and the three refusals a client
must tell apart: queue full, node inactive, invalid goal (docs/interfaces.md).
"""
import json
import os
import threading

from llm_node_harness import (LONG_SCHEMA, served, TRANSITIONS, wait_feedback_delivered,
                              wait_for)
import pytest

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import SamplingParams, Transcript
from edge_llm_ros import client as client_module
from edge_llm_ros.client import (GoalRejectedError, InvalidGoalError, NodeInactiveError,
                                 NodeNotActiveError, QueueFullError)

NODE = f'llm_node_services_{os.getpid()}'
SERVER = '/' + NODE
MOVE = {'name': 'move', 'description': 'Drive the robot straight ahead',
        'parameters': {'type': 'object', 'properties': {'meters': {'type': 'number'}},
                       'required': ['meters']}}
# Tokens of a goal that keeps the node busy for a few seconds (the schema forbids EOS).
BUSY_TOKENS = 40


@pytest.fixture(scope='module', autouse=True)
def patient_streams():
    patch = pytest.MonkeyPatch()
    patch.setattr(client_module, 'FEEDBACK_GRACE_S', 30.0)
    yield
    patch.undo()


@pytest.fixture(scope='module')
def ros():
    # The embedded SmolLM2 (model.path ''). queue.depth 1: one goal runs, one waits, the
    # next is rejected as queue full.
    with served(NODE, {'autostart': True, 'queue.depth': 1, 'max_tokens': 16,
                       'feedback.period_tokens': 2, 'feedback.period_ms': 0},
                f'llm_node_services_client_{os.getpid()}') as client:
        yield client


@pytest.fixture(scope='module')
def transcripts(ros):
    return ros.record(Transcript, SERVER + '/transcript')


@pytest.fixture(scope='module')
def llm(ros, transcripts):
    client = ros.llm(SERVER)
    wait_feedback_delivered(client)
    return client


def _busy(llm, **kwargs):
    return llm.generate('Count', max_tokens=BUSY_TOKENS, json_schema=LONG_SCHEMA, **kwargs)


def test_model_info_reports_the_model_and_its_capabilities(llm):
    info = llm.model_info(timeout=30)
    assert info.success and info.loaded, info.error_message
    assert info.family == 'smollm2' and info.architecture == 'llama'
    assert os.path.isdir(info.model_dir)
    # The display name, and the GGUF's general.name kept raw (issue 37).
    assert info.model_name == 'SmolLM2 135M (llama, Q4_1 + Q8_0)'
    assert info.gguf_name == 'Smollm2 135M 8k Lc100K Mix1 Ep2'
    assert info.vocab_size == 49152 and info.context_length >= 512
    assert '<|im_start|>' in info.chat_template
    assert info.supports_tools and info.supports_embeddings_input
    assert not info.supports_reasoning and info.reasoning_start == ''
    assert info.tool_call_format == 'hermes' and info.providers
    assert info.interface_version == Generate.Goal.INTERFACE_VERSION == 9


def test_detokenize_inverts_tokenize_and_rejects_unknown_ids(llm):
    tokens = llm.tokenize('Hello robot, turn left.', timeout=30)
    assert tokens.success
    text = llm.detokenize(tokens.token_ids, timeout=30)
    assert text.success and text.text == 'Hello robot, turn left.'
    bad = llm.detokenize([1, 10 ** 6], timeout=30)
    assert not bad.success and '1000000' in bad.error_message and 'vocabulary' in \
        bad.error_message


def test_reset_session_drops_a_session_and_never_disturbs_a_running_goal(llm):
    first = llm.generate('Hi', max_tokens=2, session_id='kitchen').result(timeout=60)
    assert first.ok, first
    dropped = llm.reset_session('kitchen', timeout=30)
    assert dropped.success and dropped.dropped == 1, dropped.message
    again = llm.reset_session('kitchen', timeout=30)
    assert again.success and again.dropped == 0       # unknown now: still a success
    # A reset of the running goal's session waits for it: the goal ends normally, then its
    # freshly kept prefix is dropped, before any next goal.
    running = _busy(llm, session_id='garage')
    wait_for(lambda: running.first_feedback_at is not None, 60, 'the busy goal to stream')
    answers = []
    resetter = threading.Thread(
        target=lambda: answers.append(llm.reset_session('garage', timeout=60)))
    resetter.start()
    outcome = running.result(timeout=120)
    resetter.join(timeout=60)
    assert outcome.ok and outcome.finish_reason == 'length'
    assert outcome.completion_tokens == BUSY_TOKENS
    assert answers and answers[0].success and answers[0].dropped == 1, answers
    everything = llm.reset_session('', timeout=30)
    assert everything.success and 'every session' in everything.message


def test_tool_call_through_the_action(llm, transcripts):
    chunks = []
    handle = llm.generate('Drive forward two meters.', tools=[MOVE], tool_choice='required',
                          parallel_tool_calls=False, max_tokens=60, top_logprobs=2,
                          on_feedback=chunks.append)
    outcome = handle.result(timeout=120)
    assert outcome.ok, outcome
    assert outcome.finish_reason == Generate.Result.FINISH_TOOL_CALLS
    call, = outcome.tool_calls
    assert call.name == 'move' and call.id
    assert isinstance(json.loads(call.arguments)['meters'], (int, float))
    assert outcome.text == '' and outcome.reasoning == ''
    # Streamed deltas, joined per index, are the result's call.
    wait_for(lambda: sum(len(c.token_ids) for c in list(chunks)) >= outcome.completion_tokens,
             30, 'every feedback chunk')
    deltas = [d for c in chunks for d in c.tool_call_deltas]
    assert deltas and deltas[0].id == call.id and deltas[0].name == 'move'
    assert ''.join(d.arguments_delta for d in deltas if d.index == 0) == call.arguments
    assert ''.join(c.text_delta for c in chunks) == ''
    # One logprob per token, with its text and at most 2 alternatives.
    assert len(outcome.logprobs) == outcome.completion_tokens
    first = outcome.logprobs[0]
    assert first.token_id == outcome.token_ids[0] and first.token and first.logprob <= 0.0
    assert 1 <= len(first.top_token_ids) <= 2
    assert len(first.top_tokens) == len(first.top_token_ids)
    wait_for(lambda: any(t.tool_calls for t in transcripts), 30, 'the transcript')
    record = next(t for t in transcripts if t.tool_calls)
    assert record.interface_version == Transcript.INTERFACE_VERSION
    assert record.tools[0].name == 'move' and record.tool_choice == 'required'
    assert record.no_parallel_tool_calls and record.tool_calls[0].arguments == call.arguments
    assert record.finish_reason == 'tool_calls' and record.effective_sampling.top_logprobs == 2


def test_unset_penalties_take_the_node_default_and_zero_is_explicit(llm, transcripts):
    plain = llm.generate('Hi', max_tokens=1).result(timeout=60)
    explicit = llm.generate('Hi', max_tokens=1, presence_penalty=0.5,
                            frequency_penalty=0.0).result(timeout=60)
    assert plain.ok and explicit.ok
    wait_for(lambda: len([t for t in transcripts if t.prompt == 'Hi']) >= 2, 30, 'transcripts')
    unset, chosen = [t for t in transcripts if t.prompt == 'Hi'][-2:]
    assert unset.sampling.presence_penalty == SamplingParams.UNSET_PENALTY
    assert unset.effective_sampling.presence_penalty == 0.0          # the node's default
    assert chosen.sampling.presence_penalty == pytest.approx(0.5)
    assert chosen.effective_sampling.presence_penalty == pytest.approx(0.5)
    assert chosen.sampling.frequency_penalty == 0.0


def test_a_client_tells_invalid_goal_queue_full_and_node_inactive_apart(llm, ros):
    # Invalid: accepted, aborted with error_kind invalid_request and what to fix.
    invalid = llm.generate('Go', tools=[MOVE], tool_choice='fly').result(timeout=60)
    assert invalid.status == 'aborted' and invalid.finish_reason == 'error'
    assert invalid.error_kind == Generate.Result.ERROR_INVALID_REQUEST
    with pytest.raises(InvalidGoalError, match='unknown tool') as err:
        invalid.raise_for_error()
    assert err.value.outcome is invalid
    # Queue full: queue.depth 1, one goal running and one waiting.
    running = _busy(llm)
    wait_for(lambda: running.first_feedback_at is not None, 60, 'the busy goal to stream')
    waiting = _busy(llm)
    wait_for(lambda: waiting.queue_position == 1, 30, 'the second goal to wait')
    with pytest.raises(QueueFullError, match='queue is full'):
        llm.generate('Hi', max_tokens=1).result(timeout=30)
    full = llm.complete('Hi', max_tokens=1, timeout=30)
    assert not full.success and full.error_kind == Generate.Result.ERROR_QUEUE_FULL
    for handle in (waiting, running):
        assert handle.cancel()
        assert handle.result(timeout=60).finish_reason == 'cancelled'
    # Inactive: deactivated, the goal is rejected and the client says so.
    assert ros.transition(SERVER, TRANSITIONS['deactivate'])
    try:
        with pytest.raises(NodeInactiveError, match='inactive') as err:
            llm.generate('Hi', max_tokens=1).result(timeout=30)
        assert isinstance(err.value, GoalRejectedError)
        assert isinstance(err.value, NodeNotActiveError)
        refused = llm.complete('Hi', max_tokens=1, timeout=30)
        assert not refused.success
        assert refused.error_kind == Generate.Result.ERROR_UNAVAILABLE
        info = llm.model_info(timeout=30)   # answered in every state
        assert info.success and info.loaded
    finally:
        assert ros.transition(SERVER, TRANSITIONS['activate'])
    assert llm.generate('Hi', max_tokens=1).result(timeout=60).raise_for_error().ok
