"""OpenAI's request and response shapes (the subset the bridge serves), as pydantic models.

Requests ignore fields they do not know (clients send many: user, store, metadata, ...);
fields they know are checked here for type and range, and in convert.py for meaning.
Responses are dumped with `exclude_unset=True`, so a field set to None is sent as null
(content of a tool-call message, finish_reason of a chunk) and an unset one is left out.
"""
from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from edge_llm_ros.runtime.tools.spec import NAME_RE


class _Request(BaseModel):
    model_config = ConfigDict(extra='ignore', populate_by_name=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra='forbid')

    def model_post_init(self, context: Any) -> None:
        # Defaults that are not None (object, role, index) are always sent; None only if set.
        self.model_fields_set.update(
            name for name in type(self).model_fields if getattr(self, name) is not None)

    def dump(self) -> Dict[str, Any]:
        return self.model_dump(mode='json', exclude_unset=True, by_alias=True)


# ---- requests ---------------------------------------------------------------------------------
class FunctionCallIn(_Request):
    name: str
    arguments: str = '{}'


class ToolCallIn(_Request):
    id: str  # noqa: A003 - OpenAI's field name
    type: Literal['function'] = 'function'  # noqa: A003 - OpenAI's field name
    function: FunctionCallIn


class ImageUrl(_Request):
    url: str
    detail: Optional[str] = None     # OpenAI's low/high/auto: the model's own tiling applies


class ContentPart(_Request):
    model_config = ConfigDict(extra='allow')
    type: str  # noqa: A003 - OpenAI's field name
    text: Optional[str] = None
    # type image_url: {"url": "data:image/png;base64,..."} (some clients send the URL alone).
    image_url: Union[ImageUrl, str, None] = None


class ChatMessageIn(_Request):
    role: Literal['system', 'developer', 'user', 'assistant', 'tool']
    content: Union[str, List[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[List[ToolCallIn]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None     # sent back by some clients; not re-rendered


class FunctionDef(_Request):
    name: str          # checked with the engine's rules (convert._tools)
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolDef(_Request):
    type: Literal['function']  # noqa: A003 - OpenAI's field name
    function: FunctionDef


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal['function']  # noqa: A003 - OpenAI's field name
    function: FunctionName


class JsonSchemaFormat(_Request):
    name: str = Field(pattern=NAME_RE.pattern)
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(default=None, alias='schema')
    strict: Optional[bool] = None


class ResponseFormat(_Request):
    type: Literal['text', 'json_object', 'json_schema']  # noqa: A003 - OpenAI's field name
    json_schema: Optional[JsonSchemaFormat] = None


class StreamOptions(_Request):
    include_usage: bool = False


class LoraEntry(_Request):
    """llama-server's per-request adapter: {"id": n, "scale": s}; here by name."""

    name: Optional[str] = None
    id: Optional[int] = None   # noqa: A003 - llama-server's field name (refused: use name)
    scale: float = 1.0


class _Sampling(_Request):
    """Fields /v1/chat/completions and /v1/completions share."""

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    n: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, List[str], None] = None
    seed: Optional[int] = Field(default=None, ge=0, le=2**63 - 1)   # the action's int64
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: Optional[Dict[str, float]] = None
    user: Optional[str] = None
    # LoRA adapters of this request (llama-server's field; docs/interfaces.md, LoRA adapters).
    lora: Optional[List[LoraEntry]] = None


class ChatCompletionRequest(_Sampling):
    messages: List[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[List[ToolDef]] = None
    tool_choice: Union[Literal['none', 'auto', 'required'], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[ResponseFormat] = None
    reasoning_effort: Optional[Literal['none', 'minimal', 'low', 'medium', 'high',
                                       'xhigh']] = None
    # vLLM's way to switch thinking (Qwen3: {"enable_thinking": false}).
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    # This project's extension (issue 13): reasoning tokens before the closing tag is forced.
    reasoning_budget: Optional[int] = Field(default=None, ge=0)


class CompletionRequest(_Sampling):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    logprobs: Optional[int] = Field(default=None, ge=0, le=5)
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


# ---- responses --------------------------------------------------------------------------------
class FunctionCallOut(_Response):
    name: Optional[str] = None
    arguments: Optional[str] = None


class ToolCallOut(_Response):
    index: Optional[int] = None      # in stream deltas only
    id: Optional[str] = None  # noqa: A003 - OpenAI's field name
    type: Optional[Literal['function']] = None  # noqa: A003 - OpenAI's field name
    function: FunctionCallOut


class TopLogprobOut(_Response):
    token: str
    logprob: float
    bytes: Optional[List[int]] = None  # noqa: A003 - OpenAI's field name


class TokenLogprobOut(TopLogprobOut):
    top_logprobs: List[TopLogprobOut] = Field(default_factory=list)


class ChoiceLogprobs(_Response):
    content: Optional[List[TokenLogprobOut]] = None


class ChatMessageOut(_Response):
    role: Literal['assistant'] = 'assistant'
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[List[ToolCallOut]] = None


class ChatDelta(_Response):
    role: Optional[Literal['assistant']] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[List[ToolCallOut]] = None


class ChatChoice(_Response):
    index: int = 0
    message: ChatMessageOut
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatChunkChoice(_Response):
    index: int = 0
    delta: ChatDelta
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionTokensDetails(_Response):
    reasoning_tokens: int = 0


class UsageOut(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: Optional[CompletionTokensDetails] = None


class _Envelope(_Response):
    """What every completion body and chunk has; subclasses pin `object` and `choices`."""

    id: str  # noqa: A003 - OpenAI's field name
    object: str  # noqa: A003 - OpenAI's field name
    created: int
    model: str
    choices: List[Any]
    usage: Optional[UsageOut] = None


class ChatCompletion(_Envelope):
    object: Literal['chat.completion'] = 'chat.completion'  # noqa: A003
    choices: List[ChatChoice]


class ChatCompletionChunk(_Envelope):
    object: Literal['chat.completion.chunk'] = 'chat.completion.chunk'  # noqa: A003
    choices: List[ChatChunkChoice]


class CompletionLogprobs(_Response):
    tokens: List[str] = Field(default_factory=list)
    token_logprobs: List[float] = Field(default_factory=list)
    top_logprobs: List[Dict[str, float]] = Field(default_factory=list)
    text_offset: List[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class Completion(_Envelope):
    object: Literal['text_completion'] = 'text_completion'  # noqa: A003
    choices: List[CompletionChoice]


class ModelCard(_Response):
    id: str  # noqa: A003 - OpenAI's field name
    object: Literal['model'] = 'model'  # noqa: A003 - OpenAI's field name
    created: int
    owned_by: str


class ModelList(_Response):
    object: Literal['list'] = 'list'  # noqa: A003 - OpenAI's field name
    data: List[ModelCard]
