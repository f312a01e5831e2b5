"""Translation between edge_llm_msgs messages and the engine's plain types.

The request side applies the node's defaults: a SamplingParams field left at its UNSET
value (and presence_penalty at 0.0, the message default) takes the node's
~/sampling.* parameter, max_tokens 0 takes ~/max_tokens and an empty system_prompt takes
~/system_prompt. Everything else is passed through unchanged: this module only translates,
and Engine.prepare is the one place that checks values (NaN, negative seeds, ranges).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from edge_llm_msgs.msg import ChatMessage as ChatMessageMsg
from edge_llm_msgs.msg import SamplingParams
from edge_llm_msgs.msg import Timings as TimingsMsg
from edge_llm_msgs.msg import Transcript
from edge_llm_ros.engine.types import (ChatMessage, DeclaredEmbeddings, GenerationRequest,
                                       GenerationResult, SamplingConfig, StopReason, Timings)


@dataclass(frozen=True)
class RequestDefaults:
    """Node-wide values a request falls back to."""

    sampling: SamplingConfig = SamplingConfig()
    max_tokens: int = 256
    system_prompt: str = ''


def effective_sampling(msg: SamplingParams, defaults: SamplingConfig) -> SamplingConfig:
    """Return the sampling after the node defaults replaced UNSET fields."""
    def pick(value, unset, default):
        return default if value == unset else value

    seed = defaults.seed if msg.seed == SamplingParams.UNSET_SEED else int(msg.seed)
    return SamplingConfig(
        temperature=float(pick(msg.temperature, SamplingParams.UNSET, defaults.temperature)),
        top_k=int(pick(msg.top_k, SamplingParams.UNSET_INT, defaults.top_k)),
        top_p=float(pick(msg.top_p, SamplingParams.UNSET, defaults.top_p)),
        min_p=float(pick(msg.min_p, SamplingParams.UNSET, defaults.min_p)),
        repetition_penalty=float(pick(msg.repetition_penalty, SamplingParams.UNSET,
                                      defaults.repetition_penalty)),
        # The message default is 0.0 (no UNSET value exists for it): 0.0 = node default.
        presence_penalty=float(msg.presence_penalty or defaults.presence_penalty),
        seed=seed)


def sampling_to_msg(config: SamplingConfig) -> SamplingParams:
    return SamplingParams(
        temperature=float(config.temperature), top_k=int(config.top_k),
        top_p=float(config.top_p), min_p=float(config.min_p),
        repetition_penalty=float(config.repetition_penalty),
        presence_penalty=float(config.presence_penalty),
        seed=SamplingParams.UNSET_SEED if config.seed is None else int(config.seed))


def chat_messages(msgs: Sequence[ChatMessageMsg]) -> tuple:
    return tuple(ChatMessage(role=m.role, content=m.content) for m in msgs)


def to_request(goal, defaults: RequestDefaults,
               prefix_embeddings: Optional[DeclaredEmbeddings] = None) -> GenerationRequest:
    """Build the engine request of a Generate goal or a Complete request (no checks)."""
    return GenerationRequest(
        prompt=goal.prompt,
        messages=chat_messages(goal.messages),
        system_prompt=goal.system_prompt or defaults.system_prompt,
        sampling=effective_sampling(goal.sampling, defaults.sampling),
        max_tokens=int(goal.max_tokens) or defaults.max_tokens,
        stop=tuple(goal.stop),
        json_schema=goal.json_schema,
        prefix_embeddings=prefix_embeddings,
        session_id=goal.session_id)


def timings_to_msg(timings: Timings) -> TimingsMsg:
    return TimingsMsg(
        queue_wait_s=float(timings.queue_wait_s),
        time_to_first_token_s=float(timings.time_to_first_token_s),
        prefill_tokens=int(timings.prefill_tokens),
        cached_prompt_tokens=int(timings.cached_prompt_tokens),
        prefill_tokens_per_second=float(timings.prefill_tokens_per_second),
        decode_tokens_per_second=float(timings.decode_tokens_per_second),
        total_s=float(timings.total_s))


def fill_result(msg, result: GenerationResult, error_message: Optional[str] = None):
    """Copy an engine result into a Generate.Result or Complete.Response; return `msg`."""
    msg.text = result.text
    msg.token_ids = [int(t) for t in result.token_ids]
    msg.finish_reason = result.stop_reason.value
    msg.prompt_tokens = int(result.prompt_tokens)
    msg.completion_tokens = int(result.completion_tokens)
    msg.timings = timings_to_msg(result.timings)
    msg.error_message = result.error if error_message is None else error_message
    return msg


REQUEST_FIELDS = ('prompt', 'messages', 'system_prompt', 'sampling', 'max_tokens', 'stop',
                  'json_schema', 'prefix_embeddings', 'session_id')
OUTCOME_FIELDS = ('text', 'token_ids', 'finish_reason', 'prompt_tokens', 'completion_tokens',
                  'timings')


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
                     finished_stamp=finished_stamp, error_message=error)
    if accepted_stamp is not None:
        msg.accepted_stamp = accepted_stamp
    if engine_request is not None:
        msg.effective_sampling = sampling_to_msg(engine_request.sampling)
    for name in REQUEST_FIELDS:
        setattr(msg, name, getattr(request_msg, name))
    if outcome_msg is not None:
        for name in OUTCOME_FIELDS:
            setattr(msg, name, getattr(outcome_msg, name))
    else:
        msg.finish_reason = StopReason.ERROR.value
    return msg
