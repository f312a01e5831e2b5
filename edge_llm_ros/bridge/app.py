"""The OpenAI-compatible HTTP app: /v1/chat/completions, /v1/completions, /v1/models.

`create_app(backend, config)` depends only on the Backend protocol (bridge/backend.py), so
it is tested with a fake backend and served by llm_node's adapter over LLMClient alike.
Every request: bearer token (if configured) -> body size limit -> JSON -> schema -> model
-> backend. While the backend works, the handler listens for the client's disconnect and
cancels the backend request when it comes, streaming or not.
"""
from __future__ import annotations

import hmac
import json
import logging
from typing import Any, Awaitable, Callable, Dict, List, Optional, Type, TypeVar, Union
import uuid

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from edge_llm_ros.bridge.backend import Backend, BackendRequest, Finished
from edge_llm_ros.bridge.config import BridgeConfig
from edge_llm_ros.bridge.convert import Body, chat_request, completion_request, parse_body
from edge_llm_ros.bridge.embeddings import EmbeddingRoutes
from edge_llm_ros.bridge.errors import (AuthenticationError, BodyTooLargeError, BridgeError,
                                        InvalidRequestError, MethodNotAllowedError,
                                        ModelNotFoundError, NotFoundError)
from edge_llm_ros.bridge.image_fetch import ImageFetcher
from edge_llm_ros.bridge.render import ChatRenderer, CompletionRenderer
from edge_llm_ros.bridge.run import BackendRun
from edge_llm_ros.bridge.schemas import (ChatCompletionRequest, CompletionRequest, ModelCard,
                                         ModelList)

LOG = logging.getLogger('edge_llm_ros.bridge')
Renderer = Union[ChatRenderer, CompletionRenderer]
T = TypeVar('T')


class ClientDisconnected(Exception):
    """The HTTP client closed the connection before the answer was complete."""


class IncompleteStreamError(BridgeError):
    """The backend's events ended without a Finished event (a backend bug)."""

    code = 'incomplete_generation'


def _usage_on(body) -> bool:
    """Whether a stream ends with a usage chunk (stream_options.include_usage)."""
    return bool(body.stream_options and body.stream_options.include_usage)


def error_response(exc: BridgeError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


def _sse(data: Any) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))
    return f'data: {text}\n\n'.encode('utf-8')


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())['type'] != 'http.disconnect':
        pass


async def while_connected(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work()`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    box: List[Any] = []
    errors: List[BaseException] = []
    async with anyio.create_task_group() as group:
        async def run() -> None:
            try:
                box.append(await work())
            except Exception as exc:   # noqa: B902 - re-raised below, outside the task group
                errors.append(exc)
            group.cancel_scope.cancel()
        group.start_soon(run)
        await _wait_disconnect(request.receive)
        group.cancel_scope.cancel()
    if errors:
        raise errors[0]
    if not box:
        raise ClientDisconnected()
    return box[0]


class DisconnectAwareStream(StreamingResponse):
    """A streaming response that always watches for the client leaving (any ASGI version).

    On disconnect the body iterator is cancelled; `on_close` then runs in any case (it
    cancels the backend request unless it finished), even if the body never started.
    """

    def __init__(self, content: Any, on_close: Callable[[], Awaitable[None]],
                 **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass   # the socket broke while sending: same as a disconnect
                    group.cancel_scope.cancel()
                group.start_soon(stream)
                await _wait_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            await self.on_close()


class _Handlers:
    """Route handlers bound to one backend and config."""

    def __init__(self, backend: Backend, config: BridgeConfig) -> None:
        self.backend = backend
        self.config = config
        self.fetch = (ImageFetcher(config.image_fetch_timeout_s, config.image_fetch_max_bytes)
                      if config.fetch_image_urls else None)

    def authorize(self, request: Request) -> None:
        if not self.config.api_key:
            return
        header = request.headers.get('authorization', '')
        scheme, _, token = header.partition(' ')
        if not header:
            raise AuthenticationError('no API key given: send "Authorization: Bearer <key>" '
                                      '(the key the bridge was started with)')
        if scheme.lower() != 'bearer' or not hmac.compare_digest(
                token.strip().encode(), self.config.api_key.encode()):
            raise AuthenticationError('incorrect API key: send "Authorization: Bearer <key>" '
                                      'with the key the bridge was started with')

    async def read_json(self, request: Request) -> Any:
        limit = self.config.max_body_bytes
        too_large = BodyTooLargeError(f'the request body is over the limit of {limit} bytes '
                                      '(BridgeConfig.max_body_bytes)')
        length = request.headers.get('content-length', '')
        if length.isdigit() and int(length) > limit:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as exc:   # UnicodeDecodeError is a ValueError
            raise InvalidRequestError(
                f'the request body is not valid JSON ({exc}); send a JSON object with '
                'Content-Type: application/json') from None

    def models(self) -> List[str]:
        return [str(m) for m in self.backend.models()]

    def check_model(self, model: str) -> None:
        served = self.models()
        # 'base+adapter[+adapter]': the base model with LoRA adapters (convert.lora_of).
        if model.split('+')[0] not in served:
            raise ModelNotFoundError(f"the model '{model}' does not exist here; this bridge "
                                     f"serves: {', '.join(served) or 'nothing'}",
                                     param='model')

    async def list_models(self, request: Request) -> Dict[str, Any]:
        self.authorize(request)
        return ModelList(data=[self._card(m) for m in self.models()]).dump()

    async def get_model(self, request: Request, model_id: str) -> Dict[str, Any]:
        self.authorize(request)
        self.check_model(model_id)
        return self._card(model_id).dump()

    def _card(self, model: str) -> ModelCard:
        return ModelCard(id=model, created=0, owned_by=self.config.owned_by)

    async def body(self, request: Request, model: Type[Body]) -> Body:
        """Check token, size, JSON, schema and model, in that order."""
        self.authorize(request)
        body = parse_body(model, await self.read_json(request))
        self.check_model(body.model)
        return body

    async def chat(self, request: Request) -> Response:
        body = await self.body(request, ChatCompletionRequest)
        # Off the event loop: decoding (and fetching, where allowed) images takes a while.
        backend_request = await anyio.to_thread.run_sync(
            chat_request, body, f'chatcmpl-{uuid.uuid4().hex}',
            request.headers.get('x-session-id', ''), self.fetch)
        return await self.serve(request, backend_request,
                                ChatRenderer(backend_request, include_usage=_usage_on(body)))

    async def completions(self, request: Request) -> Response:
        body = await self.body(request, CompletionRequest)
        backend_request = completion_request(body, f'cmpl-{uuid.uuid4().hex}')
        return await self.serve(request, backend_request,
                                CompletionRenderer(backend_request, echo=bool(body.echo),
                                                   include_usage=_usage_on(body)))

    async def serve(self, request: Request, backend_request: BackendRequest,
                    renderer: Renderer) -> Response:
        """Answer one generation: errors before the first event are HTTP statuses."""
        run = BackendRun(self.backend, backend_request)
        handed_over = False     # a returned stream closes the run itself
        try:
            if not backend_request.stream:
                return await while_connected(request, lambda: self._collect(run, renderer))
            first = await while_connected(request, run.next_event)
            response = DisconnectAwareStream(
                self._stream(run, renderer, first), on_close=run.close,
                media_type='text/event-stream',
                headers={'Cache-Control': 'no-cache', 'X-Accel-Buffering': 'no'})
            handed_over = True
            return response
        except StopAsyncIteration:
            raise IncompleteStreamError('the backend ended without a result') from None
        except ClientDisconnected:
            return Response(status_code=499)   # nobody reads it; the backend was cancelled
        except BridgeError:
            raise
        except Exception as exc:   # noqa: B902 - a backend bug still gets an OpenAI error
            LOG.exception('request %s failed', backend_request.request_id)
            raise BridgeError(f'the backend failed: {exc!r}') from None
        finally:
            if not handed_over:
                await run.close()

    async def _collect(self, run: BackendRun, renderer: Renderer) -> Dict[str, Any]:
        while True:
            event = await run.next_event()
            renderer.chunks(event)
            if isinstance(event, Finished):
                return renderer.completion()

    async def _stream(self, run: BackendRun, renderer: Renderer, first):
        try:
            for chunk in renderer.first_chunks():
                yield _sse(chunk)
            event = first
            while True:
                for chunk in renderer.chunks(event):
                    yield _sse(chunk)
                if isinstance(event, Finished):
                    break
                event = await run.next_event()
        except StopAsyncIteration:
            yield _sse(IncompleteStreamError('the backend ended without a result').body())
        except BridgeError as exc:
            yield _sse(exc.body())
        except Exception as exc:   # noqa: B902 - the client gets an error event, not a cut
            LOG.exception('request %s failed mid-stream', run.request.request_id)
            yield _sse(BridgeError(f'internal error: {exc}').body())
        finally:
            await run.close()
        yield _sse('[DONE]')


def create_app(backend: Backend, config: Optional[BridgeConfig] = None) -> FastAPI:
    """Build the FastAPI app serving `backend` under OpenAI's /v1 routes."""
    config = config or BridgeConfig()
    handlers = _Handlers(backend, config)
    app = FastAPI(title='edge_llm_ros OpenAI bridge', docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.backend = backend
    app.state.config = config

    @app.exception_handler(BridgeError)
    async def bridge_error(request: Request, exc: BridgeError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 405:
            return error_response(MethodNotAllowedError(
                f'{request.method} is not allowed on {request.url.path}'))
        if exc.status_code == 404:
            return error_response(NotFoundError(
                f'no route {request.url.path}: this bridge serves /v1/chat/completions, '
                '/v1/completions, /v1/embeddings, /v1/rerank and /v1/models'))
        error = BridgeError(str(exc.detail))
        error.status = exc.status_code
        error.error_type = 'invalid_request_error' if exc.status_code < 500 else 'server_error'
        return error_response(error)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        LOG.exception('request %s %s failed', request.method, request.url.path)
        return error_response(BridgeError(f'internal error: {exc}'))

    app.add_api_route('/v1/models', handlers.list_models, methods=['GET'])
    app.add_api_route('/v1/models/{model_id:path}', handlers.get_model, methods=['GET'])
    app.add_api_route('/v1/chat/completions', handlers.chat, methods=['POST'])
    app.add_api_route('/v1/completions', handlers.completions, methods=['POST'])
    extra = EmbeddingRoutes(handlers)   # bridge/embeddings.py
    app.add_api_route('/v1/embeddings', extra.embeddings, methods=['POST'])
    app.add_api_route('/v1/rerank', extra.rerank, methods=['POST'])
    return app
