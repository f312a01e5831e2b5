"""The OpenAI bridge app with a scripted backend: shapes, conversions, errors, disconnects."""
import json
import socket
import time

from bridge_fakes import (AsyncFakeBackend, BACKEND_KINDS, FakeBackend, HOLD, KIND_IDS, MODEL,
                          reasoning_script, served, text_script, tool_script)
from fastapi.testclient import TestClient
import httpx
import pytest

from edge_llm_ros.bridge import (BackendUnavailableError, BridgeConfig, BridgeStartError,
                                 create_app, Finished, InvalidRequestError, QueueFullError,
                                 run_bridge, TextDelta, TokenLogprob, ToolChoice, TopLogprob,
                                 Usage)

pytestmark = pytest.mark.timeout(60)
TEXT = 'The sky is blue because air scatters short wavelengths more.'


def chat_body(**extra):
    return {'model': MODEL, 'messages': [{'role': 'user', 'content': 'hi'}], **extra}


def sse_events(response):
    """Decode an SSE body into its JSON chunks; the last item is the literal '[DONE]'."""
    out = []
    for line in response.iter_lines():
        if line.startswith('data: '):
            data = line[len('data: '):]
            out.append(data if data == '[DONE]' else json.loads(data))
    return out


@pytest.fixture(params=BACKEND_KINDS, ids=KIND_IDS)
def kind(request):
    return request.param


def make_client(backend, **config):
    return TestClient(create_app(backend, BridgeConfig(**config)))


# ---- models ----------------------------------------------------------------------------------
def test_models_lists_the_backends_ids():
    client = make_client(FakeBackend(models=['a-model', 'b-model']))
    body = client.get('/v1/models').json()
    assert body['object'] == 'list'
    assert [m['id'] for m in body['data']] == ['a-model', 'b-model']
    assert all(m['object'] == 'model' and m['owned_by'] == 'edge_llm_ros' for m in body['data'])
    assert client.get('/v1/models/b-model').json()['id'] == 'b-model'
    missing = client.get('/v1/models/nope')
    assert missing.status_code == 404
    assert missing.json()['error']['code'] == 'model_not_found'


# ---- chat, plain -----------------------------------------------------------------------------
def test_chat_plain_answer_and_request_mapping(kind):
    backend = kind(lambda r: text_script(TEXT))
    client = make_client(backend)
    body = client.post('/v1/chat/completions', json=chat_body(
        messages=[{'role': 'developer', 'content': 'be brief'},
                  {'role': 'user', 'content': [{'type': 'text', 'text': 'why'},
                                               {'type': 'text', 'text': 'blue?'}],
                   'name': 'ann'}],
        max_tokens=10, max_completion_tokens=20, temperature=0.3, top_p=0.9, seed=7,
        stop='END', presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={'42': -100},
        user='someone', store=False)).json()
    assert body['object'] == 'chat.completion' and body['id'].startswith('chatcmpl-')
    assert body['model'] == MODEL
    choice = body['choices'][0]
    assert choice['message'] == {'role': 'assistant', 'content': TEXT}
    assert choice['finish_reason'] == 'stop' and choice['index'] == 0
    words = len(TEXT.split(' '))
    assert body['usage'] == {'prompt_tokens': 5, 'completion_tokens': words,
                             'total_tokens': 5 + words}
    request = backend.requests[0]
    assert request.request_id == body['id'] and request.is_chat and not request.stream
    assert [(m.role, m.content, m.name) for m in request.messages] == [
        ('system', 'be brief', ''), ('user', 'why\nblue?', 'ann')]
    assert request.max_tokens == 20          # max_completion_tokens wins
    assert (request.temperature, request.top_p, request.seed) == (0.3, 0.9, 7)
    assert request.stop == ('END',)
    assert (request.presence_penalty, request.frequency_penalty) == (0.5, -0.5)
    assert request.logit_bias == {42: -100.0}
    assert request.tools == () and request.tool_choice == ToolChoice('none')
    assert request.json_schema == ''


def test_chat_defaults_leave_everything_to_the_backend():
    backend = FakeBackend(lambda r: text_script('ok'))
    make_client(backend).post('/v1/chat/completions', json=chat_body())
    request = backend.requests[0]
    assert request.max_tokens == 0 and request.temperature is None and request.top_p is None
    assert request.seed is None and request.stop == () and request.reasoning is None
    assert not request.logprobs and request.logit_bias == {}


def test_reasoning_goes_to_reasoning_content(kind):
    backend = kind(lambda r: reasoning_script('Rayleigh scattering, short waves.', 'Blue.'))
    client = make_client(backend)
    body = client.post('/v1/chat/completions', json=chat_body()).json()
    message = body['choices'][0]['message']
    assert message['content'] == 'Blue.'
    assert message['reasoning_content'] == 'Rayleigh scattering, short waves.'
    assert body['usage']['completion_tokens_details'] == {'reasoning_tokens': 4}
    with client.stream('POST', '/v1/chat/completions', json=chat_body(stream=True)) as resp:
        chunks = sse_events(resp)[:-1]
    thinking = ''.join(c['choices'][0]['delta'].get('reasoning_content', '') for c in chunks)
    answer = ''.join(c['choices'][0]['delta'].get('content', '') for c in chunks)
    assert (thinking, answer) == ('Rayleigh scattering, short waves.', 'Blue.')
    assert not any('reasoning_content' in c['choices'][0]['delta']
                   and 'content' in c['choices'][0]['delta'] for c in chunks)


@pytest.mark.parametrize('fields, expected', [
    ({'reasoning_effort': 'none'}, False), ({'reasoning_effort': 'high'}, True),
    ({'chat_template_kwargs': {'enable_thinking': False}, 'reasoning_effort': 'high'}, False),
    ({'reasoning_budget': 64}, None)])
def test_reasoning_switches(fields, expected):
    backend = FakeBackend(lambda r: text_script('ok'))
    assert make_client(backend).post('/v1/chat/completions',
                                     json=chat_body(**fields)).status_code == 200
    assert backend.requests[0].reasoning is expected
    assert backend.requests[0].reasoning_budget == fields.get('reasoning_budget', 0)


# ---- chat, streamed --------------------------------------------------------------------------
def test_chat_stream_chunks(kind):
    backend = kind(lambda r: text_script(TEXT))
    client = make_client(backend)
    with client.stream('POST', '/v1/chat/completions',
                       json=chat_body(stream=True, stream_options={'include_usage': True})) as r:
        assert r.status_code == 200
        assert r.headers['content-type'].startswith('text/event-stream')
        events = sse_events(r)
    assert events[-1] == '[DONE]'
    chunks = events[:-1]
    assert all(c['object'] == 'chat.completion.chunk' for c in chunks)
    assert len({c['id'] for c in chunks}) == 1
    assert chunks[0]['choices'][0]['delta'] == {'role': 'assistant', 'content': ''}
    content = [c['choices'][0]['delta']['content'] for c in chunks[1:-2]]
    assert ''.join(content) == TEXT and len(content) == len(TEXT.split(' '))
    assert chunks[-2]['choices'][0] == {'index': 0, 'delta': {}, 'logprobs': None,
                                        'finish_reason': 'stop'}
    assert chunks[-1]['choices'] == [] and chunks[-1]['usage']['completion_tokens'] == len(
        content)
    assert all(c['choices'][0]['finish_reason'] is None for c in chunks[:-2])
    assert backend.requests[0].stream and backend.cancelled == []


def test_tool_calls_plain_and_streamed(kind):
    calls = [('get_weather', {'city': 'Paris', 'unit': 'celsius'}), ('get_time', {'tz': 'CET'})]
    backend = kind(lambda r: tool_script(calls))
    client = make_client(backend)
    weather = {'name': 'get_weather', 'description': 'Weather now',
               'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}},
                              'required': ['city']}}
    tools = [{'type': 'function', 'function': weather},
             {'type': 'function', 'function': {'name': 'get_time'}}]
    body = client.post('/v1/chat/completions', json=chat_body(
        tools=tools, tool_choice='required', parallel_tool_calls=False)).json()
    choice = body['choices'][0]
    assert choice['finish_reason'] == 'tool_calls'
    assert choice['message']['content'] is None
    got = [(c['id'], c['type'], c['function']['name'], json.loads(c['function']['arguments']))
           for c in choice['message']['tool_calls']]
    assert got == [('call_0', 'function', 'get_weather', calls[0][1]),
                   ('call_1', 'function', 'get_time', calls[1][1])]
    request = backend.requests[0]
    assert [t.name for t in request.tools] == ['get_weather', 'get_time']
    assert request.tools[0].parameters['required'] == ['city']
    assert request.tools[0].description == 'Weather now'
    assert request.tools[1].parameters == {'type': 'object', 'properties': {}}
    assert request.tool_choice == ToolChoice('required') and not request.parallel_tool_calls

    named = {'type': 'function', 'function': {'name': 'get_time'}}
    with client.stream('POST', '/v1/chat/completions',
                       json=chat_body(tools=tools, tool_choice=named, stream=True)) as r:
        chunks = sse_events(r)[:-1]
    assert backend.requests[1].tool_choice == ToolChoice('named', 'get_time')
    deltas = [c['choices'][0]['delta']['tool_calls'][0] for c in chunks
              if 'tool_calls' in c['choices'][0]['delta']]
    assert deltas[0] == {'index': 0, 'id': 'call_0', 'type': 'function',
                         'function': {'name': 'get_weather',
                                      'arguments': deltas[0]['function']['arguments']}}
    assert all(set(d) == {'index', 'function'} and set(d['function']) == {'arguments'}
               for d in deltas[1:3])
    for index, (name, arguments) in enumerate(calls):
        text = ''.join(d['function']['arguments'] for d in deltas if d['index'] == index)
        assert json.loads(text) == arguments
    assert chunks[-1]['choices'][0]['finish_reason'] == 'tool_calls'


def test_tool_call_ids_are_made_when_the_backend_has_none():
    backend = FakeBackend(lambda r: tool_script([('f', {})], call_ids=False))
    tools = [{'type': 'function', 'function': {'name': 'f'}}]
    body = make_client(backend).post('/v1/chat/completions',
                                     json=chat_body(tools=tools)).json()
    call_id = body['choices'][0]['message']['tool_calls'][0]['id']
    assert call_id.startswith('call_') and len(call_id) > 10
    assert backend.requests[0].tool_choice == ToolChoice('auto')


def test_tool_turns_in_messages_reach_the_backend():
    backend = FakeBackend(lambda r: text_script('It is 21 C in Paris.'))
    messages = [
        {'role': 'user', 'content': 'Weather in Paris?'},
        {'role': 'assistant', 'content': None, 'tool_calls': [{
            'id': 'call_9', 'type': 'function',
            'function': {'name': 'get_weather', 'arguments': '{"city": "Paris"}'}}]},
        {'role': 'tool', 'tool_call_id': 'call_9', 'content': '{"temp": 21}'}]
    response = make_client(backend).post('/v1/chat/completions', json=chat_body(
        messages=messages))
    assert response.status_code == 200
    assistant, tool = backend.requests[0].messages[1:]
    assert assistant.role == 'assistant' and assistant.content == ''
    assert [(c.id, c.name, json.loads(c.arguments)) for c in assistant.tool_calls] == [
        ('call_9', 'get_weather', {'city': 'Paris'})]
    assert (tool.role, tool.tool_call_id, tool.content) == ('tool', 'call_9', '{"temp": 21}')


def test_response_format_becomes_a_json_schema():
    backend = FakeBackend(lambda r: text_script('{"a": 1}'))
    client = make_client(backend)
    schema = {'type': 'object', 'properties': {'a': {'type': 'integer'}}, 'required': ['a']}
    client.post('/v1/chat/completions', json=chat_body(response_format={
        'type': 'json_schema', 'json_schema': {'name': 'thing', 'schema': schema,
                                               'strict': True}}))
    client.post('/v1/chat/completions', json=chat_body(response_format={'type': 'json_object'}))
    client.post('/v1/chat/completions', json=chat_body(response_format={'type': 'text'}))
    assert [r.json_schema for r in backend.requests] == [json.dumps(schema),
                                                         '{"type": "object"}', '']


def logprob_script(request):
    tokens = [TokenLogprob('Hi', -0.1, (TopLogprob('Hi', -0.1), TopLogprob('Hey', -2.5))),
              TokenLogprob(' there', -0.4, (TopLogprob(' there', -0.4),))]
    return [TextDelta('Hi', tokens[:1]), TextDelta(' there', tokens[1:]),
            Finished('length', Usage(3, 2))]


def test_chat_logprobs(kind):
    backend = kind(logprob_script)
    client = make_client(backend)
    body = client.post('/v1/chat/completions',
                       json=chat_body(logprobs=True, top_logprobs=2)).json()
    assert backend.requests[0].logprobs and backend.requests[0].top_logprobs == 2
    content = body['choices'][0]['logprobs']['content']
    assert [(t['token'], t['logprob']) for t in content] == [('Hi', -0.1), (' there', -0.4)]
    assert content[0]['bytes'] == list(b'Hi')
    assert [t['token'] for t in content[0]['top_logprobs']] == ['Hi', 'Hey']
    assert body['choices'][0]['finish_reason'] == 'length'
    with client.stream('POST', '/v1/chat/completions',
                       json=chat_body(logprobs=True, stream=True)) as r:
        chunks = sse_events(r)[:-1]
    streamed = [t['token'] for c in chunks if c['choices'][0]['logprobs']
                for t in c['choices'][0]['logprobs']['content']]
    assert streamed == ['Hi', ' there']
    plain = client.post('/v1/chat/completions', json=chat_body()).json()
    assert plain['choices'][0]['logprobs'] is None


# ---- completions -----------------------------------------------------------------------------
def test_completions_plain_stream_echo_logprobs(kind):
    backend = kind(logprob_script)
    client = make_client(backend)
    body = client.post('/v1/completions', json={'model': MODEL, 'prompt': 'Say:',
                                                'max_tokens': 2, 'logprobs': 1}).json()
    assert body['object'] == 'text_completion' and body['id'].startswith('cmpl-')
    choice = body['choices'][0]
    assert choice['text'] == 'Hi there' and choice['finish_reason'] == 'length'
    assert choice['logprobs'] == {'tokens': ['Hi', ' there'], 'token_logprobs': [-0.1, -0.4],
                                  'top_logprobs': [{'Hi': -0.1, 'Hey': -2.5},
                                                   {' there': -0.4}],
                                  'text_offset': [0, 2]}
    request = backend.requests[0]
    assert request.prompt == 'Say:' and request.messages == () and not request.is_chat
    assert request.max_tokens == 2 and request.top_logprobs == 1
    echoed = client.post('/v1/completions', json={'model': MODEL, 'prompt': ['Say:'],
                                                  'echo': True}).json()
    assert echoed['choices'][0]['text'] == 'Say:Hi there'
    with client.stream('POST', '/v1/completions',
                       json={'model': MODEL, 'prompt': 'Say:', 'stream': True}) as r:
        events = sse_events(r)
    assert events[-1] == '[DONE]'
    assert ''.join(c['choices'][0]['text'] for c in events[:-1]) == 'Hi there'
    assert events[-2]['choices'][0]['finish_reason'] == 'length'


# ---- bad input -------------------------------------------------------------------------------
def tool(name='f', parameters=None):
    function = {'name': name}
    if parameters is not None:
        function['parameters'] = parameters
    return {'type': 'function', 'function': function}


BAD_CHAT = [
    ('no messages', {'model': MODEL}, 'messages'),
    ('empty messages', chat_body(messages=[]), 'messages'),
    ('bad role', chat_body(messages=[{'role': 'robot', 'content': 'x'}]), 'messages[0].role'),
    ('temperature type', chat_body(temperature='hot'), 'temperature'),
    ('temperature range', chat_body(temperature=3.5), 'temperature'),
    ('top_p zero', chat_body(top_p=0), 'top_p'),
    ('n=2', chat_body(n=2), 'n'),
    ('negative seed', chat_body(seed=-5), 'seed'),
    ('max_tokens 0', chat_body(max_tokens=0), 'max_tokens'),
    ('empty stop', chat_body(stop=['']), 'stop'),
    ('logit_bias key', chat_body(logit_bias={'abc': 1}), 'logit_bias'),
    ('logit_bias value', chat_body(logit_bias={'5': 500}), 'logit_bias'),
    ('top_logprobs alone', chat_body(top_logprobs=3), 'top_logprobs'),
    ('image_url without an image', chat_body(messages=[{'role': 'user', 'content': [
        {'type': 'image_url', 'image_url': {'url': 'data:,'}}]}]),
     'messages[0].content[0].image_url.url'),
    ('audio content', chat_body(messages=[{'role': 'user', 'content': [
        {'type': 'input_audio', 'input_audio': {'data': '', 'format': 'wav'}}]}]),
     'messages[0].content[0].type'),
    ('user without content', chat_body(messages=[{'role': 'user'}]), 'messages[0].content'),
    ('tool without id', chat_body(messages=[{'role': 'tool', 'content': 'x'}]),
     'messages[0].tool_call_id'),
    ('bad call arguments', chat_body(messages=[{'role': 'assistant', 'tool_calls': [
        {'id': 'c', 'type': 'function', 'function': {'name': 'f', 'arguments': '{oops'}}]}]),
     'messages[0].tool_calls[0].function.arguments'),
    ('call arguments not an object', chat_body(messages=[{'role': 'assistant', 'tool_calls': [
        {'id': 'c', 'type': 'function', 'function': {'name': 'f', 'arguments': '[1]'}}]}]),
     'messages[0].tool_calls[0].function.arguments'),
    ('tool name', chat_body(tools=[tool('has space')]), 'tools[0]'),
    ('tool schema type', chat_body(tools=[tool(parameters={'type': 'objekt'})]), 'tools[0]'),
    ('tool schema not for an object', chat_body(tools=[tool(parameters={'type': 'string'})]),
     'tools[0]'),
    ('tool schema not object', chat_body(tools=[tool(parameters=[1])]),
     'tools[0].function.parameters'),
    ('duplicate tools', chat_body(tools=[tool(), tool()]), 'tools'),
    ('unknown tool_choice', chat_body(tools=[tool()], tool_choice={
        'type': 'function', 'function': {'name': 'g'}}), 'tool_choice'),
    ('tool_choice word', chat_body(tools=[tool()], tool_choice='always'), 'tool_choice'),
    ('required without tools', chat_body(tool_choice='required'), 'tool_choice'),
    ('tools and json_schema', chat_body(tools=[tool()], response_format={
        'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': {'type': 'object'}}}),
     'response_format'),
    ('json_schema without schema', chat_body(response_format={
        'type': 'json_schema', 'json_schema': {'name': 'x'}}), 'response_format.json_schema'),
    ('bad json_schema', chat_body(response_format={
        'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': {'type': 5}}}),
     'response_format.json_schema.schema'),
    ('enable_thinking type', chat_body(chat_template_kwargs={'enable_thinking': 'yes'}),
     'chat_template_kwargs.enable_thinking'),
]


@pytest.mark.parametrize('body, param', [case[1:] for case in BAD_CHAT],
                         ids=[case[0] for case in BAD_CHAT])
def test_bad_chat_requests_get_400_naming_the_field(body, param):
    backend = FakeBackend()
    response = make_client(backend).post('/v1/chat/completions', json=body)
    assert response.status_code == 400, response.text
    error = response.json()['error']
    assert set(error) == {'message', 'type', 'param', 'code'}
    assert error['type'] == 'invalid_request_error' and error['param'] == param
    assert error['message']
    assert backend.requests == []


BAD_COMPLETIONS = [
    ('token prompt', {'prompt': [1, 2, 3]}, 'prompt'),
    ('batch prompt', {'prompt': ['a', 'b']}, 'prompt'),
    ('empty prompt', {'prompt': ''}, 'prompt'),
    ('suffix', {'prompt': 'a', 'suffix': 'b'}, 'suffix'),
    ('best_of', {'prompt': 'a', 'best_of': 3}, 'best_of'),
    ('logprobs range', {'prompt': 'a', 'logprobs': 9}, 'logprobs'),
    ('n', {'prompt': 'a', 'n': 3}, 'n'),
]


@pytest.mark.parametrize('body, param', [case[1:] for case in BAD_COMPLETIONS],
                         ids=[case[0] for case in BAD_COMPLETIONS])
def test_bad_completion_requests_get_400(body, param):
    backend = FakeBackend()
    response = make_client(backend).post('/v1/completions', json={'model': MODEL, **body})
    assert response.status_code == 400, response.text
    assert response.json()['error']['param'] == param
    assert backend.requests == []


def test_http_level_bad_input():
    backend = FakeBackend()
    client = make_client(backend, max_body_bytes=2000)
    not_json = client.post('/v1/chat/completions', content=b'{"model": ',
                           headers={'content-type': 'application/json'})
    assert not_json.status_code == 400
    assert not_json.json()['error']['type'] == 'invalid_request_error'
    assert 'not valid JSON' in not_json.json()['error']['message']
    binary = client.post('/v1/chat/completions', content=b'\xff\xfe\x00')
    assert binary.status_code == 400
    deep = make_client(backend).post('/v1/chat/completions',
                                     content=b'[' * 100000 + b']' * 100000)
    assert deep.status_code == 400 and 'not valid JSON' in deep.json()['error']['message']
    array = client.post('/v1/chat/completions', json=[chat_body()])
    assert array.status_code == 400 and 'JSON object' in array.json()['error']['message']
    big = chat_body(messages=[{'role': 'user', 'content': 'x' * 5000}])
    too_large = client.post('/v1/chat/completions', json=big)
    assert too_large.status_code == 413
    assert too_large.json()['error']['code'] == 'request_too_large'

    def chunked():          # no Content-Length: the limit is counted while reading
        for _ in range(10):
            yield b' ' * 500
    assert client.post('/v1/chat/completions', content=chunked()).status_code == 413
    unknown_model = client.post('/v1/chat/completions', json=chat_body(model='gpt-4o'))
    assert unknown_model.status_code == 404
    assert unknown_model.json()['error'] == {
        'message': unknown_model.json()['error']['message'], 'type': 'invalid_request_error',
        'param': 'model', 'code': 'model_not_found'}
    assert MODEL in unknown_model.json()['error']['message']
    route = client.get('/v2/whatever')
    assert route.status_code == 404 and 'error' in route.json()
    method = client.get('/v1/chat/completions')
    assert method.status_code == 405 and method.json()['error']['message']
    assert backend.requests == []
    assert client.post('/v1/chat/completions', json=chat_body()).status_code == 200


def test_a_session_header_names_the_conversation_and_stateless_is_the_default():
    backend = FakeBackend(lambda r: text_script('ok'))
    client = make_client(backend)
    assert client.post('/v1/chat/completions', json=chat_body()).status_code == 200
    response = client.post('/v1/chat/completions', json=chat_body(),
                           headers={'X-Session-Id': 'kitchen robot'})
    assert response.status_code == 200
    assert [r.session_id for r in backend.requests] == ['', 'kitchen robot']
    for bad in ('x' * 129, 'a\tb'):
        response = client.post('/v1/chat/completions', json=chat_body(),
                               headers={'X-Session-Id': bad})
        assert response.status_code == 400, bad
        assert response.json()['error']['param'] == 'X-Session-Id'
    assert len(backend.requests) == 2


def test_bearer_token():
    backend = FakeBackend()
    client = make_client(backend, api_key='s3cret')
    for headers in ({}, {'Authorization': 'Bearer wrong'}, {'Authorization': 's3cret'},
                    {'Authorization': 'Basic s3cret'}):
        response = client.post('/v1/chat/completions', json=chat_body(), headers=headers)
        assert response.status_code == 401, headers
        assert response.json()['error']['code'] == 'invalid_api_key'
        assert response.headers['www-authenticate'] == 'Bearer'
        assert client.get('/v1/models', headers=headers).status_code == 401
    assert backend.requests == []
    good = {'Authorization': 'Bearer s3cret'}
    assert client.post('/v1/chat/completions', json=chat_body(), headers=good).status_code == 200
    assert client.get('/v1/models', headers=good).status_code == 200


# ---- backend errors --------------------------------------------------------------------------
@pytest.mark.parametrize('error, status, code', [
    (InvalidRequestError('prompt too long for the context', param='messages'), 400, None),
    (QueueFullError('llm_node queue is full', retry_after_s=1.5), 429, 'queue_full'),
    (BackendUnavailableError('llm_node is not active'), 503, 'model_not_ready'),
    (RuntimeError('boom'), 500, None)])
@pytest.mark.parametrize('stream', [False, True])
def test_backend_errors_before_the_first_event(kind, error, status, code, stream):
    backend = kind(lambda r: [error])
    client = make_client(backend)
    response = client.post('/v1/chat/completions', json=chat_body(stream=stream))
    assert response.status_code == status
    body = response.json()['error']
    assert body['code'] == code and str(error) in body['message']
    if status == 429:
        assert response.headers['retry-after'] == '2'
    if status == 400:
        assert body['param'] == 'messages'
    assert backend.cancelled == []
    assert client.post('/v1/completions', json={'model': MODEL, 'prompt': 'x'}).status_code == \
        status


def test_backend_errors_mid_stream_and_failed_generation(kind):
    script = [TextDelta('partial '), BackendUnavailableError('llm_node went inactive')]
    client = make_client(kind(lambda r: script))
    with client.stream('POST', '/v1/chat/completions', json=chat_body(stream=True)) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[1]['choices'][0]['delta']['content'] == 'partial '
    assert events[-2]['error']['code'] == 'model_not_ready' and events[-1] == '[DONE]'

    failed = [TextDelta('x'), Finished('error', error_message='decode failed: NaN logits')]
    client = make_client(kind(lambda r: failed))
    plain = client.post('/v1/chat/completions', json=chat_body())
    assert plain.status_code == 500
    assert plain.json()['error'] == {'message': 'decode failed: NaN logits',
                                     'type': 'server_error', 'param': None,
                                     'code': 'generation_failed'}
    with client.stream('POST', '/v1/chat/completions', json=chat_body(stream=True)) as r:
        events = sse_events(r)
    assert events[-2]['error']['code'] == 'generation_failed'

    client = make_client(kind(lambda r: [TextDelta('no end')]))
    assert client.post('/v1/chat/completions', json=chat_body()).status_code == 500
    with client.stream('POST', '/v1/chat/completions', json=chat_body(stream=True)) as r:
        events = sse_events(r)
    assert events[-2]['error']['code'] == 'incomplete_generation'


def test_server_side_cancel_is_finish_reason_abort():
    client = make_client(FakeBackend(lambda r: [TextDelta('a'), Finished('cancelled')]))
    body = client.post('/v1/chat/completions', json=chat_body()).json()
    assert body['choices'][0]['finish_reason'] == 'abort'


# ---- config and server -----------------------------------------------------------------------
def test_config_checks():
    assert BridgeConfig().host == '127.0.0.1' and BridgeConfig().is_loopback
    assert BridgeConfig(host='localhost').is_loopback and BridgeConfig(host='::1').is_loopback
    assert not BridgeConfig(host='0.0.0.0').is_loopback
    for bad in ({'port': 70000}, {'host': ''}, {'max_body_bytes': 0},
                {'shutdown_timeout_s': -1}):
        with pytest.raises(ValueError):
            BridgeConfig(**bad)


def test_run_bridge_binds_loopback_on_an_ephemeral_port_and_stops():
    backend = FakeBackend()
    bridge = run_bridge(backend, BridgeConfig(port=0))
    try:
        assert bridge.host == '127.0.0.1' and bridge.port > 0
        assert bridge.base_url == f'http://127.0.0.1:{bridge.port}/v1'
        assert httpx.get(f'{bridge.base_url}/models').json()['data'][0]['id'] == MODEL
        with pytest.raises(BridgeStartError, match='cannot listen'):
            run_bridge(backend, BridgeConfig(port=bridge.port))
    finally:
        bridge.stop()
    assert not bridge.running
    with pytest.raises(OSError):
        socket.create_connection(('127.0.0.1', bridge.port), timeout=1).close()


def test_stop_cancels_streams_still_open(kind):
    backend = kind(lambda r: [TextDelta('a'), HOLD, TextDelta('b'), Finished('stop')])
    bridge = run_bridge(backend, BridgeConfig(port=0, shutdown_timeout_s=0.5))
    with httpx.stream('POST', f'{bridge.base_url}/chat/completions',
                      json=chat_body(stream=True), timeout=10) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if '"content":"a"' in line)
        started = time.monotonic()
        bridge.stop()
        assert time.monotonic() - started < 5.0
    assert backend.wait_cancelled(1, timeout=5.0)
    assert backend.wait_ended([backend.requests[0].request_id])


# ---- dropped connections ---------------------------------------------------------------------
def raw_post(port, path, body):
    """Send a request on a plain socket (to close it at will); return the socket."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(('127.0.0.1', port), timeout=10)
    sock.sendall(f'POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
                 f'Content-Length: {len(data)}\r\n\r\n'.encode() + data)
    return sock


@pytest.mark.parametrize('script', [
    [TextDelta('one '), TextDelta('two '), HOLD, TextDelta('never'), Finished('stop')],
    [HOLD, TextDelta('never'), Finished('stop')]], ids=['mid-stream', 'before-first-token'])
def test_dropped_stream_cancels_the_backend_request(kind, script):
    backend = kind(lambda r: script if r.messages[-1].content == 'hi' else text_script('fine'))
    with served(backend) as bridge:
        sock = raw_post(bridge.port, '/v1/chat/completions', chat_body(stream=True))
        if script[0] is not HOLD:
            received = b''
            while b'two ' not in received:
                received += sock.recv(4096)
            assert b'200 OK' in received
        else:
            assert backend.wait_requests(1)     # in the backend, no byte sent yet
            time.sleep(0.1)
        assert backend.cancelled == []
        sock.close()
        assert backend.wait_cancelled(1, timeout=5.0)
        request_id = backend.requests[0].request_id
        assert backend.cancelled == [request_id]
        assert backend.wait_ended([request_id])
        # A sync backend sees the cancel; an async one is also cancelled where it awaits.
        assert backend.ended[request_id] == 'cancelled' or (
            kind is AsyncFakeBackend and backend.ended[request_id] == 'closed')
        assert 'never' not in backend.sent[request_id]
        # The server goes on serving.
        again = chat_body(messages=[{'role': 'user', 'content': 'again'}])
        assert httpx.post(f'{bridge.base_url}/chat/completions', json=again,
                          timeout=10).status_code == 200


def test_dropped_plain_request_cancels_the_backend_request(kind):
    backend = kind(lambda r: [TextDelta('one '), HOLD, Finished('stop')])
    with served(backend) as bridge:
        sock = raw_post(bridge.port, '/v1/chat/completions', chat_body())
        assert backend.wait_requests(1)
        time.sleep(0.1)
        sock.close()
        assert backend.wait_cancelled(1, timeout=5.0)
        assert backend.wait_ended([backend.requests[0].request_id])


def test_finished_requests_are_not_cancelled(kind):
    backend = kind(lambda r: text_script(TEXT))
    with served(backend) as bridge:
        for stream in (False, True):
            response = httpx.post(f'{bridge.base_url}/chat/completions',
                                  json=chat_body(stream=stream), timeout=10)
            assert response.status_code == 200
    assert len(backend.requests) == 2 and backend.cancelled == []
