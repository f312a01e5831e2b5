"""Video clips on Qwen2.5-VL and Qwen3-VL against llama.cpp's libmtmd (issue 40 items 3 and 6).

A clip (runtime.media.VideoClip: frames of one size, their timestamps, the fps) takes one
`<__media__>` marker. mtmd takes the same frames as one marker each, every bitmap marked
mergeable (test/mtmd_runner.py --mergeable): mtmd_tokenize merges two adjacent frames of one
size into one chunk (frame 0 through the patch embedding's first temporal kernel, frame 1
through the second), an odd last frame alone, and places each chunk like an image (M-RoPE).
The tiny random pairs are the ones test/test_vision_qwen.py and test/test_vision_qwen3.py
check still images on, with their stated tolerances.
"""
import json

from gguf_fixtures import write_gguf
from mmproj_fixtures import write_qwen25vl_mmproj, write_qwen3vl_mmproj
import numpy as np
import pytest
from test_vision_llm_parity import logprob_gap, mtmd_layout, mtmd_run
from test_vision_qwen import image, QWEN_LM
from test_vision_qwen3 import LOGPROB_OF_PEAK, MAX_OF_PEAK, MEAN_OF_PEAK, QWEN3_LM

from edge_llm_ros.runtime.media import ImageInputError, VideoClip
from edge_llm_ros.runtime.types import GenerationRequest, SamplingConfig

FAMILIES = {'qwen2vl': (QWEN_LM, write_qwen25vl_mmproj, 0.01),
            'qwen3vl': (QWEN3_LM, write_qwen3vl_mmproj, LOGPROB_OF_PEAK)}
SIZE = (150, 230)   # wide, resized (Qwen2.5-VL: 8 x 5 tokens a chunk; Qwen3-VL: 7 x 5)


@pytest.fixture(scope='module', params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """Return (name, text.gguf, mmproj.gguf, engine) of a tiny Qwen-VL pair, converted."""
    from edge_llm_ros.convert.converter import convert
    from edge_llm_ros.serving.engine import Engine, EngineConfig
    case, write_mmproj, _ = FAMILIES[request.param]
    work = tmp_path_factory.mktemp(request.param)
    text = write_gguf(work / 'text.gguf', case)
    mmproj = write_mmproj(work / 'mmproj.gguf', n_text=case.dims.hidden, seed=3)
    folder = convert(str(text), str(work / 'vlm'), mmproj=str(mmproj), progress=False)
    engine = Engine(EngineConfig(model_dir=str(folder), max_context=256, intra_op_threads=1,
                                 prefix_reuse=False))
    yield request.param, text, mmproj, engine
    engine.close()


def frames(n: int, size=SIZE):
    return [image(20 + j, *size) for j in range(n)]


def clip_of(n: int, size=SIZE) -> VideoClip:
    return VideoClip(tuple(frames(n, size)), tuple(0.5 * j for j in range(n)), 2.0)


def _within(name: str, ours: np.ndarray, theirs: np.ndarray) -> float:
    """Assert the family's stated tolerance (test_vision_qwen*.py); return the peak."""
    peak = float(np.abs(theirs).max())
    if name == 'qwen2vl':
        per_token = np.abs(ours - theirs).max(-1)
        assert float(per_token.max()) <= 2.5e-4 * peak
        assert np.mean(per_token <= 1e-4 * peak) >= 0.9
    else:
        diff = np.abs(ours - theirs)
        assert float(diff.max()) <= MAX_OF_PEAK * peak
        assert float(diff.mean()) <= MEAN_OF_PEAK * peak
    return peak


@pytest.mark.parametrize('n', [4, 3])
def test_clip_embeddings_match_mtmds_merged_frames(tmp_path, family, n):
    """4 frames: 2 chunks of 2; 3 frames: a chunk of 2, then the last frame alone."""
    name, text, mmproj, engine = family
    clip = clip_of(n)
    data = mtmd_run(text, mmproj, list(clip.frames), '<__media__>' * n, tmp_path, tokens=0,
                    extra=('--mergeable',))
    assert int(data['n_chunks']) == 2
    theirs = np.concatenate([data['embeds_0'], data['embeds_1']])
    ours = engine.vision.encode_clip(clip).rows
    assert ours.shape == theirs.shape
    peak = _within(name, ours, theirs)
    # The second frame is seen: frame 0 as a still image (twice) is far from the first chunk.
    still = engine.vision.encode(clip.frames[0]).rows
    half = still.shape[0]
    assert float(np.abs(still - ours[:half]).max()) > 25 * 4e-4 * peak
    if n == 3:   # the odd last frame is a still image of itself
        assert np.array_equal(ours[half:], engine.vision.encode(clip.frames[2]).rows)


@pytest.mark.parametrize('n', [4, 3])
def test_a_clip_question_decodes_as_mtmd(tmp_path, family, n, compat):
    name, text, mmproj, engine = family
    case, _, of_peak = FAMILIES[name]
    compat(name, case.wtype, 'vision')
    clip = clip_of(n)
    data = mtmd_run(text, mmproj, list(clip.frames), 'Hi ' + '<__media__>' * n + ' the sky is',
                    tmp_path, extra=('--mergeable',))
    prepared = engine.prepare(GenerationRequest(prompt='Hi <__media__> the sky is',
                                                use_chat_template=False, images=[clip],
                                                max_tokens=32))
    assert (list(prepared.prompt_ids), list(prepared.spans)) == mtmd_layout(data)
    assert prepared.grids == ((7 if name == 'qwen3vl' else 8, 5),) * 2
    result = engine.generate(GenerationRequest(
        prompt='Hi <__media__> the sky is', use_chat_template=False, images=[clip],
        max_tokens=32, sampling=SamplingConfig(logprobs=True, top_logprobs=4))).run_to_end()
    assert result.error == ''
    assert result.token_ids == [int(t) for t in data['tokens']]
    assert logprob_gap(result, data['logits']) <= of_peak * float(np.abs(data['logits']).max())


def _refused(engine, clip, match, **kw):
    with pytest.raises(ImageInputError, match=match):
        engine.prepare(GenerationRequest(prompt='<__media__> what happened?',
                                         use_chat_template=False, images=[clip], max_tokens=8,
                                         **kw))


def test_bad_clips_are_refused_before_any_model_work_and_text_still_runs(family):
    _, _, _, engine = family
    mixed = frames(3)
    mixed[1] = image(9, 100, 100)
    _refused(engine, VideoClip(tuple(mixed), (0.0, 0.5, 1.0)),
             r'frames\[1\] is 100x100, but frames\[0\] is 230x150')
    _refused(engine, VideoClip(tuple(frames(3)), (0.0, 1.0, 0.5)),
             r'out of order: frames\[2\] at 0.5 s is not after frames\[1\] at 1 s')
    _refused(engine, VideoClip(tuple(frames(2)), (0.0, 0.0)), 'out of order')
    _refused(engine, VideoClip(tuple(frames(2)), (0.0,)), '1 timestamps for 2 frames')
    _refused(engine, VideoClip(tuple(frames(2)), (0.0, 1.0), fps=-1), 'fps must be')
    _refused(engine, VideoClip((), ()), 'without frames')
    # The cap is per chunk (2 frames placed like one image): 40 or 35 tokens each.
    per_chunk = engine.prepare(GenerationRequest(
        prompt='<__media__>', use_chat_template=False, images=[clip_of(4)],
        max_tokens=8)).spans[0][1]
    _refused(engine, clip_of(4), f'every 2 frames take {per_chunk} tokens, over '
                                 f'max_image_tokens {per_chunk - 1}',
             max_image_tokens=per_chunk - 1)
    assert engine.prepare(GenerationRequest(
        prompt='<__media__>', use_chat_template=False, images=[clip_of(4)], max_tokens=8,
        max_image_tokens=per_chunk)).prompt_tokens > 2 * per_chunk
    result = engine.generate(GenerationRequest(prompt='the sky', use_chat_template=False,
                                               max_tokens=3)).run_to_end()
    assert result.error == '' and result.completion_tokens == 3


def test_a_model_without_temporal_merge_refuses_a_clip(tmp_path):
    """gemma3 (and every non-Qwen-VL family): llama.cpp's n_temporal_merge is 1."""
    from gguf_fixtures import ParityCase
    from mmproj_fixtures import write_mmproj
    from edge_llm_ros.convert.converter import convert
    from edge_llm_ros.serving.engine import Engine, EngineConfig
    text = write_gguf(tmp_path / 'text.gguf', ParityCase(arch='llama', wtype='F32',
                                                         vision=True))
    mmproj = write_mmproj(tmp_path / 'gemma3.gguf', 'gemma3', n_text=256, seed=11)
    folder = convert(str(text), str(tmp_path / 'vlm'), mmproj=str(mmproj), progress=False)
    engine = Engine(EngineConfig(model_dir=str(folder), max_context=256, intra_op_threads=1))
    try:
        _refused(engine, clip_of(2, (32, 32)), r'gemma3\) has no temporal merge')
        result = engine.generate(GenerationRequest(
            prompt='<__media__> the sky', use_chat_template=False, images=[image(3, 32, 32)],
            max_tokens=3)).run_to_end()
        assert result.error == '' and result.completion_tokens == 3
    finally:
        engine.close()


def _write_mp4(path, n: int, rate: int = 10, height: int = 144, width: int = 224) -> None:
    """Write n random frames at `rate` fps (PyAV, mpeg4 in mp4)."""
    import av
    with av.open(str(path), 'w') as container:
        stream = container.add_stream('mpeg4', rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, 'yuv420p'
        for j in range(n):
            frame = av.VideoFrame.from_ndarray(image(40 + j, height, width), format='rgb24')
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_a_video_file_is_sampled_at_its_fps_and_capped(tmp_path):
    from edge_llm_ros.runtime.video_file import read_clip
    _write_mp4(tmp_path / 'clip.mp4', 6)   # 0.0, 0.1, ... 0.5 s
    clip = read_clip(tmp_path / 'clip.mp4', fps=5)
    assert np.allclose(clip.timestamps, [0.0, 0.2, 0.4]) and clip.fps == 5
    assert all(f.shape == (144, 224, 3) and f.dtype == np.uint8 for f in clip.frames)
    assert len(read_clip(tmp_path / 'clip.mp4', fps=0).frames) == 6
    assert np.allclose(read_clip(tmp_path / 'clip.mp4', fps=0, max_frames=4).timestamps,
                       [0.0, 0.1, 0.2, 0.3])
    (tmp_path / 'broken.mp4').write_bytes(b'\x00\x01 not a video ' * 64)
    with pytest.raises(ImageInputError, match='cannot be decoded'):
        read_clip(tmp_path / 'broken.mp4')


def test_generate_with_a_video_answers_as_the_engine_does(tmp_path, family):
    """`edge-llm generate --video clip.mp4 --fps 5`: 3 frames, 2 chunks, the engine's ids."""
    from test_cli import edge_llm
    from edge_llm_ros.runtime.video_file import read_clip
    _, _, _, engine = family
    _write_mp4(tmp_path / 'clip.mp4', 6)
    prompt = 'Hi <__media__> the sky is'
    proc = edge_llm('generate', prompt, '--raw', '--model', str(engine.model_dir), '--video',
                    str(tmp_path / 'clip.mp4'), '--fps', '5', '--max-tokens', '6', '--json',
                    '--max-context', '256')
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    clip = read_clip(tmp_path / 'clip.mp4', fps=5)
    expected = engine.generate(GenerationRequest(prompt=prompt, use_chat_template=False,
                                                 images=[clip], max_tokens=6)).run_to_end()
    assert out['token_ids'] == expected.token_ids and out['error'] == ''
    assert out['prompt_tokens'] == expected.prompt_tokens
    proc = edge_llm('generate', prompt, '--raw', '--model', str(engine.model_dir), '--video',
                    str(tmp_path / 'missing.mp4'), '--max-context', '256')
    assert proc.returncode == 2 and 'missing.mp4' in proc.stderr


# ---- interface version 8: the clip on a Generate goal -------------------------------------
def test_version_8_clip_fields_travel_as_handles_and_round_trip_a_bag(tmp_path, monkeypatch):
    """make_goal -> described handles -> a VideoClip request -> held frames; bag and replay."""
    from regression_helpers import handle, transcript, write_transcript_bag
    from edge_llm_msgs.action import Generate
    from edge_llm_msgs.msg import Transcript
    from edge_llm_ros.client import make_goal
    from edge_llm_ros.nodes.embeddings import EmbeddingResolver
    from edge_llm_ros.nodes.handles import image_pool
    from edge_llm_ros.nodes.messages import goal_media, RequestDefaults, to_request
    from edge_llm_ros.regression import bagio
    from edge_llm_ros.regression.replay import goal_fields
    from edge_llm_ros.runtime.media import DeclaredImage
    from edge_llm_ros.runtime.request import PreparedRequest
    assert Generate.Goal.INTERFACE_VERSION == Transcript.INTERFACE_VERSION == 9
    old = Generate.Goal(prompt='hi')   # an older goal: no clip
    assert list(old.video_frames) == [] and to_request(old, RequestDefaults()).images == ()
    monkeypatch.setenv('EDGE_LLM_IPC_DIR', str(tmp_path / 'sockets'))
    still, clip = image(1, 6, 5), frames(3, (4, 8))
    with image_pool([still, *clip], 'video_test') as handles:
        goal = make_goal('<__media__><__media__> what happened?', images=handles[:1],
                         video_frames=handles[1:], video_timestamps=[0.0, 0.5, 1.0],
                         video_fps=2.0)
        resolver = EmbeddingResolver()
        try:
            described = resolver.describe_images(list(goal.images) + list(goal.video_frames))
            request = to_request(goal, RequestDefaults(),
                                 images=goal_media(goal, described.declared))
            assert request.images == (DeclaredImage(6, 5), VideoClip(
                (DeclaredImage(4, 8),) * 3, (0.0, 0.5, 1.0), 2.0))
            prepared = PreparedRequest(prompt_ids=(1,), max_tokens=1,
                                       sampling=SamplingConfig(), stop=(), constraint=None,
                                       session_id='', act_dtype=np.dtype(np.float32),
                                       images=tuple(request.images))
            assert not prepared.bound   # the clip's frames wait for their mapping
            with resolver.hold_images(described.descriptors, 1) as views:
                bound = prepared.with_frames(views)
                assert bound.bound and np.array_equal(bound.images[0], still)
                assert all(np.array_equal(a, b) for a, b in zip(bound.images[1].frames, clip))
                with pytest.raises(ImageInputError, match='mapped as'):
                    prepared.with_frames([views[0], views[1][:2] + [views[0]]])
        finally:
            resolver.close()
    msg = transcript('<__media__> what happened?')
    msg.video_frames = [handle('cam0'), handle('cam0')]
    msg.video_timestamps, msg.video_fps = [0.0, 0.5], 2.0
    record, = bagio.read_bag(write_transcript_bag(tmp_path / 'v8', [msg])).transcripts
    assert record.interface_version == 9 and record.video_timestamps == [0.0, 0.5]
    assert record.video_fps == 2.0 and len(record.tensor_handles) == 2
    resent = make_goal(**goal_fields(record))
    assert [h.pool_id for h in resent.video_frames] == ['cam0', 'cam0']
    assert list(resent.video_timestamps) == [0.0, 0.5] and resent.video_fps == 2.0


def test_a_session_turn_after_a_stored_clip_keeps_its_positions(family):
    """The second turn reads the stored clip's rows and grid: as the whole chat at once."""
    from edge_llm_ros.runtime.types import ChatMessage
    from edge_llm_ros.serving.engine import Engine, EngineConfig
    _, _, _, made = family
    engine = Engine(EngineConfig(model_dir=str(made.model_dir), max_context=256,
                                 intra_op_threads=1))
    clip, look = clip_of(3), 'What happened in <__media__> this clip?'
    greedy = SamplingConfig(logprobs=True, top_logprobs=4)

    def ask(messages, images=(), session='', **kw):
        return engine.generate(GenerationRequest(
            messages=messages, images=list(images), max_tokens=12, session_id=session,
            sampling=greedy, **kw)).run_to_end()
    try:
        first = ask([ChatMessage('user', look)], [clip], 'clip', choices=('a red box', 'blue'))
        second = ask([ChatMessage('user', 'And the color?')], session='clip')
        assert first.error == '' and second.error == ''
        assert second.timings.cached_prompt_tokens > 0
        whole = ask([ChatMessage('user', look), ChatMessage('assistant', first.text),
                     ChatMessage('user', 'And the color?')], [clip])
        assert second.token_ids == whole.token_ids
        assert max(abs(a.logprob - b.logprob)
                   for a, b in zip(second.logprobs, whole.logprobs)) < 1e-3
    finally:
        engine.close()
