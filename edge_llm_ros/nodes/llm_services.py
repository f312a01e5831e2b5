"""llm_node's small services: ~/tokenize, ~/detokenize, ~/get_model_info and the sessions'.

~/get_session and ~/list_sessions describe the conversations the node keeps (turns, tokens,
KV bytes); ~/reset_session forgets one (or all). ~/warm_prompt adds a warm prompt (a system
prompt prefilled and pinned in the prefix cache, as kv.warm_prompts does at configure).

Each answers from the loaded engine without the queue (never behind a generation):
tokenizing, detokenizing and model info only read the tokenizer and the model's description;
reset_session drops KV prefixes and warm_prompt prefills through
EngineWorker.run_between_jobs, so a running generation is never disturbed (they happen
right after it, before the next goal).
`engine` is None while the node is unconfigured: the answer then says so. A service always
answers: an unexpected exception is logged and answered (GenerateServer.refusal).
"""
from __future__ import annotations

from typing import Any, Optional

from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup

from edge_llm_msgs.action import Generate
from edge_llm_msgs.srv import (Detokenize, GetModelInfo, GetSession, ListSessions, ResetSession,
                               Tokenize, WarmPrompt)
from edge_llm_ros.errors import EngineError
from edge_llm_ros.nodes.messages import adapter_uses, chat_message_msgs, ros_string
from edge_llm_ros.runtime.types import ChatMessage
from edge_llm_ros.serving.worker import EngineWorker, WorkerStoppedError

# How long ~/reset_session waits for a running generation before answering "scheduled".
RESET_WAIT_S = 10.0
# How long ~/warm_prompt waits for a running generation (and its own prefill) to answer.
WARM_WAIT_S = 120.0


def detokenize(engine: Any, request: Detokenize.Request, response: Detokenize.Response,
               unloaded: str) -> Detokenize.Response:
    """Fill `response` with the text of the request's ids (`unloaded`: why no engine)."""
    if engine is None:
        response.success, response.error_message = False, unloaded
        return response
    try:
        response.text = ros_string(engine.detokenize([int(t) for t in request.token_ids]))
    except EngineError as exc:     # an id outside the vocabulary
        response.success, response.error_message = False, str(exc)
        return response
    response.success = True
    return response


def model_info(engine: Any, response: GetModelInfo.Response,
               unloaded: str) -> GetModelInfo.Response:
    """Fill `response` with what the engine reports (a remote engine may report less)."""
    response.interface_version = Generate.Goal.INTERFACE_VERSION
    if engine is None:
        response.success, response.loaded, response.error_message = True, False, unloaded
        return response
    info = engine.model_info()
    caps = info.get('capabilities', {})
    for name in ('model_name', 'gguf_name', 'model_dir', 'architecture', 'quantization',
                 'family', 'chat_template', 'tool_call_format', 'kernel'):
        setattr(response, name, str(info.get(name) or ''))
    response.context_length = int(info.get('context_length') or 0)
    response.vocab_size = int(info.get('vocab_size') or 0)
    response.providers = [str(p) for p in info.get('providers', ())]
    response.supports_tools = bool(caps.get('tools'))
    response.supports_reasoning = bool(caps.get('reasoning'))
    response.supports_embeddings_input = bool(caps.get('embeddings_input'))
    warm = info.get('warm_prompts', ())
    # A prompt whose stored state could not be used says so beside its label (the status:
    # 're-prefilled: StoredWarmStateError: ...'), so an operator sees why it was prefilled.
    response.warm_prompts = [str(w['label']) + (f" ({w['status']})" if str(
        w.get('status', '')).startswith('re-prefilled') else '') for w in warm]
    response.warm_prompt_tokens = [int(w['tokens']) for w in warm]
    response.warm_prompt_bytes = [int(w['bytes']) for w in warm]
    family = getattr(engine, 'family', None)
    reasoning = getattr(family, 'reasoning', None)
    if reasoning is not None:
        response.reasoning_start = reasoning.open_tag
        response.reasoning_end = reasoning.close_tag
    response.success = response.loaded = True
    return response


def reset_session(worker: Optional[EngineWorker], request: ResetSession.Request,
                  response: ResetSession.Response, unloaded: str,
                  wait_s: float = RESET_WAIT_S) -> ResetSession.Response:
    """Drop one session's KV prefix ('' = all) between generations; fill `response`."""
    which = f'session {request.session_id!r}' if request.session_id else 'every session'
    if worker is None:
        response.success, response.message = False, unloaded
        return response
    try:
        response.dropped = int(worker.run_between_jobs(
            lambda engine: engine.reset_sessions(request.session_id), wait_s) or 0)
    except TimeoutError:
        response.success = True
        response.message = (f'{which}: a generation is still running; the KV is dropped as '
                            'soon as it ends, before the next goal')
        return response
    except (EngineError, WorkerStoppedError) as exc:
        response.success, response.message = False, str(exc)
        return response
    response.success = True
    response.message = f'{which}: dropped {response.dropped} kept prefix(es)'
    return response


def warm_prompt(worker: Optional[EngineWorker], request: WarmPrompt.Request,
                response: WarmPrompt.Response, unloaded: str,
                wait_s: float = WARM_WAIT_S) -> WarmPrompt.Response:
    """Prefill and pin one more warm prompt between generations; fill `response`."""
    if worker is None:
        response.success, response.message = False, unloaded
        return response
    if not hasattr(worker.engine, 'add_warm_prompt'):
        response.success = False
        response.message = ('this node forwards goals to a remote server (engine.backend '
                            'remote): warm prompts belong to that server')
        return response
    try:
        prompt = worker.run_between_jobs(
            lambda engine: engine.add_warm_prompt(request.text, request.path), wait_s)
    except TimeoutError:
        response.success = True
        response.message = ('a generation is still running; the warm prompt is added as soon '
                            'as it ends (~/get_model_info lists it then)')
        return response
    except (EngineError, WorkerStoppedError) as exc:   # WarmPromptError says what to change
        response.success, response.message = False, str(exc)
        return response
    response.success = True
    response.tokens, response.bytes = prompt.tokens, prompt.nbytes
    response.message = (f'warm prompt {prompt.label!r}: {prompt.tokens} tokens pinned '
                        f'({prompt.nbytes} bytes)')
    return response


def _keeps_sessions(engine: Any, response, unloaded: str) -> bool:
    """Whether `engine` keeps sessions here; else fill `response` with why not."""
    if engine is None:
        response.success, response.message = False, unloaded
        return False
    if not hasattr(engine, 'session'):
        response.success = False
        response.message = ('this node forwards goals to a remote server (engine.backend '
                            'remote), which keeps its own sessions: ask it')
        return False
    return True


def get_session(engine: Any, request: GetSession.Request, response: GetSession.Response,
                unloaded: str) -> GetSession.Response:
    """Fill `response` with one session's turns, token count and KV bytes."""
    if not _keeps_sessions(engine, response, unloaded):
        return response
    info = engine.session(request.session_id)
    response.success = True
    if info is None:
        response.found = False
        response.message = (f'no session {request.session_id!r} is kept (never used, reset or '
                            'evicted): its next goal starts a new conversation')
        return response
    response.found = True
    response.system_prompt = info.conversation.system
    response.turns = chat_message_msgs(info.conversation.turns)
    response.token_count = len(info.conversation.ids)
    response.kv_bytes = int(info.kv_bytes)
    response.lora = adapter_uses(info.conversation.lora)
    return response


def list_sessions(engine: Any, response: ListSessions.Response,
                  unloaded: str) -> ListSessions.Response:
    """Fill `response` with every session kept, least recently used first."""
    if not _keeps_sessions(engine, response, unloaded):
        return response
    infos = engine.sessions()
    response.success = True
    response.session_ids = [i.session_id for i in infos]
    response.turn_counts = [len(i.conversation.turns) for i in infos]
    response.token_counts = [len(i.conversation.ids) for i in infos]
    response.kv_bytes = [int(i.kv_bytes) for i in infos]
    return response


def tokenize(engine: Any, request: Tokenize.Request, response: Tokenize.Response,
             unloaded: str) -> Tokenize.Response:
    """Fill `response` with the ids and token texts of the request's text or messages."""
    if engine is None:
        response.success, response.error_message = False, unloaded
        return response
    try:
        messages = [ChatMessage(m.role, m.content) for m in request.messages]
        ids = engine.tokenize(request.text, messages, request.add_generation_prompt)
        tokens = list(engine.token_strings(ids))
    except (EngineError, ValueError, TypeError) as exc:  # e.g. a template the sandbox refused
        response.success, response.error_message = False, str(exc)
        return response
    response.success = True
    response.token_ids = [int(i) for i in ids]
    response.tokens = tokens
    response.context_length = int(engine.context_length)
    return response


class LLMServices:
    """Registers the small services on an llm_node and answers them."""

    def __init__(self, node: Any) -> None:
        self._node = node
        # The tokenizer is thread-safe and independent of the worker: answered at once.
        self._tokenize_group = MutuallyExclusiveCallbackGroup()
        self._tokenize_srv = node.create_service(Tokenize, '~/tokenize', self.on_tokenize,
                                                 callback_group=self._tokenize_group)
        # Reentrant: a reset waiting for a running generation blocks nothing else.
        self._info_group = ReentrantCallbackGroup()
        self._small = [node.create_service(kind, name, callback,
                                           callback_group=self._info_group)
                       for kind, name, callback in (
                           (Detokenize, '~/detokenize', self.on_detokenize),
                           (GetModelInfo, '~/get_model_info', self.on_get_model_info),
                           (ResetSession, '~/reset_session', self.on_reset_session),
                           (WarmPrompt, '~/warm_prompt', self.on_warm_prompt),
                           (GetSession, '~/get_session', self.on_get_session),
                           (ListSessions, '~/list_sessions', self.on_list_sessions))]

    def _unloaded(self) -> str:
        node = self._node
        return f'{node.get_name()} is {node.lifecycle_state()}: configure it to load the model'

    def _answer(self, what: str, answer, response, error_field: str = 'error_message'):
        try:
            return answer()
        except Exception as exc:  # noqa: B902 - answer, never crash (see refusal)
            response.success = False
            setattr(response, error_field, self._node.admission.refusal(exc, what))
            return response

    def on_tokenize(self, request: Tokenize.Request,
                    response: Tokenize.Response) -> Tokenize.Response:
        return self._answer('~/tokenize', lambda: tokenize(
            self._node.engine, request, response, self._unloaded()), response)

    def on_detokenize(self, request: Detokenize.Request,
                      response: Detokenize.Response) -> Detokenize.Response:
        return self._answer('~/detokenize', lambda: detokenize(
            self._node.engine, request, response, self._unloaded()), response)

    def on_get_model_info(self, request: GetModelInfo.Request,
                          response: GetModelInfo.Response) -> GetModelInfo.Response:
        return self._answer('~/get_model_info', lambda: model_info(
            self._node.engine, response, self._unloaded()), response)

    def on_reset_session(self, request: ResetSession.Request,
                         response: ResetSession.Response) -> ResetSession.Response:
        return self._answer('~/reset_session', lambda: reset_session(
            self._node.worker, request, response, self._unloaded()), response, 'message')

    def on_warm_prompt(self, request: WarmPrompt.Request,
                       response: WarmPrompt.Response) -> WarmPrompt.Response:
        return self._answer('~/warm_prompt', lambda: warm_prompt(
            self._node.worker, request, response, self._unloaded()), response, 'message')

    def on_get_session(self, request: GetSession.Request,
                       response: GetSession.Response) -> GetSession.Response:
        return self._answer('~/get_session', lambda: get_session(
            self._node.engine, request, response, self._unloaded()), response, 'message')

    def on_list_sessions(self, request: ListSessions.Request,
                         response: ListSessions.Response) -> ListSessions.Response:
        return self._answer('~/list_sessions', lambda: list_sessions(
            self._node.engine, response, self._unloaded()), response, 'message')
