"""Streaming tool-call parser: model text in, user-visible text and call deltas out.

Fed the text deltas of a generation (after the reasoning splitter), it keeps markup out of
the answer: text outside calls comes back as `text`; each call comes back as a first delta
with its id and name, then argument deltas, the raw JSON text of the arguments object as the
model writes it (joined, they are exactly `ToolCall.arguments`). Markers split across deltas
are held back until they can be told apart from text.

A run of calls starts at one of the format's open markers (e.g. `<tool_call>`) anywhere, or at
one of its start markers (e.g. a bare `{`) at the very start of the output; the run holds JSON
objects, separated by whitespace, commas, semicolons or wrapped in an array. A bare JSON
answer that is not a call (no known tool name) is given back as text. Calls that do not
parse or do not validate against their tool's schema end up in `invalid` with the reason;
under a tool constraint (see tools.grammar) that cannot happen.

Formats with `python_calls` (LFM2) also take a Python call list in the run instead of JSON:
`[move_to(x=1.5, frame="map"), stop()]`. It is read whole at the close marker (with `ast`,
nothing evaluated: keyword arguments whose values are literals), so its calls are announced
there, each with its arguments in one delta (JSON text, as for JSON calls). Gemma 4's
call:name{...} (gemma4_calls) and Qwen3.5's <function=NAME><parameter=KEY>... (xml_calls) are
read the same way.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
import json
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from edge_llm_ros.runtime.tools.formats import ARG_KEYS, ToolFormat
from edge_llm_ros.runtime.tools.spec import new_call_id, ToolCall, ToolSpec, validate_arguments
from edge_llm_ros.runtime.tools.xml_calls import xml_calls

_SEPARATORS = frozenset(' \t\r\n,;[]`')
_ENDED_INSIDE = 'the output ended inside a tool call (max_tokens reached?)'


@dataclass(frozen=True)
class ToolCallDelta:
    """Part of call `index`: the first delta has id and name, later ones argument text."""

    index: int
    id: str = ''  # noqa: A003 - OpenAI's field name
    name: str = ''
    arguments: str = ''


@dataclass(frozen=True)
class ParsedDelta:
    text: str = ''
    tool_calls: Tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True)
class InvalidToolCall:
    raw: str      # the JSON text the model wrote
    error: str


@dataclass
class _Obj:
    """One JSON object being scanned (see ToolCallParser._object_char)."""

    buf: List[str] = field(default_factory=list)
    depth: int = 0
    in_str: bool = False
    esc: bool = False
    expect: str = 'key'        # at depth 1: key | colon | value | next
    key: str = ''
    str_start: int = -1        # where the current depth-1 string began
    value_start: int = -1
    name: Optional[str] = None
    args_start: int = -1       # where the arguments object begins in buf
    args_end: int = -1         # one past its end, once closed
    index: int = -1            # call index once announced
    emitted: int = -1          # buf position up to which arguments were emitted


class ToolCallParser:
    """See the module docstring. feed() per delta, finish() once, then result()."""

    def __init__(self, fmt: ToolFormat, tools: Sequence[ToolSpec] = (),
                 id_factory: Optional[Callable[[], str]] = None) -> None:
        self._fmt = fmt
        self._tools: Dict[str, ToolSpec] = {t.name: t for t in tools}
        self._new_id = id_factory or (lambda: new_call_id(fmt.id_style))
        self._mode = 'text'
        self._held = ''
        self._at_start = True      # nothing but whitespace so far
        self._after_call = False   # whitespace after a run of calls is dropped
        self._bare = False         # the run began at a start marker (may prove to be text)
        self._bare_text = ''
        self._obj: Optional[_Obj] = None
        # What a run held before its first call (separators), None once a JSON call began:
        # a Python call list is read from there, '[' included.
        self._lead: Optional[str] = None
        self._py: List[str] = []   # the Python call list read so far
        self._announced = 0
        self._ids: Dict[int, str] = {}
        self.calls: List[ToolCall] = []
        self.invalid: List[InvalidToolCall] = []
        self._text: List[str] = []
        self._deltas: List[ToolCallDelta] = []
        self._finished = False

    # --- public ------------------------------------------------------------------------------
    def feed(self, delta: str) -> ParsedDelta:
        if self._finished:
            raise RuntimeError('feed() after finish()')
        text, self._held = self._held + delta, ''
        i = 0
        while i < len(text):
            if self._mode == 'text':
                i = self._scan_text(text, i)
            elif self._mode == 'python':
                i = self._scan_python(text, i)
            else:
                i = self._scan_calls(text, i)
        return self._take()

    def finish(self) -> ParsedDelta:
        """End of output: release held text, close or reject an unfinished call."""
        if self._finished:
            return ParsedDelta()
        self._finished = True
        held, self._held = self._held, ''
        obj = self._obj
        if self._mode == 'calls' and obj is not None:
            raw = ''.join(obj.buf)
            self._obj = None
            if not self._give_back(raw + held):
                self.invalid.append(InvalidToolCall(raw, _ENDED_INSIDE))
        elif self._mode == 'python':
            # No close marker: a list that reads whole is kept, as a finished JSON call is.
            self._python_done(''.join(self._py) + held, closed=False)
        elif self._mode == 'calls':
            self._give_back(held)
        elif self._mode == 'text' and not (self._after_call and not held.strip()):
            self._text.append(held)
        return self._take()

    # --- text mode ---------------------------------------------------------------------------
    def _scan_text(self, text: str, i: int) -> int:
        fmt = self._fmt
        rest = text[i:]
        if self._at_start or self._after_call:
            stripped = rest.lstrip()
            if not stripped:
                self._held = rest
                return len(text)
            markers = fmt.open_markers + (fmt.start_markers if self._at_start else ())
            for m in sorted(markers, key=len, reverse=True):
                if stripped.startswith(m):
                    skip = len(rest) - len(stripped)
                    return self._enter_calls(text, i, i + skip, m)
                if m.startswith(stripped):
                    self._held = rest
                    return len(text)
            if self._after_call:
                self._text.append(rest[:len(rest) - len(stripped)])
            self._at_start = self._after_call = False
            i += len(rest) - len(stripped)
            rest = text[i:]
        found = [(rest.find(m), m) for m in fmt.open_markers if m in rest]
        if found:
            at, marker = min(found)
            self._text.append(rest[:at])
            return self._enter_calls(text, i + at, i + at, marker)
        keep = _partial_suffix(rest, fmt.open_markers)
        self._text.append(rest[:len(rest) - keep])
        self._held = rest[len(rest) - keep:]
        return len(text)

    def _enter_calls(self, text: str, start: int, at: int, marker: str) -> int:
        self._mode = 'calls'
        self._lead = ''
        self._bare = marker in self._fmt.start_markers and self._at_start
        self._at_start = self._after_call = False
        # A bare '{' or '[{' is the JSON itself; other markers are consumed.
        end = at if marker[0] in '{[' and marker in self._fmt.start_markers else at + len(marker)
        # What a bare run consumed before its first object: given back if it is not a call.
        self._bare_text = text[start:end] if self._bare else ''
        return end

    # --- calls mode --------------------------------------------------------------------------
    def _scan_calls(self, text: str, i: int) -> int:
        close = self._fmt.close
        while i < len(text):
            if self._obj is not None:
                self._object_char(text[i])
                i += 1
                continue
            if close and text.startswith(close, i):
                self._mode, self._after_call = 'text', True
                return i + len(close)
            if close and close.startswith(text[i:]):
                self._held = text[i:]
                return len(text)
            c = text[i]
            if c == '{':
                self._lead = None
                self._obj = _Obj()
                self._object_char(c)
            elif self._lead is not None and (
                    (self._fmt.python_calls or self._fmt.gemma4_calls) and c.isidentifier()
                    or self._fmt.xml_calls and c == '<'):
                self._mode = 'python'
                self._py = [self._lead]
                return i
            elif c not in _SEPARATORS:
                # Text after the calls: back to the answer (a format without a close marker).
                self._mode = 'text'
                self._after_call = bool(self.calls)
                self._give_back('')
                return i
            else:
                if self._bare:
                    self._bare_text += c
                if self._lead is not None:
                    self._lead += c
            i += 1
        self._flush_arguments()
        return i

    def _scan_python(self, text: str, i: int) -> int:
        """Collect a Python call list up to the close marker, then read it."""
        close = self._fmt.close
        rest = text[i:]
        at = rest.find(close)
        if at < 0:
            keep = _partial_suffix(rest, (close,))
            self._py.append(rest[:len(rest) - keep])
            self._held = rest[len(rest) - keep:]
            return len(text)
        self._python_done(''.join(self._py) + rest[:at], closed=True)
        self._mode, self._after_call = 'text', True
        return i + at + len(close)

    def _python_done(self, source: str, closed: bool) -> None:
        """Record the calls of a Python call list; report each bad one."""
        self._py = []
        try:
            if self._fmt.xml_calls:
                calls = [PythonCall(*c) for c in xml_calls(source, self._tools)]
            elif self._fmt.gemma4_calls:
                calls = gemma4_python_calls(source)
            else:
                calls = python_calls(source)
        except ValueError as exc:
            syntax = ('XML call syntax' if self._fmt.xml_calls else 'Gemma 4 call syntax'
                      if self._fmt.gemma4_calls else 'valid Python')
            error = f'the tool calls are not {syntax}: {exc}' if closed else _ENDED_INSIDE
            self.invalid.append(InvalidToolCall(source.strip(), error))
            return
        for call in calls:
            error = (self._unknown_tool(call.name) if call.name else '') or call.error
            if error and call.error and not closed and self._fmt.xml_calls:
                error = _ENDED_INSIDE   # an XML call cut short reads as a bad one
            if not error:  # validate what the call carries (tuples as lists, as JSON has)
                error = self._arguments_problem(call.name, json.loads(call.arguments))
            if error:
                self.invalid.append(InvalidToolCall(call.raw, error))
            else:
                self._accept(_Obj(name=call.name), call.name, call.arguments)

    def _object_char(self, c: str) -> None:
        o = self._obj
        o.buf.append(c)
        pos = len(o.buf) - 1
        if o.in_str:
            if o.esc:
                o.esc = False
            elif c == '\\':
                o.esc = True
            elif c == '"':
                o.in_str = False
                if o.depth == 1:
                    self._string_closed(o, pos)
            return
        if c.isspace():
            return
        if o.depth == 1 and o.expect == 'value' and o.value_start < 0:
            o.value_start = pos
            if o.key in ARG_KEYS and c == '{':
                o.args_start = pos
        if c == '"':
            o.in_str = True
            if o.depth == 1:
                o.str_start = pos
        elif c in '{[':
            o.depth += 1
        elif c in '}]':
            o.depth -= 1
            if o.depth == 1 and o.args_start >= 0 and o.args_end < 0 and o.key in ARG_KEYS:
                o.args_end = pos + 1
            if o.depth == 0:
                self._object_done()
        elif o.depth == 1 and c == ':':
            o.expect, o.value_start = 'value', -1
        elif o.depth == 1 and c == ',':
            o.expect, o.key = 'key', ''

    def _string_closed(self, o: _Obj, pos: int) -> None:
        literal = ''.join(o.buf[o.str_start:pos + 1])
        try:
            value = json.loads(literal)
        except ValueError:
            return
        if o.expect == 'key':
            o.key, o.expect = value, 'colon'
        elif o.expect == 'value' and o.key == 'name' and o.value_start == o.str_start:
            o.name = value
            self._announce(o)

    def _announce(self, o: _Obj) -> None:
        """Emit the first delta of a call once its name is a known tool (or any, tool-less)."""
        if o.index >= 0 or o.name is None or (self._tools and o.name not in self._tools):
            return
        o.index = self._announced
        self._announced += 1
        o.emitted = o.args_start if o.args_start >= 0 else -1
        self._ids[o.index] = self._new_id()
        self._deltas.append(ToolCallDelta(o.index, self._ids[o.index], o.name))

    def _flush_arguments(self) -> None:
        o = self._obj
        if o is None or o.index < 0 or o.args_start < 0:
            return
        if o.emitted < 0:
            o.emitted = o.args_start
        end = o.args_end if o.args_end >= 0 else len(o.buf)
        if end > o.emitted:
            self._deltas.append(ToolCallDelta(o.index, arguments=''.join(o.buf[o.emitted:end])))
            o.emitted = end

    def _object_done(self) -> None:
        o = self._obj
        raw = ''.join(o.buf)
        error, name, args_text = self._check(o, raw)
        if error and o.index < 0 and self._give_back(raw):
            # A bare JSON answer that is not a call: it is the answer's text.
            self._obj = None
            self._mode = 'text'
            return
        if error:
            self._obj = None
            self.invalid.append(InvalidToolCall(raw, error))
            return
        self._accept(o, name, args_text)
        self._obj = None

    def _accept(self, o: _Obj, name: str, args_text: str) -> None:
        """Record a valid call: announce it if not yet, emit what is left of its arguments."""
        if o.index < 0:
            self._announce(o)
        if o.args_start >= 0:
            self._flush_arguments()
        else:  # arguments not streamed (a JSON string, absent, a Python call): all at once
            self._deltas.append(ToolCallDelta(o.index, arguments=args_text))
        self.calls.append(ToolCall(self._ids[o.index], name, args_text))

    def _check(self, o: _Obj, raw: str) -> Tuple[str, str, str]:
        """(error or '', name, arguments text) of a complete object."""
        try:
            value = json.loads(raw)
        except ValueError as exc:
            return f'the tool call is not valid JSON: {exc}', '', ''
        name = value.get('name')
        if not isinstance(name, str):
            return 'the tool call has no "name"', '', ''
        unknown = self._unknown_tool(name)
        if unknown:
            return unknown, name, ''
        key = next((k for k in ARG_KEYS if k in value), None)
        args = value.get(key) if key else {}
        if o.args_start >= 0 and o.args_end >= 0:
            args_text = raw[o.args_start:o.args_end]
        elif isinstance(args, str):
            args_text = args
            try:
                args = json.loads(args)
            except ValueError:
                return f'arguments of {name} are not JSON', name, ''
        else:
            args_text = json.dumps(args)
        return self._arguments_problem(name, args), name, args_text

    def _unknown_tool(self, name: str) -> str:
        """Say that `name` is not a tool in scope ('' if it is, or if any name goes)."""
        if self._tools and name not in self._tools:
            return f'the model called unknown tool {name!r}'
        return ''

    def _arguments_problem(self, name: str, args: Any) -> str:
        """Say why `args` do not fit tool `name` ('' when they do)."""
        if not isinstance(args, dict):
            return f'arguments of {name} are not a JSON object'
        spec = self._tools.get(name)
        return (validate_arguments(spec, args) if spec is not None else None) or ''

    def _give_back(self, raw: str) -> bool:
        """Return a bare run that held no call to the text; False if it cannot be."""
        if not self._bare or self.calls or self.invalid or self._announced:
            return False
        self._text.append(self._bare_text + raw)
        self._bare = False
        self._bare_text = ''
        return True

    def _take(self) -> ParsedDelta:
        text = ''.join(self._text)
        deltas = tuple(self._deltas)
        self._text.clear()
        self._deltas.clear()
        return ParsedDelta(text, deltas)


def _partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker."""
    longest = max((len(m) for m in markers), default=0)
    for n in range(min(len(text), longest - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0


@dataclass(frozen=True)
class PythonCall:
    """One call of a Python call list: arguments as JSON text, or why it is refused."""

    raw: str            # the call as the model wrote it
    name: str = ''      # '' when the call names no tool
    arguments: str = ''
    error: str = ''


def python_calls(source: str) -> List[PythonCall]:
    """Read a Python call list (`[move_to(x=1, frame="map"), stop()]`) without running it.

    Each call must name a tool and pass keyword arguments whose values are literals JSON can
    hold (ast.literal_eval; tuples become lists); a call that does not gets its error. Raise
    ValueError with the reason when `source` is not one Python list of calls (or one call).
    """
    source = source.strip()
    try:
        tree = ast.parse(source, mode='eval').body
    except SyntaxError as exc:
        raise ValueError(exc.msg) from None
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes, nested too deeply
        raise ValueError(str(exc) or type(exc).__name__) from None
    if isinstance(tree, ast.Call):
        return [_python_call(source, tree)]
    if not isinstance(tree, ast.List):
        raise ValueError('expected a list of calls, e.g. [move_to(x=1), stop()]')
    return [_python_call(source, node) for node in tree.elts]


def _python_call(source: str, node: ast.expr) -> PythonCall:
    raw = ast.get_source_segment(source, node) or source
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return PythonCall(raw, error=f'{raw!r} is not a call of a tool by its name')
    name = node.func.id
    if node.args:
        return PythonCall(raw, name, error=f'the call to {name} passes arguments by position; '
                          f'name each one ({name}(arg=value))')
    args: Dict[str, Any] = {}
    for kw in node.keywords:
        if kw.arg is None or kw.arg in args:  # **mapping, or f(a=1, a=2) (ast.parse allows it)
            what = 'unpacks a mapping' if kw.arg is None else f'gives {kw.arg} twice'
            return PythonCall(raw, name, error=f'the call to {name} {what}')
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            value = ast.get_source_segment(source, kw.value)
            return PythonCall(raw, name, error=f'argument {kw.arg} of {name} is not a literal '
                              f'value: {value}')
    try:
        text = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return PythonCall(raw, name, error=f'arguments of {name} hold a value JSON cannot '
                          '(a set, bytes, complex or infinite number)')
    return PythonCall(raw, name, text)


def gemma4_python_calls(source: str) -> List[PythonCall]:
    """Read Gemma 4's call:name{...} calls (tools/gemma4_calls.py) as PythonCalls."""
    from edge_llm_ros.runtime.tools.gemma4_calls import gemma4_calls
    return [PythonCall(raw, name, args, error) for raw, name, args, error in gemma4_calls(source)]


def parse_all(text: str, fmt: ToolFormat, tools: Sequence[ToolSpec] = ()
              ) -> Tuple[str, List[ToolCall], List[InvalidToolCall]]:
    """Parse a whole output at once: (answer text, calls, invalid calls)."""
    parser = ToolCallParser(fmt, tools)
    out = [parser.feed(text).text, parser.finish().text]
    return ''.join(out), parser.calls, parser.invalid
