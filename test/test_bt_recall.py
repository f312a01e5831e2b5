"""The py_trees Recall behaviour ticked in a loop against a real memory node process.

The embedding node is memory_harness.StandInEmbedder (a real rclpy service with a hashed
trigram embedding), standing in for the embedding llm_node, whose own tests live with it.
"""
import time
import uuid

from geometry_msgs.msg import PoseStamped
from memory_harness import served_memory
import py_trees
from py_trees.common import Access, Status
import pytest

from edge_llm_ros.bt import Recall, RecallKeys

pytestmark = pytest.mark.timeout(300)
TICK_S = 0.01


@pytest.fixture(scope='module')
def served(tmp_path_factory):
    with served_memory(tmp_path_factory.mktemp('memory'), 'bt') as made:
        yield made


@pytest.fixture(autouse=True)
def clean_blackboard():
    py_trees.blackboard.Blackboard.clear()
    yield
    py_trees.blackboard.Blackboard.clear()


def _writer(*keys):
    board = py_trees.blackboard.Client(name=f'test_{uuid.uuid4().hex[:6]}')
    for key in keys:
        board.register_key(key, Access.WRITE)
    return board


def _reader(*keys):
    board = py_trees.blackboard.Client(name=f'read_{uuid.uuid4().hex[:6]}')
    for key in keys:
        board.register_key(key, Access.READ)
    return board


def _tick_until_done(tree, timeout=60.0):
    """Tick until the root leaves RUNNING; return (ticks, slowest tick in s)."""
    ticks, slowest = 0, 0.0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        start = time.monotonic()
        tree.tick()
        slowest = max(slowest, time.monotonic() - start)
        ticks += 1
        if tree.root.status != Status.RUNNING:
            return ticks, slowest
        time.sleep(TICK_S)
    raise AssertionError(f'the tree still runs after {timeout} s')


def _pose(frame, x, y):
    msg = PoseStamped()
    msg.header.frame_id = frame
    msg.pose.position.x, msg.pose.position.y = float(x), float(y)
    msg.pose.orientation.w = 1.0
    return msg


def test_recall_writes_the_hits_near_a_pose_to_the_blackboard(served):
    _, _, memory, _ = served
    dock = memory.remember('the spare battery is on the shelf at dock two', _pose('map', 5, 5),
                           ['object'])
    memory.remember('the spare battery charger is in the lab', _pose('map', 80, 0), ['object'])
    writer = _writer('/task', '/robot_pose')
    writer.set('/task', 'where is a spare battery')
    writer.set('/robot_pose', _pose('map', 6, 4))
    recall = Recall('recall', memory, keys=RecallKeys(query='/task', near='/robot_pose'), k=3,
                    radius_m=10.0, tags=['object'])
    tree = py_trees.trees.BehaviourTree(py_trees.composites.Sequence('seq', True, [recall]))
    ticks, slowest = _tick_until_done(tree)
    assert tree.root.status == Status.SUCCESS, recall.feedback_message
    assert slowest < 0.5      # ticks read the future; they never wait for the service
    hits = _reader('/memory/hits').get('/memory/hits')
    assert [h['id'] for h in hits] == [dock]
    assert hits[0]['pose']['frame_id'] == 'map' and hits[0]['tags'] == ['object']


def test_a_refused_recall_fails_the_behaviour_with_the_typed_error(served):
    _, _, memory, _ = served
    recall = Recall('bad', memory, query='battery', k=0)
    tree = py_trees.trees.BehaviourTree(recall)
    _tick_until_done(tree)
    assert recall.status == Status.FAILURE
    assert recall.feedback_message.startswith('InvalidMemoryRequestError: k = 0')
    assert _reader('/memory/error').get('/memory/error') == recall.feedback_message
