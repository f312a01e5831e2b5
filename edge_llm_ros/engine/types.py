"""Plain data types shared by the engine, the nodes and the regression tools.

No rclpy here: nodes translate ROS messages to and from these.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import enum
from typing import Optional, Sequence, Union

import numpy as np


class StopReason(str, enum.Enum):
    """Why a generation ended (values match Generate.Result.FINISH_*)."""

    STOP = 'stop'            # EOS token or a stop string
    LENGTH = 'length'        # max_tokens or the context limit reached
    CANCELLED = 'cancelled'  # cancel() from another thread
    ERROR = 'error'          # an exception ended it; see GenerationResult.error


ROLES = ('system', 'user', 'assistant', 'tool')


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings; validated by `engine.sampling.validate`.

    temperature 0 means greedy. top_k 0, top_p 1, min_p 0, repetition_penalty 1,
    presence_penalty 0 disable their stage. seed None draws a random seed.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    seed: Optional[int] = None


@dataclass(frozen=True)
class DeclaredEmbeddings:
    """Prefix embeddings known by their shape only, until the request runs.

    A node that receives tensor handles maps their frames only while the job runs: prepare()
    checks this declared shape (dtype, hidden width, room in the context) at admission, and
    the array is bound to the prepared request just before generating.
    """

    rows: int
    hidden: int
    dtype: str    # 'float32' or 'float16'


@dataclass
class GenerationRequest:
    """One generation: either `prompt` (a single user turn) or `messages`."""

    prompt: str = ''
    messages: Sequence[ChatMessage] = ()
    system_prompt: str = ''
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_tokens: int = 256
    stop: Sequence[str] = ()
    json_schema: str = ''
    # float32/float16 [n, hidden] embeddings fed through inputs_embeds ahead of the prompt,
    # or only their declared shape (bound later, see PreparedRequest.bind).
    prefix_embeddings: Optional[Union[np.ndarray, DeclaredEmbeddings]] = None
    # Keep this conversation's KV prefix so the next turn only prefills new tokens.
    session_id: str = ''
    # Apply the chat template (False: `prompt` is raw text fed as is).
    use_chat_template: bool = True


@dataclass(frozen=True)
class Timings:
    queue_wait_s: float = 0.0
    time_to_first_token_s: float = 0.0
    prefill_tokens: int = 0
    cached_prompt_tokens: int = 0
    prefill_tokens_per_second: float = 0.0
    decode_tokens_per_second: float = 0.0
    total_s: float = 0.0


@dataclass(frozen=True)
class TokenEvent:
    """One generated token; `text_delta` is the new valid UTF-8 text (may be '')."""

    token_id: int
    text_delta: str
    index: int               # 0-based index among completion tokens
    elapsed_s: float         # since the start of generation


@dataclass
class GenerationResult:
    text: str
    token_ids: list
    stop_reason: StopReason
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    error: str = ''
