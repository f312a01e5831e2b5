"""Camera -> perception (a VLM's own encoder) -> llm_node: encoded images in a goal.

frame_source publishes one PNG file as 64x48 frames; perception runs a converted tiny VLM
folder's vision encoder on them (idefics3: 2 x 2 tiles of 16 rows and the overview) and
publishes each frame's rows in their wire form (float32 [grid_rows + 1, grid_cols, 16,
hidden]); a Generate goal carries that handle in `images`. llm_node must place the rows with
the family's wrapper tokens and give the ids Engine.generate gives for the frame's pixels,
without running its encoder. All processes find the pool sockets through EDGE_LLM_IPC_DIR.

perception also holds a time window (window.seconds): "the last 2 seconds, 2 frames" from its
~/window service goes into a goal as two image handles of the window pool and gives
Engine.generate's ids for the frame's pixels twice (a 64x48 frame is 80 image rows here; the
tiny model's 256 positions take two).
"""
import os
import time

from gguf_fixtures import ParityCase, write_gguf
from llm_node_harness import NodeProcess, RosClient
from mmproj_fixtures import write_mmproj
import numpy as np
from PIL import Image
import pytest
import rclpy
from vision_support import NodeProc

from edge_llm_msgs.srv import GetWindow
from edge_llm_ros.convert.converter import convert
from edge_llm_ros.nodes.handles import to_handle
from edge_llm_ros.nodes.tensor_input import TensorInput
from edge_llm_ros.nodes.tensor_output import CopyKind
from edge_llm_ros.runtime import media
from edge_llm_ros.runtime.types import GenerationRequest
from edge_llm_ros.serving.engine import Engine, EngineConfig

pytestmark = pytest.mark.timeout(600)
TAG = f'pv{os.getpid()}'
LLM = f'{TAG}_llm'
PROMPT = f'Look {media.MEDIA_MARKER} the sky'
TOKENS = 8
PIXELS = np.random.default_rng(21).integers(0, 256, (48, 64, 3), np.uint8)


@pytest.fixture(scope='module')
def world(tmp_path_factory):
    work = tmp_path_factory.mktemp('perception_vlm')
    text = write_gguf(work / 'text.gguf', ParityCase(arch='llama', wtype='F32', vision=True))
    mmproj = write_mmproj(work / 'mmproj.gguf', 'idefics3', n_text=256, scale=2,
                          longest_edge=64, seed=13)
    folder = convert(str(text), str(work / 'vlm'), mmproj=str(mmproj), progress=False)
    photo = work / 'photo.png'
    Image.fromarray(PIXELS).save(photo)
    sockets = str(work / 'sockets')
    env = {'EDGE_LLM_IPC_DIR': sockets}
    procs = [
        NodeProc('frame_source', f'{TAG}_frames', {
            'source': str(photo), 'width': 64, 'height': 48, 'rate_hz': 5.0,
            'pool.id': f'{TAG}_frames'}, env),
        NodeProc('perception', f'{TAG}_perception', {
            'input.topic': f'/{TAG}_frames/frames', 'pool.id': f'{TAG}_rows',
            'model.path': str(folder), 'window.seconds': 3.0}, env),
    ]
    llm = NodeProcess(LLM, {'autostart': True, 'model.path': str(folder),
                            'kv.max_context': 256}, env=env)
    try:
        procs[1].wait_log('embeddings pool', 120)
        yield folder, sockets, procs
    finally:
        codes = [p.stop() for p in procs] + [llm.stop()]
        assert codes == [0, 0, 0], '\n'.join([p.log() for p in procs] + [llm.log()])


def test_perception_rows_in_a_goal_give_the_frames_own_answer(world):
    folder, sockets, procs = world
    assert 'VLM encoder of' in procs[1].log()
    engine = Engine(EngineConfig(model_dir=str(folder), max_context=256, intra_op_threads=1,
                                 prefix_reuse=False))
    rclpy.init()
    client = RosClient(f'{TAG}_client')
    rows = TensorInput(client.node, f'/{TAG}_perception/embeddings', CopyKind.TENSOR,
                       socket_dir=sockets)
    try:
        want = engine.generate(GenerationRequest(prompt=PROMPT, images=[PIXELS],
                                                 use_chat_template=False,
                                                 max_tokens=TOKENS)).run_to_end()
        assert want.error == ''
        client.wait_state('/' + LLM, 'active', timeout=120)
        llm = client.llm('/' + LLM)
        sample = rows.take(60.0)
        assert sample is not None and sample.zero_copy, rows.stats
        with sample:   # held: perception cannot rewrite this buffer while the goal runs
            # 64x48 -> longest edge 64 -> 2 x 2 tiles of 32 px (16 rows each) + overview.
            assert sample.array.shape == (3, 2, 16, 256) and sample.array.dtype == np.float32
            # The same encoder code: the rows llm_node's engine makes of the frame's pixels.
            ours = engine.vision.encode(PIXELS).rows
            np.testing.assert_allclose(media.encoded_rows(sample.array), ours, atol=1e-5)
            outcome = llm.generate(PROMPT, images=[to_handle(sample.descriptor, sample.header)],
                                   raw_prompt=True, max_tokens=TOKENS,
                                   temperature=0.0).result(timeout=300)
        assert outcome.ok, outcome
        assert outcome.token_ids == want.token_ids
        assert outcome.prompt_tokens == want.prompt_tokens
    finally:
        rows.close()
        client.close()
        rclpy.try_shutdown()
        engine.close()


def test_encoded_images_through_the_engine_equal_their_frames(world):
    """The wire form round trip, and the checks an encoded image gets before any model work."""
    folder = world[0]
    engine = Engine(EngineConfig(model_dir=str(folder), max_context=256, intra_op_threads=1,
                                 prefix_reuse=False))
    try:
        enc = engine.vision
        wire = np.zeros(enc.encoded_shape(48, 64), np.float32)
        enc.encode_into(PIXELS, wire)
        np.testing.assert_array_equal(media.encoded_rows(wire), enc.encode(PIXELS).rows)
        request = {'prompt': PROMPT, 'use_chat_template': False, 'max_tokens': TOKENS}
        a = engine.generate(GenerationRequest(images=[PIXELS], **request)).run_to_end()
        b = engine.generate(GenerationRequest(images=[wire], **request)).run_to_end()
        assert a.error == b.error == '' and a.token_ids == b.token_ids
        for bad, match in [(wire[:, :, :8], 'takes 16 x 256'),
                           (wire[:1, :1], 'never has'),
                           (np.zeros((2, 2, 16), np.float32), 'uint8'),
                           (np.zeros((1, 3, 16, 256), np.float32), 'encoded image of shape')]:
            with pytest.raises(media.ImageInputError, match=match):
                engine.prepare(GenerationRequest(images=[bad], **request))
        nan = wire.copy()
        nan[0, 0, 0, 0] = np.nan
        result = engine.generate(GenerationRequest(images=[nan], **request)).run_to_end()
        assert 'NaN' in result.error
        again = engine.generate(GenerationRequest(images=[wire], **request)).run_to_end()
        assert again.token_ids == a.token_ids   # the engine keeps serving
    finally:
        engine.close()


def test_a_time_window_of_perception_goes_into_a_goal_as_its_frames(world):
    folder, sockets, procs = world
    prompt = f'Look {media.MEDIA_MARKER * 2} the sky'
    engine = Engine(EngineConfig(model_dir=str(folder), max_context=256, intra_op_threads=1,
                                 prefix_reuse=False))
    rclpy.init()
    client = RosClient(f'{TAG}_window_client')
    try:
        want = engine.generate(GenerationRequest(prompt=prompt, images=[PIXELS] * 2,
                                                 use_chat_template=False,
                                                 max_tokens=TOKENS)).run_to_end()
        assert want.error == ''
        procs[1].wait_log('window: the last', 60)
        time.sleep(2.0)   # 5 Hz: the window holds about 10 frames
        reply = client.call(GetWindow, f'/{TAG}_perception/window',
                            GetWindow.Request(last_seconds=2.0, max_frames=2))
        assert reply.success, reply.error_message
        assert len(reply.frames) == 2
        assert {h.pool_id for h in reply.frames} == {f'{TAG}_rows_window'}
        assert [tuple(h.shape) for h in reply.frames] == [(48, 64, 3)] * 2
        client.wait_state('/' + LLM, 'active', timeout=120)
        outcome = client.llm('/' + LLM).generate(
            prompt, images=list(reply.frames), raw_prompt=True, max_tokens=TOKENS,
            temperature=0.0).result(timeout=300)
        assert outcome.ok, outcome.error_message
        assert outcome.token_ids == want.token_ids
        assert outcome.prompt_tokens == want.prompt_tokens
    finally:
        client.close()
        rclpy.try_shutdown()
        engine.close()
