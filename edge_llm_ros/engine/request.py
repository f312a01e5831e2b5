"""Request validation and preparation: GenerationRequest -> the positions and pieces to run.

Everything a request can get wrong is found here, before the first token, and raised as an
InvalidRequestError subclass whose message says what to change. The result carries the
rendered prompt ids, the cache keys of every position (see kv_cache) and the per-request
pieces the decode loop needs.
"""
from __future__ import annotations

from dataclasses import dataclass
import hashlib
from typing import Callable, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from edge_llm_ros.engine import sampling
from edge_llm_ros.engine.errors import ContextOverflowError, InvalidRequestError
from edge_llm_ros.engine.kv_cache import check_fits
from edge_llm_ros.engine.tokenizer import TextTokenizer
from edge_llm_ros.engine.types import ChatMessage, GenerationRequest, ROLES, SamplingConfig


class InvalidEmbeddingsError(InvalidRequestError):
    """prefix_embeddings have the wrong type, shape or values."""


@dataclass
class PreparedRequest:
    """A validated request, ready for the generator."""

    prompt_ids: List[int]
    embeds: Optional[np.ndarray]    # [e, hidden] in the model's activation dtype, or None
    keys: List[Hashable]            # cache key of every prompt position (embeds first)
    max_tokens: int
    sampling: SamplingConfig
    stop: Tuple[str, ...]
    constraint: Optional[object]    # compiled JSON-schema constraint (has .start())
    session_id: str

    @property
    def prompt_positions(self) -> int:
        return len(self.keys)


def embedding_keys(embeds: np.ndarray) -> List[Hashable]:
    """Cache keys of prefix embeddings: by content, so only identical bytes are reused."""
    digest = hashlib.blake2b(np.ascontiguousarray(embeds).tobytes(), digest_size=16).hexdigest()
    return [('emb', digest, i) for i in range(embeds.shape[0])]


def conversation(request: GenerationRequest) -> List[ChatMessage]:
    """List the messages to render: system_prompt, messages, then the prompt as a user turn."""
    messages: List[ChatMessage] = []
    if request.system_prompt:
        messages.append(ChatMessage('system', request.system_prompt))
    for i, m in enumerate(request.messages):
        if not isinstance(m, ChatMessage):
            raise InvalidRequestError(f'messages[{i}] must be a ChatMessage, not '
                                      f'{type(m).__name__}')
        if m.role not in ROLES:
            raise InvalidRequestError(f'messages[{i}] has unknown role {m.role!r}: use one of '
                                      f'{", ".join(ROLES)}')
        messages.append(m)
    if request.prompt:
        messages.append(ChatMessage('user', request.prompt))
    return messages


def _check_embeddings(value, hidden_size: int, dtype, max_tokens: int,
                      capacity: int) -> Optional[np.ndarray]:
    if value is None:
        return None
    if not isinstance(value, np.ndarray):
        raise InvalidEmbeddingsError(f'prefix_embeddings must be a numpy array, not '
                                     f'{type(value).__name__}')
    if value.dtype not in (np.float32, np.float16):
        raise InvalidEmbeddingsError(f'prefix_embeddings dtype {value.dtype} is not float32 '
                                     'or float16')
    arr = value[0] if value.ndim == 3 and value.shape[0] == 1 else value
    if arr.ndim != 2 or arr.shape[1] != hidden_size:
        raise InvalidEmbeddingsError(
            f'prefix_embeddings shape {value.shape} is not [n, {hidden_size}] '
            '(hidden_size of the model)')
    if arr.shape[0] == 0:
        return None
    # Before scanning, copying and hashing the rows: their number is the sender's word.
    if arr.shape[0] + max_tokens > capacity:
        raise ContextOverflowError(
            f'prefix_embeddings have {arr.shape[0]} rows; with max_tokens {max_tokens} that '
            f'exceeds the context of {capacity} positions: send fewer rows or lower max_tokens')
    if not np.isfinite(arr).all():
        raise InvalidEmbeddingsError('prefix_embeddings contain NaN or infinite values')
    return np.ascontiguousarray(arr, dtype=dtype)


def prepare(request: GenerationRequest, tokenizer: TextTokenizer, hidden_size: int,
            capacity: int, compile_schema: Callable[[str], object],
            act_dtype=np.float32) -> PreparedRequest:
    """Validate the request and build the prompt; raises InvalidRequestError subclasses.

    compile_schema(text) returns a compiled JSON-schema constraint (InvalidSchemaError if bad).
    """
    if not isinstance(request, GenerationRequest):
        raise InvalidRequestError(f'expected a GenerationRequest, got {type(request).__name__}')
    # What is asked: the conversation.
    if not isinstance(request.prompt, str):
        raise InvalidRequestError(f'prompt must be text, not {type(request.prompt).__name__}')
    if not request.prompt and not request.messages:
        raise InvalidRequestError('the request is empty: give a prompt or messages')
    if request.use_chat_template:
        messages = conversation(request)
    elif request.messages or request.system_prompt:
        raise InvalidRequestError('use_chat_template=False takes only `prompt` (raw text); '
                                  'messages and system_prompt need the chat template')
    if not isinstance(request.session_id, str):
        raise InvalidRequestError('session_id must be text')
    # How to answer: sampling, stopping, format, embeddings.
    if isinstance(request.max_tokens, bool) or \
            not isinstance(request.max_tokens, (int, np.integer)):
        raise InvalidRequestError(f'max_tokens must be an integer, got {request.max_tokens!r}')
    if request.max_tokens < 1:
        raise InvalidRequestError(f'max_tokens must be >= 1, got {request.max_tokens}')
    sampling.validate(request.sampling)
    stop = tuple(request.stop)
    if any(not isinstance(s, str) or not s for s in stop):
        raise InvalidRequestError('stop strings must be non-empty text')
    if not isinstance(request.json_schema, str):
        raise InvalidRequestError('json_schema must be the schema as JSON text')
    constraint = compile_schema(request.json_schema) if request.json_schema else None
    if request.max_tokens >= capacity:
        raise ContextOverflowError(f'max_tokens {request.max_tokens} leaves no room for the '
                                   f'prompt in the context of {capacity} tokens: lower it')
    embeds = _check_embeddings(request.prefix_embeddings, hidden_size, act_dtype,
                               int(request.max_tokens), capacity)
    # The prompt, and whether it fits.
    if request.use_chat_template:
        ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
    else:
        ids = tokenizer.encode(request.prompt)
        bos = tokenizer.bos_token_id
        if tokenizer.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
    keys: List[Hashable] = (embedding_keys(embeds) if embeds is not None else []) + list(ids)
    if not keys:
        raise InvalidRequestError('the prompt encodes to no tokens: give some text')
    problem = check_fits(len(keys), int(request.max_tokens), capacity)
    if problem:
        raise ContextOverflowError(problem)
    return PreparedRequest(prompt_ids=ids, embeds=embeds, keys=keys,
                           max_tokens=int(request.max_tokens), sampling=request.sampling,
                           stop=stop, constraint=constraint,
                           session_id=request.session_id)


def split_chunks(total: int, start: int, chunk: int) -> Sequence[Tuple[int, int]]:
    """Cut [start, total) into [a, b) pieces of at most `chunk` positions.

    No piece has a single position unless the whole range does: a one-row forward takes the
    decode kernel, whose numerics differ from the prefill kernel (see generator.RECOMPUTE).
    """
    bounds = list(range(start, total, chunk)) + [total]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1 and chunk > 1:
        bounds[-2] -= 1
    return list(zip(bounds[:-1], bounds[1:]))
