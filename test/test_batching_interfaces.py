"""Interface version 3 (issue 14) without a node: priority/preempt/paused end to end in messages.

Real generated message classes, real bags (rosbags), the real parameter schema and board
profiles. The node-level behaviour (queueing, preemption, paused feedback) is in
test/test_batching_node.py.
"""
import pathlib
from types import SimpleNamespace

import pytest
from rclpy.serialization import serialize_message
from regression_helpers import transcript, write_transcript_bag
from unique_identifier_msgs.msg import UUID

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import Transcript
from edge_llm_msgs.srv import Complete
from edge_llm_ros.bringup import parameters, profiles
from edge_llm_ros.bringup.errors import ParameterRangeError
from edge_llm_ros.client import make_goal
from edge_llm_ros.errors import InvalidRequestError
from edge_llm_ros.nodes.messages import build_transcript, queue_order
from edge_llm_ros.regression import bagio, legacy
from edge_llm_ros.regression.records import adapter_problem, TranscriptRecord
from edge_llm_ros.regression.replay import goal_fields
from edge_llm_ros.runtime.types import SamplingConfig
from edge_llm_ros.serving.goal import check_priority, PRIORITY_MAX, PRIORITY_MIN

V2_FIXTURE = pathlib.Path(__file__).resolve().parent / 'data' / 'bags' / 'smollm2_greedy_v2'


def test_version_3_constants_and_defaults():
    goal = Generate.Goal()
    assert Generate.Goal.INTERFACE_VERSION == Transcript.INTERFACE_VERSION == 9
    assert (Generate.Goal.PRIORITY_MIN, Generate.Goal.PRIORITY_MAX) == (-100, 100)
    # The serving layer's limits are the interface's (one place checks them).
    assert (PRIORITY_MIN, PRIORITY_MAX) == (Generate.Goal.PRIORITY_MIN, Generate.Goal.PRIORITY_MAX)
    assert (goal.priority, goal.preempt) == (0, False)
    assert Generate.Feedback().paused is False
    assert Transcript().interface_version == 9


@pytest.mark.parametrize('priority', [-100, -1, 0, 7, 100])
def test_queue_order_passes_the_range(priority):
    goal = make_goal('hi', priority=priority, preempt=True)
    assert queue_order(goal) == (priority, True)


@pytest.mark.parametrize('priority', [-101, 101, 32767, -32768])
def test_out_of_range_priority_is_refused_with_the_range(priority):
    # queue_order only translates; the one range check is where the goal is built.
    with pytest.raises(InvalidRequestError) as err:
        check_priority(queue_order(make_goal('hi', priority=priority))[0])
    assert f'priority {priority} is outside [-100, 100]' in str(err.value)


def test_complete_requests_queue_at_normal_priority():
    request = make_goal('hi', request_type=Complete.Request)
    assert queue_order(request) == (0, False)
    with pytest.raises(TypeError, match='no priority/preempt'):
        make_goal('hi', request_type=Complete.Request, priority=5)
    with pytest.raises(TypeError, match='no priority/preempt'):
        make_goal('hi', request_type=Complete.Request, preempt=True)


def test_transcript_records_the_goal_queue_order_and_not_for_complete():
    goal = make_goal('hi', priority=-7, preempt=True)
    stamp = Transcript().finished_stamp
    msg = build_transcript(Transcript.SOURCE_ACTION, UUID(), goal, None, None, accepted=False,
                           model='m', accepted_stamp=None, finished_stamp=stamp)
    assert (msg.priority, msg.preempt, msg.interface_version) == (-7, True, 9)
    request = make_goal('hi', request_type=Complete.Request)
    msg = build_transcript(Transcript.SOURCE_SERVICE, UUID(), request, None, None,
                           accepted=False, model='m', accepted_stamp=None,
                           finished_stamp=stamp)
    assert (msg.priority, msg.preempt) == (0, False)


def test_version_3_fields_round_trip_through_a_bag_and_replay(tmp_path):
    msg = transcript('urgent')
    msg.priority, msg.preempt = 42, True
    record, = bagio.read_bag(write_transcript_bag(tmp_path / 'v3', [msg])).transcripts
    assert (record.interface_version, record.priority, record.preempt) == (9, 42, True)
    goal = make_goal(**goal_fields(record))
    assert (goal.priority, goal.preempt) == (42, True)


def test_a_version_2_bag_replays_at_normal_priority_untranslated():
    """test/data/bags/smollm2_greedy_v2: recorded by a version-2 node (just before the bump)."""
    contents = bagio.read_bag(V2_FIXTURE)
    assert contents.complete and contents.problems == []
    checks = {t.topic: t.status for t in contents.topics}
    assert checks['/llm_node/transcript'] == 'older'
    assert len(contents.transcripts) == 5
    for record in contents.transcripts:
        assert record.interface_version == 2
        assert (record.priority, record.preempt) == (0, False)
        assert record.text and record.token_ids and record.accepted
        # Version-2 sampling already means what it means today: 0.0 penalties stay 0.0.
        assert legacy.upgrade(record) is record
    goal = make_goal(**goal_fields(contents.transcripts[0]))
    assert (goal.priority, goal.preempt) == (0, False)
    assert goal.prompt == contents.transcripts[0].prompt


def test_a_version_4_bag_reads_without_no_speculation_and_replays_untranslated():
    """test/data/bags/smollm2_greedy_v4: the CI fixture before interface version 5."""
    contents = bagio.read_bag(V2_FIXTURE.with_name('smollm2_greedy_v4'))
    assert contents.complete and contents.problems == []
    assert len(contents.transcripts) == 5
    for record in contents.transcripts:
        assert record.interface_version == 4 and record.no_speculation is False
        assert record.text and record.token_ids and legacy.upgrade(record) is record
    goal = make_goal(**goal_fields(contents.transcripts[0]))
    assert goal.no_speculation is False and goal.prompt == contents.transcripts[0].prompt


@pytest.mark.parametrize('bag, version', [
    ('smollm2_greedy_v5', 5),   # the CI fixture before the fused SiLU (converter 7)
    ('smollm2_greedy_v6', 6),   # the CI fixture before attention's own softmax exp
])
def test_an_older_fixture_reads_and_replays_untranslated(bag, version):
    """test/data/bags/smollm2_greedy_v5 and _v6: earlier CI fixtures, kept as old bags."""
    contents = bagio.read_bag(V2_FIXTURE.with_name(bag))
    assert contents.complete and contents.problems == []
    assert len(contents.transcripts) == 5
    for record in contents.transcripts:
        assert record.interface_version == version
        assert record.text and record.token_ids and legacy.upgrade(record) is record
    goal = make_goal(**goal_fields(contents.transcripts[0]))
    assert goal.prompt == contents.transcripts[0].prompt


def test_legacy_translates_only_version_1():
    v1 = TranscriptRecord(goal_id='00' * 16, interface_version=1)
    assert legacy.upgrade(v1) is not v1          # version 1: sampling translated
    for version in (2, 3, 4, 5):
        record = TranscriptRecord(goal_id='00' * 16, interface_version=version)
        assert legacy.upgrade(record) is record


def test_feedback_paused_serializes():
    feedback = Generate.Impl.FeedbackMessage()
    feedback.feedback.paused = True
    assert bagio.goal_id_of_raw(serialize_message(feedback)) == bytes(16).hex()


def test_parallel_sequences_parameter_schema():
    spec = parameters.schema('llm_node').get('engine.parallel_sequences')
    assert spec.type is parameters.ParamType.INTEGER and spec.default == 1
    assert (spec.range.low, spec.range.high) == (1, 16) and spec.description
    for bad in (0, 17):
        with pytest.raises(ParameterRangeError, match='engine.parallel_sequences'):
            parameters.schema('llm_node').validate({'engine.parallel_sequences': bad})


@pytest.mark.parametrize('board', profiles.available_boards())
def test_every_board_sets_parallel_sequences_in_range(board):
    llm = profiles.load_profile(board)['llm_node']
    assert 1 <= llm['engine.parallel_sequences'] <= 16


def test_transcript_records_the_goals_adapters_and_replay_checks_them(tmp_path):
    """Version 8: a goal's lora, each with the digest the node ran, round-trips a bag."""
    goal = make_goal('hi', lora={'skill': 0.5, 'off': 0.0})
    ran = SimpleNamespace(sampling=SamplingConfig(), session=None,
                          lora_set=(('skill@0123456789ab', 0.5),))   # scale 0: not in the set
    msg = build_transcript(Transcript.SOURCE_ACTION, UUID(), goal, ran, None, accepted=True,
                           model='m', accepted_stamp=None,
                           finished_stamp=Transcript().finished_stamp)
    uses = [(u.name, u.scale, u.digest) for u in msg.lora]
    assert uses == [('skill', 0.5, '0123456789ab'), ('off', 0.0, '')]
    record, = bagio.read_bag(write_transcript_bag(tmp_path / 'v8', [msg])).transcripts
    assert [(u.name, u.digest) for u in record.lora] == [('skill', '0123456789ab'), ('off', '')]
    assert goal_fields(record)['lora'] == {'skill': 0.5, 'off': 0.0}
    assert adapter_problem(record, {'skill': '0123456789ab', 'off': 'ffffffffffff'}) == ''
    assert 'has not loaded' in adapter_problem(record, {'skill': '0123456789ab'})
    assert 'has digest 999999999999' in adapter_problem(
        record, {'skill': '999999999999', 'off': 'x'})
    assert adapter_problem(TranscriptRecord(goal_id='00' * 16), {}) == ''   # no adapters
