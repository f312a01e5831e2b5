"""Canonical JSON: the exact bytes that are signed (manifest.json, delta.json, *.sig).

Canonical form: UTF-8 JSON with sorted keys, no whitespace (separators ',' and ':'), ASCII
only (non-ASCII escaped), no trailing newline; values are objects, strings, integers
and booleans only (no floats: they have no single spelling). The signer writes these bytes
and the verifier checks the signature over the file's bytes *before* parsing them, then
refuses a file that is not canonical, so one content has exactly one signed spelling.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Tuple

from edge_llm_ros.update.errors import ManifestError, UnknownFieldError


def dumps(value: Any) -> bytes:
    """Return the canonical bytes of `value`."""
    return json.dumps(value, sort_keys=True, separators=(',', ':'),
                      ensure_ascii=True, allow_nan=False).encode('ascii')


def loads(data: bytes, what: str) -> Dict[str, Any]:
    """Parse canonical JSON holding an object; ManifestError saying why it is refused."""
    try:
        value = json.loads(data.decode('ascii'), object_pairs_hook=_no_duplicates,
                           parse_float=_no_float, parse_constant=_no_float)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ManifestError(f'{what} is not valid canonical JSON ({exc}); write it with '
                            'edge-llm-update') from None
    if not isinstance(value, dict):
        raise ManifestError(f'{what} must hold a JSON object, not {type(value).__name__}')
    if dumps(value) != data:
        raise ManifestError(f'{what} is not in canonical form (sorted keys, no whitespace, '
                            'no trailing newline): it was re-formatted after it was written; '
                            'sign it again with edge-llm-update')
    return value


def fields(obj: Any, required: Mapping[str, type], what: str) -> Dict[str, Any]:
    """Check that `obj` is an object with exactly the `required` keys and value types."""
    if not isinstance(obj, dict):
        raise ManifestError(f'{what} must be a JSON object, not {type(obj).__name__}')
    unknown = sorted(set(obj) - set(required))
    if unknown:
        raise UnknownFieldError(
            f'{what} has unknown field(s) {", ".join(unknown)} (this version knows '
            f'{", ".join(sorted(required))}): it was written by a newer or foreign tool; '
            'update edge_llm_ros or re-sign the folder with this version')
    missing = sorted(set(required) - set(obj))
    if missing:
        raise ManifestError(f'{what} lacks field(s) {", ".join(missing)}')
    for key, kind in required.items():
        value = obj[key]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise ManifestError(f'{what}.{key} must be an integer, not {value!r}')
        if kind is not int and not isinstance(value, kind):
            raise ManifestError(f'{what}.{key} must be a {kind.__name__}, not {value!r}')
    return obj


def _no_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f'duplicate key {key!r}')
        out[key] = value
    return out


def _no_float(text: str) -> Any:
    raise ValueError(f'number {text} is not an integer (floats are not allowed)')
