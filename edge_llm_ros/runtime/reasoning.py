r"""Reasoning ("thinking") text kept out of the answer, and a token budget for it.

ReasoningSplitter is fed the text deltas of a generation and routes what lies between the
family's tags (e.g. <think> ... </think>) to `reasoning`, the rest to `text`. A block opens
only at the start of the output (after whitespace), where reasoning models put it, so an
answer that quotes the tag is left alone; it may also start open, when the chat template
wrote the open tag itself (DeepSeek-R1 distills). Tags split across deltas are held back
until complete; whitespace after the close tag is dropped (templates put "\n\n" there).

ReasoningBudget tells the generator, before each pick, whether to force the close tag
instead of sampling: once `budget` tokens were generated inside the block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

from edge_llm_ros.errors import InvalidRequestError
from edge_llm_ros.runtime.model_config import ReasoningConfig


@dataclass(frozen=True)
class SplitDelta:
    text: str = ''
    reasoning: str = ''


class ReasoningSplitter:
    """See the module docstring. feed() per delta, finish() once."""

    def __init__(self, config: ReasoningConfig, starts_open: bool = False) -> None:
        self._open = config.open_tag
        self._close = config.close_tag
        # before: may still open a block | inside | after: drop leading whitespace | text
        self._state = 'inside' if starts_open else 'before'
        self._held = ''
        self.closed = False        # a block was closed
        self.unterminated = False  # the output ended inside the block

    @property
    def in_reasoning(self) -> bool:
        """Whether the next token is generated inside the reasoning block."""
        return self._state == 'inside'

    def feed(self, delta: str) -> SplitDelta:
        text, self._held = self._held + delta, ''
        out_text, out_reasoning = [], []
        while text:
            if self._state == 'before':
                stripped = text.lstrip()
                if stripped.startswith(self._open):
                    self._state = 'inside'
                    text = stripped[len(self._open):]
                elif self._open.startswith(stripped):  # '' or a partial tag: wait
                    self._held = text
                    text = ''
                else:
                    self._state = 'text'
            elif self._state == 'inside':
                at = text.find(self._close)
                if at >= 0:
                    out_reasoning.append(text[:at])
                    text = text[at + len(self._close):]
                    self._state, self.closed = 'after', True
                else:
                    keep = _partial_suffix(text, self._close)
                    out_reasoning.append(text[:len(text) - keep])
                    self._held = text[len(text) - keep:]
                    text = ''
            elif self._state == 'after':
                text = text.lstrip()
                if text:
                    self._state = 'text'
            else:
                out_text.append(text)
                text = ''
        return SplitDelta(''.join(out_text), ''.join(out_reasoning))

    def finish(self) -> SplitDelta:
        """End of output: what was held back goes where it was heading."""
        held, self._held = self._held, ''
        if self._state == 'inside':
            self.unterminated = True
            return SplitDelta(reasoning=held)
        if self._state == 'before':
            return SplitDelta(text=held)
        return SplitDelta()


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def prompt_opens_reasoning(prompt: str, config: ReasoningConfig) -> bool:
    """Whether a rendered prompt ends inside an open block (the template opened it)."""
    tail = prompt.rstrip()
    return tail.endswith(config.open_tag) or (
        config.open_tag in tail and config.close_tag not in tail[tail.rfind(config.open_tag):])


class ReasoningBudget:
    """Forces the close tag once `budget` tokens were generated inside the block."""

    def __init__(self, budget: int, close_ids: Sequence[int]) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise InvalidRequestError(f'reasoning_budget must be an integer >= 0, got '
                                      f'{budget!r}')
        if not close_ids:
            raise InvalidRequestError('the close tag encodes to no tokens; check the model '
                                      'config reasoning.force_close_text')
        self.budget = budget
        self.close_ids: Tuple[int, ...] = tuple(int(i) for i in close_ids)
        self.used = 0
        self.forced = False

    def before_pick(self, in_reasoning: bool) -> Tuple[int, ...]:
        """Call before each token: () to sample as usual, else the ids to feed in order."""
        if not in_reasoning or self.forced:
            return ()
        if self.used >= self.budget:
            self.forced = True
            return self.close_ids
        self.used += 1
        return ()


def close_ids(tokenizer, config: ReasoningConfig) -> Tuple[int, ...]:
    """Return the token ids of the family's forced close text (e.g. a newline, </think>)."""
    return tuple(tokenizer.encode(config.force_close_text))
