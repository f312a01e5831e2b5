"""Compare a replay with its recording: outputs per goal, latency over the run.

Pure functions over records (no rclpy, no bag access), so every rule is unit-testable.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
import json
import math
import statistics
from typing import Callable, Optional, Sequence

from edge_llm_ros.regression.cpu_class import same_cpu_class, UNKNOWN
from edge_llm_ros.regression.records import SamplingRecord, TranscriptRecord
from edge_llm_ros.regression.thresholds import OutputThresholds, Thresholds
from edge_llm_ros.runtime.types import StopReason

# Finding severities, strongest first. Exit status: 1 if any regression, else 2 if any
# input problem (the bag could not be fully replayed), else 0.
REGRESSION = 'regression'
INPUT = 'input'
WARNING = 'warning'
INFO = 'info'

# ---- Outcome vocabulary (ReplayOutcome.status, report.json goals[].status) ----------------
# One spelling, ROS's. The action's terminal states, as LLMClient names them
# (GenerationOutcome.status):
SUCCEEDED = 'succeeded'
ABORTED = 'aborted'
CANCELED = 'canceled'
ACTION_STATUSES = (SUCCEEDED, ABORTED, CANCELED)
# States only a replay has: the node refused the goal, no result within --goal-timeout,
# left out by --skip-tensor-goals, never sent (node gone, Ctrl-C, not in the new bag).
REJECTED = 'rejected'
TIMEOUT = 'timeout'
SKIPPED = 'skipped'
NOT_SENT = 'not_sent'
# A transcript carries the engine's finish_reason (StopReason values, kept in bags as
# recorded: the engine spells 'cancelled'), not the action status. The one mapping from a
# finish reason to the outcome it stands for; any other finish reason counts as ABORTED.
STATUS_OF_FINISH_REASON = {
    StopReason.STOP.value: SUCCEEDED,
    StopReason.LENGTH.value: SUCCEEDED,
    StopReason.TOOL_CALLS.value: SUCCEEDED,
    StopReason.CANCELLED.value: CANCELED,
    StopReason.ERROR.value: ABORTED,
}
FINISH_OK = tuple(reason for reason, status in STATUS_OF_FINISH_REASON.items()
                  if status == SUCCEEDED)

EXIT_OK = 0
EXIT_REGRESSION = 1
EXIT_INPUT = 2

# ---- Token rules of greedy goals (GoalComparison.token_rule, report.json) -----------------
# Same CPU class in both runs: onnxruntime runs the same kernels, token ids must be equal.
EXACT = 'exact'
# Another or an unknown CPU class: float drift may flip a near-tie token; a divergence
# within the outputs.cross_cpu_* thresholds is a warning (docs/regression.md).
CROSS_CPU = 'cross_cpu'
TOKEN_RULE_TEXT = {EXACT: 'exact (same CPU class)', CROSS_CPU: 'cross-CPU tolerant'}


@dataclass(frozen=True)
class CpuClasses:
    """CPU classes (regression.cpu_class) of the recording and of the replaying node."""

    recorded: str = UNKNOWN
    replay: str = UNKNOWN

    @property
    def same(self) -> bool:
        return same_cpu_class(self.recorded, self.replay)

    @property
    def token_rule(self) -> str:
        return EXACT if self.same else CROSS_CPU

    def describe(self) -> str:
        if self.same:
            return f'same CPU class {self.recorded}'
        return f'recorded on CPU class {self.recorded}, replayed on {self.replay}'


@dataclass(frozen=True)
class Finding:
    code: str
    severity: str
    message: str
    goal: Optional[int] = None      # index of the goal in the recording, None = whole run


@dataclass
class ReplayOutcome:
    """What happened when one recorded goal was sent again."""

    status: str                         # SUCCEEDED, ABORTED, ... (vocabulary above)
    new: Optional[TranscriptRecord] = None
    detail: str = ''
    # The node published no transcript: `new` was built from the action result alone.
    synthesized: bool = False


@dataclass
class GoalComparison:
    index: int
    old: TranscriptRecord
    outcome: ReplayOutcome
    kind: str = 'unknown'              # greedy | sampled | unknown
    compared: bool = False             # outputs were compared (both runs finished)
    tokens_equal: Optional[bool] = None
    first_divergence: Optional[int] = None
    similarity: Optional[float] = None
    json_valid_old: Optional[bool] = None
    json_valid_new: Optional[bool] = None
    # Greedy goals: EXACT or CROSS_CPU; with CROSS_CPU, what the tolerant rule measured.
    token_rule: Optional[str] = None
    leading_agreement: Optional[int] = None
    required_agreement: Optional[int] = None
    findings: list = field(default_factory=list)

    @property
    def new(self) -> Optional[TranscriptRecord]:
        return self.outcome.new

    def worst(self) -> str:
        for severity in (REGRESSION, INPUT, WARNING):
            if any(f.severity == severity for f in self.findings):
                return severity
        return 'pass'


@dataclass
class MetricSummary:
    """One latency metric over the goals that finished in both runs."""

    name: str
    unit: str
    higher_is_better: bool
    old: list = field(default_factory=list)
    new: list = field(default_factory=list)
    gated: bool = False
    limit: Optional[float] = None          # the bound the new median was held to
    regression: bool = False

    @property
    def old_median(self) -> Optional[float]:
        return statistics.median(self.old) if self.old else None

    @property
    def new_median(self) -> Optional[float]:
        return statistics.median(self.new) if self.new else None

    @property
    def ratio(self) -> Optional[float]:
        if not self.old or not self.new or self.old_median == 0:
            return None
        return self.new_median / self.old_median


@dataclass
class ComparisonResult:
    goals: list = field(default_factory=list)        # GoalComparison
    metrics: list = field(default_factory=list)      # MetricSummary
    findings: list = field(default_factory=list)     # run-level Finding
    cpu: Optional[CpuClasses] = None                 # None: both runs on one machine

    def all_findings(self) -> list:
        out = list(self.findings)
        for goal in self.goals:
            out.extend(goal.findings)
        return out

    def by_severity(self, severity: str) -> list:
        return [f for f in self.all_findings() if f.severity == severity]

    def exit_code(self) -> int:
        if self.by_severity(REGRESSION):
            return EXIT_REGRESSION
        if self.by_severity(INPUT):
            return EXIT_INPUT
        return EXIT_OK

    def verdict(self) -> str:
        return {EXIT_OK: 'PASS', EXIT_REGRESSION: 'REGRESSION',
                EXIT_INPUT: 'INCOMPLETE'}[self.exit_code()]


# ---------------------------------------------------------------- text measures

def edit_distance(a: Sequence, b: Sequence) -> int:
    """Levenshtein distance (insert, delete, substitute cost 1)."""
    start = 0
    while start < len(a) and start < len(b) and a[start] == b[start]:
        start += 1
    end_a, end_b = len(a), len(b)
    while end_a > start and end_b > start and a[end_a - 1] == b[end_b - 1]:
        end_a -= 1
        end_b -= 1
    a, b = a[start:end_a], b[start:end_b]
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, item_a in enumerate(a, 1):
        current = [i]
        for j, item_b in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1,
                               previous[j - 1] + (item_a != item_b)))
        previous = current
    return previous[-1]


def similarity(a: Sequence, b: Sequence) -> float:
    """1 - edit distance / longer length; 1.0 for two empty sequences."""
    longest = max(len(a), len(b))
    return 1.0 if longest == 0 else 1.0 - edit_distance(a, b) / longest


def first_divergence(a: Sequence, b: Sequence) -> Optional[int]:
    """Index of the first differing element (or the shorter length); None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def json_valid(text: str, schema_text: str) -> tuple:
    """Check `text` is JSON and, when the schema parses, conforms to it: (valid, reason)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        return False, f'not JSON ({exc})'
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return True, 'schema is not JSON: only JSON syntax was checked'
    import jsonschema
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        return False, f'violates the schema: {exc.message}'
    except jsonschema.SchemaError as exc:
        return True, f'schema is invalid ({exc.message}): only JSON syntax was checked'
    return True, ''


def tool_arguments_valid(arguments: str, schema_text: str = '') -> tuple:
    """Check tool-call arguments: a JSON object, of the tool's parameters schema if any."""
    try:
        value = json.loads(arguments)
    except ValueError as exc:
        return False, f'not JSON ({exc})'
    if not isinstance(value, dict):
        return False, 'not a JSON object'
    if not schema_text.strip():
        return True, ''
    return json_valid(arguments, schema_text)


@dataclass(frozen=True)
class DriftVerdict:
    """Whether a greedy divergence on another CPU class is float drift (cross_cpu_drift)."""

    within: bool
    agreed: int          # leading elements both runs share
    required: int        # leading elements the thresholds require
    reason: str


def required_agreement(recorded: int, limits: OutputThresholds) -> int:
    """Leading tokens a cross-CPU replay must reproduce: a fraction of the recorded, capped."""
    # The epsilon keeps 0.3 * 10 at 3: float products may land just above the integer.
    needed = math.ceil(limits.cross_cpu_min_token_agreement * recorded - 1e-9)
    if limits.cross_cpu_max_required_tokens > 0:
        needed = min(needed, limits.cross_cpu_max_required_tokens)
    return max(needed, 0)


def cross_cpu_drift(old: Sequence, new: Sequence, text_similarity: float,
                    limits: OutputThresholds, unit: str = 'token') -> DriftVerdict:
    """Judge a greedy divergence between runs on different (or unknown) CPU classes.

    Float drift flips one near-tie token and decoding goes on from there, so it is
    accepted when that token comes late enough and the texts stay similar. A replay that
    only cuts or extends the recorded sequence changed no token: that is never drift.
    """
    agreed = first_divergence(old, new)
    agreed = len(old) if agreed is None else agreed
    required = required_agreement(len(old), limits)
    if agreed >= min(len(old), len(new)):
        return DriftVerdict(False, agreed, required,
                            'the replay only cuts or extends the recorded answer (no token '
                            'differs), which float drift does not do')
    failures = []
    if agreed < required:
        cap = limits.cross_cpu_max_required_tokens
        failures.append(
            f'only {agreed} leading {unit}s agree, {required} required '
            f'(cross_cpu_min_token_agreement {limits.cross_cpu_min_token_agreement:g} of '
            f'{len(old)}{f", at most {cap}" if cap else ""})')
    if text_similarity < limits.cross_cpu_min_similarity:
        failures.append(f'text similarity {text_similarity:.2f} is below '
                        f'cross_cpu_min_similarity {limits.cross_cpu_min_similarity:.2f}')
    if failures:
        return DriftVerdict(False, agreed, required, '; '.join(failures))
    return DriftVerdict(True, agreed, required,
                        f'{agreed} leading {unit}s agree (>= {required} required), text '
                        f'similarity {text_similarity:.2f} >= '
                        f'{limits.cross_cpu_min_similarity:.2f}')


def _excerpt(text: str, width: int = 60) -> str:
    text = text.replace('\n', '\\n')
    return repr(text if len(text) <= width else text[:width - 1] + '\u2026')


def _sampling_diff(old: TranscriptRecord, new: TranscriptRecord) -> list:
    """Fields of the effective sampling that differ ('name old -> new')."""
    a, b = old.effective_sampling, new.effective_sampling
    if a.is_unset() or b.is_unset():
        return []  # one side did not report it: nothing to compare
    if old.sampling.seed < 0:
        # A node draws a fresh seed when none was asked for: that is not a setting change.
        a, b = replace(a, seed=-1), replace(b, seed=-1)
    return [f'{name} {_value(getattr(a, name))} -> {_value(getattr(b, name))}'
            for name in SamplingRecord.__dataclass_fields__
            if getattr(a, name) != getattr(b, name)]


def _value(value) -> str:
    return f'{value:g}' if isinstance(value, (int, float)) else str(list(value))


# ---------------------------------------------------------------- per goal

def compare_goal(index: int, old: TranscriptRecord, outcome: ReplayOutcome,
                 thresholds: Thresholds, cpu: Optional[CpuClasses] = None) -> GoalComparison:
    """Compare one recorded goal with its replay.

    `cpu` says on which CPU classes both runs were made and so which token rule greedy
    goals get; None means both on one machine (the exact rule).
    """
    result = GoalComparison(index=index, old=old, outcome=outcome)
    temperature = old.effective_temperature()
    result.kind = 'unknown' if temperature is None else (
        'greedy' if temperature == 0.0 else 'sampled')

    def add(code: str, severity: str, message: str) -> None:
        result.findings.append(Finding(code, severity, message, index))

    if outcome.status == SKIPPED:
        add('skipped', INFO, f'not replayed: {outcome.detail}')
        return result
    if outcome.status == NOT_SENT:
        add('not_replayed', INPUT, f'not replayed: {outcome.detail}')
        return result

    new = outcome.new
    new_ok = outcome.status == SUCCEEDED and new is not None and new.finish_reason in FINISH_OK
    old_ok = old.accepted and old.finish_reason in FINISH_OK
    if not old_ok:
        state = 'rejected' if not old.accepted else f'ended with {old.finish_reason!r}'
        if new_ok:
            add('recorded_failure_now_ok', WARNING,
                f'the recorded goal {state} ({old.error_message or "no message"}); '
                'it succeeds now: outputs not compared')
        else:
            add('recorded_failure', INFO,
                f'the recorded goal {state}; it fails again now ({outcome.status}): '
                f'{_new_error(outcome)}')
        return result

    if not new_ok:
        reason = _new_error(outcome)
        if old.tensor_handles:
            handles = '; '.join(h.describe() for h in old.tensor_handles)
            add('stale_tensor_handle', INPUT,
                f'the goal references tensor handles that no longer exist ({handles}); the '
                f'node answered: {reason}. Replay it while the producer of those buffers '
                'runs, or pass --skip-tensor-goals')
        elif thresholds.outputs.new_failures:
            add('goal_failed', REGRESSION,
                f'succeeded in the recording ({old.finish_reason}) but {outcome.status} now: '
                f'{reason}')
        else:
            add('goal_failed', WARNING, f'{outcome.status} now: {reason}')
        return result

    result.compared = True
    if outcome.synthesized:
        add('no_transcript', WARNING,
            'the node published no transcript for this goal: the comparison uses the action '
            'result only (effective sampling unknown)')
    _compare_outputs(result, old, new, thresholds, cpu, add)
    return result


def _new_error(outcome: ReplayOutcome) -> str:
    parts = []
    if outcome.new is not None and outcome.new.error_message:
        parts.append(outcome.new.error_message)
    if outcome.new is not None and outcome.new.finish_reason:
        parts.append(f'finish reason {outcome.new.finish_reason!r}')
    if outcome.detail:
        parts.append(outcome.detail)
    return '; '.join(parts) or 'no details'


def _compare_outputs(result: GoalComparison, old: TranscriptRecord, new: TranscriptRecord,
                     thresholds: Thresholds, cpu: Optional[CpuClasses], add) -> None:
    limits = thresholds.outputs
    result.similarity = similarity(old.text, new.text)
    if old.token_ids or new.token_ids:
        result.tokens_equal = list(old.token_ids) == list(new.token_ids)
        result.first_divergence = first_divergence(old.token_ids, new.token_ids)
    else:
        result.tokens_equal = old.text == new.text
        result.first_divergence = first_divergence(old.text, new.text)

    if result.kind == 'greedy':
        _compare_greedy(result, old, new, limits, cpu, add)
    else:
        if result.kind == 'unknown':
            add('sampling_unknown', WARNING,
                'neither the transcript nor the request says the temperature: compared as '
                'sampled text')
        if result.similarity < limits.min_sampled_similarity:
            add('low_similarity', REGRESSION,
                f'text similarity {result.similarity:.2f} is below '
                f'{limits.min_sampled_similarity:.2f}: {_excerpt(old.text)} -> '
                f'{_excerpt(new.text)}')

    if old.json_schema:
        result.json_valid_old, _ = json_valid(old.text, old.json_schema)
        result.json_valid_new, why = json_valid(new.text, old.json_schema)
        if result.json_valid_old and not result.json_valid_new:
            add('json_invalid', REGRESSION if limits.json_must_stay_valid else WARNING,
                f'the answer was valid JSON for its schema and is not any more: {why}')
        elif not result.json_valid_old and not result.json_valid_new:
            add('json_invalid_before', WARNING,
                f'the recorded answer was not valid for its schema either: {why}')

    if old.finish_reason != new.finish_reason:
        add('finish_reason_changed', REGRESSION if limits.finish_reason_change else WARNING,
            f'finish reason {old.finish_reason!r} -> {new.finish_reason!r} '
            f'(completion tokens {old.completion_tokens} -> {new.completion_tokens})')

    _compare_tool_calls(old, new, limits, add)

    changed = _sampling_diff(old, new)
    if changed:
        add('effective_sampling_changed',
            REGRESSION if limits.effective_sampling_change else WARNING,
            'the node applied other sampling than in the recording: ' + ', '.join(changed))
    if old.model and new.model and old.model != new.model:
        add('model_changed', INFO, f'model {old.model!r} -> {new.model!r}')


def _compare_greedy(result: GoalComparison, old: TranscriptRecord, new: TranscriptRecord,
                    limits: OutputThresholds, cpu: Optional[CpuClasses],
                    add: Callable[[str, str, str], None]) -> None:
    """Apply the goal's token rule: exact on one CPU class, tolerant across classes."""
    result.token_rule = EXACT if cpu is None else cpu.token_rule
    if result.tokens_equal:
        return
    if old.token_ids or new.token_ids:
        a, b, unit = old.token_ids, new.token_ids, 'token'
    else:
        a, b, unit = old.text, new.text, 'character'
    change = (f'greedy output changed at {unit} {result.first_divergence} '
              f'({len(a)} -> {len(b)} {unit}s): {_excerpt(old.text)} -> {_excerpt(new.text)}')
    if cpu is not None and result.token_rule == CROSS_CPU:
        verdict = cross_cpu_drift(a, b, result.similarity, limits, unit)
        result.leading_agreement, result.required_agreement = verdict.agreed, verdict.required
        if verdict.within:
            add('cross_cpu_drift', WARNING,
                f'{change}; float drift on another CPU class ({cpu.describe()}), within the '
                f'cross-CPU thresholds: {verdict.reason}')
            return
        change += f'; beyond the cross-CPU thresholds ({cpu.describe()}): {verdict.reason}'
    add('token_mismatch', REGRESSION if limits.greedy_exact_match else WARNING, change)


def _compare_tool_calls(old: TranscriptRecord, new: TranscriptRecord,
                        limits: OutputThresholds, add: Callable[[str, str, str], None]) -> None:
    """Tool names and argument validity: strict on every CPU (they are not numerics)."""
    if not old.tool_calls and not new.tool_calls:
        return
    severity = REGRESSION if limits.tool_calls_must_stay_valid else WARNING
    names_old = [c.name for c in old.tool_calls]
    names_new = [c.name for c in new.tool_calls]
    if names_old != names_new:
        add('tool_calls_changed', severity, f'tool calls {names_old} -> {names_new}')
        return
    schemas = {t.name: t.parameters for t in old.tools}
    for i, (a, b) in enumerate(zip(old.tool_calls, new.tool_calls)):
        was_valid, _ = tool_arguments_valid(a.arguments, schemas.get(a.name, ''))
        valid, why = tool_arguments_valid(b.arguments, schemas.get(b.name, ''))
        if was_valid and not valid:
            add('tool_arguments_invalid', severity,
                f'the arguments of tool call {i} ({b.name}) were valid and are not any '
                f'more: {why}: {_excerpt(b.arguments)}')


# ---------------------------------------------------------------- recorded pairs

_REQUEST_FIELDS = ('prompt', 'messages', 'system_prompt', 'json_schema', 'stop', 'session_id',
                   'tools', 'tool_choice', 'no_parallel_tool_calls', 'grammar', 'regex',
                   'choices', 'reasoning_mode', 'reasoning_budget', 'raw_prompt')


def _same_request(a: TranscriptRecord, b: TranscriptRecord) -> bool:
    return all(getattr(a, name) == getattr(b, name) for name in _REQUEST_FIELDS)


def outcome_of(new: TranscriptRecord) -> ReplayOutcome:
    """Return the outcome a recorded transcript stands for."""
    if not new.accepted:
        return ReplayOutcome(REJECTED, new, new.error_message or 'rejected')
    return ReplayOutcome(STATUS_OF_FINISH_REASON.get(new.finish_reason, ABORTED), new)


def pair_recordings(olds: Sequence[TranscriptRecord], news: Sequence[TranscriptRecord],
                    goal_map: Optional[dict] = None) -> list:
    """Outcomes for `olds` taken from another recording `news`.

    With `goal_map` (old goal id -> new goal id, stored by edge-llm-replay in its bag)
    goals pair by id when the map is about `olds`; otherwise the n-th new transcript with
    the same request answers the n-th old one (two recordings of the same script).
    """
    by_id = {n.goal_id: n for n in news}
    outcomes = []
    # A replay bag's map is keyed by the goals of the bag it replayed: useless for another.
    if goal_map and any(old.goal_id in goal_map for old in olds):
        for old in olds:
            new = by_id.get(goal_map.get(old.goal_id, ''))
            outcomes.append(outcome_of(new) if new is not None else ReplayOutcome(
                NOT_SENT, None, 'no transcript for this goal in the new bag'))
        return outcomes
    used = set()
    for old in olds:
        match = next((i for i, n in enumerate(news)
                      if i not in used and _same_request(old, n)), None)
        if match is None:
            outcomes.append(ReplayOutcome(NOT_SENT, None,
                                          'no goal with the same request in the new bag'))
        else:
            used.add(match)
            outcomes.append(outcome_of(news[match]))
    return outcomes


# ---------------------------------------------------------------- whole run

def _metric_values(goals: Sequence, attr: str, min_tokens: int) -> tuple:
    old, new = [], []
    for goal in goals:
        if not goal.compared:
            continue
        a = getattr(goal.old.timings, attr)
        b = getattr(goal.new.timings, attr)
        if goal.old.completion_tokens < min_tokens or goal.new.completion_tokens < min_tokens:
            continue
        if a > 0 and b > 0:
            old.append(a)
            new.append(b)
    return old, new


def compare_latency(goals: Sequence, thresholds: Thresholds) -> tuple:
    """Median TTFT and tokens/s of both runs, gated by the latency thresholds."""
    limits = thresholds.latency
    specs = (
        ('time_to_first_token_s', 'TTFT', 's', False, 1, limits.max_ttft_ratio),
        ('decode_tokens_per_second', 'decode tok/s', 'tok/s', True, 2,
         limits.min_decode_tps_ratio),
        ('prefill_tokens_per_second', 'prefill tok/s', 'tok/s', True, 1,
         limits.min_prefill_tps_ratio),
        ('total_s', 'total time', 's', False, 1, 0.0),
    )
    metrics, findings = [], []
    for attr, name, unit, higher_better, min_tokens, ratio in specs:
        old, new = _metric_values(goals, attr, min_tokens)
        metric = MetricSummary(name=name, unit=unit, higher_is_better=higher_better,
                               old=old, new=new)
        metrics.append(metric)
        if not limits.enabled or ratio <= 0 or len(old) < max(1, limits.min_goals):
            continue
        metric.gated = True
        if higher_better:
            metric.limit = metric.old_median * ratio
            metric.regression = metric.new_median < metric.limit
        else:
            metric.limit = metric.old_median * ratio + limits.ttft_slack_s
            metric.regression = metric.new_median > metric.limit
        if metric.regression:
            direction = 'dropped' if higher_better else 'grew'
            findings.append(Finding(
                f'{attr}_regression', REGRESSION,
                f'median {name} {direction}: {metric.old_median:.4g} -> '
                f'{metric.new_median:.4g} {unit} (limit {metric.limit:.4g} {unit}, '
                f'{len(old)} goals)'))
    if limits.enabled and metrics and len(metrics[0].old) < limits.min_goals:
        findings.append(Finding(
            'latency_not_gated', INFO,
            f'only {len(metrics[0].old)} goals finished in both runs (< min_goals '
            f'{limits.min_goals}): latency reported, not gated'))
    return metrics, findings


def compare_run(olds: Sequence[TranscriptRecord], outcomes: Sequence[ReplayOutcome],
                thresholds: Thresholds, problems: Sequence[str] = (),
                cpu: Optional[CpuClasses] = None) -> ComparisonResult:
    """Compare every goal and the run's latency; `problems` are input problems met earlier.

    `cpu`: the CPU classes of both runs (None: one machine), see compare_goal.
    """
    if len(olds) != len(outcomes):
        raise ValueError(f'{len(olds)} recorded goals but {len(outcomes)} outcomes')
    result = ComparisonResult(cpu=cpu)
    for problem in problems:
        result.findings.append(Finding('bad_input', INPUT, problem))
    for index, (old, outcome) in enumerate(zip(olds, outcomes)):
        result.goals.append(compare_goal(index, old, outcome, thresholds, cpu))
    result.metrics, latency_findings = compare_latency(result.goals, thresholds)
    result.findings.extend(latency_findings)
    return result
