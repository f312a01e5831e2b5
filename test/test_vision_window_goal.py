"""A Generate goal that names a time window: "what just happened?" (issue 40 item 3).

A real frame_source (synthetic 64x48 frames, each carrying its counter) feeds a real perception
node holding a 4 s window; a real llm_node serves the tiny random Qwen2.5-VL pair. A goal names
the window (video_window_source / _seconds / _max_frames, interface version 9) instead of
handles: llm_node asks perception's ~/window itself, takes the frames as the goal's clip and
answers as Engine.generate does for a VideoClip of those very frames (mapped from the handles
the transcript records, checked untorn), with their stamps as timestamps, oldest first, the
newest among them. Bad windows (an unknown node, a node holding no frame, a window past what
is held, seconds <= 0, too many frames, a window beside video_frames) end invalid_request
before any model work, and the node keeps serving; a model without video support refuses the
window before any frame is asked for. `edge-llm ask --window --perception` sends one.
"""
import os
import subprocess
import sys
import time

from gguf_fixtures import ParityCase, write_gguf
from llm_node_harness import NodeProcess, RosClient
from mmproj_fixtures import write_qwen25vl_mmproj
import numpy as np
import pytest
import rclpy
from vision_support import NodeProc

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import Transcript
from edge_llm_ros.client import VideoWindow
from edge_llm_ros.ipc.resolver import TensorResolver
from edge_llm_ros.nodes.handles import from_handle
from edge_llm_ros.runtime.media import ImageInputError, MEDIA_MARKER, VideoClip
from edge_llm_ros.runtime.types import GenerationRequest
from edge_llm_ros.vision import synthetic

pytestmark = pytest.mark.timeout(600)
TAG = f'wg{os.getpid()}'
LLM, PERCEPTION, IDLE = f'{TAG}_llm', f'{TAG}_perception', f'{TAG}_idle'
WIDTH, HEIGHT, RATE, SECONDS = 64, 48, 5.0, 4.0
PROMPT = f'{MEDIA_MARKER} what just happened?'
TOKENS = 6
INVALID = Generate.Result.ERROR_INVALID_REQUEST
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def world(tmp_path_factory):
    work = tmp_path_factory.mktemp('window_goal')
    case = ParityCase(arch='qwen2vl', wtype='F32', vision='qwen', chain=0.1)
    text = write_gguf(work / 'text.gguf', case)
    mmproj = write_qwen25vl_mmproj(work / 'mmproj.gguf', n_text=case.dims.hidden, seed=3)
    from edge_llm_ros.convert.converter import convert
    folder = convert(str(text), str(work / 'vlm'), mmproj=str(mmproj), progress=False)
    sockets = str(work / 'sockets')
    env = {'EDGE_LLM_IPC_DIR': sockets}
    procs = [
        NodeProc('frame_source', f'{TAG}_frames', {
            'width': WIDTH, 'height': HEIGHT, 'rate_hz': RATE, 'pool.id': f'{TAG}_frames'},
            env),
        NodeProc('perception', PERCEPTION, {
            'input.topic': f'/{TAG}_frames/frames', 'pool.id': f'{TAG}_emb',
            'engine.intra_op_threads': 1, 'model.image_size': 32,
            'window.seconds': SECONDS, 'window.max_frames': 60}, env),
        # A window that never gets a frame (its topic has no publisher).
        NodeProc('perception', IDLE, {
            'input.topic': f'/{TAG}_nothing', 'pool.id': f'{TAG}_idle',
            'engine.intra_op_threads': 1, 'model.image_size': 32, 'window.seconds': SECONDS},
            env),
    ]
    llm = NodeProcess(LLM, {'autostart': True, 'model.path': str(folder),
                            'kv.max_context': 256, 'vision.window_timeout_s': 1.5}, env=env)
    rclpy.init()
    ros = RosClient(f'{TAG}_client')
    try:
        procs[1].wait_log('window: the last', 120)
        ros.wait_state('/' + LLM, 'active', timeout=180)
        transcripts = ros.record(Transcript, f'/{LLM}/transcript')
        yield folder, sockets, ros, transcripts, llm
    finally:
        ros.close()
        rclpy.try_shutdown()
        codes = [p.stop() for p in procs] + [llm.stop()]
        assert codes == [0, 0, 0, 0], '\n'.join([p.log() for p in procs] + [llm.log()])


def _stamp(header) -> float:
    return header.stamp.sec + header.stamp.nanosec * 1e-9


def _record_of(transcripts, text: str, timeout: float = 30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = [t for t in list(transcripts) if t.prompt == text]
        if found:
            return found[-1]
        time.sleep(0.05)
    raise AssertionError(f'no transcript of {text!r}')


def test_a_goal_naming_a_window_answers_about_its_newest_frames(world):
    folder, sockets, ros, transcripts, _ = world
    from edge_llm_ros.serving.engine import Engine, EngineConfig
    time.sleep(3.0)   # more than the 2 s asked for in the window (it holds up to 4 s)
    prompt = f'{PROMPT} ({TAG} 1)'
    sent = time.time()
    outcome = ros.llm('/' + LLM).generate(
        prompt, video_window=VideoWindow(f'/{PERCEPTION}', 2.0, 4), video_fps=2.0,
        raw_prompt=True, max_tokens=TOKENS, temperature=0.0).result(timeout=300)
    answered = time.time()
    assert outcome.ok, outcome.error_message
    record = _record_of(transcripts, prompt)
    # Recorded as the clip the window resolved to, beside the window it came from.
    assert record.video_window_source == f'/{PERCEPTION}'
    assert record.video_window_seconds == 2.0 and record.video_window_max_frames == 4
    frames = list(record.video_frames)
    assert 2 <= len(frames) <= 4 and {h.pool_id for h in frames} == {f'{TAG}_emb_window'}
    stamps = [_stamp(h.header) for h in frames]
    assert list(record.video_timestamps) == pytest.approx([s - stamps[0] for s in stamps])
    assert all(b - a >= 0.49 for a, b in zip(stamps, stamps[1:]))   # sampled at 2 fps
    # The newest frames: taken when the goal was accepted, within the last 2 s.
    assert sent - 2.5 <= stamps[0] and sent - 1.0 < stamps[-1] <= answered
    assert record.video_fps == 2.0
    # The frames themselves (the pool's 69 slots keep them ~14 s): the engine's answer for them.
    with TensorResolver(socket_dir=sockets, max_inflight=len(frames)) as resolver:
        pixels = [np.array(resolver.resolve(from_handle(h))) for h in frames]
        for h in frames:
            resolver.release(from_handle(h))
    counters = [synthetic.check_frame(p) for p in pixels]
    assert counters == sorted(set(counters)), counters   # oldest first, distinct frames
    engine = Engine(EngineConfig(model_dir=str(folder), max_context=256, intra_op_threads=1,
                                 prefix_reuse=False))
    try:
        clip = VideoClip(tuple(pixels), tuple(record.video_timestamps), 2.0)
        want = engine.generate(GenerationRequest(prompt=prompt, images=[clip],
                                                 use_chat_template=False,
                                                 max_tokens=TOKENS)).run_to_end()
    finally:
        engine.close()
    assert want.error == ''
    assert outcome.token_ids == want.token_ids
    assert outcome.prompt_tokens == want.prompt_tokens


@pytest.mark.parametrize('window, extra, words', [
    ((f'/{TAG}_nobody', 1.0), {}, f'no service /{TAG}_nobody/window'),
    ((f'/{IDLE}', 1.0), {}, 'holds no frame yet'),
    ((f'/{PERCEPTION}', 30.0), {}, 'before the oldest frame held'),
    ((f'/{PERCEPTION}', 0.0), {}, 'video_window_seconds is 0'),
    ((f'/{PERCEPTION}', -1.0), {}, 'video_window_seconds is -1'),
    ((f'/{PERCEPTION}', 1.0, 9), {}, 'video_window_max_frames is 9'),
    ((f'/{PERCEPTION}', 1.0), {'frames': True}, 'either the handles or the window'),
], ids=['unknown-node', 'empty-window', 'past-what-is-held', 'zero-seconds',
        'negative-seconds', 'too-many-frames', 'beside-video-frames'])
def test_a_bad_window_ends_invalid_before_model_work_and_the_node_keeps_serving(
        world, window, extra, words):
    _, _, ros, _, _ = world
    llm = ros.llm('/' + LLM)
    if extra:   # a handle of any pool: refused before it is looked at
        from regression_helpers import handle
        extra = {'video_frames': [handle('cam0')], 'video_timestamps': [0.0]}
    refused = llm.generate(PROMPT, video_window=window, raw_prompt=True, max_tokens=TOKENS,
                           **extra).result(timeout=120)
    assert refused.status == 'aborted' and refused.error_kind == INVALID, refused
    assert words in refused.error_message, refused.error_message
    assert refused.prompt_tokens == 0 and refused.token_ids == []   # no model work
    served = llm.generate('the sky', raw_prompt=True, max_tokens=2).result(timeout=120)
    assert served.ok, served


def test_a_goal_cancelled_while_it_waits_for_its_window_is_cancelled(world):
    _, _, ros, _, _ = world
    llm = ros.llm('/' + LLM)
    handle = llm.generate(PROMPT, video_window=(f'/{TAG}_nobody', 1.0), raw_prompt=True,
                          max_tokens=TOKENS)
    time.sleep(0.3)
    handle.cancel()
    outcome = handle.result(timeout=60)
    assert outcome.status == 'canceled' and outcome.finish_reason == 'cancelled', outcome
    assert llm.generate('the sky', raw_prompt=True, max_tokens=2).result(timeout=120).ok


def test_ask_window_sends_the_perception_nodes_last_seconds(world):
    _, sockets, _, transcripts, _ = world
    prompt = f'What just happened? ({TAG} ask)'
    env = dict(os.environ, EDGE_LLM_IPC_DIR=sockets,
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get('PYTHONPATH'))
                                          if p))
    proc = subprocess.run(
        [sys.executable, '-c', 'import sys; from edge_llm_ros.cli import main; '
         'sys.exit(main())', 'ask', f'{MEDIA_MARKER}{prompt}', '--server', '/' + LLM,
         '--window', '1.5',
         '--perception', f'/{PERCEPTION}', '--fps', '2', '--max-frames', '2', '--raw',
         '--max-tokens', '3', '--temperature', '0'],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    record = _record_of(transcripts, f'{MEDIA_MARKER}{prompt}')
    assert record.video_window_source == f'/{PERCEPTION}' and len(record.video_frames) == 2
    assert record.error_message == '' and record.finish_reason in ('stop', 'length')


def test_a_model_without_video_support_refuses_a_window_before_asking_for_frames(tmp_path):
    """Engine.check_video: what llm_node asks before it calls any ~/window."""
    from edge_llm_ros.convert.converter import convert
    from edge_llm_ros.serving.engine import Engine, EngineConfig
    text = write_gguf(tmp_path / 'text.gguf', ParityCase(arch='llama', wtype='F32'))
    folder = convert(str(text), str(tmp_path / 'text'), progress=False)
    engine = Engine(EngineConfig(model_dir=str(folder), max_context=64, intra_op_threads=1))
    try:
        with pytest.raises(ImageInputError, match='no vision encoder'):
            engine.check_video("the goal's video window")
    finally:
        engine.close()


def test_version_9_window_fields_round_trip_a_bag_and_replay_resends_the_clip(tmp_path):
    from regression_helpers import handle, transcript, write_transcript_bag
    from edge_llm_ros.client import make_goal
    from edge_llm_ros.nodes.llm_window import window_ask
    from edge_llm_ros.regression import bagio
    from edge_llm_ros.regression.records import INTERFACE_VERSION
    from edge_llm_ros.regression.replay import goal_fields
    assert Generate.Goal.INTERFACE_VERSION == Transcript.INTERFACE_VERSION == 9
    assert INTERFACE_VERSION == 9
    old = Generate.Goal(prompt='hi')   # an older goal names no window
    assert old.video_window_source == '' and window_ask(old) is None
    goal = make_goal(PROMPT, video_window=('/perception', 2.5), video_fps=2.0)
    ask = window_ask(goal)
    assert (ask.service, ask.seconds, ask.fps, ask.max_frames) == (
        '/perception/window', 2.5, 2.0, 8)
    msg = transcript(PROMPT)
    msg.video_window_source, msg.video_window_seconds = '/perception', 2.5
    msg.video_frames = [handle('cam_window'), handle('cam_window')]
    msg.video_timestamps, msg.video_fps = [0.0, 0.5], 2.0
    record, = bagio.read_bag(write_transcript_bag(tmp_path / 'v9', [msg])).transcripts
    assert record.interface_version == 9 and record.video_window_source == '/perception'
    assert record.video_window_seconds == 2.5 and record.video_timestamps == [0.0, 0.5]
    resent = make_goal(**goal_fields(record))   # the clip it saw, not "the last 2.5 s now"
    assert resent.video_window_source == '' and len(resent.video_frames) == 2
    assert list(resent.video_timestamps) == [0.0, 0.5] and resent.video_fps == 2.0
