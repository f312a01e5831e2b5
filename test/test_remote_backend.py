"""engine.backend remote: RemoteEngine over HTTP, and llm_node forwarding to another node.

First RemoteEngine alone against the project's bridge serving a scripted backend (real
uvicorn, real httpx): streaming, reasoning and tool-call deltas, cancel, server errors and
what is refused. Then the whole chain in processes: llm_node A (local model) <- openai_bridge
<- llm_node B (engine.backend remote): B's stream equals A's greedy result, and a cancel on B
ends A's goal as cancelled.
"""
import json
import os
import threading
import uuid

from agent_harness import transcript_of
from bridge_fakes import (FakeBackend, HOLD, MODEL, reasoning_script, served, text_script,
                          tool_script)
from llm_node_harness import (LONG_SCHEMA, LONG_TOKENS, medium_model_dir, NodeProcess,
                              RosClient, wait_feedback_delivered, wait_for)
import numpy as np
import pytest

from edge_llm_ros.bridge import BridgeConfig, QueueFullError
from edge_llm_ros.errors import (ContextOverflowError, InvalidRequestError, InvalidSamplingError,
                                 ModelLoadError)
from edge_llm_ros.runtime.types import ChatMessage, GenerationRequest, SamplingConfig, StopReason
from edge_llm_ros.serving.remote import (REMOTE_TOKEN_ID, RemoteConfig, RemoteEngine,
                                         RemoteUnsupportedError)

pytestmark = pytest.mark.timeout(600)
KEY_ENV = 'REMOTE_TEST_KEY'


def responder(request):
    said = request.messages[-1].content if request.messages else request.prompt
    if said == 'hold':
        return [HOLD]
    if said == 'busy':
        return [QueueFullError('queue full (2 waiting)')]
    if said == 'think':
        return reasoning_script('The sky scatters blue light.', 'Blue.')
    if request.tools:
        return tool_script([(request.tools[0].name, {'place': 'kitchen'})])
    return text_script(f'You said: {said}. Fine.')


@pytest.fixture(scope='module')
def fake():
    backend = FakeBackend(responder)
    with served(backend, BridgeConfig(port=0, api_key='k')) as bridge:
        yield backend, bridge


@pytest.fixture
def engine(fake, monkeypatch):
    monkeypatch.setenv(KEY_ENV, 'k')
    made = RemoteEngine(RemoteConfig(url=fake[1].base_url, api_key_env=KEY_ENV,
                                     context_length=512))
    yield made
    made.close()


def _run(engine, request):
    generation = engine.generate(engine.prepare(request))
    events = list(generation)
    return events, generation.result


def test_streams_text_and_sends_the_request(engine, fake):
    assert engine.model_name == MODEL and engine.kv_occupancy() == (0, 0)
    request = GenerationRequest(messages=[ChatMessage('user', 'hi')], system_prompt='Be brief',
                                max_tokens=20, stop=('END',),
                                sampling=SamplingConfig(temperature=0.5, top_p=0.9, seed=3))
    events, result = _run(engine, request)
    assert ''.join(e.text_delta for e in events) == result.text == 'You said: hi. Fine.'
    assert len(events) > 2 and all(e.token_id == REMOTE_TOKEN_ID for e in events)
    assert [e.index for e in events] == list(range(len(events)))
    assert result.stop_reason is StopReason.STOP and result.completion_tokens == len(events)
    assert result.prompt_tokens == 5 and result.timings.total_s > 0
    sent = fake[0].requests[-1]
    assert [(m.role, m.content) for m in sent.messages] == [
        ('system', 'Be brief'), ('user', 'hi')]
    assert (sent.temperature, sent.top_p, sent.seed, sent.max_tokens, sent.stop) == (
        0.5, 0.9, 3, 20, ('END',))


def test_json_schema_is_sent_as_response_format(engine, fake):
    schema = {'type': 'object', 'properties': {'a': {'type': 'integer'}}}
    _run(engine, GenerationRequest(prompt='x', json_schema=json.dumps(schema)))
    assert json.loads(fake[0].requests[-1].json_schema) == schema


def test_reasoning_and_tool_calls_stream_apart(engine):
    events, result = _run(engine, GenerationRequest(prompt='think'))
    assert ''.join(e.reasoning_delta for e in events) == result.reasoning == \
        'The sky scatters blue light.'
    assert result.text == 'Blue.'
    tools = [{'type': 'function', 'function': {'name': 'go', 'parameters': {
        'type': 'object', 'properties': {'place': {'type': 'string'}}}}}]
    events, result = _run(engine, GenerationRequest(prompt='go', tools=tools,
                                                    tool_choice='required'))
    assert result.stop_reason is StopReason.TOOL_CALLS
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ('go', {'place': 'kitchen'})]
    assert sum(len(e.tool_call_deltas) for e in events) == 3


def test_cancel_closes_the_stream_and_the_server_cancels(engine, fake):
    generation = engine.generate(engine.prepare(GenerationRequest(prompt='hold')))
    seen = []
    thread = threading.Thread(target=lambda: seen.extend(generation))
    thread.start()
    assert fake[0].wait_requests(len(fake[0].requests) + 0, timeout=10)
    wait_for(lambda: fake[0].requests and fake[0].requests[-1].messages[-1].content == 'hold',
             10, 'the held request at the server')
    generation.cancel()
    thread.join(10)
    assert not thread.is_alive()
    assert generation.result.stop_reason is StopReason.CANCELLED and not seen
    request_id = fake[0].requests[-1].request_id
    assert fake[0].wait_ended([request_id], timeout=10)
    assert fake[0].ended[request_id] == 'cancelled'


def test_server_errors_end_the_generation_with_its_message(engine):
    events, result = _run(engine, GenerationRequest(prompt='busy'))
    assert not events and result.stop_reason is StopReason.ERROR
    assert '429' in result.error and 'queue full' in result.error


def test_prepare_refuses_what_cannot_be_forwarded(engine):
    with pytest.raises(InvalidSamplingError):
        engine.prepare(GenerationRequest(prompt='x', sampling=SamplingConfig(top_p=2.0)))
    with pytest.raises(ContextOverflowError):
        engine.prepare(GenerationRequest(prompt='x', max_tokens=512))
    with pytest.raises(InvalidRequestError):
        engine.prepare(GenerationRequest(prompt=''))
    with pytest.raises(InvalidRequestError, match='role'):
        engine.prepare(GenerationRequest(messages=[ChatMessage('robot', 'x')]))
    with pytest.raises(RemoteUnsupportedError, match='prefix_embeddings'):
        engine.prepare(GenerationRequest(prompt='x',
                                         prefix_embeddings=np.zeros((2, 8), np.float32)))
    with pytest.raises(RemoteUnsupportedError, match='images cannot be sent'):
        engine.prepare(GenerationRequest(prompt='<__media__>x',
                                         images=[np.zeros((4, 4, 3), np.uint8)]))
    with pytest.raises(InvalidRequestError, match='json_schema'):
        engine.prepare(GenerationRequest(prompt='x', json_schema='{nope'))
    with pytest.raises(RemoteUnsupportedError, match='tokenizer'):
        engine.tokenize('x')
    with pytest.raises(RemoteUnsupportedError, match='tokenizer'):
        engine.detokenize([1])


def test_the_factory_takes_typed_configs():
    # The node reads engine.backend and remote.* into these once (nodes/llm_config.py).
    from edge_llm_ros.bringup import parameters
    from edge_llm_ros.serving.backends import engine_factory
    from edge_llm_ros.serving.engine import Engine, EngineConfig
    values = dict(parameters.schema('llm_node').defaults(), **{
        'engine.backend': 'remote', 'remote.url': 'http://10.0.0.2:8000/v1'})
    remote = RemoteConfig(**parameters.remote_kwargs(values))
    made = engine_factory(EngineConfig(), remote)
    assert (made.func, made.args) == (RemoteEngine, (remote,))
    assert remote.url == 'http://10.0.0.2:8000/v1' and remote.timeout_s == 30.0
    local = EngineConfig(max_context=64)
    made = engine_factory(local)
    assert (made.func, made.args) == (Engine, (local,))


def test_load_errors_say_what_to_fix(fake, monkeypatch):
    with pytest.raises(ModelLoadError, match='remote.url'):
        RemoteEngine(RemoteConfig(url=''))
    with pytest.raises(ModelLoadError, match='unreachable'):
        RemoteEngine(RemoteConfig(url='http://127.0.0.1:9/v1', timeout_s=2))
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ModelLoadError, match=KEY_ENV):
        RemoteEngine(RemoteConfig(url=fake[1].base_url, api_key_env=KEY_ENV))
    monkeypatch.setenv(KEY_ENV, 'wrong')
    with pytest.raises(ModelLoadError, match='401'):
        RemoteEngine(RemoteConfig(url=fake[1].base_url, api_key_env=KEY_ENV))
    monkeypatch.setenv(KEY_ENV, 'k')
    with pytest.raises(ModelLoadError, match='does not serve'):
        RemoteEngine(RemoteConfig(url=fake[1].base_url, api_key_env=KEY_ENV, model='other'))


# ---- llm_node (remote) -> openai_bridge -> llm_node (local), all processes -----------------
LOCAL = f'llm_local_{os.getpid()}'
REMOTE = f'llm_remote_{os.getpid()}'


@pytest.fixture(scope='module')
def chain(tmp_path_factory):
    import rclpy
    from edge_llm_msgs.msg import Transcript
    from edge_llm_ros import client as client_module
    from edge_llm_ros.node_process import NodeProcess as AnyNodeProcess
    from edge_llm_ros.nodes.openai_bridge import wait_serving
    patch = pytest.MonkeyPatch()
    patch.setattr(client_module, 'FEEDBACK_GRACE_S', 30.0)
    model = medium_model_dir(tmp_path_factory.mktemp('remote_models'))
    # No prefix reuse: a reused prefix may decode other greedy tokens than a full prefill.
    local = NodeProcess(LOCAL, {'autostart': True, 'model.path': str(model),
                                'feedback.period_tokens': 1, 'kv.prefix_reuse': False})
    bridge = AnyNodeProcess('openai_bridge', name=f'bridge_{os.getpid()}',
                            params={'port': 0, 'llm_node': '/' + LOCAL})
    url = wait_serving(bridge, 60)
    remote = NodeProcess(REMOTE, {'autostart': True, 'engine.backend': 'remote',
                                  'remote.url': url, 'feedback.period_tokens': 1})
    rclpy.init()
    ros = RosClient(f'remote_test_client_{os.getpid()}')
    try:
        ros.wait_state('/' + LOCAL, 'active', timeout=120)
        ros.wait_state('/' + REMOTE, 'active', timeout=60)
        transcripts = ros.record(Transcript, f'/{LOCAL}/transcript')
        local_llm, remote_llm = ros.llm('/' + LOCAL), ros.llm('/' + REMOTE)
        wait_feedback_delivered(local_llm)
        wait_feedback_delivered(remote_llm)
        yield ros, local_llm, remote_llm, transcripts
    finally:
        ros.close()
        rclpy.shutdown()
        codes = [proc.stop() for proc in (remote, bridge, local)]
        patch.undo()
        assert codes == [0, 0, 0], remote.log() + bridge.log() + local.log()


def test_remote_stream_equals_the_local_greedy_result(chain):
    ros, local_llm, remote_llm, _ = chain
    text = f'Hello sky {uuid.uuid4().hex[:6]}'
    direct = local_llm.generate(messages=[('user', text)], max_tokens=24, temperature=0,
                                json_schema=LONG_SCHEMA).result(timeout=120)
    handle = remote_llm.generate(messages=[('user', text)], max_tokens=24, temperature=0,
                                 json_schema=LONG_SCHEMA)
    streamed = ''.join(handle.stream(timeout=120))
    outcome = handle.result(timeout=120)
    assert outcome.status == 'succeeded' and outcome.finish_reason == 'length'
    assert streamed == outcome.text == direct.text
    assert outcome.prompt_tokens == direct.prompt_tokens
    status = ros.next_status('/' + REMOTE)
    assert status['providers'] == 'remote'


def test_cancel_on_the_remote_node_cancels_the_local_goal(chain):
    ros, _, remote_llm, transcripts = chain
    text = f'Count {uuid.uuid4().hex[:6]}'
    chunks = []
    handle = remote_llm.generate(messages=[('user', text)], max_tokens=LONG_TOKENS,
                                 json_schema=LONG_SCHEMA, on_feedback=chunks.append)
    wait_for(lambda: sum(len(c.token_ids) for c in list(chunks)) >= 3, 60,
             'the first tokens through the chain')
    assert handle.cancel(timeout=10)
    outcome = handle.result(timeout=60)
    assert outcome.status == 'canceled' and outcome.finish_reason == 'cancelled'
    record = transcript_of(transcripts, text)
    assert record.finish_reason == 'cancelled' and not record.error_message
    assert len(record.token_ids) < LONG_TOKENS


def test_tokenize_on_the_remote_node_says_why_not(chain):
    _, _, remote_llm, _ = chain
    response = remote_llm.tokenize('hello', timeout=30)
    assert not response.success and 'remote' in response.error_message


def test_tool_calls_come_back_through_the_remote_node(chain):
    _, _, remote_llm, transcripts = chain
    text = f'Go {uuid.uuid4().hex[:6]}'
    tool = {'type': 'function', 'function': {'name': 'move_to', 'parameters': {
        'type': 'object', 'properties': {'place': {'type': 'string',
                                                   'enum': ['kitchen', 'dock']}},
        'required': ['place'], 'additionalProperties': False}}}
    chunks = []
    outcome = remote_llm.generate(messages=[('user', text)], tools=[tool],
                                  tool_choice='required', parallel_tool_calls=False,
                                  max_tokens=200, on_feedback=chunks.append).result(timeout=120)
    assert outcome.status == 'succeeded' and outcome.finish_reason == 'tool_calls', outcome
    local = transcript_of(transcripts, text)
    assert [(c.name, json.loads(c.arguments)) for c in outcome.tool_calls] == [
        (c.name, json.loads(c.arguments)) for c in local.tool_calls]
    assert json.loads(outcome.tool_calls[0].arguments)['place'] in ('kitchen', 'dock')
    wait_for(lambda: sum(len(c.token_ids) for c in list(chunks)) >= outcome.completion_tokens,
             30, 'the last feedback')
    streamed = ''.join(d.arguments_delta for c in list(chunks) for d in c.tool_call_deltas)
    assert json.loads(streamed) == json.loads(outcome.tool_calls[0].arguments)
