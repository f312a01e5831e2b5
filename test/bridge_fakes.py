"""A scripted Backend for the bridge tests (sync and async kinds), and a real-server helper.

A responder maps each BackendRequest to a script: a list of events, where HOLD waits until
the request is cancelled and an exception instance is raised at that point. The backend
records every request, every cancel, and what it ended each request with.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence

from edge_llm_ros.bridge import (BackendRequest, BridgeConfig, Finished, ReasoningDelta,
                                 run_bridge, TextDelta, ToolCallDelta, Usage)

MODEL = 'fake-model'
HOLD = object()           # in a script: block until the request is cancelled
HOLD_LIMIT_S = 20.0       # a held request that nobody cancels ends itself (test bug guard)


def words(text: str) -> List[str]:
    """Split text into stream-sized pieces that add up to it exactly."""
    pieces, current = [], ''
    for char in text:
        current += char
        if char == ' ':
            pieces.append(current)
            current = ''
    return pieces + ([current] if current else [])


def text_script(text: str, prompt_tokens: int = 5, reason: str = 'stop') -> list:
    deltas = [TextDelta(piece) for piece in words(text)]
    return deltas + [Finished(reason, Usage(prompt_tokens, len(deltas)))]


def reasoning_script(thoughts: str, text: str) -> list:
    thinking = [ReasoningDelta(piece) for piece in words(thoughts)]
    answer = [TextDelta(piece) for piece in words(text)]
    usage = Usage(7, len(thinking) + len(answer), reasoning_tokens=len(thinking))
    return thinking + answer + [Finished('stop', usage)]


def tool_script(calls: Sequence[tuple], text: str = '', call_ids: bool = True) -> list:
    """One tool call per (name, arguments dict); arguments stream in three pieces."""
    script = [TextDelta(text)] if text else []
    for index, (name, arguments) in enumerate(calls):
        body = json.dumps(arguments)
        thirds = [body[:len(body) // 3], body[len(body) // 3:2 * len(body) // 3],
                  body[2 * len(body) // 3:]]
        script.append(ToolCallDelta(index, id=f'call_{index}' if call_ids else '', name=name,
                                    arguments=thirds[0]))
        script += [ToolCallDelta(index, arguments=piece) for piece in thirds[1:]]
    return script + [Finished('tool_calls', Usage(9, 3 * len(calls)))]


def tool_to_call(request: BackendRequest) -> Optional[str]:
    """Name the tool a model would call under the request's tool_choice (None: text)."""
    if not request.tools or request.tool_choice.mode == 'none':
        return None
    return request.tool_choice.name or request.tools[0].name


def echo_responder(request: BackendRequest) -> list:
    """Answer with a text that names the request's last message (or prompt)."""
    said = request.messages[-1].content if request.messages else request.prompt
    return text_script(f'You said: {said}. That is all I have to say about it.')


def _wait_len(items: list, count: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while len(items) < count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class FakeBackend:
    """Sync backend: generate() is a plain generator, run by the bridge on its own thread."""

    def __init__(self, responder: Callable[[BackendRequest], list] = echo_responder,
                 models: Sequence[str] = (MODEL,), delay_s: float = 0.0) -> None:
        self.responder = responder
        self.model_ids = list(models)
        self.delay_s = delay_s
        self.requests: List[BackendRequest] = []
        self.cancelled: List[str] = []
        self.sent: Dict[str, str] = {}        # request id -> text it emitted
        self.ended: Dict[str, str] = {}       # request id -> how it ended (finish reason)
        self._cancel: Dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self.ended_any = threading.Condition(self._lock)

    def models(self) -> List[str]:
        return self.model_ids

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self.cancelled.append(request_id)
            event = self._cancel.get(request_id)
        if event is not None:
            event.set()

    def _start(self, request: BackendRequest) -> list:
        with self._lock:
            self.requests.append(request)
            self._cancel[request.request_id] = threading.Event()
            self.sent[request.request_id] = ''
        return self.responder(request)

    def _end(self, request_id: str, how: str) -> None:
        with self._lock:
            self.ended.setdefault(request_id, how)
            self.ended_any.notify_all()

    def _record(self, request_id: str, event) -> None:
        if isinstance(event, TextDelta):
            with self._lock:
                self.sent[request_id] += event.text

    def _steps(self, request: BackendRequest) -> Iterator:
        """Play the script: a number is a wait (cut short by a cancel), the rest are events."""
        script = self._start(request)
        request_id = request.request_id
        cancel = self._cancel[request_id]
        try:
            for event in script:
                if isinstance(event, BaseException):
                    raise event
                yield HOLD_LIMIT_S if event is HOLD else self.delay_s
                if cancel.is_set():
                    self._end(request_id, 'cancelled')
                    yield Finished('cancelled')
                    return
                if event is HOLD:
                    continue
                self._record(request_id, event)
                if isinstance(event, Finished):   # the bridge may close us right after it
                    self._end(request_id, event.finish_reason)
                yield event
            self._end(request_id, 'no Finished')
        finally:
            self._end(request_id, 'closed')     # kept only if it ended no other way

    def generate(self, request: BackendRequest) -> Iterator:
        steps = self._steps(request)
        try:
            for step in steps:
                if isinstance(step, (int, float)):
                    if step:
                        self._cancel[request.request_id].wait(step)
                else:
                    yield step
        finally:
            steps.close()

    def wait_ended(self, request_ids: Sequence[str], timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            while not all(rid in self.ended for rid in request_ids):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.ended_any.wait(left)
        return True

    def wait_requests(self, count: int = 1, timeout: float = 10.0) -> bool:
        return _wait_len(self.requests, count, timeout)

    def wait_cancelled(self, count: int = 1, timeout: float = 10.0) -> bool:
        return _wait_len(self.cancelled, count, timeout)


class AsyncFakeBackend(FakeBackend):
    """The same backend with `async def` generate and cancel (run on the server's loop)."""

    async def cancel(self, request_id: str) -> None:
        FakeBackend.cancel(self, request_id)

    async def generate(self, request: BackendRequest):
        steps = self._steps(request)
        try:
            for step in steps:
                if isinstance(step, (int, float)):
                    deadline = time.monotonic() + step
                    await asyncio.sleep(0)
                    while (time.monotonic() < deadline
                           and not self._cancel[request.request_id].is_set()):
                        await asyncio.sleep(min(0.01, step))
                else:
                    yield step
        finally:
            steps.close()


BACKEND_KINDS = (FakeBackend, AsyncFakeBackend)
KIND_IDS = ('sync', 'async')


@contextlib.contextmanager
def served(backend: FakeBackend, config: Optional[BridgeConfig] = None):
    """Run the bridge on 127.0.0.1 with an ephemeral port for the duration of a test."""
    bridge = run_bridge(backend, config or BridgeConfig(port=0))
    try:
        yield bridge
    finally:
        bridge.stop()


def serving(backend: FakeBackend, api_key: str = '') -> Iterator:
    """Yield (backend, bridge) while a bridge serves `backend` (for module fixtures)."""
    with served(backend, BridgeConfig(port=0, api_key=api_key)) as bridge:
        yield backend, bridge
