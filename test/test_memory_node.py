"""The memory node as a real process: ~/remember, ~/recall, ~/forget, typed errors, diagnostics.

The embedding node is memory_harness.StandInEmbedder: a real rclpy node in this process that
serves Embed/Rerank with a deterministic hashed-trigram embedding. It stands in for the
embedding llm_node, whose own tests live with it.
"""
import os
import subprocess
import sys
import time

from geometry_msgs.msg import PoseStamped
from lifecycle_msgs.msg import Transition
from memory_embed import hashed_embed, MODEL_ID
from memory_harness import served_memory, StandInEmbedder
import pytest

from edge_llm_ros.memory.memory import Memory
from edge_llm_ros.memory.store import MemoryStore, Pose, StoreConfig
from edge_llm_ros.memory_client import MemoryClient, MemoryClientError
from edge_llm_ros.node_process import NodeProcess

pytestmark = pytest.mark.timeout(300)


def pose(frame, x, y):
    msg = PoseStamped()
    msg.header.frame_id = frame
    msg.pose.position.x, msg.pose.position.y = float(x), float(y)
    msg.pose.orientation.w = 1.0
    return msg


@pytest.fixture(scope='module')
def served(tmp_path_factory):
    with served_memory(tmp_path_factory.mktemp('memory'), 'node') as made:
        yield made


def refused(call, kind):
    with pytest.raises(MemoryClientError) as info:
        call()
    assert info.value.error_kind == kind, str(info.value)
    return str(info.value)


def test_remember_and_recall_with_a_pose(served):
    _, _, memory, _ = served
    charger = memory.remember('the charger is behind the kitchen door', pose('map', 1, 2),
                              ['place'])
    memory.remember('the charger cable is in the red box', pose('map', 40, 0), ['object'])
    memory.remember('grandma likes tea at five', tags=['person'], stamp=time.time() - 3600)
    hits = memory.recall('where is the charger behind the door', k=2)
    assert hits[0]['id'] == charger and hits[0]['tags'] == ['place']
    assert hits[0]['pose'] == {'frame_id': 'map', 'x': 1.0, 'y': 2.0, 'z': 0.0, 'qx': 0.0,
                               'qy': 0.0, 'qz': 0.0, 'qw': 1.0}
    near = memory.recall('charger', k=5, near=pose('map', 38, 0), radius_m=5.0)
    assert [h['text'] for h in near] == ['the charger cable is in the red box']
    old = memory.recall('tea', k=5, until=time.time() - 60)
    assert [h['text'] for h in old] == ['grandma likes tea at five']
    ranked = memory.recall('red box cable', k=3, rerank=True)
    assert ranked[0]['text'] == 'the charger cable is in the red box'
    assert ranked[0]['rerank_score'] == 3.0
    assert memory.forget(tags=['person']) == 1
    assert all(h['text'] != 'grandma likes tea at five' for h in memory.recall('tea', k=5))


def test_bad_requests_get_typed_errors_and_the_node_serves_on(served):
    _, client, memory, embedder = served
    memory.remember('pallet at dock 3', pose('map', 0, 0))
    refused(lambda: memory.remember('  '), 'EmptyInputError')
    refused(lambda: memory.recall('', k=1), 'EmptyInputError')
    assert 'max_k' in refused(lambda: memory.recall('pallet', k=0), 'InvalidMemoryRequestError')
    refused(lambda: memory.recall('pallet', k=21), 'InvalidMemoryRequestError')
    text = refused(lambda: memory.recall('pallet', k=1, near=pose('odom', 0, 0), radius_m=2.0),
                   'FrameMismatchError')
    assert "transform the query pose into 'map'" in text
    refused(lambda: memory.forget(), 'InvalidMemoryRequestError')
    # The embedding node restarted with another model: refused with the re-embed command.
    embedder.model_id = 'other-embedder'
    try:
        text = refused(lambda: memory.recall('pallet', k=1), 'StoreModelMismatchError')
        assert 'edge-llm-memory-reembed --store' in text
    finally:
        embedder.model_id = 'test-hashed-trigrams-64'
    assert memory.recall('pallet at dock', k=1)[0]['text'] == 'pallet at dock 3'
    status = client.next_status(served[0].fqn)
    assert status['state'] == 'active' and int(status['rows']) >= 1
    assert 'StoreModelMismatchError' in status['last_error']


def test_outside_active_the_services_answer_not_active(served):
    proc, client, memory, _ = served
    assert client.transition(proc.fqn, Transition.TRANSITION_DEACTIVATE)
    try:
        assert 'activate it' in refused(lambda: memory.recall('pallet', k=1), 'NotActiveError')
    finally:
        assert client.transition(proc.fqn, Transition.TRANSITION_ACTIVATE)
    assert memory.recall('pallet at dock', k=1)


def test_the_reembed_command_moves_a_store_to_the_new_model(ros, tmp_path):
    """The command a model mismatch names, run as the user would, against a stand-in Embed."""
    path = tmp_path / 'memory.db'
    old = Memory(MemoryStore(StoreConfig(str(path))), hashed_embed)
    old.remember('the red door leads to the lab', Pose('map', 1.0, 2.0, 0.0), ('door',), 5.0)
    old.store.close()
    embedder = StandInEmbedder(ros('reembed_embedder'), f'reembed_embedder_{os.getpid()}')
    embedder.model_id, embedder.dims = 'other-embedder', 32
    done = subprocess.run([sys.executable, '-m', 'edge_llm_ros.nodes.memory_reembed',
                           '--store', str(path), '--embed-service', embedder.embed_service],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert 're-embedded 1 memories' in done.stdout
    assert (tmp_path / f'memory.db.{MODEL_ID}.bak').is_file()
    store = MemoryStore(StoreConfig(str(path)))
    assert (store.model_id, store.dimensions) == ('other-embedder', 32)
    (row,) = store.all_rows()
    assert (row.text, row.stamp, row.tags, row.pose.x) == ('the red door leads to the lab', 5.0,
                                                           ('door',), 1.0)
    store.close()


def test_a_failed_reembed_leaves_the_store_as_it_was_and_can_be_run_again(tmp_path):
    """No embedding service: exit 2 naming it, the store untouched, no half-written new store."""
    path = tmp_path / 'memory.db'
    old = Memory(MemoryStore(StoreConfig(str(path))), hashed_embed)
    old.remember('the red door leads to the lab', Pose('map', 1.0, 2.0, 0.0), ('door',), 5.0)
    old.store.close()
    before = path.read_bytes()
    files = sorted(p.name for p in tmp_path.iterdir())
    missing = f'/no_embedder_{os.getpid()}/embed'
    for _ in range(2):   # the second run is not refused for a leftover of the first
        done = subprocess.run([sys.executable, '-m', 'edge_llm_ros.nodes.memory_reembed',
                               '--store', str(path), '--embed-service', missing,
                               '--timeout', '1'], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stdout + done.stderr
        assert f'service {missing} is not available' in done.stderr
        assert 'exists' not in done.stderr
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == files


def test_every_acknowledged_remember_survives_kill_9_of_the_node(served, tmp_path):
    _, client, _, embedder = served
    name = f'memory_crash_{os.getpid()}'
    params = {'store': str(tmp_path / 'crash.db'), 'embed.service': embedder.embed_service}
    acked = {}
    proc = NodeProcess('memory', name=name, params=params)
    try:
        client.wait_state('/' + name, 'active', timeout=60)
        memory = MemoryClient(client.node, '/' + name, timeout_s=30.0)
        assert memory.wait_ready(30), proc.log()
        for i in range(12):
            acked[memory.remember(f'crash note {i}', tags=[f'c{i}'])] = i
        proc.kill()    # SIGKILL right after the last answer
    finally:
        if proc.alive():
            proc.kill()
    with NodeProcess('memory', name=name, params=params) as again:
        client.wait_state('/' + name, 'active', timeout=60)
        memory = MemoryClient(client.node, '/' + name, timeout_s=30.0)
        assert memory.wait_ready(30), again.log()
        for row_id, i in acked.items():
            hits = memory.recall(f'crash note {i}', k=1, tags=[f'c{i}'])
            assert [(h['id'], h['text']) for h in hits] == [(row_id, f'crash note {i}')]
        assert memory.remember('after the crash') > max(acked)
