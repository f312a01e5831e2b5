"""What the bridge needs from a model: a request dataclass in, a stream of events out.

    class Backend(Protocol):
        def models(self) -> Sequence[str]
        def generate(self, request: BackendRequest) -> Iterator[Event] | AsyncIterator[Event]
        def cancel(self, request_id: str) -> None          # or async def

`generate` is either a plain function returning a (sync) iterator, run by the bridge on a
thread of its own so it may block, or an `async def` / async generator function, run on the
event loop. The events are TextDelta, ReasoningDelta and ToolCallDelta (engine.tools.parser's:
the first delta of a call has its id and name, later ones argument text) in stream order,
then exactly one Finished. The bridge never reads a final text: the deltas are the output,
so a backend that only learns the whole answer at the end sends it as one delta.

`cancel(request_id)` is called (at most once) when the HTTP client went away before Finished;
the backend then ends the stream, ideally with Finished(finish_reason='cancelled'), but the
bridge no longer reads it. An async generator is also cancelled where it awaits (cleanup
belongs in its `finally`); a sync iterator is left to end on its own thread.

Errors: raise bridge.errors' InvalidRequestError (400), QueueFullError (429) or
BackendUnavailableError (503) from `generate` or from the iteration. Before the first event
they are the HTTP status; later, an SSE error event.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import (Any, AsyncIterator, Dict, Iterator, Optional, Protocol, Sequence, Tuple,
                    Union)

# The engine's tool types are the bridge's too: one definition from HTTP to the model.
from edge_llm_ros.runtime.tools.parser import ToolCallDelta
from edge_llm_ros.runtime.tools.spec import ToolCall, ToolChoice, ToolSpec

__all__ = ['Backend', 'BackendRequest', 'Event', 'Finished', 'FINISH_REASONS', 'Message',
           'ReasoningDelta', 'TextDelta', 'TokenLogprob', 'ToolCall', 'ToolCallDelta',
           'ToolChoice', 'ToolSpec', 'TopLogprob', 'Usage']

FINISH_REASONS = ('stop', 'length', 'tool_calls', 'cancelled', 'error')


@dataclass(frozen=True)
class Message:
    """One chat turn; roles: system, user, assistant, tool ('developer' arrives as system)."""

    role: str
    content: str = ''
    tool_calls: Tuple[ToolCall, ...] = ()
    tool_call_id: str = ''         # role tool: which call this answers
    name: str = ''                 # optional participant / tool name


@dataclass(frozen=True)
class BackendRequest:
    """One request as the bridge hands it over; None / empty means "backend default"."""

    request_id: str                # also the HTTP response id (chatcmpl-..., cmpl-...)
    model: str
    messages: Tuple[Message, ...] = ()     # chat completions
    prompt: str = ''                        # /v1/completions (then messages is empty)
    max_tokens: int = 0                     # 0 = backend default
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Dict[int, float] = field(default_factory=dict)   # token id -> bias
    stop: Tuple[str, ...] = ()
    json_schema: str = ''          # JSON text of the schema; json_object gives {"type":"object"}
    tools: Tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = ToolChoice('none')    # mode auto/none/required/named (+ name)
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int = 0          # 0..20, only with logprobs
    reasoning: Optional[bool] = None         # False: thinking off where the template allows it
    reasoning_budget: int = 0      # tokens of reasoning before the closing tag is forced; 0 = none
    stream: bool = False
    # Chat only, from the X-Session-Id header: the node remembers this conversation (the
    # client still sends the whole history, OpenAI style: the node continues after the turns
    # it already holds). '' = stateless, the default.
    session_id: str = ''
    # Chat only: the image_url parts' pixels (RGB [H, W, 3] uint8 arrays, decoded by the
    # bridge), in order; each part became a `<__media__>` marker in its message's content.
    images: Tuple[Any, ...] = field(default=(), compare=False, repr=False)
    # LoRA adapters (name, scale): the body's `lora` and the model name's base+adapter.
    lora: Tuple[Tuple[str, float], ...] = ()

    @property
    def is_chat(self) -> bool:
        return not self.prompt


@dataclass(frozen=True)
class TopLogprob:
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's logprob, with the `top` alternatives when asked for."""

    token: str
    logprob: float
    top: Tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class TextDelta:
    """User-visible answer text, with its tokens' logprobs when the request asked."""

    text: str
    logprobs: Tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ReasoningDelta:
    """Text between the model's reasoning tags (reasoning_content in the response)."""

    text: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0      # part of completion_tokens


@dataclass(frozen=True)
class Finished:
    """The last event: one of FINISH_REASONS, the token counts, and why for 'error'."""

    finish_reason: str
    usage: Usage = Usage()
    error_message: str = ''


Event = Union[TextDelta, ReasoningDelta, ToolCallDelta, Finished]


class Backend(Protocol):
    """The model behind the bridge (llm_node through LLMClient, or a fake in tests)."""

    def models(self) -> Sequence[str]:
        """Return the model ids served (a request naming another gets 404)."""

    def generate(self, request: BackendRequest) -> Union[Iterator[Event],
                                                         AsyncIterator[Event]]:
        """Start the request and return its events (see the module docstring)."""

    def cancel(self, request_id: str) -> Any:
        """Stop the request (may be `async def`); called when the HTTP client left."""
