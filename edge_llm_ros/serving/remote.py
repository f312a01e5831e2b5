"""RemoteEngine: the engine interface over any OpenAI-compatible server (httpx streaming).

With llm_node's `engine.backend: remote` the worker runs this instead of the ONNX engine, so
the action keeps its semantics (queue, streaming, cancel, diagnostics, transcripts) while the
model runs elsewhere: vLLM, llama-server, or another robot's openai_bridge.

    engine = RemoteEngine(RemoteConfig(url='http://10.0.0.2:8000/v1'))
    for event in engine.generate(engine.prepare(GenerationRequest(prompt='Hi'))):
        print(event.text_delta, end='')

- prepare() checks what can be checked here (roles, sampling ranges, max_tokens against
  remote.context_length, stop strings, JSON schema, tools and tool_choice) and builds the
  /chat/completions body (or /completions for a raw prompt); the server checks the prompt's
  length. prefix_embeddings, grammar/regex/choices and logprobs cannot be forwarded: they are
  refused with an InvalidRequestError saying so.
- generate() streams: one TokenEvent per SSE chunk that carries output. The server's token
  ids are unknown, so each such chunk counts as one token with id REMOTE_TOKEN_ID (-1):
  completion_tokens and token_ids count chunks (one per token for llama-server, vLLM and the
  bridge at its default feedback cadence); prompt_tokens is the server's usage figure.
- cancel() closes the HTTP stream from any thread; the generation ends CANCELLED.
- tokenize/detokenize/token_strings raise RemoteUnsupportedError (no tokenizer here).
No rclpy here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import json
import os
import socket
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import httpx

from edge_llm_ros.errors import (ContextOverflowError, EngineError, InvalidRequestError,
                                 InvalidSchemaError, ModelLoadError)
from edge_llm_ros.runtime import sampling as sampling_mod
from edge_llm_ros.runtime.request import conversation
from edge_llm_ros.runtime.tools.parser import ToolCallDelta
from edge_llm_ros.runtime.tools.spec import check_tools, parse_tool_choice, ToolCall
from edge_llm_ros.runtime.types import (GenerationRequest, GenerationResult, SamplingConfig,
                                        StopReason, Timings, TokenEvent)

REMOTE_TOKEN_ID = -1
_STOP_REASONS = {'stop': StopReason.STOP, 'length': StopReason.LENGTH,
                 'content_filter': StopReason.STOP, 'cancelled': StopReason.CANCELLED}


class RemoteUnsupportedError(EngineError):
    """The remote backend cannot do this (tokenize, embeddings, grammars, logprobs)."""


class RemoteServerError(EngineError):
    """The remote server refused or broke the request; the message has its answer."""


@dataclass(frozen=True)
class RemoteConfig:
    """Where the remote server is and how to reach it (bringup's remote.* parameters)."""

    url: str                        # base URL of its OpenAI API, e.g. http://host:8000/v1
    model: str = ''                 # '' = the first model its /models lists
    api_key_env: str = ''           # environment variable holding the bearer token
    timeout_s: float = 30.0         # connect, and between two chunks
    context_length: int = 4096      # what ~/get_model_info reports; bounds max_tokens


@dataclass(frozen=True)
class RemoteRequest:
    """A checked request: the HTTP body, plus what the worker and transcripts read."""

    path: str                       # /chat/completions or /completions
    body: Dict[str, Any]
    max_tokens: int
    sampling: SamplingConfig
    stop: Tuple[str, ...] = ()
    session_id: str = ''
    embeddings: None = None          # never: refused by prepare
    prompt_ids: Tuple[int, ...] = ()     # unknown here (the server tokenizes)

    @property
    def prompt_tokens(self) -> int:
        return 0

    @property
    def bound(self) -> bool:
        return True


def _sampling_body(config: SamplingConfig) -> Dict[str, Any]:
    """Return the OpenAI sampling fields (top_k, min_p, repetition_penalty: vLLM extras)."""
    body: Dict[str, Any] = {'temperature': config.temperature}
    if config.top_p != 1.0:
        body['top_p'] = config.top_p
    if config.presence_penalty:
        body['presence_penalty'] = config.presence_penalty
    if config.seed is not None:
        body['seed'] = config.seed
    if config.frequency_penalty:
        body['frequency_penalty'] = config.frequency_penalty
    if config.logit_bias:
        body['logit_bias'] = {str(k): float(v) for k, v in config.logit_bias.items()}
    if config.logprobs or config.top_logprobs:
        raise RemoteUnsupportedError('logprobs cannot be forwarded by the remote backend: '
                                     'ask the remote server directly')
    for name, off in (('top_k', 0), ('min_p', 0.0), ('repetition_penalty', 1.0)):
        if getattr(config, name) != off:
            body[name] = getattr(config, name)
    return body


def _message_body(message: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {'role': message.role, 'content': message.content}
    if message.tool_calls:
        out['tool_calls'] = [_call_body(call) for call in message.tool_calls]
    if message.tool_call_id:
        out['tool_call_id'] = message.tool_call_id
    if message.name:
        out['name'] = message.name
    return out


def _call_body(call: Any) -> Dict[str, Any]:
    """One assistant tool call in OpenAI's shape (a ToolCall, or already an OpenAI dict)."""
    if isinstance(call, dict):
        return call
    return {'id': call.id, 'type': 'function',
            'function': {'name': call.name, 'arguments': call.arguments}}


def _tools_body(request: GenerationRequest) -> Dict[str, Any]:
    if not request.tools:
        return {}
    specs = check_tools(request.tools)
    choice = parse_tool_choice(request.tool_choice, specs)
    body: Dict[str, Any] = {'tools': [spec.to_hf() for spec in specs]}
    body['tool_choice'] = ({'type': 'function', 'function': {'name': choice.name}}
                           if choice.mode == 'named' else choice.mode)
    if not request.parallel_tool_calls:
        body['parallel_tool_calls'] = False
    return body


def _constraint_body(request: GenerationRequest) -> Dict[str, Any]:
    for name in ('grammar', 'regex', 'choices'):
        if getattr(request, name):
            raise RemoteUnsupportedError(f'{name} constraints cannot be forwarded by the remote '
                                         'backend (OpenAI servers take json_schema and tools)')
    if not request.json_schema:
        return {}
    if request.tools and request.tool_choice != 'none':
        raise InvalidRequestError('tools and json_schema cannot be combined: a reply follows '
                                  'one constraint; give only one of them')
    try:
        schema = json.loads(request.json_schema)
    except ValueError as exc:
        raise InvalidSchemaError(f'json_schema is not valid JSON: {exc}') from None
    if not isinstance(schema, dict):
        raise InvalidSchemaError('json_schema must be a JSON object')
    return {'response_format': {'type': 'json_schema',
                                'json_schema': {'name': 'response', 'schema': schema,
                                                'strict': True}}}


def _reasoning_body(request: GenerationRequest) -> Dict[str, Any]:
    body: Dict[str, Any] = {}
    if not request.reasoning:
        body['reasoning_effort'] = 'none'
    if request.reasoning_budget:
        body['reasoning_budget'] = int(request.reasoning_budget)
    return body


class RemoteGeneration:
    """One streaming request: iterate for TokenEvents; `.result` once done; `cancel()`."""

    def __init__(self, client: httpx.Client, model: str, request: RemoteRequest) -> None:
        self._client = client
        self._model = model
        self._request = request
        self._cancelled = threading.Event()
        self._response: Optional[httpx.Response] = None
        self._connection: Any = None      # httpcore's network stream of this request
        self._lock = threading.Lock()
        self.result: Optional[GenerationResult] = None

    def cancel(self) -> None:
        """Stop from any thread: close the HTTP stream (the server sees the client leave).

        Before the response headers there is no response to close (a server may send them
        only with its first token): the connection's socket is shut down instead, which
        ends the blocked read on the generating thread at once.
        """
        self._cancelled.set()
        with self._lock:
            response, connection = self._response, self._connection
        if response is not None:
            response.close()
        _shutdown(connection)

    def _trace(self, name: str, info: Dict[str, Any]) -> None:
        """Keep the request's connection (httpcore trace hook) so cancel() can cut it."""
        if name == 'connection.connect_tcp.complete':
            with self._lock:
                self._connection = info.get('return_value')
            if self._cancelled.is_set():
                _shutdown(self._connection)

    def __iter__(self) -> Iterator[TokenEvent]:
        start = time.perf_counter()
        state = _StreamState()
        reason = StopReason.STOP
        error = ''
        try:
            for event in self._events(state, start):
                yield event
            reason = state.stop_reason
        except RemoteServerError as exc:
            reason, error = StopReason.ERROR, str(exc)
        except (httpx.HTTPError, OSError, ValueError) as exc:
            if self._cancelled.is_set():
                reason = StopReason.CANCELLED
            else:
                reason = StopReason.ERROR
                error = (f'the remote server {self._client.base_url} failed mid-request: '
                         f'{type(exc).__name__}: {exc}')
        finally:
            with self._lock:
                response, self._response = self._response, None
            if response is not None:
                response.close()
        if self._cancelled.is_set() and reason is not StopReason.ERROR:
            reason = StopReason.CANCELLED
        self.result = state.result(reason, error, start)

    def _events(self, state: '_StreamState', start: float) -> Iterator[TokenEvent]:
        if self._cancelled.is_set():
            return
        body = dict(self._request.body, model=self._model, stream=True,
                    stream_options={'include_usage': True})
        request = self._client.build_request('POST', self._request.path, json=body,
                                             extensions={'trace': self._trace})
        response = self._client.send(request, stream=True)
        with self._lock:
            self._response = response
        if self._cancelled.is_set():
            return
        if response.status_code != 200:
            response.read()
            raise RemoteServerError(f'the remote server answered {response.status_code}: '
                                    f'{_error_text(response)}')
        chat = self._request.path.endswith('chat/completions')
        for line in response.iter_lines():
            if not line.startswith('data:'):
                continue
            data = line[5:].strip()
            if data == '[DONE]':
                break
            chunk = json.loads(data)
            if 'error' in chunk:
                raise RemoteServerError(f'the remote server failed mid-stream: '
                                        f'{chunk["error"].get("message", chunk["error"])}')
            event = state.take(chunk, chat, time.perf_counter() - start)
            if event is not None:
                yield event


@dataclass
class _StreamState:
    """What the chunks said so far: text, reasoning, tool calls, usage, finish reason."""

    text: List[str] = field(default_factory=list)
    reasoning: List[str] = field(default_factory=list)
    calls: Dict[int, Dict[str, str]] = field(default_factory=dict)
    count: int = 0
    prompt_tokens: int = 0
    first_at: float = 0.0
    finish: str = ''

    def take(self, chunk: Dict[str, Any], chat: bool, elapsed: float) -> Optional[TokenEvent]:
        usage = chunk.get('usage') or {}
        self.prompt_tokens = int(usage.get('prompt_tokens') or self.prompt_tokens)
        choices = chunk.get('choices') or []
        if not choices:
            return None
        choice = choices[0]
        self.finish = choice.get('finish_reason') or self.finish
        if chat:
            delta = choice.get('delta') or {}
            text = delta.get('content') or ''
            reasoning = delta.get('reasoning_content') or delta.get('reasoning') or ''
            calls = tuple(self._call_delta(c) for c in delta.get('tool_calls') or ())
        else:
            text, reasoning, calls = choice.get('text') or '', '', ()
        if not (text or reasoning or calls):
            return None
        if not self.count:
            self.first_at = elapsed
        self.text.append(text)
        self.reasoning.append(reasoning)
        self.count += 1
        return TokenEvent(token_id=REMOTE_TOKEN_ID, text_delta=text, index=self.count - 1,
                          elapsed_s=elapsed, reasoning_delta=reasoning,
                          tool_call_deltas=calls)

    def _call_delta(self, raw: Dict[str, Any]) -> ToolCallDelta:
        index = int(raw.get('index', 0))
        function = raw.get('function') or {}
        call = self.calls.setdefault(index, {'id': '', 'name': '', 'arguments': ''})
        call['id'] = call['id'] or raw.get('id') or ''
        call['name'] += function.get('name') or ''
        call['arguments'] += function.get('arguments') or ''
        return ToolCallDelta(index, id=raw.get('id') or '', name=function.get('name') or '',
                             arguments=function.get('arguments') or '')

    @property
    def stop_reason(self) -> StopReason:
        if self.finish == 'tool_calls':
            return StopReason.TOOL_CALLS
        return _STOP_REASONS.get(self.finish, StopReason.STOP)

    def result(self, reason: StopReason, error: str, start: float) -> GenerationResult:
        total = time.perf_counter() - start
        decode = total - self.first_at
        timings = Timings(time_to_first_token_s=self.first_at, total_s=total,
                          decode_tokens_per_second=(self.count - 1) / decode
                          if self.count > 1 and decode > 0 else 0.0)
        calls = [ToolCall(c['id'], c['name'], c['arguments'])
                 for _, c in sorted(self.calls.items())]
        return GenerationResult(text=''.join(self.text), token_ids=[REMOTE_TOKEN_ID] * self.count,
                                stop_reason=reason, prompt_tokens=self.prompt_tokens,
                                completion_tokens=self.count, timings=timings, error=error,
                                reasoning=''.join(self.reasoning), tool_calls=calls)


def _shutdown(connection: Any) -> None:
    """Shut a connection's socket down so a read blocked on it returns (any thread)."""
    sock = connection.get_extra_info('socket') if connection is not None else None
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass    # already closed


def _error_text(response: httpx.Response) -> str:
    try:
        error = response.json().get('error')
        if isinstance(error, dict) and error.get('message'):
            return str(error['message'])
    except (ValueError, AttributeError):
        pass
    return response.text[:500]


class RemoteEngine:
    """The engine interface (see the issue 13 contract) over an OpenAI-compatible server."""

    providers: Tuple[str, ...] = ('remote',)
    vocab_size = 0
    info = None
    family = None

    def __init__(self, config: RemoteConfig) -> None:
        if not config.url:
            raise ModelLoadError('engine.backend is remote but remote.url is empty: set it to '
                                 "the server's OpenAI base URL, e.g. http://host:8000/v1")
        self.config = config
        headers = {}
        if config.api_key_env:
            key = os.environ.get(config.api_key_env, '')
            if not key:
                raise ModelLoadError(f'remote.api_key_env names {config.api_key_env}, which is '
                                     'not set in the environment of llm_node')
            headers['Authorization'] = f'Bearer {key}'
        # One connection per request (no keep-alive): each is traced, so cancel() can cut it.
        self._client = httpx.Client(base_url=config.url.rstrip('/') + '/', headers=headers,
                                    timeout=httpx.Timeout(config.timeout_s),
                                    limits=httpx.Limits(max_keepalive_connections=0))
        self.model_name = self._resolve_model(config.model)
        self.model_dir = config.url
        self.context_length = config.context_length
        self._active: Optional[RemoteGeneration] = None
        self._lock = threading.Lock()

    def _resolve_model(self, wanted: str) -> str:
        """Check the server answers and serves the model (a failure fails configure)."""
        try:
            response = self._client.get('models')
        except httpx.HTTPError as exc:
            self._client.close()
            raise ModelLoadError(f'the remote server {self.config.url} is unreachable '
                                 f'({type(exc).__name__}: {exc}): check remote.url and that '
                                 'the server runs') from None
        if response.status_code != 200:
            self._client.close()
            raise ModelLoadError(f'the remote server {self.config.url} answered '
                                 f'{response.status_code} to /models: {_error_text(response)}')
        served = [str(m.get('id')) for m in response.json().get('data', [])]
        if wanted and wanted not in served:
            self._client.close()
            raise ModelLoadError(f'the remote server does not serve remote.model {wanted!r}; '
                                 f'it serves: {", ".join(served) or "nothing"}')
        if not served and not wanted:
            self._client.close()
            raise ModelLoadError(f'the remote server {self.config.url} lists no models: set '
                                 'remote.model')
        return wanted or served[0]

    # --- requests ----------------------------------------------------------------------------
    def prepare(self, request: GenerationRequest) -> RemoteRequest:
        """Check the request and build its HTTP body; InvalidRequestError says what to fix."""
        if not isinstance(request, GenerationRequest):
            raise InvalidRequestError(f'expected a GenerationRequest, got '
                                      f'{type(request).__name__}')
        if not request.prompt and not request.messages:
            raise InvalidRequestError('the request is empty: give a prompt or messages')
        if request.prefix_embeddings is not None:
            raise RemoteUnsupportedError('prefix_embeddings cannot be sent to a remote backend: '
                                         'run the vision pipeline with a local llm_node')
        if getattr(request, 'images', ()):
            raise RemoteUnsupportedError('images cannot be sent to a remote backend here: '
                                         'serve a converted VLM with a local llm_node')
        max_tokens = request.max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidRequestError(f'max_tokens must be an integer >= 1, got {max_tokens!r}')
        if max_tokens >= self.context_length:
            raise ContextOverflowError(f'max_tokens {max_tokens} leaves no room for the prompt '
                                       f'in the context of {self.context_length} tokens '
                                       '(remote.context_length): lower it')
        sampling_mod.validate(request.sampling)
        stop = tuple(request.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise InvalidRequestError('stop strings must be non-empty text')
        body: Dict[str, Any] = {'max_tokens': max_tokens, **_sampling_body(request.sampling)}
        if stop:
            body['stop'] = list(stop)
        if request.use_chat_template:
            path = 'chat/completions'
            body['messages'] = [_message_body(m) for m in conversation(request)]
            body.update(_tools_body(request))
            body.update(_reasoning_body(request))
            body.update(_constraint_body(request))
        else:
            path = 'completions'
            body['prompt'] = request.prompt
            if request.json_schema or request.tools:
                raise RemoteUnsupportedError('a raw prompt (no chat template) takes no '
                                             'json_schema or tools on the remote backend')
        return RemoteRequest(path=path, body=body, max_tokens=max_tokens,
                             sampling=request.sampling, stop=stop,
                             session_id=request.session_id)

    def generate(self, request: Any) -> RemoteGeneration:
        """Return the streaming generation of a prepared (or plain) request."""
        prepared = request if isinstance(request, RemoteRequest) else self.prepare(request)
        with self._lock:
            if self._client.is_closed:
                raise EngineError('this remote engine was closed: create a new one')
            generation = RemoteGeneration(self._client, self.model_name, prepared)
            self._active = generation
        return generation

    # --- what a remote model cannot do here ----------------------------------------------------
    def _no_tokenizer(self, what: str) -> RemoteUnsupportedError:
        return RemoteUnsupportedError(f'{what} is not available with engine.backend remote: '
                                      'the tokenizer is on the remote server')

    def tokenize(self, text: str = '', messages: Sequence[Any] = (),
                 add_generation_prompt: bool = True) -> List[int]:
        raise self._no_tokenizer('tokenize')

    def token_strings(self, ids: Sequence[int]) -> List[str]:
        raise self._no_tokenizer('token_strings')

    def detokenize(self, ids: Sequence[int]) -> str:
        raise self._no_tokenizer('detokenize')

    # --- state -------------------------------------------------------------------------------
    def kv_occupancy(self) -> Tuple[int, int]:
        return (0, 0)    # the KV cache is the server's

    def saved_sessions(self) -> List[str]:
        return []

    def reset_cache(self, sessions: bool = True) -> None:
        """Nothing to drop (see reset_sessions)."""

    def model_info(self) -> Dict[str, Any]:
        """Describe the remote model for the get_model_info service (what is known here)."""
        return {'model_name': self.model_name, 'gguf_name': '', 'model_dir': self.model_dir,
                'architecture': 'remote', 'quantization': '',
                'context_length': self.context_length, 'vocab_size': 0,
                'providers': list(self.providers), 'chat_template': '', 'family': '',
                'tool_call_format': 'openai',
                'capabilities': {'tools': True, 'reasoning': True,
                                 'reasoning_can_disable': True, 'embeddings_input': False,
                                 'vision': False}}

    def reset_sessions(self, session_id: str = '') -> int:
        """Drop nothing: the remote server keeps no per-session state for us (0 dropped)."""
        return 0

    def close(self) -> None:
        with self._lock:
            active, self._active = self._active, None
        if active is not None:
            active.cancel()
        self._client.close()
