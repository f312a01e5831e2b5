"""Bad inputs to frame_source and perception: each process says what to fix, or exits 2."""
import os
import time

import onnx
from onnx import helper, TensorProto
import pytest
import rclpy
from vision_support import NodeProc, Probe

from edge_llm_ros.nodes.tensor_output import CopyKind

TAG = f'e{os.getpid()}'


@pytest.mark.parametrize('params, message', [
    ({'source': 'webcam'}, "source 'webcam' is not usable"),
    ({'width': 8}, 'width'),
    ({'height': 100000}, 'height'),
    ({'pool.allocator': 'gpu'}, "'gpu' is not one of auto"),
    ({'copy_fallback': 'sometimes'}, 'copy_fallback'),
    ({'source': '/dev/video97'}, 'V4L2 device /dev/video97 does not exist'),
])
def test_frame_source_refuses_bad_parameters(tmp_path, params, message):
    proc = NodeProc('frame_source', f'{TAG}_bad_source',
                    {'socket_dir': str(tmp_path / 's'), **params})
    assert proc.wait_exit(60) == 2, proc.log()
    assert 'frame_source: error:' in proc.log() and message in proc.log(), proc.log()


@pytest.mark.parametrize('params, message', [
    ({'model.path': '/no/such/model.onnx'}, "model.path '/no/such/model.onnx' is not a file"),
    ({'model.image_size': 100}, 'image_size 100 is not a multiple of patch_size 16'),
    ({'model.llm_path': '/no/such/llm'}, 'model folder /no/such/llm does not exist'),
    ({'input.transport': 'carrier_pigeon'}, 'input.transport'),
])
def test_perception_refuses_bad_parameters(tmp_path, params, message):
    proc = NodeProc('perception', f'{TAG}_bad_perception',
                    {'socket_dir': str(tmp_path / 's'), **params})
    assert proc.wait_exit(60) == 2, proc.log()
    assert 'perception: error:' in proc.log() and message in proc.log(), proc.log()


@pytest.fixture(scope='module')
def frames(tmp_path_factory):
    socket_dir = str(tmp_path_factory.mktemp('vision_errors') / 's')
    proc = NodeProc('frame_source', f'{TAG}_frames', {
        'socket_dir': socket_dir, 'width': 64, 'height': 48, 'rate_hz': 15.0,
        'pool.id': f'{TAG}_frames'})
    proc.wait_log('synthetic pattern', 30)
    rclpy.init()
    yield socket_dir
    rclpy.try_shutdown()
    assert proc.stop() == 0, proc.log()


def _float_image_model(path) -> str:
    info = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node('Identity', ['pixel_values'], ['y'])], 'g',
                              [info('pixel_values', TensorProto.FLOAT, [1, 3, 224, 224])],
                              [info('y', TensorProto.FLOAT, [1, 3, 224, 224])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid('', 18)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return str(path)


@pytest.mark.parametrize('params, message', [
    ({'model.path': 'FLOAT_MODEL'},
     "frame rejected: model input 'pixel_values': float32 [1, 3, 224, 224] does not accept "
     'frames of uint8 [48, 64, 3]'),
    ({'input.pool_id': 'some_other_pool'},
     "ignoring handles of pool 'FRAMES_POOL': this input only accepts pool 'some_other_pool'"),
])
def test_perception_rejects_frames_it_cannot_use_and_keeps_running(
        frames, tmp_path, params, message):
    params = {k: _float_image_model(tmp_path / 'float.onnx') if v == 'FLOAT_MODEL' else v
              for k, v in params.items()}
    message = message.replace('FRAMES_POOL', f'{TAG}_frames')
    name = f'{TAG}_picky'
    proc = NodeProc('perception', name, {'socket_dir': frames, 'pool.id': f'{TAG}_picky',
                                         'input.topic': f'/{TAG}_frames/frames', **params})
    probe = Probe(f'{TAG}_probe')
    try:
        embeddings = probe.tensors(f'/{name}/embeddings', CopyKind.TENSOR, socket_dir=frames)
        proc.wait_log(message, 60)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            assert embeddings.take(0.1) is None, 'a rejected frame produced embeddings'
        assert proc.proc.poll() is None, proc.log()
    finally:
        probe.close()
        assert proc.stop() == 0, proc.log()
