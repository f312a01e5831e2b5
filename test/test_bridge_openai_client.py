"""The bridge against the real `openai` client, over a real uvicorn server on 127.0.0.1."""
import asyncio
import json

from bridge_fakes import (BACKEND_KINDS, KIND_IDS, MODEL, reasoning_script, serving,
                          text_script, tool_script, tool_to_call, words)
import openai
import pydantic
import pytest

from edge_llm_ros.bridge import BackendUnavailableError, InvalidRequestError, QueueFullError

pytestmark = pytest.mark.timeout(120)
KEY = 'test-key'
WEATHER = {'city': 'Paris', 'temp_c': 21}
TOOL_ARGS = {'get_weather': {'city': 'Paris'}, 'Weather': WEATHER}


class Weather(pydantic.BaseModel):
    city: str
    temp_c: int


def responder(request):
    """Tools -> a call; a JSON schema -> JSON; 'think' -> reasoning; 'fail:*' -> errors."""
    said = request.messages[-1].content if request.messages else request.prompt
    if said == 'fail:queue':
        return [QueueFullError('llm_node queue is full (4 waiting)')]
    if said == 'fail:inactive':
        return [BackendUnavailableError('llm_node is not active: configure and activate it')]
    if said == 'fail:invalid':
        return [InvalidRequestError('messages do not fit the 2048-token context',
                                    param='messages')]
    name = tool_to_call(request)
    if name:
        return tool_script([(name, TOOL_ARGS[name])])
    if request.json_schema:
        return text_script(json.dumps(WEATHER))
    if said == 'think':
        return reasoning_script('The user wants the sky colour.', 'Blue.')
    return text_script(f'You said: {said}. Nothing more to add.')


@pytest.fixture(scope='module', params=BACKEND_KINDS, ids=KIND_IDS)
def server(request):
    yield from serving(request.param(responder), KEY)


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server[1].base_url, api_key=KEY, max_retries=0,
                       timeout=20) as made:
        yield made


def user(text):
    return [{'role': 'user', 'content': text}]


def test_models(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_plain_and_streamed(client, server):
    backend = server[0]
    answer = client.chat.completions.create(model=MODEL, messages=user('hello'),
                                            temperature=0.2, max_completion_tokens=50, seed=3)
    text = 'You said: hello. Nothing more to add.'
    assert answer.choices[0].message.content == text
    assert answer.choices[0].finish_reason == 'stop'
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + len(words(text))
    assert backend.requests[-1].temperature == 0.2 and backend.requests[-1].max_tokens == 50
    stream = client.chat.completions.create(model=MODEL, messages=user('hello'), stream=True,
                                            stream_options={'include_usage': True})
    chunks = list(stream)
    assert ''.join(c.choices[0].delta.content or '' for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == len(words(text))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == 'stop'


def test_reasoning_content_reaches_the_client(client):
    message = client.chat.completions.create(model=MODEL, messages=user('think')).choices[0]
    assert message.message.content == 'Blue.'
    assert message.message.reasoning_content == 'The user wants the sky colour.'
    deltas = [c.choices[0].delta for c in client.chat.completions.create(
        model=MODEL, messages=user('think'), stream=True)]
    assert ''.join(getattr(d, 'reasoning_content', None) or '' for d in deltas) == \
        'The user wants the sky colour.'
    assert ''.join(d.content or '' for d in deltas) == 'Blue.'


WEATHER_TOOL = {'type': 'function', 'function': {
    'name': 'get_weather', 'description': 'Current weather of a city',
    'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}},
                   'required': ['city']}}}


def test_tool_calls_plain_streamed_and_parsed(client, server):
    answer = client.chat.completions.create(model=MODEL, messages=user('weather?'),
                                            tools=[WEATHER_TOOL], tool_choice='required')
    call = answer.choices[0].message.tool_calls[0]
    assert answer.choices[0].finish_reason == 'tool_calls'
    assert call.function.name == 'get_weather'
    assert json.loads(call.function.arguments) == {'city': 'Paris'}
    assert server[0].requests[-1].tools[0].parameters == WEATHER_TOOL['function']['parameters']

    # The SDK's stream helper accumulates argument deltas into a whole call.
    with client.chat.completions.stream(model=MODEL, messages=user('weather?'),
                                        tools=[WEATHER_TOOL]) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls[0]
    assert (streamed.id, streamed.function.name) == ('call_0', 'get_weather')
    assert json.loads(streamed.function.arguments) == {'city': 'Paris'}

    # The tool result goes back as a tool turn.
    follow = user('weather?') + [
        {'role': 'assistant', 'content': None, 'tool_calls': [call.model_dump()]},
        {'role': 'tool', 'tool_call_id': call.id, 'content': '{"temp_c": 21}'}]
    client.chat.completions.create(model=MODEL, messages=follow)
    last = server[0].requests[-1].messages
    assert last[1].tool_calls[0].name == 'get_weather' and last[2].tool_call_id == call.id

    parsed = client.chat.completions.parse(
        model=MODEL, messages=user('weather?'), tools=[openai.pydantic_function_tool(Weather)],
        tool_choice={'type': 'function', 'function': {'name': 'Weather'}})
    call = parsed.choices[0].message.tool_calls[0]
    assert call.function.parsed_arguments == Weather(**WEATHER)


def test_response_format_json_schema(client, server):
    parsed = client.chat.completions.parse(model=MODEL, messages=user('weather as JSON'),
                                           response_format=Weather)
    assert parsed.choices[0].message.parsed == Weather(**WEATHER)
    schema = json.loads(server[0].requests[-1].json_schema)
    assert schema['properties'].keys() == {'city', 'temp_c'}
    plain = client.chat.completions.create(model=MODEL, messages=user('JSON please'),
                                           response_format={'type': 'json_object'})
    assert json.loads(plain.choices[0].message.content) == WEATHER
    assert server[0].requests[-1].json_schema == '{"type": "object"}'


def test_completions(client):
    answer = client.completions.create(model=MODEL, prompt='Once', max_tokens=8)
    assert answer.choices[0].text == 'You said: Once. Nothing more to add.'
    streamed = client.completions.create(model=MODEL, prompt='Once', stream=True)
    assert ''.join(c.choices[0].text for c in streamed) == answer.choices[0].text


def test_errors_are_the_sdks_exceptions(client, server):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model='gpt-4o', messages=user('x'))
    assert caught.value.code == 'model_not_found'
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=user('x'), n=3)
    assert caught.value.param == 'n'
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=user('fail:invalid'))
    assert caught.value.param == 'messages' and '2048' in caught.value.message
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model=MODEL, messages=user('fail:queue'), stream=True)
    assert caught.value.response.headers['retry-after'] == '1'
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model=MODEL, messages=user('fail:inactive'))
    assert caught.value.status_code == 503
    with openai.OpenAI(base_url=server[1].base_url, api_key='wrong', max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


STREAMS = 8
CANCELLED = {1, 4, 6}          # these clients hang up after a few chunks


def long_text(i):
    return ' '.join(f'client{i}-token{k}' for k in range(40)) + '.'


def test_concurrent_streams_with_cancels(server):
    backend, bridge = server
    old = backend.responder, backend.delay_s
    backend.responder = lambda r: text_script(long_text(r.messages[-1].content.split()[-1]))
    backend.delay_s = 0.005

    async def one(client, i):
        stream = await client.chat.completions.create(
            model=MODEL, messages=user(f'client {i}'), stream=True)
        pieces, request_id, finish = [], None, None
        async for chunk in stream:
            request_id = chunk.id
            choice = chunk.choices[0]
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
            if i in CANCELLED and len(pieces) == 5:
                await stream.close()
                break
        return i, request_id, pieces, finish

    async def run_all():
        async with openai.AsyncOpenAI(base_url=bridge.base_url, api_key=KEY, max_retries=0,
                                      timeout=30) as client:
            return await asyncio.gather(*(one(client, i) for i in range(STREAMS)))
    try:
        first = len(backend.requests)
        results = asyncio.run(run_all())
        ids = [r.request_id for r in backend.requests[first:]]
        assert len(ids) == STREAMS and backend.wait_ended(ids)
    finally:
        backend.responder, backend.delay_s = old
    cancelled_ids = set()
    for i, request_id, pieces, finish in results:
        full = long_text(i)
        got = ''.join(pieces)
        if i in CANCELLED:
            cancelled_ids.add(request_id)
            assert len(pieces) == 5 and full.startswith(got), i
            assert backend.ended[request_id] in ('cancelled', 'closed')
        else:
            # every token once, in order: the pieces are exactly the backend's deltas
            assert got == full == backend.sent[request_id], i
            assert pieces == words(full) and finish == 'stop'
            assert backend.ended[request_id] == 'stop'
    assert set(backend.cancelled) & set(ids) == cancelled_ids
