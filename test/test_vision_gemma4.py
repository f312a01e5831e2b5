"""Gemma 4 vision (mmproj `gemma4v`) against llama.cpp's libmtmd: encoder, resize and prompt.

A tiny random gemma4v mmproj (test/mmproj_fixtures.py: patch 4, 3 x 3 pooling, the clamps of
Gemma4ClippableLinear on three matrices, no use_gelu, as llama.cpp's converter writes it)
beside a tiny gemma4 text GGUF (gguf_fixtures.Gemma4Case with `<|image>` / `<image|>` in its
vocabulary). llama.cpp's own multimodal library (test/mtmd_runner.py in the peer venv)
resizes, encodes and evaluates the same images; ours is convert/vision_gemma4.py's graph fed
by runtime/mmproj_gemma4.py, then the engine.

Encoder tolerance (Qwen2.5-VL's rule): 90 % of the tokens within 1e-4 x the embeddings' peak
in every value, every value within 2.5e-4 x the peak. Measured on the sizes below: 0.8-1.5e-4
at most, mean 8.4-8.7e-6 of the peak (98-100 % of the tokens within 1e-4); another image is
over 1e-2 away; the same file without its clamps is far off (the check sees them).

Language model: the engine lays the prompt out as mtmd's chunks and its 32 greedy ids equal
mtmd's. chain 0.05 (the head's next-token term) lets the image steer the path: another image
changes mtmd's ids within 1-5 tokens in two of the cases and moves its logits by 20 of a
16 peak. Log probs within 1.5 % of mtmd's peak logit (measured 0.11-0.16 of 14-16). The
tiny model is 256 wide, so mtmd makes its images bidirectional (mtmd_decode_use_non_causal:
every gemma4v width but E2B's 1536 and E4B's 2560): causal images instead leave mtmd's path
(measured log prob gaps of 1-24).
"""
import dataclasses
import logging
import pathlib

from gguf_fixtures import Gemma4Case, write_gemma4_gguf
from mmproj_fixtures import write_gemma4v_mmproj
import numpy as np
import onnxruntime as ort
import pytest
from test_vision_qwen import image, mtmd
import yaml

from edge_llm_ros.convert.converter import convert
from edge_llm_ros.convert.mmproj import AudioTowerError, MmprojError, read_mmproj
from edge_llm_ros.convert.vision_graph import build_encoder, image_attention, model_yaml_section
from edge_llm_ros.runtime.mmproj_gemma4 import encoder_inputs
from edge_llm_ros.runtime.mmproj_preprocess import grid_for, preprocess
from edge_llm_ros.runtime.mmproj_qwen import smart_size

TEXT = Gemma4Case('Q8_0', vision=True, chain=0.05)
PEAK_ALL, PEAK_MOST, MOST = 2.5e-4, 1e-4, 0.9
LOGPROB_OF_PEAK = 0.015


@pytest.fixture(scope='module')
def gemma4_pair(tmp_path_factory):
    work = tmp_path_factory.mktemp('gemma4v')
    text = write_gemma4_gguf(work / 'text.gguf', TEXT)
    mmproj = write_gemma4v_mmproj(work / 'mmproj.gguf', n_text=TEXT.hidden, seed=3)
    return text, mmproj


def embeddings_of(mm, img: np.ndarray) -> np.ndarray:
    """Return our encoder's rows of an image for a read mmproj (resize, RoPE tables, graph)."""
    vision = model_yaml_section(mm, 'vision.onnx')
    session = ort.InferenceSession(build_encoder(mm).SerializeToString(),
                                   providers=['CPUExecutionProvider'])
    (resized,) = preprocess(img, vision).tiles
    (out,) = session.run(None, {'pixels': resized[None], **encoder_inputs(resized, vision)})
    return out[0]


def our_embeddings(mmproj, img: np.ndarray) -> np.ndarray:
    return embeddings_of(read_mmproj(mmproj), img)


@pytest.mark.parametrize('height, width', [
    (120, 120),   # square: 30 x 30 patches, 10 x 10 tokens, no resize
    (90, 200),    # wide, resized to 96 x 204 (letterboxed)
    (97, 131),    # odd sides, resized to 96 x 132
    (300, 40),    # tall, resized to 300 x 36
])
def test_image_embeddings_match_llamacpps_mtmd(tmp_path, gemma4_pair, height, width):
    text, mmproj = gemma4_pair
    img = image(7, height, width)
    data = mtmd(text, mmproj, img, tmp_path)
    assert int(data['n_chunks']) == 1
    theirs, ours = data['embeds_0'], our_embeddings(mmproj, img)
    cols, rows, _ = grid_for(height, width, model_yaml_section(read_mmproj(mmproj), 'v'))
    assert ours.shape == theirs.shape == (cols * rows, TEXT.hidden)
    peak = float(np.abs(theirs).max())
    per_token = np.abs(ours - theirs).max(-1)
    assert float(per_token.max()) <= PEAK_ALL * peak
    assert np.mean(per_token <= PEAK_MOST * peak) >= MOST
    other = our_embeddings(mmproj, image(8, height, width))
    assert float(np.abs(other - theirs).max()) > 100 * PEAK_MOST * peak


@pytest.mark.parametrize('height, width', [(120, 120), (97, 131)])
def test_an_f16_mmproj_matches_mtmd_within_its_rounding_noise(
        tmp_path, gemma4_pair, height, width):
    """Every matrix F16 (mmproj-F16 files): ggml rounds the activations to fp16 before each.

    Measured 6.4-8.8e-4 of the peak at most, mean 1.0-1.2e-4 (square, wide, odd, tall), as
    Qwen3-VL's F16 file (test_vision_qwen3.py, whose bounds these are: the fp16 activations
    flip whole steps where float32 noise crosses a boundary); another image is 0.25 of the
    peak away on average.
    """
    text, _ = gemma4_pair
    mmproj = write_gemma4v_mmproj(tmp_path / 'f16.gguf', n_text=TEXT.hidden, seed=3,
                                  weight_type='F16')
    img = image(7, height, width)
    theirs, ours = mtmd(text, mmproj, img, tmp_path)['embeds_0'], our_embeddings(mmproj, img)
    peak = float(np.abs(theirs).max())
    diff = np.abs(ours - theirs)
    assert float(diff.max()) <= 1e-3 * peak and float(diff.mean()) <= 1.5e-4 * peak
    other = our_embeddings(mmproj, image(8, height, width))
    assert float(np.abs(other - theirs).mean()) > 30 * 1.5e-4 * peak


def test_the_clamps_are_seen(tmp_path, gemma4_pair):
    """The same weights without their clamp limits are far from mtmd's clamped embeddings."""
    text, mmproj = gemma4_pair
    img = image(7, 120, 120)
    theirs = mtmd(text, mmproj, img, tmp_path)['embeds_0']
    free = write_gemma4v_mmproj(tmp_path / 'free.gguf', n_text=TEXT.hidden, seed=3,
                                clamps=False)
    peak = float(np.abs(theirs).max())
    assert float(np.abs(our_embeddings(free, img) - theirs).max()) > 100 * PEAK_MOST * peak


@pytest.mark.parametrize('height, width', [
    (10, 10),       # under the 70-token minimum: scaled up
    (20, 300),      # a thin strip
    (480, 640),     # VGA: over 1120 tokens, scaled down
    (3000, 41),     # tall and thin, over the limit
    (333, 517),     # odd sides
])
def test_the_resize_to_multiples_of_patch_x_3_gives_mtmds_token_counts(
        tmp_path, gemma4_pair, height, width):
    text, mmproj = gemma4_pair
    data = mtmd(text, mmproj, np.zeros((height, width, 3), np.uint8), tmp_path,
                '--layout-only')
    vision = model_yaml_section(read_mmproj(mmproj), 'vision.onnx')
    cols, rows, tiles = grid_for(height, width, vision)
    types = list(data['chunk_types'])
    assert types.count(1) == 1 and tiles == 1
    assert int(data[f'chunk_{types.index(1)}'][0]) == cols * rows
    h, w = smart_size(height, width, 4, 70, 1120, merge=3)
    assert (h % 12, w % 12) == (0, 0) and 70 <= cols * rows <= 1120


def test_e2b_and_e4b_widths_make_causal_images(gemma4_pair):
    """As mtmd_decode_use_non_causal: 1536 and 2560 wide causal, the others bidirectional."""
    mm = read_mmproj(gemma4_pair[1])
    for width, attention in ((1536, 'causal'), (2560, 'causal'), (256, 'bidirectional'),
                             (3840, 'bidirectional')):
        wide = dataclasses.replace(mm, config=dataclasses.replace(mm.config, n_out=width))
        assert image_attention(wide) == attention
        assert model_yaml_section(wide, 'v')['attention'] == attention


@pytest.mark.parametrize('skip', [('v.blk.1.attn_k_norm.weight',), ('v.position_embd.weight',),
                                  ('v.blk.0.ffn_gate.weight',)])
def test_a_gemma4v_mmproj_without_a_tensor_it_needs_is_refused(tmp_path, skip):
    bad = write_gemma4v_mmproj(tmp_path / 'bad.gguf', skip=skip)
    with pytest.raises(MmprojError, match=skip[0].replace('.', r'\.')):
        read_mmproj(bad)


# --- the audio tower -------------------------------------------------------------------------
def test_an_audio_tower_is_refused_by_name_before_anything_is_written(
        tmp_path, gemma4_pair, native_library):
    from edge_llm_ros.convert.check import check_source
    text, _ = gemma4_pair
    mmproj = write_gemma4v_mmproj(tmp_path / 'av.gguf', n_text=TEXT.hidden, seed=3, audio=True)
    with pytest.raises(AudioTowerError, match="'gemma4a' audio tower.*--mmproj-vision-only"):
        convert(str(text), str(tmp_path / 'out'), mmproj=str(mmproj), progress=False)
    assert not (tmp_path / 'out').exists()
    report = check_source(str(text), str(mmproj))
    assert not report.ok and 'gemma4a' in report.render()
    assert check_source(str(text), str(mmproj), mmproj_vision_only=True).ok


def test_vision_only_converts_the_vision_tower_with_a_warning(tmp_path, gemma4_pair, caplog,
                                                              native_library):
    text, plain = gemma4_pair
    mmproj = write_gemma4v_mmproj(tmp_path / 'av.gguf', n_text=TEXT.hidden, seed=3, audio=True)
    with caplog.at_level(logging.WARNING, logger='edge_llm_ros.convert.mmproj'):
        mm = read_mmproj(mmproj, vision_only=True)
    assert "'gemma4a' audio tower (2 tensors) is left out" in caplog.text
    assert not [n for n in mm.tensors if n.startswith(('a.', 'mm.a.'))]
    img = image(7, 90, 200)
    assert np.array_equal(our_embeddings(plain, img), embeddings_of(mm, img))
    from edge_llm_ros.convert.converter import main
    assert main([str(text), str(tmp_path / 'vlm'), '--mmproj', str(mmproj),
                 '--mmproj-vision-only', '--quiet']) == 0
    meta = yaml.safe_load((tmp_path / 'vlm' / 'model.yaml').read_text())
    assert meta['vision']['projector'] == 'gemma4v'


def test_an_audio_only_mmproj_is_refused_by_name(tmp_path):
    import gguf
    path = tmp_path / 'audio.gguf'
    w = gguf.GGUFWriter(str(path), 'clip')
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_audio_encoder(True)
    w.add_clip_audio_projector_type('gemma4a')
    w.add_tensor('a.blk.0.ln1.weight', np.ones(8, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(AudioTowerError, match="audio-only mmproj \\('gemma4a'\\)"):
        read_mmproj(path)


# --- the language model ----------------------------------------------------------------------
LM_CASES = [
    ([(120, 120)], 'Hi <__media__> the sky is'),                   # square: 10 x 10 tokens
    ([(90, 200)], 'Hi <__media__> the sky is'),                    # wide: 17 x 8 tokens
    ([(97, 131), (300, 40)], '<__media__>Hello<__media__> blue'),  # odd-sized, then tall
]


def _engine(work: pathlib.Path, text, mmproj, **kw):
    from edge_llm_ros.serving.engine import Engine, EngineConfig
    folder = convert(str(text), str(work / 'vlm'), mmproj=str(mmproj), progress=False)
    return Engine(EngineConfig(model_dir=str(folder), max_context=512, intra_op_threads=1,
                               **{'prefix_reuse': False, **kw}))


@pytest.fixture(scope='module')
def gemma4_engine(tmp_path_factory, gemma4_pair, native_library):
    engine = _engine(tmp_path_factory.mktemp('gemma4v_lm'), *gemma4_pair)
    yield engine
    engine.close()


def _against_mtmd(engine, text, mmproj, sizes, prompt, work):
    from test_vision_qwen import _check_against_mtmd
    result, data, gap, tolerance = _check_against_mtmd(engine, text, mmproj, sizes, prompt,
                                                       work)
    return result, data, gap, tolerance / 0.01 * LOGPROB_OF_PEAK


@pytest.mark.parametrize('sizes, prompt', LM_CASES)
def test_greedy_ids_match_mtmd_with_images_in_the_prompt(tmp_path, gemma4_pair, gemma4_engine,
                                                         sizes, prompt, compat):
    compat('gemma4', TEXT.wtype, 'vision')
    text, mmproj = gemma4_pair
    result, data, gap, tolerance = _against_mtmd(gemma4_engine, text, mmproj, sizes, prompt,
                                                 tmp_path)
    assert result.token_ids == [int(t) for t in data['tokens']]
    assert gap <= tolerance


def test_two_image_goals_batched_in_one_step_each_decode_as_mtmd(
        tmp_path, gemma4_pair, native_library, compat):
    """Two slots, each with its bidirectional image rows, in the same decoder calls."""
    compat('gemma4', TEXT.wtype, 'batching')
    from test_vision_llm_parity import image as vimage, mtmd_run
    from edge_llm_ros.runtime.types import GenerationRequest, SamplingConfig
    from edge_llm_ros.serving.engine import Engine, EngineConfig
    from edge_llm_ros.serving.scheduler import Goal
    text, mmproj = gemma4_pair
    folder = convert(str(text), str(tmp_path / 'vlm'), mmproj=str(mmproj), progress=False)
    engine = Engine(EngineConfig(model_dir=str(folder), max_context=512, intra_op_threads=1,
                                 prefix_reuse=False, parallel_sequences=2))
    try:
        goals, expected = [], []
        for n, (sizes, prompt) in enumerate(LM_CASES[1:]):
            images = [vimage(7 + i, h, w) for i, (h, w) in enumerate(sizes)]
            (tmp_path / str(n)).mkdir()
            expected.append([int(t) for t in mtmd_run(text, mmproj, images, prompt,
                                                      tmp_path / str(n))['tokens']])
            goals.append(Goal(engine.prepare(GenerationRequest(
                prompt=prompt, use_chat_template=False, images=images, max_tokens=32,
                sampling=SamplingConfig(temperature=0.0)))))
        for g in goals:
            engine.scheduler().submit(g)
        while not all(g.done for g in goals):
            engine.run_plan()
        assert [g.result.token_ids for g in goals] == expected
    finally:
        engine.close()


def test_a_session_turn_after_a_stored_image_equals_the_whole_chat(
        tmp_path, gemma4_pair, native_library, compat):
    """The second turn reads the stored image's rows: as the whole chat at once.

    The first reply is one of two choices, so its text tokenizes back to its own ids.
    """
    compat('gemma4', TEXT.wtype, 'sessions')
    from test_vision_llm_parity import image as vimage
    from edge_llm_ros.runtime.types import ChatMessage, GenerationRequest, SamplingConfig
    frame, look = vimage(7, 90, 200), 'What is in <__media__> this?'
    greedy = SamplingConfig(logprobs=True, top_logprobs=4)

    engine = _engine(tmp_path, *gemma4_pair, prefix_reuse=True)

    def ask(messages, images=(), session='', **kw):
        return engine.generate(GenerationRequest(
            messages=messages, images=list(images), max_tokens=12, session_id=session,
            sampling=greedy, **kw)).run_to_end()
    try:
        first = ask([ChatMessage('user', look)], [frame], 'g4', choices=('a red box', 'blue'))
        second = ask([ChatMessage('user', 'And the color?')], session='g4')
        whole = ask([ChatMessage('user', look), ChatMessage('assistant', first.text),
                     ChatMessage('user', 'And the color?')], [frame])
    finally:
        engine.close()
    assert first.error == '' and second.error == '' and second.timings.cached_prompt_tokens
    assert second.token_ids == whole.token_ids
    assert max(abs(a.logprob - b.logprob) for a, b in zip(second.logprobs, whole.logprobs)) \
        < 1e-3


def test_a_reused_prefix_with_an_image_decodes_as_mtmd(tmp_path, gemma4_pair, native_library):
    """The second run reuses the first's KV (the bidirectional image included)."""
    text, mmproj = gemma4_pair
    engine = _engine(tmp_path, text, mmproj, prefix_reuse=True)
    try:
        first, data, _, _ = _against_mtmd(engine, text, mmproj, *LM_CASES[1], tmp_path)
        second, _, gap, tolerance = _against_mtmd(engine, text, mmproj, *LM_CASES[1], tmp_path)
    finally:
        engine.close()
    assert second.timings.cached_prompt_tokens > 0
    assert first.token_ids == second.token_ids == [int(t) for t in data['tokens']]
    assert gap <= tolerance


def test_causal_images_would_not_match(tmp_path, gemma4_pair, native_library, monkeypatch):
    """The check above sees the attention: causal images (E2B's rule) leave mtmd's path."""
    import edge_llm_ros.convert.vision_graph as vision_graph
    text, mmproj = gemma4_pair
    monkeypatch.setattr(vision_graph, 'GEMMA4_CAUSAL_WIDTHS', (TEXT.hidden,))
    engine = _engine(tmp_path, text, mmproj)
    try:
        result, data, gap, tolerance = _against_mtmd(engine, text, mmproj, *LM_CASES[0],
                                                     tmp_path)
    finally:
        engine.close()
    assert gap > 5 * tolerance


def test_an_encoded_image_is_refused_with_what_to_send(gemma4_engine):
    from edge_llm_ros.runtime.media import ImageInputError
    with pytest.raises(ImageInputError, match='gemma4v model takes frames'):
        gemma4_engine.vision.encoded_shape(120, 120)
