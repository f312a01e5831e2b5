"""openai_bridge as a real process in front of a real llm_node process, driven over HTTP.

The llm_node serves the medium random model; the bridge runs as its console script's module
(`python -m edge_llm_ros.nodes.openai_bridge`) on an ephemeral port with an API key. The
clients are the real `openai` SDK, raw httpx (to drop a connection mid-stream) and
langchain-openai. The node's ~/transcript and /diagnostics show what each request became.
"""
import json
import os
import uuid

from agent_harness import serving_llm, transcript_of
import httpx
from llm_node_harness import LONG_SCHEMA, LONG_TOKENS, TRANSITIONS, wait_for
import openai
import pytest
from tiny_model import tiny_vocab

from edge_llm_ros.node_process import NodeProcess as AnyNodeProcess
from edge_llm_ros.nodes.openai_bridge import wait_serving

pytestmark = pytest.mark.timeout(600)
NODE = f'llm_bridge_test_{os.getpid()}'
SERVER = '/' + NODE
BRIDGE = f'openai_bridge_test_{os.getpid()}'
KEY = 'bridge-test-key'
MODEL = 'edge-test'


@pytest.fixture(scope='module')
def served(tmp_path_factory):
    with serving_llm(tmp_path_factory, NODE, {'queue.depth': 2, 'max_tokens': 8}) as made:
        yield made


@pytest.fixture(scope='module')
def bridge(served):
    proc = AnyNodeProcess('openai_bridge', name=BRIDGE, stop_timeout=30.0,
                          params={'port': 0, 'llm_node': SERVER, 'api_key_env': 'BRIDGE_KEY',
                                  'model_id': MODEL},
                          env={'BRIDGE_KEY': KEY})
    url = wait_serving(proc, timeout=60)
    yield proc, url
    assert proc.stop() == 0, proc.log()
    assert 'Traceback' not in proc.log(), proc.log()


@pytest.fixture(scope='module')
def api(bridge, served):
    with openai.OpenAI(base_url=bridge[1], api_key=KEY, max_retries=0, timeout=120) as made:
        yield made


def _tag() -> str:
    return f'Hello sky {uuid.uuid4().hex[:8]}'


def test_plain_chat_equals_the_action_and_the_transcript(api, served):
    llm, transcripts = served.llm, served.transcripts
    text = _tag()
    reply = api.chat.completions.create(model=MODEL, messages=[{'role': 'user',
                                                                'content': text}],
                                        max_tokens=12, temperature=0)
    direct = llm.generate(messages=[('user', text)], max_tokens=12,
                          temperature=0).result(timeout=120)
    record = transcript_of(transcripts, text)
    assert reply.choices[0].message.content == direct.text == record.text
    assert reply.choices[0].finish_reason == direct.finish_reason == record.finish_reason
    assert reply.usage.completion_tokens == direct.completion_tokens
    assert reply.usage.prompt_tokens == direct.prompt_tokens
    assert reply.model == MODEL


def test_nul_characters_arrive_as_replacement_characters(api, served):
    # Token 3 of the tiny vocabulary is the byte 0x00. ROS strings end at a NUL, so the node
    # sends U+FFFD in its place: the text is not cut there, and streamed deltas (the bridge's
    # stream, the action's feedback) still add up to the result.
    llm, transcripts = served.llm, served.transcripts
    text = _tag()
    # Logits of the random model reach past 100: every other token is pushed down as well.
    only_nul = {str(t): (100 if t == 3 else -100) for t in range(len(tiny_vocab()))}
    reply = api.chat.completions.create(model=MODEL, messages=[{'role': 'user', 'content': text}],
                                        max_tokens=3, temperature=0, logit_bias=only_nul)
    stream = api.chat.completions.create(model=MODEL, messages=[{'role': 'user', 'content': text}],
                                         max_tokens=3, temperature=0, logit_bias=only_nul,
                                         stream=True)
    streamed = ''.join(c.choices[0].delta.content or '' for c in stream if c.choices)
    deltas: list = []
    handle = llm.generate(messages=[('user', text)], max_tokens=3, temperature=0,
                          logit_bias={int(t): float(v) for t, v in only_nul.items()},
                          on_feedback=deltas.append)
    direct = handle.result(timeout=120)
    assert direct.token_ids == [3, 3, 3]
    assert direct.text == '\ufffd' * 3 == reply.choices[0].message.content == streamed
    assert transcript_of(transcripts, text).text == direct.text
    wait_for(lambda: sum(len(d.token_ids) for d in list(deltas)) == 3, 30, 'all feedback')
    assert ''.join(d.text_delta for d in deltas) == direct.text


def test_streaming_deltas_add_up_to_the_result(api, served):
    transcripts = served.transcripts
    text = _tag()
    stream = api.chat.completions.create(
        model=MODEL, messages=[{'role': 'user', 'content': text}], max_tokens=30,
        temperature=0, stream=True, stream_options={'include_usage': True},
        response_format={'type': 'json_schema',
                         'json_schema': {'name': 'long', 'schema': json.loads(LONG_SCHEMA)}})
    deltas, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                deltas.append(choice.delta.content)
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    record = transcript_of(transcripts, text)
    assert ''.join(deltas) == record.text and record.finish_reason == 'length'
    assert reasons == ['length'] and usage.completion_tokens == 30
    assert len(deltas) > 5     # streamed, not one block at the end


def test_dropped_connection_cancels_the_goal(bridge, api, served):
    ros, transcripts = served.ros, served.transcripts
    text = _tag()
    before = int(ros.next_status(SERVER)['goals_cancelled'])
    body = {'model': MODEL, 'messages': [{'role': 'user', 'content': text}], 'stream': True,
            'max_tokens': LONG_TOKENS,
            'response_format': {'type': 'json_schema', 'json_schema': {
                'name': 'long', 'schema': json.loads(LONG_SCHEMA)}}}
    with httpx.Client(timeout=60) as http:
        with http.stream('POST', bridge[1] + '/chat/completions', json=body,
                         headers={'Authorization': f'Bearer {KEY}'}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            got = [line for _, line in zip(range(6), lines) if line.startswith('data:')]
            assert got
        # Leaving the block closed the connection mid-stream.
    record = transcript_of(transcripts, text)
    assert record.finish_reason == 'cancelled' and not record.error_message, record
    assert 0 < len(record.token_ids) < LONG_TOKENS
    wait_for(lambda: int(ros.next_status(SERVER)['goals_cancelled']) > before, 30,
             'goals_cancelled to count the dropped request')


def test_first_request_right_after_start_waits_for_discovery(bridge):
    """A goal sent before the bridge discovered the action server would be lost for good."""
    proc = AnyNodeProcess('openai_bridge', name=f'{BRIDGE}_fresh', stop_timeout=30.0,
                          params={'port': 0, 'llm_node': SERVER})
    try:
        url = wait_serving(proc, timeout=60)
        with openai.OpenAI(base_url=url, api_key='unused', max_retries=0,
                           timeout=60) as fresh:
            reply = fresh.chat.completions.create(
                model='edge-llm', messages=[{'role': 'user', 'content': 'hi'}], max_tokens=2)
        assert reply.choices[0].finish_reason in ('stop', 'length')
    finally:
        assert proc.stop() == 0, proc.log()


def test_invalid_request_is_400_and_node_keeps_serving(api):
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(model=MODEL, messages=[{'role': 'user', 'content': 'x'}],
                                    max_tokens=5000)
    assert 'context' in str(caught.value)
    reply = api.chat.completions.create(model=MODEL, messages=[{'role': 'user',
                                                                'content': 'again'}],
                                        max_tokens=2)
    assert reply.choices[0].finish_reason in ('stop', 'length')


def test_wrong_key_and_unknown_model(bridge):
    with openai.OpenAI(base_url=bridge[1], api_key='wrong', max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    with openai.OpenAI(base_url=bridge[1], api_key=KEY, max_retries=0) as good:
        assert [m.id for m in good.models.list()] == [MODEL]
        with pytest.raises(openai.NotFoundError):
            good.chat.completions.create(model='other', messages=[{'role': 'user',
                                                                   'content': 'x'}])


def test_inactive_node_is_503_then_serves_again(api, served):
    ros = served.ros
    assert ros.transition(SERVER, TRANSITIONS['deactivate'])
    try:
        with pytest.raises(openai.APIStatusError) as caught:
            api.chat.completions.create(model=MODEL, messages=[{'role': 'user',
                                                                'content': 'x'}],
                                        max_tokens=2)
        assert caught.value.status_code == 503
    finally:
        assert ros.transition(SERVER, TRANSITIONS['activate'])
    reply = api.chat.completions.create(model=MODEL, messages=[{'role': 'user',
                                                                'content': 'back'}],
                                        max_tokens=2)
    assert reply.choices[0].message.content is not None


def test_langchain_bind_tools_required(bridge):
    from langchain_openai import ChatOpenAI
    chat = ChatOpenAI(base_url=bridge[1], api_key=KEY, model=MODEL, temperature=0,
                      max_tokens=200, max_retries=0, timeout=120)
    tool = {'type': 'function', 'function': {
        'name': 'move_to', 'description': 'Drive the robot to a named place',
        'parameters': {'type': 'object', 'properties': {
            'place': {'type': 'string', 'enum': ['kitchen', 'garage', 'dock']}},
                       'required': ['place'], 'additionalProperties': False}}}
    reply = chat.bind_tools([tool], tool_choice='required',
                            parallel_tool_calls=False).invoke('Go to the kitchen')
    assert reply.tool_calls, reply
    call = reply.tool_calls[0]
    assert call['name'] == 'move_to'
    assert call['args']['place'] in ('kitchen', 'garage', 'dock')
    assert reply.response_metadata['finish_reason'] == 'tool_calls'


def test_streamed_tool_call_adds_up_to_the_result(api, served):
    transcripts = served.transcripts
    text = f'Go somewhere {uuid.uuid4().hex[:6]}'
    tool = {'type': 'function', 'function': {
        'name': 'move_to', 'parameters': {
            'type': 'object', 'properties': {'place': {'type': 'string',
                                                       'enum': ['kitchen', 'dock']}},
            'required': ['place'], 'additionalProperties': False}}}
    stream = api.chat.completions.create(
        model=MODEL, messages=[{'role': 'user', 'content': text}], tools=[tool],
        tool_choice='required', parallel_tool_calls=False, max_tokens=200, stream=True)
    names, arguments, content, reasons = [], '', '', []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ''
            for call in choice.delta.tool_calls or ():
                if call.function.name:
                    names.append(call.function.name)
                arguments += call.function.arguments or ''
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    record = transcript_of(transcripts, text)
    assert names == ['move_to'] and reasons == ['tool_calls'] and content == ''
    assert [(c.name, json.loads(c.arguments)) for c in record.tool_calls] == [
        ('move_to', json.loads(arguments))]
    assert json.loads(arguments)['place'] in ('kitchen', 'dock')


def test_full_queue_is_429_with_retry_after(bridge, served):
    llm = served.llm
    # queue.depth 2: one running and two waiting fill the node.
    handles = [llm.generate('Count', max_tokens=LONG_TOKENS, json_schema=LONG_SCHEMA)
               for _ in range(3)]
    try:
        assert all(handle.accepted for handle in handles)
        wait_for(lambda: handles[2].queue_position > 0 or handles[0].streamed_text, 30,
                 'the node to run the first goal')
        reply = httpx.post(bridge[1] + '/chat/completions', timeout=60,
                           headers={'Authorization': f'Bearer {KEY}'},
                           json={'model': MODEL, 'max_tokens': 2,
                                 'messages': [{'role': 'user', 'content': 'x'}]})
        assert reply.status_code == 429, reply.text
        assert reply.json()['error']['code'] == 'queue_full'
        assert int(reply.headers['Retry-After']) >= 1
    finally:
        for handle in handles:
            handle.cancel(timeout=10)
        for handle in handles:
            assert handle.result(timeout=60).status == 'canceled'


@pytest.mark.parametrize('params, message', [
    ({'api_key_env': 'EDGE_LLM_NO_SUCH_VARIABLE'}, 'EDGE_LLM_NO_SUCH_VARIABLE'),
    ({'port': 70000}, 'port'),
])
def test_bad_setup_exits_2_saying_why(params, message):
    proc = AnyNodeProcess('openai_bridge', name=f'{BRIDGE}_bad', params=params)
    assert proc.wait_exit(60) == 2, proc.log()
    assert message in proc.log() and 'Traceback' not in proc.log()


def test_busy_port_exits_2_saying_why(bridge):
    port = bridge[1].rsplit(':', 1)[1].split('/')[0]
    proc = AnyNodeProcess('openai_bridge', name=f'{BRIDGE}_busy', params={'port': int(port)})
    assert proc.wait_exit(60) == 2, proc.log()
    assert 'another bridge on that port' in proc.log()
