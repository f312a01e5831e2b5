"""engine.cpu_affinity is really in effect in a running llm_node process (issue 6, item 4).

The kernel's view (/proc/<pid>/status and every thread's task/<tid>/status) is read
from outside the node, on this machine's real cores.
"""
import os

from llm_node_harness import NodeProcess, RosClient, TRANSITIONS, wait_for
import pytest
import rclpy
from tiny_model import tiny_model_dir

from edge_llm_ros.bringup.affinity import allowed_cpu_list, format_cpu_list, thread_ids


@pytest.fixture(scope='module')
def ros():
    rclpy.init()
    client = RosClient(f'llm_affinity_test_client_{os.getpid()}')
    yield client
    client.close()
    rclpy.shutdown()


def test_running_node_is_pinned_to_the_configured_core_and_restored(tmp_path, ros):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.fail('this test needs 2 cores to tell pinned from unpinned (machine size: 2)')
    target = str(cores[-1])
    everything = format_cpu_list(cores)
    name = f'llm_affinity_{os.getpid()}'
    # The quotes keep '1' a string parameter (rcl would read a bare 1 as an integer).
    node = NodeProcess(name, {'model.path': str(tiny_model_dir(tmp_path)), 'autostart': True,
                              'engine.cpu_affinity': f"'{target}'",
                              'engine.intra_op_threads': 1, 'kv.max_context': 256})
    try:
        try:
            ros.wait_state(node.fqn, 'active', timeout=90)
        except AssertionError as exc:
            raise AssertionError(f'{exc}\n{node.log()}') from None
        # A goal makes the worker and onnxruntime threads run at least once.
        outcome = ros.llm(node.fqn).generate('Hello', max_tokens=4).result(timeout=60)
        assert outcome.status == 'succeeded', outcome
        pid = node.proc.pid
        assert allowed_cpu_list(pid) == target
        per_thread = {tid: allowed_cpu_list(pid, tid) for tid in thread_ids(pid)}
        assert len(per_thread) > 3   # executor, worker and ORT threads exist
        assert set(per_thread.values()) == {target}, per_thread

        # Cleanup frees the engine and gives the process its original cores back.
        assert ros.transition(node.fqn, TRANSITIONS['deactivate'])
        assert ros.transition(node.fqn, TRANSITIONS['cleanup'])
        wait_for(lambda: allowed_cpu_list(pid) == everything, 30,
                 f'the process mask to return to {everything}')
    finally:
        assert node.stop() == 0, node.log()
