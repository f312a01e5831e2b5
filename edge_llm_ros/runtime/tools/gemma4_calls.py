"""Read Gemma 4's native tool calls: `call:name{key:value,...}` (config/models/gemma4.yaml).

What its chat template writes for a call (and the model learnt): the tool's name after
`call:`, then its arguments as `key:value` pairs in braces, keys bare, strings between
`<|"|>` marks, numbers, true/false/null, lists `[...]` and objects `{key:value,...}` (keys
bare or marked). Nothing is evaluated; each call's arguments come back as JSON text, or the
reason it cannot be read.
"""
from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Tuple

QUOTE = '<|"|>'
_NAME = re.compile(r'[A-Za-z_][A-Za-z0-9_.\-]*')
_NUMBER = re.compile(r'-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?')
_WORDS = {'true': True, 'false': False, 'null': None}
_MAX_DEPTH = 64


class _Bad(ValueError):
    """The call text does not follow Gemma 4's call syntax (the message says where)."""


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.i = 0

    def fail(self, what: str) -> None:
        raise _Bad(f'{what} at character {self.i}: {self.text[self.i:self.i + 20]!r}')

    def skip(self) -> None:
        while self.i < len(self.text) and self.text[self.i].isspace():
            self.i += 1

    def take(self, s: str) -> bool:
        self.skip()
        if self.text.startswith(s, self.i):
            self.i += len(s)
            return True
        return False

    def name(self) -> str:
        self.skip()
        m = _NAME.match(self.text, self.i)
        if not m:
            self.fail('expected a name')
        self.i = m.end()
        return m.group()

    def string(self) -> str:
        end = self.text.find(QUOTE, self.i)
        if end < 0:
            self.fail('a string without its closing <|"|>')
        out = self.text[self.i:end]
        self.i = end + len(QUOTE)
        return out

    def key(self) -> str:
        return self.string() if self.take(QUOTE) else self.name()

    def pairs(self, depth: int) -> Dict[str, Any]:
        """Read `key:value,...}` after an opening brace."""
        out: Dict[str, Any] = {}
        if self.take('}'):
            return out
        while True:
            k = self.key()
            if k in out:
                self.fail(f'argument {k} given twice')
            if not self.take(':'):
                self.fail(f'expected : after {k}')
            out[k] = self.value(depth + 1)
            if self.take('}'):
                return out
            if not self.take(','):
                self.fail('expected , or }')

    def value(self, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            self.fail('values nested too deeply')
        self.skip()
        if self.take(QUOTE):
            return self.string()
        if self.take('{'):
            return self.pairs(depth)
        if self.take('['):
            items: List[Any] = []
            if self.take(']'):
                return items
            while True:
                items.append(self.value(depth + 1))
                if self.take(']'):
                    return items
                if not self.take(','):
                    self.fail('expected , or ]')
        m = _NUMBER.match(self.text, self.i)
        if m:
            self.i = m.end()
            return json.loads(m.group())
        for word, v in _WORDS.items():
            if self.text.startswith(word, self.i):
                self.i += len(word)
                return v
        self.fail('expected a value')


def gemma4_calls(source: str) -> List[Tuple[str, str, str, str]]:
    """Read the calls in `source` (one or more `call:name{...}`).

    Returns (raw, name, arguments as JSON text, error) per call; raises ValueError when the
    text is not a call at all.
    """
    r = _Reader(source.strip())
    out = []
    while True:
        r.skip()
        if r.i >= len(r.text):
            break
        start = r.i
        if not r.take('call:'):
            if not out:
                raise ValueError('expected call:name{...}')
            r.fail('expected call:')
        name = ''
        try:
            name = r.name()
            if not r.take('{'):
                r.fail(f'expected {{ after {name}')
            args = r.pairs(0)
            out.append((r.text[start:r.i], name, json.dumps(args, ensure_ascii=False), ''))
        except _Bad as exc:
            out.append((r.text[start:], name, '', f'the call is not Gemma 4 call syntax: {exc}'))
            break
    return out
