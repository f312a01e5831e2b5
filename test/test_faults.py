"""Fault injection: SIGKILL mid-stream and mid-goal, corrupt models, disk full, SIGINT.

Covered elsewhere, not repeated here: a consumer killed while holding frames and a producer
killed while consumers hold views, one at a time and idle (test_ipc_processes.py); a
model.onnx of garbage at autostart (test_llm_node_lifecycle.py). This module kills them
mid-stream, kills llm_node mid-goal and restarts it, corrupts every file of a model folder,
fills the disk under the converter and sends SIGINT in every lifecycle state.
"""
import collections
import gc
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Deque, Dict, Tuple

from ipc_support import frame_ok, open_fds, shared_mapped_bytes
from llm_node_harness import (LONG_SCHEMA, medium_model_dir, NodeProcess, RosClient,
                              TRANSITIONS, wait_for)
import pytest
import rclpy
from tiny_model import build_tiny_gguf, TinyDims

from edge_llm_ros.client import LLMClientError, ServerUnavailableError
from edge_llm_ros.errors import ModelLoadError
from edge_llm_ros.ipc.errors import PoolClosedError, UnknownPoolError
from edge_llm_ros.ipc.resolver import TensorResolver
from edge_llm_ros.serving.engine import Engine, EngineConfig

HERE = pathlib.Path(__file__).resolve().parent
CHILDREN = HERE / 'fault_children.py'


# --- zero-copy transport: SIGKILL mid-stream ----------------------------------------------
class Script:
    """A fault_children.py process; its JSON lines are collected on a thread."""

    def __init__(self, role: str, sock_dir: str) -> None:
        self.proc = subprocess.Popen([sys.executable, str(CHILDREN), role, sock_dir],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.events: Deque[Dict] = collections.deque(maxlen=1000)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.events.append(json.loads(line))

    def wait(self, predicate, timeout: float, what: str) -> Dict:
        """Return the first event (newest first) that satisfies predicate."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in reversed(list(self.events)):
                if predicate(event):
                    return event
            if self.proc.poll() is not None:
                raise AssertionError(f'{what}: the child exited: {self.proc.stderr.read()}')
            time.sleep(0.02)
        raise AssertionError(f'timed out after {timeout} s waiting for {what}')

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._reader.join(5)
        self.proc.stdout.close()
        self.proc.stderr.close()


def ipc_resources() -> Tuple[int, int]:
    """(sockets + memfds + dma-bufs open, bytes mapped from memfds/dma-bufs) here.

    Only what the transport can leak: onnxruntime opens its own files in the background.
    """
    fds = [t for t in open_fds() if t.split(':', 1)[1].startswith(
        ('socket:', '/memfd:', 'anon_inode:dmabuf', '/dmabuf'))]
    return len(fds), shared_mapped_bytes()


class Observer(threading.Thread):
    """Checks every pushed frame in this process, always holding the newest one."""

    def __init__(self, sock_dir: str) -> None:
        super().__init__(daemon=True)
        self.resolver = TensorResolver(socket_dir=sock_dir, name='observer', max_inflight=2)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.sub = self.resolver.subscribe('faults', 2)
                break
            except UnknownPoolError:
                assert time.monotonic() < deadline, 'the producer pool never appeared'
                time.sleep(0.05)
        self.received = self.torn = 0
        self.held = None
        self.ended_with = None

    def run(self) -> None:
        try:
            while True:
                frame = self.sub.receive(5.0)
                if frame is None:
                    continue
                self.received += 1
                self.torn += not frame_ok(frame.array, frame.descriptor.sequence)
                old, self.held = self.held, frame
                if old is not None:
                    old.release()
        except PoolClosedError as exc:
            self.ended_with = type(exc)   # not exc: its traceback would keep frames mapped


def test_kill_9_of_a_consumer_then_the_producer_mid_stream():
    sock_dir = tempfile.mkdtemp(prefix='flt')
    gc.collect()
    base = ipc_resources()
    producer = Script('producer', sock_dir)
    doomed = None
    try:
        producer.wait(lambda e: e.get('ready'), 30, 'the producer')
        observer = Observer(sock_dir)
        observer.start()
        alone = producer.wait(lambda e: e.get('consumers') == 1, 30, 'the observer admitted')
        doomed = Script('consumer', sock_dir)
        doomed.wait(lambda e: e.get('received', 0) >= 40, 30, 'the doomed consumer streaming')
        doomed.kill9()
        last = list(doomed.events)[-1]
        assert last['torn'] == 0, last
        # The producer drops the dead consumer (EOF): its holds and its socket's fd go.
        producer.wait(lambda e: e['published'] > alone['published'] and
                      e.get('consumers') == 1 and e['fds'] == alone['fds'], 30,
                      'the producer back to one consumer and its fds')
        seen = observer.received
        # Over 60 frames in all (checked below): a starved observer skips frames, so its
        # count is waited for, not assumed from the doomed consumer's.
        wait_for(lambda: observer.received > max(seen + 20, 60), 60,
                 'frames after the consumer died')

        producer.kill9()
        observer.join(30)
        assert not observer.is_alive() and observer.ended_with is PoolClosedError
        held = observer.held
        # The frame held when its producer died stays mapped and intact.
        assert frame_ok(held.array, held.descriptor.sequence)
        assert observer.torn == 0 and observer.received > 60
        held.release()
        del held
        observer.held = None
        observer.sub.close()   # a subscription is closed by its owner, not by the resolver
        observer.resolver.close()
    finally:
        for script in (doomed, producer):
            if script is not None and script.proc.poll() is None:
                script.kill9()
        shutil.rmtree(sock_dir, ignore_errors=True)
    # Closing is synchronous, but give a late collection of the resolver's objects time.
    deadline = time.monotonic() + 10
    while ipc_resources() != base and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert ipc_resources() == base, (open_fds(), shared_mapped_bytes(), base)


# --- llm_node: SIGKILL mid-goal, restart --------------------------------------------------
@pytest.fixture(scope='module')
def model_dir(tmp_path_factory) -> pathlib.Path:
    return medium_model_dir(tmp_path_factory.mktemp('faults_model'))


@pytest.fixture(scope='module')
def ros():
    rclpy.init()
    client = RosClient(f'faults_client_{os.getpid()}')
    yield client
    client.close()
    rclpy.shutdown()


RESULT_TIMEOUT_S = 10.0
# How late the client may fail after its timeout on a loaded machine (not a latency target).
RESULT_SLACK_S = 10.0
RETRY_S = 5.0
RESTART_S = 180.0


def _first_answer(attempt, timeout: float, what: str):
    """Return attempt()'s first result that does not time out (attempts of RETRY_S)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return attempt()
        except (TimeoutError, AssertionError, ServerUnavailableError) as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f'no {what} within {timeout} s (last attempt: '
                                     f'{type(exc).__name__}: {exc})') from None


def _answered_goal(llm):
    """Send a short goal; a goal lost to half-done discovery is retried by _first_answer."""
    handle = llm.generate('Hello sky', max_tokens=3)
    wait_for(lambda: handle.responded, RETRY_S, 'a goal response')
    # Accepted: the node has it. A first inference is slow on a loaded machine; no resend.
    return handle.result(timeout=60)


def test_kill_9_mid_goal_fails_the_client_and_a_restarted_node_serves(model_dir, ros):
    name = f'llm_kill_{os.getpid()}'
    server = '/' + name
    params = {'autostart': True, 'model.path': str(model_dir)}
    proc = NodeProcess(name, params)
    restarted = None
    try:
        ros.wait_state(server, 'active', timeout=60)
        llm = ros.llm(server)
        running = llm.generate('Count', max_tokens=1500, json_schema=LONG_SCHEMA)
        wait_for(lambda: running.first_feedback_at is not None, 60, 'the goal to stream')
        proc.proc.kill()
        proc.proc.wait()
        killed_at = time.monotonic()
        with pytest.raises((TimeoutError, LLMClientError)) as err:
            running.result(timeout=RESULT_TIMEOUT_S)
        waited = time.monotonic() - killed_at
        assert waited < RESULT_TIMEOUT_S + RESULT_SLACK_S, \
            f'the client failed only after {waited:.1f} s'
        assert 'llm_node' in str(err.value)
        assert running.streamed_text   # what streamed before the kill stays readable

        restarted = NodeProcess(name, params)
        # The restarted node serves goals once active (before, it rejects them: its action
        # server exists in every lifecycle state); wait_state retries lost requests.
        ros.wait_state(server, 'active', timeout=RESTART_S)
        # Discovery still lists the dead node's endpoints for a while, so wait_for_server is
        # no proof: requests sent before the new node is matched are lost. Retry, as a
        # robot's client must after a restart.
        outcome = _first_answer(lambda: _answered_goal(llm), RESTART_S,
                                'a goal answered by the restarted node')
        assert outcome.status == 'succeeded', outcome
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
        code = restarted.stop() if restarted is not None else 0
    assert code == 0, restarted.log()


# --- corrupt model folders -----------------------------------------------------------------
def _truncate(path: pathlib.Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


CORRUPTIONS = {
    'weights truncated': ('model.onnx.data', _truncate),
    'weights missing': ('model.onnx.data', lambda p: p.unlink()),
    'graph empty': ('model.onnx', lambda p: p.write_bytes(b'')),
    'graph garbage': ('model.onnx', lambda p: p.write_bytes(os.urandom(4096))),
    'graph header flipped': ('model.onnx', lambda p: p.write_bytes(
        bytes(b ^ 0xFF for b in p.read_bytes()[:64]) + p.read_bytes()[64:])),
    'model.yaml garbage': ('model.yaml', lambda p: p.write_text(': : [')),
    'model.yaml a list': ('model.yaml', lambda p: p.write_text('[1, 2]')),
    'model.yaml bad number': ('model.yaml', lambda p: p.write_text(
        p.read_text().replace('hidden_size: 512', 'hidden_size: huge'))),
    'tokenizer garbage': ('tokenizer.json', lambda p: p.write_text('{"model": ')),
    'chat template missing': ('chat_template.jinja', lambda p: p.unlink()),
    'chat template broken': ('chat_template.jinja', lambda p: p.write_text('{% for m in')),
}


@pytest.mark.parametrize('name', sorted(CORRUPTIONS))
def test_corrupt_model_folders_fail_to_load_with_the_file_named(model_dir, tmp_path, name):
    broken = tmp_path / 'broken'
    shutil.copytree(model_dir, broken)
    target, corrupt = CORRUPTIONS[name]
    corrupt(broken / target)
    with pytest.raises(ModelLoadError) as err:
        Engine(EngineConfig(model_dir=str(broken), max_context=256)).close()
    assert target.split('.')[0] in str(err.value), str(err.value)


def test_configure_on_truncated_weights_fails_then_succeeds_once_repaired(model_dir, ros,
                                                                          tmp_path):
    broken = tmp_path / 'repairable'
    shutil.copytree(model_dir, broken)
    _truncate(broken / 'model.onnx.data')
    name = f'llm_repair_{os.getpid()}'
    server = '/' + name
    proc = NodeProcess(name, {'model.path': str(broken)})
    try:
        ros.wait_state(server, 'unconfigured', timeout=60)
        assert not ros.transition(server, TRANSITIONS['configure'])
        assert ros.state(server) == 'unconfigured'
        status = ros.next_status(server)
        assert status['level'] == 2 and 'model.onnx' in status['load_error'], status
        shutil.copy(model_dir / 'model.onnx.data', broken / 'model.onnx.data')
        assert ros.transition(server, TRANSITIONS['configure'])
        assert ros.transition(server, TRANSITIONS['activate'])
        assert ros.next_status(server)['load_error'] == ''
        outcome = ros.llm(server).generate('Hello sky', max_tokens=2).result(timeout=60)
        assert outcome.status == 'succeeded', outcome
    finally:
        code = proc.stop()
    assert code == 0 and 'Traceback' not in proc.log(), proc.log()


# --- disk full under the converter --------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """Yield (folder with ~5 MiB free, how it is limited): a tmpfs, else RLIMIT_FSIZE."""
    folder = tmp_path / 'small'
    folder.mkdir()
    mounted = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=5m', 'tmpfs', str(folder)],
                             capture_output=True).returncode == 0
    yield folder, 'tmpfs' if mounted else 'rlimit'
    if mounted:
        subprocess.run(['umount', str(folder)], check=True)


def _convert_cli(source: pathlib.Path, out: pathlib.Path, limit: str):
    code = ('import resource, signal, sys\n'
            'if sys.argv[1] == "rlimit":\n'
            '    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes fail with EFBIG\n'
            '    resource.setrlimit(resource.RLIMIT_FSIZE, (5 << 20, 5 << 20))\n'
            'from edge_llm_ros.convert.converter import main\n'
            'sys.exit(main(sys.argv[2:]))\n')
    return subprocess.run([sys.executable, '-c', code, limit, str(source), str(out), '--quiet'],
                          capture_output=True, text=True, timeout=300)


def test_disk_full_while_converting_leaves_no_half_written_model(tmp_path, small_disk):
    folder, limit = small_disk
    source = build_tiny_gguf(tmp_path / 'big.gguf', dims=TinyDims(
        hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1024, context=2048))
    out = folder / 'model'
    result = _convert_cli(source, out, limit)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert 'Traceback' not in result.stderr, result.stderr
    if limit == 'tmpfs':
        # ENOSPC: the message must say so (numpy's short write carries no errno).
        assert 'disk is full' in result.stderr, result.stderr
    assert not out.exists() and list(folder.iterdir()) == [], list(folder.iterdir())
    # With room again the same command converts, over nothing left behind.
    roomy = tmp_path / 'roomy' / 'model'
    assert _convert_cli(source, roomy, 'none').returncode == 0
    Engine(EngineConfig(model_dir=str(roomy), max_context=256)).close()


# --- SIGINT in every lifecycle state ------------------------------------------------------
STATES = ('unconfigured', 'inactive', 'active idle', 'active mid-goal')
# A hang fails the test; a slow but clean exit on a loaded machine does not.
STOP_TIMEOUT_S = 60.0


@pytest.mark.parametrize('state', STATES)
def test_sigint_exits_cleanly_in_every_lifecycle_state(model_dir, ros, state):
    name = f'llm_sigint_{state.replace(" ", "_").replace("-", "_")}_{os.getpid()}'
    server = '/' + name
    proc = NodeProcess(name, {'model.path': str(model_dir),
                              'autostart': state.startswith('active')})
    try:
        if state == 'unconfigured':
            ros.wait_state(server, 'unconfigured', timeout=60)
        elif state == 'inactive':
            ros.wait_state(server, 'unconfigured', timeout=60)
            assert ros.transition(server, TRANSITIONS['configure'])
        else:
            ros.wait_state(server, 'active', timeout=60)
        if state == 'active mid-goal':
            running = ros.llm(server).generate('Count', max_tokens=1500,
                                               json_schema=LONG_SCHEMA)
            wait_for(lambda: running.first_feedback_at is not None, 60, 'the goal to stream')
    finally:
        code = proc.stop(timeout=STOP_TIMEOUT_S)
    assert code == 0, f'exit code {code} after SIGINT in {state}:\n{proc.log()}'
    assert 'Traceback' not in proc.log(), proc.log()
