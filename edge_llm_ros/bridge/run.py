"""One backend request on the event loop: its events one by one, and cancel when abandoned.

A sync backend's iterator is pumped by a thread of its own into an asyncio queue, so a
backend that blocks (LLMClient waiting for feedback) never holds the event loop, and a
waiting HTTP handler can still be cancelled at once when its client goes away.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from typing import Any, AsyncIterator, Optional

import anyio
import anyio.to_thread

from edge_llm_ros.bridge.backend import Backend, BackendRequest, Event, Finished

LOG = logging.getLogger('edge_llm_ros.bridge')
_END = object()


def is_async(function: Any) -> bool:
    return inspect.iscoroutinefunction(function) or inspect.isasyncgenfunction(function)


class BackendRun:
    """One request's events via `next_event()`; `close()` cancels it unless it ended."""

    def __init__(self, backend: Backend, request: BackendRequest) -> None:
        self._backend = backend
        self.request = request
        self.ended = False            # the backend stopped by itself (Finished, error, end)
        self._closed = False
        self._source: Optional[AsyncIterator[Event]] = None
        self._async_source: Optional[Any] = None

    async def next_event(self) -> Event:
        """Return the next event; raises StopAsyncIteration if the backend stopped early."""
        try:
            if self._source is None:
                self._source = await self._open()
            event = await self._source.__anext__()
        except Exception:
            self.ended = True      # raised or stopped by itself: nothing left to cancel
            raise
        if isinstance(event, Finished):
            self.ended = True
        return event

    async def _open(self) -> AsyncIterator[Event]:
        if is_async(self._backend.generate):
            source = self._backend.generate(self.request)
            if inspect.isawaitable(source):
                source = await source
            self._async_source = source
            return source.__aiter__()
        return self._pump()

    async def _pump(self) -> AsyncIterator[Event]:
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        thread = threading.Thread(target=_pump_thread, daemon=True,
                                  args=(self._backend, self.request, loop, queue),
                                  name=f'bridge-{self.request.request_id[-8:]}')
        thread.start()
        while True:
            item = await queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def close(self) -> None:
        """Cancel the backend request if it did not finish; safe in a cancelled task."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if not self.ended and self._source is not None:
                await self._cancel()
            close = getattr(self._async_source or self._source, 'aclose', None)
            if close is not None:
                try:
                    await close()
                except Exception:   # noqa: B902 - the backend's cleanup must not break ours
                    LOG.exception('closing the backend stream of %s failed',
                                  self.request.request_id)

    async def _cancel(self) -> None:
        cancel = self._backend.cancel
        request_id = self.request.request_id
        try:
            if is_async(cancel):
                await cancel(request_id)
            else:
                await anyio.to_thread.run_sync(cancel, request_id)
        except Exception:   # noqa: B902 - a failed cancel is logged; the client is gone anyway
            LOG.exception('cancelling %s failed', request_id)


def _pump_thread(backend: Backend, request: BackendRequest, loop: asyncio.AbstractEventLoop,
                 queue: asyncio.Queue) -> None:
    """Move a sync backend's events to the loop; stop early if the loop is gone."""
    iterator = None
    try:
        iterator = iter(backend.generate(request))
        for event in iterator:
            loop.call_soon_threadsafe(queue.put_nowait, event)
            if isinstance(event, Finished):
                break
    except RuntimeError as exc:
        if not loop.is_closed():
            _put(loop, queue, exc)
    except Exception as exc:   # noqa: B902 - handed to the request's handler, which answers it
        _put(loop, queue, exc)
    finally:
        close = getattr(iterator, 'close', None)
        if close is not None:
            close()
        _put(loop, queue, _END)


def _put(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item: Any) -> None:
    try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:
        pass   # the server stopped: nobody reads this request any more
