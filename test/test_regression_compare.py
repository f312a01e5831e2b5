"""Comparison rules and thresholds of the bag regression tools (no ROS graph needed)."""
from dataclasses import replace
import pathlib

from hypothesis import given, settings, strategies as st
import pytest

from edge_llm_ros.client import STATUS_NAMES
from edge_llm_ros.regression import compare, cpu_class
from edge_llm_ros.regression.compare import (ABORTED, CANCELED, compare_goal, compare_run,
                                             CpuClasses, EXIT_INPUT, EXIT_OK, EXIT_REGRESSION,
                                             NOT_SENT, outcome_of, pair_recordings, REJECTED,
                                             ReplayOutcome, SUCCEEDED)
from edge_llm_ros.regression.errors import CpuClassError, ThresholdsError
from edge_llm_ros.regression.records import (SamplingRecord, TensorHandleRecord, TimingsRecord,
                                             ToolCallRecord, ToolSpecRecord, TranscriptRecord)
from edge_llm_ros.regression.report import RunInfo, write_report
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


# ---------------------------------------------------------------- CPU classes

ICELAKE_SP = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush \
mmx fxsr sse sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc pni pclmulqdq ssse3 fma cx16 \
sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand avx2 bmi2 erms avx512f avx512dq rdseed \
adx avx512ifma clflushopt avx512cd sha_ni avx512bw avx512vl avx512vbmi avx512_vbmi2 gfni vaes \
avx512_vnni avx512_bitalg avx512_vpopcntdq
bugs\t\t: spectre_v1

processor\t: 1
vendor_id\t: GenuineIntel
flags\t\t: fpu sse sse2 lm fma avx avx2 avx512f avx512bw avx512_vnni
"""
ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7R13 Processor
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx \
fxsr sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm pni pclmulqdq ssse3 fma cx16 \
sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand bmi1 avx2 smep bmi2 erms sha_ni vaes
"""
SAPPHIRE_RAPIDS = ('processor\t: 0\nflags\t\t: lm fma avx2 avx512f avx512bw avx512_vnni '
                   'avx_vnni amx_bf16 amx_tile amx_int8\n')
GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm \
jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs \
paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd40
CPU revision\t: 1

processor\t: 1
Features\t: fp asimd asimddp sve i8mm
CPU implementer\t: 0x41
CPU architecture: 8
"""
# A big.LITTLE SoC whose little cores lack i8mm: only the common features count.
BIG_LITTLE = """processor\t: 0
Features\t: fp asimd asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU part\t: 0xd05

processor\t: 4
Features\t: fp asimd asimddp i8mm
CPU implementer\t: 0x41
CPU architecture: 8
CPU part\t: 0xd0b
"""


@pytest.mark.parametrize('text, expected', [
    (ICELAKE_SP, 'x86_64:avx2,fma,avx512f,avx512vnni'),
    (ZEN3, 'x86_64:avx2,fma'),
    (SAPPHIRE_RAPIDS, 'x86_64:avx2,fma,avx512f,avx512vnni,avx_vnni,amx_int8,amx_tile'),
    (GRAVITON3, 'aarch64:asimddp,i8mm,sve'),
    (BIG_LITTLE, 'aarch64:asimddp'),
    ('processor\t: 0\nFeatures\t: fp asimd\nCPU architecture: 8\n', 'aarch64:'),
    ('processor\t: 0\nflags\t\t: fpu sse sse2\n', 'x86:'),
    ('', cpu_class.UNKNOWN),
    ('processor\t: 0\nhart\t: 0\nisa\t: rv64imafdc\n', cpu_class.UNKNOWN),
])
def test_cpu_class_from_cpuinfo(text, expected):
    assert cpu_class.cpu_class_from_cpuinfo(text) == expected


def test_cpu_class_uses_the_process_architecture_and_reads_files(tmp_path):
    # A 32-bit userland on a 64-bit Arm kernel runs the 32-bit onnxruntime build.
    assert cpu_class.cpu_class_from_cpuinfo(BIG_LITTLE, machine='armv7l') == 'arm:asimddp'
    assert cpu_class.cpu_class_from_cpuinfo(ZEN3, machine='AMD64') == 'x86_64:avx2,fma'
    path = tmp_path / 'cpuinfo'
    path.write_text(GRAVITON3)
    assert cpu_class.current_cpu_class(str(path), machine='aarch64') == \
        'aarch64:asimddp,i8mm,sve'
    assert cpu_class.current_cpu_class(str(tmp_path / 'missing')) == cpu_class.UNKNOWN
    here = cpu_class.current_cpu_class()
    assert here == cpu_class.parse_cpu_class(here)  # this machine's class is well formed


def test_cpu_classes_compare_as_strings_and_unknown_never_matches():
    zen3, avx512 = 'x86_64:avx2,fma', 'x86_64:avx2,fma,avx512f,avx512vnni'
    assert cpu_class.same_cpu_class(zen3, zen3) and not cpu_class.same_cpu_class(zen3, avx512)
    unknown = cpu_class.UNKNOWN
    assert not cpu_class.same_cpu_class(unknown, unknown)
    assert CpuClasses(zen3, zen3).token_rule == compare.EXACT
    assert CpuClasses(zen3, avx512).token_rule == compare.CROSS_CPU
    assert CpuClasses(unknown, zen3).token_rule == compare.CROSS_CPU
    assert CpuClasses().token_rule == compare.CROSS_CPU
    assert cpu_class.parse_cpu_class(' X86_64:AVX2,FMA ') == zen3
    assert cpu_class.parse_cpu_class('') == cpu_class.parse_cpu_class('Unknown') == unknown
    for bad in ('avx2', 'x86_64: avx2', 'x86_64:avx2,,fma', 'x86 64:avx2'):
        with pytest.raises(CpuClassError, match='ARCH:FEATURE'):
            cpu_class.parse_cpu_class(bad)


# ---------------------------------------------------------------- cross-CPU token rule

ZEN3_CLASS = 'x86_64:avx2,fma'
AVX512_CLASS = 'x86_64:avx2,fma,avx512f,avx512vnni'
SAME = CpuClasses(ZEN3_CLASS, ZEN3_CLASS)
OTHER = CpuClasses(AVX512_CLASS, ZEN3_CLASS)
UNKNOWN_BAG = CpuClasses(cpu_class.UNKNOWN, ZEN3_CLASS)
SKY_OLD = 'The sky on a clear day is often described as a deep, rich, and vibrant shade of blue.'
SKY_NEW = 'The sky on a clear day is often described as a deep, rich shade of blue, with a hint'


def drifted(at: int, length: int = 24, tail: int = 1000) -> tuple:
    """Return token ids equal to range(length) up to `at`, then different ones."""
    return tuple(range(at)) + tuple(range(tail, tail + length - at))


def test_same_cpu_class_requires_identical_tokens():
    old = record(text=SKY_OLD, tokens=range(24), finish='length')
    new = record(goal_id='b', text=SKY_NEW, tokens=drifted(14), finish='length')
    goal = compare_goal(0, old, ok(new), DEFAULTS, SAME)
    assert goal.token_rule == compare.EXACT
    assert codes(goal) == {'token_mismatch': 'regression'}
    assert 'cross-CPU' not in goal.findings[0].message
    assert compare_goal(0, old, ok(replace(old, goal_id='c')), DEFAULTS, SAME).findings == []


@pytest.mark.parametrize('cpu', [OTHER, UNKNOWN_BAG], ids=['other-class', 'unknown-class'])
def test_cross_cpu_drift_within_thresholds_is_a_warning(cpu):
    old = record(text=SKY_OLD, tokens=range(24), finish='length')
    new = record(goal_id='b', text=SKY_NEW, tokens=drifted(14), finish='length')
    goal = compare_goal(0, old, ok(new), DEFAULTS, cpu)
    assert goal.token_rule == compare.CROSS_CPU and goal.tokens_equal is False
    assert codes(goal) == {'cross_cpu_drift': 'warning'}
    assert (goal.leading_agreement, goal.required_agreement) == (14, 12)
    message = goal.findings[0].message
    assert 'float drift on another CPU class' in message and cpu.recorded in message
    assert '14 leading tokens agree (>= 12 required)' in message
    result = compare_run([old], [ok(new)], DEFAULTS, cpu=cpu)
    assert result.exit_code() == EXIT_OK and result.verdict() == 'PASS'


def test_cross_cpu_drift_beyond_thresholds_stays_a_regression():
    old = record(text=SKY_OLD, tokens=range(24), finish='length')
    early = record(goal_id='b', text='The weather is nice today, is it not? Let me',
                   finish='length', tokens=drifted(3))
    goal = compare_goal(0, old, ok(early), DEFAULTS, OTHER)
    assert codes(goal) == {'token_mismatch': 'regression'}
    message = goal.findings[0].message
    assert 'beyond the cross-CPU thresholds' in message
    assert 'only 3 leading tokens agree, 12 required' in message
    # A late divergence into unrelated text fails the similarity floor.
    garbage = record(goal_id='c', text=SKY_OLD[:40] + ' zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz'
                     'zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz', tokens=drifted(20),
                     finish='length')
    goal = compare_goal(0, old, ok(garbage), DEFAULTS, OTHER)
    assert codes(goal) == {'token_mismatch': 'regression'} and goal.similarity < 0.4
    assert 'below cross_cpu_min_similarity 0.40' in goal.findings[0].message
    # An answer cut short changed no token: never drift (finish reason aside).
    cut = record(goal_id='d', text=SKY_OLD[:50], tokens=range(20), finish='length')
    goal = compare_goal(0, old, ok(cut), DEFAULTS, OTHER)
    assert codes(goal) == {'token_mismatch': 'regression'}
    assert 'only cuts or extends the recorded answer' in goal.findings[0].message


def test_cross_cpu_thresholds_fraction_cap_and_strict_settings():
    limits = DEFAULTS.outputs
    assert [compare.required_agreement(n, limits) for n in (0, 1, 7, 8, 24, 32, 200)] == [
        0, 1, 4, 4, 12, 16, 16]
    uncapped = replace(limits, cross_cpu_max_required_tokens=0)
    assert compare.required_agreement(200, uncapped) == 100
    assert compare.required_agreement(10, replace(limits, cross_cpu_min_token_agreement=0.3)) \
        == 3
    long_old = record(text=SKY_OLD * 4, tokens=range(200), finish='length')
    long_new = record(goal_id='b', text=SKY_OLD * 3 + SKY_NEW, tokens=drifted(20, 200),
                      finish='length')
    assert codes(compare_goal(0, long_old, ok(long_new), DEFAULTS, OTHER)) == {
        'cross_cpu_drift': 'warning'}
    no_cap = Thresholds(outputs=uncapped)
    assert codes(compare_goal(0, long_old, ok(long_new), no_cap, OTHER)) == {
        'token_mismatch': 'regression'}
    # Exact on every CPU: every leading token required (a differing one then never passes).
    exact = Thresholds(outputs=replace(uncapped, cross_cpu_min_token_agreement=1.0))
    old = record(text=SKY_OLD, tokens=range(24))
    late = record(goal_id='c', text=SKY_OLD[:-1] + '!', tokens=drifted(23))
    assert codes(compare_goal(0, old, ok(late), exact, OTHER)) == {'token_mismatch': 'regression'}
    assert codes(compare_goal(0, old, ok(late), DEFAULTS, OTHER)) == {'cross_cpu_drift': 'warning'}
    relaxed = Thresholds(outputs=replace(limits, greedy_exact_match=False))
    early = record(goal_id='d', text='x', tokens=drifted(1))
    assert codes(compare_goal(0, old, ok(early), relaxed, OTHER)) == {'token_mismatch': 'warning'}


def test_sampled_goals_ignore_the_cpu_class():
    old = record(temperature=0.8, text='robots plan paths around obstacles')
    far = record(goal_id='c', temperature=0.8, tokens=(3,), text='xyz')
    goal = compare_goal(0, old, ok(far), DEFAULTS, OTHER)
    assert codes(goal) == {'low_similarity': 'regression'} and goal.token_rule is None


TOOLS = [ToolSpecRecord('move', 'Drive', '{"type": "object", "required": ["meters"], '
                        '"properties": {"meters": {"type": "number"}}}'),
         ToolSpecRecord('grab', 'Close the gripper', '')]


def tool_record(goal_id: str, *calls, tokens=range(24), finish='tool_calls') -> TranscriptRecord:
    return record(goal_id=goal_id, text='', tokens=tokens, finish=finish, tools=TOOLS,
                  tool_calls=[ToolCallRecord(f'c{i}', name, args)
                              for i, (name, args) in enumerate(calls)])


@pytest.mark.parametrize('cpu', [None, SAME, OTHER, UNKNOWN_BAG])
def test_non_numeric_checks_are_strict_on_every_cpu(cpu):
    """Finish reason, JSON, tool names and arguments, sampling: never float drift."""
    # Every replay below drifted within the cross-CPU thresholds, and broke one more thing.
    tokens = drifted(20)
    old = record(text=SKY_OLD, tokens=range(24))
    stopped = record(goal_id='b', text=SKY_NEW, tokens=tokens, finish='length')
    assert 'finish_reason_changed' in codes(compare_goal(0, old, ok(stopped), DEFAULTS, cpu))
    assert codes(compare_goal(0, old, ok(stopped), DEFAULTS, cpu))[
        'finish_reason_changed'] == 'regression'

    schema = '{"type": "object", "required": ["answer"]}'
    json_old = record(text='{"answer": "the sky is blue on a clear day"}', json_schema=schema,
                      tokens=range(24))
    json_new = record(goal_id='c', text='{"answer": "the sky is blue on a clear day',
                      tokens=tokens, json_schema=schema)
    assert codes(compare_goal(0, json_old, ok(json_new), DEFAULTS, cpu))[
        'json_invalid'] == 'regression'

    calls_old = tool_record('a', ('move', '{"meters": 2.0}'), ('grab', '{}'))
    renamed = tool_record('b', ('move', '{"meters": 2.0}'), ('drop', '{}'), tokens=tokens)
    found = codes(compare_goal(0, calls_old, ok(renamed), DEFAULTS, cpu))
    assert found['tool_calls_changed'] == 'regression'
    reordered = tool_record('b', ('grab', '{}'), ('move', '{"meters": 2.0}'), tokens=tokens)
    assert codes(compare_goal(0, calls_old, ok(reordered), DEFAULTS, cpu))[
        'tool_calls_changed'] == 'regression'
    broken = tool_record('c', ('move', '{"meters": 2.'), ('grab', '{}'), tokens=tokens)
    goal = compare_goal(0, calls_old, ok(broken), DEFAULTS, cpu)
    assert codes(goal)['tool_arguments_invalid'] == 'regression'
    assert 'tool call 0 (move)' in [f.message for f in goal.findings
                                    if f.code == 'tool_arguments_invalid'][0]
    off_schema = tool_record('d', ('move', '{"meters": "far"}'), ('grab', '{}'), tokens=tokens)
    goal = compare_goal(0, calls_old, ok(off_schema), DEFAULTS, cpu)
    assert 'violates the schema' in [f.message for f in goal.findings
                                     if f.code == 'tool_arguments_invalid'][0]
    drifted_value = tool_record('e', ('move', '{"meters": 2.5}'), ('grab', '{}'), tokens=tokens)
    assert 'tool_arguments_invalid' not in codes(
        compare_goal(0, calls_old, ok(drifted_value), DEFAULTS, cpu))

    hot = replace(stopped, finish_reason='stop', effective_sampling=replace(
        stopped.effective_sampling, temperature=0.7))
    assert codes(compare_goal(0, old, ok(hot), DEFAULTS, cpu))[
        'effective_sampling_changed'] == 'regression'


def test_tool_call_checks_follow_their_setting():
    calls_old = tool_record('a', ('move', '{"meters": 2.0}'))
    broken = tool_record('b', ('move', 'meters=2'))
    lax = Thresholds(outputs=OutputThresholds(tool_calls_must_stay_valid=False))
    assert codes(compare_goal(0, calls_old, ok(broken), lax)) == {
        'tool_arguments_invalid': 'warning'}
    assert compare.tool_arguments_valid('[1]') == (False, 'not a JSON object')
    assert compare.tool_arguments_valid('{"a": 1}', 'not a schema')[0] is True


def test_report_names_both_cpu_classes_and_the_rule_per_goal(tmp_path):
    old = record(text=SKY_OLD, tokens=range(24), finish='length')
    new = record(goal_id='b', text=SKY_NEW, tokens=drifted(14), finish='length')
    same = record(goal_id='c', prompt='other', tokens=(1, 2))
    result = compare_run([old, same], [ok(new), ok(replace(same, goal_id='d'))], DEFAULTS,
                         cpu=UNKNOWN_BAG)
    data = write_report(result, RunInfo(bag='old', new_bag='new'), tmp_path)
    assert data['cpu'] == {'recorded': 'unknown', 'replay': ZEN3_CLASS, 'same_class': False,
                           'token_rule': 'cross_cpu', 'token_rule_text': 'cross-CPU tolerant'}
    assert [g['token_rule'] for g in data['goals']] == ['cross_cpu', 'cross_cpu']
    assert (data['goals'][0]['leading_agreement'], data['goals'][0]['required_agreement']) == (
        14, 12)
    summary = data['summary']
    assert (summary['greedy_compared'], summary['greedy_exact'], summary['greedy_identical'],
            summary['greedy_cross_cpu_drift'], summary['regressions']) == (2, 2, 1, 1, 0)
    assert data['verdict'] == 'PASS' and summary['warnings'] == 1
    for name in ('summary.md', 'report.html'):
        text = (tmp_path / name).read_text()
        assert 'cross-CPU tolerant' in text and ZEN3_CLASS in text and 'cross_cpu_drift' in text
    exact = write_report(compare_run([old], [ok(new)], DEFAULTS, cpu=SAME), RunInfo(),
                         tmp_path / 'same')
    assert exact['cpu']['token_rule'] == 'exact' and exact['verdict'] == 'REGRESSION'
    assert exact['goals'][0]['token_rule_text'] == 'exact (same CPU class)'
    assert (exact['summary']['greedy_exact'], exact['summary']['greedy_identical']) == (0, 0)
    assert 'exact (same CPU class)' in (tmp_path / 'same' / 'summary.md').read_text()


@pytest.mark.parametrize('text, message', [
    ('outputs: {cross_cpu_min_similarity: 1.5}\n',
     'outputs.cross_cpu_min_similarity is a fraction: it must be between 0 and 1'),
    ('outputs: {cross_cpu_min_token_agreement: -0.1}\n',
     'outputs.cross_cpu_min_token_agreement must be a number >= 0'),
    ('outputs: {cross_cpu_max_required_tokens: 2.5}\n',
     'outputs.cross_cpu_max_required_tokens must be an integer >= 0'),
    ('outputs: {tool_calls_must_stay_valid: yes please}\n',
     'outputs.tool_calls_must_stay_valid must be true or false'),
    ('outputs: {cross_cpu_similarity: 0.5}\n', 'unknown setting(s) outputs.cross_cpu_similarity'),
])
def test_bad_cross_cpu_thresholds_say_what_to_fix(tmp_path, text, message):
    path = tmp_path / 'thresholds.yaml'
    path.write_text(text)
    with pytest.raises(ThresholdsError) as err:
        load_thresholds(path)
    assert message in str(err.value)


def test_cross_cpu_thresholds_load_from_yaml(tmp_path):
    path = tmp_path / 't.yaml'
    path.write_text('outputs:\n  cross_cpu_min_token_agreement: 1\n  cross_cpu_min_similarity: '
                    '0.9\n  cross_cpu_max_required_tokens: 0\n')
    outputs = load_thresholds(path).outputs
    assert outputs == OutputThresholds(cross_cpu_min_token_agreement=1.0,
                                       cross_cpu_min_similarity=0.9,
                                       cross_cpu_max_required_tokens=0)
    assert isinstance(outputs.cross_cpu_min_token_agreement, float)
