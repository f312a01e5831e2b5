"""Text side of the engine: tokenizer.json + the model's Jinja chat template + streaming decode.

The chat template comes from the model file, so it is rendered in jinja2's immutable sandbox: a
template cannot reach Python internals, and message content is data inserted as text, never
evaluated.
"""
from __future__ import annotations

from dataclasses import dataclass
import datetime
import json
import os
import pathlib
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
import yaml

from edge_llm_ros.errors import InvalidRequestError, ModelLoadError
from edge_llm_ros.model_format import CHAT_TEMPLATE_FILE, TOKENIZER_FILE
from edge_llm_ros.runtime.tools.spec import check_tools, ToolCall
from edge_llm_ros.runtime.types import ChatMessage, ROLES

MODEL_YAML = 'model.yaml'

MessageLike = Union[ChatMessage, Mapping[str, Any]]
# Variables the engine sets itself; template_kwargs cannot replace them.
_RESERVED_VARS = frozenset({'messages', 'add_generation_prompt', 'tools', 'bos_token',
                            'eos_token'})


@dataclass(frozen=True)
class SpecialTokens:
    """Special-token facts from model.yaml."""

    bos_token_id: Optional[int]
    eos_token_ids: Tuple[int, ...]
    add_bos_token: bool


class TextTokenizer:
    """Encode/decode, chat templating and incremental detokenization for one model."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str, special: SpecialTokens) -> None:
        self._tok = tokenizer
        self._special = special
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        for tid in (special.bos_token_id, *special.eos_token_ids):
            if tid is not None and not 0 <= tid < self.vocab_size:
                raise ModelLoadError(f'special token id {tid} is outside the vocabulary '
                                     f'(size {self.vocab_size}); fix model.yaml')
        self._template = _compile_template(chat_template)
        self._uses_tools = 'tools' in _template_variables(chat_template)
        self._uses_tool_calls = 'tool_calls' in chat_template
        self._template_vars = {
            'bos_token': self._token_text(special.bos_token_id),
            'eos_token': self._token_text(special.eos_token_ids[0] if special.eos_token_ids
                                          else None),
        }
        self._special_ids = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def from_dir(cls, model_dir: os.PathLike) -> 'TextTokenizer':
        """Load tokenizer.json, chat_template.jinja and the special ids of model.yaml."""
        root = pathlib.Path(model_dir)
        paths = {name: root / name for name in (TOKENIZER_FILE, CHAT_TEMPLATE_FILE, MODEL_YAML)}
        missing = [name for name, p in paths.items() if not p.is_file()]
        if missing:
            raise ModelLoadError(f'model folder {root} lacks {", ".join(missing)}; '
                                 're-run the converter (edge-llm-convert) on the source model')
        try:
            tokenizer = Tokenizer.from_file(str(paths[TOKENIZER_FILE]))
        except Exception as exc:  # the library raises a bare Exception on bad JSON
            raise ModelLoadError(f'{paths[TOKENIZER_FILE]} is not a valid tokenizer: {exc}; '
                                 're-run the converter') from exc
        try:
            meta = yaml.safe_load(paths[MODEL_YAML].read_text(encoding='utf-8')) or {}
        except yaml.YAMLError as exc:
            raise ModelLoadError(f'{paths[MODEL_YAML]} is not valid YAML: {exc}') from exc
        special = _special_from_yaml(meta, paths[MODEL_YAML])
        template = paths[CHAT_TEMPLATE_FILE].read_text(encoding='utf-8')
        return cls(tokenizer, template, special)

    # --- plain tokenization -----------------------------------------------------------------

    @property
    def hf_tokenizer(self) -> Tokenizer:
        """Return the underlying `tokenizers.Tokenizer` (shared, do not mutate)."""
        return self._tok

    @property
    def bos_token_id(self) -> Optional[int]:
        return self._special.bos_token_id

    @property
    def eos_token_ids(self) -> Tuple[int, ...]:
        return self._special.eos_token_ids

    @property
    def add_bos_token(self) -> bool:
        return self._special.add_bos_token

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        """Token ids of `text`; special tokens written in it (e.g. <|im_start|>) are parsed.

        add_special_tokens=True adds BOS (and EOS) where the model asks for it.
        """
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: Iterable[int]) -> List[str]:
        """Return the vocabulary entries of `ids` (byte-level forms like 'Ġthe', not text)."""
        out = []
        for i in ids:
            text = self._tok.id_to_token(int(i))
            if text is None:
                raise InvalidRequestError(f'token id {i} is outside the vocabulary '
                                          f'(0..{self.vocab_size - 1})')
            out.append(text)
        return out

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    # --- chat --------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[MessageLike],
                            add_generation_prompt: bool = True,
                            tools: Sequence[Any] = (),
                            template_kwargs: Optional[Mapping[str, Any]] = None) -> str:
        """Render the conversation with the model's own template.

        As Hugging Face does: `tools` (ToolSpecs or OpenAI tool dicts) go to the template as
        `tools=[{"type": "function", "function": {...}}]`, messages may carry `tool_calls`
        (arguments as dicts), `tool_call_id` and `name`, and `template_kwargs` are extra
        template variables (e.g. enable_thinking=False).
        """
        dicts = [message_dict(m, i) for i, m in enumerate(messages)]
        if not dicts:
            raise InvalidRequestError('the conversation is empty: give at least one message')
        variables = dict(self._template_vars)
        if tools:
            variables['tools'] = [t.to_hf() for t in check_tools(tools)]
        for key, value in (template_kwargs or {}).items():
            if key in _RESERVED_VARS or not isinstance(key, str) or not key.isidentifier():
                raise InvalidRequestError(f'template variable {key!r} cannot be set; it is '
                                          'reserved or not a name')
            variables[key] = value
        try:
            return self._template.render(messages=dicts,
                                         add_generation_prompt=add_generation_prompt,
                                         **variables)
        except jinja2.exceptions.SecurityError as exc:
            raise ModelLoadError(f'the chat template tried an unsafe operation ({exc}); '
                                 'replace chat_template.jinja') from exc
        except jinja2.TemplateError as exc:
            # raise_exception() in templates reports conversations they cannot express.
            raise InvalidRequestError(f'the chat template rejected the conversation: {exc}') \
                from exc
        except Exception as exc:  # noqa: B902 - the template's own bug (1/0, range(1e9), ...)
            raise InvalidRequestError(f'the chat template failed on this conversation '
                                      f'({type(exc).__name__}: {exc}); fix chat_template.jinja'
                                      ) from exc

    @property
    def template_uses_tools(self) -> bool:
        """Whether the chat template reads `tools` (else tools must be described in text)."""
        return self._uses_tools

    @property
    def template_uses_tool_calls(self) -> bool:
        """Whether the chat template writes assistant `tool_calls` itself."""
        return self._uses_tool_calls

    def encode_chat(self, messages: Sequence[MessageLike],
                    add_generation_prompt: bool = True, tools: Sequence[Any] = (),
                    template_kwargs: Optional[Mapping[str, Any]] = None) -> List[int]:
        """Render and tokenize a conversation, adding BOS once if the model wants it."""
        return self.encode_prompt(self.apply_chat_template(messages, add_generation_prompt,
                                                           tools, template_kwargs))

    def encode_prompt(self, prompt: str) -> List[int]:
        """Tokenize a rendered prompt, adding BOS once if the model wants it."""
        ids = self.encode(prompt)
        bos = self._special.bos_token_id
        if self._special.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    # --- streaming ---------------------------------------------------------------------------

    def new_stream(self, skip_special_tokens: bool = True) -> 'TokenStream':
        """Start incremental detokenization of one generation."""
        return TokenStream(self._tok, skip_special_tokens)

    def _token_text(self, token_id: Optional[int]) -> str:
        return '' if token_id is None else (self._tok.id_to_token(token_id) or '')


class TokenStream:
    """Turns generated ids into text deltas that are always complete UTF-8 characters.

    Only a short trailing window is decoded per token: `_prefix` marks the start of the window
    (text already emitted up to `_read`), so each push costs O(window), not O(sequence).  When
    the window's text ends with U+FFFD, the last token(s) hold part of a multi-byte character
    and nothing is emitted until it completes (or `flush()` at the end).  Joining every delta
    plus `flush()` equals `decode(all ids)`.
    """

    # A stream whose tokens never complete a character stops holding back after this many
    # tokens, so a degenerate model cannot make each step slower than the last (only then can
    # the joined deltas differ from decode(all ids), in where U+FFFD marks appear).
    MAX_HELD_TOKENS = 64

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: List[int] = []
        self._prefix = 0          # window start (ids before it are never decoded again)
        self._read = 0            # ids before this have been emitted
        self._prefix_text = ''    # decode(ids[_prefix:_read])

    @property
    def token_ids(self) -> List[int]:
        return self._ids

    @property
    def window_size(self) -> int:
        """Return how many ids the next push will decode (stays small)."""
        return len(self._ids) - self._prefix + 1

    def push(self, token_id: int) -> str:
        """Add one id; return the new text (possibly '')."""
        self._ids.append(int(token_id))
        text = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        if not text.endswith('\ufffd'):
            return self._advance(text)
        if len(self._ids) - self._read < self.MAX_HELD_TOKENS:
            return ''
        # Give up on completing the character: emit as is and restart the window here.
        delta = text[len(self._prefix_text):]
        self._prefix = self._read = len(self._ids)
        self._prefix_text = ''
        return delta

    def flush(self) -> str:
        """Return whatever is still held back (a trailing partial character becomes U+FFFD)."""
        if self._read == len(self._ids):
            return ''
        text = self._tok.decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        return self._advance(text)

    def _advance(self, text: str) -> str:
        delta = text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._tok.decode(self._ids[self._prefix:],
                                             skip_special_tokens=self._skip)
        return delta


# --- chat template sandbox ------------------------------------------------------------------

def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Optional[Tuple[str, str]] = None, sort_keys: bool = False) -> str:
    # Like HF's: unlike jinja's built-in, no HTML escaping, since prompts are not HTML.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=['jinja2.ext.loopcontrols'])
    env.filters['tojson'] = _tojson
    env.globals['raise_exception'] = _raise_exception
    env.globals['strftime_now'] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ModelLoadError(f'the chat template does not compile: {exc}; '
                             'fix chat_template.jinja') from exc


def message_dict(message: MessageLike, index: int) -> Dict[str, Any]:
    """One message as HF templates take it; the tool fields only when set."""
    if isinstance(message, Mapping):
        get = message.get
    elif isinstance(message, ChatMessage):
        def get(key: str, default: Any = None) -> Any:
            return getattr(message, key, default)
    else:
        raise InvalidRequestError(f'message {index} must be a ChatMessage or a dict with role '
                                  f'and content, not {type(message).__name__}')
    role, content = get('role'), get('content')
    if role not in ROLES:
        raise InvalidRequestError(f'message {index} has unknown role {role!r}; '
                                  f'use one of {", ".join(ROLES)}')
    if content is None and get('tool_calls'):
        content = ''
    if not isinstance(content, str):
        raise InvalidRequestError(f'message {index} content must be text')
    out: Dict[str, Any] = {'role': role, 'content': content}
    calls = get('tool_calls') or ()
    if calls:
        if role != 'assistant':
            raise InvalidRequestError(f'message {index}: only assistant messages carry '
                                      'tool_calls')
        out['tool_calls'] = [_call_dict(c, index, j) for j, c in enumerate(calls)]
    for key in ('tool_call_id', 'name'):
        value = get(key) or ''
        if not isinstance(value, str):
            raise InvalidRequestError(f'message {index}: {key} must be text')
        if value:
            out[key] = value
    return out


def _call_dict(call: Any, index: int, j: int) -> Dict[str, Any]:
    """Return a tool call as HF templates take it: arguments as a dict, not JSON text."""
    if isinstance(call, ToolCall):
        return call.to_hf()
    fn = call.get('function') if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get('name'), str):
        raise InvalidRequestError(f'message {index} tool_calls[{j}] must be a ToolCall or '
                                  '{"id", "type": "function", "function": {"name", "arguments"}}')
    args = fn.get('arguments', {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as exc:
            raise InvalidRequestError(f'message {index} tool_calls[{j}] arguments are not '
                                      f'JSON: {exc}') from None
    if not isinstance(args, dict):
        raise InvalidRequestError(f'message {index} tool_calls[{j}] arguments must be a JSON '
                                  'object')
    return {'id': str(call.get('id', '')), 'type': 'function',
            'function': {'name': fn['name'], 'arguments': args}}


def _template_variables(source: str) -> frozenset:
    """Names a template reads from its context (jinja2's static analysis)."""
    env = ImmutableSandboxedEnvironment(extensions=['jinja2.ext.loopcontrols'])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
    except jinja2.TemplateError:
        return frozenset()  # _compile_template reports it


def _special_from_yaml(meta: Mapping[str, Any], path: pathlib.Path) -> SpecialTokens:
    try:
        bos = meta.get('bos_token_id')
        eos = meta.get('eos_token_ids')
        eos_ids = tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None)
        return SpecialTokens(bos_token_id=None if bos is None else int(bos),
                             eos_token_ids=eos_ids,
                             add_bos_token=bool(meta.get('add_bos_token', False)))
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f'{path}: bos_token_id / eos_token_ids must be integers ({exc})') \
            from exc
