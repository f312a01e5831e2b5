"""The bridge's Backend over llm_node's ~/generate action (LLMClient): one goal per request.

    backend = LLMClientBackend(LLMClient(node, '/llm_node'), model_id='edge-llm')
    bridge = run_bridge(backend, BridgeConfig(port=8000))

`generate` sends the goal and turns its feedback into bridge events in arrival order
(reasoning_delta -> ReasoningDelta, text_delta -> TextDelta, tool_call_deltas ->
ToolCallDelta), then one Finished from the result. As LLMClient.stream does, feedback that
never arrived (a gap in the token counts, or none within FEEDBACK_GRACE_S after the result)
is not lost: the rest of the result's text, and its tool calls, are sent before Finished.
`cancel` cancels the goal (the HTTP client went away); the goal then ends CANCELED on the
node, in its transcript and diagnostics.

How refusals map (bridge/errors.py answers them in OpenAI's shape):
- goal rejected: LLMClient's QueueFullError -> 429 (Retry-After); NodeInactiveError, or a
  plain GoalRejectedError when the node's state could not be asked -> 503.
- accepted and aborted with error_kind invalid_request before any output -> 400 with the
  node's error_message; error_kind unavailable (deactivated or shutting down), or a cancel
  nobody asked for -> 503; any other abort -> finish_reason 'error' (mid-stream: an SSE
  error event).
- the action server not discovered within discovery_timeout_s -> 503 (a goal sent before
  discovery would be lost).

Images (image_url parts, decoded by bridge/convert.py) never travel inside the goal: each
request's images are copied into one slot of a pool of this process (nodes/handles.py
image_pool, its socket in EDGE_LLM_IPC_DIR, which llm_node must share: same host) and the
goal carries their handles. The pool lives until the goal's stream ends. Pool ids come from a
fixed set of image_pools names, so llm_node keeps one connection per name however many
requests come; a request finding all of them busy gets 429. /v1/completions prompts go as
raw_prompt (no chat template), as OpenAI's completions take them.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import ChatMessage, ToolCall as ToolCallMsg, ToolSpec as ToolSpecMsg
from edge_llm_ros.bridge.backend import (BackendRequest, Event, Finished, Message, ReasoningDelta,
                                         TextDelta, TokenLogprob, ToolCallDelta, TopLogprob, Usage)
from edge_llm_ros.bridge.errors import BackendUnavailableError, InvalidRequestError, QueueFullError
from edge_llm_ros.client import (EmbedRefusedError, FEEDBACK_GRACE_S, GenerationHandle,
                                 GenerationOutcome, GoalRejectedError, LLMClient, LLMClientError,
                                 make_goal, QueueFullError as QueueFullRejection)
from edge_llm_ros.ipc.errors import IpcError
from edge_llm_ros.nodes.handles import image_pool

_DONE = object()
# How long a cancelled goal may take to end before the stream gives up on its result.
CANCEL_RESULT_TIMEOUT_S = 10.0
# Requests with images that may run at once (one pool each, see the module docstring).
IMAGE_POOLS = 8


def message_msg(message: Message) -> ChatMessage:
    """Translate one bridge chat turn into an edge_llm_msgs ChatMessage."""
    return ChatMessage(role=message.role, content=message.content,
                       tool_calls=[ToolCallMsg(id=call.id, name=call.name,
                                               arguments=call.arguments)
                                   for call in message.tool_calls],
                       tool_call_id=message.tool_call_id, name=message.name)


def build_goal(request: BackendRequest, images: Sequence[Any] = ()) -> Generate.Goal:
    """Translate a bridge request into a Generate goal (unset values: the node's defaults).

    images: TensorHandle messages of request.images (see LLMClientBackend); a completion's
    prompt goes raw (no chat template).
    """
    sampling: Dict[str, Any] = {name: value for name, value in (
        ('temperature', request.temperature), ('top_p', request.top_p),
        ('seed', request.seed), ('presence_penalty', request.presence_penalty),
        ('frequency_penalty', request.frequency_penalty)) if value is not None}
    if request.logit_bias:
        sampling['logit_bias'] = dict(request.logit_bias)
    if request.logprobs:
        sampling['top_logprobs'] = int(request.top_logprobs)
    choice = request.tool_choice
    return make_goal(
        prompt=request.prompt, messages=[message_msg(m) for m in request.messages],
        max_tokens=request.max_tokens, stop=request.stop, json_schema=request.json_schema,
        tools=[ToolSpecMsg(name=t.name, description=t.description,
                           parameters=json.dumps(dict(t.parameters))) for t in request.tools],
        tool_choice=(choice.name if choice.mode == 'named' else choice.mode)
        if request.tools else '',
        parallel_tool_calls=request.parallel_tool_calls, reasoning=request.reasoning,
        reasoning_budget=request.reasoning_budget or None, session_id=request.session_id,
        history_mode=Generate.Goal.HISTORY_AUTO, images=list(images),
        raw_prompt=not request.is_chat, lora=dict(request.lora), **sampling)


def rejection_error(exc: GoalRejectedError) -> Exception:
    """Map a goal rejection to the bridge's error: queue full 429, not active 503."""
    if isinstance(exc, QueueFullRejection):
        return QueueFullError(str(exc))
    return BackendUnavailableError(str(exc))


class _Stream:
    """One goal's feedback turned into bridge events (see the module docstring)."""

    def __init__(self) -> None:
        self.items: 'queue.Queue[Any]' = queue.Queue()
        self.seen_tokens = 0
        self.gap = False
        self.text = ''
        self.reasoning = ''
        self.tool_deltas = 0

    def on_feedback(self, feedback: Generate.Feedback) -> None:   # executor thread
        self.items.put(feedback)

    def events(self, feedback: Generate.Feedback) -> List[Event]:
        if feedback.queue_position and not feedback.completion_tokens:
            return []       # still waiting in the queue
        first_token = feedback.completion_tokens - len(feedback.token_ids)
        if feedback.token_ids and first_token != self.seen_tokens:
            self.gap = True   # chunks were lost: the rest comes from the result
        self.seen_tokens = max(self.seen_tokens, feedback.completion_tokens)
        if self.gap:
            return []
        out: List[Event] = []
        reasoning = feedback.reasoning_delta
        if reasoning:
            self.reasoning += reasoning
            out.append(ReasoningDelta(reasoning))
        if feedback.text_delta:
            self.text += feedback.text_delta
            out.append(TextDelta(feedback.text_delta))
        for delta in feedback.tool_call_deltas:
            self.tool_deltas += 1
            out.append(ToolCallDelta(int(delta.index), id=delta.id, name=delta.name,
                                     arguments=delta.arguments_delta))
        return out

    def complete(self, outcome: Optional[GenerationOutcome], result_at: float) -> bool:
        if outcome is None or self.gap or self.seen_tokens >= outcome.completion_tokens:
            return True
        return time.monotonic() - result_at > FEEDBACK_GRACE_S

    def rest(self, outcome: GenerationOutcome) -> List[Event]:
        """Events the feedback did not deliver: the tails of reasoning and text, tool calls."""
        out: List[Event] = []
        reasoning = outcome.reasoning
        if reasoning.startswith(self.reasoning) and len(reasoning) > len(self.reasoning):
            out.append(ReasoningDelta(reasoning[len(self.reasoning):]))
        if outcome.text.startswith(self.text) and len(outcome.text) > len(self.text):
            out.append(TextDelta(outcome.text[len(self.text):]))
        if not self.tool_deltas:
            for index, call in enumerate(outcome.tool_calls):
                out.append(ToolCallDelta(index, id=call.id, name=call.name,
                                         arguments=call.arguments))
        logprobs = tuple(_logprob(entry) for entry in outcome.logprobs)
        if logprobs:    # the feedback carries none: they come with the result
            out.append(TextDelta('', logprobs))
        return out


def _logprob(entry: Any) -> TokenLogprob:
    """Translate an edge_llm_msgs TokenLogprob into the bridge's."""
    top = tuple(TopLogprob(token, float(value))
                for token, value in zip(entry.top_tokens, entry.top_logprobs))
    return TokenLogprob(entry.token, float(entry.logprob), top)


class LLMClientBackend:
    """Serve llm_node's action to the bridge; thread-safe (one bridge thread per request)."""

    def __init__(self, client: LLMClient, model_id: str = 'edge-llm',
                 cancel_timeout_s: float = 5.0, discovery_timeout_s: float = 5.0) -> None:
        self.client = client
        self.model_id = model_id
        self.cancel_timeout_s = cancel_timeout_s
        self.discovery_timeout_s = discovery_timeout_s
        self._handles: Dict[str, GenerationHandle] = {}
        self._cancelled: set = set()
        self._lock = threading.Lock()
        self._pool_ids = [f'edge_llm_bridge_{os.getpid()}_{k}' for k in range(IMAGE_POOLS)]

    def models(self) -> Sequence[str]:
        return [self.model_id]

    def embed(self, texts: Sequence[str], dimensions: int = 0):
        """Return the node's ~/embed reply (bridge /v1/embeddings); a refusal is a 400."""
        try:
            return self.client.embed(texts, dimensions=dimensions,
                                     timeout=self.discovery_timeout_s + 60.0)
        except EmbedRefusedError as exc:
            raise InvalidRequestError(exc.message, param='input') from None
        except (LLMClientError, TimeoutError) as exc:
            raise BackendUnavailableError(str(exc)) from None

    def rerank(self, query: str, documents: Sequence[str], top_n: int = 0):
        """Return the node's ~/rerank reply (bridge /v1/rerank); a refusal is a 400."""
        try:
            return self.client.rerank(query, documents, top_n=top_n,
                                      timeout=self.discovery_timeout_s + 60.0)
        except EmbedRefusedError as exc:
            raise InvalidRequestError(exc.message, param='documents') from None
        except (LLMClientError, TimeoutError) as exc:
            raise BackendUnavailableError(str(exc)) from None

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)
            handle = self._handles.get(request_id)
        if handle is not None:
            handle.cancel(timeout=self.cancel_timeout_s)

    @contextlib.contextmanager
    def _shared_images(self, images: Sequence[Any]) -> Iterator[list]:
        """Publish a request's images in a pool of its own; yield their handles."""
        if not images:
            yield []
            return
        with self._lock:
            if not self._pool_ids:
                raise QueueFullError(f'{IMAGE_POOLS} requests with images are running: '
                                     'retry later')
            pool_id = self._pool_ids.pop()
        try:
            with image_pool(images, pool_id) as handles:
                yield handles
        except IpcError as exc:
            raise BackendUnavailableError(f'the images cannot be shared with llm_node: {exc}'
                                          ) from None
        finally:
            with self._lock:
                self._pool_ids.append(pool_id)

    def generate(self, request: BackendRequest) -> Iterator[Event]:
        with self._shared_images(request.images) as images:
            yield from self._generate(request, images)

    def _generate(self, request: BackendRequest, images: Sequence[Any]) -> Iterator[Event]:
        goal = build_goal(request, images)   # a missing interface field raises 400 here
        # A goal sent before the action server is discovered is lost: it would never end.
        if not self.client.wait_for_server(timeout=self.discovery_timeout_s):
            raise BackendUnavailableError(
                f'{self.client.server}/generate was not discovered within '
                f'{self.discovery_timeout_s:g} s: is llm_node running with the same '
                'ROS_DOMAIN_ID?')
        stream = _Stream()
        handle = self.client.generate_goal(goal, on_feedback=stream.on_feedback)
        handle.add_done_callback(lambda _: stream.items.put(_DONE))
        with self._lock:
            self._handles[request.request_id] = handle
            cancelled = request.request_id in self._cancelled
        if cancelled:     # the client left while the goal was being sent
            handle.cancel(timeout=self.cancel_timeout_s)
        try:
            yield from self._events(request, handle, stream)
        finally:
            with self._lock:
                self._handles.pop(request.request_id, None)
                self._cancelled.discard(request.request_id)

    def _events(self, request: BackendRequest, handle: GenerationHandle,
                stream: _Stream) -> Iterator[Event]:
        sent_any = False
        done_at: Optional[float] = None
        outcome: Optional[GenerationOutcome] = None
        while True:
            if done_at is not None and stream.complete(outcome, done_at) and \
                    stream.items.empty():
                break
            try:
                item = stream.items.get(timeout=0.05 if done_at is not None else 1.0)
            except queue.Empty:
                continue
            if item is _DONE:
                done_at = time.monotonic()
                outcome = self._outcome(handle)
                continue
            for event in stream.events(item):
                sent_any = True
                yield event
        yield from stream.rest(outcome)
        yield self._finished(outcome, sent_any, request.request_id)

    def _outcome(self, handle: GenerationHandle) -> GenerationOutcome:
        try:
            return handle.result(timeout=CANCEL_RESULT_TIMEOUT_S)
        except GoalRejectedError as exc:
            raise rejection_error(exc) from None
        except (LLMClientError, TimeoutError) as exc:
            raise BackendUnavailableError(f'llm_node did not answer: {exc}') from None

    def _finished(self, outcome: GenerationOutcome, sent_any: bool,
                  request_id: str) -> Finished:
        usage = Usage(outcome.prompt_tokens, outcome.completion_tokens)
        reason = outcome.finish_reason
        with self._lock:
            asked = request_id in self._cancelled
        if outcome.status == 'aborted':
            kind = outcome.error_kind
            message = outcome.error_message or f'llm_node aborted the goal ({kind or reason})'
            if kind == Generate.Result.ERROR_INVALID_REQUEST and not sent_any:
                raise InvalidRequestError(message)
            if kind == Generate.Result.ERROR_UNAVAILABLE or (reason == 'cancelled'
                                                             and not asked):
                raise BackendUnavailableError(message)
            return Finished('error', usage, message)
        if reason not in ('stop', 'length', 'tool_calls', 'cancelled'):
            reason = 'stop'
        return Finished(reason, usage)
