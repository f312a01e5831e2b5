"""The perception node's time window (vision/window.py, ~/window): "what just happened?".

The index's rules are checked on their own (bounds, sampling, typed errors that say what is
held); then a real frame_source (synthetic 64x48 at 30 Hz) feeds a real perception node with
window.seconds 2, and the test resolves windows through its ~/window service: the handles map
(zero-copy, from the window pool) to the synthetic frames themselves, oldest first, within the
window, sampled as asked, with no pixels in the reply.
"""
import os
import time

from builtin_interfaces.msg import Time
import pytest
import rclpy
from rclpy.serialization import serialize_message
from vision_support import NodeProc

from edge_llm_msgs.srv import GetWindow
from edge_llm_ros.ipc.resolver import TensorResolver
from edge_llm_ros.nodes.handles import from_handle
from edge_llm_ros.vision import synthetic
from edge_llm_ros.vision.window import (
    FrameWindow, NS, window_frames, window_request, WindowBudgetError, WindowRangeError,
    WindowRequest, WindowRequestError)

TAG = f'w{os.getpid()}'
FRAMES_NODE, PERCEPTION_NODE = f'{TAG}_frames', f'{TAG}_perception'
WIDTH, HEIGHT, RATE, SECONDS, MAX_FRAMES = 64, 48, 30.0, 2.0, 90


def _filled(stamps_s, seconds=10.0, max_frames=100) -> FrameWindow:
    window = FrameWindow(seconds, max_frames)
    for i, t in enumerate(stamps_s):
        window.add(round(t * NS), i)
    return window


def _items(held) -> list:
    return [h.item for h in held]


def test_the_window_is_bounded_by_seconds_and_frames():
    window = _filled([i / 10 for i in range(50)], seconds=2.0)   # 10 Hz for 4.9 s
    count, oldest, newest = window.span()
    assert (count, oldest, newest) == (21, round(2.9 * NS), round(4.9 * NS))
    window = _filled([i / 10 for i in range(50)], seconds=60.0, max_frames=8)
    assert len(window) == 8 and window.span()[1] == round(4.2 * NS)
    # A clock stepping back starts the window again.
    out = window.add(0, 'restart')
    assert len(out) == 8 and _items(window.select(WindowRequest(0, 0))) == ['restart']
    assert window.drop(lambda item: item == 'restart') == 1 and len(window) == 0


def test_windows_select_oldest_first_sampled_by_rate_and_count():
    window = _filled([i / 10 for i in range(30)])                # 0.0 .. 2.9 s at 10 Hz
    assert _items(window.select(WindowRequest(round(1.0 * NS), round(1.5 * NS)))) == [
        10, 11, 12, 13, 14, 15]
    every = WindowRequest(0, round(2.9 * NS), fps=2.0)
    assert _items(window.select(every)) == [4, 9, 14, 19, 24, 29]   # 0.5 s apart, newest kept
    assert _items(window.select(WindowRequest(0, round(2.9 * NS), max_count=4))) == [
        0, 10, 19, 29]
    assert _items(window.select(WindowRequest(0, round(2.9 * NS), max_count=1))) == [29]


@pytest.mark.parametrize('request_, words', [
    (WindowRequest(round(5.0 * NS), round(6.0 * NS)), 'no frame between 5.000 s and 6.000 s'),
    (WindowRequest(round(-1.0 * NS), round(1.0 * NS)), 'before the oldest frame held'),
])
def test_a_window_past_what_is_held_says_what_is_held(request_, words):
    window = _filled([i / 10 for i in range(30)])
    with pytest.raises(WindowRangeError, match=words) as caught:
        window.select(request_)
    assert 'holds 30 frame(s) from 0.000 s to 2.900 s (2.90 s' in str(caught.value)
    with pytest.raises(WindowRangeError, match='holds no frame yet'):
        FrameWindow(1.0, 4).select(request_)


def test_requests_and_budgets_are_validated():
    now = 100 * NS
    assert window_request(2.0, 0, 0, 0.0, 0, now) == WindowRequest(98 * NS, now)
    assert window_request(0.0, 5 * NS, 0, 1.0, 3, now) == WindowRequest(5 * NS, now, 1.0, 3)
    for args, words in [((1.0, 5 * NS, 0, 0.0, 0), 'not both'), ((0.0, 0, 0, 0.0, 0), 'no window'),
                        ((0.0, 6 * NS, 5 * NS, 0.0, 0), 'before start'),
                        ((0.0, 5 * NS, 0, -1.0, 0), '>= 0')]:
        with pytest.raises(WindowRequestError, match=words):
            window_request(*args, now)
    assert window_frames(2.0, 150, 100 << 20, 921600, 9) == 104    # 640x480 RGB in 100 MiB
    assert window_frames(2.0, 60, 100 << 20, 921600, 9) == 60
    with pytest.raises(WindowBudgetError, match='raise window.max_mb to at least 8.8'):
        window_frames(2.0, 60, 8 << 20, 921600, 9)


@pytest.fixture(scope='module')
def socket_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp('window') / 'sockets')


@pytest.fixture(scope='module')
def pipeline(socket_dir):
    frames = NodeProc('frame_source', FRAMES_NODE, {
        'socket_dir': socket_dir, 'width': WIDTH, 'height': HEIGHT, 'rate_hz': RATE,
        'pool.id': f'{TAG}_frames'})
    perception = NodeProc('perception', PERCEPTION_NODE, {
        'socket_dir': socket_dir, 'input.topic': f'/{FRAMES_NODE}/frames',
        'pool.id': f'{TAG}_emb', 'engine.intra_op_threads': 1, 'model.image_size': 32,
        'window.seconds': SECONDS, 'window.max_frames': MAX_FRAMES})
    try:
        frames.wait_log('synthetic pattern', 30)
        perception.wait_log('window: the last', 60)
        yield frames, perception
    finally:
        codes = (frames.stop(), perception.stop())
    assert codes == (0, 0), f'{frames.log()}\n{perception.log()}'


@pytest.fixture(scope='module')
def ask(pipeline):
    rclpy.init()
    node = rclpy.create_node(f'{TAG}_client')
    client = node.create_client(GetWindow, f'/{PERCEPTION_NODE}/window')
    assert client.wait_for_service(timeout_sec=30)

    def call(**fields) -> GetWindow.Response:
        future = client.call_async(GetWindow.Request(**fields))
        rclpy.spin_until_future_complete(node, future, timeout_sec=10)
        assert future.done()
        return future.result()
    yield call
    node.destroy_node()
    rclpy.try_shutdown()


def _seconds(stamp) -> float:
    return stamp.sec + stamp.nanosec / NS


def test_the_last_second_resolves_to_the_frames_oldest_first(pipeline, ask, socket_dir):
    time.sleep(SECONDS + 0.5)        # the window fills
    asked_at = time.time()
    reply = ask(last_seconds=1.0)
    assert reply.success, reply.error_message
    # 30 Hz for 1 s on a loaded machine: most frames, none older than the window.
    assert 10 <= len(reply.frames) <= 32, len(reply.frames)
    stamps = [_seconds(h.header.stamp) for h in reply.frames]
    assert stamps == sorted(stamps) and asked_at - 1.2 <= stamps[0] and stamps[-1] <= asked_at
    assert {h.pool_id for h in reply.frames} == {f'{TAG}_emb_window'}
    assert len(serialize_message(reply)) < 250 * len(reply.frames)    # handles, no pixels
    assert 0 < reply.held_frames <= MAX_FRAMES
    assert _seconds(reply.held_newest) - _seconds(reply.held_oldest) <= SECONDS
    with TensorResolver(socket_dir=socket_dir, max_inflight=len(reply.frames)) as resolver:
        counters = []
        for handle in reply.frames:
            frame = resolver.resolve(from_handle(handle))
            assert frame.shape == (HEIGHT, WIDTH, 3) and not frame.flags.writeable
            counters.append(synthetic.check_frame(frame))   # the frame itself, untorn
            resolver.release(from_handle(handle))
    assert counters == sorted(set(counters)), counters


def test_llm_nodes_resolver_holds_several_window_frames_and_two_of_a_camera_ring(
        pipeline, ask, socket_dir):
    # The window pool grants nodes/embeddings' WINDOW_INFLIGHT holds; a camera ring refuses
    # them and its consumer falls back to MAX_INFLIGHT (what llm_node's goals rely on).
    from edge_llm_ros.nodes.embeddings import MAX_INFLIGHT, WINDOW_INFLIGHT
    reply = ask(last_seconds=1.0, max_frames=WINDOW_INFLIGHT)
    assert reply.success and len(reply.frames) == WINDOW_INFLIGHT, reply.error_message
    with TensorResolver(socket_dir=socket_dir, max_inflight=MAX_INFLIGHT,
                        try_inflight=WINDOW_INFLIGHT) as resolver:
        assert resolver.inflight(f'{TAG}_emb_window') == WINDOW_INFLIGHT
        assert resolver.inflight(f'{TAG}_frames') == MAX_INFLIGHT
        held = [resolver.resolve(from_handle(h)) for h in reply.frames]   # all at once
        assert [synthetic.check_frame(f) for f in held] == sorted(
            synthetic.check_frame(f) for f in held)
        for handle in reply.frames:
            resolver.release(from_handle(handle))


def test_windows_are_sampled_by_rate_and_count(pipeline, ask):
    every = ask(last_seconds=1.5, fps=4.0)
    assert every.success, every.error_message
    stamps = [_seconds(h.header.stamp) for h in every.frames]
    assert 4 <= len(stamps) <= 7 and all(b - a >= 0.249 for a, b in zip(stamps, stamps[1:]))
    four = ask(last_seconds=1.5, max_frames=4)
    assert four.success and len(four.frames) == 4
    # By stamps: from the oldest held frame to now.
    now = time.time()
    span = ask(start=Time(sec=int(now - 1.0), nanosec=int((now - 1.0) % 1 * NS)), max_frames=3)
    assert span.success and len(span.frames) == 3, span.error_message


@pytest.mark.parametrize('fields, words', [
    ({'last_seconds': 30.0}, 'before the oldest frame held'),
    ({'start': Time(sec=1), 'end': Time(sec=2)}, 'before the oldest frame held'),
    ({'last_seconds': 1.0, 'start': Time(sec=1)}, 'not both'),
    ({}, 'no window'),
])
def test_a_bad_window_is_a_typed_reply_that_says_what_is_held(pipeline, ask, fields, words):
    reply = ask(**fields)
    assert not reply.success and words in reply.error_message, reply.error_message
    assert reply.frames == [] and reply.held_frames > 0
    if 'held' in words:
        assert f'window.seconds {SECONDS:g}' in reply.error_message
    assert ask(last_seconds=0.5).success     # the node keeps serving
