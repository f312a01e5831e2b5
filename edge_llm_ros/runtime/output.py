"""A sequence's output as it was emitted: the one copy that feedback and the result read.

The runtime appends one TokenEvent per generated token; the worker sends feedback from slices
of the same list (a cursor per goal), and the result's text, ids, reasoning and logprobs are
joined from it. Nothing else accumulates output, so the streamed text and the result cannot
disagree.
"""
from __future__ import annotations

from typing import List, Optional

from edge_llm_ros.runtime.types import TokenEvent


class Output:
    """TokenEvents in order (appended on the owner thread only)."""

    __slots__ = ('events',)

    def __init__(self) -> None:
        self.events: List[TokenEvent] = []

    def add(self, event: TokenEvent) -> None:
        self.events.append(event)

    def __len__(self) -> int:
        return len(self.events)

    def text(self, start: int = 0, end: Optional[int] = None) -> str:
        return ''.join(e.text_delta for e in self.events[start:end])

    def reasoning(self, start: int = 0, end: Optional[int] = None) -> str:
        return ''.join(e.reasoning_delta for e in self.events[start:end])

    def token_ids(self, start: int = 0, end: Optional[int] = None) -> List[int]:
        return [e.token_id for e in self.events[start:end]]

    def tool_call_deltas(self, start: int = 0, end: Optional[int] = None) -> tuple:
        return tuple(d for e in self.events[start:end] for d in e.tool_call_deltas)

    def logprobs(self) -> list:
        return [e.logprobs for e in self.events if e.logprobs is not None]
