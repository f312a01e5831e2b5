"""TextTokenizer on the real SmolLM2 vocabulary: encode/decode, chat template, streaming."""
import shutil

from hypothesis import given, HealthCheck, settings, strategies as st
import jinja2
import pytest
from smollm2_files import write_text_model_dir

from edge_llm_ros.errors import InvalidRequestError, ModelLoadError
from edge_llm_ros.runtime.tokenizer import TextTokenizer
from edge_llm_ros.runtime.types import ChatMessage

FIXTURE_CHECKS = [HealthCheck.function_scoped_fixture]


@pytest.fixture(scope='module')
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp('text_model')
    write_text_model_dir(out)
    return out


@pytest.fixture(scope='module')
def tok(model_dir):
    return TextTokenizer.from_dir(model_dir)


def _copy_dir(model_dir, tmp_path):
    dst = tmp_path / 'model'
    shutil.copytree(model_dir, dst)
    return dst


# --- loading -------------------------------------------------------------------------------

def test_special_ids_from_model_yaml(tok):
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids[0] == 2 and 0 in tok.eos_token_ids
    assert tok.add_bos_token is False
    assert tok.vocab_size == 49152


@pytest.mark.parametrize('name', ['tokenizer.json', 'chat_template.jinja', 'model.yaml'])
def test_missing_file_is_a_load_error(model_dir, tmp_path, name):
    d = _copy_dir(model_dir, tmp_path)
    (d / name).unlink()
    with pytest.raises(ModelLoadError, match=name):
        TextTokenizer.from_dir(d)


@pytest.mark.parametrize('name, text, words', [
    ('tokenizer.json', '{"not": "a tokenizer"', 'not a valid tokenizer'),
    ('model.yaml', 'bos_token_id: [1', 'not valid YAML'),
    ('model.yaml', 'bos_token_id: 999999\neos_token_ids: [2]', 'outside the vocabulary'),
    ('model.yaml', 'bos_token_id: one\neos_token_ids: [2]', 'must be integers'),
    ('chat_template.jinja', '{% for m in messages %}', 'does not compile'),
])
def test_corrupt_files_are_load_errors(model_dir, tmp_path, name, text, words):
    d = _copy_dir(model_dir, tmp_path)
    (d / name).write_text(text)
    with pytest.raises(ModelLoadError, match=words):
        TextTokenizer.from_dir(d)


# --- encode / decode -----------------------------------------------------------------------

@pytest.mark.parametrize('text', ['Hello world', 'naïve café 😀🤖', 'def f(x):\n\treturn x', ''])
def test_encode_decode_roundtrip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_token_strings(tok):
    ids = tok.encode('Hello world')
    strings = tok.token_strings(ids)
    assert len(strings) == len(ids) and strings[1].startswith('Ġ')
    assert tok.token_strings([1]) == ['<|im_start|>']
    with pytest.raises(InvalidRequestError, match='outside the vocabulary'):
        tok.token_strings([tok.vocab_size])


# --- chat template -------------------------------------------------------------------------

def test_chat_template_matches_plain_jinja_render(tok, model_dir):
    source = (model_dir / 'chat_template.jinja').read_text()
    plain = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(source)
    messages = [{'role': 'system', 'content': 'Be brief.'},
                {'role': 'user', 'content': 'Hi'},
                {'role': 'assistant', 'content': 'Hello!'},
                {'role': 'user', 'content': 'Sky colour?'}]
    for gen in (True, False):
        assert tok.apply_chat_template(messages, gen) == plain.render(
            messages=messages, add_generation_prompt=gen)
    text = tok.apply_chat_template([ChatMessage('user', 'Hi')])
    assert '<|im_start|>user\nHi<|im_end|>\n' in text
    assert text.endswith('<|im_start|>assistant\n')


def test_encode_chat_has_special_ids(tok):
    ids = tok.encode_chat([ChatMessage('user', 'Hi')])
    assert ids[0] == tok.bos_token_id == 1  # <|im_start|> opens the template's system turn
    assert ids.count(1) == 3 and ids.count(2) == 2
    assert tok.decode(ids) == tok.apply_chat_template([ChatMessage('user', 'Hi')])


@pytest.mark.parametrize('messages, words', [
    ([{'role': 'robot', 'content': 'x'}], "unknown role 'robot'"),
    ([ChatMessage('wizard', 'x')], "unknown role 'wizard'"),
    ([{'role': 'user', 'content': 3}], 'content must be text'),
    (['hello'], 'must be a ChatMessage'),
    ([], 'empty'),
])
def test_bad_messages(tok, messages, words):
    with pytest.raises(InvalidRequestError, match=words):
        tok.apply_chat_template(messages)


def test_hostile_content_is_only_text(tok):
    evil = "{{ ''.__class__.__mro__ }}{% for x in range(3) %}X{% endfor %}{{ 7*7 }}"
    text = tok.apply_chat_template([ChatMessage('user', evil)])
    assert evil in text and '49' not in text


def _with_template(model_dir, tmp_path, template):
    d = _copy_dir(model_dir, tmp_path)
    (d / 'chat_template.jinja').write_text(template)
    return TextTokenizer.from_dir(d)


def test_hostile_template_cannot_reach_python(model_dir, tmp_path):
    t = _with_template(model_dir, tmp_path,
                       "{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ModelLoadError, match='unsafe'):
        t.apply_chat_template([ChatMessage('user', 'x')])
    t = _with_template(model_dir, tmp_path / 'b',
                       "{{ messages.append({'role': 'system'}) }}")
    with pytest.raises(ModelLoadError, match='unsafe'):
        t.apply_chat_template([ChatMessage('user', 'x')])


def test_template_helpers(model_dir, tmp_path):
    t = _with_template(model_dir, tmp_path, (
        "{% if messages[0]['role'] == 'tool' %}{{ raise_exception('no tool turns here') }}"
        "{% endif %}{{ messages[0]['content'] | tojson }}#{{ strftime_now('%Y') }}"
        '#{{ bos_token }}#{{ eos_token }}'))
    out = t.apply_chat_template([ChatMessage('user', '<b>é"')])
    first, year, bos, eos = out.split('#')
    assert first == '"<b>é\\""'  # JSON, not HTML-escaped
    assert len(year) == 4 and year.isdigit()
    assert (bos, eos) == ('<|im_start|>', '<|im_end|>')
    with pytest.raises(InvalidRequestError, match='no tool turns here'):
        t.apply_chat_template([ChatMessage('tool', 'x')])


# --- tools through the template (the Hugging Face convention) -------------------------------

# Written for these tests in the shape of tool-aware HF templates (Qwen2.5 / Hermes): tools as
# {"type": "function", "function": {...}}, calls with function.name and dict arguments.
TOOLS_TEMPLATE = (
    # (trim_blocks drops a newline right after a block tag, as in HF: hence {{ '\\n' }}.)
    '{% if tools %}<|im_start|>system\nTools:{% for t in tools %}{{ "\\n" }}{{ t | tojson }}'
    '{% endfor %}<|im_end|>\n{% endif %}'
    '{% for m in messages %}<|im_start|>{{ m.role }}'
    '{% if m.name is defined %}({{ m.name }}){% endif %}'
    '{% if m.tool_call_id is defined %}[{{ m.tool_call_id }}]{% endif %}{{ "\\n" }}'
    '{{ m.content }}'
    '{% if m.tool_calls %}{% for c in m.tool_calls %}{% set f = c.function %}'
    '<tool_call>{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}</tool_call>'
    '{% endfor %}{% endif %}<|im_end|>{{ "\\n" }}{% endfor %}'
    '{% if add_generation_prompt %}<|im_start|>assistant\n'
    '{% if enable_thinking is defined and enable_thinking is false %}'
    '<think>\n\n</think>\n\n'
    '{% endif %}{% endif %}')
MOVE = {'type': 'function', 'function': {'name': 'move', 'description': 'Drive',
                                         'parameters': {'type': 'object', 'properties': {
                                             'x': {'type': 'number'}}}}}


@pytest.fixture(scope='module')
def tools_tok(model_dir, tmp_path_factory):
    return _with_template(model_dir, tmp_path_factory.mktemp('tools_tok'), TOOLS_TEMPLATE)


def test_tools_reach_the_template_as_hf_passes_them(tools_tok):
    from edge_llm_ros.runtime.tools.spec import check_tool, ToolCall
    assert tools_tok.template_uses_tools and tools_tok.template_uses_tool_calls
    messages = [
        {'role': 'user', 'content': 'go'},
        {'role': 'assistant', 'content': None, 'tool_calls': [
            ToolCall('call_1', 'move', '{"x": 1.5}'),
            {'id': 'call_2', 'type': 'function',
             'function': {'name': 'move', 'arguments': '{"x": -2}'}}]},
        {'role': 'tool', 'content': 'arrived', 'tool_call_id': 'call_1', 'name': 'move'},
    ]
    for tools in ([MOVE], [check_tool(MOVE)]):
        text = tools_tok.apply_chat_template(messages, tools=tools)
        assert text.startswith('<|im_start|>system\nTools:\n{"type": "function", '
                               '"function": {"name": "move", "description": "Drive"')
        assert ('<tool_call>{"name": "move", "arguments": {"x": 1.5}}</tool_call>'
                '<tool_call>{"name": "move", "arguments": {"x": -2}}</tool_call>') in text
        assert '<|im_start|>tool(move)[call_1]\narrived<|im_end|>' in text
    ids = tools_tok.encode_chat(messages, tools=[MOVE])
    assert tools_tok.decode(ids) == tools_tok.apply_chat_template(messages, tools=[MOVE])


def test_messages_from_a_richer_chat_message_type(tools_tok):
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Message(ChatMessage):
        tool_calls: tuple = ()
        tool_call_id: str = ''
        name: str = ''

    text = tools_tok.apply_chat_template([Message('tool', 'ok', tool_call_id='c9', name='f')])
    assert '<|im_start|>tool(f)[c9]\nok' in text
    plain = tools_tok.apply_chat_template([ChatMessage('user', 'hi')])
    assert '(' not in plain.split('\n')[0]  # fields that are absent stay undefined


def test_template_kwargs(tools_tok):
    off = tools_tok.apply_chat_template([ChatMessage('user', 'hi')],
                                        template_kwargs={'enable_thinking': False})
    assert off.endswith('<|im_start|>assistant\n<think>\n\n</think>\n\n')
    on = tools_tok.apply_chat_template([ChatMessage('user', 'hi')])
    assert on.endswith('<|im_start|>assistant\n')
    for key in ('messages', 'tools', 'bos_token', 'not a name', 3):
        with pytest.raises(InvalidRequestError, match='cannot be set'):
            tools_tok.apply_chat_template([ChatMessage('user', 'hi')],
                                          template_kwargs={key: 1})


@pytest.mark.parametrize('message, words', [
    ({'role': 'user', 'content': 'x', 'tool_calls': [{'function': {'name': 'f'}}]},
     'only assistant messages carry tool_calls'),
    ({'role': 'assistant', 'content': '',
      'tool_calls': [{'function': {'name': 'f', 'arguments': '{x'}}]},
     r'tool_calls\[0\] arguments are not JSON'),
    ({'role': 'assistant', 'content': '',
      'tool_calls': [{'function': {'name': 'f', 'arguments': '[1]'}}]},
     'arguments must be a JSON object'),
    ({'role': 'assistant', 'content': '', 'tool_calls': [{'name': 'f'}]},
     r'tool_calls\[0\] must be a ToolCall'),
    ({'role': 'tool', 'content': 'x', 'tool_call_id': 7}, 'tool_call_id must be text'),
    ({'role': 'assistant', 'content': None}, 'content must be text'),
])
def test_bad_tool_messages(tools_tok, message, words):
    with pytest.raises(InvalidRequestError, match=words):
        tools_tok.apply_chat_template([message])


def test_bad_tools_are_refused_before_rendering(tools_tok):
    from edge_llm_ros.runtime.tools.spec import InvalidToolsError
    with pytest.raises(InvalidToolsError, match='parameters schema is invalid'):
        tools_tok.apply_chat_template([ChatMessage('user', 'x')],
                                      tools=[{'name': 'f', 'parameters': {'type': 'bogus'}}])


# --- streaming -----------------------------------------------------------------------------

def _stream_all(tok, ids, skip):
    stream = tok.new_stream(skip_special_tokens=skip)
    deltas = [stream.push(i) for i in ids]
    deltas.append(stream.flush())
    return deltas, stream


@settings(max_examples=400, deadline=None, suppress_health_check=FIXTURE_CHECKS)
@given(ids=st.lists(st.integers(0, 49151), max_size=40), skip=st.booleans())
def test_stream_concatenation_equals_decode_of_random_ids(tok, ids, skip):
    deltas, _ = _stream_all(tok, ids, skip)
    assert ''.join(deltas) == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=200, deadline=None, suppress_health_check=FIXTURE_CHECKS)
@given(text=st.text(alphabet=st.characters(blacklist_categories=('Cs', 'Cn')), max_size=60))
def test_stream_of_real_text_never_emits_partial_characters(tok, text):
    ids = tok.encode(text)
    deltas, _ = _stream_all(tok, ids, skip=False)
    assert ''.join(deltas) == tok.decode(ids)
    if '\ufffd' not in tok.decode(ids):
        assert not any('\ufffd' in d for d in deltas)


def test_stream_holds_back_split_emoji(tok):
    ids = tok.encode(' 🤖🦾')
    assert len(ids) > 2  # each emoji spans several byte-level tokens
    deltas, _ = _stream_all(tok, ids, skip=False)
    assert [d for d in deltas if d] == [' 🤖', '🦾']


def test_stream_skips_special_tokens_by_default(tok):
    ids = tok.encode('<|im_start|>assistant\nSure<|im_end|>')
    deltas, _ = _stream_all(tok, ids, skip=True)
    assert ''.join(deltas) == 'assistant\nSure'


def test_stream_window_stays_small(tok):
    ids = tok.encode('The quick brown fox jumps over the lazy dog. ' * 60)
    stream = tok.new_stream()
    widest = 0
    for i in ids:
        stream.push(i)
        widest = max(widest, stream.window_size)
    assert len(ids) > 500 and widest <= 3


def test_stream_bounds_hold_back_of_broken_bytes(tok):
    lead = tok.hf_tokenizer.token_to_id('â')  # the lone UTF-8 lead byte 0xE2
    stream = tok.new_stream()
    deltas = [stream.push(lead) for _ in range(stream.MAX_HELD_TOKENS + 5)]
    assert any(deltas) and stream.window_size <= 6
