"""JSON-schema constrained decoding on the real SmolLM2 vocabulary.

Random logits stand in for a model that knows nothing about JSON: whatever they favour, the
sampler + constraint loop must produce text that parses and validates.
"""
from dataclasses import replace
import json
import re

from hypothesis import given, HealthCheck, settings, strategies as st
import jsonschema
import numpy as np
import pytest
from smollm2_files import write_text_model_dir

from edge_llm_ros.errors import EngineError, InvalidSchemaError
from edge_llm_ros.runtime.constraint import (compile_choices, compile_lark, compile_regex,
                                             compile_request_constraint, InvalidGrammarError,
                                             JsonSchemaConstraint)
from edge_llm_ros.runtime.sampling import build_sampler
from edge_llm_ros.runtime.tokenizer import TextTokenizer
from edge_llm_ros.runtime.tools.spec import ConstraintConflictError
from edge_llm_ros.runtime.types import SamplingConfig

SCHEMAS = {
    'required_fields': {
        'type': 'object',
        'properties': {'name': {'type': 'string', 'maxLength': 12},
                       'age': {'type': 'integer', 'minimum': 0, 'maximum': 150},
                       'ok': {'type': 'boolean'}},
        'required': ['name', 'age', 'ok'], 'additionalProperties': False},
    'enums': {
        'type': 'object',
        'properties': {'color': {'enum': ['red', 'green', 'blue']},
                       'mode': {'type': 'string', 'enum': ['auto', 'manual', 'off']},
                       'level': {'enum': [1, 2, None]}},
        'required': ['color', 'mode', 'level'], 'additionalProperties': False},
    'array_of_numbers': {
        'type': 'array', 'items': {'type': 'number'}, 'minItems': 1, 'maxItems': 4},
    'numbers': {
        'type': 'object',
        'properties': {'x': {'type': 'number', 'minimum': -10, 'maximum': 10},
                       'n': {'type': 'integer', 'exclusiveMinimum': 0},
                       'f': {'type': 'number'}},
        'required': ['x', 'n'], 'additionalProperties': False},
    'nested_tool_call': {
        'type': 'object',
        'properties': {
            'tool': {'const': 'move_to'},
            'args': {'type': 'object',
                     'properties': {
                         'pose': {'type': 'array', 'items': {'type': 'number'},
                                  'minItems': 3, 'maxItems': 3},
                         'frame': {'type': 'string', 'maxLength': 8},
                         'speed': {'anyOf': [{'type': 'number', 'maximum': 2},
                                             {'type': 'null'}]}},
                     'required': ['pose', 'frame'], 'additionalProperties': False},
            'tags': {'type': 'array', 'items': {'enum': ['a', 'b']}, 'maxItems': 2}},
        'required': ['tool', 'args'], 'additionalProperties': False},
}

MAX_TOKENS = 400


@pytest.fixture(scope='module')
def tok(tmp_path_factory):
    out = tmp_path_factory.mktemp('constraint_model')
    write_text_model_dir(out)
    return TextTokenizer.from_dir(out)


@pytest.fixture(scope='module')
def compiled(tok):
    return {name: JsonSchemaConstraint.compile(json.dumps(s), tok) for name, s in SCHEMAS.items()}


def generate(tok, constraint, config, logit_seed):
    """Run the sampler + constraint loop on random logits; return (text, ended by EOS)."""
    rng = np.random.default_rng(logit_seed)
    state = constraint.start()
    sampler = build_sampler(config, tok.vocab_size)
    sampler.reset([])
    mask = np.empty(tok.vocab_size, dtype=bool)
    ids = []
    for _ in range(MAX_TOKENS):
        state.fill_mask(mask)
        if any(mask[e] for e in tok.eos_token_ids):
            assert state.is_accepting()  # EOS only once the value is complete
        token = sampler.sample(rng.standard_normal(tok.vocab_size).astype(np.float32) * 3,
                               allowed_mask=mask)
        assert mask[token]
        state.accept(token)
        sampler.accept(token)
        if token in tok.eos_token_ids:
            return tok.decode(ids), True
        ids.append(token)
        if state.is_finished():
            return tok.decode(ids), False
    pytest.fail(f'no complete JSON value within {MAX_TOKENS} tokens: {tok.decode(ids)!r}')


SAMPLING = [SamplingConfig(),
            SamplingConfig(temperature=1.0),
            SamplingConfig(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2)]


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), config=st.sampled_from(SAMPLING))
@pytest.mark.parametrize('name', sorted(SCHEMAS))
def test_random_logits_always_give_valid_json(tok, compiled, name, seed, config):
    config = replace(config, seed=seed) if config.temperature else config
    text, _ = generate(tok, compiled[name], config, seed)
    value = json.loads(text)
    jsonschema.validate(value, SCHEMAS[name])


@pytest.mark.parametrize('seed', range(5))
def test_output_uses_the_standard_layout(tok, compiled, seed):
    text, _ = generate(tok, compiled['enums'], SamplingConfig(), seed)
    assert text == json.dumps(json.loads(text))


def test_finished_state_allows_only_eos(tok, compiled):
    constraint = JsonSchemaConstraint.compile('{"enum": ["yes"]}', tok)
    state = constraint.start()
    for token in tok.encode('"yes"'):
        state.accept(token)
    assert state.is_finished() and state.is_accepting()
    mask = np.empty(tok.vocab_size + 64, dtype=bool)  # a model vocabulary padded past the
    state.fill_mask(mask)                              # tokenizer's gets False there
    assert set(np.flatnonzero(mask).tolist()) <= set(tok.eos_token_ids)
    assert mask.any()


def test_disallowed_token_is_an_error(tok):
    state = JsonSchemaConstraint.compile('{"type": "integer"}', tok).start()
    with pytest.raises(EngineError, match='violates the JSON schema'):
        state.accept(tok.encode('"')[0])


def test_mask_must_be_bool_of_vocab_size(tok, compiled):
    state = compiled['enums'].start()
    with pytest.raises(EngineError, match='1-D bool array'):
        state.fill_mask(np.empty(10, dtype=bool))
    with pytest.raises(EngineError, match='1-D bool array'):
        state.fill_mask(np.empty(tok.vocab_size, dtype=np.uint8))


@pytest.mark.parametrize('schema_text, words', [
    ('{"type": ', 'not valid JSON'),
    ('[1, 2]', 'must be an object'),
    ('false', 'must be an object'),
    ('{"type": "strin"}', r'invalid at type: .strin.'),
    ('{"properties": {"a": {"minimum": "x"}}}', 'invalid at properties/a/minimum'),
    ('{"type": "string", "format": "no-such-format"}', 'no-such-format'),
    ('{"not": {"type": "string"}}', 'Unimplemented keys'),
])
def test_invalid_schemas(tok, schema_text, words):
    with pytest.raises(InvalidSchemaError, match=words):
        JsonSchemaConstraint.compile(schema_text, tok)


# --- Lark grammar, regular expression, choices ----------------------------------------------

LARK = r"""
start: "MOVE " DIR " " NUM "m" | "STOP"
DIR: "left" | "right" | "forward"
NUM: /[1-9][0-9]?/
"""


@pytest.mark.parametrize('seed', range(8))
def test_lark_grammar_output_matches(tok, seed):
    text, _ = generate(tok, compile_lark(LARK, tok), SamplingConfig(temperature=1.0, seed=seed),
                       seed)
    assert re.fullmatch(r'MOVE (left|right|forward) [1-9][0-9]?m|STOP', text), text


@pytest.mark.parametrize('seed', range(8))
def test_regex_output_matches(tok, seed):
    pattern = r'(yes|no|maybe)( \(confidence 0\.[0-9]\))?'
    text, _ = generate(tok, compile_regex(pattern, tok),
                       SamplingConfig(temperature=1.0, seed=seed), seed)
    assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize('seed', range(8))
def test_choices_output_is_one_of_them(tok, seed):
    choices = ['go to the kitchen', 'go to the dock', 'stay', 'say "hi"\n']
    text, _ = generate(tok, compile_choices(choices, tok),
                       SamplingConfig(temperature=1.0, seed=seed), seed)
    assert text in choices


def test_kinds_are_named(tok):
    assert compile_regex('a', tok).kind == 'regex'
    assert compile_lark('start: "a"', tok).kind == 'grammar'
    assert compile_choices(['a'], tok).kind == 'choices'
    state = compile_choices(['ab'], tok).start()
    with pytest.raises(EngineError, match='violates the choice list'):
        state.accept(tok.encode('zz')[0])


@pytest.mark.parametrize('compile_it, words', [
    (lambda t: compile_lark('start: foo(', t), 'Lark grammar does not compile: .*'),
    (lambda t: compile_lark('start: undefined_rule', t), 'does not compile: .*undefined_rule'),
    (lambda t: compile_lark('', t), 'Lark grammar must be non-empty text'),
    (lambda t: compile_lark(3, t), 'must be non-empty text'),
    (lambda t: compile_lark('start: "a"' + ' ' * (1 << 20), t), 'at most'),
    (lambda t: compile_regex('[a-', t), 'regular expression does not compile'),
    (lambda t: compile_regex('(?<=a)b', t), 'regular expression does not compile'),
    (lambda t: compile_choices([], t), 'non-empty list'),
    (lambda t: compile_choices('abc', t), 'non-empty list'),
    (lambda t: compile_choices(['a', ''], t), r'choices\[1\] must be non-empty'),
    (lambda t: compile_choices(['a', 3], t), r'choices\[1\]'),
    (lambda t: compile_choices(['a', 'a'], t), 'distinct'),
    (lambda t: compile_choices(['x'] * 2000, t), 'at most 1024'),
])
def test_bad_grammars(tok, compile_it, words):
    with pytest.raises(InvalidGrammarError, match=words):
        compile_it(tok)


def test_request_constraint_picks_one_kind(tok):
    assert compile_request_constraint(tok) is None
    assert compile_request_constraint(tok, regex='a+').kind == 'regex'
    assert compile_request_constraint(tok, choices=['a']).kind == 'choices'
    assert compile_request_constraint(tok, grammar='start: "a"').kind == 'grammar'
    c = compile_request_constraint(tok, json_schema='{"type": "integer"}')
    assert isinstance(c, JsonSchemaConstraint) and c.kind == 'json_schema'
    # Tools build their own constraint (tools.grammar): here they only take part in the check.
    assert compile_request_constraint(tok, tools_constrained=True) is None


@pytest.mark.parametrize('kwargs, words', [
    ({'json_schema': '{}', 'regex': 'a'}, 'json_schema and regex cannot be combined'),
    ({'grammar': 'start: "a"', 'choices': ['a']}, 'grammar and choices'),
    ({'json_schema': '{}', 'tools_constrained': True}, 'tools and json_schema'),
])
def test_more_than_one_constraint_is_refused(tok, kwargs, words):
    with pytest.raises(ConstraintConflictError, match=words):
        compile_request_constraint(tok, **kwargs)
