"""Regression thresholds: what counts as a regression when a replay is compared.

The dataclass defaults are the shipped defaults; config/regression_thresholds.yaml is
the same values with comments, as a starting point for a team's own file.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
import os
from typing import Any

import yaml

from edge_llm_ros.regression.errors import ThresholdsError


# Field metadata of settings that are fractions: a value above 1 could never be met.
_FRACTION = {'max': 1.0}


@dataclass(frozen=True)
class OutputThresholds:
    # A greedy goal (temperature 0 after node defaults) must give the same token ids.
    greedy_exact_match: bool = True
    # Sampled goals: normalized edit-distance similarity (0..1) of the texts below this
    # is a regression. Sampled text legitimately changes between builds: keep it low.
    min_sampled_similarity: float = field(default=0.3, metadata=_FRACTION)
    # A schema goal whose recorded answer was valid JSON (of its schema) must stay valid.
    json_must_stay_valid: bool = True
    # A changed finish reason (stop -> length, ...) is a regression.
    finish_reason_change: bool = True
    # The node applied other sampling defaults (effective_sampling differs).
    effective_sampling_change: bool = True
    # A goal accepted in the recording but rejected/failed now.
    new_failures: bool = True
    # Tool calls: the same tool names in the same order, and arguments that were valid JSON
    # (for the tool's parameters schema) stay valid. On every CPU: this is not numerics.
    tool_calls_must_stay_valid: bool = True
    # Greedy goals replayed on another or an unknown CPU class (docs/regression.md,
    # "Replaying on another machine"): float drift may flip a near-tie token. The output
    # passes (with a warning) when its first differing token (a cut or extended answer is
    # no drift) comes no earlier than this fraction of the recorded tokens...
    cross_cpu_min_token_agreement: float = field(default=0.5, metadata=_FRACTION)
    # ...though never more leading tokens than this are required (0 = no cap)...
    cross_cpu_max_required_tokens: int = 16
    # ...and the normalized edit-distance similarity of the texts is at least this.
    cross_cpu_min_similarity: float = field(default=0.4, metadata=_FRACTION)


@dataclass(frozen=True)
class LatencyThresholds:
    # Off when the recording comes from another machine: latency is then not comparable.
    enabled: bool = True
    # Median time to first token may grow to old * ratio + slack (seconds).
    max_ttft_ratio: float = 1.5
    ttft_slack_s: float = 0.05
    # Median decode tokens/s may drop to old * ratio.
    min_decode_tps_ratio: float = 0.67
    # Median prefill tokens/s may drop to old * ratio (0 disables).
    min_prefill_tps_ratio: float = 0.0
    # Fewer goals with timings than this in both runs: latency is reported, not gated.
    min_goals: int = 3


@dataclass(frozen=True)
class Thresholds:
    outputs: OutputThresholds = field(default_factory=OutputThresholds)
    latency: LatencyThresholds = field(default_factory=LatencyThresholds)

    def to_dict(self) -> dict:
        return {'outputs': _section_dict(self.outputs), 'latency': _section_dict(self.latency)}


def _section_dict(section: Any) -> dict:
    return {f.name: getattr(section, f.name) for f in fields(section)}


def _build_section(cls: type, data: Any, where: str) -> Any:
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ThresholdsError(f"'{where}' must be a mapping of settings, got {data!r}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ThresholdsError(
            f"unknown setting(s) {', '.join(where + '.' + k for k in unknown)}; known: "
            f"{', '.join(sorted(known))}")
    values = {}
    for name, value in data.items():
        default = known[name].default
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ThresholdsError(f'{where}.{name} must be true or false, got {value!r}')
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ThresholdsError(f'{where}.{name} must be an integer >= 0, got {value!r}')
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ThresholdsError(f'{where}.{name} must be a number >= 0, got {value!r}')
            top = known[name].metadata.get('max')
            if top is not None and value > top:
                raise ThresholdsError(
                    f'{where}.{name} is a fraction: it must be between 0 and {top:g}, got '
                    f'{value!r}')
            value = float(value)
        values[name] = value
    return cls(**values)


def thresholds_from_dict(data: Any) -> Thresholds:
    """Validate a parsed YAML document; missing settings keep their defaults."""
    if data is None:
        return Thresholds()
    if not isinstance(data, dict):
        raise ThresholdsError('the thresholds file must be a mapping with outputs/latency')
    unknown = sorted(set(data) - {'outputs', 'latency'})
    if unknown:
        raise ThresholdsError(
            f"unknown section(s) {', '.join(unknown)}: only 'outputs' and 'latency' exist")
    return Thresholds(
        outputs=_build_section(OutputThresholds, data.get('outputs'), 'outputs'),
        latency=_build_section(LatencyThresholds, data.get('latency'), 'latency'))


def load_thresholds(path: str | os.PathLike = '') -> Thresholds:
    """Thresholds from a YAML file, or the defaults when `path` is empty."""
    if not path:
        return Thresholds()
    try:
        with open(path, encoding='utf-8') as stream:
            data = yaml.safe_load(stream)
    except OSError as exc:
        raise ThresholdsError(f'cannot read thresholds file {path}: {exc.strerror}') from exc
    except yaml.YAMLError as exc:
        raise ThresholdsError(f'thresholds file {path} is not valid YAML: {exc}') from exc
    try:
        return thresholds_from_dict(data)
    except ThresholdsError as exc:
        raise ThresholdsError(f'{path}: {exc}') from exc
