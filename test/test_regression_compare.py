"""Comparison rules and thresholds of the bag regression tools (no ROS graph needed)."""
from dataclasses import replace
import pathlib

from hypothesis import given, settings, strategies as st
import pytest

from edge_llm_ros.client import STATUS_NAMES
from edge_llm_ros.regression import compare
from edge_llm_ros.regression.compare import (ABORTED, CANCELED, compare_goal, compare_run,
                                             EXIT_INPUT, EXIT_OK, EXIT_REGRESSION, NOT_SENT,
                                             outcome_of, pair_recordings, REJECTED, ReplayOutcome,
                                             SUCCEEDED)
from edge_llm_ros.regression.errors import ThresholdsError
from edge_llm_ros.regression.records import (SamplingRecord, TensorHandleRecord, TimingsRecord,
                                             TranscriptRecord)
from edge_llm_ros.regression.thresholds import (LatencyThresholds, load_thresholds,
                                                OutputThresholds, Thresholds)
from edge_llm_ros.runtime.types import StopReason

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULTS = Thresholds()


def record(goal_id='a', text='the sky is blue', tokens=(5, 6, 7, 8), finish='stop',
           temperature=0.0, ttft=0.1, tps=50.0, **kw) -> TranscriptRecord:
    return TranscriptRecord(
        goal_id=goal_id, accepted=True, prompt=kw.pop('prompt', 'why is the sky blue?'),
        effective_sampling=SamplingRecord(temperature=temperature, top_k=0, top_p=1.0,
                                          min_p=0.0, repetition_penalty=1.0),
        text=text, token_ids=list(tokens), finish_reason=finish,
        completion_tokens=len(tokens),
        timings=TimingsRecord(time_to_first_token_s=ttft, decode_tokens_per_second=tps,
                              prefill_tokens_per_second=300.0, total_s=1.0), **kw)


def ok(new: TranscriptRecord) -> ReplayOutcome:
    return ReplayOutcome(SUCCEEDED, new)


def codes(goal) -> dict:
    return {f.code: f.severity for f in goal.findings}


def test_edit_distance_and_similarity():
    assert compare.edit_distance('kitten', 'sitting') == 3
    assert compare.edit_distance('', 'abc') == 3
    assert compare.edit_distance([1, 2, 3], [1, 2, 3]) == 0
    assert compare.similarity('', '') == 1.0
    assert compare.similarity('abcd', 'abcx') == pytest.approx(0.75)
    assert compare.first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert compare.first_divergence([1, 2], [1, 2, 3]) == 2
    assert compare.first_divergence([1, 2], [1, 2]) is None


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=30), st.text(max_size=30))
def test_edit_distance_is_a_metric_bounded_by_lengths(a, b):
    d = compare.edit_distance(a, b)
    assert d == compare.edit_distance(b, a)
    assert abs(len(a) - len(b)) <= d <= max(len(a), len(b))
    assert (d == 0) == (a == b)
    assert 0.0 <= compare.similarity(a, b) <= 1.0


def test_identical_greedy_replay_has_no_findings():
    goal = compare_goal(0, record(), ok(record(goal_id='b')), DEFAULTS)
    assert goal.kind == 'greedy' and goal.compared and goal.tokens_equal
    assert goal.findings == [] and goal.worst() == 'pass'


def test_greedy_token_change_is_a_regression_naming_the_position():
    new = record(goal_id='b', text='the sky is grey', tokens=(5, 6, 7, 9))
    goal = compare_goal(3, record(), ok(new), DEFAULTS)
    assert codes(goal) == {'token_mismatch': 'regression'}
    assert goal.first_divergence == 3
    assert 'at token 3' in goal.findings[0].message and "'the sky is grey'" in \
        goal.findings[0].message
    relaxed = Thresholds(outputs=OutputThresholds(greedy_exact_match=False))
    assert codes(compare_goal(3, record(), ok(new), relaxed)) == {'token_mismatch': 'warning'}


def test_truncated_max_tokens_shows_as_token_and_finish_regressions():
    new = record(goal_id='b', text='the sky', tokens=(5, 6), finish='length')
    goal = compare_goal(0, record(), ok(new), DEFAULTS)
    assert codes(goal) == {'token_mismatch': 'regression',
                           'finish_reason_changed': 'regression'}
    assert "'stop' -> 'length'" in [f for f in goal.findings
                                    if f.code == 'finish_reason_changed'][0].message


def test_changed_node_default_temperature_is_reported():
    new = record(goal_id='b', temperature=0.7)
    goal = compare_goal(0, record(), ok(new), DEFAULTS)
    assert codes(goal) == {'effective_sampling_changed': 'regression'}
    assert 'temperature 0 -> 0.7' in goal.findings[0].message


def test_node_drawn_seed_is_not_a_setting_change_but_an_asked_seed_is():
    old = record(temperature=0.8)
    new = replace(record(goal_id='b', temperature=0.8),
                  effective_sampling=replace(old.effective_sampling, seed=1234))
    assert 'effective_sampling_changed' not in codes(compare_goal(0, old, ok(new), DEFAULTS))
    asked = replace(old, sampling=replace(old.sampling, seed=5),
                    effective_sampling=replace(old.effective_sampling, seed=5))
    assert 'effective_sampling_changed' in codes(compare_goal(0, asked, ok(new), DEFAULTS))


def test_sampled_goals_use_similarity_threshold():
    old = record(temperature=0.8, text='robots plan paths around obstacles')
    close = record(goal_id='b', temperature=0.8, tokens=(1, 2),
                   text='robots plan routes around obstacles')
    far = record(goal_id='c', temperature=0.8, tokens=(3,), text='xyz')
    assert codes(compare_goal(0, old, ok(close), DEFAULTS)) == {}
    goal = compare_goal(0, old, ok(far), DEFAULTS)
    assert codes(goal) == {'low_similarity': 'regression'} and goal.kind == 'sampled'


def test_unknown_temperature_falls_back_to_request_then_warns():
    unset = replace(record(), effective_sampling=SamplingRecord())
    assert compare_goal(0, unset, ok(record(goal_id='b')), DEFAULTS).kind == 'unknown'
    asked = replace(unset, sampling=SamplingRecord(temperature=0.0))
    assert compare_goal(0, asked, ok(record(goal_id='b')), DEFAULTS).kind == 'greedy'


def test_json_schema_goal_must_stay_valid():
    schema = '{"type": "object", "required": ["answer"]}'
    old = record(text='{"answer": "blue"}', json_schema=schema)
    broken = record(goal_id='b', text='{"answer": "blu', json_schema=schema)
    wrong = record(goal_id='c', text='{"other": 1}', json_schema=schema)
    goal = compare_goal(0, old, ok(broken), DEFAULTS)
    assert goal.json_valid_old is True and goal.json_valid_new is False
    assert codes(goal)['json_invalid'] == 'regression'
    assert 'not JSON' in [f for f in goal.findings if f.code == 'json_invalid'][0].message
    schema_goal = compare_goal(0, old, ok(wrong), DEFAULTS)
    assert 'violates the schema' in [f for f in schema_goal.findings
                                     if f.code == 'json_invalid'][0].message


def test_failed_goal_and_stale_tensor_handle():
    failed = ReplayOutcome(ABORTED, record(goal_id='b', finish='error', tokens=(),
                                           text='', error_message='engine crashed'))
    goal = compare_goal(0, record(), failed, DEFAULTS)
    assert codes(goal) == {'goal_failed': 'regression'}
    assert 'engine crashed' in goal.findings[0].message
    handle = TensorHandleRecord('camera0', 2, 7, 41, 0, 'float32', (4, 576), (), 0, 9216)
    stale = compare_goal(1, record(prefix_embeddings=[handle]), failed, DEFAULTS)
    assert codes(stale) == {'stale_tensor_handle': 'input'}
    text = stale.findings[0].message
    assert "pool 'camera0' slot 2 generation 7" in text and '--skip-tensor-goals' in text


def test_recorded_failures_are_not_compared():
    old = record(finish='error', tokens=(), text='', error_message='bad schema')
    again = ReplayOutcome(ABORTED, record(goal_id='b', finish='error', tokens=()))
    assert codes(compare_goal(0, old, again, DEFAULTS)) == {'recorded_failure': 'info'}
    fixed = compare_goal(0, old, ok(record(goal_id='b')), DEFAULTS)
    assert codes(fixed) == {'recorded_failure_now_ok': 'warning'} and not fixed.compared


def test_latency_gate_uses_medians_and_min_goals():
    olds = [record(goal_id=str(i), ttft=0.10, tps=50.0) for i in range(4)]
    slow = [ok(record(goal_id=f'n{i}', ttft=0.30, tps=20.0)) for i in range(4)]
    result = compare_run(olds, slow, DEFAULTS)
    found = {f.code for f in result.findings}
    assert {'time_to_first_token_s_regression', 'decode_tokens_per_second_regression'} <= found
    ttft = result.metrics[0]
    assert ttft.name == 'TTFT' and ttft.gated and ttft.regression
    assert ttft.limit == pytest.approx(0.10 * 1.5 + 0.05)
    assert result.exit_code() == EXIT_REGRESSION and result.verdict() == 'REGRESSION'
    same = compare_run(olds, [ok(record(goal_id=f'n{i}')) for i in range(4)], DEFAULTS)
    assert same.exit_code() == EXIT_OK
    few = Thresholds(latency=LatencyThresholds(min_goals=5))
    ungated = compare_run(olds, slow, few)
    assert ungated.exit_code() == EXIT_OK
    assert 'latency_not_gated' in {f.code for f in ungated.findings}
    off = Thresholds(latency=LatencyThresholds(enabled=False))
    assert compare_run(olds, slow, off).exit_code() == EXIT_OK


def test_exit_code_prefers_regression_over_input_problems():
    olds = [record(goal_id='a'), record(goal_id='b', tokens=(1,))]
    outcomes = [ok(record(goal_id='x', tokens=(9,))),
                ReplayOutcome(NOT_SENT, None, 'node went away')]
    assert compare_run(olds, outcomes, DEFAULTS).exit_code() == EXIT_REGRESSION
    only_input = compare_run(olds[:1], [ReplayOutcome(NOT_SENT, None, 'x')], DEFAULTS)
    assert only_input.exit_code() == EXIT_INPUT and only_input.verdict() == 'INCOMPLETE'
    problems = compare_run([], [], DEFAULTS, problems=['truncated bag'])
    assert problems.exit_code() == EXIT_INPUT


def test_pair_recordings_by_goal_map_and_by_request():
    olds = [record(goal_id='a', prompt='one'), record(goal_id='b', prompt='two')]
    news = [record(goal_id='y', prompt='two'), record(goal_id='x', prompt='one')]
    by_map = pair_recordings(olds, news, {'a': 'x', 'b': 'y'})
    assert [o.new.goal_id for o in by_map] == ['x', 'y']
    by_request = pair_recordings(olds, news)
    assert [o.new.goal_id for o in by_request] == ['x', 'y']
    foreign_map = pair_recordings(olds, news, {'other': 'x'})  # a map about another bag
    assert [o.new.goal_id for o in foreign_map] == ['x', 'y']
    missing = pair_recordings(olds, news[:1])
    assert missing[0].status == NOT_SENT and missing[1].new.goal_id == 'y'


def test_outcome_vocabulary_has_one_spelling():
    """Recorded finish reasons (the engine's 'cancelled') map onto ROS's spelling."""
    assert set(compare.STATUS_OF_FINISH_REASON) == {reason.value for reason in StopReason}
    assert [outcome_of(record(finish=reason)).status
            for reason in ('stop', 'length', 'cancelled', 'error', 'something new')] == [
        SUCCEEDED, SUCCEEDED, CANCELED, ABORTED, ABORTED]
    assert outcome_of(replace(record(), accepted=False)).status == REJECTED
    # The action's terminal states are spelled as LLMClient spells them.
    assert set(compare.ACTION_STATUSES) == set(STATUS_NAMES.values()) - {'unknown'}


def test_shipped_yaml_equals_builtin_defaults():
    assert load_thresholds(ROOT / 'config' / 'regression_thresholds.yaml') == Thresholds()
    assert load_thresholds('') == Thresholds()


@pytest.mark.parametrize('text, message', [
    ('outputs: {greedy_exact_match: 1}\n', 'outputs.greedy_exact_match must be true or false'),
    ('latency: {max_ttft_ratio: -1}\n', 'latency.max_ttft_ratio must be a number >= 0'),
    ('latency: {ttft_ratio: 2}\n', 'unknown setting(s) latency.ttft_ratio'),
    ('speed: {}\n', "unknown section(s) speed: only 'outputs' and 'latency' exist"),
    ('outputs: [1, 2]\n', "'outputs' must be a mapping"),
    ('outputs: {a: [\n', 'is not valid YAML'),
])
def test_bad_thresholds_files_say_what_to_fix(tmp_path, text, message):
    path = tmp_path / 'thresholds.yaml'
    path.write_text(text)
    with pytest.raises(ThresholdsError) as err:
        load_thresholds(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_partial_thresholds_keep_other_defaults(tmp_path):
    path = tmp_path / 't.yaml'
    path.write_text('latency:\n  enabled: false\n  min_goals: 10\n')
    loaded = load_thresholds(path)
    assert loaded.latency == LatencyThresholds(enabled=False, min_goals=10)
    assert loaded.outputs == OutputThresholds()
    with pytest.raises(ThresholdsError, match='cannot read thresholds file'):
        load_thresholds(tmp_path / 'missing.yaml')
