"""Constrained decoding with llguidance: JSON Schema, Lark grammar, regex or a choice list.

llguidance is the engine behind onnxruntime-genai's and llama.cpp's structured output.  Per
step the state fills a boolean mask of allowed tokens; the sampler removes the others, so every
finished output matches.  JSON is generated in the json.dumps layout (', ' and ': ', no other
whitespace) so a model cannot spend its budget on blank space.  Every kind compiles once, at
admission, into a GrammarConstraint; a grammar that does not compile is an
InvalidGrammarError carrying llguidance's message.  A request gives at most one kind
(compile_request_constraint checks it).
"""
from __future__ import annotations

import json
import threading
from typing import Any, Dict, List, Optional, Sequence
import weakref

import llguidance
import numpy as np

from edge_llm_ros.errors import EngineError, InvalidRequestError, InvalidSchemaError
from edge_llm_ros.runtime.tokenizer import TextTokenizer
from edge_llm_ros.runtime.tools.spec import (check_single_constraint, schema_problem,
                                             SCHEMA_TOO_DEEP)

JSON_OPTIONS: Dict[str, Any] = {
    'whitespace_flexible': False,
    'item_separator': ', ',
    'key_separator': ': ',
}

_TOO_DEEP = ('the JSON schema is nested too deeply to check (hundreds of levels): flatten it, '
             'e.g. with $defs and $ref')

# Building an LLTokenizer walks the whole vocabulary (~0.25 s): once per TextTokenizer.
_LL_TOKENIZERS: 'weakref.WeakKeyDictionary[TextTokenizer, llguidance.LLTokenizer]' = \
    weakref.WeakKeyDictionary()
_LL_LOCK = threading.Lock()


def ll_tokenizer(tokenizer: TextTokenizer) -> llguidance.LLTokenizer:
    """Return the llguidance view of `tokenizer` (built once per tokenizer)."""
    with _LL_LOCK:
        ll = _LL_TOKENIZERS.get(tokenizer)
        if ll is None:
            ll = llguidance.LLTokenizer(tokenizer.hf_tokenizer.to_str(),
                                        eos_token=list(tokenizer.eos_token_ids))
            _LL_TOKENIZERS[tokenizer] = ll
        return ll


MAX_CHOICES = 1024
_WHAT = {'json_schema': 'the JSON schema', 'grammar': 'the grammar', 'regex': 'the regular '
         'expression', 'choices': 'the choice list', 'tools': 'the tool-call format'}
MAX_GRAMMAR_CHARS = 1 << 20


class InvalidGrammarError(InvalidRequestError):
    """A Lark grammar, regular expression or choice list cannot be compiled."""


class GrammarConstraint:
    """A compiled llguidance grammar; `start()` gives the per-generation state."""

    def __init__(self, grammar: str, ll_tok: llguidance.LLTokenizer, kind: str) -> None:
        self.kind = kind        # json_schema | grammar | regex | choices | tools
        self.grammar = grammar  # llguidance's top-level JSON ({"grammars": [...]})
        self._ll = ll_tok

    def start(self) -> 'ConstraintState':
        """Return a fresh state for one generation."""
        return ConstraintState(llguidance.LLMatcher(self._ll, self.grammar, log_level=0),
                               self._ll.vocab_size, _WHAT.get(self.kind, self.kind))


def compile_grammar(grammar: str, tokenizer: TextTokenizer, kind: str,
                    what: str) -> GrammarConstraint:
    """Check llguidance's top-level grammar JSON for `tokenizer` (InvalidGrammarError)."""
    ll_tok = ll_tokenizer(tokenizer)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll_tok)
    if is_error:
        reason = messages[0] if messages else 'no reason given'
        raise InvalidGrammarError(f'the {what} does not compile: {reason}')
    return GrammarConstraint(grammar, ll_tok, kind)


def _text(value: object, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidGrammarError(f'the {what} must be non-empty text')
    if len(value) > MAX_GRAMMAR_CHARS:
        raise InvalidGrammarError(f'the {what} has {len(value)} characters; at most '
                                  f'{MAX_GRAMMAR_CHARS} are accepted')
    return value


def compile_lark(text: str, tokenizer: TextTokenizer,
                 kind: str = 'grammar') -> GrammarConstraint:
    """Compile a Lark grammar in llguidance's dialect (its docs/syntax.md; `start` rule)."""
    grammar = llguidance.LLMatcher.grammar_from_lark(_text(text, 'Lark grammar'))
    return compile_grammar(grammar, tokenizer, kind, 'Lark grammar')


def compile_regex(text: str, tokenizer: TextTokenizer) -> GrammarConstraint:
    """Compile a regular expression (Rust regex syntax) the whole output must match."""
    grammar = llguidance.LLMatcher.grammar_from_regex(_text(text, 'regular expression'))
    return compile_grammar(grammar, tokenizer, 'regex', 'regular expression')


def compile_choices(choices: Sequence[str], tokenizer: TextTokenizer) -> GrammarConstraint:
    """Compile a choice list: the output is exactly one of `choices` (distinct texts)."""
    if isinstance(choices, str) or not isinstance(choices, (list, tuple)) or not choices:
        raise InvalidGrammarError('choices must be a non-empty list of strings')
    if len(choices) > MAX_CHOICES:
        raise InvalidGrammarError(f'{len(choices)} choices given; at most {MAX_CHOICES}')
    for i, c in enumerate(choices):
        if not isinstance(c, str) or not c:
            raise InvalidGrammarError(f'choices[{i}] must be non-empty text')
    if len(set(choices)) != len(choices):
        raise InvalidGrammarError('choices must be distinct; remove the repeated entry')
    # JSON string escapes are Lark string escapes in llguidance.
    lark = 'start: ' + ' | '.join(json.dumps(c) for c in choices)
    return compile_grammar(llguidance.LLMatcher.grammar_from_lark(lark), tokenizer, 'choices',
                           'choice list')


def compile_request_constraint(tokenizer: TextTokenizer, json_schema: str = '',
                               grammar: str = '', regex: str = '',
                               choices: Sequence[str] = (),
                               tools_constrained: bool = False
                               ) -> Optional[GrammarConstraint]:
    """Compile the one constraint a request asks for (None if none); refuse conflicts.

    tools_constrained: the request has tools with tool_choice other than 'none' (their
    constraint is built by tools.grammar; here it only counts for the conflict check).
    """
    kind = check_single_constraint(tools=tools_constrained, json_schema=json_schema,
                                   grammar=grammar, regex=regex, choices=choices)
    if kind == 'json_schema':
        return JsonSchemaConstraint.compile(json_schema, tokenizer)
    if kind == 'grammar':
        return compile_lark(grammar, tokenizer)
    if kind == 'regex':
        return compile_regex(regex, tokenizer)
    if kind == 'choices':
        return compile_choices(choices, tokenizer)
    return None


class JsonSchemaConstraint(GrammarConstraint):
    """A compiled JSON schema (`schema` is the parsed document)."""

    def __init__(self, schema: Dict[str, Any], grammar: str,
                 ll_tok: llguidance.LLTokenizer) -> None:
        super().__init__(grammar, ll_tok, 'json_schema')
        self.schema = schema

    @classmethod
    def compile(cls, schema_text: str,  # noqa: A003 (the agreed engine API name)
                tokenizer: TextTokenizer) -> 'JsonSchemaConstraint':
        """Check `schema_text` (JSON Schema as text) and compile it for `tokenizer`."""
        try:
            schema = json.loads(schema_text)
        except (TypeError, ValueError) as exc:
            raise InvalidSchemaError(f'the JSON schema is not valid JSON: {exc}') from exc
        except RecursionError:
            raise InvalidSchemaError(_TOO_DEEP) from None
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise InvalidSchemaError('the JSON schema must be an object (or true), not '
                                     f'{json.dumps(schema)[:40]}')
        problem = schema_problem(schema)
        if problem == SCHEMA_TOO_DEEP:
            raise InvalidSchemaError(_TOO_DEEP)
        if problem:
            raise InvalidSchemaError(f'the JSON schema is {problem}')
        ll_tok = ll_tokenizer(tokenizer)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema,
                                                                    overrides=JSON_OPTIONS)
        except ValueError as exc:
            raise InvalidSchemaError(f'the JSON schema cannot be compiled: {exc}') from exc
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll_tok)
        if is_error:
            raise InvalidSchemaError('the JSON schema cannot be used for constrained decoding: '
                                     f'{messages[0]}')
        return cls(schema, grammar, ll_tok)


class ConstraintState:
    """Tracks one generation through the grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int,
                 what: str = 'the constraint') -> None:
        if matcher.is_error():
            raise EngineError(f'the constraint could not start: {matcher.get_error()}')
        self._m = matcher
        self._n = vocab_size
        self._what = what
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def fill_mask(self, mask: np.ndarray) -> None:
        """Write the allowed tokens of the next step into `mask` (bool, model vocabulary).

        Model vocabularies padded past the tokenizer's get False for the padding.
        """
        if mask.dtype != np.bool_ or mask.ndim != 1 or mask.size < self._n:
            raise EngineError(f'the mask must be a 1-D bool array of at least {self._n} entries')
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._check()
        bits = np.unpackbits(self._bits.view(np.uint8), count=self._n, bitorder='little')
        mask[:self._n] = bits.view(np.bool_)
        mask[self._n:] = False

    def accept(self, token_id: int) -> None:
        """Advance past the sampled token; it must have been allowed by the last mask."""
        if not self._m.consume_token(int(token_id)):
            raise EngineError(f'token {token_id} violates {self._what}: '
                              f'{self._m.get_error()}')

    def forced_tokens(self) -> List[int]:
        """Return the tokens the grammar forces next, whatever the model says (may be [])."""
        tokens = self._m.compute_ff_tokens()
        self._check()
        return list(tokens)

    def is_finished(self) -> bool:
        """Tell whether the output is complete (only an end-of-generation token may follow)."""
        return self._m.is_stopped()

    def is_accepting(self) -> bool:
        """Tell whether the text so far is a complete match (more may still follow)."""
        return self._m.is_accepting()

    def _check(self) -> None:
        if self._m.is_error():
            raise EngineError(f'constrained decoding failed: {self._m.get_error()}')
