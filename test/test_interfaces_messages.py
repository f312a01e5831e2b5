"""nodes/messages.py: edge_llm_msgs (interface version 2) to engine types and back.

Only translation is checked here (Engine.prepare validates values; test_llm_node_services.py
runs the same fields through a real node).
"""
import json

import pytest

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import ChatMessage, SamplingParams, ToolCall
from edge_llm_msgs.srv import Complete
from edge_llm_ros.client import make_goal
from edge_llm_ros.errors import InvalidRequestError
from edge_llm_ros.nodes import messages
from edge_llm_ros.runtime.sampling import TokenLogprobs
from edge_llm_ros.runtime.tools.parser import ToolCallDelta
from edge_llm_ros.runtime.tools.spec import ToolCall as EngineToolCall
from edge_llm_ros.runtime.types import GenerationResult, SamplingConfig, StopReason, Timings
from edge_llm_ros.serving.worker import tool_call_tail

DEFAULTS = messages.RequestDefaults(
    sampling=SamplingConfig(temperature=0.7, presence_penalty=0.3, frequency_penalty=0.2))


def test_unset_sampling_takes_node_defaults_and_zero_penalties_are_explicit():
    unset = messages.effective_sampling(SamplingParams(), DEFAULTS.sampling)
    assert (unset.presence_penalty, unset.frequency_penalty) == (0.3, 0.2)
    assert unset.logit_bias is None and not unset.logprobs and unset.top_logprobs == 0
    zero = messages.effective_sampling(
        SamplingParams(presence_penalty=0.0, frequency_penalty=0.0, top_logprobs=0),
        DEFAULTS.sampling)
    assert (zero.presence_penalty, zero.frequency_penalty) == (0.0, 0.0)
    assert zero.logprobs and zero.top_logprobs == 0      # 0: the chosen token's only
    assert SamplingParams().presence_penalty == SamplingParams.UNSET_PENALTY < -2.0


def test_logit_bias_arrays_become_a_map_or_a_clear_error():
    params = SamplingParams(logit_bias_token_ids=[5, 9], logit_bias_values=[-100.0, 1.5])
    assert messages.effective_sampling(params, DEFAULTS.sampling).logit_bias == {
        5: -100.0, 9: 1.5}
    with pytest.raises(InvalidRequestError, match='2 entries but logit_bias_values 1'):
        messages.logit_bias([1, 2], [0.5])
    with pytest.raises(InvalidRequestError, match='twice'):
        messages.logit_bias([1, 1], [0.5, 0.5])
    back = messages.sampling_to_msg(messages.effective_sampling(params, DEFAULTS.sampling))
    assert list(back.logit_bias_token_ids) == [5, 9] and back.top_logprobs == -1


@pytest.mark.parametrize('request_type', [Generate.Goal, Complete.Request])
def test_goal_fields_translate_to_the_engine_request(request_type):
    goal = make_goal('go', messages=[
        ChatMessage(role='assistant', content='',
                    tool_calls=[ToolCall(id='c1', name='move', arguments='{"m": 1}')]),
        ChatMessage(role='tool', content='ok', tool_call_id='c1', name='move')],
        tools=[{'name': 'move', 'description': 'Drive', 'parameters': {'type': 'object'}}],
        tool_choice='required', parallel_tool_calls=False, choices=['a', 'b'],
        reasoning=False, reasoning_budget=32, logit_bias={3: 1.0}, top_logprobs=4,
        request_type=request_type)
    request = messages.to_request(goal, DEFAULTS)
    tool, = request.tools
    assert tool['function']['name'] == 'move'
    assert json.loads(tool['function']['parameters']) == {'type': 'object'}
    assert request.tool_choice == 'required' and request.parallel_tool_calls is False
    assert request.choices == ('a', 'b') and request.grammar == request.regex == ''
    assert request.reasoning is False and request.reasoning_budget == 32
    assert request.sampling.logit_bias == {3: 1.0} and request.sampling.top_logprobs == 4
    assistant, answer = request.messages
    assert assistant.tool_calls == (EngineToolCall('c1', 'move', '{"m": 1}'),)
    assert (answer.tool_call_id, answer.name) == ('c1', 'move')


def test_default_goal_means_what_a_version_1_goal_meant():
    request = messages.to_request(Generate.Goal(prompt='hi'), DEFAULTS)
    assert request.tools == () and request.tool_choice == '' and request.parallel_tool_calls
    assert request.reasoning is True and request.reasoning_budget is None
    assert request.grammar == request.regex == '' and request.choices == ()
    assert request.speculative   # version 5: the node's speculative.mode applies


def test_no_speculation_and_speculation_timings_travel():
    goal = make_goal(prompt='hi', no_speculation=True)
    assert goal.no_speculation and not messages.to_request(goal, DEFAULTS).speculative
    assert messages.to_request(Complete.Request(prompt='hi'), DEFAULTS).speculative
    with pytest.raises(TypeError, match='priority/preempt'):
        make_goal(prompt='hi', no_speculation=True, request_type=Complete.Request)
    msg = messages.timings_to_msg(Timings(draft_passes=3, draft_tokens=9,
                                          accepted_draft_tokens=5, decode_steps=7))
    assert (msg.draft_passes, msg.draft_tokens, msg.accepted_draft_tokens,
            msg.decode_steps) == (3, 9, 5, 7)


def test_unknown_reasoning_mode_is_refused():
    goal = Generate.Goal(prompt='hi', reasoning_mode=7)
    with pytest.raises(InvalidRequestError, match='reasoning_mode 7'):
        messages.to_request(goal, DEFAULTS)


def test_result_carries_tool_calls_reasoning_logprobs_and_error_kind():
    result = GenerationResult(
        text='', token_ids=[4, 5], stop_reason=StopReason.TOOL_CALLS, prompt_tokens=3,
        completion_tokens=2, timings=Timings(), reasoning='because',
        tool_calls=[EngineToolCall('c9', 'move', '{}')],
        logprobs=[TokenLogprobs(4, -0.1, ((4, -0.1), (6, -2.0))), TokenLogprobs(5, -0.2)])
    msg = messages.fill_result(Generate.Result(), result,
                               token_strings=lambda ids: [f'<{i}>' for i in ids])
    assert msg.finish_reason == Generate.Result.FINISH_TOOL_CALLS and msg.error_kind == ''
    assert (msg.tool_calls[0].id, msg.tool_calls[0].name) == ('c9', 'move')
    assert msg.reasoning == 'because'
    first, second = msg.logprobs
    assert (first.token, list(first.top_tokens)) == ('<4>', ['<4>', '<6>'])
    assert list(first.top_token_ids) == [4, 6] and second.top_token_ids.tolist() == []
    failed = GenerationResult('', [], StopReason.ERROR, 0, 0, Timings(), error='boom')
    assert messages.error_kind(failed) == Generate.Result.ERROR_FAILED
    assert messages.error_kind(failed, stopped=True) == Generate.Result.ERROR_UNAVAILABLE
    assert messages.error_kind(result) == ''


def test_last_feedback_completes_tool_calls_the_stream_missed():
    calls = [EngineToolCall('c1', 'move', '{"m": 12}'), EngineToolCall('c2', 'stop', '{}')]
    streamed = [ToolCallDelta(0, 'c1', 'move', ''), ToolCallDelta(0, arguments='{"m": 1')]
    tail = tool_call_tail(streamed, calls)
    assert tail == (ToolCallDelta(0, arguments='2}'), ToolCallDelta(1, 'c2', 'stop', '{}'))
    msgs = messages.tool_call_delta_msgs(streamed + list(tail))
    joined = {}
    for delta in msgs:
        joined[delta.index] = joined.get(delta.index, '') + delta.arguments_delta
    assert joined == {0: '{"m": 12}', 1: '{}'}
