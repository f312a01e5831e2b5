"""Record and replay end to end against a real rclpy action server (test/fake_llm_server.py).

A session is recorded with edge-llm-record from a fake llm_node, then replayed with
edge-llm-replay against servers with the same or deliberately changed settings.
"""
import json
import pathlib
import signal
import subprocess
import tempfile
import time

import pytest
import rclpy
from rclpy.action import ActionClient
from rclpy.context import Context
from rclpy.executors import SingleThreadedExecutor
from rclpy.serialization import deserialize_message
from regression_helpers import (
    fake_server, handle, PYTHON, read_report, ROOT, run_tool, stock_record_layout,
    stop_process, wait_for_line)
from rosbags.rosbag2 import Reader, StoragePlugin

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import ChatMessage, Transcript
from edge_llm_ros.regression import bagio
from edge_llm_ros.regression.cpu_class import current_cpu_class, UNKNOWN
from edge_llm_ros.regression.live import RawRecorder

pytestmark = pytest.mark.timeout(300)
SCHEMA = '{"type": "object", "required": ["answer"]}'


def session_goals() -> list:
    """Return a small session covering every kind of goal the comparison distinguishes."""
    goals = []
    goals.append(Generate.Goal(prompt='Why is the sky blue?', max_tokens=24))
    chat = Generate.Goal(system_prompt='You are a robot.', max_tokens=24)
    chat.messages = [ChatMessage(role='user', content='Plan a path to the door.')]
    goals.append(chat)
    goals.append(Generate.Goal(prompt='List sensors', stop=['robots'], max_tokens=24))
    goals.append(Generate.Goal(prompt='Answer in JSON', json_schema=SCHEMA))
    sampled = Generate.Goal(prompt='Tell a story', max_tokens=24)
    sampled.sampling.temperature = 0.9
    sampled.sampling.seed = 7
    goals.append(sampled)
    goals.append(Generate.Goal(prompt='What is in front of me?', max_tokens=24,
                               prefix_embeddings=[handle('cam0')]))
    return goals


def send_goals(action_name: str, goals: list) -> list:
    """Send goals one by one from this process (own rclpy context); returns results."""
    context = Context()
    rclpy.init(context=context)
    node = rclpy.create_node('regression_test_client', context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    client = ActionClient(node, Generate, action_name)
    results = []
    try:
        assert client.wait_for_server(timeout_sec=60.0)
        for goal in goals:
            future = client.send_goal_async(goal)
            executor.spin_until_future_complete(future, timeout_sec=60.0)
            assert future.done(), 'no goal response within 60 s'
            result = future.result().get_result_async()
            executor.spin_until_future_complete(result, timeout_sec=60.0)
            assert result.done(), 'no result within 60 s'
            results.append(result.result().result)
    finally:
        client.destroy()
        executor.shutdown()
        node.destroy_node()
        rclpy.shutdown(context=context)
    return results


@pytest.fixture(scope='module')
def workdir():
    with tempfile.TemporaryDirectory(prefix='regression_replay_') as folder:
        yield pathlib.Path(folder)


@pytest.fixture(scope='module')
def outputs_only(workdir):
    """Thresholds without the latency gate: sleep-based fake timings are noisy here."""
    path = workdir / 'outputs_only.yaml'
    path.write_text('latency:\n  enabled: false\n')
    return path


@pytest.fixture(scope='module')
def reference_server():
    """Run the server the session is recorded from (it knows tensor pool cam0)."""
    with fake_server('/rg_ref', '--known-pool', 'cam0') as name:
        yield name


@pytest.fixture(scope='module')
def recording(workdir, reference_server):
    """edge-llm-record's bag of session_goals() on the reference server."""
    bag = workdir / 'session'
    goals = session_goals()
    with tempfile.TemporaryFile('w+') as log:
        proc = subprocess.Popen(
            [PYTHON, '-m', 'edge_llm_ros.regression.record', '-o', str(bag), '--node',
             reference_server, '--max-goals', str(len(goals)), '--diagnostics'],
            stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        try:
            # Every recorded topic matched (messages published before are lost), including
            # the feedback the first test counts.
            for topic in ('transcript', 'generate/_action/feedback', 'generate/_action/status'):
                wait_for_line(proc, log, f'on {reference_server}/{topic}', 60.0)
            results = send_goals(f'{reference_server}/generate', goals)
            proc.wait(timeout=60.0)
        finally:
            stop_process(proc)
        log.seek(0)
        output = log.read()
    assert proc.returncode == 0, output
    assert [r.finish_reason for r in results][:4] == ['stop', 'stop', 'stop', 'stop']
    return bag


def test_recorder_writes_paired_goals_feedback_and_status(recording):
    contents = bagio.read_bag(recording)
    assert contents.complete and contents.problems == []
    assert len(contents.transcripts) == len(session_goals())
    prompts = [t.prompt or t.messages[0].content for t in contents.transcripts]
    assert prompts[0] == 'Why is the sky blue?' and prompts[1] == 'Plan a path to the door.'
    first = contents.transcripts[0]
    # goal -> result pairing: the transcript's goal id is the one feedback carried.
    assert len(contents.feedback[first.goal_id]) == first.completion_tokens
    assert first.effective_temperature() == 0.0 and first.model == 'fake-llm'
    assert contents.transcripts[5].prefix_embeddings[0].pool_id == 'cam0'
    with Reader(recording) as reader:
        topics = {c.topic: c for c in reader.connections}
    status = topics['/rg_ref/llm_node/generate/_action/status']
    assert status.msgcount > 0
    qos = topics['/rg_ref/llm_node/transcript'].ext.offered_qos_profiles
    # The publisher's offered QoS is stored (DDS does not tell the history depth).
    assert [(q.reliability.name, q.durability.name) for q in qos] == [
        ('RELIABLE', 'VOLATILE')]


def test_replay_against_the_same_build_passes(recording, reference_server,
                                              workdir, outputs_only):
    report = workdir / 'same'
    proc = run_tool('replay', recording, '--node', reference_server, '--report', report,
                    '--thresholds', outputs_only)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = read_report(report)
    assert data['verdict'] == 'PASS'
    summary = data['summary']
    assert summary['compared'] == 6 and summary['greedy_exact'] == summary[
        'greedy_compared'] == 5
    kinds = [g['kind'] for g in data['goals']]
    assert kinds == ['greedy'] * 4 + ['sampled', 'greedy']
    assert data['goals'][3]['json_valid_new'] is True
    new = bagio.read_bag(report / 'replay_bag')
    assert len(new.transcripts) == 6
    # Recorded and replayed on this machine: one CPU class, greedy tokens compared exactly.
    here = current_cpu_class()
    assert bagio.read_bag(recording).cpu_class == new.cpu_class == here
    assert data['cpu']['same_class'] is (here != UNKNOWN)
    assert {g['token_rule'] for g in data['goals'] if g['kind'] == 'greedy'} == {
        'exact' if here != UNKNOWN else 'cross_cpu'}
    goal_map = json.loads(new.custom['edge_llm_ros.goal_map'])
    old_ids = [t.goal_id for t in bagio.read_bag(recording).transcripts]
    assert sorted(goal_map) == sorted(old_ids)
    assert {t.goal_id for t in new.transcripts} == set(goal_map.values())
    assert sum(len(v) for v in new.feedback.values()) > 0
    for name in ('summary.md', 'report.html', 'latency_distributions.png', 'per_goal.png'):
        assert (report / name).stat().st_size > 0


def test_truncated_max_tokens_override_is_a_regression(recording, reference_server,
                                                       workdir, outputs_only):
    report = workdir / 'truncated'
    proc = run_tool('replay', recording, '--node', reference_server, '--report', report,
                    '--set', 'max_tokens=2', '--thresholds', outputs_only)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = read_report(report)
    found = {(f['goal'], f['code']) for f in data['findings'] if f['severity'] == 'regression'}
    assert (0, 'token_mismatch') in found and (0, 'finish_reason_changed') in found
    assert 'token_mismatch' in proc.stdout and data['run']['overrides'] == {'max_tokens': 2}
    assert "'stop' -> 'length'" in (report / 'summary.md').read_text()


def test_other_default_temperature_is_a_regression(recording,
                                                   workdir, outputs_only):
    report = workdir / 'temperature'
    with fake_server('/rg_hot', '--temperature', '0.7', '--known-pool', 'cam0') as name:
        proc = run_tool('replay', recording, '--node', name, '--report', report,
                        '--thresholds', outputs_only)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = read_report(report)
    changed = [f for f in data['findings'] if f['code'] == 'effective_sampling_changed']
    # Every goal that left temperature to the node default, and only those.
    assert sorted(f['goal'] for f in changed) == [0, 1, 2, 3, 5]
    assert 'temperature 0 -> 0.7' in changed[0]['message']
    assert 'effective_sampling_changed' in (report / 'report.html').read_text()


def test_stale_tensor_handles_give_a_partial_report(recording,
                                                    workdir, outputs_only):
    report = workdir / 'stale'
    with fake_server('/rg_nopool') as name:
        proc = run_tool('replay', recording, '--node', name, '--report', report,
                        '--thresholds', outputs_only)
        skipped = run_tool('replay', recording, '--node', name, '--report',
                           workdir / 'stale_skipped', '--skip-tensor-goals',
                           '--thresholds', outputs_only)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    data = read_report(report)
    assert data['verdict'] == 'INCOMPLETE'
    stale = [f for f in data['findings'] if f['code'] == 'stale_tensor_handle']
    assert len(stale) == 1 and stale[0]['goal'] == 5
    assert "pool 'cam0'" in stale[0]['message'] and 'cannot be resolved' in stale[0]['message']
    assert data['summary']['compared'] == 5  # every other goal was still compared
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    assert read_report(workdir / 'stale_skipped')['goals'][5]['status'] == 'skipped'


@pytest.fixture(scope='module')
def slow_server():
    """Run a server 25x slower than the recording's that publishes no transcripts."""
    with fake_server('/rg_slow', '--slow', '25', '--no-transcript',
                     '--known-pool', 'cam0') as name:
        yield name


def test_slow_node_without_transcripts(recording, slow_server, workdir):
    """Latency regression; a node publishing no transcript still gets compared."""
    report = workdir / 'slow'
    proc = run_tool('replay', recording, '--node', slow_server, '--report', report)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert 'nothing publishes /rg_slow/llm_node/transcript' in proc.stderr
    data = read_report(report)
    codes = {f['code'] for f in data['findings'] if f['severity'] == 'regression'}
    assert codes == {'time_to_first_token_s_regression'} | (
        codes & {'decode_tokens_per_second_regression'})
    ttft = data['latency'][0]
    assert ttft['new_median'] > ttft['limit'] > ttft['old_median']
    assert {g['synthesized_transcript'] for g in data['goals']} == {True}
    assert data['summary']['greedy_exact'] == 5  # outputs themselves unchanged
    assert len(bagio.read_bag(report / 'replay_bag').transcripts) == 6


def test_ctrl_c_during_replay_keeps_a_partial_report(recording, slow_server, workdir):
    report = workdir / 'interrupted'
    with tempfile.TemporaryFile('w+') as log:
        proc = subprocess.Popen(
            [PYTHON, '-m', 'edge_llm_ros.regression.replay', str(recording), '--node',
             slow_server, '--report', str(report)],
            stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        try:
            wait_for_line(proc, log, 'goal 1/6', 60.0)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30.0) == 130
        finally:
            stop_process(proc)
    data = read_report(report)
    assert 'interrupted (Ctrl-C)' in data['run']['error']
    statuses = [g['status'] for g in data['goals']]
    assert statuses[0] == 'succeeded' and statuses[-1] == 'not_sent'
    assert bagio.read_bag(report / 'replay_bag').transcripts  # the new bag was closed


def test_recorder_stops_cleanly_on_ctrl_c(reference_server, workdir):
    bag = workdir / 'ctrl_c'
    with tempfile.TemporaryFile('w+') as log:
        proc = subprocess.Popen(
            [PYTHON, '-m', 'edge_llm_ros.regression.record', '-o', str(bag), '--node',
             reference_server, '--storage', 'sqlite3'],
            stdout=log, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        try:
            wait_for_line(proc, log, f'on {reference_server}/generate/_action/status', 60.0)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60.0) == 0
        finally:
            stop_process(proc)
    with Reader(bag) as reader:
        assert {c.topic for c in reader.connections} >= {
            f'{reference_server}/transcript', f'{reference_server}/generate/_action/status'}
    assert (bag / 'metadata.yaml').read_text().count('storage_identifier: sqlite3') == 1


def test_unreachable_node_exits_3_with_report(recording, workdir):
    report = workdir / 'nobody'
    proc = run_tool('replay', recording, '--node', '/nobody/llm_node', '--report', report,
                    '--server-timeout', '1')
    assert proc.returncode == 3, proc.stdout + proc.stderr
    data = read_report(report)
    assert 'no Generate action server at /nobody/llm_node/generate' in data['run']['error']
    assert {g['status'] for g in data['goals']} == {'not_sent'}


def test_stock_layout_bag_replays_with_original_timing(recording, reference_server,
                                                       workdir, outputs_only):
    """A bag laid out like `ros2 bag record` output (see docs/regression.md) replays.

    The stock layout records the default node's topics (/llm_node/...); --node points the
    replay at whichever node should answer.
    """
    with Reader(recording) as reader:
        conns = [c for c in reader.connections if c.msgtype == bagio.TRANSCRIPT_TYPE]
        raw = [data for _, _, data in reader.messages(connections=conns)]
    messages = [deserialize_message(data, Transcript) for data in raw]
    stock = stock_record_layout(workdir / 'stock', messages, StoragePlugin.MCAP)
    report = workdir / 'stock_report'
    proc = run_tool('replay', stock, '--node', reference_server, '--report', report,
                    '--timing', 'original', '--thresholds', outputs_only)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = read_report(report)
    assert data['verdict'] == 'PASS' and data['run']['timing'] == 'original'
    assert data['summary']['compared'] == 6


def test_rejected_and_timed_out_goals_are_reported_as_such(recording, slow_server, workdir,
                                                           outputs_only):
    """Goals the node refuses, and goals without a result in time, fail the replay."""
    with fake_server('/rg_refusing', '--reject-all', '--no-transcript') as name:
        refused = run_tool('replay', recording, '--node', name, '--report',
                           workdir / 'refused', '--thresholds', outputs_only)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    data = read_report(workdir / 'refused')
    assert {g['status'] for g in data['goals']} == {'rejected'}
    assert 'the node rejected the goal' in data['goals'][0]['findings'][0]['message']
    late = run_tool('replay', recording, '--node', slow_server, '--report', workdir / 'late',
                    '--thresholds', outputs_only, '--goal-timeout', '0.05')
    assert late.returncode == 1, late.stdout + late.stderr
    data = read_report(workdir / 'late')
    assert {g['status'] for g in data['goals']} == {'timeout'}
    assert 'no result within 0.05 s' in data['goals'][0]['findings'][0]['message']


def test_recorder_counts_publishers_without_matched_counts(reference_server, workdir, ros):
    """Humble's rclpy cannot count a subscription's matched publishers: the graph count."""
    topics = bagio.LlmTopics(reference_server)
    with bagio.BagWriter(workdir / 'counted') as writer:
        recorder = RawRecorder(ros('publisher_counter'), writer, topics.core())
        try:
            deadline = time.monotonic() + 30.0
            while recorder.publisher_count(topics.transcript) == 0 and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
            assert recorder.publisher_count(topics.transcript) == 1
            assert recorder.publisher_count(topics.transcript, matched=False) == 1
            assert recorder.publisher_count('/not/subscribed', matched=False) == 0
        finally:
            recorder.close()
