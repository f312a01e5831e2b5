"""Interface versions 6 and 7 without a node: images, raw_prompt, max_image_tokens, detections.

The goal's image handles are described (admission) and held (while running) by
nodes/embeddings.py against a real pool of this process; `edge-llm ask --image` packs its
images into one published slot. test_vision_node.py runs the same through a real llm_node.
"""
import pathlib
from uuid import uuid4

import numpy as np
import pytest
from regression_helpers import handle, transcript, write_transcript_bag

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import TensorHandle, Transcript
from edge_llm_msgs.srv import Complete
from edge_llm_ros.client import make_goal
from edge_llm_ros.ipc.pool import PoolConfig, TensorPool
from edge_llm_ros.ipc.resolver import TensorResolver
from edge_llm_ros.nodes import ask
from edge_llm_ros.nodes.embeddings import (EmbeddingResolveError, EmbeddingResolver,
                                           ImageResolveError, MAX_INFLIGHT)
from edge_llm_ros.nodes.handles import image_pool, to_handle
from edge_llm_ros.nodes.messages import build_transcript, RequestDefaults, to_request
from edge_llm_ros.regression import bagio, legacy
from edge_llm_ros.regression.compare import pair_recordings
from edge_llm_ros.regression.records import TranscriptRecord
from edge_llm_ros.regression.replay import goal_fields
from edge_llm_ros.runtime.media import DeclaredImage, ImageInputError, MEDIA_MARKER

BAGS = pathlib.Path(__file__).resolve().parent / 'data' / 'bags'
RGB = np.random.default_rng(3).integers(0, 256, (6, 5, 3), dtype=np.uint8)


# ---- messages -------------------------------------------------------------------------------
def test_version_6_defaults_mean_what_older_goals_meant():
    goal = Generate.Goal(prompt='hi')
    assert Generate.Goal.INTERFACE_VERSION == Transcript.INTERFACE_VERSION == 9
    assert list(goal.images) == [] and goal.raw_prompt is False
    request = to_request(goal, RequestDefaults(system_prompt='Be brief.'))
    assert request.images == () and request.use_chat_template
    assert request.system_prompt == 'Be brief.'


def test_raw_prompt_skips_the_template_and_the_node_system_prompt():
    goal = make_goal('<s>[INST] hi [/INST]', raw_prompt=True)
    request = to_request(goal, RequestDefaults(system_prompt='Be brief.'))
    assert not request.use_chat_template and request.system_prompt == ''
    # The goal's own system prompt still reaches the engine, which refuses it with raw text.
    goal.system_prompt = 'mine'
    assert to_request(goal, RequestDefaults()).system_prompt == 'mine'


def test_images_travel_as_handles_and_declared_sizes():
    handles = [handle('cam'), handle('cam')]
    goal = make_goal(MEDIA_MARKER * 2 + 'what?', images=handles)
    assert [h.pool_id for h in goal.images] == ['cam', 'cam']
    declared = (DeclaredImage(4, 3), DeclaredImage(8, 8))
    assert to_request(goal, RequestDefaults(), images=declared).images == declared
    with pytest.raises(TypeError, match='images'):
        make_goal('hi', images=handles, request_type=Complete.Request)
    with pytest.raises(TypeError, match='raw_prompt'):
        make_goal('hi', raw_prompt=True, request_type=Complete.Request)
    # ~/complete requests have neither field: they translate as before.
    assert to_request(Complete.Request(prompt='hi'), RequestDefaults()).use_chat_template


def test_transcript_records_images_and_raw_prompt_only_for_goals():
    goal = make_goal(MEDIA_MARKER + 'what?', images=[handle('cam')], raw_prompt=True)
    stamp = Transcript().finished_stamp
    msg = build_transcript(Transcript.SOURCE_ACTION, goal_id(), goal, None, None,
                           accepted=False, model='m', accepted_stamp=None,
                           finished_stamp=stamp)
    assert msg.interface_version == 9 and msg.raw_prompt
    assert [h.pool_id for h in msg.images] == ['cam']
    request = make_goal('hi', request_type=Complete.Request)
    msg = build_transcript(Transcript.SOURCE_SERVICE, goal_id(), request, None, None,
                           accepted=False, model='m', accepted_stamp=None,
                           finished_stamp=stamp)
    assert list(msg.images) == [] and not msg.raw_prompt


def goal_id():
    from unique_identifier_msgs.msg import UUID
    return UUID(uuid=list(uuid4().bytes))


# ---- bags -----------------------------------------------------------------------------------
def test_version_6_fields_round_trip_through_a_bag_and_replay(tmp_path):
    msg = transcript(MEDIA_MARKER + 'what is this?')
    msg.images = [handle('cam0'), handle('cam1')]
    msg.raw_prompt = True
    record, = bagio.read_bag(write_transcript_bag(tmp_path / 'v6', [msg])).transcripts
    assert record.interface_version == 9 and record.raw_prompt
    assert [h.pool_id for h in record.images] == ['cam0', 'cam1']
    assert record.images[0].shape == (4, 576) and record.images[0].frame_id == 'camera'
    assert [h.pool_id for h in record.tensor_handles] == ['cam0', 'cam1']
    goal = make_goal(**goal_fields(record))
    assert goal.raw_prompt and [h.pool_id for h in goal.images] == ['cam0', 'cam1']
    assert goal.images[1].generation == 7 and goal.images[1].header.frame_id == 'camera'
    # Two recordings of the same script pair only goals with the same raw_prompt.
    plain = TranscriptRecord(goal_id='11' * 16, prompt=record.prompt, accepted=True,
                             finish_reason='stop')
    assert pair_recordings([record], [plain])[0].status == 'not_sent'


def test_version_7_max_image_tokens_and_detections_round_trip(tmp_path):
    """Version 7: the goal's image token cap and the result's detections, recorded and resent."""
    from edge_llm_msgs.msg import Detection2D
    goal = make_goal(MEDIA_MARKER + 'where?', images=[handle('cam')], max_image_tokens=400)
    assert goal.max_image_tokens == 400 and Generate.Goal().max_image_tokens == 0
    assert to_request(goal, RequestDefaults()).max_image_tokens == 400
    assert to_request(Complete.Request(prompt='hi'), RequestDefaults()).max_image_tokens == 0
    with pytest.raises(TypeError, match='max_image_tokens'):
        make_goal('hi', max_image_tokens=4, request_type=Complete.Request)
    result = Generate.Result(text='[{"bbox_2d": [1, 2, 3, 4]}]')
    result.detections = [Detection2D(id='g/0')]
    msg = build_transcript(Transcript.SOURCE_ACTION, goal_id(), goal, None, result,
                           accepted=True, model='m', accepted_stamp=None,
                           finished_stamp=Transcript().finished_stamp)
    assert msg.max_image_tokens == 400 and [d.id for d in msg.detections] == ['g/0']
    record, = bagio.read_bag(write_transcript_bag(tmp_path / 'v7', [msg])).transcripts
    assert record.interface_version == 9 and record.max_image_tokens == 400
    assert make_goal(**goal_fields(record)).max_image_tokens == 400


def test_a_version_5_bag_reads_without_images_and_replays_untranslated():
    """test/data/bags/smollm2_greedy_v5: the CI fixture, recorded before interface version 6."""
    contents = bagio.read_bag(BAGS / 'smollm2_greedy_v5')
    assert contents.complete and contents.problems == []
    assert {t.topic: t.status for t in contents.topics}['/llm_node/transcript'] == 'older'
    assert len(contents.transcripts) == 5
    for record in contents.transcripts:
        assert record.interface_version == 5
        assert record.images == [] and record.raw_prompt is False
        assert record.text and record.token_ids and legacy.upgrade(record) is record
    goal = make_goal(**goal_fields(contents.transcripts[0]))
    assert list(goal.images) == [] and goal.raw_prompt is False
    assert goal.prompt == contents.transcripts[0].prompt or goal.messages


# ---- handles at admission and while running ------------------------------------------------
@pytest.fixture
def pool(tmp_path, monkeypatch):
    monkeypatch.setenv('EDGE_LLM_IPC_DIR', str(tmp_path / 'sockets'))
    config = PoolConfig(pool_id=f'vi{uuid4().hex[:8]}', slot_nbytes=4096, slots=4)
    with TensorPool(config) as made:
        yield made


@pytest.fixture
def resolver():
    made = EmbeddingResolver()
    yield made
    made.close()


def test_rgb_and_mono_handles_are_declared_and_held_without_copy(pool, resolver):
    mono = RGB[:, :, 1].copy()
    for second in (mono, mono[:, :, None]):
        handles = [to_handle(pool.publish_array(RGB)), to_handle(pool.publish_array(second))]
        described = resolver.describe_images(handles)
        assert described.declared == (DeclaredImage(6, 5),) * 2
        with resolver.hold_images(described.descriptors) as frames:
            assert all(f.shape == (6, 5, 3) and f.dtype == np.uint8 for f in frames)
            assert np.array_equal(frames[0], RGB) and not frames[0].flags.writeable
            assert all(np.array_equal(frames[1][:, :, c], mono) for c in range(3))
            assert frames[1].strides[2] == 0   # a broadcast view of the mapped frame, no copy
            assert resolver._resolver.held(pool.pool_id) == MAX_INFLIGHT
        assert resolver._resolver.held(pool.pool_id) == 0   # released at the end
    assert resolver.describe_images([]) is None


@pytest.mark.parametrize('dtype, shape', [
    ('float32', (6, 5, 3)), ('uint8', (6, 5, 4)), ('uint8', (6,)), ('uint8', (1, 6, 5, 3))])
def test_handles_that_are_no_image_are_refused_naming_the_formats(pool, resolver, dtype, shape):
    bad = to_handle(pool.publish_array(np.zeros(shape, dtype)))
    with pytest.raises(ImageResolveError) as err:
        resolver.describe_images([bad])
    assert isinstance(err.value, ImageInputError)   # an InvalidRequestError: invalid_request
    assert f'images[0] is {dtype} {list(shape)}' in str(err.value)
    assert 'RGB [height, width, 3]' in str(err.value) and 'BGR' in str(err.value)


def test_foreign_malformed_and_too_many_handles_are_refused_at_admission(pool, resolver):
    good = to_handle(pool.publish_array(RGB))
    foreign = to_handle(pool.publish_array(RGB))
    foreign.pool_id = 'nobody_serves_this'
    with pytest.raises(ImageResolveError,
                       match=r'images\[1\]: no producer serves pool .nobody_serves_this.'):
        resolver.describe_images([good, foreign])
    broken = TensorHandle(pool_id='../x', dtype='uint8', shape=[2, 2, 3], nbytes=12)
    with pytest.raises(ImageResolveError, match=r'images\[0\] is not a valid handle'):
        resolver.describe_images([broken])
    three = [to_handle(pool.publish_array(RGB)) for _ in range(MAX_INFLIGHT + 1)]
    with pytest.raises(ImageResolveError, match='3 frames of pool'):
        resolver.describe_images(three)
    # The same limit guards prefix_embeddings (there its own error type).
    rows = [to_handle(pool.publish_array(np.zeros((2, 8), np.float32))) for _ in range(3)]
    with pytest.raises(EmbeddingResolveError, match='3 frames of pool'):
        resolver.describe(rows)


def test_a_stale_handle_fails_when_held_and_the_next_one_works(pool, resolver):
    first = to_handle(pool.publish_array(RGB))
    described = resolver.describe_images([first])
    for _ in range(pool.slot_count):   # the ring comes round: the slot is rewritten
        pool.publish_array(np.zeros_like(RGB))
    with pytest.raises(ImageResolveError, match=r'images\[0\] \(pool .*, slot \d+\) cannot '
                                                r'be mapped'):
        with resolver.hold_images(described.descriptors):
            pass
    fresh = resolver.describe_images([to_handle(pool.publish_array(RGB))])
    with resolver.hold_images(fresh.descriptors) as frames:
        assert np.array_equal(frames[0], RGB)


# ---- edge-llm ask --image -------------------------------------------------------------------
def test_ask_packs_its_images_into_one_published_slot(tmp_path, monkeypatch):
    monkeypatch.setenv('EDGE_LLM_IPC_DIR', str(tmp_path / 'sockets'))
    from PIL import Image
    second = np.random.default_rng(4).integers(0, 256, (3, 7, 3), dtype=np.uint8)
    paths = []
    for i, pixels in enumerate((RGB, second)):
        paths.append(str(tmp_path / f'{i}.png'))
        Image.fromarray(pixels).save(paths[-1])
    images = ask.decode_images(paths)
    with image_pool(images, 'ask_test') as handles:
        assert [(h.pool_id, h.slot, h.sequence) for h in handles] == [
            ('ask_test', handles[0].slot, handles[0].sequence)] * 2
        assert [list(h.shape) for h in handles] == [[6, 5, 3], [3, 7, 3]]
        assert handles[1].byte_offset % 64 == 0 and handles[1].byte_offset >= RGB.nbytes
        with TensorResolver() as consumer:
            views = [consumer.resolve(h) for h in handles]
            assert np.array_equal(views[0], RGB) and np.array_equal(views[1], second)
            assert consumer.held('ask_test') == 1   # one frame, held once per handle
    (tmp_path / 'bad.png').write_bytes(b'\x89PNG\r\n\x1a\n' + b'\0' * 20)
    with pytest.raises(ImageInputError, match='--image .*bad.png'):
        ask.decode_images([str(tmp_path / 'bad.png')])


def test_ask_puts_markers_ahead_of_a_chat_prompt_without_any():
    assert ask.prompt_with_markers('What is it?', 2, raw=False) == (
        MEDIA_MARKER * 2 + '\nWhat is it?')
    assert ask.prompt_with_markers(f'Look: {MEDIA_MARKER}', 1, raw=False) == (
        f'Look: {MEDIA_MARKER}')
    assert ask.prompt_with_markers('raw text', 1, raw=True) == 'raw text'
    assert ask.prompt_with_markers('no images', 0, raw=False) == 'no images'


def test_a_restarted_producer_is_reconnected(tmp_path, monkeypatch, resolver):
    monkeypatch.setenv('EDGE_LLM_IPC_DIR', str(tmp_path / 'sockets'))
    config = PoolConfig(pool_id='restarted', slot_nbytes=4096, slots=4)
    with TensorPool(config) as first:
        described = resolver.describe_images([to_handle(first.publish_array(RGB))])
        with resolver.hold_images(described.descriptors):
            pass
    with TensorPool(config) as second:   # same pool id, new producer (e.g. a camera restart)
        other = RGB[::-1].copy()
        described = resolver.describe_images([to_handle(second.publish_array(other))])
        with resolver.hold_images(described.descriptors) as frames:
            assert np.array_equal(frames[0], other)
