"""Backend events -> OpenAI responses: stream chunks as they come, or one body at the end.

One renderer per request. `chunks(event)` both returns the stream chunks for that event and
accumulates it, so the plain (non-stream) body is built from exactly what a stream would
have sent. Reasoning goes to `reasoning_content` (vLLM's and DeepSeek's field), never to
`content`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import time
from typing import Any, Dict, List, Optional

from edge_llm_ros.bridge.backend import (BackendRequest, Event, Finished, ReasoningDelta,
                                         TextDelta, TokenLogprob, ToolCallDelta, Usage)
from edge_llm_ros.bridge.errors import BridgeError
from edge_llm_ros.bridge.schemas import (ChatChoice, ChatChunkChoice, ChatCompletion,
                                         ChatCompletionChunk, ChatDelta, ChatMessageOut,
                                         ChoiceLogprobs, Completion, CompletionChoice,
                                         CompletionLogprobs, CompletionTokensDetails,
                                         FunctionCallOut, TokenLogprobOut, ToolCallOut,
                                         TopLogprobOut, UsageOut)
from edge_llm_ros.runtime.tools.spec import new_call_id

# The backend's finish reasons in OpenAI's words ('cancelled' by the server: vLLM's 'abort').
FINISH_REASON = {'stop': 'stop', 'length': 'length', 'tool_calls': 'tool_calls',
                 'cancelled': 'abort'}
Chunk = Dict[str, Any]


class GenerationFailedError(BridgeError):
    """The backend ended the request with finish_reason 'error' (500)."""

    code = 'generation_failed'


@dataclass
class _ToolCallState:
    call_id: str
    name: str
    arguments: List[str] = field(default_factory=list)


def _usage(usage: Usage) -> UsageOut:
    out = UsageOut(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                   total_tokens=usage.prompt_tokens + usage.completion_tokens)
    if usage.reasoning_tokens:
        out.completion_tokens_details = CompletionTokensDetails(
            reasoning_tokens=usage.reasoning_tokens)
    return out


def _bytes(text: str) -> List[int]:
    return list(text.encode('utf-8'))


def _token_logprob(item: TokenLogprob) -> TokenLogprobOut:
    return TokenLogprobOut(
        token=item.token, logprob=item.logprob, bytes=_bytes(item.token),
        top_logprobs=[TopLogprobOut(token=t.token, logprob=t.logprob, bytes=_bytes(t.token))
                      for t in item.top])


class _Renderer:
    """What chat and completion renderers share: ids, text, usage and the finish reason."""

    def __init__(self, request: BackendRequest, created: Optional[int] = None) -> None:
        self.request = request
        self.created = int(time.time()) if created is None else created
        self.text: List[str] = []
        self.logprobs: List[TokenLogprob] = []
        self.finished: Optional[Finished] = None

    def _finish_reason(self, finished: Finished) -> str:
        if finished.finish_reason == 'error':
            raise GenerationFailedError(finished.error_message or 'the model failed to generate;'
                                        ' see the node log and /diagnostics')
        return FINISH_REASON.get(finished.finish_reason, finished.finish_reason)

    def _base(self) -> Dict[str, Any]:
        return {'id': self.request.request_id, 'created': self.created,
                'model': self.request.model}


class ChatRenderer(_Renderer):
    """chat.completion and chat.completion.chunk bodies of one request."""

    def __init__(self, request: BackendRequest, include_usage: bool = False,
                 created: Optional[int] = None) -> None:
        super().__init__(request, created)
        self.include_usage = include_usage
        self.reasoning: List[str] = []
        self.tool_calls: Dict[int, _ToolCallState] = {}

    def _chunk(self, delta: ChatDelta, finish_reason: Optional[str] = None,
               logprobs: Optional[ChoiceLogprobs] = None) -> Chunk:
        choice = ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        return ChatCompletionChunk(**self._base(), choices=[choice]).dump()

    def first_chunks(self) -> List[Chunk]:
        """Return the opening chunk OpenAI sends before any text: the assistant role."""
        return [self._chunk(ChatDelta(role='assistant', content=''))]

    def chunks(self, event: Event) -> List[Chunk]:
        """Accumulate `event` and return the stream chunks that carry it."""
        if isinstance(event, TextDelta):
            self.text.append(event.text)
            logprobs = None
            if self.request.logprobs:
                self.logprobs.extend(event.logprobs)
                logprobs = ChoiceLogprobs(content=[_token_logprob(t) for t in event.logprobs])
            if not event.text and not (logprobs and logprobs.content):
                return []
            return [self._chunk(ChatDelta(content=event.text), logprobs=logprobs)]
        if isinstance(event, ReasoningDelta):
            self.reasoning.append(event.text)
            return [self._chunk(ChatDelta(reasoning_content=event.text))] if event.text else []
        if isinstance(event, ToolCallDelta):
            return [self._chunk(ChatDelta(tool_calls=[self._tool_call_delta(event)]))]
        if isinstance(event, Finished):
            return self._finish(event)
        raise TypeError(f'backend sent {event!r}: not one of the bridge.backend event types')

    def _tool_call_delta(self, event: ToolCallDelta) -> ToolCallOut:
        state = self.tool_calls.get(event.index)
        if state is None:
            state = _ToolCallState(call_id=event.id or new_call_id(),
                                   name=event.name)
            self.tool_calls[event.index] = state
            state.arguments.append(event.arguments)
            return ToolCallOut(index=event.index, id=state.call_id, type='function',
                               function=FunctionCallOut(name=state.name,
                                                        arguments=event.arguments))
        state.arguments.append(event.arguments)
        return ToolCallOut(index=event.index, function=FunctionCallOut(arguments=event.arguments))

    def _finish_reason(self, finished: Finished) -> str:
        reason = super()._finish_reason(finished)
        # OpenAI says tool_calls whenever the answer is calls, whatever stopped the model.
        return 'tool_calls' if self.tool_calls and reason == 'stop' else reason

    def _finish(self, finished: Finished) -> List[Chunk]:
        reason = self._finish_reason(finished)
        self.finished = finished
        chunks = [self._chunk(ChatDelta(), finish_reason=reason)]
        if self.include_usage:
            chunks.append(ChatCompletionChunk(**self._base(), choices=[],
                                              usage=_usage(finished.usage)).dump())
        return chunks

    def completion(self) -> Dict[str, Any]:
        """Return the whole chat.completion body, once Finished was fed."""
        assert self.finished is not None, 'completion() before the Finished event'
        text = ''.join(self.text)
        calls = [ToolCallOut(id=s.call_id, type='function',
                             function=FunctionCallOut(name=s.name, arguments=''.join(s.arguments)))
                 for _, s in sorted(self.tool_calls.items())]
        message = ChatMessageOut(content=text if text or not calls else None)
        if self.reasoning:
            message.reasoning_content = ''.join(self.reasoning)
        if calls:
            message.tool_calls = calls
        logprobs = None
        if self.request.logprobs:
            logprobs = ChoiceLogprobs(content=[_token_logprob(t) for t in self.logprobs])
        choice = ChatChoice(message=message, logprobs=logprobs,
                            finish_reason=self._finish_reason(self.finished))
        return ChatCompletion(**self._base(), choices=[choice],
                              usage=_usage(self.finished.usage)).dump()


class CompletionRenderer(_Renderer):
    """text_completion bodies of one /v1/completions request (`echo` repeats the prompt)."""

    def __init__(self, request: BackendRequest, echo: bool = False, include_usage: bool = False,
                 created: Optional[int] = None) -> None:
        super().__init__(request, created)
        self.echo = echo
        self.include_usage = include_usage
        self.offset = 0

    def _chunk(self, text: str, finish_reason: Optional[str] = None,
               logprobs: Optional[CompletionLogprobs] = None) -> Chunk:
        choice = CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish_reason)
        return Completion(**self._base(), choices=[choice]).dump()

    def _logprobs(self, items) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for item in items:
            out.tokens.append(item.token)
            out.token_logprobs.append(item.logprob)
            out.top_logprobs.append({t.token: t.logprob for t in item.top})
            out.text_offset.append(self.offset)
            self.offset += len(item.token)
        return out

    def first_chunks(self) -> List[Chunk]:
        if not self.echo:
            return []
        self.offset = len(self.request.prompt)
        return [self._chunk(self.request.prompt)]

    def chunks(self, event: Event) -> List[Chunk]:
        if isinstance(event, TextDelta):
            self.text.append(event.text)
            self.logprobs.extend(event.logprobs)
            logprobs = self._logprobs(event.logprobs) if self.request.logprobs else None
            if not event.text and not (logprobs and logprobs.tokens):
                return []
            return [self._chunk(event.text, logprobs=logprobs)]
        if isinstance(event, Finished):
            reason = self._finish_reason(event)
            self.finished = event
            chunks = [self._chunk('', finish_reason=reason)]
            if self.include_usage:
                chunks.append(Completion(**self._base(), choices=[],
                                         usage=_usage(event.usage)).dump())
            return chunks
        if isinstance(event, (ReasoningDelta, ToolCallDelta)):
            return []     # a raw completion has no place for them
        raise TypeError(f'backend sent {event!r}: not one of the bridge.backend event types')

    def completion(self) -> Dict[str, Any]:
        assert self.finished is not None, 'completion() before the Finished event'
        logprobs = None
        if self.request.logprobs:
            self.offset = len(self.request.prompt) if self.echo else 0
            logprobs = self._logprobs(self.logprobs)
        echoed = self.request.prompt if self.echo else ''
        choice = CompletionChoice(text=echoed + ''.join(self.text), logprobs=logprobs,
                                  finish_reason=self._finish_reason(self.finished))
        return Completion(**self._base(), choices=[choice],
                          usage=_usage(self.finished.usage)).dump()
