"""llm_node's lifecycle, driven through lifecycle_msgs services of a real node process.

The last test stops node processes with SIGINT at varied moments: idle, while a goal
streams, right after a goal was sent (during admission), with goals queued, or while a
parameter change is handled. Each must exit 0 without a traceback (issue 11): rclpy's own
signal handler used to shut the context down under a spinning executor ("failed to
initialize wait set: the given context is not valid", about once in 15 stops);
nodes/spin.py now stops the executor before the context.
"""
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

from llm_node_harness import (LONG_SCHEMA, LONG_TOKENS, medium_model_dir, NodeProcess,
                              RosClient, TRANSITIONS, wait_for)
import pytest
from rcl_interfaces.msg import Parameter as ParameterMsg
from rcl_interfaces.msg import ParameterType, ParameterValue
from rcl_interfaces.srv import SetParameters
import rclpy

from edge_llm_ros.client import GoalRejectedError

# The moments at which SIGINT arrives; each runs in SHUTDOWN_ROUNDS fresh processes.
SHUTDOWN_MOMENTS = ('idle', 'streaming', 'just sent', 'queued', 'setting a parameter')
SHUTDOWN_ROUNDS = 2
SHUTDOWN_CONTEXT = 512   # kv.max_context of those processes: quick to load


@pytest.fixture(scope='module')
def model_dir(tmp_path_factory) -> pathlib.Path:
    return medium_model_dir(tmp_path_factory.mktemp('llm_node_lifecycle_models'))


@pytest.fixture(scope='module')
def ros():
    rclpy.init()
    client = RosClient(f'llm_lifecycle_test_client_{os.getpid()}')
    yield client
    client.close()
    rclpy.shutdown()


def _assert_rejected(llm) -> None:
    with pytest.raises(GoalRejectedError):
        llm.generate('Hello sky', max_tokens=2).result(timeout=30)


def _assert_serves(llm) -> None:
    outcome = llm.generate('Hello sky', max_tokens=2).result(timeout=60)
    assert outcome.status == 'succeeded', outcome


def _ask(server: str) -> tuple:
    """Run `edge-llm ask` against `server`; (exit code, stderr).

    --wait must cover a fresh process's discovery of the node on a loaded machine (2 s did
    not, seen on a 2-core VM); the node is not active, so ask waits all of it, then fails.
    """
    proc = subprocess.run([sys.executable, '-m', 'edge_llm_ros.cli', 'ask', 'Hello', '--server',
                           server, '--wait', '8'], capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stderr


def test_transitions_gate_serving_and_deactivate_cancels_running_goals(model_dir, ros):
    name = f'llm_lifecycle_{os.getpid()}'
    server = '/' + name
    proc = NodeProcess(name, {'model.path': str(model_dir)})
    try:
        ros.wait_state(server, 'unconfigured', timeout=60)
        llm = ros.llm(server)
        _assert_rejected(llm)   # goals before configuration
        code, err = _ask(server)
        assert code == 1 and "is 'unconfigured', not 'active'" in err, err
        assert 'autostart:=true' in err and 'Traceback' not in err, err
        tokens = llm.tokenize('Hello', timeout=30)
        assert not tokens.success and 'unconfigured' in tokens.error_message
        status = ros.next_status(server)
        assert status['level'] == 1 and status['state'] == 'unconfigured'   # WARN

        assert ros.transition(server, TRANSITIONS['configure'])
        assert ros.state(server) == 'inactive'
        assert llm.tokenize('Hello', timeout=30).success   # the tokenizer is loaded
        _assert_rejected(llm)   # configured but not active
        refused = llm.complete('Hello', max_tokens=2, timeout=30)
        assert not refused.success and 'not active' in refused.error_message

        assert ros.transition(server, TRANSITIONS['activate'])
        _assert_serves(llm)

        running = llm.generate('Count', max_tokens=LONG_TOKENS, json_schema=LONG_SCHEMA)
        wait_for(lambda: running.first_feedback_at is not None, 60, 'the goal to run')
        assert ros.transition(server, TRANSITIONS['deactivate'])
        outcome = running.result(timeout=30)
        assert outcome.status == 'aborted' and outcome.finish_reason == 'cancelled'
        assert 'deactivated' in outcome.error_message
        assert 0 < outcome.completion_tokens < LONG_TOKENS and outcome.text
        _assert_rejected(llm)

        assert ros.transition(server, TRANSITIONS['activate'])
        _assert_serves(llm)
        assert ros.transition(server, TRANSITIONS['deactivate'])
        assert ros.transition(server, TRANSITIONS['cleanup'])
        assert ros.state(server) == 'unconfigured'
        assert not llm.tokenize('Hello', timeout=30).success   # the model is freed

        assert ros.transition(server, TRANSITIONS['configure'])
        assert ros.transition(server, TRANSITIONS['activate'])
        _assert_serves(llm)
        assert ros.transition(server, TRANSITIONS['deactivate'])
        assert ros.transition(server, TRANSITIONS['shutdown'])
        assert ros.state(server) == 'finalized'
    finally:
        code = proc.stop()
    assert code == 0, proc.log()


def test_configure_fails_on_a_corrupt_model_and_node_stays_up(model_dir, ros, tmp_path):
    broken = tmp_path / 'broken'
    shutil.copytree(model_dir, broken)
    (broken / 'model.onnx').write_bytes(b'this is not an onnx file' * 100)
    name = f'llm_corrupt_{os.getpid()}'
    server = '/' + name
    # autostart tries to configure at once and fails: the node must stay up, unconfigured.
    proc = NodeProcess(name, {'model.path': str(broken), 'autostart': True})
    try:
        ros.wait_state(server, 'unconfigured', timeout=60)
        wait_for(lambda: 'configure failed' in proc.log(), 30, 'the configure error in the log')
        status = ros.next_status(server)
        assert status['level'] == 2, status   # ERROR
        assert status['message'].startswith('model load failed')
        assert 'model.onnx' in status['load_error'] or 'onnx' in status['load_error'].lower()
        assert not ros.transition(server, TRANSITIONS['configure'])
        assert ros.state(server) == 'unconfigured'
        _assert_rejected(ros.llm(server))
    finally:
        code = proc.stop()
    assert code == 0, proc.log()


def _interrupt_at(moment: str, ros, server: str, proc: NodeProcess,
                  rng: random.Random) -> None:
    """Bring the node to `moment`, then send SIGINT (without waiting for answers)."""
    llm = ros.llm(server)
    long_goal = {'max_tokens': SHUTDOWN_CONTEXT - 64, 'json_schema': LONG_SCHEMA}
    if moment == 'idle':
        time.sleep(rng.uniform(0.0, 0.3))
    elif moment == 'streaming':
        first = threading.Event()
        llm.generate('Count', on_feedback=lambda chunk: first.set(), **long_goal)
        assert first.wait(30), 'no feedback from the long goal'
    elif moment == 'just sent':
        llm.generate('Hello sky', max_tokens=8)
        time.sleep(rng.uniform(0.0, 0.02))
    elif moment == 'queued':
        for i in range(3):
            llm.generate(f'queued {i}', **long_goal)
        time.sleep(rng.uniform(0.0, 0.05))
    elif moment == 'setting a parameter':
        client = ros.node.create_client(SetParameters, server + '/set_parameters')
        assert client.wait_for_service(timeout_sec=30)
        client.call_async(SetParameters.Request(parameters=[ParameterMsg(
            name='sampling.top_k', value=ParameterValue(
                type=ParameterType.PARAMETER_INTEGER, integer_value=5))]))
        time.sleep(rng.uniform(0.0, 0.01))
    proc.proc.send_signal(signal.SIGINT)


@pytest.mark.parametrize('moment', SHUTDOWN_MOMENTS)
def test_sigint_stops_a_serving_node_cleanly(model_dir, ros, moment):
    rng = random.Random(f'{moment}-{os.getpid()}')
    for round_ in range(SHUTDOWN_ROUNDS):
        name = f'llm_sigint_{os.getpid()}_{SHUTDOWN_MOMENTS.index(moment)}_{round_}'
        proc = NodeProcess(name, {'autostart': True, 'model.path': str(model_dir),
                                  'kv.max_context': SHUTDOWN_CONTEXT, 'queue.depth': 4,
                                  'feedback.period_tokens': 1})
        try:
            ros.wait_state('/' + name, 'active', timeout=60)
            _assert_serves(ros.llm('/' + name))
            _interrupt_at(moment, ros, '/' + name, proc, rng)
        finally:
            code = proc.stop(timeout=30)
        log = proc.log()
        assert code == 0, f'{moment}, round {round_}: exit code {code}\n{log}'
        assert 'Traceback' not in log, f'{moment}, round {round_}:\n{log}'
