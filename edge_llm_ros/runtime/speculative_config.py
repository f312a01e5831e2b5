"""Speculative decoding settings (runtime/speculative.py runs them; node parameters set them).

Kept apart from speculative.py so that building the settings loads no onnxruntime; the modes
themselves are runtime/choices.py's.
"""
from __future__ import annotations

from dataclasses import dataclass

from edge_llm_ros.errors import ModelLoadError
from edge_llm_ros.runtime.choices import SPECULATIVE_MODES


class SpeculativeConfigError(ModelLoadError):
    """The speculative settings cannot run with this model (configure fails with it)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates (node parameters speculative.*)."""

    mode: str = 'off'
    max_draft: int = 6          # drafted tokens per verify pass, at most
    draft_model: str = ''       # a converted folder (mode draft, or auto with one)
    ngram_max: int = 3          # prompt lookup: longest context suffix matched
    ngram_min: int = 1
    # auto: passes a sequence speculates before its rate is judged against break-even
    auto_probe: int = 4

    def check(self) -> None:
        """Raise SpeculativeConfigError for settings that cannot mean anything."""
        if self.mode not in SPECULATIVE_MODES:
            raise SpeculativeConfigError(f'speculative.mode {self.mode!r} is not one of '
                                         f'{", ".join(SPECULATIVE_MODES)}')
        if not 1 <= self.max_draft <= 32:
            raise SpeculativeConfigError(f'speculative.max_draft {self.max_draft} must be '
                                         '1..32')
        if self.mode == 'draft' and not self.draft_model:
            raise SpeculativeConfigError('speculative.mode draft needs speculative.draft_model '
                                         '(a converted model folder with the same tokenizer)')
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise SpeculativeConfigError(f'speculative n-gram sizes {self.ngram_min}..'
                                         f'{self.ngram_max} must satisfy 1 <= min <= max')
