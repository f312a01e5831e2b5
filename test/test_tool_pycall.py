"""LFM2's Python call lists between <|tool_call_start|> and <|tool_call_end|>.

`[move_to(x=1.5, frame="map"), stop()]` is read with ast (nothing evaluated), each call's
arguments checked against its tool's schema as JSON calls are; the JSON list still parses in
the same markers. Streamed in token-sized pieces, the result equals one whole feed.
"""
import json
import re

from hypothesis import given, settings, strategies as st
import pytest
from test_tool_calls import MOVE, STOP, stream, tok  # noqa: F401 - tok: the SmolLM2 fixture

from edge_llm_ros.runtime.tools.formats import FORMATS
from edge_llm_ros.runtime.tools.parser import parse_all, python_calls, ToolCallParser
from edge_llm_ros.runtime.tools.spec import check_tools

SAY = {'name': 'say', 'parameters': {'type': 'object', 'properties': {'text': {'type': 'string'}},
                                     'required': ['text']}}
PLAN = {'name': 'plan', 'parameters': {'type': 'object', 'properties': {
    'waypoints': {'type': 'array', 'items': {'type': 'array', 'items': {'type': 'number'}}},
    'options': {'type': 'object'},
    'loop': {'type': 'boolean'},
    'timeout': {'type': ['number', 'null']}}}}
TOOLS = check_tools([MOVE, STOP, SAY, PLAN])
LFM2 = FORMATS['lfm2']
START, END = '<|tool_call_start|>', '<|tool_call_end|>'


def calls_of(text, tools=TOOLS):
    """Return (answer, [(name, arguments dict)], [(raw, error)]) of a whole output."""
    answer, calls, invalid = parse_all(text, LFM2, tools)
    return (answer, [(c.name, json.loads(c.arguments)) for c in calls],
            [(i.raw, i.error) for i in invalid])


def test_one_call():
    answer, calls, invalid = calls_of(f'Driving. {START}[move_to(x=1.5, frame="map")]{END}')
    assert answer == 'Driving. ' and not invalid
    assert calls == [('move_to', {'x': 1.5, 'frame': 'map'})]


def test_several_calls_keep_their_order():
    answer, calls, invalid = calls_of(f"{START}[say(text='hi'), move_to(frame='odom', x=-2), "
                                      f'stop()]{END}\nDone.')
    assert answer == '\nDone.' and not invalid   # as after a JSON run: text keeps its lead
    assert calls == [('say', {'text': 'hi'}), ('move_to', {'frame': 'odom', 'x': -2}),
                     ('stop', {})]


def test_arguments_text_is_json_in_the_order_written():
    _, calls, _ = parse_all(f'{START}[move_to(x=-0.25, frame="map")]{END}', LFM2, TOOLS)
    assert calls[0].arguments == '{"x": -0.25, "frame": "map"}'


def test_nested_literals():
    _, calls, invalid = calls_of(
        f'{START}[plan(waypoints=[[0, 1.5], [-2.0, 3e2]], options={{"speed": {{"max": 0.5}}, '
        f'"tags": ["a", "b"]}}, loop=True, timeout=None)]{END}')
    assert not invalid
    assert calls == [('plan', {'waypoints': [[0, 1.5], [-2.0, 300.0]],
                               'options': {'speed': {'max': 0.5}, 'tags': ['a', 'b']},
                               'loop': True, 'timeout': None})]


def test_tuples_become_lists():
    _, calls, invalid = calls_of(f'{START}[plan(waypoints=((1, 2), (3, 4)))]{END}')
    assert calls == [('plan', {'waypoints': [[1, 2], [3, 4]]})] and not invalid


@pytest.mark.parametrize('literal, value', [
    ('"a, b"', 'a, b'),
    ("'f(x=1), g()]'", 'f(x=1), g()]'),
    ('"say \\"hi\\" (twice)"', 'say "hi" (twice)'),
    ("'it\\'s'", "it's"),
    ('"\'single\' inside"', "'single' inside"),
    ('"tab\\tnew\\nline"', 'tab\tnew\nline'),
    ("'Grüße ✓'", 'Grüße ✓'),
    ("'<|tool_call_start|>'", '<|tool_call_start|>'),
])
def test_strings_with_commas_parens_and_quotes(literal, value):
    _, calls, invalid = calls_of(f'{START}[say(text={literal}), stop()]{END}')
    assert calls == [('say', {'text': value}), ('stop', {})] and not invalid


@pytest.mark.parametrize('literal, value', [
    ('-2', -2), ('-0.5', -0.5), ('3.25', 3.25), ('1e-3', 0.001), ('-7.', -7.0), ('+4', 4),
])
def test_negative_and_float_numbers(literal, value):
    _, calls, invalid = calls_of(f'{START}[move_to(x={literal}, frame="map")]{END}')
    assert calls == [('move_to', {'x': value, 'frame': 'map'})] and not invalid
    assert type(calls[0][1]['x']) is type(value)


def test_true_false_none():
    _, calls, invalid = calls_of(f'{START}[plan(loop=False, timeout=None), plan(loop=True)]{END}')
    assert calls == [('plan', {'loop': False, 'timeout': None}), ('plan', {'loop': True})]
    assert not invalid
    assert parse_all(f'{START}[plan(loop=True)]{END}', LFM2, TOOLS)[1][0].arguments == \
        '{"loop": true}'


def test_empty_argument_list():
    _, calls, invalid = calls_of(f'{START}[stop()]{END}')
    assert calls == [('stop', {})] and not invalid
    assert parse_all(f'{START}[stop()]{END}', LFM2, TOOLS)[1][0].arguments == '{}'


def test_whitespace_and_a_bare_call():
    _, calls, _ = calls_of(f'{START} [ \n stop( ) ,\n say( text = "x" ) ] {END}')
    assert calls == [('stop', {}), ('say', {'text': 'x'})]
    # Without the brackets (a small model dropping them) one call still reads.
    _, calls, invalid = calls_of(f'{START}stop(){END}')
    assert calls == [('stop', {})] and not invalid


def test_json_list_still_parses_in_the_same_markers():
    answer, calls, invalid = calls_of(
        f'Going. {START}[{{"name": "move_to", "arguments": {{"x": 5, "frame": "map"}}}}, '
        f'{{"name": "stop", "arguments": {{}}}}]{END}')
    assert answer == 'Going. ' and not invalid
    assert calls == [('move_to', {'x': 5, 'frame': 'map'}), ('stop', {})]


def test_both_forms_in_one_output():
    _, calls, invalid = calls_of(f'{START}[say(text="a")]{END}{START}[{{"name": "stop", '
                                 f'"arguments": {{}}}}]{END}{START}[say(text="b")]{END}')
    assert calls == [('say', {'text': 'a'}), ('stop', {}), ('say', {'text': 'b'})]
    assert not invalid


def test_any_name_without_a_tool_list():
    _, calls, invalid = calls_of(f'{START}[wave(hand="left", times=2)]{END}', tools=())
    assert calls == [('wave', {'hand': 'left', 'times': 2})] and not invalid


def test_schema_errors_match_the_json_form():
    """The same validation (spec.validate_arguments) and message as a JSON call."""
    _, _, py = calls_of(f'{START}[move_to(x=99, frame="map")]{END}')
    _, _, js = calls_of(f'{START}[{{"name": "move_to", "arguments": {{"x": 99, "frame": '
                        f'"map"}}}}]{END}')
    assert [e for _, e in py] == [e for _, e in js] == [
        'arguments of move_to are invalid at x: 99 is greater than the maximum of 10']
    assert py[0][0] == 'move_to(x=99, frame="map")'
    _, _, missing = calls_of(f'{START}[move_to(x=1)]{END}')
    assert re.search("'frame' is a required property", missing[0][1])


@pytest.mark.parametrize('body, raw, words', [
    ('[move_to(x=1, frame="map"]', '[move_to(x=1, frame="map"]',
     r'not valid Python: closing parenthesis'),
    ('[move_to(x=1, frame="map")', '[move_to(x=1, frame="map")', r'not valid Python: .*never'),
    ('[say(text="open)]', '[say(text="open)]', 'not valid Python: unterminated string'),
    ('[move_to(1.5, frame="map")]', 'move_to(1.5, frame="map")',
     'move_to passes arguments by position'),
    ('[move_to(x=goal_x, frame="map")]', 'move_to(x=goal_x, frame="map")',
     'argument x of move_to is not a literal value: goal_x'),
    ('[move_to(x=pose.x, frame="map")]', 'move_to(x=pose.x, frame="map")',
     'argument x of move_to is not a literal value: pose.x'),
    ('[move_to(x=abs(-1), frame="map")]', 'move_to(x=abs(-1), frame="map")',
     r'not a literal value: abs\(-1\)'),
    ('[move_to(x=1 + 1, frame="map")]', 'move_to(x=1 + 1, frame="map")', 'not a literal'),
    ('[robot.stop()]', 'robot.stop()', 'is not a call of a tool by its name'),
    ('[fly(height=2)]', 'fly(height=2)', "unknown tool 'fly'"),
    ('[fly(1)]', 'fly(1)', "unknown tool 'fly'"),   # the unknown name first, as for JSON
    ('[stop(**opts)]', 'stop(**opts)', 'stop unpacks a mapping'),
    ('[say(text="a", text="b")]', 'say(text="a", text="b")', 'say gives text twice'),
    ('[plan(options={1, 2})]', 'plan(options={1, 2})', 'a value JSON cannot'),
    ('[plan(timeout=1e999)]', 'plan(timeout=1e999)', 'a value JSON cannot'),
    ('[plan(options=b"x")]', 'plan(options=b"x")', 'a value JSON cannot'),
    ('stop', 'stop', 'expected a list of calls'),
    ('[stop(), "text"]', '"text"', 'is not a call of a tool'),
])
def test_malformed_calls_are_reported(body, raw, words):
    text = f'Sure. {START}{body}{END} Bye.'
    seen = []
    for cuts in ([], range(len(text))):   # one chunk, then one character at a time
        parser, answer, deltas = stream('lfm2', text, cuts, TOOLS)
        assert answer == 'Sure.  Bye.'   # the markup never reaches the answer
        bad = [i for i in parser.invalid if i.raw == raw]
        assert len(bad) == 1 and re.search(words, bad[0].error), parser.invalid
        # Deltas only for the calls that parsed (here at most the good stop()).
        assert {d.index for d in deltas} == set(range(len(parser.calls)))
        assert [c.name for c in parser.calls] in ([], ['stop'])
        seen.append(([(c.name, c.arguments) for c in parser.calls], parser.invalid))
    assert seen[0] == seen[1]


def test_one_bad_call_does_not_drop_the_others():
    _, calls, invalid = calls_of(f'{START}[say(text="a"), move_to(2, frame="map"), stop()]{END}')
    assert calls == [('say', {'text': 'a'}), ('stop', {})]
    assert [raw for raw, _ in invalid] == ['move_to(2, frame="map")']


def test_output_ending_inside_the_list():
    answer, calls, invalid = calls_of(f'Ok {START}[say(text="a"), stop(')
    assert answer == 'Ok ' and not calls
    assert invalid == [('[say(text="a"), stop(', 'the output ended inside a tool call '
                        '(max_tokens reached?)')]
    # A list that is whole but lacks the close marker is kept, as a finished JSON call is.
    _, calls, invalid = calls_of(f'{START}[say(text="a"), stop()]')
    assert calls == [('say', {'text': 'a'}), ('stop', {})] and not invalid


def test_python_calls_reads_without_running():
    assert [(c.name, c.arguments, c.error) for c in python_calls('[f(a=[1, {"b": None}])]')] \
        == [('f', '{"a": [1, {"b": null}]}', '')]
    with pytest.raises(ValueError, match='expected a list of calls'):
        python_calls('{"name": "f"}')
    with pytest.raises(ValueError):
        python_calls('[' * 1000)
    with pytest.raises(ValueError):
        python_calls('[f(a=1)]\x00')
    calls = python_calls('[__import__("os").system("x")]')
    assert calls[0].error and not calls[0].arguments


def test_other_formats_keep_json_only():
    """python_calls is LFM2's alone: Hermes tags around a Python list are not a call."""
    assert [n for n, f in FORMATS.items() if f.python_calls] == ['lfm2']
    _, calls, _ = parse_all('<tool_call>[stop()]</tool_call>', FORMATS['hermes'], TOOLS)
    assert not calls


# --- streaming -----------------------------------------------------------------------------

OUTPUT = (f'Sure, on my way. {START}[move_to(x=-1.5, frame="map"), say(text="done, (really) '
          f'\\"ok\\""), plan(waypoints=[[0, 1], [2, -3.5]], options={{"a": [True, None]}}), '
          f'stop()]{END}\nAnything else?')
EXPECTED = ('Sure, on my way. \nAnything else?',
            [('move_to', {'x': -1.5, 'frame': 'map'}), ('say', {'text': 'done, (really) "ok"'}),
             ('plan', {'waypoints': [[0, 1], [2, -3.5]], 'options': {'a': [True, None]}}),
             ('stop', {})])


def feed_pieces(pieces, text=OUTPUT):
    """Feed `pieces` (joined: `text`); return (parser, answer, call deltas)."""
    assert ''.join(pieces) == text
    parser = ToolCallParser(LFM2, TOOLS)
    outs = [parser.feed(p) for p in pieces] + [parser.finish()]
    return parser, ''.join(o.text for o in outs), [d for o in outs for d in o.tool_calls]


def check_stream(parser, answer, deltas):
    assert answer == EXPECTED[0] and not parser.invalid
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == EXPECTED[1]
    for i, call in enumerate(parser.calls):
        mine = [d for d in deltas if d.index == i]
        assert (mine[0].id, mine[0].name) == (call.id, call.name)   # announced first
        assert ''.join(d.arguments for d in mine) == call.arguments
    return [(c.name, c.arguments) for c in parser.calls]


def test_token_sized_pieces_give_the_one_chunk_result(tok):  # noqa: F811
    whole = check_stream(*feed_pieces([OUTPUT]))
    # The engine's own detokenizer: SmolLM2 splits LFM2's markers into several tokens.
    detok = tok.new_stream()
    pieces = [detok.push(t) for t in tok.encode(OUTPUT)]
    assert len(pieces) > 40
    assert check_stream(*feed_pieces(pieces)) == whole
    assert check_stream(*feed_pieces(list(OUTPUT))) == whole   # one character at a time


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, len(OUTPUT)), max_size=25))
def test_any_cut_gives_the_one_chunk_result(cuts):
    bounds = [0] + sorted(set(cuts)) + [len(OUTPUT)]
    check_stream(*feed_pieces([OUTPUT[a:b] for a, b in zip(bounds[:-1], bounds[1:])]))


def test_the_list_is_withheld_until_the_close_marker():
    parser = ToolCallParser(LFM2, TOOLS)
    head, tail = OUTPUT.split(END)
    early = [parser.feed(c) for c in head]
    assert ''.join(d.text for d in early) == 'Sure, on my way. '
    assert not any(d.tool_calls for d in early) and not parser.calls
    closed = parser.feed(END)
    assert [d.name for d in closed.tool_calls if d.name] == ['move_to', 'say', 'plan', 'stop']
    assert len(parser.calls) == 4
    assert parser.feed(tail).text + parser.finish().text == '\nAnything else?'


def test_streams_as_the_json_form_does():
    """Same answer text and calls as the JSON list of the same calls, however it is cut."""
    as_json = ', '.join(json.dumps({'name': n, 'arguments': a}) for n, a in EXPECTED[1])
    json_output = OUTPUT.split(START)[0] + f'{START}[{as_json}]{END}' + OUTPUT.split(END)[1]
    for cuts in ([], range(0, len(OUTPUT), 3)):
        py, py_text, py_deltas = stream('lfm2', OUTPUT, cuts, TOOLS)
        js, js_text, js_deltas = stream('lfm2', json_output, cuts, TOOLS)
        assert py_text == js_text == EXPECTED[0]
        assert [(c.name, json.loads(c.arguments)) for c in py.calls] == \
            [(c.name, json.loads(c.arguments)) for c in js.calls]
        assert [d.name for d in py_deltas if d.id] == [d.name for d in js_deltas if d.id]
