"""JSON-schema constrained decoding with llguidance.

llguidance is the engine behind onnxruntime-genai's and llama.cpp's structured output.  Per
step the state fills a boolean mask of allowed tokens; the sampler removes the others, so every
finished output parses and validates.  JSON is generated in the json.dumps layout
(', ' and ': ', no other whitespace) so a model cannot spend its budget on blank space.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Dict
import weakref

import jsonschema
import llguidance
import numpy as np

from .errors import EngineError, InvalidSchemaError
from .tokenizer import TextTokenizer

_JSON_OPTIONS: Dict[str, Any] = {
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


class JsonSchemaConstraint:
    """A compiled schema; `start()` gives the per-generation state."""

    def __init__(self, schema: Dict[str, Any], grammar: str,
                 ll_tok: llguidance.LLTokenizer) -> None:
        self.schema = schema
        self._grammar = grammar
        self._ll = ll_tok

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
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as exc:
            where = '/'.join(str(p) for p in exc.absolute_path) or '(root)'
            raise InvalidSchemaError(f'the JSON schema is invalid at {where}: '
                                     f'{exc.message}') from exc
        except RecursionError:
            # jsonschema checks recursively: a few hundred levels exhaust Python's stack.
            raise InvalidSchemaError(_TOO_DEEP) from None
        ll_tok = ll_tokenizer(tokenizer)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema,
                                                                    overrides=_JSON_OPTIONS)
        except ValueError as exc:
            raise InvalidSchemaError(f'the JSON schema cannot be compiled: {exc}') from exc
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll_tok)
        if is_error:
            raise InvalidSchemaError('the JSON schema cannot be used for constrained decoding: '
                                     f'{messages[0]}')
        return cls(schema, grammar, ll_tok)

    def start(self) -> 'ConstraintState':
        """Return a fresh state for one generation."""
        return ConstraintState(llguidance.LLMatcher(self._ll, self._grammar, log_level=0),
                               self._ll.vocab_size)


class ConstraintState:
    """Tracks one generation through the grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        if matcher.is_error():
            raise EngineError(f'the constraint could not start: {matcher.get_error()}')
        self._m = matcher
        self._n = vocab_size
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
            raise EngineError(f'token {token_id} violates the JSON schema: '
                              f'{self._m.get_error()}')

    def is_finished(self) -> bool:
        """Tell whether the JSON value is complete (only an end-of-generation token may follow)."""
        return self._m.is_stopped()

    def is_accepting(self) -> bool:
        """Tell whether the text so far is a complete value (more may still follow)."""
        return self._m.is_accepting()

    def _check(self) -> None:
        if self._m.is_error():
            raise EngineError(f'constrained decoding failed: {self._m.get_error()}')
