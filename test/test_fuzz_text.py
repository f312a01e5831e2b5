"""Property tests: hostile chat content and templates, JSON schemas and sampling configs.

Contract (edge_llm_ros/runtime): bad input is rejected with an InvalidRequestError subclass
(or ModelLoadError for a model's own broken files) whose message says what to fix, within a
time bound; accepted input behaves as documented (message content is data, never template
code; a compiled schema starts a constraint; a valid sampling config always picks a token).
"""
import json
import string

from fuzz_support import accepted_or_typed, bounded, fuzz, HOSTILE_SNIPPETS, HOSTILE_TEXT, JUNK
from hypothesis import example, given, strategies as st
import numpy as np
import pytest
from smollm2_files import write_text_model_dir
from tiny_model import tiny_model_dir

from edge_llm_ros.errors import (EngineError, InvalidRequestError, InvalidSamplingError,
                                 InvalidSchemaError, ModelLoadError)
from edge_llm_ros.runtime.constraint import JsonSchemaConstraint
from edge_llm_ros.runtime.sampling import build_sampler, validate
from edge_llm_ros.runtime.tokenizer import SpecialTokens, TextTokenizer
from edge_llm_ros.runtime.types import ChatMessage, ROLES, SamplingConfig


@pytest.fixture(scope='module')
def smol(tmp_path_factory) -> TextTokenizer:
    """SmolLM2's real tokenizer and chat template (no model weights needed)."""
    out = tmp_path_factory.mktemp('smol_text')
    write_text_model_dir(out)
    return TextTokenizer.from_dir(out)


@pytest.fixture(scope='module')
def tiny(tmp_path_factory) -> TextTokenizer:
    return TextTokenizer.from_dir(tiny_model_dir(tmp_path_factory.mktemp('fuzz_tiny')))


# --- chat content -----------------------------------------------------------------------
roles = st.one_of(st.sampled_from(ROLES), st.sampled_from(['System', 'root', '', 'user\n']),
                  st.text(max_size=6))
conversations = st.lists(st.tuples(roles, HOSTILE_TEXT), min_size=1, max_size=5)


@fuzz(150)
@given(turns=conversations, generation_prompt=st.booleans())
def test_hostile_content_is_inserted_as_data(smol, turns, generation_prompt):
    messages = [ChatMessage(role, content) for role, content in turns]
    ok, text = accepted_or_typed(
        lambda: smol.apply_chat_template(messages, generation_prompt), (InvalidRequestError,),
        10.0, 'apply_chat_template')
    if not ok:
        assert any(r not in ROLES for r, _ in turns) and 'unknown role' in str(text)
        return
    # Each turn's content appears verbatim and in order: nothing in it was evaluated.
    pos = 0
    for role, content in turns:
        pos = text.index(f'<|im_start|>{role}\n{content}<|im_end|>', pos) + len(content)
    ids = bounded(lambda: smol.encode_chat(messages, generation_prompt), 10.0, 'encode_chat')
    assert ids and all(0 <= i < smol.vocab_size for i in ids)


def test_megabyte_of_content_renders_and_tokenizes_in_bounded_time(smol):
    content = ''.join(HOSTILE_SNIPPETS) * (1_000_000 // len(''.join(HOSTILE_SNIPPETS)))
    ids = bounded(lambda: smol.encode_chat([ChatMessage('user', content)]), 60.0,
                  'encode_chat of 1 MB')
    assert len(ids) > 100_000


def test_messages_that_are_not_messages_are_refused(smol):
    for bad in ([{'role': 'user'}], [{'role': 'user', 'content': 5}], [42], [None],
                [{'content': 'x'}], [ChatMessage('user', None)]):
        with pytest.raises(InvalidRequestError) as err:
            smol.apply_chat_template(bad)
        assert str(err.value)


# --- chat templates (they come from the model file) -------------------------------------
ESCAPES = (
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    '{{ messages.__class__.__base__.__subclasses__() }}',
    "{{ cycler.__init__.__globals__.os.system('id') }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    '{{ joiner.__init__.__globals__ }}',
    '{{ namespace.__init__.__globals__ }}',
    '{{ self.__init__.__globals__.__builtins__ }}',
    "{{ ''|attr('__class__')|attr('__mro__') }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{{ '%s'|format(messages.__class__) }}",
    '{{ raise_exception.__globals__ }}',
    "{{ strftime_now.__globals__['datetime'] }}",
    "{% set x = messages.append({'role': 'system', 'content': 'pwned'}) %}{{ messages }}",
    "{% set _ = messages[0].update({'content': 'pwned'}) %}{{ messages }}",
    '{{ messages.pop() }}',
    "{% include '/etc/passwd' %}",
    "{% import 'os' as os %}{{ os }}",
    "{% extends '/etc/passwd' %}",
    '{{ config }}{{ request }}{{ self._TemplateReference__context }}',
    '{{ range(10**9)|list }}',
    '{{ 1 / (messages|length - messages|length) }}',
    '{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}',
    "{{ messages[0]['content']|int(base=99) }}",
    '{{ undefined.attribute.chain }}',
    '{% for',
)


def _template_tokenizer(tiny: TextTokenizer, source: str) -> TextTokenizer:
    return TextTokenizer(tiny.hf_tokenizer, source, SpecialTokens(1, (2,), False))


def _render_hostile(tiny: TextTokenizer, source: str):
    """Render a template from a hostile model file: (True, text) or (False, typed error)."""
    ok, tok = accepted_or_typed(lambda: _template_tokenizer(tiny, source), (ModelLoadError,))
    if not ok:
        return ok, tok
    # Isolated: a template is code and may allocate without bound ('a' * 99999 * 99999).
    return accepted_or_typed(
        lambda: tok.apply_chat_template([ChatMessage('user', 'hi')]),
        (ModelLoadError, InvalidRequestError), 10.0, f'render {source!r}', isolate=True)


@pytest.mark.parametrize('source', ESCAPES)
def test_template_escapes_end_in_typed_errors(tiny, source):
    ok, out = _render_hostile(tiny, source)
    if ok:
        # Jinja renders what the sandbox hides as empty: nothing of Python's internals.
        for leak in ('<class', '<function', '<module', '<built-in', 'pwned', 'root:'):
            assert leak not in out, (source, out)


template_parts = st.sampled_from([
    '{{ ', ' }}', '{% ', ' %}', 'messages', '[0]', "['content']", '.__class__', '.__dict__',
    '.__globals__', '|attr("__init__")', '|list', '|join', '|tojson', '|length', ' ~ ',
    ' * ', ' / ', ' // ', ' % ', '(', ')', 'range(', '99999', '0', 'loop', 'for m in ',
    'endfor', 'if ', 'endif', 'set x = ', 'x', 'cycler', 'lipsum', 'namespace(', 'self',
    'raise_exception(', 'strftime_now(', "'%Y'", "'a'", ',', '.format(', '.items()',
    '.update(', '.append(', 'macro f()', 'endmacro', 'f()', 'add_generation_prompt'])


@fuzz(300)
@given(parts=st.lists(template_parts, max_size=14))
def test_random_templates_end_in_typed_errors(tiny, parts):
    _render_hostile(tiny, ''.join(parts))


# --- JSON schemas -------------------------------------------------------------------------
SCHEMA_TIMEOUT_S = 30.0
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
              st.floats(allow_nan=False), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=20)
KEYWORDS = ('type', 'properties', 'items', 'prefixItems', 'enum', 'const', 'pattern',
            'minLength', 'maxLength', 'minItems', 'maxItems', 'minimum', 'maximum',
            'exclusiveMinimum', 'multipleOf', 'required', 'additionalProperties', 'anyOf',
            'allOf', 'oneOf', 'not', '$ref', '$defs', 'format', 'if', 'then', 'else',
            'patternProperties', 'uniqueItems', 'contains', 'dependentRequired')
keyword_values = st.one_of(
    st.sampled_from(['string', 'integer', 'number', 'object', 'array', 'boolean', 'null',
                     ['string', 'null'], 'nonsense']),
    st.sampled_from(['#', '#/$defs/a', '#/$defs/missing', 'http://127.0.0.1:9/x.json',
                     'file:///etc/passwd', '(a+)+$', '[', '^\\d{3}$', 'date-time', 'email']),
    st.integers(-5, 10**6), st.floats(allow_nan=False, allow_infinity=False),
    st.lists(st.text(max_size=4), max_size=4), json_values)
schemas = st.recursive(
    st.dictionaries(st.sampled_from(KEYWORDS), keyword_values, max_size=4),
    lambda inner: st.one_of(
        st.dictionaries(st.sampled_from(KEYWORDS), st.one_of(keyword_values, inner),
                        max_size=4),
        st.builds(lambda p: {'type': 'object', 'properties': p}, st.dictionaries(
            st.text(string.ascii_letters, max_size=5), inner, max_size=4)),
        st.builds(lambda i: {'type': 'array', 'items': i}, inner),
        st.builds(lambda a: {'anyOf': a}, st.lists(inner, max_size=3)),
        st.builds(lambda d, r: {'$defs': {'a': d}, '$ref': r}, inner,
                  st.sampled_from(['#/$defs/a', '#', '#/$defs/b']))),
    max_leaves=12)


def _compile_and_start(tokenizer: TextTokenizer, text: str) -> None:
    """compile(): InvalidSchemaError or a constraint whose first mask works or is typed."""
    ok, constraint = accepted_or_typed(
        lambda: JsonSchemaConstraint.compile(text, tokenizer), (InvalidSchemaError,),
        SCHEMA_TIMEOUT_S, 'JsonSchemaConstraint.compile', isolate=True)
    if not ok:
        return
    mask = np.zeros(tokenizer.vocab_size, dtype=bool)

    def first_step() -> None:
        state = constraint.start()
        state.fill_mask(mask)
    # An unsatisfiable schema ($ref loop) fails here, as the generator reports it.
    accepted_or_typed(first_step, (EngineError,), SCHEMA_TIMEOUT_S, 'first mask')


@fuzz(200)
@given(schema=schemas)
def test_random_schemas_compile_or_raise_invalid_schema(tiny, schema):
    _compile_and_start(tiny, json.dumps(schema))


@fuzz(200)
@given(text=st.one_of(st.text(max_size=40), json_values.map(json.dumps),
                      st.sampled_from(['', 'null', 'true', 'false', '[]', '{', '{"type":',
                                       'NaN', '1e999', '"\\ud800"', '{"a": 1, "a": 2}'])))
def test_random_schema_text_compiles_or_raises_invalid_schema(tiny, text):
    _compile_and_start(tiny, text)


def _nested(depth: int) -> str:
    """Return a valid schema of arrays nested depth deep, as text (json.dumps recurses)."""
    return '{"type": "array", "items": ' * depth + '{"type": "string"}' + '}' * depth


HUGE_SCHEMAS = {
    'nested JSON text 100k deep': '[' * 100_000,
    'nested objects 5k deep': '{"a": ' * 5_000 + '1' + '}' * 5_000,
    'schema nested 3k deep': _nested(3_000),
    'enum of 100k strings': json.dumps({'enum': [f'v{i}' for i in range(100_000)]}),
    'remote $ref': json.dumps({'$ref': 'http://127.0.0.1:9/schema.json'}),
    '$ref loop': json.dumps({'$defs': {'a': {'$ref': '#/$defs/a'}}, '$ref': '#/$defs/a'}),
    'anyOf explosion': json.dumps({'allOf': [{'anyOf': [
        {'type': 'string', 'pattern': f'a{{{i}}}'} for i in range(30)]} for _ in range(8)]}),
    'minLength 1e9': json.dumps({'type': 'string', 'minLength': 10**9}),
    'number 1e300': json.dumps({'type': 'integer', 'minimum': 10**300}),
}


@pytest.mark.parametrize('name', sorted(HUGE_SCHEMAS))
def test_huge_and_recursive_schemas_are_bounded(tiny, name):
    _compile_and_start(tiny, HUGE_SCHEMAS[name])


# --- sampling configs ---------------------------------------------------------------------
reals = st.one_of(st.floats(), st.floats(0, 2),
                  st.sampled_from([0.0, 1.0, 5e-324, 1e-300, 1e300, -0.0]), JUNK)
ints = st.one_of(st.integers(-3, 70_000), st.integers(-2**70, 2**70), JUNK)


@fuzz(400)
@given(temperature=reals, top_k=ints, top_p=reals, min_p=reals, repetition_penalty=reals,
       presence_penalty=reals, seed=st.one_of(st.none(), ints),
       logits=st.sampled_from(['normal', 'flat', 'spiky', 'masked', 'huge']))
# Both pass validate() and fit the float32 fields of SamplingParams: 1/T and seen/penalty
# overflow float32 logits to inf, top-p then keeps no token (ValueError in the decode loop).
@example(temperature=1e-45, top_k=0, top_p=0.9, min_p=0.0, repetition_penalty=1.0,
         presence_penalty=0.0, seed=0, logits='normal')
@example(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0, repetition_penalty=1e-40,
         presence_penalty=0.0, seed=0, logits='normal')
def test_sampling_configs_validate_or_raise_and_valid_ones_pick_a_token(
        temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, seed, logits):
    config = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            repetition_penalty=repetition_penalty,
                            presence_penalty=presence_penalty, seed=seed)
    ok, _ = accepted_or_typed(lambda: validate(config), (InvalidSamplingError,))
    if not ok:
        return
    vocab = 2048
    rng = np.random.default_rng(0)
    values = {'normal': rng.normal(0, 3, vocab), 'flat': np.zeros(vocab),
              'spiky': np.where(rng.random(vocab) < 0.01, 30.0, -30.0),
              'masked': rng.normal(0, 3, vocab), 'huge': rng.normal(0, 3e38, vocab)}[logits]
    values = np.clip(values, -3e38, 3e38).astype(np.float32)
    mask = rng.random(vocab) < 0.05 if logits == 'masked' else None
    if mask is not None:
        mask[7] = True
    sampler = build_sampler(config, vocab)
    sampler.reset([1, 2, 3, 7, 7])
    for _ in range(4):
        token = sampler.sample(values, mask)
        assert 0 <= token < vocab and (mask is None or mask[token])
        sampler.accept(token)


@pytest.mark.parametrize('temperature', [1e-6, 1e-20, 1e-45, 5e-324])
def test_tiny_temperatures_tend_to_greedy(temperature):
    # The T -> 0 limit of sampling is greedy; 1/T must not overflow into garbage picks.
    logits = np.random.default_rng(1).normal(0, 3, 2048).astype(np.float32)
    sampler = build_sampler(SamplingConfig(temperature=temperature, seed=0), logits.size)
    assert sampler.sample(logits) == int(np.argmax(logits))


def test_repository_has_no_fuzz_regressions_left(tiny):
    """The cases fuzzing found once, kept as plain assertions (see docs/reliability.md)."""
    for text in ('[' * 5_000, _nested(1_500)):
        with pytest.raises(InvalidSchemaError, match='nested'):
            JsonSchemaConstraint.compile(text, tiny)
    for source in ('{{ 1 / 0 }}', '{{ range(10**9)|list }}', "{% include 'x' %}"):
        with pytest.raises(InvalidRequestError, match='chat template'):
            _template_tokenizer(tiny, source).apply_chat_template([ChatMessage('user', 'x')])
