"""Tool calls: specs, tool_choice, streaming parsers, prompt fallback and the constraint.

Random logits on the real SmolLM2 vocabulary stand in for a model that knows nothing of tools:
under the constraint every call must still parse and validate.
"""
import json
import re
import string

from hypothesis import given, settings, strategies as st
import jsonschema
import numpy as np
import pytest
from smollm2_files import write_text_model_dir

from edge_llm_ros.runtime.constraint import compile_request_constraint
from edge_llm_ros.runtime.model_config import load_family, ReasoningConfig
from edge_llm_ros.runtime.reasoning import close_ids, ReasoningBudget, ReasoningSplitter
from edge_llm_ros.runtime.sampling import build_sampler
from edge_llm_ros.runtime.tokenizer import TextTokenizer
from edge_llm_ros.runtime.tools.formats import FORMATS, tool_format
from edge_llm_ros.runtime.tools.grammar import compile_tool_constraint, tool_grammar
from edge_llm_ros.runtime.tools.parser import parse_all, ToolCallParser
from edge_llm_ros.runtime.tools.render import calls_text, chat_inputs, tools_system_text
from edge_llm_ros.runtime.tools.spec import (check_single_constraint, check_tool, check_tools,
                                             ConstraintConflictError, InvalidToolsError,
                                             new_call_id, parse_tool_choice, ToolCall, ToolChoice,
                                             ToolSpec)
from edge_llm_ros.runtime.types import SamplingConfig

MOVE = {'type': 'function', 'function': {
    'name': 'move_to', 'description': 'Drive to a pose',
    'parameters': {'type': 'object',
                   'properties': {'x': {'type': 'number', 'minimum': -10, 'maximum': 10},
                                  'frame': {'enum': ['map', 'odom']}},
                   'required': ['x', 'frame']}}}
STOP = {'type': 'function', 'function': {'name': 'stop', 'parameters': {'type': 'object'}}}
TOOLS = check_tools([MOVE, STOP])


# --- specs and choice ----------------------------------------------------------------------

def test_tool_forms_are_accepted():
    spec = check_tool(MOVE)
    assert spec.name == 'move_to' and spec.parameters['required'] == ['x', 'frame']
    assert spec.to_hf() == MOVE
    as_text = check_tool({'name': 'f', 'parameters': json.dumps({'type': 'object'})})
    assert as_text.parameters == {'type': 'object'}
    assert check_tool(ToolSpec('g')).parameters == {'type': 'object', 'properties': {}}


@pytest.mark.parametrize('tool, words', [
    ({'type': 'function', 'function': {'name': 'bad name'}}, 'name .* letters, digits'),
    ({'type': 'function', 'function': {'name': 'x' * 65}}, 'must be 1-64'),
    ({'type': 'retrieval'}, 'only .*function.* tools'),
    ({'name': 'f', 'parameters': '{not json'}, 'parameters are not valid JSON'),
    ({'name': 'f', 'parameters': {'type': 'nonsense'}}, r'schema is invalid at .*type'),
    ({'name': 'f', 'parameters': {'type': 'object',
                                  'properties': {'a': {'minimum': 'low'}}}},
     'invalid at properties/a/minimum'),
    ({'name': 'f', 'parameters': {'type': 'array'}}, 'must describe an object'),
    ({'name': 'f', 'parameters': [1]}, 'must be a JSON Schema object'),
    ({'name': 'f', 'description': 3}, 'description must be text'),
    ({'name': 'f', 'parameters': '[' * 5000 + ']' * 5000}, 'nested too deeply|not valid JSON'),
    ('f', 'must be a ToolSpec or a dict'),
])
def test_malformed_tools_are_refused(tool, words):
    with pytest.raises(InvalidToolsError, match=words):
        check_tools([tool])


def test_duplicate_and_too_many_tools():
    with pytest.raises(InvalidToolsError, match="'stop' is given twice"):
        check_tools([STOP, STOP])
    with pytest.raises(InvalidToolsError, match='at most 128'):
        check_tools([{'name': f't{i}'} for i in range(129)])


@pytest.mark.parametrize('choice, expected', [
    ('auto', ToolChoice('auto')), ('none', ToolChoice('none')),
    ('required', ToolChoice('required')), ('stop', ToolChoice('named', 'stop')),
    ({'type': 'function', 'function': {'name': 'move_to'}}, ToolChoice('named', 'move_to')),
    ('', ToolChoice('auto')), (None, ToolChoice('auto')),
])
def test_tool_choice(choice, expected):
    assert parse_tool_choice(choice, TOOLS) == expected


@pytest.mark.parametrize('choice, tools, words', [
    ('fly', TOOLS, "unknown tool 'fly'; tools: move_to, stop"),
    ('required', (), 'needs tools'),
    ({'type': 'function', 'function': {'name': 3}}, TOOLS, 'tool_choice objects must be'),
    (ToolChoice('sometimes'), TOOLS, "mode 'sometimes' is not one of"),
    (3, TOOLS, 'tool_choice must be text'),
])
def test_bad_tool_choice(choice, tools, words):
    with pytest.raises(InvalidToolsError, match=words):
        parse_tool_choice(choice, tools)


def test_no_tools_means_none():
    assert parse_tool_choice('', ()) == ToolChoice('none')


def test_constraint_conflicts():
    assert check_single_constraint(tools=True, json_schema='') == 'tools'
    assert check_single_constraint(tools=False, json_schema='') is None
    with pytest.raises(ConstraintConflictError, match='tools and json_schema cannot be combined'):
        check_single_constraint(tools=True, json_schema='{}')


def test_call_ids():
    assert re.fullmatch(r'call_[0-9a-f]{24}', new_call_id())
    assert re.fullmatch(r'[A-Za-z0-9]{9}', new_call_id('mistral'))
    assert new_call_id() != new_call_id()


def test_no_format_is_an_error():
    with pytest.raises(InvalidToolsError, match="no tool-call format \\('none'\\)"):
        tool_format('none')


# --- streaming parsers ---------------------------------------------------------------------

OUTPUTS = {
    'hermes': ('Sure, driving now. <tool_call>\n{"name": "move_to", "arguments": '
               '{"x": 1.5, "frame": "map"}}\n</tool_call>\n<tool_call>\n{"arguments": {}, '
               '"name": "stop"}\n</tool_call>\n',
               'Sure, driving now. ', [('move_to', '{"x": 1.5, "frame": "map"}'),
                                       ('stop', '{}')]),
    'llama3_json': (' {"name": "move_to", "parameters": {"x": -2, "frame": "odom"}}',
                    '', [('move_to', '{"x": -2, "frame": "odom"}')]),
    'mistral': ('[TOOL_CALLS][{"name": "move_to", "arguments": {"x": 0, "frame": "map"}}, '
                '{"name": "stop", "arguments": {}}]',
                '', [('move_to', '{"x": 0, "frame": "map"}'), ('stop', '{}')]),
    'lfm2': ('Going. <|tool_call_start|>[{"name": "move_to", "arguments": {"x": 5, "frame": '
             '"map"}}, {"name": "stop", "arguments": {}}]<|tool_call_end|>', 'Going. ',
             [('move_to', '{"x": 5, "frame": "map"}'), ('stop', '{}')]),
    # Qwen3.5 / Qwen3-Coder XML calls, as Qwen3.5's chat template writes them.
    'qwen3_xml': ('Driving. <tool_call>\n<function=move_to>\n<parameter=x>\n1.5\n</parameter>\n'
                  '<parameter=frame>\nmap\n</parameter>\n</function>\n</tool_call>\n<tool_call>'
                  '\n<function=stop>\n</function>\n</tool_call>', 'Driving. ',
                  [('move_to', '{"x": 1.5, "frame": "map"}'), ('stop', '{}')]),
    'generic_json': ('```json\n{"name": "move_to", "arguments": "{\\"x\\": 3, \\"frame\\": '
                     '\\"map\\"}"}\n```', '', [('move_to', '{"x": 3, "frame": "map"}')]),
}


def stream(fmt, text, cuts, tools=TOOLS):
    parser = ToolCallParser(FORMATS[fmt], tools)
    bounds = [0] + sorted({c for c in cuts if 0 < c < len(text)}) + [len(text)]
    outs = [parser.feed(text[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    outs.append(parser.finish())
    return parser, ''.join(o.text for o in outs), [d for o in outs for d in o.tool_calls]


@settings(max_examples=30, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=20), fmt=st.sampled_from(sorted(OUTPUTS)))
def test_parse_is_the_same_however_the_text_is_cut(cuts, fmt):
    output, answer, expected = OUTPUTS[fmt]
    parser, text, deltas = stream(fmt, output, cuts)
    assert text == answer
    assert [(c.name, c.arguments) for c in parser.calls] == expected
    assert not parser.invalid
    for i, call in enumerate(parser.calls):
        mine = [d for d in deltas if d.index == i]
        assert (mine[0].id, mine[0].name) == (call.id, call.name)   # announced first
        assert all(not d.id and not d.name for d in mine[1:])
        assert ''.join(d.arguments for d in mine) == call.arguments  # no char lost or doubled
        json.loads(call.arguments)


def test_arguments_stream_before_the_call_ends():
    parser = ToolCallParser(FORMATS['hermes'], TOOLS)
    parser.feed('<tool_call>\n{"name": "move_to", "arguments": {"x": 1')
    early = parser.feed('.25, "fra')
    assert ''.join(d.arguments for d in early.tool_calls) == '.25, "fra'
    assert not parser.calls


def test_mistral_ids_fit_its_template():
    parser, _, _ = stream('mistral', OUTPUTS['mistral'][0], [])
    assert all(re.fullmatch(r'[A-Za-z0-9]{9}', c.id) for c in parser.calls)


@pytest.mark.parametrize('fmt, output, answer', [
    ('llama3_json', '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}'),  # not a tool
    ('llama3_json', 'Use {"name": "move_to"} later', 'Use {"name": "move_to"} later'),
    ('hermes', 'a <tool or <b>bold</b>', 'a <tool or <b>bold</b>'),
    ('hermes', 'ends with <tool_ca', 'ends with <tool_ca'),
    ('generic_json', '  ``` not json', '  ``` not json'),
    ('generic_json', '[1, 2]', '[1, 2]'),
    ('mistral', 'No calls [here]', 'No calls [here]'),
])
def test_text_that_is_not_a_call_stays_text(fmt, output, answer):
    for cuts in ([], range(len(output))):
        parser, text, deltas = stream(fmt, output, cuts)
        assert text == answer and not parser.calls and not deltas


def test_text_after_llama_call_is_text():
    parser, text, _ = stream('llama3_json', '{"name": "stop", "parameters": {}} Done.', [5])
    assert [c.name for c in parser.calls] == ['stop'] and text == 'Done.'


@pytest.mark.parametrize('fmt, output, words', [
    ('hermes', '<tool_call>\n{"name": "fly", "arguments": {}}\n</tool_call>',
     "unknown tool 'fly'"),
    ('hermes', '<tool_call>\n{"name": "move_to", "arguments": {"x": 99, "frame": "map"}}'
     '</tool_call>', 'invalid at x: 99 is greater than the maximum of 10'),
    ('hermes', '<tool_call>\n{"name": "move_to", "arguments": {"x": 1, "fr', 'ended inside'),
    ('hermes', '<tool_call>{"arguments": {}}</tool_call>', 'has no "name"'),
    ('hermes', '<tool_call>{"name": "stop", "arguments": [1]}</tool_call>', 'not a JSON object'),
    ('hermes', '<tool_call>{"name": "stop", "arguments": {"a": tru}}</tool_call>',
     'not valid JSON'),
    ('generic_json', '{"name": "stop", "arguments": "{bad"}', 'are not JSON'),
])
def test_invalid_calls_are_reported(fmt, output, words):
    parser, _, _ = stream(fmt, output, [7, 30])
    assert not parser.calls
    assert len(parser.invalid) == 1 and re.search(words, parser.invalid[0].error)


def test_without_tool_list_any_name_is_a_call():
    text, calls, invalid = parse_all('<tool_call>{"name": "x", "arguments": {"a": 1}}'
                                     '</tool_call>', FORMATS['hermes'])
    assert [(c.name, c.arguments) for c in calls] == [('x', '{"a": 1}')] and not invalid


def test_smollm2_style_list_inside_tags():
    text, calls, _ = parse_all('<tool_call>[{"name": "stop", "arguments": {}}, {"name": '
                               '"stop", "arguments": {}}]</tool_call>', FORMATS['hermes'], TOOLS)
    assert [c.name for c in calls] == ['stop', 'stop'] and text == ''


XML_TOOL = check_tools([{'type': 'function', 'function': {
    'name': 'plan', 'parameters': {'type': 'object', 'properties': {
        'note': {'type': 'string'}, 'speed': {'type': 'number'}, 'pose': {'type': 'object'},
        'stops': {'type': 'array'}, 'fast': {'type': 'boolean'},
        'mixed': {'type': ['string', 'integer']}, 'label': {'anyOf': [{'type': 'string'},
                                                                      {'type': 'null'}]},
        'count': {'type': 'integer', 'minimum': 0}, 'free': {}}}}}])


def xml_call(**params: str) -> str:
    body = ''.join(f'<parameter={k}>\n{v}\n</parameter>\n' for k, v in params.items())
    return f'<tool_call>\n<function=plan>\n{body}</function>\n</tool_call>'


@pytest.mark.parametrize('params, expected', [
    # only strings: the text itself, JSON-looking or not, newlines inside kept
    ({'note': '123'}, {'note': '123'}), ({'note': 'line 1\nline 2'}, {'note': 'line 1\nline 2'}),
    ({'note': '{"a": 1}'}, {'note': '{"a": 1}'}),
    # no string allowed: JSON
    ({'speed': '1.5'}, {'speed': 1.5}), ({'pose': '{"x": 1, "y": [2]}'},
                                         {'pose': {'x': 1, 'y': [2]}}),
    ({'stops': '["a", "b"]'}, {'stops': ['a', 'b']}), ({'fast': 'true'}, {'fast': True}),
    # strings and more: JSON of an allowed other type, else the text
    ({'mixed': '7'}, {'mixed': 7}), ({'mixed': 'seven'}, {'mixed': 'seven'}),
    ({'mixed': '"7"'}, {'mixed': '"7"'}), ({'mixed': 'true'}, {'mixed': 'true'}),
    ({'mixed': '7.5'}, {'mixed': '7.5'}),   # a number, but not an integer: the text
    ({'label': 'null'}, {'label': None}), ({'label': 'dock'}, {'label': 'dock'}),
    # a parameter without a schema: any JSON, else the text
    ({'free': '[1, 2]'}, {'free': [1, 2]}), ({'free': 'go now'}, {'free': 'go now'}),
])
def test_xml_parameter_values_are_typed_as_llama_cpp_types_them(params, expected):
    output = xml_call(**params)
    for cuts in ([], range(len(output))):   # whole, and one character a delta
        parser, text, deltas = stream('qwen3_xml', output, cuts, XML_TOOL)
        assert text == '' and not parser.invalid, parser.invalid
        assert [json.loads(c.arguments) for c in parser.calls] == [expected]
        assert deltas[0].name == 'plan' and {d.index for d in deltas} == {0}
        assert json.loads(''.join(d.arguments for d in deltas)) == expected


@pytest.mark.parametrize('output, words', [
    (xml_call(speed='fast'), 'argument speed of plan is not JSON'),
    (xml_call(fast='True'), 'argument fast of plan is not JSON'),   # Python's, not JSON's
    (xml_call(count='-3'), 'invalid at count'),   # typed, then validated against the schema
    ('<tool_call>\n<function=plan>\n<parameter=note>\nx\n</tool_call>', 'no </parameter>'),
    ('<tool_call>\n<function=plan>\n<parameter=note>\nx\n</parameter>\n<parameter=note>\ny'
     '\n</parameter>\n</function>\n</tool_call>', 'given twice'),
    ('<tool_call>\n<function=plan>\nnote: x\n</function>\n</tool_call>', 'XML call syntax'),
    ('<tool_call>\n<function=plan>\n<parameter=note>\nx', 'ended inside'),
])
def test_bad_xml_calls_are_reported(output, words):
    for cuts in ([], range(len(output))):
        parser, _, _ = stream('qwen3_xml', output, cuts, XML_TOOL)
        assert len(parser.invalid) == 1 and re.search(words, parser.invalid[0].error), \
            parser.invalid


def test_xml_calls_tolerate_a_missing_function_close_and_read_forced_json():
    fmt = FORMATS['qwen3_xml']
    _, calls, invalid = parse_all('<tool_call>\n<function=stop>\n</tool_call>', fmt, TOOLS)
    assert [c.name for c in calls] == ['stop'] and not invalid
    # What the tool constraint forces between the markers: a Hermes JSON object.
    text, calls, invalid = parse_all('Ok.<tool_call>\n{"name": "move_to", "arguments": {"x": 2, '
                                     '"frame": "odom"}}\n</tool_call>', fmt, TOOLS)
    assert text == 'Ok.' and [(c.name, c.arguments) for c in calls] == [
        ('move_to', '{"x": 2, "frame": "odom"}')] and not invalid
    # Text about tags is text.
    assert parse_all('use <b>bold</b> and <tool_ca', fmt, TOOLS) == \
        ('use <b>bold</b> and <tool_ca', [], [])


def test_feed_after_finish_is_an_error():
    parser = ToolCallParser(FORMATS['hermes'])
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed('x')


# --- tools in the prompt -------------------------------------------------------------------

@pytest.fixture(scope='module')
def tok(tmp_path_factory):
    out = tmp_path_factory.mktemp('tool_model')
    write_text_model_dir(out)
    return TextTokenizer.from_dir(out)


def test_smollm2_template_gets_tools_as_text(tok):
    assert not tok.template_uses_tools and not tok.template_uses_tool_calls
    fmt = FORMATS['hermes']
    call = ToolCall('call_1', 'move_to', '{"x": 1, "frame": "map"}')
    messages = [{'role': 'user', 'content': 'go'},
                {'role': 'assistant', 'content': '', 'tool_calls': [call]},
                {'role': 'tool', 'content': '{"ok": true}', 'tool_call_id': 'call_1',
                 'name': 'move_to'}]
    dicts, tools = chat_inputs(tok, messages, TOOLS, fmt)
    assert tools == ()
    assert dicts[0]['role'] == 'system' and dicts[0]['content'] == tools_system_text(TOOLS, fmt)
    assert dicts[2]['content'] == calls_text([call.to_hf()], fmt)
    prompt = tok.apply_chat_template(dicts, tools=tools)
    assert json.dumps(TOOLS[0].to_hf()) in prompt
    assert '<tool_call>\n{"name": "move_to", "arguments": {"x": 1, "frame": "map"}}\n' \
           '</tool_call>' in prompt
    # The system message the user gave is kept, the tools follow it.
    dicts, _ = chat_inputs(tok, [{'role': 'system', 'content': 'Be brief.'}] + messages,
                           TOOLS, fmt)
    assert dicts[0]['content'].startswith('Be brief.\n\n# Tools')


@pytest.mark.parametrize('fmt', sorted(FORMATS))
def test_fallback_text_shows_the_format(fmt):
    text = tools_system_text(TOOLS, FORMATS[fmt])
    assert FORMATS[fmt].args_key in text and 'move_to' in text
    written = calls_text([ToolCall('i', 'stop', '{}').to_hf()], FORMATS[fmt])
    _, calls, _ = parse_all(written, FORMATS[fmt], TOOLS)
    assert [c.name for c in calls] == ['stop']   # what we write, we parse back


# --- the constraint ------------------------------------------------------------------------

def run(tok, constraint, seed, prefix_text='', max_tokens=400, budget=None, splitter=None,
        temperature=1.0):
    """Sampler + constraint on random logits; returns the generated text."""
    rng = np.random.default_rng(seed)
    state = constraint.start()
    sampler = build_sampler(SamplingConfig(temperature=temperature, seed=seed), tok.vocab_size)
    sampler.reset([])
    mask = np.empty(tok.vocab_size, dtype=bool)
    queue = list(tok.encode(prefix_text)) if prefix_text else []
    stream = tok.new_stream()
    ids = []
    for _ in range(max_tokens):
        if budget is not None and not queue:
            queue = list(budget.before_pick(splitter.in_reasoning))
        state.fill_mask(mask)
        if queue:
            token = queue.pop(0)
            assert mask[token], f'forced token {token} not allowed'
        else:
            token = sampler.sample(rng.standard_normal(tok.vocab_size).astype(np.float32) * 3,
                                   allowed_mask=mask)
        state.accept(token)
        sampler.accept(token)
        if token in tok.eos_token_ids:
            break
        ids.append(token)
        if splitter is not None:
            splitter.feed(stream.push(token))
        if state.is_finished():
            break
    else:
        pytest.fail(f'no end within {max_tokens} tokens: {tok.decode(ids)[-200:]!r}')
    return tok.decode(ids)


def random_schema(rng, depth=0):
    """Make a random tool schema of the kinds robot skills use."""
    kinds = ['string', 'integer', 'number', 'boolean', 'enum', 'array']
    if depth < 1:
        kinds.append('object')
    props, required = {}, []
    for i in range(int(rng.integers(0, 5))):
        kind = kinds[int(rng.integers(len(kinds)))]
        name = ''.join(rng.choice(list(string.ascii_lowercase), 5)) + str(i)
        if kind == 'string':
            props[name] = {'type': 'string', 'maxLength': int(rng.integers(1, 12))}
        elif kind == 'integer':
            lo = int(rng.integers(-100, 100))
            props[name] = {'type': 'integer', 'minimum': lo, 'maximum': lo + 50}
        elif kind == 'number':
            props[name] = {'type': 'number', 'minimum': -5.5, 'maximum': 5.5}
        elif kind == 'boolean':
            props[name] = {'type': 'boolean'}
        elif kind == 'enum':
            props[name] = {'enum': ['left', 'right', 'up', 3, None][:int(rng.integers(1, 6))]}
        elif kind == 'array':
            props[name] = {'type': 'array', 'items': {'type': 'number'},
                           'minItems': 1, 'maxItems': 3}
        else:
            props[name] = random_schema(rng, depth + 1)
        if rng.random() < 0.7:
            required.append(name)
    schema = {'type': 'object', 'properties': props}
    if required:
        schema['required'] = required
    return schema


@pytest.mark.parametrize('fmt', sorted(FORMATS))
@pytest.mark.parametrize('seed', range(6))
def test_required_always_gives_a_valid_call(tok, fmt, seed):
    rng = np.random.default_rng(seed)
    tools = check_tools([{'name': f'skill_{i}', 'parameters': random_schema(rng)}
                         for i in range(int(rng.integers(1, 4)))])
    choice = parse_tool_choice('required' if seed % 2 else tools[-1].name, tools)
    constraint = compile_tool_constraint(tools, choice, FORMATS[fmt], tok, parallel=False)
    text = run(tok, constraint, seed)
    answer, calls, invalid = parse_all(text, FORMATS[fmt], tools)
    assert not invalid and len(calls) == 1 and answer == '', text
    if choice.mode == 'named':
        assert calls[0].name == choice.name
    spec = {t.name: t for t in tools}[calls[0].name]
    jsonschema.validate(json.loads(calls[0].arguments), spec.parameters)


def test_parallel_calls_all_validate(tok):
    constraint = compile_tool_constraint(TOOLS, ToolChoice('required'), FORMATS['hermes'], tok)
    for seed in range(3):
        text = run(tok, constraint, seed, max_tokens=600, temperature=0.0)
        _, calls, invalid = parse_all(text, FORMATS['hermes'], TOOLS)
        assert calls and not invalid


@pytest.mark.parametrize('fmt, trigger', [('hermes', 'Let me do that. <tool_call>'),
                                          ('llama3_json', '{'), ('generic_json', '{'),
                                          ('mistral', 'Ok [TOOL_CALLS]'),
                                          ('lfm2', 'Sure. <|tool_call_start|>')])
def test_auto_engages_at_the_trigger(tok, fmt, trigger):
    constraint = compile_tool_constraint(TOOLS, ToolChoice('auto'), FORMATS[fmt], tok,
                                         parallel=False)
    # Before the trigger the text is free: almost every token is allowed.
    state = constraint.start()
    mask = np.empty(tok.vocab_size, dtype=bool)
    state.fill_mask(mask)
    assert mask.sum() > 0.99 * tok.vocab_size
    # The model writes the trigger; from there the call is forced.
    text = run(tok, constraint, 3, prefix_text=trigger, max_tokens=300)
    answer, calls, invalid = parse_all(text, FORMATS[fmt], TOOLS)
    assert len(calls) == 1 and not invalid, text
    assert answer == trigger.split('<tool_call>')[0].split('[TOOL_CALLS]')[0].split(
        '<|tool_call_start|>')[0].lstrip('{')


def test_required_after_forced_reasoning_close(tok):
    """R1-style: the template opened <think>; the budget closes it, then the call is forced."""
    reasoning = load_family('deepseek_r1_distill_qwen').reasoning
    constraint = compile_tool_constraint(TOOLS, ToolChoice('named', 'move_to'),
                                         FORMATS['generic_json'], tok, reasoning,
                                         starts_open=True, parallel=False)
    splitter = ReasoningSplitter(reasoning, starts_open=True)
    budget = ReasoningBudget(8, close_ids(tok, reasoning))
    text = run(tok, constraint, 5, budget=budget, splitter=splitter)
    assert budget.forced
    after = text.split(reasoning.close_tag, 1)[1]
    _, calls, invalid = parse_all(after, FORMATS['generic_json'], TOOLS)
    assert [c.name for c in calls] == ['move_to'] and not invalid


def test_optional_reasoning_before_required_call(tok):
    constraint = compile_tool_constraint(TOOLS, ToolChoice('named', 'stop'), FORMATS['hermes'],
                                         tok, ReasoningConfig(), parallel=False)
    text = run(tok, constraint, 1, prefix_text='<think>\nNeed to stop.\n</think>\n\n')
    _, calls, _ = parse_all(text.split('</think>')[1], FORMATS['hermes'], TOOLS)
    assert [c.name for c in calls] == ['stop']


def test_refs_in_tool_schemas_still_resolve(tok):
    tools = check_tools([{'name': 'goto', 'parameters': {
        'type': 'object', '$defs': {'pose': {'type': 'array', 'items': {'type': 'integer'},
                                             'minItems': 2, 'maxItems': 2}},
        'properties': {'pose': {'$ref': '#/$defs/pose'}}, 'required': ['pose']}}])
    constraint = compile_tool_constraint(tools, ToolChoice('required'), FORMATS['hermes'], tok,
                                         parallel=False)
    _, calls, invalid = parse_all(run(tok, constraint, 0), FORMATS['hermes'], tools)
    assert len(json.loads(calls[0].arguments)['pose']) == 2 and not invalid


def test_none_is_unconstrained(tok):
    assert compile_tool_constraint(TOOLS, ToolChoice('none'), FORMATS['hermes'], tok) is None
    assert tool_grammar(TOOLS, ToolChoice('none'), FORMATS['hermes'], tok) is None


def test_schema_the_constraint_cannot_compile(tok):
    tools = check_tools([{'name': 'f', 'parameters': {
        'type': 'object', 'properties': {'a': {'type': 'string', 'pattern': '(?<=a)b'}}}}])
    with pytest.raises(InvalidToolsError, match='cannot be used for constrained decoding'):
        compile_tool_constraint(tools, ToolChoice('required'), FORMATS['hermes'], tok)


def test_tools_conflict_with_other_constraints(tok):
    with pytest.raises(ConstraintConflictError, match='tools and regex'):
        compile_request_constraint(tok, regex='a+', tools_constrained=True)


def test_family_formats_resolve():
    for name in ('smollm2', 'qwen3', 'llama3', 'mistral', 'gemma3', 'qwen35'):
        assert tool_format(load_family(name).tool_call_format).name
