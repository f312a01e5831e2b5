"""Tool specs, tool calls and tool_choice: checked once, before any token.

Shapes follow OpenAI's chat API, which agent stacks speak: a tool is a function with a name, a
description and a JSON Schema for its arguments; a call has an id, a name and its arguments as
JSON text; tool_choice is 'auto', 'none', 'required' or the name of one tool.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import json
import re
import secrets
import string
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Tuple, Union

import jsonschema

from edge_llm_ros.errors import InvalidRequestError

# OpenAI's rule for function names; it also keeps names safe inside grammars and templates.
NAME_RE = re.compile(r'^[A-Za-z0-9_-]{1,64}$')
CHOICE_MODES = ('auto', 'none', 'required', 'named')
MAX_TOOLS = 128
_EMPTY_PARAMETERS = {'type': 'object', 'properties': {}}


class InvalidToolsError(InvalidRequestError):
    """A tool spec, tool call or tool_choice is malformed or names an unknown tool."""


class ConstraintConflictError(InvalidRequestError):
    """The request asks for more than one output constraint (e.g. tools and json_schema)."""


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call; `parameters` is a checked JSON Schema (object type)."""

    name: str
    description: str = ''
    parameters: Mapping[str, Any] = field(default_factory=lambda: dict(_EMPTY_PARAMETERS))

    def to_hf(self) -> Dict[str, Any]:
        """Return the tool as Hugging Face templates take it (OpenAI's `tools` entry)."""
        return {'type': 'function',
                'function': {'name': self.name, 'description': self.description,
                             'parameters': dict(self.parameters)}}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: `arguments` is a JSON object as text."""

    id: str  # noqa: A003 - OpenAI's field name
    name: str
    arguments: str

    def arguments_dict(self) -> Dict[str, Any]:
        value = json.loads(self.arguments)
        if not isinstance(value, dict):
            raise InvalidToolsError(f'tool call {self.id} arguments are not a JSON object')
        return value

    def to_hf(self) -> Dict[str, Any]:
        """Return the call as HF templates take it in a message (arguments as a dict)."""
        return {'id': self.id, 'type': 'function',
                'function': {'name': self.name, 'arguments': self.arguments_dict()}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str = 'auto'   # one of CHOICE_MODES
    name: str = ''       # the tool, when mode == 'named'


ToolLike = Union[ToolSpec, Mapping[str, Any]]


def check_tool(tool: ToolLike, index: int = 0) -> ToolSpec:
    """Validate one tool (a ToolSpec or an OpenAI/HF dict); parameters may be JSON text."""
    where = f'tools[{index}]'
    if isinstance(tool, Mapping):
        fn = tool.get('function', tool) if tool.get('type', 'function') == 'function' else None
        if not isinstance(fn, Mapping):
            raise InvalidToolsError(f'{where}: only {{"type": "function", "function": {{...}}}} '
                                    'tools are supported')
        name, desc, params = fn.get('name'), fn.get('description', ''), fn.get('parameters')
    elif isinstance(tool, ToolSpec):
        name, desc, params = tool.name, tool.description, tool.parameters
    else:
        raise InvalidToolsError(f'{where} must be a ToolSpec or a dict, not '
                                f'{type(tool).__name__}')
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise InvalidToolsError(f'{where}: name {name!r} must be 1-64 letters, digits, _ or -')
    if not isinstance(desc, str):
        raise InvalidToolsError(f'{where} ({name}): description must be text')
    return ToolSpec(name=name, description=desc, parameters=_check_parameters(params, where, name))


def _check_parameters(params: Any, where: str, name: str) -> Dict[str, Any]:
    if params is None or params == '':
        return dict(_EMPTY_PARAMETERS)
    if isinstance(params, str):
        try:
            params = json.loads(params)
        except ValueError as exc:
            raise InvalidToolsError(f'{where} ({name}): parameters are not valid JSON: {exc}') \
                from None
        except RecursionError:
            raise InvalidToolsError(f'{where} ({name}): parameters are nested too deeply') \
                from None
    if not isinstance(params, Mapping):
        raise InvalidToolsError(f'{where} ({name}): parameters must be a JSON Schema object')
    params = dict(params)
    problem = schema_problem(params)
    if problem == SCHEMA_TOO_DEEP:
        raise InvalidToolsError(f'{where} ({name}): parameters are nested too deeply')
    if problem:
        raise InvalidToolsError(f'{where} ({name}): parameters schema is {problem}')
    if params.get('type', 'object') != 'object':
        raise InvalidToolsError(f'{where} ({name}): parameters must describe an object '
                                '("type": "object"), since arguments are named')
    return params


SCHEMA_TOO_DEEP = 'nested too deeply'


def schema_problem(schema: Mapping[str, Any]) -> Optional[str]:
    """Say why `schema` is not valid JSON Schema ('invalid at <path>: ...'), or None."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        at = '/'.join(str(p) for p in exc.absolute_path) or '(root)'
        return f'invalid at {at}: {exc.message}'
    except RecursionError:
        # jsonschema checks recursively: a few hundred levels exhaust Python's stack.
        return SCHEMA_TOO_DEEP
    return None


def check_tools(tools: Iterable[ToolLike]) -> Tuple[ToolSpec, ...]:
    """Validate a tool list: each tool, unique names, at most MAX_TOOLS."""
    specs = tuple(check_tool(t, i) for i, t in enumerate(tools))
    if len(specs) > MAX_TOOLS:
        raise InvalidToolsError(f'{len(specs)} tools given; at most {MAX_TOOLS} are allowed')
    seen = set()
    for spec in specs:
        if spec.name in seen:
            raise InvalidToolsError(f'tool name {spec.name!r} is given twice; names must be '
                                    'unique')
        seen.add(spec.name)
    return specs


def parse_tool_choice(choice: Union[str, Mapping[str, Any], ToolChoice, None],
                      tools: Sequence[ToolSpec]) -> ToolChoice:
    """'auto' | 'none' | 'required' | a tool name | {"type": "function", "function": {...}}.

    An empty value means 'auto' when tools are given, else 'none'.
    """
    if isinstance(choice, ToolChoice):
        mode, name = choice.mode, choice.name
    elif isinstance(choice, Mapping):
        fn = choice.get('function')
        name = fn.get('name') if isinstance(fn, Mapping) else None
        if choice.get('type') != 'function' or not isinstance(name, str):
            raise InvalidToolsError('tool_choice objects must be {"type": "function", '
                                    '"function": {"name": ...}}')
        mode = 'named'
    elif choice is None or choice == '':
        mode, name = ('auto' if tools else 'none'), ''
    elif isinstance(choice, str):
        mode, name = (choice, '') if choice in ('auto', 'none', 'required') else ('named', choice)
    else:
        raise InvalidToolsError(f'tool_choice must be text, not {type(choice).__name__}')
    if mode not in CHOICE_MODES:
        raise InvalidToolsError(f'tool_choice mode {mode!r} is not one of '
                                f'{", ".join(CHOICE_MODES)}')
    if mode in ('required', 'named') and not tools:
        raise InvalidToolsError(f'tool_choice {name or mode!r} needs tools: give the tools')
    if mode == 'named' and name not in {t.name for t in tools}:
        raise InvalidToolsError(f'tool_choice names unknown tool {name!r}; tools: '
                                f'{", ".join(t.name for t in tools)}')
    return ToolChoice(mode, name if mode == 'named' else '')


def check_single_constraint(**kinds: Any) -> Optional[str]:
    """Return the name of the one constraint kind given (truthy), None if none.

    Tools count as a constraint only with tool_choice required or named (pass
    `tools=choice.mode in ('required', 'named')`) or auto (the constraint engages at the
    trigger), so pass them unless tool_choice is 'none'.
    """
    given = [k for k, v in kinds.items() if v]
    if len(given) > 1:
        raise ConstraintConflictError(f'{" and ".join(given)} cannot be combined: a reply '
                                      'follows one constraint; give only one of them')
    return given[0] if given else None


def tools_in_scope(tools: Sequence[ToolSpec], choice: ToolChoice) -> Tuple[ToolSpec, ...]:
    """Return the tools the model may call under `choice` (none for 'none')."""
    if choice.mode == 'none':
        return ()
    if choice.mode == 'named':
        return tuple(t for t in tools if t.name == choice.name)
    return tuple(tools)


def validate_arguments(spec: ToolSpec, arguments: Any) -> Optional[str]:
    """Return why `arguments` (a dict) do not fit the tool's schema, or None when they do."""
    try:
        jsonschema.validate(arguments, dict(spec.parameters))
    except jsonschema.ValidationError as exc:
        at = '/'.join(str(p) for p in exc.absolute_path) or '(root)'
        return f'arguments of {spec.name} are invalid at {at}: {exc.message}'
    return None


_ALNUM = string.ascii_letters + string.digits


def new_call_id(style: str = 'openai') -> str:
    """Make a call id: 'call_' + 24 hex digits, or 9 letters/digits (Mistral's template)."""
    if style == 'mistral':
        return ''.join(secrets.choice(_ALNUM) for _ in range(9))
    return 'call_' + secrets.token_hex(12)
