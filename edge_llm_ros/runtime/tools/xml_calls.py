"""Read Qwen3.5 / Qwen3-Coder's XML tool calls (config/models/qwen35.yaml `qwen3_xml`).

What their chat templates write for a call (and the models learnt), between <tool_call> and
</tool_call>:

    <function=move_to>
    <parameter=x>
    1.5
    </parameter>
    <parameter=frame>
    map
    </parameter>
    </function>

A value is the text between `<parameter=NAME>` and `</parameter>`, less the newline that
follows the one and the newline that precedes the other. Nothing is evaluated; it becomes a
JSON value as llama.cpp's Qwen3-Coder parser types it (common/chat parsers,
qwen3-coder.cpp), from the parameter's schema:

* a schema that allows no string: the value must be JSON (an error otherwise);
* a schema that allows only strings: the text itself;
* a schema that allows strings and other types (or a parameter without a schema): the text
  as JSON when it reads as one of the other types allowed, else the text itself.
"""
from __future__ import annotations

import json
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Tuple

from edge_llm_ros.runtime.tools.spec import ToolSpec

_ANY = frozenset(('string', 'object', 'array', 'number', 'integer', 'boolean', 'null'))
_FUNCTION, _PARAMETER = '<function=', '<parameter='
_END_FUNCTION, _END_PARAMETER = '</function>', '</parameter>'
_MAX_DEPTH = 32


def _json_types(value: Any) -> FrozenSet[str]:
    """Return the JSON Schema types a parsed JSON value satisfies."""
    if isinstance(value, bool):
        return frozenset(('boolean',))
    if isinstance(value, int):
        return frozenset(('integer', 'number'))
    if isinstance(value, float):
        return frozenset(('number',))
    if value is None:
        return frozenset(('null',))
    if isinstance(value, str):
        return frozenset(('string',))
    return frozenset(('array',)) if isinstance(value, list) else frozenset(('object',))


def schema_types(schema: Any, depth: int = 0) -> FrozenSet[str]:
    """Return the JSON types a parameter schema allows (all of them when it does not say)."""
    if not isinstance(schema, dict) or depth > _MAX_DEPTH:
        return _ANY
    kind = schema.get('type')
    if isinstance(kind, str):
        return frozenset((kind,))
    if isinstance(kind, list) and kind:
        return frozenset(k for k in kind if isinstance(k, str))
    for key in ('anyOf', 'oneOf'):
        if isinstance(schema.get(key), list) and schema[key]:
            return frozenset().union(*(schema_types(s, depth + 1) for s in schema[key]))
    values = schema.get('enum') if isinstance(schema.get('enum'), list) else (
        [schema['const']] if 'const' in schema else None)
    if values:
        return frozenset().union(*(_json_types(v) for v in values))
    return _ANY


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f'{name} is not JSON')
    return json.loads(text, parse_constant=refuse)


def typed_value(text: str, types: FrozenSet[str]) -> Tuple[Any, str]:
    """Return (value, error) of a parameter's text under the types its schema allows."""
    if 'string' not in types:
        try:
            return _strict_json(text), ''
        except (ValueError, RecursionError) as exc:
            return None, f'is not JSON ({exc}) and its schema allows no string'
    if types == {'string'}:
        return text, ''
    try:
        value = _strict_json(text)
    except (ValueError, RecursionError):
        return text, ''
    others = types - {'string'}
    return (value, '') if _json_types(value) & others else (text, '')


class _Bad(ValueError):
    """The call text is not XML call syntax (the message says where)."""


class _BadValue(ValueError):
    """A parameter's text is not a value its schema allows (the message says which)."""


def _params_schema(tool: Optional[ToolSpec]) -> Mapping[str, Any]:
    props = (tool.parameters or {}).get('properties') if tool is not None else None
    return props if isinstance(props, dict) else {}


def xml_calls(source: str, tools: Mapping[str, ToolSpec]
              ) -> List[Tuple[str, str, str, str]]:
    """Read the calls in `source` (one or more `<function=NAME>...</function>`).

    Returns (raw, name, arguments as JSON text, error) per call; raises ValueError when the
    text does not begin with a call at all.
    """
    text = source.strip()
    out: List[Tuple[str, str, str, str]] = []
    i = 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return out
        start = i
        if not text.startswith(_FUNCTION, i):
            if not out:
                raise ValueError('expected <function=NAME>')
            out.append((text[start:], '', '', 'the call is not XML call syntax: expected '
                        f'<function=NAME> at {text[i:i + 20]!r}'))
            return out
        name = ''
        try:
            name, args, i = _function(text, i, tools)
            out.append((text[start:i], name, json.dumps(args, ensure_ascii=False), ''))
        except _Bad as exc:
            out.append((text[start:], name, '', f'the call is not XML call syntax: {exc}'))
            return out
        except _BadValue as exc:
            out.append((text[start:], name, '', str(exc)))
            return out


def _function(text: str, i: int, tools: Mapping[str, ToolSpec]
              ) -> Tuple[str, Dict[str, Any], int]:
    """Read one function block from text[i] ('<function='); return (name, args, end)."""
    end = text.find('>', i)
    if end < 0:
        raise _Bad('<function= without its closing >')
    name = text[i + len(_FUNCTION):end].strip()
    if not name or '\n' in name:
        raise _Bad(f'no tool name in {text[i:end + 1]!r}')
    props = _params_schema(tools.get(name))
    args: Dict[str, Any] = {}
    i = end + 1
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return name, args, i   # the close marker ended it without </function>
        if text.startswith(_END_FUNCTION, i):
            return name, args, i + len(_END_FUNCTION)
        if not text.startswith(_PARAMETER, i):
            raise _Bad(f'expected <parameter=NAME> or </function> at {text[i:i + 20]!r}')
        end = text.find('>', i)
        if end < 0:
            raise _Bad('<parameter= without its closing >')
        key = text[i + len(_PARAMETER):end].strip()
        close = text.find(_END_PARAMETER, end + 1)
        if not key or close < 0:
            raise _Bad(f'parameter {key!r} of {name} has no name or no {_END_PARAMETER}')
        if key in args:
            raise _Bad(f'parameter {key} of {name} given twice')
        raw = text[end + 1:close]
        raw = raw[1:] if raw.startswith('\n') else raw
        raw = raw[:-1] if raw.endswith('\n') else raw
        value, error = typed_value(raw, schema_types(props.get(key)))
        if error:
            raise _BadValue(f'argument {key} of {name} {error}')
        args[key] = value
        i = close + len(_END_PARAMETER)
