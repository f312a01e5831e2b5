"""langchain-openai's ChatOpenAI through the bridge: bind_tools, structured output, streaming."""
import json

from bridge_fakes import (BACKEND_KINDS, KIND_IDS, MODEL, serving, text_script, tool_script,
                          tool_to_call, words)
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
import pydantic
import pytest

pytestmark = pytest.mark.timeout(120)
KEY = 'lc-key'
ANSWER = 'The robot is in the kitchen, next to the red chair.'


class Pose(pydantic.BaseModel):
    """Where the robot should go."""

    x: float
    y: float
    frame: str


POSE = {'x': 1.5, 'y': -0.25, 'frame': 'map'}


@tool
def navigate_to(place: str, speed: float = 0.5) -> str:
    """Drive the robot to a named place."""
    return f'going to {place}'


def responder(request):
    """Call the named (or first) tool; answer JSON for a schema; else say ANSWER."""
    name = tool_to_call(request)
    if name:
        arguments = POSE if name == 'Pose' else {'place': 'kitchen', 'speed': 0.3}
        return tool_script([(name, arguments)])
    if request.json_schema:
        return text_script(json.dumps(POSE))
    return text_script(ANSWER)


@pytest.fixture(scope='module', params=BACKEND_KINDS, ids=KIND_IDS)
def served_backend(request):
    yield from serving(request.param(responder), KEY)


@pytest.fixture
def llm(served_backend):
    return ChatOpenAI(model=MODEL, base_url=served_backend[1].base_url, api_key=KEY,
                      max_retries=0, timeout=20, temperature=0)


def test_invoke_and_stream(llm, served_backend):
    message = llm.invoke('Where is the robot?')
    assert message.content == ANSWER
    assert message.usage_metadata['output_tokens'] == len(words(ANSWER))
    assert served_backend[0].requests[-1].temperature == 0
    chunks = list(llm.stream('Where is the robot?'))
    assert ''.join(c.content for c in chunks) == ANSWER
    assert [c.content for c in chunks if c.content] == words(ANSWER)


def test_bind_tools_invoke_stream_and_tool_turn(llm, served_backend):
    backend = served_backend[0]
    with_tools = llm.bind_tools([navigate_to], tool_choice='required')
    message = with_tools.invoke('Go to the kitchen')
    assert message.tool_calls == [{'name': 'navigate_to', 'args': {'place': 'kitchen',
                                                                   'speed': 0.3},
                                   'id': 'call_0', 'type': 'tool_call'}]
    sent = backend.requests[-1]
    assert [t.name for t in sent.tools] == ['navigate_to'] and sent.tool_choice.mode == 'required'
    assert sent.tools[0].parameters['properties'].keys() == {'place', 'speed'}

    gathered = None
    for chunk in llm.bind_tools([navigate_to]).stream('Go to the kitchen'):
        gathered = chunk if gathered is None else gathered + chunk
    assert gathered.tool_calls[0]['name'] == 'navigate_to'
    assert gathered.tool_calls[0]['args'] == {'place': 'kitchen', 'speed': 0.3}

    history = [HumanMessage('Go to the kitchen'), message,
               ToolMessage('arrived', tool_call_id=message.tool_calls[0]['id'])]
    final = llm.bind_tools([navigate_to], tool_choice='none').invoke(history)
    assert final.content == ANSWER
    roles = [(m.role, m.tool_call_id) for m in backend.requests[-1].messages]
    assert roles == [('user', ''), ('assistant', ''), ('tool', 'call_0')]
    assert isinstance(message, AIMessage)


@pytest.mark.parametrize('method', ['json_schema', 'function_calling', 'json_mode'])
def test_with_structured_output(llm, served_backend, method):
    structured = llm.with_structured_output(Pose, method=method)
    result = structured.invoke('Where should the robot go?')
    assert result == Pose(**POSE)
    sent = served_backend[0].requests[-1]
    if method == 'json_schema':
        assert json.loads(sent.json_schema)['properties'].keys() == POSE.keys()
        assert sent.tools == ()
    elif method == 'function_calling':
        assert sent.tool_choice.name == 'Pose' and sent.json_schema == ''
    else:
        assert sent.json_schema == '{"type": "object"}'


def test_structured_output_streams(llm):
    chunks = list(llm.with_structured_output(Pose, method='function_calling').stream('go'))
    assert chunks[-1] == Pose(**POSE)
