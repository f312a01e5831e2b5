"""Vision building blocks without ROS processes: pattern, stand-in model, runner, sources.

The model tests bind frames that live in a real TensorPool (mapped read-only through a
TensorResolver) and write outputs straight into a loaned slot, the way perception does.
"""
import os
import sys

import numpy as np
import onnx
from onnx import helper, TensorProto
import pytest

from edge_llm_ros.convert import standin_encoder
from edge_llm_ros.ipc.pool import PoolConfig, TensorPool
from edge_llm_ros.ipc.resolver import TensorResolver
from edge_llm_ros.vision import default_model, sources, synthetic
from edge_llm_ros.vision.errors import (FrameDecodeError, FrameSizeError, ModelMismatchError,
                                        SourceError, SourceUnavailableError, TornFrameError,
                                        VisionModelLoadError)
from edge_llm_ros.vision.runner import VisionModel


# --- synthetic pattern ---------------------------------------------------------------------
def test_synthetic_frames_carry_their_counter_and_differ_everywhere():
    a = synthetic.synthetic_frame(41, 48, 64)
    b = synthetic.synthetic_frame(42, 48, 64)
    assert synthetic.check_frame(a) == 41 and synthetic.check_frame(b) == 42
    # Every byte but the counter's moves from one frame to the next: a stale region shows.
    body = slice(synthetic.COUNTER_BYTES, -synthetic.COUNTER_BYTES)
    assert (a.reshape(-1)[body] != b.reshape(-1)[body]).all()


def test_a_torn_frame_is_detected():
    torn = synthetic.synthetic_frame(7, 48, 64)
    torn[30:] = synthetic.synthetic_frame(8, 48, 64)[30:]
    with pytest.raises(TornFrameError, match='row 30'):
        synthetic.check_frame(torn)
    one_byte = synthetic.synthetic_frame(9, 48, 64)
    one_byte[20, 20, 1] ^= 1
    with pytest.raises(TornFrameError):
        synthetic.check_frame(one_byte)


@pytest.mark.parametrize('width, height', [(0, 480), (640, 15), (9000, 480), (640.0, 480),
                                           (True, 480)])
def test_bad_frame_sizes_are_refused(width, height):
    with pytest.raises(FrameSizeError, match='out of range'):
        synthetic.synthetic_frame(0, height, width)


# --- the stand-in model ----------------------------------------------------------------------
@pytest.fixture(scope='module')
def stand_in():
    spec = default_model.PatchEmbedSpec()
    return spec, VisionModel(standin_encoder.build_model(spec).SerializeToString())


@pytest.fixture
def frames_pool(tmp_path):
    config = PoolConfig(pool_id='unit_frames', slot_nbytes=1080 * 1920 * 3, slots=3,
                        socket_dir=str(tmp_path / 'sockets'))
    with TensorPool(config) as pool, TensorResolver(socket_dir=config.socket_dir) as resolver:
        yield pool, resolver


@pytest.mark.parametrize('height, width', [(480, 640), (1080, 1920), (17, 33), (224, 224)])
def test_stand_in_on_a_mapped_frame_matches_numpy(stand_in, frames_pool, height, width):
    spec, model = stand_in
    pool, resolver = frames_pool
    desc = pool.publish_array(synthetic.synthetic_frame(5, height, width))
    with resolver.borrow(desc) as frame:          # read-only view of the producer's memfd
        assert not frame.flags.writeable
        out = np.empty((spec.n_patches, spec.hidden_size), np.float32)
        model.run(frame, out)
        expected = default_model.reference(frame, spec)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5)
    assert out.shape == (196, 576)
    # Not a constant: patches differ, and the values have the documented spread.
    assert np.unique(out[:, 0]).size > 100 and 0.02 < float(out.std()) < 0.2


def test_output_is_written_into_the_loaned_slot(stand_in, tmp_path):
    spec, model = stand_in
    frame = synthetic.synthetic_frame(3, 48, 64)
    # A socket folder of this test: the default one is shared by every run of this user.
    config = PoolConfig(pool_id='unit_emb', slot_nbytes=spec.n_patches * spec.hidden_size * 4,
                        slots=2, socket_dir=str(tmp_path / 'sockets'))
    with TensorPool(config) as pool:
        loan = pool.loan()
        out = loan.ndarray('float32', (spec.n_patches, spec.hidden_size))
        address = out.__array_interface__['data'][0]
        assert model.run(frame, out) is out and out.__array_interface__['data'][0] == address
        desc = loan.publish()
        np.testing.assert_allclose(np.frombuffer(pool.copy_out(desc), np.float32).reshape(
            out.shape), default_model.reference(frame, spec), rtol=0, atol=1e-5)


def test_stand_in_is_deterministic_per_seed_and_sized_by_spec():
    a = default_model.make_weights(default_model.PatchEmbedSpec(seed=1))
    b = default_model.make_weights(default_model.PatchEmbedSpec(seed=1))
    c = default_model.make_weights(default_model.PatchEmbedSpec(seed=2))
    assert np.array_equal(a.weight, b.weight) and not np.array_equal(a.weight, c.weight)
    spec = default_model.PatchEmbedSpec(hidden_size=64, image_size=64, patch_size=16)
    model = VisionModel(standin_encoder.build_model(spec).SerializeToString())
    assert model.output.shape == (16, 64)
    assert model.run(synthetic.synthetic_frame(0, 40, 50)).shape == (16, 64)
    with pytest.raises(ModelMismatchError, match='not a multiple'):
        default_model.PatchEmbedSpec(image_size=100, patch_size=16)


def test_stand_in_cli_writes_a_loadable_model(tmp_path):
    path = tmp_path / 'stand_in.onnx'
    assert standin_encoder.main([str(path), '--hidden-size', '32', '--image-size', '32']) == 0
    model = VisionModel(str(path))
    assert model.output.shape == (4, 32)
    assert onnx.load(str(path)).metadata_props[0].key == 'hidden_size'


# --- models given by path --------------------------------------------------------------------
def _identity_model(path, dtype, shape) -> str:
    """Write a one-node model (x -> Identity -> y) with the given input type."""
    info = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node('Identity', ['x'], ['y'])], 'g',
                              [info('x', dtype, shape)], [info('y', dtype, shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid('', 18)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return str(path)


def test_model_with_a_fixed_float_input_names_the_mismatch(tmp_path):
    model = VisionModel(_identity_model(tmp_path / 'm.onnx', TensorProto.FLOAT, [1, 3, 224, 224]))
    frame = synthetic.synthetic_frame(0, 480, 640)
    with pytest.raises(ModelMismatchError) as err:
        model.run(frame)
    text = str(err.value)
    assert "'x': float32 [1, 3, 224, 224]" in text and 'uint8 [480, 640, 3]' in text


def test_batch_of_one_input_takes_the_frame_without_copy(tmp_path):
    model = VisionModel(_identity_model(tmp_path / 'm.onnx', TensorProto.UINT8,
                                        ['batch', 48, 64, 3]))
    frame = synthetic.synthetic_frame(4, 48, 64)
    assert model.input_shape(frame.dtype, frame.shape) == (1, 48, 64, 3)
    assert np.array_equal(model.run(frame)[0], frame)
    with pytest.raises(ModelMismatchError, match='uint8 \\[40, 64, 3\\]'):
        model.run(synthetic.synthetic_frame(4, 40, 64))


def test_models_perception_cannot_feed_are_refused(tmp_path):
    with pytest.raises(VisionModelLoadError, match='is not a file'):
        VisionModel(str(tmp_path / 'missing.onnx'))
    (tmp_path / 'junk.onnx').write_bytes(b'not a model')
    with pytest.raises(VisionModelLoadError, match='cannot load'):
        VisionModel(str(tmp_path / 'junk.onnx'))
    info = helper.make_tensor_value_info
    pair = [info('a', TensorProto.FLOAT, [2]), info('b', TensorProto.FLOAT, [2])]
    graph = helper.make_graph([helper.make_node('Add', ['a', 'b'], ['c'])], 'g', pair,
                              [info('c', TensorProto.FLOAT, [2])])
    two = helper.make_model(graph, opset_imports=[helper.make_opsetid('', 18)])
    two.ir_version = 9
    with pytest.raises(ModelMismatchError, match='2 inputs'):
        VisionModel(two.SerializeToString())
    path = _identity_model(tmp_path / 'id.onnx', TensorProto.UINT8, [4])
    with pytest.raises(ModelMismatchError, match="no output named 'nope'"):
        from edge_llm_ros.vision.runner import RunnerConfig
        VisionModel(path, RunnerConfig(output_name='nope'))


# --- frame sources ---------------------------------------------------------------------------
def test_source_texts_are_classified(tmp_path):
    (tmp_path / 'clip.mkv').write_bytes(b'')
    (tmp_path / 'still.PNG').write_bytes(b'')
    kinds = {text: sources.parse_source(text).kind for text in (
        'synthetic', 'topic:/camera/image_raw', '/dev/video3', str(tmp_path),
        str(tmp_path / 'clip.mkv'), str(tmp_path / 'still.PNG'))}
    assert list(kinds.values()) == [
        sources.SourceKind.SYNTHETIC, sources.SourceKind.TOPIC, sources.SourceKind.V4L2,
        sources.SourceKind.IMAGE_FOLDER, sources.SourceKind.VIDEO_FILE,
        sources.SourceKind.IMAGE_FILE]
    assert sources.parse_source('topic: /cam ').location == '/cam'


@pytest.mark.parametrize('text, match', [
    ('webcam', "source 'webcam' is not usable"),
    ('/no/such/folder', 'is not usable'),
    ('topic:', 'needs an image topic'),
])
def test_unknown_sources_are_refused_with_what_is_accepted(text, match):
    with pytest.raises(SourceError, match=match) as err:
        sources.open_source(text, 64, 48)
    assert 'synthetic' in str(err.value) or 'topic' in str(err.value)


def test_image_folder_is_read_in_name_order_resized_and_looped(tmp_path):
    from PIL import Image
    for k in (2, 0, 1):
        Image.fromarray(synthetic.synthetic_frame(k, 48, 64)).save(tmp_path / f'f{k}.png')
    Image.new('RGB', (128, 96), (10, 200, 30)).save(tmp_path / 'z_big.png')
    (tmp_path / 'notes.txt').write_text('ignored')
    reader = sources.open_source(str(tmp_path), 64, 48)
    out = np.empty(reader.shape, np.uint8)
    got = []
    for _ in range(3):
        reader.read_into(out)
        got.append(synthetic.check_frame(out))     # PNG is lossless: exact frames
    reader.read_into(out)                           # 128x96 -> 64x48, resized by Pillow
    assert got == [0, 1, 2]
    assert (out == np.array([10, 200, 30], np.uint8)).all()
    reader.read_into(out)
    assert synthetic.check_frame(out) == 0          # looped
    (tmp_path / 'f1.png').write_bytes(b'not a png')     # a bad file: that frame fails...
    with pytest.raises(FrameDecodeError, match='f1.png'):
        reader.read_into(out)
    reader.read_into(out)                               # ...and the folder goes on
    assert synthetic.check_frame(out) == 2
    empty = tmp_path / 'empty'
    empty.mkdir()
    with pytest.raises(SourceError, match='holds no'):
        sources.open_source(str(empty), 64, 48)


def _write_video(path, counters, height=48, width=64) -> None:
    import av
    with av.open(str(path), 'w') as container:
        stream = container.add_stream('ffv1', rate=30)   # lossless: frames come back exact
        stream.width, stream.height, stream.pix_fmt = width, height, 'bgr0'
        for k in counters:
            frame = av.VideoFrame.from_ndarray(synthetic.synthetic_frame(k, height, width),
                                               format='rgb24')
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_video_file_is_decoded_exactly_and_looped(tmp_path):
    _write_video(tmp_path / 'clip.mkv', range(4))
    reader = sources.open_source(str(tmp_path / 'clip.mkv'), 64, 48)
    out = np.empty(reader.shape, np.uint8)
    got = []
    for _ in range(6):
        reader.read_into(out)
        got.append(synthetic.check_frame(out))
    reader.close()
    assert got == [0, 1, 2, 3, 0, 1]
    once = sources.open_source(str(tmp_path / 'clip.mkv'), 32, 24, loop=False)
    small = np.empty(once.shape, np.uint8)
    for _ in range(4):
        once.read_into(small)                       # scaled by FFmpeg to 32x24
    with pytest.raises(SourceError, match='end of stream'):
        once.read_into(small)


def test_unreadable_video_and_missing_camera_are_clear_errors(tmp_path):
    (tmp_path / 'broken.mp4').write_bytes(b'\x00\x01 not a video ' * 256)
    with pytest.raises(SourceError, match='not a video FFmpeg can read'):
        sources.open_source(str(tmp_path / 'broken.mp4'), 64, 48)
    with pytest.raises(SourceError, match='/dev/video97 does not exist'):
        sources.open_source('/dev/video97', 64, 48)


def test_video_without_pyav_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / 'clip.mkv').write_bytes(b'\0' * 16)
    monkeypatch.setitem(sys.modules, 'av', None)     # import av -> ImportError
    with pytest.raises(SourceUnavailableError, match='pip install av'):
        sources.open_source(str(tmp_path / 'clip.mkv'), 64, 48)


@pytest.mark.skipif(not any(p.startswith('video') for p in os.listdir('/dev')),
                    reason='no V4L2 camera (/dev/video*) on this machine')
def test_v4l2_camera_delivers_frames():
    device = sorted(f'/dev/{p}' for p in os.listdir('/dev') if p.startswith('video'))[0]
    reader = sources.open_source(device, 320, 240)
    out = np.empty(reader.shape, np.uint8)
    reader.read_into(out)
    reader.close()
    assert out.shape == (240, 320, 3)
