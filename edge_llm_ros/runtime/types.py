"""Plain data types shared by the engine, the nodes and the regression tools.

No rclpy here: nodes translate ROS messages to and from these.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import enum
from typing import Mapping, Optional, Sequence, TYPE_CHECKING, Union

import numpy as np

if TYPE_CHECKING:  # annotation only: sampling imports this module
    from edge_llm_ros.runtime.sampling import TokenLogprobs


class StopReason(str, enum.Enum):
    """Why a generation ended (values match Generate.Result.FINISH_*)."""

    STOP = 'stop'            # EOS token or a stop string
    LENGTH = 'length'        # max_tokens or the context limit reached
    CANCELLED = 'cancelled'  # cancel() from another thread
    ERROR = 'error'          # an exception ended it; see GenerationResult.error
    TOOL_CALLS = 'tool_calls'  # stopped naturally after tool calls (GenerationResult.tool_calls)


ROLES = ('system', 'user', 'assistant', 'tool')


@dataclass(frozen=True)
class ChatMessage:
    """One turn. Assistant turns may carry tool_calls; tool turns answer one by tool_call_id."""

    role: str
    content: str
    tool_calls: tuple = ()     # engine.tools.spec.ToolCall (or OpenAI call dicts)
    tool_call_id: str = ''     # role 'tool': the call this message answers
    name: str = ''             # role 'tool': the tool's name


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings; validated by `engine.sampling.validate`.

    temperature 0 means greedy. top_k 0, top_p 1, min_p 0, repetition_penalty 1,
    presence_penalty 0, frequency_penalty 0 and an empty logit_bias disable their stage. seed
    None draws a random seed. logit_bias maps token ids to a bias in [-100, 100] added to their
    logits. logprobs=True reports the chosen token's log probability per token, top_logprobs
    (0..20) also the n most likely tokens (of the distribution the token was drawn from).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    seed: Optional[int] = None
    logit_bias: Optional[Mapping[int, float]] = None
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0


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
    """One generation: either `prompt` (a single user turn) or `messages`.

    At most one output constraint: json_schema, grammar (Lark, llguidance dialect), regex,
    choices, or tools (with tool_choice other than 'none'). tools, reasoning and
    reasoning_budget need the chat template.
    """

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
    # Images (RGB [H, W, 3] uint8 arrays, or runtime.media.DeclaredImage until mapped), each
    # placed where the prompt or a message has a `<__media__>` marker, in order.
    images: Sequence = ()
    # The session (conversation) this request continues ('' = none): its stored turns come
    # first and this request's new turns after them (runtime/conversation.py).
    session_id: str = ''
    # How `messages` relate to the stored turns: runtime.conversation.HISTORY_*.
    history_mode: int = 0
    # Apply the chat template (False: `prompt` is raw text fed as is).
    use_chat_template: bool = True
    # Functions the model may call (ToolSpec or OpenAI tool dicts), and which:
    # '' = 'auto' with tools, 'none' without; 'auto' | 'none' | 'required' | a tool's name.
    tools: Sequence = ()
    tool_choice: str = ''
    parallel_tool_calls: bool = True
    grammar: str = ''
    regex: str = ''
    choices: Sequence[str] = ()
    # False asks the template to skip reasoning (only families with a switch, e.g. Qwen3).
    reasoning: bool = True
    # Tokens of reasoning after which the close tag is forced (None: unlimited).
    reasoning_budget: Optional[int] = None
    # False: this request decodes plainly even where the engine speculates.
    speculative: bool = True
    # Embedding rows (tokens) one image may take, at most; 0: no cap but the context's. An
    # image over it is refused before any model work (a 1080p frame is 2,691 Qwen-VL tokens).
    max_image_tokens: int = 0
    # LoRA adapters for this goal: loaded name -> scale (None: the adapter's default scale).
    lora: Mapping[str, Optional[float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Timings:
    queue_wait_s: float = 0.0
    time_to_first_token_s: float = 0.0
    prefill_tokens: int = 0
    cached_prompt_tokens: int = 0
    prefill_tokens_per_second: float = 0.0
    decode_tokens_per_second: float = 0.0
    total_s: float = 0.0
    # Speculative decoding (runtime/speculative.py): verify passes, the draft tokens fed to
    # them and those kept; decode steps = plain steps + verify passes.
    draft_passes: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    decode_steps: int = 0


@dataclass(frozen=True)
class TokenEvent:
    """One generated token; `text_delta` is the new user-visible UTF-8 text (may be '').

    Reasoning text and tool-call markup never reach text_delta: they come as reasoning_delta
    and tool_call_deltas.
    """

    token_id: int
    text_delta: str
    index: int               # 0-based index among completion tokens
    elapsed_s: float         # since the start of generation
    reasoning_delta: str = ''
    tool_call_deltas: tuple = ()    # engine.tools.parser.ToolCallDelta
    logprobs: Optional[TokenLogprobs] = None   # when SamplingConfig.logprobs/top_logprobs


@dataclass
class GenerationResult:
    """The outcome. `text` is only the user-visible answer (the events' text_delta joined)."""

    text: str
    token_ids: list
    stop_reason: StopReason
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    error: str = ''
    reasoning: str = ''                                   # the events' reasoning_delta joined
    tool_calls: list = field(default_factory=list)         # ToolCall, complete and valid
    invalid_tool_calls: list = field(default_factory=list)  # InvalidToolCall (raw, error)
    logprobs: list = field(default_factory=list)           # TokenLogprobs per token, if asked
    dropped_turns: int = 0     # session turns left out because they no longer fit the context
