"""Plain records of served goals, decoupled from both rclpy and rosbags message classes.

A `TranscriptRecord` mirrors edge_llm_msgs/msg/Transcript. `transcript_from_msg` reads
it from any object with the same attribute names: a message deserialized by rosbags
from a bag (also with the definitions of an older interface version: fields it lacks take
their defaults), or an rclpy message received live. Records of older versions are then
translated to the current semantics in one place, regression.legacy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional
import uuid

from edge_llm_ros.runtime.tools.spec import ToolCall
from edge_llm_ros.runtime.types import ChatMessage, Timings

# SamplingParams sentinels (edge_llm_msgs/msg/SamplingParams.msg).
UNSET_FLOAT = -1.0
UNSET_INT = -1
UNSET_PENALTY = -1000.0
# Transcript.INTERFACE_VERSION of this build; records without the field are version 1.
INTERFACE_VERSION = 9


@dataclass(frozen=True)
class SamplingRecord:
    temperature: float = UNSET_FLOAT
    top_k: int = UNSET_INT
    top_p: float = UNSET_FLOAT
    min_p: float = UNSET_FLOAT
    repetition_penalty: float = UNSET_FLOAT
    presence_penalty: float = UNSET_PENALTY
    seed: int = UNSET_INT
    frequency_penalty: float = UNSET_PENALTY
    logit_bias_token_ids: tuple = ()
    logit_bias_values: tuple = ()
    top_logprobs: int = UNSET_INT

    def is_unset(self) -> bool:
        """Whether every field still holds the node-default sentinel."""
        return self == SamplingRecord()


@dataclass(frozen=True)
class AdapterUseRecord:
    """A LoRA adapter a goal used (edge_llm_msgs/msg/AdapterUse)."""

    name: str
    scale: float = 1.0
    digest: str = ''   # the adapter's content digest as the recording node held it


# The engine's own plain types have exactly the message's fields: reuse them.
TimingsRecord = Timings
ChatRecord = ChatMessage      # tool_calls hold ToolCall
ToolCallRecord = ToolCall


@dataclass(frozen=True)
class ToolSpecRecord:
    name: str
    description: str = ''
    parameters: str = ''      # JSON Schema text, as in the message


@dataclass(frozen=True)
class TokenLogprobRecord:
    token_id: int
    token: str
    logprob: float
    top_token_ids: tuple = ()
    top_tokens: tuple = ()
    top_logprobs: tuple = ()


@dataclass(frozen=True)
class TensorHandleRecord:
    pool_id: str
    slot: int
    generation: int
    sequence: int
    buffer_kind: int
    dtype: str
    shape: tuple
    strides: tuple
    byte_offset: int
    nbytes: int
    frame_id: str = ''
    stamp_ns: int = 0

    def describe(self) -> str:
        """Short human-readable identity of the handle."""
        return (f"pool '{self.pool_id}' slot {self.slot} generation {self.generation} "
                f'({self.dtype} {list(self.shape)})')


@dataclass
class TranscriptRecord:
    """One served request and its outcome (edge_llm_msgs/msg/Transcript)."""

    goal_id: str                       # hex of the 16-byte goal UUID
    source: str = 'action'
    interface_version: int = INTERFACE_VERSION
    accepted_stamp_ns: int = 0
    finished_stamp_ns: int = 0
    model: str = ''
    effective_sampling: SamplingRecord = field(default_factory=SamplingRecord)
    prompt: str = ''
    messages: list = field(default_factory=list)           # ChatRecord
    system_prompt: str = ''
    sampling: SamplingRecord = field(default_factory=SamplingRecord)
    max_tokens: int = 0
    stop: list = field(default_factory=list)               # str
    json_schema: str = ''
    prefix_embeddings: list = field(default_factory=list)  # TensorHandleRecord
    session_id: str = ''
    tools: list = field(default_factory=list)              # ToolSpecRecord
    tool_choice: str = ''
    no_parallel_tool_calls: bool = False
    grammar: str = ''
    regex: str = ''
    choices: list = field(default_factory=list)            # str
    reasoning_mode: int = 0
    reasoning_budget: int = -1
    priority: int = 0                  # version 3; older records: 0 (normal)
    preempt: bool = False              # version 3; older records: false
    history_mode: int = 0              # version 4: Generate.Goal.HISTORY_*
    session_turns: list = field(default_factory=list)   # version 4: ChatRecord, see replay
    no_speculation: bool = False       # version 5: Generate.Goal.no_speculation
    images: list = field(default_factory=list)   # version 6: TensorHandleRecord per image
    raw_prompt: bool = False           # version 6: prompt fed without the chat template
    max_image_tokens: int = 0          # version 7: one image's token cap; 0 = node default
    video_frames: list = field(default_factory=list)   # version 8: TensorHandleRecord each
    video_timestamps: list = field(default_factory=list)   # version 8: seconds per frame
    video_fps: float = 0.0             # version 8: the clip's sampling rate (0: not said)
    # Version 9: the perception node whose time window gave the clip above ('' : none).
    video_window_source: str = ''
    video_window_seconds: float = 0.0  # version 9: the window's length (s)
    video_window_max_frames: int = 0   # version 9: its frame cap (0: llm_node's)
    lora: list = field(default_factory=list)   # version 8: AdapterUseRecord per adapter
    accepted: bool = False
    text: str = ''
    token_ids: list = field(default_factory=list)          # int
    finish_reason: str = ''
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: TimingsRecord = field(default_factory=TimingsRecord)
    error_message: str = ''
    tool_calls: list = field(default_factory=list)         # ToolCallRecord
    reasoning: str = ''
    logprobs: list = field(default_factory=list)           # TokenLogprobRecord
    dropped_turns: int = 0             # version 4
    # Where it came from: bag receive time and topic (not part of the message).
    bag_stamp_ns: int = 0
    topic: str = ''

    def effective_temperature(self) -> Optional[float]:
        """Temperature after node defaults; None when neither side says.

        The node's effective sampling is authoritative; a transcript without it (all
        UNSET) falls back to the request's own temperature when that was set.
        """
        if self.effective_sampling.temperature >= 0.0:
            return float(self.effective_sampling.temperature)
        if self.sampling.temperature >= 0.0:
            return float(self.sampling.temperature)
        return None

    @property
    def tensor_handles(self) -> list:
        """Every tensor handle the request carried (prefix embeddings, images, clip frames)."""
        return list(self.prefix_embeddings) + list(self.images) + list(self.video_frames)

    def label(self, width: int = 48) -> str:
        """Return a one-line excerpt of the request for tables."""
        if self.prompt:
            text = self.prompt
        elif self.messages:
            text = self.messages[-1].content
        else:
            text = ''
        text = ' '.join(text.split())
        return text if len(text) <= width else text[:width - 1] + '\u2026'


def adapter_problem(record: TranscriptRecord, held: Dict[str, str]) -> str:
    """Say why `record` cannot be replayed on a node holding `held` (name -> digest), or ''.

    A goal that used a LoRA adapter the node has not loaded, or holds under that name with
    other content (another digest), would not run what was recorded: replay refuses it.
    """
    for use in record.lora:
        if use.name not in held:
            return (f'the goal used LoRA adapter {use.name!r} (digest {use.digest or "?"}), '
                    'which the node has not loaded: load it (~/load_adapter or lora.adapters) '
                    'and replay again')
        if use.digest and held[use.name] != use.digest:
            return (f'the goal used LoRA adapter {use.name!r} with digest {use.digest}, but the '
                    f"node's {use.name!r} has digest {held[use.name]}: load the recorded "
                    'adapter under that name and replay again')
    return ''


def uuid_hex(raw: Any) -> str:
    """Hex string of a unique_identifier_msgs/UUID's 16 bytes (any sequence of ints)."""
    return bytes(int(b) for b in raw).hex()


def uuid_bytes(hex_id: str) -> bytes:
    """Inverse of `uuid_hex`; raises ValueError on a malformed id."""
    return uuid.UUID(hex=hex_id).bytes


def stamp_ns(stamp: Any) -> int:
    """Nanoseconds of a builtin_interfaces/Time."""
    return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)


def sampling_from_msg(msg: Any) -> SamplingRecord:
    """Read a SamplingParams; fields an older version lacks keep their (unset) defaults."""
    return SamplingRecord(
        temperature=float(msg.temperature), top_k=int(msg.top_k), top_p=float(msg.top_p),
        min_p=float(msg.min_p), repetition_penalty=float(msg.repetition_penalty),
        presence_penalty=float(msg.presence_penalty), seed=int(msg.seed),
        frequency_penalty=float(getattr(msg, 'frequency_penalty', UNSET_PENALTY)),
        logit_bias_token_ids=tuple(int(t) for t in getattr(msg, 'logit_bias_token_ids', ())),
        logit_bias_values=tuple(float(v) for v in getattr(msg, 'logit_bias_values', ())),
        top_logprobs=int(getattr(msg, 'top_logprobs', UNSET_INT)))


def chat_from_msg(msg: Any) -> ChatRecord:
    return ChatRecord(str(msg.role), str(msg.content),
                      tool_calls=tuple(tool_call_from_msg(c)
                                       for c in getattr(msg, 'tool_calls', ())),
                      tool_call_id=str(getattr(msg, 'tool_call_id', '')),
                      name=str(getattr(msg, 'name', '')))


def tool_call_from_msg(msg: Any) -> ToolCallRecord:
    return ToolCallRecord(id=str(msg.id), name=str(msg.name), arguments=str(msg.arguments))


def logprob_from_msg(msg: Any) -> TokenLogprobRecord:
    return TokenLogprobRecord(
        token_id=int(msg.token_id), token=str(msg.token), logprob=float(msg.logprob),
        top_token_ids=tuple(int(t) for t in msg.top_token_ids),
        top_tokens=tuple(str(t) for t in msg.top_tokens),
        top_logprobs=tuple(float(p) for p in msg.top_logprobs))


def timings_from_msg(msg: Any) -> TimingsRecord:
    return TimingsRecord(
        queue_wait_s=float(msg.queue_wait_s),
        time_to_first_token_s=float(msg.time_to_first_token_s),
        prefill_tokens=int(msg.prefill_tokens),
        cached_prompt_tokens=int(msg.cached_prompt_tokens),
        prefill_tokens_per_second=float(msg.prefill_tokens_per_second),
        decode_tokens_per_second=float(msg.decode_tokens_per_second),
        total_s=float(msg.total_s))


def tensor_handle_from_msg(msg: Any) -> TensorHandleRecord:
    return TensorHandleRecord(
        pool_id=str(msg.pool_id), slot=int(msg.slot), generation=int(msg.generation),
        sequence=int(msg.sequence), buffer_kind=int(msg.buffer_kind), dtype=str(msg.dtype),
        shape=tuple(int(x) for x in msg.shape), strides=tuple(int(x) for x in msg.strides),
        byte_offset=int(msg.byte_offset), nbytes=int(msg.nbytes),
        frame_id=str(msg.header.frame_id), stamp_ns=stamp_ns(msg.header.stamp))


def transcript_from_msg(msg: Any, bag_stamp_ns: int = 0, topic: str = '') -> TranscriptRecord:
    """Build a record from a Transcript message (rosbags- or rclpy-generated class).

    A message of an older interface version (decoded with its own definitions) lacks the
    newer fields: they take their defaults, and the record is upgraded to the current
    semantics by regression.legacy.upgrade.
    """
    # Imported here: legacy builds on this module's records.
    from edge_llm_ros.regression.legacy import upgrade
    record = TranscriptRecord(
        goal_id=uuid_hex(msg.goal_id.uuid),
        source=str(msg.source),
        interface_version=int(getattr(msg, 'interface_version', 1)),
        accepted_stamp_ns=stamp_ns(msg.accepted_stamp),
        finished_stamp_ns=stamp_ns(msg.finished_stamp),
        model=str(msg.model),
        effective_sampling=sampling_from_msg(msg.effective_sampling),
        prompt=str(msg.prompt),
        messages=[chat_from_msg(m) for m in msg.messages],
        system_prompt=str(msg.system_prompt),
        sampling=sampling_from_msg(msg.sampling),
        max_tokens=int(msg.max_tokens),
        stop=[str(s) for s in msg.stop],
        json_schema=str(msg.json_schema),
        prefix_embeddings=[tensor_handle_from_msg(h) for h in msg.prefix_embeddings],
        session_id=str(msg.session_id),
        tools=[ToolSpecRecord(str(t.name), str(t.description), str(t.parameters))
               for t in getattr(msg, 'tools', ())],
        tool_choice=str(getattr(msg, 'tool_choice', '')),
        no_parallel_tool_calls=bool(getattr(msg, 'no_parallel_tool_calls', False)),
        grammar=str(getattr(msg, 'grammar', '')),
        regex=str(getattr(msg, 'regex', '')),
        choices=[str(c) for c in getattr(msg, 'choices', ())],
        reasoning_mode=int(getattr(msg, 'reasoning_mode', 0)),
        reasoning_budget=int(getattr(msg, 'reasoning_budget', -1)),
        priority=int(getattr(msg, 'priority', 0)),
        preempt=bool(getattr(msg, 'preempt', False)),
        no_speculation=bool(getattr(msg, 'no_speculation', False)),
        history_mode=int(getattr(msg, 'history_mode', 0)),
        images=[tensor_handle_from_msg(h) for h in getattr(msg, 'images', ())],
        raw_prompt=bool(getattr(msg, 'raw_prompt', False)),
        max_image_tokens=int(getattr(msg, 'max_image_tokens', 0)),
        video_frames=[tensor_handle_from_msg(h) for h in getattr(msg, 'video_frames', ())],
        video_timestamps=[float(t) for t in getattr(msg, 'video_timestamps', ())],
        video_fps=float(getattr(msg, 'video_fps', 0.0)),
        video_window_source=str(getattr(msg, 'video_window_source', '')),
        video_window_seconds=float(getattr(msg, 'video_window_seconds', 0.0)),
        video_window_max_frames=int(getattr(msg, 'video_window_max_frames', 0)),
        lora=[AdapterUseRecord(str(u.name), float(u.scale), str(u.digest))
              for u in getattr(msg, 'lora', ())],
        session_turns=[chat_from_msg(m) for m in getattr(msg, 'session_turns', ())],
        accepted=bool(msg.accepted),
        text=str(msg.text),
        token_ids=[int(t) for t in msg.token_ids],
        finish_reason=str(msg.finish_reason),
        prompt_tokens=int(msg.prompt_tokens),
        completion_tokens=int(msg.completion_tokens),
        timings=timings_from_msg(msg.timings),
        error_message=str(msg.error_message),
        tool_calls=[tool_call_from_msg(c) for c in getattr(msg, 'tool_calls', ())],
        reasoning=str(getattr(msg, 'reasoning', '')),
        logprobs=[logprob_from_msg(lp) for lp in getattr(msg, 'logprobs', ())],
        dropped_turns=int(getattr(msg, 'dropped_turns', 0)),
        bag_stamp_ns=int(bag_stamp_ns),
        topic=topic)
    return upgrade(record)


@dataclass
class FeedbackRecord:
    """One feedback message of a goal (the text delta and how many tokens so far)."""

    goal_id: str
    bag_stamp_ns: int
    text_delta: str
    completion_tokens: int
    queue_position: int


def feedback_from_msg(msg: Any, bag_stamp_ns: int) -> FeedbackRecord:
    """Build a record from a Generate_FeedbackMessage."""
    return FeedbackRecord(
        goal_id=uuid_hex(msg.goal_id.uuid), bag_stamp_ns=int(bag_stamp_ns),
        text_delta=str(msg.feedback.text_delta),
        completion_tokens=int(msg.feedback.completion_tokens),
        queue_position=int(msg.feedback.queue_position))
