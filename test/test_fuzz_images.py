"""Property tests: random image goals through a VLM llm_node's validation (issue 22 item 6).

Contract: a goal with images is either run to a terminal outcome or refused with a message
before any model work; no exception escapes the node's validation, a refused goal gives its
queue reservation back, and the node keeps serving. The goals mix good frame handles of a
live pool (RGB and mono) with hostile ones: random descriptors, stale generations, foreign
pools, wrong dtypes and shapes, zero-size and 100-megapixel declarations, marker counts unlike
the image count, more images than the context holds, raw and chat prompts, and chat turns of
a few sessions (their images stored, resent or dropped). The text-only node's fuzzing
(test_fuzz_goals.py) sends images to a model without vision.
"""
import types

from fuzz_support import bounded, fuzz, HOSTILE_TEXT, private_ipc_dir
from gguf_fixtures import ParityCase, write_gguf
from hypothesis import event, given, strategies as st
from mmproj_fixtures import write_mmproj
import numpy as np
import pytest
import rclpy
from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.parameter import Parameter
from test_fuzz_goals import _peak_rss, _reservations_all_free, _validate_and_run, handles

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import ChatMessage, TensorHandle
from edge_llm_ros.convert.converter import convert
from edge_llm_ros.errors import InvalidRequestError
from edge_llm_ros.ipc.pool import PoolConfig, TensorPool
from edge_llm_ros.nodes.handles import to_handle
from edge_llm_ros.nodes.llm_admission import NodeGoal
from edge_llm_ros.nodes.llm_node import LLMNode
from edge_llm_ros.runtime.media import MEDIA_MARKER

POOL = 'fzimage'
CONTEXT = 256          # an mlp image takes 64 positions: four do not fit with a prompt
QUEUE_DEPTH = 2


@pytest.fixture(scope='module')
def vlm(tmp_path_factory):
    work = tmp_path_factory.mktemp('fuzz_images')
    text = write_gguf(work / 'text.gguf', ParityCase(arch='llama', wtype='F32', vision=True))
    mmproj = write_mmproj(work / 'mmproj.gguf', 'mlp', n_text=256, scale=None, seed=3)
    return convert(str(text), str(work / 'vlm'), mmproj=str(mmproj), progress=False)


@pytest.fixture(scope='module')
def frames():
    """Serve a live pool (private EDGE_LLM_IPC_DIR) with published RGB and mono frames."""
    with private_ipc_dir('fi') as path:
        pool = TensorPool(PoolConfig(pool_id=POOL, slot_nbytes=48 * 64 * 3, slots=4,
                                     allocator='memfd', socket_dir=path))
        good = []
        for shape in [(32, 32, 3), (20, 30), (1, 1, 3)]:
            loan = pool.loan()
            loan.ndarray('uint8', shape)[...] = np.random.default_rng(len(good)).integers(
                0, 256, shape, np.uint8)
            good.append(to_handle(loan.publish()))
        yield types.SimpleNamespace(pool=pool, good=good)
        pool.close()


@pytest.fixture(scope='module')
def node(vlm, frames):
    rclpy.init()
    llm = LLMNode(parameter_overrides=[
        Parameter('model.path', value=str(vlm)), Parameter('queue.depth', value=QUEUE_DEPTH),
        Parameter('max_tokens', value=3), Parameter('kv.max_context', value=CONTEXT)])
    assert llm.trigger_configure() == TransitionCallbackReturn.SUCCESS, llm.load_error
    assert llm.trigger_activate() == TransitionCallbackReturn.SUCCESS
    yield llm
    llm.release()
    llm.destroy_node()
    rclpy.shutdown()


def _copy(handle: TensorHandle, **changes) -> TensorHandle:
    made = TensorHandle()
    for field in ('pool_id', 'slot', 'generation', 'sequence', 'buffer_kind', 'dtype',
                  'shape', 'strides', 'byte_offset', 'nbytes'):
        setattr(made, field, changes.get(field, getattr(handle, field)))
    made.header = handle.header
    return made


@st.composite
def image_handles(draw, good) -> TensorHandle:
    """Draw a good frame, a good frame with one field spoiled, or a random descriptor."""
    kind = draw(st.sampled_from(['good', 'spoiled', 'random']))
    if kind == 'random':
        return draw(handles())
    handle = draw(st.sampled_from(good))
    if kind == 'good':
        return handle
    field, value = draw(st.sampled_from([
        ('generation', handle.generation + 7), ('slot', 3), ('pool_id', 'nobody_serves'),
        ('dtype', 'float32'), ('dtype', 'bogus'), ('shape', [0, 32, 3]),
        ('shape', [10000, 10000, 3]), ('shape', [32, 32, 4]), ('shape', [32, 32, 3, 1]),
        ('nbytes', 1), ('byte_offset', 2**40), ('strides', [1, 1, 1])]))
    return _copy(handle, **{field: value})


@st.composite
def image_goals(draw, good) -> Generate.Goal:
    images = draw(st.lists(image_handles(good), max_size=4))
    markers = draw(st.one_of(st.just(len(images)), st.integers(0, 5)))
    text = draw(st.one_of(st.just('Hello'), HOSTILE_TEXT))
    prompt = ' '.join([MEDIA_MARKER] * markers) + ' ' + text
    goal = Generate.Goal(images=images, max_tokens=draw(st.integers(1, 3)),
                         raw_prompt=draw(st.booleans()))
    if draw(st.booleans()):
        goal.prompt = prompt
    else:
        goal.messages = [ChatMessage(role='user', content=prompt)]
        goal.raw_prompt = False
        # A few sessions: their stored images come back in later turns, old turns (and
        # their images) are dropped when the context fills up.
        goal.session_id = draw(st.sampled_from(['', '', 'fuzz_a', 'fuzz_b']))
        goal.history_mode = draw(st.sampled_from([Generate.Goal.HISTORY_AUTO,
                                                  Generate.Goal.HISTORY_APPEND]))
    return goal


@fuzz(150)
@given(data=st.data())
def test_random_image_goals_are_refused_with_a_message_or_run(node, frames, data):
    goal = data.draw(image_goals(frames.good))
    event(bounded(lambda: _validate_and_run(node, goal), 90.0, 'prepare + run'))
    _reservations_all_free(node)


@pytest.mark.parametrize('markers', [3, 4])
def test_more_images_than_the_context_holds_are_refused(node, frames, markers):
    goal = Generate.Goal(prompt=MEDIA_MARKER * markers + ' Hi', raw_prompt=True, max_tokens=3,
                         images=[frames.good[0]] * markers)
    if markers * 64 + 8 <= CONTEXT:
        assert _validate_and_run(node, goal) == 'ran'
    else:
        with pytest.raises(InvalidRequestError, match='images take'):
            node.admission.prepare(goal, NodeGoal(None))
        _reservations_all_free(node)


def test_a_100_megapixel_declaration_is_refused_before_anything_is_mapped(node, frames):
    before = _peak_rss()
    goal = Generate.Goal(prompt=MEDIA_MARKER, raw_prompt=True, images=[_copy(
        frames.good[0], shape=[10000, 10000, 3], nbytes=300_000_000)])
    with pytest.raises(InvalidRequestError, match='megapixels'):
        node.admission.prepare(goal, NodeGoal(None))
    assert _peak_rss() - before < 64 << 20
    _reservations_all_free(node)
    # ... and the node still answers a good image.
    good = Generate.Goal(prompt=f'{MEDIA_MARKER} the', raw_prompt=True, max_tokens=2,
                         images=[frames.good[1]])
    assert _validate_and_run(node, good) == 'ran'
