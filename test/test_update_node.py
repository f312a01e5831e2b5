"""~/update_model on a real llm_node process: swaps, aborted goals, failed loads, kill -9.

One node serves the module: it starts on tiny v1 from <models root>/current and takes a
delta to tiny v2 (goals before and after run on the model the update names); then a full
medium folder; then tiny v2 again while six goals run and wait on the medium model (each
ends with a terminal state: the ones the update caught ABORTED with error_kind unavailable
and a reason); then a signed folder whose model.onnx is broken (refused at load: tiny v2
keeps serving) and refused inputs. Last, a second node is SIGKILLed in the middle of an
update and started again.
"""
import contextlib
import os
import pathlib
import random
import re
import shutil
import signal
import threading
import time
from typing import Iterator

from llm_node_harness import LONG_SCHEMA, medium_model_dir, NodeProcess, served, wait_for
import pytest
import rclpy
from rclpy.executors import MultiThreadedExecutor
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.parameter import Parameter
from update_support import keys, signed_copy, two_versions

from edge_llm_msgs.action import Generate
from edge_llm_msgs.srv import UpdateModel
from edge_llm_ros.nodes.llm_node import LLMNode
from edge_llm_ros.update import delta, manifest, signing
from edge_llm_ros.update.install import ModelsRoot

NODE = f'llm_node_update_{os.getpid()}'
SERVER = '/' + NODE


@pytest.fixture(scope='module')
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp('update_node')
    private, public = keys(base / 'keys')
    _, other_public = keys(base / 'keys', 'other')
    other_private = base / 'keys' / 'other.key'
    v1, v2 = two_versions(base, private)
    package = base / 'delta'
    delta.make_delta(v1, v2, package, signing.load_private(private))
    medium = signed_copy(medium_model_dir(base / 'src'), base / 'medium', private, 'medium-v3')
    broken = pathlib.Path(shutil.copytree(v2, base / 'broken'))
    (broken / 'model.onnx').write_bytes(b'this is not an onnx model')
    signed_copy(broken, base / 'broken-signed', private, 'tiny-broken')
    foreign = signed_copy(v2, base / 'foreign', other_private, 'tiny-foreign')
    root = ModelsRoot(base / 'models')
    trusted = signing.load_public(str(public))
    root.switch(root.install(v1, trusted).path)
    return {'base': base, 'public': public, 'trusted': trusted, 'root': root, 'delta': package,
            'medium': medium, 'broken': base / 'broken-signed', 'foreign': foreign,
            'v1': v1, 'v2': v2, 'other_public': other_public}


def _params(world) -> dict:
    return {'autostart': True, 'model.path': str(world['root'].current_link),
            'update.public_key': str(world['public']),
            'update.models_root': str(world['root'].path), 'kv.max_context': 256,
            'max_tokens': 8, 'queue.depth': 8}


@pytest.fixture(scope='module')
def ros(world):
    with served(NODE, _params(world), f'llm_node_update_client_{os.getpid()}') as client:
        yield client


@pytest.fixture(scope='module')
def llm(ros):
    return ros.llm(SERVER)


def _update(ros, path, server=SERVER, timeout=120.0) -> UpdateModel.Response:
    return ros.call(UpdateModel, f'{server}/update_model', UpdateModel.Request(path=str(path)),
                    timeout)


def test_delta_update_swaps_the_model_the_next_goal_runs_on(world, ros, llm):
    assert llm.generate('Hello', max_tokens=4).result(timeout=60).ok
    before = llm.model_info(timeout=30)
    assert before.model_name == 'tiny-v1'
    serving = os.path.realpath(before.model_dir)   # model.path is <root>/current
    answer = _update(ros, world['delta'])
    assert answer.success, answer.message
    assert 'now serving tiny-v2' in answer.message
    assert answer.previous_model_dir == serving
    root = world['root']
    assert pathlib.Path(answer.model_dir) == root.current()
    assert manifest.verify_folder(root.current(), world['trusted']).model_name == 'tiny-v2'
    info = llm.model_info(timeout=30)
    assert info.model_name == 'tiny-v2' and info.model_dir == answer.model_dir
    wait_for(lambda: ros.state(SERVER) == 'active', 30, 'the node active again')
    assert llm.generate('Hello', max_tokens=4).result(timeout=60).ok


def test_goals_caught_by_an_update_end_aborted_with_a_reason(world, ros, llm):
    answer = _update(ros, world['medium'])    # a slower model: goals take seconds here
    assert answer.success, answer.message
    assert llm.model_info(timeout=30).model_name == 'medium-v3'
    wait_for(lambda: ros.state(SERVER) == 'active', 30, 'the node active again')
    handles = [llm.generate('Count', max_tokens=200, json_schema=LONG_SCHEMA)
               for _ in range(6)]
    # Every goal accepted (one running, the others queued) before the update is sent.
    assert all(h.accepted for h in handles)
    answer = _update(ros, world['v2'])        # installed before: reused, then swapped in
    assert answer.success and 'now serving tiny-v2' in answer.message, answer.message
    outcomes = [h.result(timeout=120) for h in handles]
    assert all(o.status in ('succeeded', 'aborted') for o in outcomes), outcomes
    # The last one waited behind five goals of 200 tokens: the update caught it.
    assert outcomes[-1].status == 'aborted', outcomes[-1]
    for outcome in outcomes:
        if outcome.status == 'aborted':
            assert outcome.error_kind == Generate.Result.ERROR_UNAVAILABLE, outcome
            assert 'was deactivated while the goal was waiting or running' in (
                outcome.error_message), outcome
    assert llm.model_info(timeout=30).model_name == 'tiny-v2'
    wait_for(lambda: ros.state(SERVER) == 'active', 30, 'the node active again')
    assert llm.generate('Hello', max_tokens=4).result(timeout=60).ok


def test_a_model_that_fails_to_load_leaves_the_old_one_serving(world, ros, llm):
    root = world['root']
    current = root.current()
    answer = _update(ros, world['broken'])
    assert not answer.success
    assert 'failed to load' in answer.message and 'is serving again' in answer.message
    assert answer.model_dir == str(current)
    assert root.current() == current
    assert not any('tiny-broken' in p.name for p in root.installed())
    wait_for(lambda: ros.state(SERVER) == 'active', 30, 'the node active again')
    assert llm.model_info(timeout=30).model_name == 'tiny-v2'
    assert llm.generate('Hello', max_tokens=4).result(timeout=60).ok


@pytest.mark.parametrize('source, message', [
    ('foreign', 'update refused: .*is signed by key .*but the trusted public key is'),
    ('tampered', 'update refused: .*model.onnx.data does not have the sha256 of the signed'),
    ('missing', 'update refused: .* is not a folder'),
])
def test_refused_updates_change_nothing(world, ros, llm, tmp_path, source, message):
    if source == 'tampered':
        path = pathlib.Path(shutil.copytree(world['v1'], tmp_path / 'tampered'))
        with open(path / 'model.onnx.data', 'r+b') as fh:
            fh.seek(64)
            fh.write(b'\0\1\2\3')
    else:
        path = world.get(source, tmp_path / 'nothing')
    current = world['root'].current()
    answer = _update(ros, path)
    assert not answer.success and re.search(message, answer.message), answer.message
    assert answer.model_dir == '' and world['root'].current() == current
    assert ros.state(SERVER) == 'active'
    assert llm.model_info(timeout=30).model_name == 'tiny-v2'


def test_kill_9_during_an_update_then_the_next_start_serves_a_valid_model(world, ros, tmp_path):
    root = ModelsRoot(tmp_path / 'models')
    root.switch(root.install(world['v1'], world['trusted']).path)
    params = dict(_params(world), **{'model.path': str(root.current_link),
                                     'update.models_root': str(root.path)})
    name = f'llm_node_update_kill_{os.getpid()}'
    # One random point of the install/swap per run (the exhaustive kill points are in
    # test_update_faults.py, at every filesystem step of the install and switch).
    for delay in (random.uniform(0.02, 0.5),):
        node = NodeProcess(name, params)
        try:
            ros.wait_state('/' + name, 'active', timeout=120)
            update = ros.node.create_client(UpdateModel, f'/{name}/update_model')
            assert update.wait_for_service(timeout_sec=30)
            update.call_async(UpdateModel.Request(path=str(world['medium'])))
            time.sleep(delay)
            os.kill(node.pid, signal.SIGKILL)
            node.wait_exit(timeout=30)
            ros.node.destroy_client(update)
        finally:
            if node.alive:
                node.proc.kill()
        found = manifest.verify_folder(root.current(), world['trusted'])
        assert found.model_name in ('tiny-v1', 'medium-v3')
        node = NodeProcess(name, params)
        try:
            ros.wait_state('/' + name, 'active', timeout=120)
            llm = ros.llm('/' + name)
            assert llm.model_info(timeout=30).model_name == found.model_name
            assert llm.generate('Hello', max_tokens=4).result(timeout=60).ok
        finally:
            assert node.stop() == 0, node.log()
        root.switch(root.install(world['v1'], world['trusted']).path)


@contextlib.contextmanager
def _in_process_node(overrides: dict) -> Iterator[tuple]:
    """Yield an LLMNode (not configured) and a caller node, spun in this process."""
    context = rclpy.Context()
    rclpy.init(context=context)
    node = LLMNode(context=context,
                   parameter_overrides=[Parameter(k, value=v) for k, v in overrides.items()],
                   cli_args=['--ros-args', '-r', f'__node:=llm_update_local_{os.getpid()}'])
    caller = rclpy.create_node(f'llm_update_local_caller_{os.getpid()}', context=context)
    executor = MultiThreadedExecutor(num_threads=4, context=context)
    executor.add_node(node)
    executor.add_node(caller)
    spin = threading.Thread(target=executor.spin, daemon=True)
    spin.start()
    try:
        yield node, caller
    finally:
        executor.shutdown(timeout_sec=2)
        node.destroy_node()
        caller.destroy_node()
        rclpy.try_shutdown(context=context)


@pytest.mark.parametrize('configured_updates, message', [
    (False, 'does not take model updates: set both update.public_key'),
    (True, 'is unconfigured: configure it first'),
])
def test_updates_are_refused_without_keys_or_a_loaded_model(
        world, configured_updates, message):
    overrides = {'update.public_key': str(world['public']),
                 'update.models_root': str(world['root'].path)} if configured_updates else {}
    with _in_process_node(overrides) as (node, caller):
        client = caller.create_client(UpdateModel, f'{node.get_fully_qualified_name()}/'
                                                   'update_model')
        assert client.wait_for_service(timeout_sec=30)
        future = client.call_async(UpdateModel.Request(path=str(world['v1'])))
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        assert done.wait(30)
        answer = future.result()
        assert not answer.success and message in answer.message, answer.message
        assert answer.model_dir == '' and node.lifecycle_state() == 'unconfigured'


def test_an_installed_version_corrupted_on_disk_fails_configure(world, tmp_path):
    root = ModelsRoot(tmp_path / 'models')
    root.switch(root.install(world['v1'], world['trusted']).path)
    params = {'model.path': str(root.current_link), 'kv.max_context': 256,
              'update.public_key': str(world['public']), 'update.models_root': str(root.path)}
    with _in_process_node(params) as (node, _):
        assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS
        assert node.trigger_cleanup() == TransitionCallbackReturn.SUCCESS
        with open(root.current() / 'model.onnx.data', 'r+b') as fh:
            fh.seek(100)
            byte = fh.read(1)[0]
            fh.seek(100)
            fh.write(bytes([byte ^ 0xFF]))
        assert node.trigger_configure() == TransitionCallbackReturn.FAILURE
        assert 'is an installed update that does not verify' in node.load_error
        assert 'model.onnx.data does not have the sha256' in node.load_error
