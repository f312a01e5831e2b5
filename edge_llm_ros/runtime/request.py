"""Request validation: GenerationRequest -> PreparedRequest, checked once before any token.

Everything a request can get wrong is found by prepare(), before the first token, and raised
as an InvalidRequestError subclass whose message says what to change. The PreparedRequest
holds the prompt's token ids, the resolved sampling, the compiled constraint, how to read the
output (structured.OutputPlan: reasoning tags, tool-call format) and the checked lengths.
Chat requests go through structured.plan_request (tools rendered by the template, one
constraint among tools / json_schema / grammar / regex / choices, reasoning switches); raw
prompts take a json_schema, grammar, regex or choices, but no tools and no reasoning
options, and their output is returned as the model wrote it.

Images (runtime/media.py) go where the prompt's `<__media__>` markers are: prepare() checks
them and lays the prompt out (token ids, and the embedding span of every image chunk); their
embeddings are bound with bind_images() when the goal starts.

Prefix embeddings may be declared by shape only (DeclaredEmbeddings, e.g. from tensor handles
that are mapped later): their count, width and dtype are checked here, and the array is bound
with PreparedRequest.bind() just before generating, which checks only its values.

A request with a session_id continues a conversation (runtime/conversation.py). What it adds
is checked here (roles, tools, constraint, images, that its own latest turns fit the
context); its final prompt (the stored turns with their images, then its own) is built when
it starts, by bind_conversation(), since the conversation may change while it waits. The
stored images come with their rows; only the goal's own images are encoded.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
import functools
import hashlib
from typing import Callable, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from edge_llm_ros.errors import ContextOverflowError, InvalidRequestError
from edge_llm_ros.runtime import conversation as conv
from edge_llm_ros.runtime import media
from edge_llm_ros.runtime import sampling
from edge_llm_ros.runtime.constraint import compile_request_constraint
from edge_llm_ros.runtime.kv_cache import block_hashes, check_fits
from edge_llm_ros.runtime.model_config import ModelFamilyConfig
from edge_llm_ros.runtime.structured import OutputPlan, plan_request
from edge_llm_ros.runtime.tokenizer import TextTokenizer
from edge_llm_ros.runtime.tools.spec import check_single_constraint
from edge_llm_ros.runtime.types import (ChatMessage, DeclaredEmbeddings, GenerationRequest, ROLES,
                                        SamplingConfig)

EMBEDDING_DTYPES = ('float32', 'float16')


class InvalidEmbeddingsError(InvalidRequestError):
    """prefix_embeddings have the wrong type, shape or values."""


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready for Engine.generate (see the module docstring)."""

    prompt_ids: Tuple[int, ...]
    max_tokens: int
    sampling: SamplingConfig
    stop: Tuple[str, ...]
    constraint: Optional[object]    # the compiled constraint, any kind (has .start())
    session_id: str
    act_dtype: np.dtype             # the model's activation dtype (embeddings are cast to it)
    embeddings: Optional[DeclaredEmbeddings] = None   # checked shape of the prefix embeddings
    embeds: Optional[np.ndarray] = None   # the bound [rows, hidden] array, act_dtype
    # Where embedding rows sit among the prompt ids: (position, rows) per span, in order
    # (prefix embeddings: one span at 0; an image: one per tile). embeds holds their rows.
    spans: Tuple[Tuple[int, int], ...] = ()
    # The request's images (arrays or DeclaredImage) and each one's rows, until bound.
    images: Tuple[media.ImageInput, ...] = ()
    image_rows: Tuple[int, ...] = ()
    # Each span is prefilled as one forward whose rows see all of it (gemma3's images).
    whole_spans: bool = False
    # Per span, the (columns, rows) grid of an M-RoPE image (Qwen-VL), (0, 0) otherwise:
    # runtime/mrope.py gives its rows and the text after it their rotary positions.
    grids: Tuple[Tuple[int, int], ...] = ()
    # A session goal's stored images in its prompt (rows known; before `images`' rows), and
    # once bound, the content digest of every image in the prompt, in order.
    kept_images: Tuple[conv.StoredImage, ...] = ()
    digests: Tuple[str, ...] = ()
    # Cache key of every prompt position (see kv_cache); complete once bound.
    keys: Tuple[Hashable, ...] = ()
    # How to split the output into text, reasoning and tool calls (empty: all of it is text).
    output: OutputPlan = OutputPlan()
    # A session goal waiting for its conversation (bind_conversation), and once bound, what it
    # continued (the prompt ids above are then the whole conversation's).
    chat: Optional[conv.ChatTurns] = None
    session: Optional[conv.Bound] = None
    speculative: bool = True   # False: decode plainly (GenerationRequest.speculative)
    # LoRA adapters (serving/adapters.py): every row's (adapter id, scale), and the set's key
    # ((name@digest, scale) each), which the prefix keys carry (cache_keys).
    lora: Tuple[Tuple[int, float], ...] = ()
    lora_set: Tuple[Tuple[str, float], ...] = ()
    # Per request image: ((width, height) of the frame, (width, height) the model saw it at),
    # the second (0, 0) where the family does not say (grounding maps answers with both).
    image_sizes: Tuple[Tuple[Tuple[int, int], Tuple[int, int]], ...] = ()

    @property
    def prompt_tokens(self) -> int:
        """Prompt positions: embedding rows plus prompt token ids."""
        return sum(rows for _, rows in self.spans) + len(self.prompt_ids)

    @functools.cached_property
    def cache_keys(self) -> Tuple[Hashable, ...]:
        """Return the prefix-cache keys: `keys`, each tied to the adapter set when there is one.

        KV written under one adapter set is then reused only under the same set (and a goal
        without adapters keeps its plain keys: the base model's cache as before).
        """
        if not self.lora_set:
            return self.keys
        tag = ','.join(f'{name}={scale!r}' for name, scale in self.lora_set)
        return tuple(('lora', f'{tag}|{k!r}', 0) for k in self.keys)

    @functools.cached_property
    def key_hashes(self) -> List[bytes]:
        """Block digests of `cache_keys` (runtime/kv_cache.py's prefix matching), once."""
        return block_hashes(self.cache_keys)

    @property
    def bound(self) -> bool:
        """Tell whether it can start: no embeddings or images wait for their arrays.

        (Images given as arrays are encoded when the goal starts: bind_images.)
        """
        if self.embeddings is not None and self.embeds is None:
            return False
        return not any(isinstance(im, media.DeclaredImage) or (
            isinstance(im, media.VideoClip) and any(
                isinstance(f, media.DeclaredImage) for f in im.frames)) for im in self.images)

    @property
    def awaits_conversation(self) -> bool:
        """Tell whether this is a session goal whose prompt is built when it starts."""
        return self.chat is not None and self.session is None

    def bind(self, array: np.ndarray) -> 'PreparedRequest':
        """Return this request with the values of its declared prefix embeddings.

        Count, width and dtype were checked by prepare(): the array must be exactly what was
        declared ([rows, hidden] of that dtype); only its values are checked here.
        """
        declared = self.embeddings
        if declared is None:
            raise InvalidEmbeddingsError('this request declared no prefix_embeddings to bind')
        shape = (declared.rows, declared.hidden)
        if not isinstance(array, np.ndarray) or array.shape != shape or \
                array.dtype != np.dtype(declared.dtype):
            got = (f'{array.dtype} {list(array.shape)}' if isinstance(array, np.ndarray)
                   else type(array).__name__)
            raise InvalidEmbeddingsError(f'prefix_embeddings bound as {got}, not the declared '
                                         f'{declared.dtype} {list(shape)}')
        if not np.isfinite(array).all():
            raise InvalidEmbeddingsError('prefix_embeddings contain NaN or infinite values')
        embeds = np.ascontiguousarray(array, dtype=self.act_dtype)
        return replace(self, embeds=embeds, keys=media.position_keys(
            self.prompt_ids, self.spans, embedding_keys(embeds)))

    def with_frames(self, frames: Sequence[np.ndarray]) -> 'PreparedRequest':
        """Return this request with the pixels of its DeclaredImages (mapped frames, in order).

        Each frame must be the size prepare() checked: RGB [height, width, 3] uint8; a clip's
        entry is the list of its frames.
        """
        if len(frames) != len(self.images):
            raise media.ImageInputError(f'{len(frames)} frames for {len(self.images)} images')
        images = []
        for i, (frame, declared) in enumerate(zip(frames, self.images)):
            if isinstance(declared, media.VideoClip):   # its frames, each checked as an image
                clip = replace(self, images=tuple(declared.frames)).with_frames(frame).images
                images.append(replace(declared, frames=clip))
                continue
            images.append(frame)
            if isinstance(declared, media.DeclaredEncoded):
                want, dtype = declared.shape, np.dtype(declared.dtype)
            elif isinstance(declared, media.DeclaredImage):
                want, dtype = (declared.height, declared.width, 3), np.dtype(np.uint8)
            else:
                want, dtype = declared.shape, declared.dtype
            if not isinstance(frame, np.ndarray) or frame.dtype != dtype or \
                    frame.shape != want:
                got = (f'{frame.dtype} {list(frame.shape)}' if isinstance(frame, np.ndarray)
                       else type(frame).__name__)
                raise media.ImageInputError(f'images[{i}] mapped as {got}, not the declared '
                                            f'{dtype} {list(want)}')
        return replace(self, images=tuple(images))

    def bind_images(self, embeds: Sequence[np.ndarray], digests: Sequence[str]
                    ) -> 'PreparedRequest':
        """Return this request with its images' embeddings ([rows, hidden] each, in order).

        digests: each image's content digest, which keys its rows in the prefix cache.
        """
        if len(embeds) != len(self.image_rows) or any(
                e.shape[0] != rows for e, rows in zip(embeds, self.image_rows)):
            raise media.ImageInputError(
                f'the encoder gave {[e.shape[0] for e in embeds]} rows for images that take '
                f'{list(self.image_rows)}')
        embeds = [k.embeds for k in self.kept_images] + list(embeds)
        digests = tuple(k.digest for k in self.kept_images) + tuple(digests)
        keys = [('img', d, i) for d, e in zip(digests, embeds) for i in range(e.shape[0])]
        array = np.ascontiguousarray(np.concatenate(embeds), dtype=self.act_dtype)
        return replace(self, embeds=array, images=(), digests=digests,
                       keys=media.position_keys(self.prompt_ids, self.spans, keys))

    def stored_images(self) -> Tuple[conv.StoredImage, ...]:
        """Every image of a bound session goal's prompt as its conversation keeps it."""
        bound = self.session
        out, row = [], 0
        for placed, at, digest in zip(bound.placed, bound.image_at, self.digests):
            if isinstance(placed, conv.StoredImage):
                out.append(replace(placed, at=at))
            else:
                # A copy: the conversation outlives this request's array.
                rows = self.embeds[row:row + placed.rows].copy()
                out.append(conv.StoredImage(at, tuple(placed.items), digest, rows,
                                            bool(placed.bidirectional),
                                            tuple(getattr(placed, 'grid', (0, 0)))))
            row += placed.rows
        return tuple(out)


def embedding_keys(embeds: np.ndarray) -> List[Hashable]:
    """Cache keys of prefix embeddings: by content, so only identical bytes are reused.

    The digest reads the array's own buffer (a mapped frame is hashed in place, not copied).
    """
    digest = hashlib.blake2b(np.ascontiguousarray(embeds), digest_size=16).hexdigest()
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


def _embeddings(value, hidden_size: int
                ) -> Tuple[Optional[DeclaredEmbeddings], Optional[np.ndarray]]:
    """Check prefix_embeddings' declared shape; return it and the array when one was given."""
    if value is None:
        return None, None
    array = None
    if isinstance(value, DeclaredEmbeddings):
        dtype, shape = value.dtype, (value.rows, value.hidden)
    elif isinstance(value, np.ndarray):
        array = value[0] if value.ndim == 3 and value.shape[0] == 1 else value
        dtype, shape = str(value.dtype), array.shape
    else:
        raise InvalidEmbeddingsError(f'prefix_embeddings must be a numpy array, not '
                                     f'{type(value).__name__}')
    if dtype not in EMBEDDING_DTYPES:
        raise InvalidEmbeddingsError(f'prefix_embeddings dtype {dtype} is not float32 or '
                                     'float16')
    if len(shape) != 2 or shape[1] != hidden_size or shape[0] < 0:
        raise InvalidEmbeddingsError(
            f'prefix_embeddings shape {tuple(shape)} is not [n, {hidden_size}] (hidden_size '
            'of the model)')
    if shape[0] == 0:
        return None, None
    return DeclaredEmbeddings(rows=int(shape[0]), hidden=hidden_size, dtype=dtype), array


def prepare(request: GenerationRequest, tokenizer: TextTokenizer, hidden_size: int,
            capacity: int, compile_schema: Callable[[str], object],
            act_dtype=np.float32, family: Optional[ModelFamilyConfig] = None,
            vocab_size: Optional[int] = None,
            layout: Optional[media.ImageLayout] = None) -> PreparedRequest:
    """Validate the request and build the prompt; raises InvalidRequestError subclasses.

    compile_schema(text) returns a compiled JSON-schema constraint (InvalidSchemaError if bad).
    family: the model's family config (reasoning tags, tool-call format; None: generic JSON
    tool calls, no reasoning tags). vocab_size: the model's logits width, for logit_bias ids.
    An array in prefix_embeddings is bound at once; DeclaredEmbeddings wait for bind().
    layout: the model's image layout (None: a text-only model, which refuses images).
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
    else:
        _check_raw(request)
    if not isinstance(request.session_id, str):
        raise InvalidRequestError('session_id must be text')
    session = bool(request.session_id)
    if session:
        conv.check_mode(request.history_mode)
        if not request.use_chat_template:
            raise InvalidRequestError('a session_id keeps a chat conversation: it needs the '
                                      'chat template (use_chat_template=True), or send the '
                                      'raw prompt without a session_id')
        if request.prefix_embeddings is not None:
            raise InvalidRequestError('prefix_embeddings start the context, so they cannot '
                                      'join a stored conversation: send them without a '
                                      'session_id')
        if media.MEDIA_MARKER in request.system_prompt:
            raise media.ImageInputError(f'a session keeps its first system prompt: put the '
                                        f'{media.MEDIA_MARKER} images in a user turn')
    # How to answer: sampling, stopping, format, embeddings.
    if isinstance(request.max_tokens, bool) or \
            not isinstance(request.max_tokens, (int, np.integer)):
        raise InvalidRequestError(f'max_tokens must be an integer, got {request.max_tokens!r}')
    max_tokens = int(request.max_tokens)
    if max_tokens < 1:
        raise InvalidRequestError(f'max_tokens must be >= 1, got {max_tokens}')
    sampling.validate(request.sampling)
    sampling.logit_bias_items(sampling.extra(request.sampling, 'logit_bias'), vocab_size)
    stop = tuple(request.stop)
    if any(not isinstance(s, str) or not s for s in stop):
        raise InvalidRequestError('stop strings must be non-empty text')
    _check_output_fields(request)
    if max_tokens >= capacity:
        raise ContextOverflowError(f'max_tokens {max_tokens} leaves no room for the '
                                   f'prompt in the context of {capacity} tokens: lower it')
    declared, array = _embeddings(request.prefix_embeddings, hidden_size)
    placements = media.check_images(request.images, layout)
    _check_image_cap(placements, int(getattr(request, 'max_image_tokens', 0) or 0),
                     request.images)
    if placements and declared is not None:
        raise InvalidRequestError('a request takes images or prefix_embeddings, not both')
    rows = sum(p.rows for p in placements) if placements else (
        declared.rows if declared is not None else 0)
    if placements and rows + max_tokens > capacity:
        raise ContextOverflowError(
            f'the {len(placements)} images take {rows} positions; with max_tokens '
            f'{max_tokens} that exceeds the context of {capacity}: send fewer or smaller '
            'images, or lower max_tokens')
    # Before tokenizing (or scanning and hashing an array): the row count is the sender's word.
    if rows + max_tokens > capacity:
        raise ContextOverflowError(
            f'prefix_embeddings have {rows} rows; with max_tokens {max_tokens} that '
            f'exceeds the context of {capacity} positions: send fewer rows or lower max_tokens')
    # The prompt, its constraint and how to read the output; and whether it fits.
    if request.use_chat_template:
        plan = plan_request(
            tokenizer, family, messages, tools=request.tools, tool_choice=request.tool_choice,
            parallel_tool_calls=request.parallel_tool_calls, json_schema=request.json_schema,
            grammar=request.grammar, regex=request.regex, choices=request.choices,
            reasoning=request.reasoning, reasoning_budget=request.reasoning_budget,
            compile_schema=compile_schema)
        ids, constraint, output = list(plan.prompt_ids), plan.constraint, plan.output
        if placements:
            laid = media.lay_out(media.split_at_markers(plan.prompt_text, len(placements)),
                                 placements, tokenizer.encode_prompt, tokenizer.encode)
    else:
        kind = check_single_constraint(json_schema=request.json_schema, grammar=request.grammar,
                                       regex=request.regex, choices=request.choices)
        constraint = (compile_schema(request.json_schema) if kind == 'json_schema' else
                      compile_request_constraint(tokenizer, grammar=request.grammar,
                                                 regex=request.regex, choices=request.choices))
        output = OutputPlan()
        if placements:
            laid = media.lay_out(media.split_at_markers(request.prompt, len(placements)),
                                 placements, functools.partial(_encode_raw, tokenizer),
                                 tokenizer.encode)
        else:
            ids = _encode_raw(tokenizer, request.prompt)
    if placements:
        ids = list(laid.ids)
    positions = rows + len(ids)
    if session:
        chat, positions = _session_turns(request, messages, plan, tokenizer,
                                         capacity - max_tokens, placements, positions)
    if not positions:
        raise InvalidRequestError('the prompt encodes to no tokens: give some text')
    problem = check_fits(positions, max_tokens, capacity)
    if problem:
        raise ContextOverflowError(problem)
    if placements:
        spans, images, image_rows = laid.spans, tuple(request.images), laid.image_rows
    else:
        spans, images, image_rows = ((0, rows),) if rows else (), (), ()
    waits = declared is not None or bool(images)
    prepared = PreparedRequest(prompt_ids=tuple(ids), max_tokens=max_tokens,
                               sampling=request.sampling, stop=stop, constraint=constraint,
                               session_id=request.session_id, act_dtype=np.dtype(act_dtype),
                               embeddings=declared, keys=() if waits else tuple(ids),
                               spans=spans, images=images, image_rows=image_rows,
                               whole_spans=any(p.bidirectional for p in placements),
                               grids=span_grids(placements) if placements else (),
                               output=output, chat=chat if session else None,
                               speculative=bool(getattr(request, 'speculative', True)),
                               image_sizes=image_sizes(request.images, placements))
    return prepared.bind(array) if array is not None else prepared


def _check_image_cap(placements: Sequence[media.Placement], cap: int,
                     images: Sequence[media.ImageInput]) -> None:
    """Raise ImageInputError for an image of more rows than max_image_tokens (0: no cap).

    A clip's cap is per chunk (two frames placed like one image), as each chunk is an image.
    """
    if cap < 0:
        raise InvalidRequestError(f'max_image_tokens must be >= 0 (0: no cap), got {cap}')
    for i, (placed, image) in enumerate(zip(placements, images)):
        if cap and isinstance(image, media.VideoClip) and placed.rows // placed.tiles > cap:
            raise media.ImageInputError(
                f'images[{i}] is a clip whose every 2 frames take {placed.rows // placed.tiles} '
                f'tokens, over max_image_tokens {cap}: send smaller frames or raise the cap')
        if cap and not isinstance(image, media.VideoClip) and placed.rows > cap:
            raise media.ImageInputError(
                f'images[{i}] takes {placed.rows} tokens, over max_image_tokens {cap}: send '
                'a smaller image or raise the cap')


def image_sizes(images: Sequence[media.ImageInput], placements: Sequence[media.Placement]
                ) -> Tuple[Tuple[Tuple[int, int], Tuple[int, int]], ...]:
    """Return PreparedRequest.image_sizes: each pixel image's frame and model-input sizes.

    An encoded image (no pixels) has ((0, 0), (0, 0)).
    """
    out = []
    for i, (image, placed) in enumerate(zip(images, placements)):
        if isinstance(image, media.VideoClip):   # its frames' size (check_clip: all one)
            image = image.frames[0]
        if media.declared_encoding(image, f'images[{i}]') is not None:
            out.append(((0, 0), (0, 0)))
            continue
        height, width = media.image_size(image, f'images[{i}]')
        out.append(((width, height), tuple(getattr(placed, 'input_size', (0, 0)))))
    return tuple(out)


def span_grids(placements: Sequence[media.Placement]) -> Tuple[Tuple[int, int], ...]:
    """Return each embedding span's M-RoPE grid (ImagePlacement.grid; (0, 0) for others)."""
    return tuple(tuple(getattr(p, 'grid', (0, 0))) for p in placements
                 for item in p.items if not isinstance(item, tuple))


def _encode_raw(tokenizer: TextTokenizer, text: str) -> List[int]:
    """Token ids of raw prompt text (special tokens parsed), BOS first where the model wants it."""
    ids = tokenizer.encode(text)
    bos = tokenizer.bos_token_id
    if tokenizer.add_bos_token and bos is not None and (not ids or ids[0] != bos):
        ids.insert(0, bos)
    return ids


def _session_turns(request: GenerationRequest, messages: List[ChatMessage], plan,
                   tokenizer: TextTokenizer, room: int, placements: Sequence[media.Placement],
                   positions: int) -> Tuple[conv.ChatTurns, int]:
    """Return a session goal's own turns, and the prompt positions prepare() checks.

    When the request as sent (an OpenAI-style client resends its whole history) does not fit,
    what must fit is its latest part, from its last user turn on: older turns are the
    conversation's, which the context policy may drop at bind time.
    """
    system = request.system_prompt
    own = tuple(m for m in messages if not (m is messages[0] and system and m.role == 'system'
                                            and m.content == system))
    chat = conv.ChatTurns(system=system, messages=own, mode=int(request.history_mode),
                          render=plan.render, placements=tuple(placements))
    if positions > room:
        users = [i for i, m in enumerate(own) if m.role == 'user']
        tail = own[users[-1]:] if users else own
        head = (ChatMessage('system', system),) if system else ()
        text = plan.render(head + tail)
        if placements:
            mine = placements[max(0, len(placements) - sum(
                m.content.count(media.MEDIA_MARKER) for m in tail)):]
            laid = media.lay_out(media.split_at_markers(text, len(mine)), mine,
                                 tokenizer.encode_prompt, tokenizer.encode)
            positions = len(laid.ids) + sum(laid.image_rows)
        else:   # without images a marker is text
            positions = len(tokenizer.encode_prompt(text))
    return chat, positions


def bind_conversation(prepared: PreparedRequest, stored: conv.Conversation,
                      tokenizer: TextTokenizer, capacity: int) -> PreparedRequest:
    """Return a session goal with its whole prompt: the stored turns, then its own.

    Its images must be mapped (with_frames): the ones it resent with its history are checked
    against the stored ones, the others wait for bind_images after the stored images' rows.
    """
    bound = conv.bind(tokenizer, stored, prepared.chat, capacity - prepared.max_tokens,
                      prepared.chat.render)
    for i in range(bound.resent):
        if media.image_digest(prepared.images[i]) != stored.images[i].digest:
            raise media.ImageInputError(
                f'images[{i}] is in a turn the session already holds, but it is not the image '
                'stored there: send only the new turns, or start the conversation again '
                '(HISTORY_REPLACE)')
    kept = bound.kept_images
    bound_request = replace(
        prepared, prompt_ids=bound.ids, session=bound, spans=bound.spans, kept_images=kept,
        images=tuple(prepared.images[i] for i in bound.goal_images),
        image_rows=tuple(p.rows for p in bound.placed[len(kept):]),
        whole_spans=prepared.whole_spans or any(k.bidirectional for k in kept),
        grids=span_grids(bound.placed), keys=bound.ids if not bound.placed else ())
    if kept and not bound_request.images:
        return bound_request.bind_images((), ())
    return bound_request


def _check_raw(request: GenerationRequest) -> None:
    """Refuse what only the chat template can express when `prompt` is raw text."""
    if request.messages or request.system_prompt:
        raise InvalidRequestError('use_chat_template=False takes only `prompt` (raw text); '
                                  'messages and system_prompt need the chat template')
    if request.tools or request.tool_choice not in ('', 'none'):
        raise InvalidRequestError('tools need the chat template: set use_chat_template=True '
                                  '(a raw prompt cannot show the model its tools)')
    if request.reasoning_budget is not None or request.reasoning is not True:
        raise InvalidRequestError('reasoning and reasoning_budget need the chat template: set '
                                  'use_chat_template=True, or leave them at their defaults '
                                  '(a raw prompt is returned as the model writes it)')


def _check_output_fields(request: GenerationRequest) -> None:
    """Type checks of the output fields (their values are checked where they are compiled)."""
    for name in ('json_schema', 'grammar', 'regex'):
        if not isinstance(getattr(request, name), str):
            raise InvalidRequestError(f'{name} must be text')
    if isinstance(request.choices, str) or \
            not isinstance(request.choices, (list, tuple)):
        raise InvalidRequestError('choices must be a list of strings')
    if isinstance(request.tools, (str, bytes)) or \
            not isinstance(request.tools, (list, tuple)):
        raise InvalidRequestError('tools must be a list of ToolSpec or OpenAI tool dicts')
    for name in ('parallel_tool_calls', 'reasoning'):
        if not isinstance(getattr(request, name), bool):
            raise InvalidRequestError(f'{name} must be true or false')


def split_chunks(total: int, start: int, chunk: int) -> Sequence[Tuple[int, int]]:
    """Cut [start, total) into [a, b) pieces of at most `chunk` positions.

    No piece has a single position unless the whole range does: a one-row forward takes the
    decode kernel, whose numerics differ from the prefill kernel (see generator.RECOMPUTE).
    """
    bounds = list(range(start, total, chunk)) + [total]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1 and chunk > 1:
        bounds[-2] -= 1
    return list(zip(bounds[:-1], bounds[1:]))
