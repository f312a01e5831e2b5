"""Warm prompts: system prompts prefilled once and pinned in the prefix cache (docs/sessions.md).

    EngineConfig(warm_prompts=('You are a delivery robot. ...', 'file:~/robot/map.txt'))

An entry that starts with ``file:`` names a UTF-8 file holding the prompt (``~`` expanded);
any other entry is the prompt's text. The prompt's tokens are those of the chat template's
rendering of a conversation that starts with it as the system message, up to where the
conversations [system: text, user: ...] stop agreeing (whatever the user says): a goal or a
bridge request whose messages start with that system message renders to exactly these
tokens first, so prefix reuse (runtime/kv_cache.py) takes them from the pinned snapshot, in
any slot. Tools change the template's rendering of the system turn, so a goal with tools
reuses what it still shares (a hybrid's conv states: nothing).

The engine prefills each one through its normal run path, pins the KV (never evicted, outside
the saved sessions' bounds, counted in the KV budget at configure) and, with sessions.store,
saves it so the next configure restores it without a prefill (serving/session_store.py).
"""
from __future__ import annotations

from dataclasses import dataclass
import hashlib
import json
import math
import os
from typing import Optional, Sequence, Tuple

from edge_llm_ros.errors import ModelLoadError
from edge_llm_ros.model_format import ModelInfo
from edge_llm_ros.runtime.kv_cache import common_prefix
from edge_llm_ros.runtime.model_config import ModelFamilyConfig
from edge_llm_ros.runtime.structured import plan_request
from edge_llm_ros.runtime.tokenizer import TextTokenizer
from edge_llm_ros.runtime.types import ChatMessage

FILE_PREFIX = 'file:'
# User turns the rendering is compared with: the warm tokens are what every one of them
# shares, so no user text (a letter, a digit, a space, a newline, markup) can merge with them.
PROBES = ('Hello.', 'what now?', '42', ' x', '\n', '<b>', '¿Qué?')
LABEL_CHARS = 40


class WarmPromptError(ModelLoadError):
    """A warm prompt cannot be used: unreadable file, empty, too long, or over the KV budget."""


class StoredWarmStateError(WarmPromptError):
    """sessions.store holds a warm prompt's KV that this model cannot use.

    Written for another model (its folder's hash differs), by another converter version, for
    another KV layout or kv.dtype, longer than the context, or unreadable. Not fatal: the
    engine catches it at configure (or on ~/warm_prompt), prefills the prompt again, saves it
    anew and reports the error as the warm prompt's status.
    """


@dataclass(frozen=True)
class WarmPrompt:
    """One warm prompt: where it came from, its text and tokens, and its pinned KV bytes."""

    label: str                 # 'file:<path>', or the text's first LABEL_CHARS characters
    text: str
    ids: Tuple[int, ...]
    nbytes: int = 0            # of its pinned snapshot (0 until pinned)
    restored: bool = False     # read back from sessions.store (no prefill) when pinned
    # Why its stored state could not be used (a StoredWarmStateError's text; '' = none).
    stored_error: str = ''

    @property
    def status(self) -> str:
        """Return how it was pinned: restored, prefilled, or re-prefilled with the reason."""
        if self.restored:
            return 'restored from sessions.store'
        if self.stored_error:
            return f're-prefilled: {self.stored_error}'
        return 'prefilled'

    @property
    def key(self) -> str:
        """Return the digest of its token ids (its identity in the store)."""
        return prompt_key(self.ids)

    @property
    def tokens(self) -> int:
        return len(self.ids)


def prompt_key(ids: Sequence[int]) -> str:
    """Digest of a warm prompt's token ids: the same prompt on the same tokenizer, the same key."""
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:32]


def read_source(source: str, path: str = '') -> Tuple[str, str]:
    """Return (label, text) of a kv.warm_prompts entry, or of a file path (path wins).

    Raises WarmPromptError for a file that cannot be read or for an empty prompt.
    """
    if not isinstance(source, str) or not isinstance(path, str):
        raise WarmPromptError('a warm prompt is text, or file:<path>')
    if not path and source.startswith(FILE_PREFIX):
        path = source[len(FILE_PREFIX):]
    if path:
        full = os.path.expanduser(path)
        try:
            with open(full, encoding='utf-8') as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise WarmPromptError(
                f'warm prompt file {full} cannot be read ({exc}): give a readable UTF-8 file, '
                f'or the prompt text itself (without {FILE_PREFIX!r})') from None
        label = FILE_PREFIX + full
    else:
        text = source
        label = text[:LABEL_CHARS] + ('...' if len(text) > LABEL_CHARS else '')
    if not text.strip():
        raise WarmPromptError(f'warm prompt {label!r} is empty: give the system prompt text')
    return ' '.join(label.split()), text


def prompt_ids(tokenizer: TextTokenizer, family: Optional[ModelFamilyConfig],
               text: str) -> Tuple[int, ...]:
    """Tokens every conversation [system: text, user: ...] starts with (the chat template's)."""
    plans = [plan_request(tokenizer, family, [ChatMessage('system', text),
                                              ChatMessage('user', probe)]).prompt_ids
             for probe in PROBES]
    n = min(common_prefix(plans[0], other) for other in plans[1:])
    return tuple(plans[0][:n])


def load(source: str, tokenizer: TextTokenizer, family: Optional[ModelFamilyConfig],
         capacity: int, path: str = '') -> WarmPrompt:
    """Read, render and check one warm prompt (WarmPromptError saying what to change)."""
    label, text = read_source(source, path)
    ids = prompt_ids(tokenizer, family, text)
    if not ids:
        raise WarmPromptError(f'warm prompt {label!r}: the chat template renders no tokens of '
                              'it before the user turn, so no goal could reuse it: drop it')
    if len(ids) + 1 > capacity:   # one position more: the goal's own text
        raise WarmPromptError(
            f'warm prompt {label!r} is {len(ids)} tokens, and the context holds {capacity}: '
            'shorten it or raise kv.max_context')
    return WarmPrompt(label, text, ids)


def snapshot_bytes(info: ModelInfo, positions: int, kv_dtype: str) -> int:
    """Bytes of a pinned snapshot of this many positions (kv_cache's snapshot layout).

    Per attention layer K and V ([kv_heads, positions, head_dim] at the buffers' precision, or
    int8 with one float32 scale per row), plus a hybrid's conv states at its end.
    """
    itemsize = 2 if info.activation_dtype == 'float16' else 4
    rows = sum(2 * info.kv_dims(i)[0] for i in info.kv_layers) * positions
    values = info.kv_values_per_position * positions
    kv = values + rows * 4 if kv_dtype == 'int8' else values * itemsize
    states = sum(math.prod(info.state_of(i).shape) for i in info.conv_layers) * itemsize
    return kv + states
