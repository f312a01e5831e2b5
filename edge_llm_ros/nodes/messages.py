"""Translation between edge_llm_msgs messages and the engine's plain types.

The request side applies the node's defaults: a SamplingParams field left at its UNSET
value takes the node's ~/sampling.* parameter, max_tokens 0 takes ~/max_tokens and an empty
system_prompt takes ~/system_prompt. Everything else is passed through unchanged: this module
only translates, and Engine.prepare is the one place that checks values (NaN, negative seeds,
ranges, tools, grammars). What cannot be translated at all (logit_bias arrays of different
lengths, an unknown reasoning_mode) raises InvalidRequestError here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import (AdapterUse, ChatMessage as ChatMessageMsg, SamplingParams,
                               Timings as TimingsMsg, TokenLogprob as TokenLogprobMsg,
                               ToolCall as ToolCallMsg, ToolCallDelta as ToolCallDeltaMsg,
                               Transcript)
from edge_llm_ros.errors import InvalidRequestError
from edge_llm_ros.runtime.media import DeclaredImage, VideoClip
from edge_llm_ros.runtime.tools.spec import ToolCall
from edge_llm_ros.runtime.types import (ChatMessage, DeclaredEmbeddings, GenerationRequest,
                                        GenerationResult, SamplingConfig, StopReason, Timings)
from edge_llm_ros.serving.goal import CancelReason

Goal = Generate.Goal
Result = Generate.Result
# ROS 2 strings end at U+0000 (rosidl strings are C strings on the wire), so a model's NUL (a
# byte token) would cut a text field there and the streamed deltas would no longer add up to
# the result. Text fields carry U+FFFD in its place (what a decoder shows for bytes it cannot
# show); token_ids keep the exact output.
NUL_REPLACEMENT = '\ufffd'
# Generate.Goal.reasoning_mode -> GenerationRequest.reasoning (True = as the template does).
_REASONING = {Goal.REASONING_DEFAULT: True, Goal.REASONING_ON: True, Goal.REASONING_OFF: False}


@dataclass(frozen=True)
class RequestDefaults:
    """Node-wide values a request falls back to."""

    sampling: SamplingConfig = SamplingConfig()
    max_tokens: int = 256
    system_prompt: str = ''


def ros_string(text: str) -> str:
    """Return `text` with each U+0000 replaced by NUL_REPLACEMENT (see above)."""
    return text.replace('\x00', NUL_REPLACEMENT) if '\x00' in text else text


def effective_sampling(msg: SamplingParams, defaults: SamplingConfig) -> SamplingConfig:
    """Return the sampling after the node defaults replaced UNSET fields."""
    def pick(value, unset, default):
        return default if value == unset else value

    seed = defaults.seed if msg.seed == SamplingParams.UNSET_SEED else int(msg.seed)
    top = int(msg.top_logprobs)
    return SamplingConfig(
        temperature=float(pick(msg.temperature, SamplingParams.UNSET, defaults.temperature)),
        top_k=int(pick(msg.top_k, SamplingParams.UNSET_INT, defaults.top_k)),
        top_p=float(pick(msg.top_p, SamplingParams.UNSET, defaults.top_p)),
        min_p=float(pick(msg.min_p, SamplingParams.UNSET, defaults.min_p)),
        repetition_penalty=float(pick(msg.repetition_penalty, SamplingParams.UNSET,
                                      defaults.repetition_penalty)),
        presence_penalty=float(pick(msg.presence_penalty, SamplingParams.UNSET_PENALTY,
                                    defaults.presence_penalty)),
        frequency_penalty=float(pick(msg.frequency_penalty, SamplingParams.UNSET_PENALTY,
                                     defaults.frequency_penalty)),
        seed=seed,
        logit_bias=logit_bias(msg.logit_bias_token_ids, msg.logit_bias_values),
        # UNSET_INT: no log probabilities; 0..20: the chosen token's and this many more.
        logprobs=top != SamplingParams.UNSET_INT,
        top_logprobs=0 if top == SamplingParams.UNSET_INT else top)


def logit_bias(token_ids: Sequence[int], values: Sequence[float]) -> Optional[Dict[int, float]]:
    """{token id: bias} of SamplingParams' parallel arrays; None when empty."""
    if len(token_ids) != len(values):
        raise InvalidRequestError(
            f'sampling.logit_bias_token_ids has {len(token_ids)} entries but '
            f'logit_bias_values {len(values)}: give one bias per token id')
    bias = {int(t): float(v) for t, v in zip(token_ids, values)}
    if len(bias) != len(token_ids):
        raise InvalidRequestError('sampling.logit_bias_token_ids lists a token id twice: give '
                                  'each token one bias')
    return bias or None


def sampling_to_msg(config: SamplingConfig) -> SamplingParams:
    bias = dict(config.logit_bias or {})
    return SamplingParams(
        temperature=float(config.temperature), top_k=int(config.top_k),
        top_p=float(config.top_p), min_p=float(config.min_p),
        repetition_penalty=float(config.repetition_penalty),
        presence_penalty=float(config.presence_penalty),
        frequency_penalty=float(config.frequency_penalty),
        seed=SamplingParams.UNSET_SEED if config.seed is None else int(config.seed),
        logit_bias_token_ids=[int(t) for t in bias],
        logit_bias_values=[float(v) for v in bias.values()],
        top_logprobs=int(config.top_logprobs) if config.logprobs else SamplingParams.UNSET_INT)


def chat_messages(msgs: Sequence[ChatMessageMsg]) -> tuple:
    return tuple(ChatMessage(role=m.role, content=m.content,
                             tool_calls=tuple(ToolCall(id=c.id, name=c.name,
                                                       arguments=c.arguments)
                                              for c in m.tool_calls),
                             tool_call_id=m.tool_call_id, name=m.name) for m in msgs)


def chat_message_msgs(turns) -> List[ChatMessageMsg]:
    """Return the ChatMessage messages of engine turns (runtime.types.ChatMessage)."""
    return [ChatMessageMsg(role=t.role, content=ros_string(t.content), tool_calls=tool_call_msgs(
        t.tool_calls), tool_call_id=t.tool_call_id, name=t.name) for t in turns]


def tool_dicts(tools) -> tuple:
    """Return OpenAI tool entries of ToolSpec messages (parameters stay JSON text)."""
    return tuple({'type': 'function',
                  'function': {'name': t.name, 'description': t.description,
                               'parameters': t.parameters}} for t in tools)


def reasoning_switch(mode: int) -> bool:
    if mode not in _REASONING:
        raise InvalidRequestError(
            f'reasoning_mode {mode} is not one of REASONING_DEFAULT (0), REASONING_ON (1), '
            'REASONING_OFF (2)')
    return _REASONING[mode]


def queue_order(request) -> Tuple[int, bool]:
    """(priority, preempt) of a Generate goal; a Complete request runs at (0, False).

    The priority's range is checked where the goal is built (serving.goal.check_priority).
    """
    if not isinstance(request, Goal):   # ~/complete has no queue-order fields
        return 0, False
    return int(request.priority), bool(request.preempt)


def to_request(goal, defaults: RequestDefaults,
               prefix_embeddings: Optional[DeclaredEmbeddings] = None,
               images: Sequence[DeclaredImage] = ()) -> GenerationRequest:
    """Build the engine request of a Generate goal or a Complete request (no checks).

    `images`: the goal's images handles described (nodes/embeddings.py). A raw_prompt goal
    takes no system prompt from the node's default (only its own, which the engine refuses).
    """
    raw = bool(getattr(goal, 'raw_prompt', False))   # Generate goals only
    return GenerationRequest(
        prompt=goal.prompt,
        messages=chat_messages(goal.messages),
        system_prompt=goal.system_prompt if raw else (goal.system_prompt or
                                                      defaults.system_prompt),
        use_chat_template=not raw,
        images=tuple(images),
        sampling=effective_sampling(goal.sampling, defaults.sampling),
        max_tokens=int(goal.max_tokens) or defaults.max_tokens,
        stop=tuple(goal.stop),
        json_schema=goal.json_schema,
        prefix_embeddings=prefix_embeddings,
        session_id=goal.session_id,
        history_mode=int(goal.history_mode),
        tools=tool_dicts(goal.tools),
        tool_choice=goal.tool_choice,
        parallel_tool_calls=not goal.no_parallel_tool_calls,
        grammar=goal.grammar,
        regex=goal.regex,
        choices=tuple(goal.choices),
        reasoning=reasoning_switch(goal.reasoning_mode),
        reasoning_budget=(None if goal.reasoning_budget == Goal.REASONING_BUDGET_NONE
                          else int(goal.reasoning_budget)),
        # Generate goals only (a Complete request has no such field: it may speculate).
        speculative=not getattr(goal, 'no_speculation', False),
        # Generate goals only; 0: the node's vision.max_image_tokens (EngineConfig's).
        max_image_tokens=int(getattr(goal, 'max_image_tokens', 0)),
        lora=lora_scales(getattr(goal, 'lora', ())))


def goal_media(goal, declared: Sequence) -> Tuple:
    """Return a goal's images, then its clip (runtime.media.VideoClip), from declared frames.

    declared: the goal's `images` handles described, then its `video_frames` (in that order,
    as nodes/embeddings.py describes them together); the clip takes the marker after the
    images' ones. No clip without video_frames.
    """
    n = len(getattr(goal, 'images', ()))
    if not getattr(goal, 'video_frames', ()):
        return tuple(declared)
    return (*declared[:n], VideoClip(tuple(declared[n:]),
                                     tuple(float(t) for t in goal.video_timestamps),
                                     float(goal.video_fps)))


def lora_scales(entries) -> Dict[str, float]:
    """Return a goal's LoraScale entries as name -> scale (a repeated name is refused)."""
    out: Dict[str, float] = {}
    for entry in entries:
        if entry.name in out:
            raise InvalidRequestError(f'the goal names adapter {entry.name!r} twice in lora: '
                                      'give each adapter once, with its scale')
        out[entry.name] = float(entry.scale)
    return out


def timings_to_msg(timings: Timings) -> TimingsMsg:
    return TimingsMsg(
        queue_wait_s=float(timings.queue_wait_s),
        time_to_first_token_s=float(timings.time_to_first_token_s),
        prefill_tokens=int(timings.prefill_tokens),
        cached_prompt_tokens=int(timings.cached_prompt_tokens),
        prefill_tokens_per_second=float(timings.prefill_tokens_per_second),
        decode_tokens_per_second=float(timings.decode_tokens_per_second),
        total_s=float(timings.total_s),
        draft_passes=int(timings.draft_passes), draft_tokens=int(timings.draft_tokens),
        accepted_draft_tokens=int(timings.accepted_draft_tokens),
        decode_steps=int(timings.decode_steps))


def tool_call_msgs(calls) -> List[ToolCallMsg]:
    return [ToolCallMsg(id=c.id, name=ros_string(c.name), arguments=ros_string(c.arguments))
            for c in calls]


def tool_call_delta_msgs(deltas) -> List[ToolCallDeltaMsg]:
    return [ToolCallDeltaMsg(index=int(d.index), id=d.id, name=ros_string(d.name),
                             arguments_delta=ros_string(d.arguments)) for d in deltas]


TokenStrings = Callable[[Sequence[int]], Sequence[str]]


def logprob_msgs(logprobs, token_strings: Optional[TokenStrings] = None
                 ) -> List[TokenLogprobMsg]:
    """Return TokenLogprob messages of engine TokenLogprobs (token texts: `token_strings`)."""
    out = []
    for item in logprobs:
        top_ids = [int(t) for t, _ in item.top]
        msg = TokenLogprobMsg(token_id=int(item.token_id), logprob=float(item.logprob),
                              top_token_ids=top_ids,
                              top_logprobs=[float(p) for _, p in item.top])
        if token_strings is not None:
            names = list(token_strings([int(item.token_id)] + top_ids))
            msg.token, msg.top_tokens = names[0], names[1:]
        out.append(msg)
    return out


def error_kind(result: GenerationResult, known: str = '', stopped: bool = False,
               refused: bool = False) -> str:
    """Generate.Result.ERROR_* of an ended request ('' unless it failed or was stopped).

    `known`: the kind decided where the request failed (e.g. invalid at admission);
    `stopped`: the node deactivated or shut down while it waited or ran; `refused`: the
    engine found the request invalid when it started (Goal.refused).
    """
    if known:
        return known
    if result.stop_reason is StopReason.ERROR and refused:
        return Result.ERROR_INVALID_REQUEST
    if result.stop_reason is StopReason.ERROR:
        return Result.ERROR_UNAVAILABLE if stopped else Result.ERROR_FAILED
    if result.stop_reason is StopReason.CANCELLED and stopped:
        return Result.ERROR_UNAVAILABLE
    return ''


def stopped_kind(reason: CancelReason) -> str:
    """Generate.Result.ERROR_* of a goal the node cancelled for `reason` ('' for none)."""
    return Result.ERROR_MODEL_UPDATE if reason is CancelReason.MODEL_UPDATE else ''


def fill_result(msg, result: GenerationResult, error_message: Optional[str] = None,
                token_strings: Optional[TokenStrings] = None, kind: str = ''):
    """Copy an engine result into a Generate.Result or Complete.Response; return `msg`.

    `token_strings` (Engine.token_strings) names the tokens of the logprobs; `kind` is the
    error_kind (see error_kind).
    """
    msg.error_kind = kind
    msg.text = ros_string(result.text)
    msg.token_ids = [int(t) for t in result.token_ids]
    msg.finish_reason = result.stop_reason.value
    msg.prompt_tokens = int(result.prompt_tokens)
    msg.completion_tokens = int(result.completion_tokens)
    msg.timings = timings_to_msg(result.timings)
    msg.error_message = result.error if error_message is None else error_message
    msg.tool_calls = tool_call_msgs(result.tool_calls)
    msg.reasoning = ros_string(result.reasoning)
    msg.logprobs = logprob_msgs(result.logprobs, token_strings)
    msg.dropped_turns = int(result.dropped_turns)
    return msg


REQUEST_FIELDS = ('prompt', 'messages', 'system_prompt', 'sampling', 'max_tokens', 'stop',
                  'json_schema', 'prefix_embeddings', 'session_id', 'history_mode', 'tools',
                  'tool_choice', 'no_parallel_tool_calls', 'grammar', 'regex', 'choices',
                  'reasoning_mode', 'reasoning_budget')
# Generate goals only (a ~/complete record keeps 0 / false).
GOAL_ONLY_FIELDS = ('priority', 'preempt', 'no_speculation', 'images', 'raw_prompt',
                    'max_image_tokens', 'video_frames', 'video_timestamps', 'video_fps',
                    'video_window_source', 'video_window_seconds', 'video_window_max_frames')
OUTCOME_FIELDS = ('text', 'token_ids', 'finish_reason', 'prompt_tokens', 'completion_tokens',
                  'timings', 'tool_calls', 'reasoning', 'logprobs', 'dropped_turns')


def adapter_uses(lora_set) -> List[AdapterUse]:
    """Return an adapter set's ((name@digest, scale) each: PreparedRequest.lora_set) messages."""
    uses = []
    for key, scale in lora_set:
        name, _, digest = str(key).rpartition('@')
        uses.append(AdapterUse(name=name, scale=float(scale), digest=digest))
    return uses


def build_transcript(source: str, goal_id, request_msg, engine_request, outcome_msg,
                     accepted: bool, model: str, accepted_stamp, finished_stamp,
                     error: str = '') -> Transcript:
    """One ~/transcript record: the request as received, effective sampling, outcome.

    `engine_request` is what the engine ran (a PreparedRequest or GenerationRequest: its
    `sampling` is the effective one), or None when the request never became one (refused or
    invalid): the effective sampling is then left at its defaults. `outcome_msg` (a
    Generate.Result or Complete.Response) is None for a refusal.
    """
    msg = Transcript(goal_id=goal_id, source=source, accepted=accepted, model=model,
                     finished_stamp=finished_stamp, error_message=error,
                     interface_version=Transcript.INTERFACE_VERSION)
    if accepted_stamp is not None:
        msg.accepted_stamp = accepted_stamp
    if engine_request is not None:
        msg.effective_sampling = sampling_to_msg(engine_request.sampling)
        session = getattr(engine_request, 'session', None)
        if session is not None:   # the stored turns this goal continued (replay starts there)
            msg.session_turns = chat_message_msgs(session.history)
    for name in REQUEST_FIELDS:
        setattr(msg, name, getattr(request_msg, name))
    if isinstance(request_msg, Goal):
        for name in GOAL_ONLY_FIELDS:
            setattr(msg, name, getattr(request_msg, name))
        # The goal's adapters, each with the digest of the one the node ran (replay checks it)
        digests = {u.name: u.digest for u in adapter_uses(
            getattr(engine_request, 'lora_set', ()) or ())}
        msg.lora = [AdapterUse(name=e.name, scale=e.scale, digest=digests.get(e.name, ''))
                    for e in getattr(request_msg, 'lora', ())]
    if outcome_msg is not None:
        for name in OUTCOME_FIELDS:
            setattr(msg, name, getattr(outcome_msg, name))
        if hasattr(outcome_msg, 'detections'):   # Generate results only
            msg.detections = outcome_msg.detections
    else:
        msg.finish_reason = StopReason.ERROR.value
    return msg
