"""Grounded answers and the image token cap through a real llm_node, on a tiny Qwen2.5-VL pair.

A random model never writes a box by itself, so the goals force the answer with a `choices`
constraint: the output IS a Qwen2.5-VL box JSON, generated token by token as any answer is, and
the node must map it from the model's input pixels (the smart resize: 120 x 90 -> 112 x 84)
onto the frame's, put it in the Result's `detections` and publish it on ~/detections stamped
with the frame's header. A text-only answer publishes nothing. The node's image token cap
(vision.max_image_tokens, the board profile's default) refuses a frame before any model work,
a goal may raise it, and the node keeps serving. detections.publish on with a model that
does not ground fails configure.
"""
import json
import math
import os
import subprocess
import sys
import time

from gguf_fixtures import ParityCase, write_gguf
from llm_node_harness import NodeProcess, RosClient, TRANSITIONS
from mmproj_fixtures import write_qwen25vl_mmproj
import numpy as np
from PIL import Image
import pytest
import rclpy
from std_msgs.msg import Header

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import Transcript
from edge_llm_ros.convert.converter import convert
from edge_llm_ros.ipc.pool import PoolConfig, TensorPool
from edge_llm_ros.nodes.detections import detection_messages
from edge_llm_ros.nodes.handles import to_handle
from edge_llm_ros.runtime.media import MEDIA_MARKER

pytestmark = pytest.mark.timeout(600)
TAG = f'gn{os.getpid()}'
LLM = f'{TAG}_llm'
HEIGHT, WIDTH = 90, 120        # smart resize: 84 x 112 pixels = 3 x 4 = 12 tokens
TOKENS = 12
CAP = 10                       # the node's default cap: this frame is over it
BOX = '[{"bbox_2d": [28, 14, 56, 70], "label": "cup"}]'
# 28..56 x 14..70 of 112 x 84 on a 120 x 90 frame: x 30..60, y 15..75.
CENTER, SIZE = (45.0, 45.0), (30.0, 60.0)
PROMPT = f'{MEDIA_MARKER}\nWhere is the cup?'
PROMPT2 = f'{MEDIA_MARKER}{MEDIA_MARKER}\nWhere is the cup?'
INVALID = Generate.Result.ERROR_INVALID_REQUEST


@pytest.fixture(scope='module')
def vlm(tmp_path_factory):
    work = tmp_path_factory.mktemp('grounding_node')
    case = ParityCase(arch='qwen2vl', wtype='F32', vision='qwen', chain=0.1)
    text = write_gguf(work / 'text.gguf', case)
    mmproj = write_qwen25vl_mmproj(work / 'mmproj.gguf', n_text=case.dims.hidden, seed=3)
    return convert(str(text), str(work / 'vlm'), mmproj=str(mmproj), progress=False)


@pytest.fixture(scope='module')
def ipc_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp('grounding_node_ipc') / 'sockets')


@pytest.fixture(scope='module')
def ros():
    rclpy.init()
    client = RosClient(f'{TAG}_client')
    yield client
    client.close()
    rclpy.try_shutdown()


@pytest.fixture(scope='module')
def node(vlm, ipc_dir, ros):
    proc = NodeProcess(LLM, {'autostart': True, 'model.path': str(vlm), 'kv.max_context': 256,
                             'vision.max_image_tokens': CAP},
                       env={'EDGE_LLM_IPC_DIR': ipc_dir})
    try:
        ros.wait_state('/' + LLM, 'active', timeout=180)
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.fixture
def pool(ipc_dir):
    config = PoolConfig(pool_id=f'{TAG}_cam', slot_nbytes=HEIGHT * WIDTH * 3, slots=4,
                        socket_dir=ipc_dir)
    with TensorPool(config) as made:
        yield made


def frame_handle(pool, seed: int = 1, stamp_s: int = 42):
    pixels = np.random.default_rng(seed).integers(0, 256, (HEIGHT, WIDTH, 3), np.uint8)
    header = Header(frame_id='camera_optical')
    header.stamp.sec = stamp_s
    return to_handle(pool.publish_array(pixels), header)


def wait_until(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_the_engine_keeps_each_images_sizes_and_applies_its_default_cap(vlm):
    """What the node maps answers with, and EngineConfig.max_image_tokens (the parameter's)."""
    from edge_llm_ros.runtime.media import ImageInputError
    from edge_llm_ros.runtime.types import GenerationRequest
    from edge_llm_ros.serving.engine import Engine, EngineConfig
    engine = Engine(EngineConfig(model_dir=str(vlm), max_context=256, intra_op_threads=1,
                                 max_image_tokens=CAP))
    try:
        frame = np.zeros((HEIGHT, WIDTH, 3), np.uint8)
        request = GenerationRequest(prompt=PROMPT, images=[frame], max_tokens=4)
        with pytest.raises(ImageInputError, match=f'takes {TOKENS} tokens, over '
                                                  f'max_image_tokens {CAP}'):
            engine.prepare(request)
        prepared = engine.prepare(GenerationRequest(prompt=PROMPT2, images=[frame, frame[:56]],
                                                    max_tokens=4, max_image_tokens=TOKENS))
        assert prepared.image_sizes == (((WIDTH, HEIGHT), (112, 84)), ((WIDTH, 56), (112, 56)))
        assert engine.family.grounding == 'absolute'
    finally:
        engine.close()
    with pytest.raises(Exception, match='max_image_tokens must be >= 0'):
        Engine(EngineConfig(model_dir=str(vlm), max_image_tokens=-1))


def test_an_image_over_the_nodes_cap_is_refused_and_a_goal_may_raise_it(node, ros, pool):
    llm = ros.llm('/' + LLM)
    refused = llm.generate(PROMPT, images=[frame_handle(pool)], max_tokens=4,
                           temperature=0.0).result(timeout=300)
    assert refused.status == 'aborted' and refused.error_kind == INVALID, refused
    assert f'takes {TOKENS} tokens, over max_image_tokens {CAP}' in refused.error_message
    lower = llm.generate(PROMPT, images=[frame_handle(pool)], max_image_tokens=TOKENS - 1,
                         max_tokens=4, temperature=0.0).result(timeout=300)
    assert lower.error_kind == INVALID and f'over max_image_tokens {TOKENS - 1}' in \
        lower.error_message
    # The node keeps serving; the goal's own cap lets the frame in.
    served = llm.generate(PROMPT, images=[frame_handle(pool)], max_image_tokens=TOKENS,
                          max_tokens=4, temperature=0.0).result(timeout=300)
    assert served.ok, served
    assert served.prompt_tokens > TOKENS


def test_a_bad_clip_is_refused_before_any_model_work_and_node_keeps_serving(node, ros, pool):
    """Interface version 8: a clip's frames as handles, their timestamps and fps."""
    llm = ros.llm('/' + LLM)
    frames = [frame_handle(pool, seed) for seed in (1, 2)]

    def clip(stamps, **kw):
        return llm.generate(PROMPT, video_frames=frames, video_timestamps=stamps, video_fps=2.0,
                            max_tokens=4, temperature=0.0, **kw).result(timeout=300)
    backwards = clip([1.0, 0.5], max_image_tokens=TOKENS)
    assert backwards.error_kind == INVALID and 'out of order' in backwards.error_message, backwards
    over = clip([0.0, 0.5])   # the node's cap applies per chunk of 2 frames, as to an image
    assert over.error_kind == INVALID, over
    assert f'every 2 frames take {TOKENS} tokens, over max_image_tokens {CAP}' in \
        over.error_message
    served = clip([0.0, 0.5], max_image_tokens=TOKENS)
    assert served.ok, served
    # 2 frames are one chunk placed like one image: the prompt of one image goal.
    single = llm.generate(PROMPT, images=[frame_handle(pool)], max_image_tokens=TOKENS,
                          max_tokens=4, temperature=0.0).result(timeout=300)
    assert served.prompt_tokens == single.prompt_tokens > TOKENS


def test_a_box_answer_becomes_detections_in_the_frames_pixels(node, ros, pool):
    llm = ros.llm('/' + LLM)
    types = detection_messages()
    published = ros.record(types.array, f'/{LLM}/detections')
    transcripts = ros.record(Transcript, f'/{LLM}/transcript')
    outcome = llm.generate(PROMPT, images=[frame_handle(pool, stamp_s=42)], choices=[BOX],
                           max_image_tokens=TOKENS, max_tokens=128,
                           temperature=0.0).result(timeout=300)
    assert outcome.ok and outcome.text == BOX, outcome
    assert len(outcome.detections) == 1
    found = outcome.detections[0]
    assert found.header.frame_id == 'camera_optical' and found.header.stamp.sec == 42
    assert math.isclose(found.bbox.center.position.x, CENTER[0])
    assert math.isclose(found.bbox.center.position.y, CENTER[1])
    assert (found.bbox.size_x, found.bbox.size_y) == pytest.approx(SIZE)
    assert found.results[0].class_id == 'cup' and found.results[0].score == 1.0
    assert wait_until(lambda: len(published) == 1, 30), 'no Detection2DArray on ~/detections'
    array = published[0]
    assert array.header.frame_id == 'camera_optical' and array.header.stamp.sec == 42
    item = array.detections[0]
    assert (item.bbox.center.position.x, item.bbox.center.position.y) == pytest.approx(CENTER)
    assert (item.bbox.size_x, item.bbox.size_y) == pytest.approx(SIZE)
    hypothesis = item.results[0] if types.with_pose is None else item.results[0].hypothesis
    assert hypothesis.class_id == 'cup'
    assert item.id == found.id and item.id.endswith('/0')
    assert wait_until(lambda: any(r.detections for r in list(transcripts)), 30)
    record = next(r for r in list(transcripts) if r.detections)
    assert record.max_image_tokens == TOKENS and record.interface_version == 9

    # A text-only answer: an empty result list and nothing on the topic.
    text = llm.generate(PROMPT, images=[frame_handle(pool)], choices=['no cup here'],
                        max_image_tokens=TOKENS, max_tokens=64,
                        temperature=0.0).result(timeout=300)
    assert text.ok and text.text == 'no cup here' and text.detections == ()
    time.sleep(1.0)
    assert len(published) == 1


def test_a_goal_with_two_images_publishes_one_array_per_frame_with_its_header(node, ros, pool):
    """Each box goes to the image the answer names before it ("Picture n", prompt order)."""
    llm = ros.llm('/' + LLM)
    published = ros.record(detection_messages().array, f'/{LLM}/detections')
    rng = np.random.default_rng(5)
    second = pool.publish_array(rng.integers(0, 256, (56, WIDTH, 3), np.uint8))
    header = Header(frame_id='wrist_camera')
    header.stamp.sec = 43
    answer = f'Picture 1: {BOX} Picture 2: [{{"bbox_2d": [0, 0, 56, 28], "label": "pen"}}]'

    outcome = llm.generate(PROMPT2, images=[frame_handle(pool, stamp_s=42),
                                            to_handle(second, header)],
                           choices=[answer], max_image_tokens=TOKENS, max_tokens=192,
                           temperature=0.0).result(timeout=300)
    assert outcome.ok and outcome.text == answer, outcome.error_message
    cup, pen = outcome.detections
    assert (cup.header.frame_id, cup.header.stamp.sec) == ('camera_optical', 42)
    assert (cup.bbox.center.position.x, cup.bbox.center.position.y) == pytest.approx(CENTER)
    assert (pen.header.frame_id, pen.header.stamp.sec) == ('wrist_camera', 43)
    # 0..56 x 0..28 of 112 x 56 on a 120 x 56 frame: x 0..60, y 0..28.
    assert (pen.bbox.center.position.x, pen.bbox.center.position.y) == pytest.approx((30, 14))
    assert (pen.bbox.size_x, pen.bbox.size_y) == pytest.approx((60, 28))
    assert cup.id.endswith('/image1/0') and pen.id.endswith('/image2/0')
    assert wait_until(lambda: len(published) == 2, 30), len(published)
    arrays = sorted(published, key=lambda a: a.header.stamp.sec)
    assert [(a.header.frame_id, len(a.detections)) for a in arrays] == [
        ('camera_optical', 1), ('wrist_camera', 1)]
    assert [a.detections[0].id for a in arrays] == [cup.id, pen.id]


def test_detections_on_for_a_model_that_does_not_ground_fails_configure(ros):
    """The embedded SmolLM2 takes no images and does not ground: a typed configure error."""
    name = f'{TAG}_text'
    proc = NodeProcess(name, {'detections.publish': 'on', 'kv.max_context': 256})
    try:
        ros.wait_state('/' + name, 'unconfigured', timeout=60)
        assert not ros.transition('/' + name, TRANSITIONS['configure'])
        assert ros.state('/' + name) == 'unconfigured'
        assert wait_until(lambda: 'does not ground' in proc.log(), 30), proc.log()
        assert "detections.publish to 'auto' or 'off'" in proc.log()
    finally:
        assert proc.stop() == 0, proc.log()


def test_ask_draws_the_answers_boxes_on_its_image(node, ipc_dir, tmp_path):
    """`edge-llm ask --image --draw`: the answer (forced by a JSON schema) drawn on the PNG."""
    photo, out = tmp_path / 'photo.png', tmp_path / 'out.png'
    Image.fromarray(np.zeros((HEIGHT, WIDTH, 3), np.uint8)).save(photo)
    schema = {'type': 'array', 'minItems': 1, 'maxItems': 1, 'items': {
        'type': 'object', 'additionalProperties': False, 'required': ['bbox_2d', 'label'],
        'properties': {'bbox_2d': {'const': [28, 14, 56, 70]}, 'label': {'const': 'cup'}}}}
    proc = subprocess.run(
        [sys.executable, '-m', 'edge_llm_ros.cli', 'ask', 'Where is the cup?', '--server',
         '/' + LLM, '--image', str(photo), '--draw', str(out), '--max-image-tokens',
         str(TOKENS), '--max-tokens', '128', '--temperature', '0', '--json-schema',
         json.dumps(schema), '--wait', '60'],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, 'EDGE_LLM_IPC_DIR': ipc_dir})
    assert proc.returncode == 0, proc.stderr
    assert '1 detection(s) drawn to' in proc.stderr, proc.stderr
    drawn = np.asarray(Image.open(out).convert('RGB'))
    assert drawn.shape == (HEIGHT, WIDTH, 3)
    assert (drawn[20:70, 30] == (255, 64, 64)).all()   # the box's left edge at x = 30
