"""A session's conversation: its turns, and the token ids the model saw and produced.

A goal with a session_id continues its session: the stored turns come first, then the goal's
new turns, rendered by the model's chat template. What the model produced is kept as its ids,
not re-rendered: when the template writes the stored turns exactly as the model saw and
wrote them (the usual case: the decoded ids are a prefix of the new rendering), the new
prompt is the stored ids followed by only the new text, tokenized. So the KV of the whole
stored conversation is reused and a turn prefills only its new tokens. A template that
rewrites past turns (one that drops an assistant's reasoning, or trims its text) gets a
fresh rendering instead, and prefix reuse then keeps what still matches.

Context policy: when the stored turns, the new ones and max_tokens do not fit the context,
the oldest turns are dropped, whole exchanges from the start (the next kept turn is a user
turn), keeping the system prompt and the latest user turn on; the rest is rendered afresh.
Turns a goal resent (OpenAI style) before its last user turn may go too. How many were
dropped is in the result (`dropped_turns`). A goal whose latest turn cannot fit even then is
refused (prepare() checks it with the goal's own system prompt; bind() with the
conversation's, raising ContextOverflowError), never truncated.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import json
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from edge_llm_ros.errors import ContextOverflowError, InvalidRequestError
from edge_llm_ros.runtime.tokenizer import TextTokenizer
from edge_llm_ros.runtime.tools.spec import ToolCall
from edge_llm_ros.runtime.types import ChatMessage

# Generate.Goal.HISTORY_* (test_conversation checks they agree).
HISTORY_AUTO, HISTORY_APPEND, HISTORY_REPLACE = 0, 1, 2
HISTORY_MODES = (HISTORY_AUTO, HISTORY_APPEND, HISTORY_REPLACE)


@dataclass(frozen=True)
class Conversation:
    """What a session remembers (see the module docstring)."""

    system: str = ''
    turns: Tuple[ChatMessage, ...] = ()
    ids: Tuple[int, ...] = ()      # the model's view: prompt ids then generated ids

    def to_json(self) -> str:
        return json.dumps({'system': self.system, 'turns': [_turn_dict(t) for t in self.turns],
                           'ids': list(self.ids)}, ensure_ascii=False, separators=(',', ':'))

    @classmethod
    def from_json(cls, text: str) -> 'Conversation':
        """Parse to_json()'s text (ValueError when it is not that)."""
        try:
            raw = json.loads(text)
            return cls(system=str(raw['system']),
                       turns=tuple(_turn_of(t) for t in raw['turns']),
                       ids=tuple(int(i) for i in raw['ids']))
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


@dataclass(frozen=True)
class Bound:
    """A session goal's prompt once its conversation is known."""

    ids: Tuple[int, ...]
    system: str
    history: Tuple[ChatMessage, ...]     # stored turns kept (after any dropped)
    new: Tuple[ChatMessage, ...]         # the goal's new turns
    dropped: int                         # stored turns left out (context policy)
    continued: bool                      # the stored ids were continued exactly


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
    """Build the prompt ids of a session goal (see the module docstring).

    room: prompt positions allowed (context - max_tokens).
    """
    system, history, new = split_turns(stored, chat)
    if not new:
        raise InvalidRequestError('the goal adds no turn to its session: its messages are '
                                  'exactly the stored conversation; add a new user turn')
    head = (ChatMessage('system', system),) if system else ()
    text = render(head + history + new)
    ids = _continue(tokenizer, stored.ids, text) if history else None
    continued = ids is not None
    if ids is None:
        ids = tokenizer.encode_prompt(text)
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
    while len(ids) > room and pinned < limit:
        cut = min(_next_exchange(turns[pinned:]), limit - pinned)
        turns = turns[:pinned] + turns[pinned + cut:]
        limit -= cut
        dropped += cut
        ids = tokenizer.encode_prompt(render(head + turns))
        continued = False
    if len(ids) > room:
        raise ContextOverflowError(
            f"the session goal needs {len(ids)} prompt positions with its conversation's "
            f'system prompt and its latest turn, and {room} are free with its max_tokens: '
            'lower max_tokens, or start the conversation again (HISTORY_REPLACE) with a '
            'shorter system prompt')
    kept_history = len(history) - min(dropped, max(0, len(history) - pinned))
    history, new = turns[:kept_history], turns[kept_history:]
    return Bound(tuple(ids), system, history, new, dropped, continued)


def _continue(tokenizer: TextTokenizer, stored_ids: Sequence[int],
              text: str) -> Optional[List[int]]:
    """Return the stored ids + the tokens `text` adds after them (None: it rewrote them)."""
    if not stored_ids:
        return None
    ids = list(stored_ids)
    bos = tokenizer.bos_token_id
    body = ids[1:] if tokenizer.add_bos_token and bos is not None and ids[0] == bos else ids
    seen = tokenizer.decode(body, skip_special_tokens=False)
    if not text.startswith(seen):
        return None
    return ids + tokenizer.encode(text[len(seen):])


def _next_exchange(turns: Tuple[ChatMessage, ...]) -> int:
    """How many leading turns to drop so the kept turns start at the next user turn."""
    for i in range(1, len(turns)):
        if turns[i].role == 'user':
            return i
    return len(turns)


def committed(bound: Bound, reply: ChatMessage, generated: Sequence[int]) -> Conversation:
    """Return the conversation after a goal that ended well: turns, reply and all its ids."""
    return Conversation(system=bound.system, turns=bound.history + bound.new + (reply,),
                        ids=bound.ids + tuple(int(t) for t in generated))


def reply_turn(text: str, tool_calls: Sequence[Any]) -> ChatMessage:
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
