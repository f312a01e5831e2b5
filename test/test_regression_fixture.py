"""CI regression gate: replay the checked-in SmolLM2 bag against the current llm_node.

test/data/bags/smollm2_greedy_v7/ was recorded by edge_llm_ros.regression.make_fixture from a
real llm_node (embedded SmolLM2, greedy) when the op library's attention began taking its
softmax exp from its own vectorized polynomial instead of glibc's expf (within 1 ulp; v6's
goals 0 and 2 moved off near ties at token 14), on an AVX-512 machine, with its CPU class.
The older bags (smollm2_greedy: version 1, no CPU class; _v2; _v4, recorded on kquant weights
with GroupQueryAttention; _v5, the row-exact CausalAttention before the fused SiLU; _v6, the
fused SiLU, before attention's own exp) are tested as old bags elsewhere. The
current build must reproduce every greedy answer under its token rule: identical tokens, or
(on another CPU class, the cross-CPU rule) a late float-drift divergence within the
cross-CPU thresholds (docs/regression.md, "Replaying on another machine"); two deliberate
changes must be reported as regressions on any CPU.
"""
import pathlib

import pytest
import rclpy
from rclpy.context import Context
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import Parameter
from rclpy.parameter_client import AsyncParameterClient
from regression_helpers import read_report, run_tool

from edge_llm_ros.regression import bagio
from edge_llm_ros.regression.compare import CROSS_CPU, EXACT
from edge_llm_ros.regression.cpu_class import current_cpu_class, same_cpu_class, UNKNOWN
from edge_llm_ros.regression.make_fixture import (DEFAULT_OUT, FIXTURE_GOALS, MAX_TOKENS,
                                                  NODE_PARAMETERS, start_node)

pytestmark = pytest.mark.timeout(600)
FIXTURE = DEFAULT_OUT
NAMESPACE = '/fixture_ci'
NODE = f'{NAMESPACE}/llm_node'


@pytest.fixture(scope='module')
def outputs_only(tmp_path_factory) -> pathlib.Path:
    """Thresholds for the fixture: the bag was recorded on another machine (no latency)."""
    path = tmp_path_factory.mktemp('thresholds') / 'outputs_only.yaml'
    path.write_text('latency:\n  enabled: false\n')
    return path


@pytest.fixture(scope='module')
def llm_node():
    """Run the current build's llm_node with the parameters the fixture was recorded with."""
    proc = start_node(NAMESPACE, NODE_PARAMETERS)
    assert proc.fqn == NODE
    try:
        yield NODE
    finally:
        proc.stop()
        print(proc.tail(60))


def replay(tmp_path, outputs_only, *args):
    report = tmp_path / 'report'
    proc = run_tool('replay', FIXTURE, '--node', NODE, '--report', report, '--thresholds',
                    outputs_only, '--server-timeout', '240', '--goal-timeout', '60', *args,
                    timeout=500)
    data = read_report(report)
    # Every goal must have been answered: a lost or timed-out goal would hide behind
    # the regressions the tests expect.
    assert [g['status'] for g in data['goals']] == ['succeeded'] * len(FIXTURE_GOALS), proc.stdout
    return proc, data


def set_node_parameter(name: str, value) -> None:
    context = Context()
    rclpy.init(context=context)
    node = rclpy.create_node('fixture_parameter_setter', context=context)
    try:
        client = AsyncParameterClient(node, NODE)
        assert client.wait_for_services(timeout_sec=30.0)
        future = client.set_parameters([Parameter(name, value=value)])
        executor = SingleThreadedExecutor(context=context)
        executor.add_node(node)
        executor.spin_until_future_complete(future, timeout_sec=30.0)
        executor.shutdown()
        assert future.result().results[0].successful, future.result()
    finally:
        node.destroy_node()
        rclpy.shutdown(context=context)


def test_fixture_is_a_small_greedy_smollm2_session():
    size = sum(f.stat().st_size for f in FIXTURE.iterdir())
    assert size < 200 * 1024
    contents = bagio.read_bag(FIXTURE)
    assert contents.complete and contents.problems == []
    assert len(contents.transcripts) == len(FIXTURE_GOALS)
    for record in contents.transcripts:
        assert record.accepted and record.finish_reason in ('stop', 'length')
        assert record.effective_temperature() == 0.0 and record.sampling.temperature < 0
        assert record.max_tokens == MAX_TOKENS and 0 < len(record.token_ids) <= MAX_TOKENS
        assert 'smollm2' in record.model.lower()


def test_current_build_reproduces_the_fixture(llm_node, tmp_path, outputs_only):
    proc, data = replay(tmp_path, outputs_only)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert data['verdict'] == 'PASS'
    assert data['summary']['greedy_exact'] == data['summary']['greedy_compared'] == len(
        FIXTURE_GOALS)
    # The bag says its CPU class: the exact rule on that class, the cross-CPU rule elsewhere;
    # the replay bag records this machine's class.
    recorded = bagio.read_bag(FIXTURE).cpu_class
    assert recorded != UNKNOWN and data['cpu']['recorded'] == recorded
    assert data['cpu']['replay'] == current_cpu_class()
    rule = EXACT if same_cpu_class(recorded, current_cpu_class()) else CROSS_CPU
    assert [g['token_rule'] for g in data['goals']] == [rule] * len(FIXTURE_GOALS)
    assert all(g['tokens_equal'] or g['leading_agreement'] >= g['required_agreement']
               for g in data['goals'])
    assert bagio.read_bag(tmp_path / 'report' / 'replay_bag').cpu_class == current_cpu_class()


def test_truncated_max_tokens_is_a_regression(llm_node, tmp_path, outputs_only):
    proc, data = replay(tmp_path, outputs_only, '--set', 'max_tokens=4')
    assert proc.returncode == 1, proc.stdout + proc.stderr
    codes = {f['code'] for f in data['findings'] if f['severity'] == 'regression'}
    assert {'token_mismatch', 'finish_reason_changed'} <= codes
    summary = (tmp_path / 'report' / 'summary.md').read_text()
    assert 'token_mismatch' in summary and "-> 'length'" in summary


def test_other_default_temperature_is_a_regression(llm_node, tmp_path, outputs_only):
    set_node_parameter('sampling.temperature', 0.8)
    try:
        proc, data = replay(tmp_path, outputs_only)
    finally:
        set_node_parameter('sampling.temperature', 0.0)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    changed = [f for f in data['findings'] if f['code'] == 'effective_sampling_changed']
    assert len(changed) == len(FIXTURE_GOALS)
    assert 'temperature 0 -> 0.8' in changed[0]['message']
    assert 'effective_sampling_changed' in (tmp_path / 'report' / 'report.html').read_text()


def test_a_late_recorder_still_gets_the_last_transcripts(llm_node, tmp_path, outputs_only):
    """~/transcript is transient-local: edge-llm-record started after goals records them."""
    replay(tmp_path, outputs_only)
    bag = tmp_path / 'late'
    proc = run_tool('record', '-o', bag, '--node', llm_node, '--duration', '60',
                    '--max-goals', len(FIXTURE_GOALS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    prompts = {t.prompt or t.messages[-1].content for t in bagio.read_bag(bag).transcripts}
    assert prompts == {prompt for prompt, _, _ in FIXTURE_GOALS}
