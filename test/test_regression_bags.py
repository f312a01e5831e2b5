"""Bag reading/writing of the regression tools, stock `ros2 bag record` layouts, bad bags.

No ROS graph: bags are written with rosbags and rclpy's serializer; the command-line tools
are run on inputs that fail before they would contact a node.
"""
from dataclasses import replace
import pathlib

import numpy as np
import pytest
from rclpy.serialization import serialize_message
from regression_helpers import (
    handle, read_report, RELIABLE_VOLATILE, rosidl_hash, run_tool, stock_record_layout,
    transcript, write_transcript_bag)
from rosbags.rosbag2 import StoragePlugin, Writer
from rosbags.typesys import get_types_from_msg, get_typestore, Stores
import yaml

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import (AdapterUse, ChatMessage, SamplingParams, TokenLogprob, ToolCall,
                               ToolSpec, Transcript)
from edge_llm_ros.client import make_goal
from edge_llm_ros.regression import bagio, legacy
from edge_llm_ros.regression.cpu_class import current_cpu_class, UNKNOWN
from edge_llm_ros.regression.errors import (BagContentError, BagCorruptError, BagNotFoundError,
                                            BagTypeMismatchError, CpuClassError)
from edge_llm_ros.regression.records import SamplingRecord, TranscriptRecord
from edge_llm_ros.regression.replay import goal_fields


def test_type_hashes_match_rosidl():
    interfaces = bagio.load_interfaces()
    assert interfaces.rihs01(bagio.TRANSCRIPT_TYPE) == rosidl_hash(
        'msg/Transcript', bagio.TRANSCRIPT_TYPE)
    for part in ('Goal', 'Result', 'Feedback', 'FeedbackMessage'):
        name = f'edge_llm_msgs/action/Generate_{part}'
        assert interfaces.rihs01(name) == rosidl_hash('action/Generate', name)
    assert interfaces.rihs01(bagio.TENSOR_HANDLE_TYPE) == rosidl_hash(
        'msg/TensorHandle', bagio.TENSOR_HANDLE_TYPE)


@pytest.mark.parametrize('storage', ['mcap', 'sqlite3'])
def test_transcripts_round_trip_with_feedback_and_handles(tmp_path, storage):
    msgs = [transcript('why is the sky blue?', text='Rayleigh', tokens=(11, 12)),
            transcript('describe', handles=[handle('cam')], temperature=0.5,
                       effective_temperature=0.5)]
    topics = bagio.LlmTopics('/robot/llm_node')
    feedback = Generate.Impl.FeedbackMessage()
    feedback.goal_id = msgs[0].goal_id
    feedback.feedback.text_delta = 'Ray'
    feedback.feedback.completion_tokens = 1
    with bagio.BagWriter(tmp_path / 'bag', storage=storage) as bag:
        for topic, msgtype in topics.core().items():
            bag.add_topic(topic, msgtype, [RELIABLE_VOLATILE])
        bag.add_topic('/camera/embeddings', bagio.TENSOR_HANDLE_TYPE)
        bag.write(topics.feedback, 5, serialize_message(feedback))
        for i, msg in enumerate(msgs):
            bag.write(topics.transcript, 10 + i, serialize_message(msg))
        bag.write('/camera/embeddings', 7, serialize_message(handle('cam')))
    contents = bagio.read_bag(tmp_path / 'bag')
    assert contents.storage == storage and contents.complete and contents.problems == []
    first, second = contents.transcripts
    assert first.goal_id == bytes(msgs[0].goal_id.uuid).hex()
    assert (first.prompt, first.text, first.token_ids) == ('why is the sky blue?', 'Rayleigh',
                                                           [11, 12])
    assert first.topic == '/robot/llm_node/transcript' and first.bag_stamp_ns == 10
    assert second.prefix_embeddings[0].pool_id == 'cam'
    assert second.prefix_embeddings[0].shape == (4, 576)
    assert second.effective_temperature() == pytest.approx(0.5)
    assert [f.text_delta for f in contents.feedback[first.goal_id]] == ['Ray']
    assert contents.tensor_handles[0][0] == '/camera/embeddings'
    assert {t.status for t in contents.topics} == {'ok'}


def test_goal_id_is_read_from_raw_bytes():
    msg = transcript('x')
    assert bagio.goal_id_of_raw(serialize_message(msg)) == bytes(msg.goal_id.uuid).hex()
    feedback = Generate.Impl.FeedbackMessage()
    feedback.goal_id = msg.goal_id
    assert bagio.goal_id_of_raw(serialize_message(feedback)) == bytes(msg.goal_id.uuid).hex()


def test_written_transcripts_read_back_whatever_their_alignment(tmp_path):
    """wire_cdr: an empty float64 sequence after an odd-length string reads back.

    rclpy's serialize_message pads that sequence where the wire does not, which made a
    transcript replay wrote (a 'robots' stop string, no clip) undecodable by the reader.
    """
    msgs = [Transcript(stop=['robots'], finish_reason='stop', text='x' * n,
                       video_timestamps=[0.5] * (n % 2), lora=[AdapterUse(name='a', scale=0.5)])
            for n in range(8)]
    bag = write_transcript_bag(tmp_path / 'bag', msgs)
    contents = bagio.read_bag(bag)
    assert not contents.problems
    assert [t.text for t in contents.transcripts] == ['x' * n for n in range(8)]
    assert all(t.stop == ['robots'] and t.lora[0].scale == 0.5 for t in contents.transcripts)


@pytest.mark.parametrize('storage', [StoragePlugin.MCAP, StoragePlugin.SQLITE3])
def test_stock_ros2_bag_record_layout_is_accepted(tmp_path, storage):
    bag = stock_record_layout(tmp_path / 'stock', [transcript('a'), transcript('b')], storage)
    contents = bagio.read_bag(bag)
    assert [t.prompt for t in contents.transcripts] == ['a', 'b']
    assert contents.problems == [] and contents.complete
    statuses = {t.topic: t.status for t in contents.topics}
    assert set(statuses.values()) == {'ok'}


def test_bag_without_hashes_is_checked_through_its_definitions(tmp_path):
    bag = stock_record_layout(tmp_path / 'old', [transcript('a')], StoragePlugin.MCAP,
                              with_hash=False)
    contents = bagio.read_bag(bag)
    checks = {t.topic: t for t in contents.topics}
    transcript_check = checks['/llm_node/transcript']
    assert transcript_check.status == 'ok'
    assert transcript_check.digest == transcript_check.expected
    assert checks['/llm_node/generate/_action/feedback'].status == 'unverified'
    assert any('no type hash or definition' in w for w in contents.warnings)
    assert contents.complete and contents.problems == []  # a warning, not damage


OLD_TRANSCRIPT = """unique_identifier_msgs/UUID goal_id
string prompt
string text
int32[] token_ids
string finish_reason
"""


def write_other_version_bag(path, topic='/llm_node/transcript', msgtype=None):
    """Write a bag whose Transcript (or another type) has another definition and hash."""
    msgtype = msgtype or bagio.TRANSCRIPT_TYPE
    store = get_typestore(Stores.ROS2_JAZZY)
    store.register(get_types_from_msg(OLD_TRANSCRIPT, msgtype))
    msgdef, _ = store.generate_msgdef(msgtype, ros_version=2) if '/msg/' in msgtype else (
        OLD_TRANSCRIPT, None)
    cls = store.types[msgtype]
    uuid_cls = store.types['unique_identifier_msgs/msg/UUID']
    old = cls(goal_id=uuid_cls(uuid=np.arange(16, dtype=np.uint8)), prompt='hi', text='yo',
              token_ids=np.array([1, 2], dtype=np.int32), finish_reason='stop')
    writer = Writer(path, version=9, storage_plugin=StoragePlugin.MCAP)
    writer.open()
    conn = writer.add_connection(topic, msgtype, msgdef=msgdef,
                                 rihs01=store.hash_rihs01(msgtype))
    writer.write(conn, 1, store.serialize_cdr(old, msgtype))
    if msgtype != bagio.TRANSCRIPT_TYPE:
        good = writer.add_connection('/llm_node/transcript', bagio.TRANSCRIPT_TYPE,
                                     msgdef=bagio.load_interfaces().msgdef(
                                         bagio.TRANSCRIPT_TYPE),
                                     rihs01=bagio.load_interfaces().rihs01(
                                         bagio.TRANSCRIPT_TYPE))
        writer.write(good, 2, serialize_message(transcript('still readable')))
    writer.close()
    return path


def test_other_interface_version_is_refused_with_both_hashes(tmp_path):
    bag = write_other_version_bag(tmp_path / 'v0')
    with pytest.raises(BagTypeMismatchError) as err:
        bagio.read_bag(bag)
    text = str(err.value)
    expected = bagio.load_interfaces().rihs01(bagio.TRANSCRIPT_TYPE)
    assert 'another version of edge_llm_msgs/msg/Transcript' in text
    assert expected in text and 're-record' in text


def test_mismatch_on_an_optional_topic_keeps_the_transcripts(tmp_path):
    bag = write_other_version_bag(tmp_path / 'fb', '/llm_node/generate/_action/feedback',
                                  bagio.FEEDBACK_TYPE)
    contents = bagio.read_bag(bag)
    assert [t.prompt for t in contents.transcripts] == ['still readable']
    assert not contents.complete
    assert any('another version of edge_llm_msgs/action/Generate_FeedbackMessage' in p
               for p in contents.problems)


def test_missing_and_corrupt_bags(tmp_path):
    with pytest.raises(BagNotFoundError, match='does not exist'):
        bagio.read_bag(tmp_path / 'nope')
    (tmp_path / 'empty').mkdir()
    with pytest.raises(BagNotFoundError, match='without metadata.yaml'):
        bagio.read_bag(tmp_path / 'empty')
    bag = write_transcript_bag(tmp_path / 'bag', [transcript('a')])
    (bag / 'metadata.yaml').write_text('rosbag2_bagfile_information: [garbage\n')
    with pytest.raises(BagCorruptError, match='cannot open bag'):
        bagio.read_bag(bag)
    bag2 = write_transcript_bag(tmp_path / 'bag2', [transcript('a')])
    mcap = next(bag2.glob('*.mcap'))
    mcap.write_bytes(mcap.read_bytes()[:-100])
    with pytest.raises(BagCorruptError, match='cannot open bag'):
        bagio.read_bag(bag2)
    with pytest.raises(BagContentError, match='no edge_llm_msgs/msg/Transcript'):
        bagio.read_bag(write_transcript_bag(tmp_path / 'bag3', []))


def test_undecodable_message_is_skipped_and_reported(tmp_path):
    topics = bagio.LlmTopics()
    with bagio.BagWriter(tmp_path / 'bag', storage='sqlite3') as bag:
        bag.add_topic(topics.transcript, bagio.TRANSCRIPT_TYPE)
        bag.write(topics.transcript, 1, serialize_message(transcript('good one')))
        bag.write(topics.transcript, 2, b'\x00\x01\x00\x00' + b'\xff' * 40)
        bag.write(topics.transcript, 3, serialize_message(transcript('good two')))
    contents = bagio.read_bag(tmp_path / 'bag')
    assert [t.prompt for t in contents.transcripts] == ['good one', 'good two']
    assert not contents.complete
    assert 'undecodable edge_llm_msgs/msg/Transcript message' in contents.problems[0]


@pytest.mark.parametrize('case', ['missing', 'corrupt', 'mismatch'])
def test_replay_cli_on_bad_bags_writes_a_report_and_exits_2(tmp_path, case):
    if case == 'missing':
        bag = tmp_path / 'missing'
        expected = 'does not exist'
    elif case == 'corrupt':
        bag = write_transcript_bag(tmp_path / 'bag', [transcript('a')])
        (bag / 'metadata.yaml').write_text('{not: yaml: at all')
        expected = 'cannot open bag'
    else:
        bag = write_other_version_bag(tmp_path / 'v0')
        expected = 'another version of edge_llm_msgs/msg/Transcript'
    report = tmp_path / 'report'
    proc = run_tool('replay', bag, '--report', report, '--server-timeout', '1')
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in proc.stderr
    data = read_report(report)
    assert data['verdict'] == 'ERROR' and data['exit_code'] == 2
    assert expected in data['run']['error']
    assert expected in (report / 'summary.md').read_text()
    assert expected in (report / 'report.html').read_text()


def test_replay_cli_rejects_bad_overrides_and_thresholds(tmp_path):
    bag = write_transcript_bag(tmp_path / 'bag', [transcript('a')])
    proc = run_tool('replay', bag, '--set', 'temperature=0.5')
    assert proc.returncode == 2 and "cannot override 'temperature'" in proc.stderr
    bad = tmp_path / 't.yaml'
    bad.write_text('latency: {typo: 1}\n')
    proc = run_tool('replay', bag, '--thresholds', bad, '--report', tmp_path / 'r')
    assert proc.returncode == 2 and 'latency.typo' in proc.stderr
    assert read_report(tmp_path / 'r')['verdict'] == 'ERROR'


def test_offline_report_between_two_recordings(tmp_path):
    old = write_transcript_bag(tmp_path / 'old', [
        transcript('a', text='x y', tokens=(1, 2)), transcript('b', tokens=(3,))])
    same = write_transcript_bag(tmp_path / 'same', [
        transcript('a', text='x y', tokens=(1, 2)), transcript('b', tokens=(3,))])
    changed = write_transcript_bag(tmp_path / 'changed', [
        transcript('a', text='x z', tokens=(1, 9)), transcript('b', tokens=(3,))])
    proc = run_tool('report', old, same, '--report', tmp_path / 'r1')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run_tool('report', old, changed, '--report', tmp_path / 'r2')
    assert proc.returncode == 1
    data = read_report(tmp_path / 'r2')
    assert [f['code'] for f in data['findings'] if f['severity'] == 'regression'] == [
        'token_mismatch']
    assert data['goals'][0]['first_divergence'] == 1
    html = (tmp_path / 'r2' / 'report.html').read_text()
    assert 'data:image/png;base64,' in html and 'token_mismatch' in html
    assert (tmp_path / 'r2' / 'per_goal.png').read_bytes()[:4] == b'\x89PNG'


# ---------------------------------------------------------------- interface versions

FIXTURE = pathlib.Path(__file__).resolve().parent / 'data' / 'bags' / 'smollm2_greedy'


def test_a_version_1_bag_is_decoded_with_its_own_definitions_and_upgraded():
    """test/data/bags/smollm2_greedy predates interface version 2 (issue 13)."""
    contents = bagio.read_bag(FIXTURE)
    assert contents.complete and contents.problems == []
    checks = {t.topic: t.status for t in contents.topics}
    assert checks['/llm_node/transcript'] == 'older'
    assert checks['/llm_node/generate/_action/feedback'] == 'older'
    assert any('decoded with the definition stored in the bag' in w for w in contents.warnings)
    assert len(contents.transcripts) == 5 and len(contents.feedback) == 5
    for record in contents.transcripts:
        assert record.interface_version == 1
        # Version 1's presence_penalty 0.0 meant "node default": now UNSET_PENALTY.
        assert record.sampling.presence_penalty == SamplingParams.UNSET_PENALTY
        assert record.sampling.frequency_penalty == SamplingParams.UNSET_PENALTY
        assert record.sampling.top_logprobs == SamplingParams.UNSET_INT
        # What the node applied stays what it applied (no frequency penalty then).
        assert record.effective_sampling.presence_penalty == 0.0
        assert record.effective_sampling.frequency_penalty == 0.0
        assert record.tools == [] and record.tool_calls == [] and record.reasoning == ''
        assert record.text and record.token_ids
    # Resent, the upgraded request again leaves the penalties to the node.
    goal = make_goal(**goal_fields(contents.transcripts[0]))
    assert goal.sampling.presence_penalty == SamplingParams.UNSET_PENALTY
    assert goal.sampling.frequency_penalty == SamplingParams.UNSET_PENALTY
    assert goal.prompt == contents.transcripts[0].prompt or goal.messages


def _v1(asked: float, effective: SamplingRecord, version: int = 1) -> TranscriptRecord:
    """Build a record as read from a version-1 bag (missing fields at their defaults)."""
    return TranscriptRecord(goal_id='00' * 16, interface_version=version,
                            sampling=SamplingRecord(presence_penalty=asked),
                            effective_sampling=effective)


APPLIED = SamplingRecord(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                         presence_penalty=0.0)


def test_legacy_upgrade_translates_version_1_sampling_in_one_place():
    default = legacy.upgrade(_v1(0.0, APPLIED))
    assert default.sampling.presence_penalty == SamplingParams.UNSET_PENALTY
    assert default.effective_sampling.presence_penalty == 0.0
    assert default.effective_sampling.frequency_penalty == 0.0     # none existed then
    assert legacy.upgrade(default) == default                      # idempotent
    explicit = legacy.upgrade(_v1(0.5, replace(APPLIED, presence_penalty=0.5)))
    assert explicit.sampling.presence_penalty == 0.5
    assert explicit.effective_sampling.presence_penalty == 0.5
    # A refused request: its effective sampling was never filled and stays unset.
    refused = legacy.upgrade(_v1(0.0, SamplingRecord(presence_penalty=0.0)))
    assert refused.effective_sampling.is_unset()
    # Version 2 records are already current: 0.0 there means "disabled".
    current = _v1(0.0, APPLIED, version=2)
    assert legacy.upgrade(current) is current


def test_version_2_fields_round_trip_through_a_bag(tmp_path):
    msg = transcript('drive')
    msg.tools = [ToolSpec(name='move', description='Drive', parameters='{"type": "object"}')]
    msg.tool_choice = 'required'
    msg.no_parallel_tool_calls = True
    msg.reasoning_mode = Generate.Goal.REASONING_OFF
    msg.reasoning_budget = 64
    msg.messages = [ChatMessage(role='assistant', content='',
                                tool_calls=[ToolCall(id='c1', name='move', arguments='{}')]),
                    ChatMessage(role='tool', content='done', tool_call_id='c1', name='move')]
    msg.sampling.logit_bias_token_ids = [5, 7]
    msg.sampling.logit_bias_values = [-100.0, 2.5]
    msg.sampling.top_logprobs = 3
    msg.tool_calls = [ToolCall(id='c2', name='move', arguments='{"meters": 2}')]
    msg.reasoning = 'thinking'
    msg.logprobs = [TokenLogprob(token_id=1, token='a', logprob=-0.5, top_token_ids=[1, 2],
                                 top_tokens=['a', 'b'], top_logprobs=[-0.5, -1.0])]
    bag = write_transcript_bag(tmp_path / 'v2', [msg])
    record, = bagio.read_bag(bag).transcripts
    assert record.interface_version == Transcript.INTERFACE_VERSION == 9
    assert record.tools[0].name == 'move' and record.tool_choice == 'required'
    assert record.no_parallel_tool_calls and record.reasoning_budget == 64
    assert record.reasoning_mode == Generate.Goal.REASONING_OFF
    assert record.messages[0].tool_calls[0].id == 'c1' and record.messages[1].name == 'move'
    assert record.sampling.logit_bias_token_ids == (5, 7) and record.sampling.top_logprobs == 3
    assert record.tool_calls[0].arguments == '{"meters": 2}' and record.reasoning == 'thinking'
    assert record.logprobs[0].top_tokens == ('a', 'b')
    # Replay resends every version-2 request field.
    goal = make_goal(**goal_fields(record))
    assert goal.tools[0].parameters == '{"type": "object"}' and goal.no_parallel_tool_calls
    assert goal.reasoning_mode == Generate.Goal.REASONING_OFF and goal.reasoning_budget == 64
    assert goal.messages[0].tool_calls[0].name == 'move'
    assert list(goal.sampling.logit_bias_values) == [-100.0, 2.5]


# ---------------------------------------------------------------- CPU class in the bag

AVX512 = 'x86_64:avx2,fma,avx512f,avx512vnni'
ZEN3 = 'x86_64:avx2,fma'


def custom_data(bag: pathlib.Path) -> dict:
    meta = yaml.safe_load((bag / 'metadata.yaml').read_text())
    return meta['rosbag2_bagfile_information']['custom_data'] or {}


@pytest.mark.parametrize('storage', ['mcap', 'sqlite3'])
def test_cpu_class_round_trips_through_bag_metadata(tmp_path, storage):
    bag = write_transcript_bag(tmp_path / 'bag', [transcript('a')], storage=storage,
                               cpu_class=AVX512)
    assert custom_data(bag) == {bagio.CPU_CLASS_KEY: AVX512}   # as `ros2 bag info` shows it
    contents = bagio.read_bag(bag)
    assert contents.cpu_class == AVX512 and contents.warnings == []
    # By default a bag records the class of the machine writing it.
    here = write_transcript_bag(tmp_path / 'here', [transcript('a')], storage=storage)
    assert bagio.read_bag(here).cpu_class == current_cpu_class()
    assert bagio.read_bag(here).custom.get(bagio.CPU_CLASS_KEY) == (
        current_cpu_class() if current_cpu_class() != UNKNOWN else None)


def test_bags_without_a_cpu_class_count_as_unknown(tmp_path):
    assert bagio.read_bag(FIXTURE).cpu_class == UNKNOWN           # recorded before the key
    stock = stock_record_layout(tmp_path / 'stock', [transcript('a')], StoragePlugin.MCAP)
    assert bagio.read_bag(stock).cpu_class == UNKNOWN             # ros2 bag record
    unknown = write_transcript_bag(tmp_path / 'unknown', [transcript('a')], cpu_class='unknown')
    assert custom_data(unknown) == {} and bagio.read_bag(unknown).cpu_class == UNKNOWN


def test_malformed_cpu_class_is_unknown_with_a_warning(tmp_path):
    bag = write_transcript_bag(tmp_path / 'bag', [transcript('a')], cpu_class=ZEN3)
    meta = bag / 'metadata.yaml'
    meta.write_text(meta.read_text().replace(ZEN3, "'avx2 fma'"))
    contents = bagio.read_bag(bag)
    assert contents.cpu_class == UNKNOWN and contents.complete
    assert any(bagio.CPU_CLASS_KEY in w and 'counts as unknown' in w for w in contents.warnings)
    with pytest.raises(CpuClassError, match='ARCH:FEATURE'):
        bagio.BagWriter(tmp_path / 'never', cpu_class='avx2')
    assert not (tmp_path / 'never').exists()


def drift_bags(tmp_path, old_class, new_class) -> tuple:
    """Write a recording and a second run of it whose goal 0 drifted late (token 14 of 24)."""
    old_text = 'The sky on a clear day is often described as a deep, rich, and vibrant blue.'
    new_text = 'The sky on a clear day is often described as a deep, rich shade of blue, with'
    tokens = list(range(24))
    old = write_transcript_bag(tmp_path / f'old_{old_class}', [
        transcript('sky', text=old_text, tokens=tokens, finish='length'),
        transcript('two', text='4', tokens=(52, 2))], cpu_class=old_class)
    new = write_transcript_bag(tmp_path / f'new_{new_class}', [
        transcript('sky', text=new_text, tokens=tokens[:14] + list(range(500, 510)),
                   finish='length'),
        transcript('two', text='4', tokens=(52, 2))], cpu_class=new_class)
    return old, new


@pytest.mark.parametrize('old_class, new_class, exit_code, code, rule', [
    (ZEN3, ZEN3, 1, 'token_mismatch', 'exact'),
    (AVX512, ZEN3, 0, 'cross_cpu_drift', 'cross_cpu'),
    ('unknown', ZEN3, 0, 'cross_cpu_drift', 'cross_cpu'),
])
def test_offline_report_applies_the_rule_of_both_bags_cpu_classes(
        tmp_path, old_class, new_class, exit_code, code, rule):
    old, new = drift_bags(tmp_path, old_class, new_class)
    proc = run_tool('report', old, new, '--report', tmp_path / 'r')
    assert proc.returncode == exit_code, proc.stdout + proc.stderr
    data = read_report(tmp_path / 'r')
    assert (data['cpu']['recorded'], data['cpu']['replay']) == (old_class, new_class)
    assert data['cpu']['token_rule'] == rule
    assert [g['token_rule'] for g in data['goals']] == [rule, rule]
    assert [f['code'] for f in data['findings'] if f['goal'] == 0] == [code]
    summary = (tmp_path / 'r' / 'summary.md').read_text()
    assert old_class in summary and new_class in summary


def test_record_and_replay_cli_reject_a_malformed_cpu_class(tmp_path):
    bag = write_transcript_bag(tmp_path / 'bag', [transcript('a')])
    for tool, args in (('replay', [bag]), ('record', ['-o', tmp_path / 'new'])):
        proc = run_tool(tool, *args, '--cpu-class', 'avx2,fma')
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert 'ARCH:FEATURE' in proc.stderr
    assert not (tmp_path / 'new').exists()
