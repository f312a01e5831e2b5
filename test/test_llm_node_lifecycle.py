"""llm_node's lifecycle, driven through lifecycle_msgs services of a real node process."""
import os
import pathlib
import shutil

from llm_node_harness import (LONG_SCHEMA, LONG_TOKENS, medium_model_dir, NodeProcess,
                              RosClient, TRANSITIONS, wait_for)
import pytest
import rclpy

from edge_llm_ros.client import GoalRejectedError


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


def test_transitions_gate_serving_and_deactivate_cancels_running_goals(model_dir, ros):
    name = f'llm_lifecycle_{os.getpid()}'
    server = '/' + name
    proc = NodeProcess(name, {'model.path': str(model_dir)})
    try:
        ros.wait_state(server, 'unconfigured', timeout=60)
        llm = ros.llm(server)
        _assert_rejected(llm)   # goals before configuration
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
