"""The constraint that makes tool calls valid: a llguidance Lark grammar per request.

Each call is `%json {...}` (llguidance's inline JSON Schema) for an object whose "name" is
one of the tools in scope and whose arguments validate against that tool's schema, wrapped in
the family's markers. With tool_choice `required` or a named tool the whole output is calls;
with `auto` the output is free text in which the family's trigger (e.g. `<tool_call>`) starts
forced calls, which then end the output (as OpenAI's API has it: text, then calls), so the
constraint engages at the trigger; formats whose calls are a bare JSON answer (llama3_json,
generic_json) engage when the answer starts with `{`. A reasoning block
may come first (its close tag ends it; a template that opens it makes it mandatory).

Small models loop (the same word until max_tokens, call after call), which would leave a
call unfinished. So the forced calls get generous bounds where the schema sets none: a free
string at most MAX_FREE_STRING characters, an array at most MAX_FREE_ITEMS items, a run at
most MAX_PARALLEL_CALLS calls. Whatever is written still validates against the tool's own
schema; a schema's own bounds are kept.

The generator uses the result like any other constraint (constraint.GrammarConstraint):
start() per generation, fill_mask / accept per token, is_finished to stop after the calls.
Free text costs llguidance a few microseconds per token (measured on SmolLM2's 49k vocab).
"""
from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Optional, Sequence

from edge_llm_ros.runtime.constraint import (compile_grammar, compile_lark, GrammarConstraint,
                                             InvalidGrammarError, JSON_OPTIONS, ll_tokenizer)
from edge_llm_ros.runtime.model_config import ReasoningConfig
from edge_llm_ros.runtime.tokenizer import TextTokenizer
from edge_llm_ros.runtime.tools.formats import ToolFormat
from edge_llm_ros.runtime.tools.spec import InvalidToolsError, ToolChoice, tools_in_scope, ToolSpec


MAX_FREE_STRING = 128     # characters of a string argument whose schema sets no bound
MAX_FREE_ITEMS = 32       # items of an array argument whose schema sets no maxItems
MAX_PARALLEL_CALLS = 4    # calls in one run (parallel_tool_calls)


def call_schema(tool: ToolSpec, args_key: str) -> Dict[str, Any]:
    """JSON Schema of one call object: {"name": <const>, args_key: <the tool's schema>}.

    The tool's schema becomes a subschema, so its local $refs ("#/...") are re-rooted. Objects
    that do not say whether other keys are allowed get none (as OpenAI's strict mode does): a
    model is not led into inventing keys, and what it writes still validates against the
    tool's own schema. Free strings and arrays get bounds (see the module docstring).
    """
    args = _reroot(_closed(dict(tool.parameters)), f'#/properties/{args_key}')
    return {'type': 'object',
            'properties': {'name': {'const': tool.name}, args_key: args},
            'required': ['name', args_key], 'additionalProperties': False,
            'x-guidance': JSON_OPTIONS}


_SUBSCHEMA_MAPS = ('properties', '$defs', 'definitions')
_SUBSCHEMA_LISTS = ('anyOf', 'oneOf', 'prefixItems')


def _closed(schema: Any) -> Any:
    """Close objects that leave additionalProperties open (see call_schema)."""
    if not isinstance(schema, dict) or 'allOf' in schema:
        return schema  # closing parts of an allOf would reject every instance
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _closed(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(v) for v in out[key]]
    if isinstance(out.get('items'), dict):
        out['items'] = _closed(out['items'])
    is_object = out.get('type') == 'object' or 'properties' in out
    if is_object and 'additionalProperties' not in out and 'patternProperties' not in out:
        out['additionalProperties'] = False
    if out.get('type') == 'string' and not _STRING_BOUNDS.intersection(out):
        out['maxLength'] = MAX_FREE_STRING
    if out.get('type') == 'array' and 'maxItems' not in out:
        out['maxItems'] = max(MAX_FREE_ITEMS, out.get('minItems', 0))
    return out


# A string with any of these is bounded by them (or its content is the schema's business).
_STRING_BOUNDS = frozenset(('maxLength', 'enum', 'const', 'pattern', 'format'))


def _reroot(value: Any, base: str) -> Any:
    if isinstance(value, dict):
        return {k: (base + v[1:] if k == '$ref' and isinstance(v, str) and v.startswith('#')
                    else _reroot(v, base)) for k, v in value.items()}
    if isinstance(value, list):
        return [_reroot(v, base) for v in value]
    return value


_MORE = f'{{0,{MAX_PARALLEL_CALLS - 1}}}'  # Lark repetition: the calls after the first


def tool_grammar(tools: Sequence[ToolSpec], choice: ToolChoice, fmt: ToolFormat,
                 tokenizer: TextTokenizer, reasoning: Optional[ReasoningConfig] = None,
                 starts_open: bool = False, parallel: bool = True) -> Optional[str]:
    """Lark text of the tool constraint, or None when nothing is constrained ('none')."""
    scope = tools_in_scope(tools, choice)
    if not scope:
        return None
    lit = _Literals(tokenizer, [m for m in (*fmt.open_markers, fmt.close) if m])
    rules: List[str] = []
    alts = ' | '.join(f'call_{i}' for i in range(len(scope)))
    rules += [f'call_{i}: %json {json.dumps(call_schema(t, fmt.args_key))}'
              for i, t in enumerate(scope)]
    rules.append(f'call: {alts}')
    one = f'{lit(fmt.call_prefix)} call {lit(fmt.call_suffix)}'.strip()
    if fmt.name == 'mistral':
        more = f' ("," " " call){_MORE}' if parallel else ''
        rules.append(f'calls: {lit("[TOOL_CALLS]")} "[" call{more} "]"')
    else:
        more = f' ({lit(fmt.separator)} {one}){_MORE}' if parallel else ''
        rules.append(f'calls: {one}{more}')
    prefix = ''
    if reasoning is not None and (starts_open or choice.mode != 'auto'):
        prefix = _reasoning_prefix(rules, lit, reasoning, starts_open)
    if choice.mode != 'auto':
        rules.insert(0, f'start: {prefix}calls')
    elif '{' not in fmt.start_markers:
        # Free text, or text up to the trigger and then only calls: the output ends with them.
        trigger = fmt.open_markers[0]
        rules.insert(0, f'start: {prefix}(TAIL | {_until(trigger, lit, rules)} after)')
        rules.append(f'after: {_after_marker(fmt, lit, parallel)}')
        rules.append('TAIL: /(?s:.*)/')
    else:
        # The answer is either a call (it starts with '{') or text that does not.
        rules.insert(0, f'start: {prefix}(calls | FREE)?')
        rules.append(r'FREE: /[^{](?s:.*)/')
    return '\n'.join(rules) + '\n'


def _after_marker(fmt: ToolFormat, lit: '_Literals', parallel: bool) -> str:
    """Write what follows the trigger in auto mode: the first call's rest, more calls."""
    if fmt.name == 'mistral':
        more = f' ("," " " call){_MORE}' if parallel else ''
        return f'"[" call{more} "]"'
    rest = fmt.call_prefix[len(fmt.open_markers[0]):]
    first = ' '.join(p for p in (lit(rest), 'call', lit(fmt.call_suffix)) if p)
    one = ' '.join(p for p in (lit(fmt.call_prefix), 'call', lit(fmt.call_suffix)) if p)
    return f'{first} ({lit(fmt.separator)} {one}){_MORE}' if parallel else first


def _reasoning_prefix(rules: List[str], lit: '_Literals', reasoning: ReasoningConfig,
                      starts_open: bool) -> str:
    """Add the rules of a reasoning block; return what `start` puts before the output."""
    rules.append(f'think_rest: {_until(reasoning.close_tag, lit, rules)} WS?')
    rules.append(r'WS: /[ \t\r\n]+/')
    return 'think_rest ' if starts_open else f'({lit(reasoning.open_tag)} think_rest)? '


def with_reasoning(constraint: GrammarConstraint, tokenizer: TextTokenizer,
                   reasoning: ReasoningConfig, starts_open: bool) -> GrammarConstraint:
    """Let a reasoning block come before what `constraint` forces.

    Without this, a JSON schema on a model whose template opened <think> would force JSON
    inside the reasoning. The block is mandatory when the template opened it, else optional.
    """
    lit = _Literals(tokenizer, (reasoning.open_tag, reasoning.close_tag))
    rules: List[str] = []
    prefix = _reasoning_prefix(rules, lit, reasoning, starts_open)
    rules.insert(0, f'start: {prefix}@inner')
    grammars = _grammar_list(constraint.grammar)
    grammars = [{'lark_grammar': '\n'.join(rules) + '\n'}, dict(grammars[0], name='inner'),
                *grammars[1:]]
    return compile_grammar(json.dumps({'grammars': grammars}), tokenizer, constraint.kind,
                           'reasoning-wrapped constraint')


def _grammar_list(grammar: str) -> List[Dict[str, Any]]:
    """Return the grammar list of a compiled constraint (Lark text is one grammar)."""
    try:
        return list(json.loads(grammar)['grammars'])
    except (ValueError, TypeError, KeyError):
        return [{'lark_grammar': grammar}]


def _until(marker: str, lit: '_Literals', rules: List[str]) -> str:
    """Return a rule body matching any text up to and including `marker`."""
    special = lit.special_id(marker)
    if special is not None:
        if not any(r.startswith('ANY_TEXT:') for r in rules):
            rules.append('ANY_TEXT: /(?s:.*)/')
        return f'ANY_TEXT <[{special}]>'
    name = f'upto_{len(rules)}'
    escaped = re.escape(marker).replace('/', '\\/')
    rules.append(f'{name}[lazy]: /(?s:.*){escaped}/')
    return name


class _Literals:
    """Grammar literals: markers that are special tokens by id, other text quoted."""

    def __init__(self, tokenizer: TextTokenizer, markers: Sequence[str]) -> None:
        self._tok = tokenizer
        self._ll = ll_tokenizer(tokenizer)
        self._split = re.compile('(' + '|'.join(map(re.escape, markers)) + ')') if markers \
            else None

    def special_id(self, text: str) -> Optional[int]:
        ids = self._tok.encode(text) if text else []
        if len(ids) == 1 and self._ll.is_special_token(ids[0]):
            return ids[0]
        return None

    def __call__(self, text: str) -> str:
        """Return a grammar sequence for `text` ('' for no text)."""
        pieces = self._split.split(text) if self._split else [text]
        out = []
        for piece in filter(None, pieces):
            special = self.special_id(piece)
            out.append(f'<[{special}]>' if special is not None else json.dumps(piece))
        return ' '.join(out)


def compile_tool_constraint(tools: Sequence[ToolSpec], choice: ToolChoice, fmt: ToolFormat,
                            tokenizer: TextTokenizer,
                            reasoning: Optional[ReasoningConfig] = None,
                            starts_open: bool = False,
                            parallel: bool = True) -> Optional[GrammarConstraint]:
    """Compile tool_grammar once per request (None for tool_choice 'none').

    A tool schema llguidance cannot compile raises InvalidToolsError with its message.
    """
    grammar = tool_grammar(tools, choice, fmt, tokenizer, reasoning, starts_open, parallel)
    if grammar is None:
        return None
    try:
        return compile_lark(grammar, tokenizer, kind='tools')
    except InvalidGrammarError as exc:
        raise InvalidToolsError(f'the tool schemas cannot be used for constrained decoding: '
                                f'{exc}') from None
