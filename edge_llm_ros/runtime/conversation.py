"""A session's conversation: its turns, and the token ids the model saw and produced.

A goal with a session_id continues its session: the stored turns come first, then the goal's
new turns, rendered by the model's chat template. What the model produced is kept as its ids,
not re-rendered: when the template writes the stored turns exactly as the model saw and
wrote them (the usual case: the decoded ids are a prefix of the new rendering), the new
prompt is the stored ids followed by only the new text, tokenized. So the KV of the whole
stored conversation is reused and a turn prefills only its new tokens. A template that
rewrites past turns (one that drops an assistant's reasoning, or trims its text) gets a
fresh rendering instead, and prefix reuse then keeps what still matches.

Images: a turn's `<__media__>` markers say where its images go (runtime/media.py). The
conversation keeps each image it saw: where its items sit among the ids, and its embedding
rows, so a later turn (after a restart, after the KV prefix was evicted, or after the context
policy dropped turns before it) prefills them again without the frame or the encoder. A
client that resends its history (HISTORY_AUTO) resends its images too: they must be the ones
stored (same content digest); they are not encoded again.

Context policy: when the stored turns, the new ones and max_tokens do not fit the context,
the oldest turns are dropped, whole exchanges from the start (the next kept turn is a user
turn), keeping the system prompt and the latest user turn on; the rest is rendered afresh.
Turns a goal resent (OpenAI style) before its last user turn may go too. How many were
dropped is in the result (`dropped_turns`). A goal whose latest turn cannot fit even then is
refused (prepare() checks it with the goal's own system prompt; bind() with the
conversation's, raising ContextOverflowError), never truncated.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
import json
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from edge_llm_ros.errors import ContextOverflowError, InvalidRequestError
from edge_llm_ros.runtime import media
from edge_llm_ros.runtime.tokenizer import TextTokenizer
from edge_llm_ros.runtime.tools.spec import ToolCall
from edge_llm_ros.runtime.types import ChatMessage

# Generate.Goal.HISTORY_* (test_conversation checks they agree).
HISTORY_AUTO, HISTORY_APPEND, HISTORY_REPLACE = 0, 1, 2
HISTORY_MODES = (HISTORY_AUTO, HISTORY_APPEND, HISTORY_REPLACE)
LITERAL_MARKER = '<__media__ >'   # a media marker in a reply, kept as text (reply_turn)


@dataclass(frozen=True)
class StoredImage:
    """An image a conversation saw: where its items sit, and its embedding rows.

    It is a media.Placement (items, rows, bidirectional), so a later turn lays it out again
    like a new image, with its rows already known.
    """

    at: int                                          # index in Conversation.ids of its items
    items: Tuple[Union[Tuple[int, ...], int], ...]   # wrapper token ids and span rows
    digest: str                                      # content digest (media.image_digest)
    embeds: np.ndarray = field(compare=False, repr=False)   # [rows, hidden]
    bidirectional: bool = False
    grid: Tuple[int, int] = (0, 0)   # Qwen-VL: (columns, rows) of its M-RoPE positions

    @property
    def rows(self) -> int:
        return int(self.embeds.shape[0])

    @property
    def width(self) -> int:
        """How many of Conversation.ids its wrapper tokens take."""
        return len(media.item_ids(self))

    def meta(self) -> Dict[str, Any]:
        return {'at': self.at, 'digest': self.digest, 'bidirectional': self.bidirectional,
                'items': [list(i) if isinstance(i, tuple) else i for i in self.items],
                'shape': list(self.embeds.shape), 'dtype': self.embeds.dtype.name,
                **({'grid': list(self.grid)} if self.grid != (0, 0) else {})}


@dataclass(frozen=True)
class Conversation:
    """What a session remembers (see the module docstring)."""

    system: str = ''
    turns: Tuple[ChatMessage, ...] = ()
    ids: Tuple[int, ...] = ()      # the model's view: prompt ids then generated ids
    images: Tuple[StoredImage, ...] = ()   # in prompt order (their rows are not in ids)
    # The LoRA adapters its turns used, in order of first use: (name@digest, scale) each, as
    # PreparedRequest.lora_set holds them (~/get_session lists them).
    lora: Tuple[Tuple[str, float], ...] = ()

    def to_json(self) -> str:
        """Return the conversation as JSON; the images' rows are media_bytes()."""
        raw: Dict[str, Any] = {'system': self.system,
                               'turns': [_turn_dict(t) for t in self.turns],
                               'ids': list(self.ids)}
        if self.images:
            raw['images'] = [im.meta() for im in self.images]
        if self.lora:
            raw['lora'] = [[key, scale] for key, scale in self.lora]
        return json.dumps(raw, ensure_ascii=False, separators=(',', ':'))

    def as_text(self) -> 'Conversation':
        """Return the turns alone, for another model: its next turn renders them afresh.

        The ids and the images' rows are the old model's (its tokenizer, its projector), so
        they go; an image's marker in a turn goes with its rows (the frame is not kept).
        """
        turns = tuple(replace(t, content=t.content.replace(media.MEDIA_MARKER, ''))
                      for t in self.turns)
        return Conversation(system=self.system, turns=turns)

    @property
    def media_nbytes(self) -> int:
        """Bytes of the images' embedding rows (what media_bytes() holds)."""
        return sum(int(im.embeds.nbytes) for im in self.images)

    def media_bytes(self) -> bytes:
        """Return the images' embedding rows, one after another (from_json reads them)."""
        return b''.join(np.ascontiguousarray(im.embeds).tobytes() for im in self.images)

    @classmethod
    def from_json(cls, text: str, media_bytes: bytes = b'') -> 'Conversation':
        """Parse to_json()'s text and media_bytes() (ValueError when they are not that)."""
        try:
            raw = json.loads(text)
            images, offset = [], 0
            for meta in raw.get('images', ()):
                dtype, shape = np.dtype(meta['dtype']), tuple(int(n) for n in meta['shape'])
                count = int(np.prod(shape))
                if len(shape) != 2 or offset + count * dtype.itemsize > len(media_bytes):
                    raise ValueError(f'image rows {shape} are not in the stored bytes')
                embeds = np.frombuffer(media_bytes, dtype, count, offset).reshape(shape)
                offset += count * dtype.itemsize
                images.append(StoredImage(
                    at=int(meta['at']), digest=str(meta['digest']), embeds=embeds,
                    bidirectional=bool(meta['bidirectional']),
                    grid=tuple(int(n) for n in meta.get('grid', (0, 0))),
                    items=tuple(tuple(int(i) for i in item) if isinstance(item, list)
                                else int(item) for item in meta['items'])))
            if offset != len(media_bytes):
                raise ValueError(f'{len(media_bytes) - offset} stored image bytes belong to '
                                 'no image')
            return cls(system=str(raw['system']),
                       turns=tuple(_turn_of(t) for t in raw['turns']),
                       ids=tuple(int(i) for i in raw['ids']), images=tuple(images),
                       lora=tuple((str(k), float(v)) for k, v in raw.get('lora', ())))
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f'not a stored conversation ({exc})') from None


@dataclass(frozen=True)
class ChatTurns:
    """A session goal's own part, kept by prepare() until the goal starts (bind time)."""

    system: str                          # the request's system prompt ('' = none)
    messages: Tuple[ChatMessage, ...]    # the request's messages, prompt turn included
    mode: int                            # HISTORY_*
    # render(turns) -> prompt text with this request's tools and template options.
    render: Callable[[Sequence[ChatMessage]], str] = field(
        compare=False, repr=False, default=None)
    # Where the goal's images go (media.Placement), in the order of its markers.
    placements: Tuple[media.Placement, ...] = ()


@dataclass(frozen=True)
class Bound:
    """A session goal's prompt once its conversation is known."""

    ids: Tuple[int, ...]
    system: str
    history: Tuple[ChatMessage, ...]     # stored turns kept (after any dropped)
    new: Tuple[ChatMessage, ...]         # the goal's new turns
    dropped: int                         # stored turns left out (context policy)
    continued: bool                      # the stored ids were continued exactly
    spans: Tuple[Tuple[int, int], ...] = ()   # embedding spans (position, rows)
    # The prompt's images in order: the stored ones kept (StoredImage, `at` as stored), then
    # the goal's (media.Placement); image_at: where each one's items start in `ids`.
    placed: Tuple[media.Placement, ...] = ()
    image_at: Tuple[int, ...] = ()
    goal_images: Tuple[int, ...] = ()    # indices into the goal's images of the placed ones
    resent: int = 0                      # the goal's first images, resent stored ones
    lora: Tuple[Tuple[str, float], ...] = ()   # the adapters the stored turns kept used

    @property
    def kept_images(self) -> Tuple[StoredImage, ...]:
        return tuple(p for p in self.placed if isinstance(p, StoredImage))


def check_mode(mode: Any) -> int:
    if isinstance(mode, bool) or mode not in HISTORY_MODES:
        raise InvalidRequestError(
            f'history_mode {mode!r} is not one of HISTORY_AUTO (0), HISTORY_APPEND (1), '
            'HISTORY_REPLACE (2)')
    return int(mode)


def split_turns(stored: Conversation, chat: ChatTurns) -> Tuple[str, Tuple[ChatMessage, ...],
                                                                Tuple[ChatMessage, ...]]:
    """Return (system, stored turns to keep, new turns) for a goal of this conversation.

    AUTO: messages that start with the stored turns (after an optional leading system
    message equal to the stored system prompt) continue after them; otherwise all of them
    are new. The conversation's system prompt is the one it started with; REPLACE starts it
    again from this goal's system prompt and messages.
    """
    messages = chat.messages
    if chat.mode == HISTORY_REPLACE or not (stored.turns or stored.system):
        return chat.system, (), messages
    body = messages
    if body and body[0].role == 'system' and body[0].content == stored.system:
        body = body[1:]
    n = len(stored.turns)
    if chat.mode == HISTORY_AUTO and len(body) >= n and tuple(body[:n]) == stored.turns:
        body = body[n:]
    return stored.system, stored.turns, tuple(body)


def bind(tokenizer: TextTokenizer, stored: Conversation, chat: ChatTurns, room: int,
         render: Callable[[Sequence[ChatMessage]], str]) -> Bound:
    """Build the prompt of a session goal (see the module docstring).

    room: prompt positions allowed (context - max_tokens), embedding rows included.
    """
    system, history, new = split_turns(stored, chat)
    if not new:
        raise InvalidRequestError('the goal adds no turn to its session: its messages are '
                                  'exactly the stored conversation; add a new user turn')
    head = (ChatMessage('system', system),) if system else ()
    # The goal's images in the turns it resent (HISTORY_AUTO) are the stored ones.
    resent = max(0, len(chat.placements) - _markers(new))
    goal = list(range(resent, len(chat.placements)))
    kept = list(stored.images) if history else []   # REPLACE starts without them
    placed = kept + [chat.placements[i] for i in goal]
    texts = _split(render(head + history + new), placed)
    laid = _continue(tokenizer, stored, texts, placed[len(kept):]) if history else None
    continued = laid is not None
    if laid is None:
        laid = _lay_out(tokenizer, texts, placed)
    # What may go, oldest first: the stored turns, then the goal's own turns before its last
    # user turn (a client that resends a long history). System turns at the start (a client
    # may send its system prompt as a message) and the latest user turn on are kept.
    turns = history + new
    pinned = 0
    while pinned < len(turns) and turns[pinned].role == 'system':
        pinned += 1
    users = [i for i, t in enumerate(new) if t.role == 'user']
    limit = len(history) + (users[-1] if users else 0)   # turns[limit:] are always kept
    dropped = 0
    while len(laid.ids) + sum(laid.image_rows) > room and pinned < limit:
        cut = min(_next_exchange(turns[pinned:]), limit - pinned)
        gone = _markers(turns[pinned:pinned + cut])
        goal = goal[max(0, gone - sum(isinstance(p, StoredImage) for p in placed[:gone])):]
        placed = placed[gone:]
        turns = turns[:pinned] + turns[pinned + cut:]
        limit -= cut
        dropped += cut
        laid = _lay_out(tokenizer, _split(render(head + turns), placed), placed)
        continued = False
    positions = len(laid.ids) + sum(laid.image_rows)
    if positions > room:
        raise ContextOverflowError(
            f"the session goal needs {positions} prompt positions with its conversation's "
            f'system prompt and its latest turn, and {room} are free with its max_tokens: '
            'lower max_tokens, or start the conversation again (HISTORY_REPLACE) with a '
            'shorter system prompt')
    kept_history = len(history) - min(dropped, max(0, len(history) - pinned))
    history, new = turns[:kept_history], turns[kept_history:]
    return Bound(laid.ids, system, history, new, dropped, continued, spans=laid.spans,
                 placed=tuple(placed), image_at=laid.image_at, goal_images=tuple(goal),
                 resent=resent, lora=stored.lora if history else ())


def _split(text: str, placed: Sequence[media.Placement]) -> List[str]:
    """Split at the media markers when the prompt has images; without, a marker is text."""
    return media.split_at_markers(text, len(placed)) if placed else [text]


def _markers(turns: Sequence[ChatMessage]) -> int:
    return sum(t.content.count(media.MEDIA_MARKER) for t in turns)


def _lay_out(tokenizer: TextTokenizer, texts: Sequence[str],
             placed: Sequence[media.Placement]) -> media.MediaPrompt:
    return media.lay_out(texts, placed, tokenizer.encode_prompt, tokenizer.encode)


def _continue(tokenizer: TextTokenizer, stored: Conversation, texts: Sequence[str],
              new: Sequence[media.Placement]) -> Optional[media.MediaPrompt]:
    """Lay out the stored ids + what `texts` adds after them (None: it rewrote them).

    texts: the new rendering split at its markers. The stored ids' text between its images
    must be the rendering's, and the text after its last image a prefix of the rendering's.
    """
    if not stored.ids:
        return None
    ids = list(stored.ids)
    pieces, start = [], 0
    for image in stored.images:
        pieces.append(ids[start:image.at])
        start = image.at + image.width
    pieces.append(ids[start:])
    bos = tokenizer.bos_token_id
    if tokenizer.add_bos_token and bos is not None and pieces[0][:1] == [bos]:
        pieces[0] = pieces[0][1:]
    seen = [tokenizer.decode(piece, skip_special_tokens=False) for piece in pieces]
    if list(texts[:len(seen) - 1]) != seen[:-1] or not texts[len(seen) - 1].startswith(seen[-1]):
        return None
    # What the rendering adds: the rest of the last stored piece, then the new images.
    added = media.lay_out([texts[len(seen) - 1][len(seen[-1]):], *texts[len(seen):]], new,
                          tokenizer.encode, tokenizer.encode)
    image_at = [image.at for image in stored.images] + [len(ids) + at for at in added.image_at]
    placed = tuple(stored.images) + tuple(new)
    return media.MediaPrompt(tuple(ids) + added.ids, media.spans_of(placed, image_at),
                             tuple(p.rows for p in placed), tuple(image_at))


def _next_exchange(turns: Tuple[ChatMessage, ...]) -> int:
    """How many leading turns to drop so the kept turns start at the next user turn."""
    for i in range(1, len(turns)):
        if turns[i].role == 'user':
            return i
    return len(turns)


def committed(bound: Bound, reply: ChatMessage, generated: Sequence[int],
              images: Sequence[StoredImage] = (),
              lora: Sequence[Tuple[str, float]] = ()) -> Conversation:
    """Return the conversation after a goal that ended well: turns, reply and all its ids.

    images: every image of the goal's prompt, as placed (request.stored_images); lora: the
    goal's adapter set (request.lora_set), added to those the stored turns used.
    """
    used = bound.lora + tuple(entry for entry in lora if entry not in bound.lora)
    return Conversation(system=bound.system, turns=bound.history + bound.new + (reply,),
                        ids=bound.ids + tuple(int(t) for t in generated), images=tuple(images),
                        lora=used)


def reply_turn(text: str, tool_calls: Sequence[Any]) -> ChatMessage:
    """Return the assistant turn a session keeps.

    A media marker the model wrote is kept as LITERAL_MARKER: in a later prompt with images
    every marker is an image, and this one has none.
    """
    text = text.replace(media.MEDIA_MARKER, LITERAL_MARKER)
    return ChatMessage('assistant', text, tool_calls=tuple(
        ToolCall(c.id, c.name, c.arguments) for c in tool_calls))


def _turn_dict(turn: ChatMessage) -> Dict[str, Any]:
    out: Dict[str, Any] = {'role': turn.role, 'content': turn.content}
    if turn.tool_calls:
        out['tool_calls'] = [{'id': c.id, 'name': c.name, 'arguments': c.arguments}
                             for c in turn.tool_calls]
    if turn.tool_call_id:
        out['tool_call_id'] = turn.tool_call_id
    if turn.name:
        out['name'] = turn.name
    return out


def _turn_of(raw: Mapping[str, Any]) -> ChatMessage:
    calls = tuple(ToolCall(str(c['id']), str(c['name']), str(c['arguments']))
                  for c in raw.get('tool_calls', ()))
    return ChatMessage(str(raw['role']), str(raw['content']), tool_calls=calls,
                       tool_call_id=str(raw.get('tool_call_id', '')),
                       name=str(raw.get('name', '')))
