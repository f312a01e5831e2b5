"""NodeProcess (start a node as a child, wait for it, stop it) and LLMClient.wait_until_active.

Real processes throughout: llm_node on the tiny model, llm_node with a model that is not
there, a module that does not exist, and small scripts that ignore SIGINT (and SIGTERM).
"""
import io
import os
import signal

import pytest
import rclpy
from tiny_model import tiny_model_dir

from edge_llm_ros.client import LLMClient, NodeNotActiveError
from edge_llm_ros.node_process import (node_command, NodeProcess, NodeStartError, NodeStopError,
                                       parameter_text)

TAG = f'np{os.getpid()}'
TINY = {'autostart': True, 'kv.max_context': 256, 'engine.intra_op_threads': 1}


def test_parameters_are_written_as_ros_args_want_them():
    assert [parameter_text(v) for v in (True, False, '', 'x', 3, 0.5, ['a', 'b'], [1, 2])] == \
        ['true', 'false', "''", 'x', '3', '0.5', "['a','b']", '[1,2]']
    # Strings YAML would read as another type stay strings (speculative.mode off).
    assert [parameter_text(v) for v in ('off', 'yes', '1.5', "it's", '2-3', "'1'")] == \
        ["'off'", "'yes'", "'1.5'", "it's", '2-3', "'1'"]   # quoted text stays as given
    command = node_command('perception', 'cam', 'robot', {'pool.id': 'p', 'debug': True})
    assert command[1:] == ['-m', 'edge_llm_ros.nodes.perception', '--ros-args',
                           '-r', '__node:=cam', '-r', '__ns:=/robot',
                           '-p', 'pool.id:=p', '-p', 'debug:=true']


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    return str(tiny_model_dir(tmp_path_factory.mktemp('node_process_model')))


def test_llm_node_becomes_active_and_stops_cleanly_on_sigint(ros, tiny):
    echo = io.StringIO()
    with NodeProcess('llm_node', name=f'{TAG}_ok', namespace='robot',
                     params={**TINY, 'model.path': tiny}, echo=echo) as node:
        assert node.fqn == f'/robot/{TAG}_ok'
        client = LLMClient(ros(f'{TAG}_ok_client'), node.fqn)
        node.wait_until_active(client, timeout=120)
        assert client.generate('Hi', max_tokens=2).result(timeout=60).status == 'succeeded'
        client.destroy()
    assert node.returncode == 0, node.log()
    assert 'Traceback' not in node.log()
    assert f'[{TAG}_ok] ' in echo.getvalue()   # echoed with its name


def test_wait_until_active_spins_a_node_that_no_executor_spins(tiny):
    context = rclpy.Context()
    rclpy.init(context=context)
    ros_node = rclpy.create_node(f'{TAG}_self_spun', context=context)
    try:
        with NodeProcess('llm_node', name=f'{TAG}_spun',
                         params={**TINY, 'model.path': tiny}) as node:
            client = LLMClient(ros_node, node.fqn)   # no executor: the client spins it
            node.wait_until_active(client, timeout=120)
            client.destroy()
        assert node.returncode == 0, node.log()
    finally:
        ros_node.destroy_node()
        rclpy.try_shutdown(context=context)


def test_a_node_that_cannot_load_its_model_fails_the_wait_with_its_output(ros, tmp_path):
    with NodeProcess('llm_node', name=f'{TAG}_broken',
                     params={'autostart': True, 'model.path': str(tmp_path / 'none')}) as node:
        client = LLMClient(ros(f'{TAG}_broken_client'), node.fqn)
        with pytest.raises(NodeStartError) as caught:
            node.wait_until_active(client, timeout=20)
        client.destroy()
    message = str(caught.value)
    assert f"/{TAG}_broken is 'unconfigured', not 'active'" in message, message
    assert 'configure failed' in message, message     # the node's own log line
    assert node.returncode == 0, node.log()            # it stayed up until SIGINT


def test_a_node_that_exits_at_once_fails_the_wait_fast(ros):
    node = NodeProcess('edge_llm_ros.nodes.no_such_node', name=f'{TAG}_missing')
    client = LLMClient(ros(f'{TAG}_missing_client'), node.fqn)
    with pytest.raises(NodeStartError) as caught:
        node.wait_until_active(client, timeout=60)
    client.destroy()
    assert 'exited with code 1' in str(caught.value)
    assert 'No module named edge_llm_ros.nodes.no_such_node' in str(caught.value)
    assert node.stop() == 1


def test_client_wait_until_active_without_a_node_says_what_to_check(ros):
    client = LLMClient(ros(f'{TAG}_alone_client'), f'/{TAG}_nobody')
    with pytest.raises(NodeNotActiveError, match='ROS_DOMAIN_ID'):
        client.wait_until_active(timeout=1.0)
    client.destroy()


def _deaf_node(tmp_path, ignored: tuple) -> dict:
    """Write module deaf.node that ignores the `ignored` signals; return the env to run it."""
    package = tmp_path / 'deaf'
    package.mkdir()
    (package / '__init__.py').write_text('')
    (package / 'node.py').write_text(
        'import signal\nimport time\n'
        + ''.join(f'signal.signal(signal.{s}, signal.SIG_IGN)\n' for s in ignored)
        + "print('ignoring ' + ' '.join(%r), flush=True)\ntime.sleep(600)\n" % (ignored,))
    return {'PYTHONPATH': str(tmp_path)}


@pytest.mark.parametrize('ignored, code, how', [
    (('SIGINT',), -signal.SIGTERM, 'stopped by SIGTERM'),
    (('SIGINT', 'SIGTERM'), -signal.SIGKILL, 'killed (SIGTERM ignored'),
])
def test_stop_escalates_after_its_timeout_and_says_so(tmp_path, ignored, code, how):
    node = NodeProcess('deaf.node', env=_deaf_node(tmp_path, ignored))
    node.wait_output('ignoring', timeout=30)
    with pytest.raises(NodeStopError) as caught:
        node.stop(timeout=0.5)
    assert caught.value.returncode == code == node.returncode
    assert 'node ignored SIGINT for 0.5 s' in str(caught.value), caught.value
    assert how in str(caught.value) and 'ignoring SIGINT' in str(caught.value)
