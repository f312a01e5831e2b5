"""The py_trees Generate behaviour ticked in a loop against a real llm_node process."""
import os
import time
import uuid

from agent_harness import serving_llm, transcript_of
from llm_node_harness import LONG_SCHEMA, LONG_TOKENS
import py_trees
from py_trees.common import Access, Status
import pytest

from edge_llm_ros.bt import BlackboardKeys, Generate

pytestmark = pytest.mark.timeout(600)
NODE = f'llm_bt_test_{os.getpid()}'
TICK_S = 0.01


@pytest.fixture(scope='module')
def served(tmp_path_factory):
    with serving_llm(tmp_path_factory, NODE, {'queue.depth': 2}) as made:
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


def _tick_until_done(tree, timeout=120.0, on_tick=None):
    """Tick until the root leaves RUNNING; return (ticks, slowest tick in s)."""
    ticks, slowest = 0, 0.0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        start = time.monotonic()
        tree.tick()
        slowest = max(slowest, time.monotonic() - start)
        ticks += 1
        if on_tick is not None:
            on_tick(ticks)
        if tree.root.status != Status.RUNNING:
            return ticks, slowest
        time.sleep(TICK_S)
    raise AssertionError(f'the tree still runs after {timeout} s')


def test_generate_runs_without_blocking_and_writes_the_answer(served):
    llm, transcripts = served.llm, served.transcripts
    prompt = f'Hello sky {uuid.uuid4().hex[:6]}'
    _writer('/task').set('/task', prompt)
    ask = Generate('ask', llm, keys=BlackboardKeys(prompt='/task', partial='/llm/partial'),
                   max_tokens=24, temperature=0, json_schema=LONG_SCHEMA)
    tree = py_trees.trees.BehaviourTree(py_trees.composites.Sequence('seq', True, [ask]))
    partials = []
    board = py_trees.blackboard.Client(name='reader')
    board.register_key('/llm/partial', Access.READ)
    board.register_key('/llm/text', Access.READ)
    ticks, slowest = _tick_until_done(
        tree, on_tick=lambda _: partials.append(board.get('/llm/partial')))
    assert tree.root.status == Status.SUCCESS, ask.feedback_message
    assert ticks > 3 and slowest < 0.5     # RUNNING ticks return at once
    direct = llm.generate(prompt, max_tokens=24, temperature=0,
                          json_schema=LONG_SCHEMA).result(timeout=120)
    assert board.get('/llm/text') == direct.text
    streaming = [p for p in partials if p and p != direct.text]
    assert streaming and all(direct.text.startswith(p) for p in streaming)
    assert transcript_of(transcripts, prompt).text == direct.text


def test_halting_the_tree_cancels_the_goal(served):
    llm, transcripts = served.llm, served.transcripts
    prompt = f'Count {uuid.uuid4().hex[:6]}'
    stop = _writer('/stop')
    work = Generate('work', llm, prompt=prompt, keys=BlackboardKeys(partial='/llm/partial'),
                    max_tokens=LONG_TOKENS, json_schema=LONG_SCHEMA)
    # A higher-priority branch takes over once /stop exists: the tree halts `work`.
    guard = py_trees.behaviours.CheckBlackboardVariableExists('stop?', '/stop')
    tree = py_trees.trees.BehaviourTree(py_trees.composites.Selector('root', False,
                                                                     [guard, work]))
    board = py_trees.blackboard.Client(name='reader2')
    board.register_key('/llm/partial', Access.READ)

    def maybe_stop(_):
        if len(board.get('/llm/partial') or '') > 10 and not stop.exists('/stop'):
            stop.set('/stop', True)
    _tick_until_done(tree, on_tick=maybe_stop)
    assert tree.root.status == Status.SUCCESS and guard.status == Status.SUCCESS
    assert work.status == Status.INVALID and 'halted' in work.feedback_message
    outcome = work.handle.result(timeout=60)
    assert outcome.status == 'canceled' and outcome.finish_reason == 'cancelled'
    assert 0 < outcome.completion_tokens < LONG_TOKENS
    assert transcript_of(transcripts, prompt).finish_reason == 'cancelled'


def test_an_invalid_goal_fails_the_behaviour_with_the_reason(served):
    llm = served.llm
    ask = Generate('too long', llm, prompt='x', max_tokens=5000)
    tree = py_trees.trees.BehaviourTree(ask)
    _tick_until_done(tree)
    assert ask.status == Status.FAILURE
    assert 'context' in ask.feedback_message
    board = py_trees.blackboard.Client(name='reader3')
    board.register_key('/llm/error', Access.READ)
    assert board.get('/llm/error') == ask.feedback_message


def test_tool_calls_go_to_the_blackboard(served):
    llm = served.llm
    tool = {'type': 'function', 'function': {
        'name': 'move_to', 'description': 'Drive to a place',
        'parameters': {'type': 'object', 'properties': {
            'place': {'type': 'string', 'enum': ['kitchen', 'dock']}},
            'required': ['place'], 'additionalProperties': False}}}
    choose = Generate('choose skill', llm, prompt='Go to the kitchen', tools=[tool],
                      tool_choice='required', parallel_tool_calls=False, max_tokens=200)
    tree = py_trees.trees.BehaviourTree(choose)
    _tick_until_done(tree)
    assert choose.status == Status.SUCCESS, choose.feedback_message
    board = py_trees.blackboard.Client(name='reader4')
    board.register_key('/llm/tool_calls', Access.READ)
    calls = board.get('/llm/tool_calls')
    assert [c['name'] for c in calls] == ['move_to']
    assert calls[0]['arguments']['place'] in ('kitchen', 'dock') and calls[0]['id']
    assert choose.handle.result(timeout=5).finish_reason == 'tool_calls'
