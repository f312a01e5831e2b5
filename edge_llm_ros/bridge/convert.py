"""OpenAI request bodies -> BackendRequest, with every check that needs more than a type.

Each rejection is an InvalidRequestError whose `param` names the offending field the way
OpenAI does (`messages[2].tool_calls[0].function.arguments`), so a client can point at it.
"""
from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, TypeVar

import jsonschema
from pydantic import BaseModel, ValidationError

from edge_llm_ros.bridge.backend import BackendRequest, Message
from edge_llm_ros.bridge.errors import InvalidRequestError
from edge_llm_ros.bridge.schemas import (ChatCompletionRequest, ChatMessageIn, CompletionRequest,
                                         ResponseFormat, ToolDef)
from edge_llm_ros.errors import InvalidRequestError as EngineInvalidRequest
from edge_llm_ros.runtime.media import MEDIA_MARKER
from edge_llm_ros.runtime.tools.spec import (check_single_constraint, check_tool, check_tools,
                                             parse_tool_choice, ToolCall, ToolChoice, ToolSpec)

Body = TypeVar('Body', bound=BaseModel)
TEXT_PARTS = ('text', 'input_text')
IMAGE_PART = 'image_url'
# data: URLs of the image types served (the pixels are decoded by Pillow, whatever they are).
DATA_URL = re.compile(r'data:image/(png|jpeg|jpg|webp|gif|bmp);base64,(.*)', re.I | re.S)
FIELD_NAME = re.compile(r'^[a-z_][a-z0-9_]*$')
UNION_TAGS = ('str', 'int', 'float', 'bool', 'dict', 'list', 'none')


def param_path(loc: Sequence[Any]) -> str:
    """Turn a pydantic location ('messages', 0, 'role') into 'messages[0].role'."""
    path = ''
    for part in loc:
        if isinstance(part, int):
            path += f'[{part}]'
        elif not FIELD_NAME.match(part) or part in UNION_TAGS:
            continue   # pydantic's union-branch tag (NamedToolChoice, list[...], str)
        else:
            path = f'{path}.{part}' if path else part
    return path


def parse_body(model: Type[Body], data: Any) -> Body:
    """Validate a decoded JSON body; the first error becomes a 400 naming its field."""
    if not isinstance(data, dict):
        raise InvalidRequestError('the request body must be a JSON object')
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = param_path(first['loc'])
        raise InvalidRequestError(f"invalid value for '{where}': {first['msg']}",
                                  param=where or None) from None


def _check_schema(schema: Any, param: str) -> None:
    if not isinstance(schema, dict):
        raise InvalidRequestError('a JSON schema must be a JSON object', param=param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise InvalidRequestError(f'invalid JSON schema: {exc.message}', param=param) from None


def _sampling(body, request_id: str) -> Dict[str, Any]:
    if body.n not in (None, 1):
        raise InvalidRequestError('n must be 1: the model makes one choice per request; send '
                                  'several requests for several answers', param='n')
    stop: Tuple[str, ...] = ()
    if body.stop is not None:
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
        if not all(stop):
            raise InvalidRequestError('stop strings must not be empty', param='stop')
    bias: Dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.isdigit():
            raise InvalidRequestError(f'logit_bias keys are token ids; {key!r} is not one',
                                      param='logit_bias')
        if not -100.0 <= value <= 100.0:
            raise InvalidRequestError(f'logit_bias values must be in [-100, 100], not {value}',
                                      param='logit_bias')
        bias[int(key)] = float(value)
    return {'request_id': request_id, 'model': body.model.split('+')[0], 'lora': lora_of(body),
            'temperature': body.temperature,
            'top_p': body.top_p, 'seed': body.seed, 'presence_penalty': body.presence_penalty,
            'frequency_penalty': body.frequency_penalty, 'logit_bias': bias, 'stop': stop,
            'stream': bool(body.stream)}


def lora_of(body) -> Tuple[Tuple[str, float], ...]:
    """Return the request's adapters (name, scale): `lora` entries, then base+name's (1.0)."""
    out: Dict[str, float] = {}
    for i, entry in enumerate(body.lora or ()):
        if entry.name is None:
            raise InvalidRequestError(
                f'lora[{i}] has no name: this server names its adapters (GET ~/list_adapters '
                'on the node); send {"name": ..., "scale": ...} instead of an id',
                param=f'lora[{i}]')
        out[entry.name] = float(entry.scale)
    for name in body.model.split('+')[1:]:
        if not name:
            raise InvalidRequestError(f"model '{body.model}' has an empty adapter name: give "
                                      "'base+adapter'", param='model')
        out.setdefault(name, 1.0)
    return tuple(out.items())


# fetch(url, param) -> the bytes of an http(s) image URL (bridge/image_fetch.ImageFetcher).
Fetch = Callable[[str, str], bytes]


def image_from_url(url: str, param: str, fetch: Optional[Fetch] = None) -> Any:
    """Decode an image URL into RGB [H, W, 3] uint8 (400 naming `param`).

    data:image/...;base64 URLs always; http(s) URLs only with a `fetch` (the bridge's
    fetch_image_urls): by default it fetches nothing on a client's behalf (a robot's network
    is not the client's to reach through it).
    """
    if url[:8].lower().startswith(('http://', 'https://')):
        if fetch is None:
            raise InvalidRequestError(
                'image URLs are not fetched by this server: send the image inline as a '
                'data:image/png;base64,... (or image/jpeg) URL', param=param,
                code='image_url_not_supported')
        data = fetch(url, param)
    else:
        match = DATA_URL.fullmatch(url)
        if match is None:
            raise InvalidRequestError(
                f'{url[:40]!r}... is not an image data URL: send '
                'data:image/png;base64,... or data:image/jpeg;base64,...', param=param)
        try:
            data = base64.b64decode(''.join(match.group(2).split()), validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError('the image data URL is not valid base64', param=param) \
                from None
    from edge_llm_ros.runtime.image_file import decode_image
    try:
        return decode_image(data, f'the image of {param}')
    except EngineInvalidRequest as exc:   # ImageInputError: corrupt, too large, no image
        raise InvalidRequestError(str(exc), param=param) from None


def _content(message: ChatMessageIn, where: str, images: List[Any],
             fetch: Optional[Fetch]) -> str:
    """Text of a message's content; each image part is decoded into `images` and marked."""
    if message.content is None:
        return ''
    if isinstance(message.content, str):
        return message.content
    texts = []
    for j, part in enumerate(message.content):
        if part.type == IMAGE_PART and part.image_url is not None:
            url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
            images.append(image_from_url(url, f'{where}.content[{j}].image_url.url', fetch))
            texts.append(MEDIA_MARKER)
            continue
        if part.type not in TEXT_PARTS or part.text is None:
            raise InvalidRequestError(
                f'content parts of type {part.type!r} are not served here, only text and '
                'image_url', param=f'{where}.content[{j}].type')
        texts.append(part.text)
    return '\n'.join(texts)


def _message(message: ChatMessageIn, i: int, images: List[Any],
             fetch: Optional[Fetch] = None) -> Message:
    where = f'messages[{i}]'
    role = 'system' if message.role == 'developer' else message.role
    if message.tool_calls and role != 'assistant':
        raise InvalidRequestError('only assistant messages carry tool_calls',
                                  param=f'{where}.tool_calls')
    if role == 'tool' and not message.tool_call_id:
        raise InvalidRequestError("a 'tool' message needs the tool_call_id it answers",
                                  param=f'{where}.tool_call_id')
    if message.content is None and not (role == 'assistant' and message.tool_calls):
        raise InvalidRequestError(f"a '{message.role}' message needs content",
                                  param=f'{where}.content')
    calls = []
    for j, call in enumerate(message.tool_calls or ()):
        made = ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments)
        try:
            made.arguments_dict()       # the template renders them as a dict
        except (ValueError, EngineInvalidRequest) as exc:
            raise InvalidRequestError(
                f'tool call arguments must be a JSON object as text ({exc})',
                param=f'{where}.tool_calls[{j}].function.arguments') from None
        calls.append(made)
    return Message(role=role, content=_content(message, where, images, fetch),
                   tool_calls=tuple(calls),
                   tool_call_id=message.tool_call_id or '', name=message.name or '')


def _tools(tools: Optional[List[ToolDef]]) -> Tuple[ToolSpec, ...]:
    """Check the tools with the engine's own rules, naming the tool that fails."""
    raw = [tool.model_dump(exclude_none=True) for tool in tools or ()]
    for i, tool in enumerate(raw):
        try:
            check_tool(tool, i)
        except EngineInvalidRequest as exc:
            raise InvalidRequestError(str(exc), param=f'tools[{i}]') from None
    try:
        return check_tools(raw)
    except EngineInvalidRequest as exc:
        raise InvalidRequestError(str(exc), param='tools') from None


def _tool_choice(body: ChatCompletionRequest, tools: Tuple[ToolSpec, ...]) -> ToolChoice:
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = choice.model_dump()
    try:
        return parse_tool_choice(choice, tools)
    except EngineInvalidRequest as exc:
        raise InvalidRequestError(str(exc), param='tool_choice') from None


def _json_schema(response_format: Optional[ResponseFormat]) -> str:
    if response_format is None or response_format.type == 'text':
        return ''
    if response_format.type == 'json_object':
        return json.dumps({'type': 'object'})
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise InvalidRequestError("response_format json_schema needs 'json_schema.schema'",
                                  param='response_format.json_schema')
    _check_schema(spec.schema_, 'response_format.json_schema.schema')
    return json.dumps(spec.schema_)


def _reasoning(body: ChatCompletionRequest) -> Optional[bool]:
    kwargs = body.chat_template_kwargs or {}
    if 'enable_thinking' in kwargs:
        if not isinstance(kwargs['enable_thinking'], bool):
            raise InvalidRequestError('enable_thinking must be true or false',
                                      param='chat_template_kwargs.enable_thinking')
        return kwargs['enable_thinking']
    if body.reasoning_effort is None:
        return None
    return body.reasoning_effort != 'none'


# X-Session-Id values: what a ROS session id may be here (no control characters).
SESSION_ID_MAX = 128


def session_header(value: str) -> str:
    """Check an X-Session-Id header value ('' = none)."""
    if len(value) > SESSION_ID_MAX or not value.isprintable():
        raise InvalidRequestError(f'X-Session-Id must be at most {SESSION_ID_MAX} printable '
                                  'characters', param='X-Session-Id')
    return value


def chat_request(body: ChatCompletionRequest, request_id: str,
                 session_id: str = '', fetch: Optional[Fetch] = None) -> BackendRequest:
    """Check a chat completion body and build the backend's request.

    fetch: how http(s) image URLs are fetched (None: they are refused).
    """
    tools = _tools(body.tools)
    tool_choice = _tool_choice(body, tools)
    json_schema = _json_schema(body.response_format)
    try:
        check_single_constraint(tools=bool(tools) and tool_choice.mode != 'none',
                                response_format=bool(json_schema))
    except EngineInvalidRequest as exc:
        raise InvalidRequestError(str(exc), param='response_format') from None
    if body.top_logprobs and not body.logprobs:
        raise InvalidRequestError('top_logprobs needs logprobs: true', param='top_logprobs')
    max_tokens = body.max_completion_tokens or body.max_tokens or 0
    images: List[Any] = []
    messages = tuple(_message(m, i, images, fetch) for i, m in enumerate(body.messages))
    return BackendRequest(
        **_sampling(body, request_id), messages=messages, images=tuple(images),
        max_tokens=max_tokens, json_schema=json_schema, tools=tools, tool_choice=tool_choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs or 0,
        reasoning=_reasoning(body), reasoning_budget=body.reasoning_budget or 0,
        session_id=session_header(session_id))


def completion_request(body: CompletionRequest, request_id: str) -> BackendRequest:
    """Check a legacy completion body (one text prompt) and build the backend's request."""
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidRequestError('prompt must be one string (token-id prompts and batches '
                                  'are not served)', param='prompt')
    if not prompt:
        raise InvalidRequestError('prompt must not be empty', param='prompt')
    if body.suffix:
        raise InvalidRequestError('suffix (fill-in-the-middle) is not served', param='suffix')
    if body.best_of not in (None, 1):
        raise InvalidRequestError('best_of must be 1', param='best_of')
    return BackendRequest(**_sampling(body, request_id), prompt=prompt,
                          max_tokens=body.max_tokens or 0,
                          logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0)
