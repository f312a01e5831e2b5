"""CPU pinning: parsing, ORT affinity strings, and real pinning checked in /proc."""
import os
import pathlib
import subprocess
import sys

from hypothesis import given, strategies as st
import numpy as np
import onnx
from onnx import helper, TensorProto
import onnxruntime as ort
import pytest

from edge_llm_ros.bringup import affinity
from edge_llm_ros.bringup.errors import AffinityError

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALLOWED = sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize('text, cpus', [
    ('', ()), ('3', (3,)), ('0-3', (0, 1, 2, 3)), ('0,2,4-5', (0, 2, 4, 5)),
    (' 4-7 , 1 ', (1, 4, 5, 6, 7)), ('2,2,1-2', (1, 2)),
])
def test_parse_cpu_list(text, cpus):
    assert affinity.parse_cpu_list(text) == cpus


@pytest.mark.parametrize('text', ['a', '1-', '-1', '3-1', '1,,2', '1;2', '0x3'])
def test_parse_cpu_list_rejects(text):
    with pytest.raises(AffinityError, match='CPU list'):
        affinity.parse_cpu_list(text)


@given(st.sets(st.integers(0, 300)))
def test_format_parse_round_trip(cpus):
    text = affinity.format_cpu_list(cpus)
    assert affinity.parse_cpu_list(text) == tuple(sorted(cpus))


def test_check_cpus_lists_valid_cores():
    affinity.check_cpus((4, 5), range(8))
    with pytest.raises(AffinityError, match=r'core\(s\) 8-9 .* valid cores: 0-7'):
        affinity.check_cpus((7, 8, 9), range(8))


def test_ort_affinity_string_and_plan():
    assert affinity.ort_intra_op_affinity((4, 5, 6, 7), 4) == '6;7;8'
    assert affinity.ort_intra_op_affinity((4, 5, 6, 7), 2) == '6'
    assert affinity.ort_intra_op_affinity((4, 5), 1) == ''
    assert affinity.ort_intra_op_affinity((), 4) == ''
    with pytest.raises(AffinityError):
        affinity.ort_intra_op_affinity((4,), 2)
    plan = affinity.plan_affinity((7, 6, 5, 4), 0)
    assert (plan.process_cpus, plan.decode_cpus, plan.intra_op_threads) == (
        (4, 5, 6, 7), (4,), 4)
    assert affinity.plan_affinity((), 3) == affinity.AffinityPlan((), (), 3, '')


def _tiny_model() -> bytes:
    node = helper.make_node('MatMul', ['x', 'w'], ['y'])
    w = helper.make_tensor('w', TensorProto.FLOAT, [64, 64], np.ones(64 * 64, np.float32))
    graph = helper.make_graph([node], 'g', [helper.make_tensor_value_info(
        'x', TensorProto.FLOAT, [64, 64])], [helper.make_tensor_value_info(
            'y', TensorProto.FLOAT, [64, 64])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid('', 18)],
                             ir_version=10).SerializeToString()


@pytest.mark.skipif(len(ALLOWED) < 2, reason='needs two usable cores for a two-thread pool')
def test_onnxruntime_accepts_the_affinity_string():
    model = _tiny_model()
    onnx.checker.check_model(onnx.load_from_string(model))
    cpus = ALLOWED[:2]
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry('session.intra_op_thread_affinities',
                                     affinity.ort_intra_op_affinity(cpus, 2))
    session = ort.InferenceSession(model, options, providers=['CPUExecutionProvider'])
    y, = session.run(None, {'x': np.ones((64, 64), np.float32)})
    assert float(y[0, 0]) == 64.0
    # ORT checks the count: one entry too many is refused, so the string above was parsed.
    bad = ort.SessionOptions()
    bad.intra_op_num_threads = 2
    bad.add_session_config_entry('session.intra_op_thread_affinities', '1;2')
    with pytest.raises(Exception):
        ort.InferenceSession(model, bad, providers=['CPUExecutionProvider'])


CHILD = r"""
import sys, threading
from edge_llm_ros.bringup import affinity
mode, target = sys.argv[1], tuple(int(c) for c in sys.argv[2].split(','))
stop = threading.Event()
early = threading.Thread(target=stop.wait)
early.start()
if mode == 'process':
    saved = affinity.pin_process(target)
else:
    saved = {0: affinity.pin_thread(target)}
late = threading.Thread(target=stop.wait)
late.start()
print('pinned', early.native_id, late.native_id, flush=True)
sys.stdin.readline()
if mode == 'process':
    affinity.restore(saved)
print('restored', flush=True)
sys.stdin.readline()
stop.set()
"""


def _status_list(pid, tid=None):
    return affinity.allowed_cpu_list(pid, tid)


def _run_child(mode, target):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, '-c', CHILD, mode, ','.join(map(str, target))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                            cwd=str(ROOT))


@pytest.mark.skipif(len(ALLOWED) < 2, reason='needs two usable cores to narrow the mask')
def test_pin_process_moves_every_thread_and_restore_undoes_it():
    target = (ALLOWED[-1],)
    full = affinity.format_cpu_list(ALLOWED)
    child = _run_child('process', target)
    try:
        words = child.stdout.readline().split()
        assert words[0] == 'pinned'
        early, late = int(words[1]), int(words[2])
        tids = affinity.thread_ids(child.pid)
        assert early in tids and late in tids and len(tids) >= 3
        assert _status_list(child.pid) == str(target[0])
        for tid in tids:   # the thread started before pinning moved too; the late one inherits
            assert _status_list(child.pid, tid) == str(target[0])
        child.stdin.write('\n')
        child.stdin.flush()
        assert child.stdout.readline().strip() == 'restored'
        assert _status_list(child.pid) == full
        assert _status_list(child.pid, early) == full
        # Born while pinned and not in the saved masks: keeps the narrow mask.
        assert _status_list(child.pid, late) == str(target[0])
        child.stdin.write('\n')
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.skipif(len(ALLOWED) < 2, reason='needs two usable cores to narrow the mask')
def test_pin_thread_only_moves_the_calling_thread():
    target = (ALLOWED[0],)
    full = affinity.format_cpu_list(ALLOWED)
    child = _run_child('thread', target)
    try:
        words = child.stdout.readline().split()
        early, late = int(words[1]), int(words[2])
        assert _status_list(child.pid) == str(target[0])          # main thread
        assert _status_list(child.pid, early) == full             # untouched
        assert _status_list(child.pid, late) == str(target[0])    # inherited from main
        child.stdin.write('\n\n')
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_pin_to_missing_core_is_an_error():
    missing = max(ALLOWED) + 64
    with pytest.raises(AffinityError, match='cannot pin thread'):
        affinity.pin_thread((missing,))
    with pytest.raises(AffinityError, match='empty'):
        affinity.pin_process(())
    assert sorted(os.sched_getaffinity(0)) == ALLOWED


def test_usable_cpus_on_live_and_recorded_roots():
    assert set(affinity.usable_cpus('/')) == set(ALLOWED)
    rk = ROOT / 'test' / 'data' / 'boards' / 'rk3588'
    assert affinity.usable_cpus(str(rk)) == tuple(range(8))
    with pytest.raises(AffinityError, match='cannot read'):
        affinity.online_cpus(str(ROOT / 'nonexistent'))
