"""~/update_model on a real llm_node process: swaps, drains, failed loads, kill -9.

One node serves the module: it starts on tiny v1 from <models root>/current and takes a
delta to tiny v2 (goals before and after run on the model the update names); then a full
medium folder; then tiny v2 again while four goals run and wait on the medium model: the
running one finishes on medium (the drain), the waiting ones and one sent during the update
run on tiny v2, none is aborted. With update.drain_timeout_s 0 a long goal is cancelled
with error_kind model_update, its partial text kept. A session's conversation goes to the
new model as text and its next turn prefills it again. Then a signed folder whose
model.onnx is broken (refused at load: tiny v2 keeps serving) and refused inputs. Last, a
second node is SIGKILLed in the middle of an update (and one in the middle of a drain) and
started again.
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
from typing import Iterator, Tuple

from llm_node_harness import (LONG_SCHEMA, LONG_TOKENS, medium_model_dir, NodeProcess, served,
                              wait_for)
import pytest
from rcl_interfaces.srv import SetParameters
import rclpy
from rclpy.executors import MultiThreadedExecutor
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.parameter import Parameter
from update_support import keys, signed_copy, two_versions

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import Transcript
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


def _update_in_background(ros, path) -> Tuple[threading.Thread, list]:
    """Send ~/update_model from a thread (it answers once the swap is done)."""
    box: list = []
    thread = threading.Thread(target=lambda: box.append(_update(ros, path)), daemon=True)
    thread.start()
    return thread, box


def _set(ros, name: str, value) -> None:
    answer = ros.call(SetParameters, f'{SERVER}/set_parameters', SetParameters.Request(
        parameters=[Parameter(name, value=value).to_parameter_msg()]))
    assert answer.results[0].successful, answer.results[0].reason


def test_an_update_drains_running_goals_and_runs_the_queued_ones_on_the_new_model(
        world, ros, llm):
    answer = _update(ros, world['medium'])    # a slower model: goals take seconds here
    assert answer.success, answer.message
    wait_for(lambda: ros.state(SERVER) == 'active', 30, 'the node active again')
    medium = llm.model_info(timeout=30).model_name
    transcripts = ros.record(Transcript, f'{SERVER}/transcript')
    handles = [llm.generate('Count', max_tokens=200, json_schema=LONG_SCHEMA) for _ in range(4)]
    # Every goal accepted (one running, the others queued) before the update is sent.
    assert all(h.accepted for h in handles)
    thread, box = _update_in_background(ros, world['v2'])   # installed before: reused
    time.sleep(0.2)
    # Queued behind the others (then taken into the hold) or held at once: either way it
    # waits out the drain and runs on the new model.
    late = llm.generate('Hello', max_tokens=4)
    outcomes = [h.result(timeout=120) for h in handles + [late]]
    thread.join(120)
    assert box and box[0].success and 'now serving tiny-v2' in box[0].message, box
    assert re.search(r'drained [1-9]\d* running goal\(s\) in [\d.]+ s\)', box[0].message)
    # Nothing aborted: the running goal finished, the waiting ones ran after the swap.
    assert all(o.status == 'succeeded' for o in outcomes), outcomes
    tiny = llm.model_info(timeout=30).model_name
    wait_for(lambda: len(transcripts) >= len(handles) + 1, 30, "the goals' transcripts")
    model_of = {bytes(t.goal_id.uuid).hex(): t.model for t in transcripts}
    models = [model_of[h.goal_id] for h in handles + [late]]
    assert models[0] == medium and models[-1] == tiny, models
    # Each goal ran on the old model or the new one, and none on the old after the swap.
    assert models == sorted(models, key=lambda m: m == tiny), models
    assert llm.generate('Hello', max_tokens=4).result(timeout=60).ok


def test_goals_still_running_at_the_drain_timeout_end_with_model_update(world, ros, llm):
    assert _update(ros, world['medium']).success   # goals of 200 tokens take a second
    wait_for(lambda: ros.state(SERVER) == 'active', 30, 'the node active again')
    _set(ros, 'update.drain_timeout_s', 0.0)
    try:
        streaming = threading.Event()
        long = llm.generate('Count', max_tokens=200, json_schema=LONG_SCHEMA,
                            on_feedback=lambda chunk: chunk.token_ids and streaming.set())
        assert long.accepted
        assert streaming.wait(60), 'the goal never streamed a token'
        answer = _update(ros, world['v2'])
        assert answer.success and 'cancelled at update.drain_timeout_s 0 s' in (
            answer.message), answer.message
        outcome = long.result(timeout=60)
        assert outcome.status == 'aborted', outcome
        assert outcome.error_kind == Generate.Result.ERROR_MODEL_UPDATE, outcome
        assert outcome.finish_reason == Generate.Result.FINISH_CANCELLED, outcome
        assert 'update.drain_timeout_s ran out' in outcome.error_message, outcome
        assert outcome.text, 'the partial text is kept'
    finally:
        _set(ros, 'update.drain_timeout_s', 60.0)
    wait_for(lambda: ros.state(SERVER) == 'active', 30, 'the node active again')
    assert llm.generate('Hello', max_tokens=4).result(timeout=60).ok


def test_sessions_go_to_the_new_model_as_text(world, ros, llm):
    first = llm.generate('Name a color.', session_id='carried', max_tokens=4).result(timeout=60)
    assert first.ok
    before = llm.get_session('carried', timeout=30)
    assert before.found and before.token_count > 0
    answer = _update(ros, world['medium'])
    assert answer.success, answer.message
    wait_for(lambda: ros.state(SERVER) == 'active', 30, 'the node active again')
    after = llm.get_session('carried', timeout=30)
    assert after.found, 'the conversation was lost by the update'
    assert [(t.role, t.content) for t in after.turns] == [
        (t.role, t.content) for t in before.turns]
    assert after.token_count == 0 and after.kv_bytes == 0   # the old model's ids and KV went
    again = llm.generate('And another?', session_id='carried', max_tokens=4).result(timeout=60)
    assert again.ok
    # The whole conversation was prefilled for the new model: none of its KV was reused.
    assert again.prompt_tokens > first.prompt_tokens, (again, first)
    assert again.timings.cached_prompt_tokens == 0, again.timings
    assert len(llm.get_session('carried', timeout=30).turns) == len(before.turns) + 2
    assert _update(ros, world['v2']).success


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


def _wait_active(ros, node: NodeProcess) -> None:
    try:
        ros.wait_state(node.fqn, 'active', timeout=120)
    except AssertionError as exc:
        raise AssertionError(f'{exc}\n{node.tail()}') from None


def test_kill_9_in_the_middle_of_a_drain_loses_nothing_acknowledged(world, ros, tmp_path):
    root = ModelsRoot(tmp_path / 'models')   # serving medium (context 2048, slower)
    root.switch(root.install(world['medium'], world['trusted']).path)
    store = tmp_path / 'sessions.db'
    params = dict(_params(world), **{'model.path': str(root.current_link),
                                     'update.models_root': str(root.path),
                                     'kv.max_context': 2048, 'sessions.store': str(store)})
    name = f'llm_node_drain_kill_{os.getpid()}'
    node = NodeProcess(name, params)
    try:
        _wait_active(ros, node)
        llm = ros.llm('/' + name)
        # Acknowledged: its result came back, so its turn is in sessions.store.
        kept = llm.generate('Name a color.', session_id='kept', max_tokens=4).result(timeout=60)
        assert kept.ok, kept
        streaming = threading.Event()
        running = llm.generate('Count', max_tokens=LONG_TOKENS, json_schema=LONG_SCHEMA,
                               on_feedback=lambda chunk: chunk.token_ids and streaming.set())
        assert streaming.wait(60), 'the long goal never streamed a token'
        update = ros.node.create_client(UpdateModel, f'/{name}/update_model')
        assert update.wait_for_service(timeout_sec=30)
        update.call_async(UpdateModel.Request(path=str(world['v1'])))
        wait_for(lambda: 'draining' in node.log(), 60, 'the drain to start')
        assert not running.done(), 'the long goal ended before the kill: no drain was caught'
        os.kill(node.pid, signal.SIGKILL)
        node.wait_exit(timeout=30)
        ros.node.destroy_client(update)
    finally:
        if node.alive():
            node.proc.kill()
    # The old model is still current: the switch comes only after the new one loaded.
    assert manifest.verify_folder(root.current(), world['trusted']).model_name == 'medium-v3'
    node = NodeProcess(name, params)
    try:
        _wait_active(ros, node)
        llm = ros.llm('/' + name)
        session = llm.get_session('kept', timeout=30)
        assert session.found and [t.role for t in session.turns] == ['user', 'assistant']
        assert session.turns[1].content == kept.text
        assert session.kv_bytes > 0    # same model: restored with its KV
        assert llm.generate('Hello', max_tokens=4).result(timeout=60).ok
    finally:
        assert node.stop() == 0, node.log()


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
        spin.join(timeout=5)
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
