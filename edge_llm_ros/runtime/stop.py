"""Stop strings matched across token boundaries in streamed text."""
from __future__ import annotations

from typing import Iterable, Tuple

from edge_llm_ros.errors import InvalidRequestError


class StopMatcher:
    """Feeds text deltas through; stops at the first occurrence of any stop string.

    Text that might be the start of a stop string is held back, but only the longest suffix that
    is a prefix of some stop string, so output lags by as little as possible.  The stop string
    itself is never emitted.  Emitted text (plus `flush()` at the end) equals the text up to the
    first stop string found in the whole text at once, however the text was split: a stop found
    while a longer one that starts earlier may still complete waits for the next delta.
    """

    def __init__(self, stop_strings: Iterable[str]) -> None:
        stops = []
        for s in stop_strings:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError('stop strings must be non-empty text; remove the empty '
                                          'entry')
            if s not in stops:
                stops.append(s)
        self._stops: Tuple[str, ...] = tuple(stops)
        self._longest = max((len(s) for s in stops), default=0)
        self._held = ''
        self.stopped = False
        self.matched = ''  # the stop string that ended the text

    @property
    def stop_strings(self) -> Tuple[str, ...]:
        return self._stops

    def feed(self, delta: str) -> Tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was reached)."""
        if self.stopped:
            return '', True
        if not self._stops:
            return delta, False
        text = self._held + delta
        cut, matched = self._first_stop(text)
        partial = self._partial_start(text)
        if matched and partial >= cut:
            return self._stop(text, cut, matched), True
        # Either no stop yet, or a longer stop string starting earlier may still complete:
        # emit up to where a stop string could begin, hold the rest.
        self._held = text[partial:]
        return text[:partial], False

    def flush(self) -> str:
        """End of text: release the held-back text (up to a stop string found in it)."""
        if self.stopped:
            return ''
        text, self._held = self._held, ''
        cut, matched = self._first_stop(text)
        return self._stop(text, cut, matched) if matched else text

    def _stop(self, text: str, cut: int, matched: str) -> str:
        self._held = ''
        self.stopped = True
        self.matched = matched
        return text[:cut]

    def _first_stop(self, text: str) -> Tuple[int, str]:
        best, matched = len(text), ''
        for s in self._stops:
            i = text.find(s)
            if i != -1 and (i < best or (i == best and len(s) > len(matched))):
                best, matched = i, s
        return best, matched

    def _partial_start(self, text: str) -> int:
        """Start of the longest suffix of `text` that is a proper prefix of a stop string."""
        for n in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-n:]
            if any(len(s) > n and s.startswith(tail) for s in self._stops):
                return len(text) - n
        return len(text)
