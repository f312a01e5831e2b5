"""Qwen3-VL (mmproj `qwen3vl_merger`) against llama.cpp's libmtmd: encoder and resize.

A tiny random Qwen3-VL mmproj (test/mmproj_fixtures.py: patch 16 as Qwen3-VL's, learned
positions for an 8 x 8 grid interpolated to every image's, DeepStack after layers 1 and 2)
beside a tiny qwen3vl text GGUF (n_deepstack_layers 2, three layers: llama.cpp adds the
DeepStack rows after layers 0 and 1, and needs a layer after them). llama.cpp's own multimodal
library (test/mtmd_runner.py in the peer venv) resizes and encodes the same image; ours is
convert/vision_qwen.py's graph fed by runtime/mmproj_qwen.py. Each image row is the main
merger's 256 values, then each DeepStack merger's 256 (768 wide, as mtmd's).

Stated tolerance (not Qwen2.5-VL's per-token rule, see why): every value within 4e-4 x the
embeddings' peak and the mean difference within 3e-5 x the peak. libmtmd rounds the pixels
and patch kernel to fp16 (im2col) and takes GELU from an fp16 table, and Qwen3-VL has that
GELU in every encoder layer as well as in its three mergers: a float32 ulp moving one GELU
input across an fp16 rounding boundary moves its output one fp16 step, and the following
layers' attention spreads it over every token. Measured on the sizes below: ours against
mtmd 1.4-2.9e-4 x the peak at most, mean 1.0-2.1e-5; our own graph with each GELU input
moved by one ulp, against itself, up to 2.3e-4, mean up to 1.8e-5 (so Qwen2.5-VL's "90 % of
the tokens within 1e-4" cannot hold: 29-69 % here, 46-100 % from the one-ulp move alone);
exact float32 GELU instead of the table 3.5-5.4e-4, mean 6-9e-5; no fp16 im2col 3.9-7.3e-4
(both fail the rule); another image's embeddings are over 1e-2 x the peak off.
"""
from gguf_fixtures import ParityCase, write_gguf
from mmproj_fixtures import write_qwen3vl_mmproj
import numpy as np
import pytest
from test_vision_qwen import image, mtmd, our_embeddings
from tiny_model import TinyDims

from edge_llm_ros.convert.mmproj import MmprojError, read_mmproj
from edge_llm_ros.convert.vision_graph import model_yaml_section
from edge_llm_ros.runtime.mmproj_preprocess import grid_for
from edge_llm_ros.runtime.mmproj_qwen import smart_size

# Qwen3-VL's text sections (24, 20, 20 of 64 pairs) scaled to 32 pairs; three layers.
QWEN3_TEXT = ParityCase(arch='qwen3vl', wtype='F32', vision='qwen', deepstack=2,
                        rope_sections=(12, 10, 10, 0),
                        dims=TinyDims(hidden=256, layers=3, intermediate=512, rms_eps=1e-6,
                                      key_length=64))
MAX_OF_PEAK, MEAN_OF_PEAK = 4e-4, 3e-5


@pytest.fixture(scope='module')
def qwen3_pair(tmp_path_factory):
    work = tmp_path_factory.mktemp('qwen3')
    text = write_gguf(work / 'text.gguf', QWEN3_TEXT)
    mmproj = write_qwen3vl_mmproj(work / 'mmproj.gguf', n_text=QWEN3_TEXT.dims.hidden, seed=3)
    return text, mmproj


@pytest.mark.parametrize('height, width', [
    (128, 128),   # square: the learned positions' own 8 x 8 grid, no interpolation
    (96, 128),    # wide, no resize: 3 x 4 tokens
    (150, 230),   # wide, resized to 160 x 224 (letterboxed by a few columns)
    (250, 100),   # tall, resized to 256 x 96
    (97, 131),    # odd sides
    (224, 320),   # larger than the position grid: interpolated up
    (700, 760),   # 2,112 patches, over FLASH_FROM: flash attention (blocked)
])
def test_image_embeddings_match_llamacpps_mtmd(tmp_path, qwen3_pair, height, width):
    text, mmproj = qwen3_pair
    img = image(7, height, width)
    data = mtmd(text, mmproj, img, tmp_path)
    assert int(data['n_chunks']) == 1
    theirs, ours = data['embeds_0'], our_embeddings(mmproj, img)
    assert ours.shape == theirs.shape == (theirs.shape[0], 3 * QWEN3_TEXT.dims.hidden)
    peak = float(np.abs(theirs).max())
    diff = np.abs(ours - theirs)
    assert float(diff.max()) <= MAX_OF_PEAK * peak
    assert float(diff.mean()) <= MEAN_OF_PEAK * peak
    # The max covers each part of the row (main merger, DeepStack after layers 1 and 2):
    # a wrong layer or merger is O(peak) off. Each part moves with the pixels:
    other = our_embeddings(mmproj, image(8, height, width))
    for part_ours, part_other in zip(np.split(ours, 3, axis=1), np.split(other, 3, axis=1)):
        assert float(np.abs(part_ours - part_other).max()) > 25 * MAX_OF_PEAK * peak


@pytest.mark.parametrize('height, width', [(128, 128), (150, 230), (97, 131)])
def test_an_f16_mmproj_matches_mtmd_within_its_rounding_noise(
        tmp_path, qwen3_pair, height, width):
    """Every matrix F16 (mmproj-F16 files): ggml rounds the activations to fp16 before each.

    That rounding flips whole fp16 steps where float32 noise crosses a boundary: our own
    graph with each GELU input moved by one ulp is 3.0-6.4e-4 of the peak from itself at
    most, mean 2.9-9.7e-5 (measured); ours against mtmd 6.0-6.3e-4, mean 0.99-1.07e-4.
    So the bound is 1e-3 and 1.5e-4: it sees a wrong layer or input, not the last rounding.
    """
    text, _ = qwen3_pair
    mmproj = write_qwen3vl_mmproj(tmp_path / 'f16.gguf', n_text=QWEN3_TEXT.dims.hidden, seed=3,
                                  weight_type='F16')
    img = image(7, height, width)
    theirs, ours = mtmd(text, mmproj, img, tmp_path)['embeds_0'], our_embeddings(mmproj, img)
    peak = float(np.abs(theirs).max())
    diff = np.abs(ours - theirs)
    assert float(diff.max()) <= 1e-3 * peak and float(diff.mean()) <= 1.5e-4 * peak
    other = our_embeddings(mmproj, image(8, height, width))
    assert float(np.abs(other - theirs).mean()) > 30 * 1.5e-4 * peak


@pytest.mark.parametrize('height, width', [
    (10, 10),       # under the 8-token minimum: scaled up
    (20, 300),      # a thin strip
    (480, 640),     # VGA: 15 x 20 tokens
    (1080, 1920),   # 1080p: over 4096 tokens, scaled down
    (3000, 41),     # tall and thin, over the limit
    (333, 517),     # odd sides
])
def test_smart_resize_to_multiples_of_32_gives_mtmds_token_counts(
        tmp_path, qwen3_pair, height, width):
    text, mmproj = qwen3_pair
    data = mtmd(text, mmproj, np.zeros((height, width, 3), np.uint8), tmp_path,
                '--layout-only')
    vision = model_yaml_section(read_mmproj(mmproj), 'vision.onnx')
    cols, rows, tiles = grid_for(height, width, vision)
    types = list(data['chunk_types'])
    assert types.count(1) == 1 and tiles == 1
    assert int(data[f'chunk_{types.index(1)}'][0]) == cols * rows
    h, w = smart_size(height, width, 16)
    assert (h % 32, w % 32) == (0, 0) and 8 <= cols * rows <= 4096


def test_the_mmproj_reading_finds_deepstack_layers_and_the_row_width(qwen3_pair):
    _, mmproj = qwen3_pair
    cfg = read_mmproj(mmproj).config
    assert (cfg.deepstack, cfg.n_out, cfg.row_width, cfg.wa_pattern) == ((1, 2), 256, 768, 0)
    vision = model_yaml_section(read_mmproj(mmproj), 'vision.onnx')
    assert (vision['position_grid'], vision['deepstack_layers']) == (8, 2)


@pytest.mark.parametrize('skip, missing', [
    (('v.blk.1.attn_qkv.weight',), r'v\.blk\.1\.attn_qkv\.weight'),
    (('v.position_embd.weight',), r'v\.position_embd\.weight'),
    (('v.deepstack.2.fc2.weight',), r'v\.deepstack\.2\.fc2\.weight'),
])
def test_a_qwen3vl_mmproj_without_a_tensor_it_needs_is_refused(tmp_path, skip, missing):
    bad = write_qwen3vl_mmproj(tmp_path / 'bad.gguf', skip=skip)
    with pytest.raises(MmprojError, match=missing):
        read_mmproj(bad)


# --- the language model: interleaved M-RoPE and DeepStack through the engine's rows ----------
# chain 0.1 as test_vision_qwen's: the greedy path follows the image's positions and rows.
# Stated tolerance: log probs within 1.5 % of mtmd's peak logit (Qwen2.5-VL's test: 1 %).
# The text path alone is that far from llama.cpp on these tiny qwen3 weights: with no image,
# the plain qwen3 family's logits differ from llama.cpp's by up to 0.29 of a 28.3 peak (1.0 %;
# qwen3vl's 0.34, qwen2vl's 0.27 of 23.2), and here the image steps measure 0.22-0.29 of
# 21.5-30 (with mtmd's own image rows fed in instead of ours: the same, so not the encoder).
# Removing the DeepStack rows moves them 3-34, plain (non-interleaved) sections 0.3-29: the
# check sees both. Two images in the other order ((97, 131) then (250, 100)) leave mtmd's
# path at a near tie, where mtmd's choice leads by 0.03-0.08 (under that noise), so the cases
# below are ones without such a tie.
QWEN3_LM = ParityCase(arch='qwen3vl', wtype='F32', vision='qwen', deepstack=2, chain=0.1,
                      rope_sections=QWEN3_TEXT.rope_sections, dims=QWEN3_TEXT.dims)
LM_CASES = [
    ([(128, 128)], 'Hi <__media__> the sky is'),                   # square: 4 x 4 tokens
    ([(150, 230)], 'Hi <__media__> the sky is'),                   # wide: 7 x 5 tokens
    ([(250, 100), (97, 131)], '<__media__>Hi<__media__> the sky'),  # tall, then odd-sized
]
LOGPROB_OF_PEAK = 0.015


@pytest.fixture(scope='module')
def qwen3_engine(tmp_path_factory):
    from edge_llm_ros.convert.converter import convert
    from edge_llm_ros.serving.engine import Engine, EngineConfig
    work = tmp_path_factory.mktemp('qwen3_lm')
    text = write_gguf(work / 'text.gguf', QWEN3_LM)
    mmproj = write_qwen3vl_mmproj(work / 'mmproj.gguf', n_text=QWEN3_LM.dims.hidden, seed=3)
    folder = convert(str(text), str(work / 'vlm'), mmproj=str(mmproj), progress=False)
    engines = []

    def make(**kw):
        engines.append(Engine(EngineConfig(model_dir=str(folder), max_context=256,
                                           intra_op_threads=1, **kw)))
        return engines[-1]
    yield text, mmproj, make
    for engine in engines:
        engine.close()


def _check(engine, text, mmproj, sizes, prompt, work):
    from test_vision_qwen import _check_against_mtmd
    result, data, gap, tolerance = _check_against_mtmd(engine, text, mmproj, sizes, prompt,
                                                       work)
    return result, data, gap, tolerance / 0.01 * LOGPROB_OF_PEAK


@pytest.mark.parametrize('sizes, prompt', LM_CASES)
def test_greedy_ids_match_mtmd_with_interleaved_mrope_and_deepstack(
        tmp_path, qwen3_engine, sizes, prompt, compat):
    compat('qwen3vl', QWEN3_LM.wtype, 'vision')
    text, mmproj, make = qwen3_engine
    engine = make(prefix_reuse=False)
    result, data, gap, tolerance = _check(engine, text, mmproj, sizes, prompt, tmp_path)
    assert result.token_ids == [int(t) for t in data['tokens']]
    assert gap <= tolerance


def test_a_reused_prefix_with_an_image_keeps_its_positions_and_deepstack(tmp_path, qwen3_engine):
    """The second run reuses the first's KV (image included) and decodes the same ids."""
    text, mmproj, make = qwen3_engine
    engine = make(prefix_reuse=True)
    first, data, _, _ = _check(engine, text, mmproj, *LM_CASES[1], tmp_path)
    second, _, gap, tolerance = _check(engine, text, mmproj, *LM_CASES[1], tmp_path)
    assert second.timings.cached_prompt_tokens > 0
    assert first.token_ids == second.token_ids == [int(t) for t in data['tokens']]
    assert gap <= tolerance


def test_two_image_goals_batched_in_one_step_each_decode_as_mtmd(tmp_path, qwen3_engine, compat):
    """Two slots, each row with its own positions and DeepStack rows, in the same calls."""
    compat('qwen3vl', QWEN3_LM.wtype, 'batching')
    from test_vision_llm_parity import image as vimage, mtmd_run
    from edge_llm_ros.runtime.types import GenerationRequest, SamplingConfig
    from edge_llm_ros.serving.scheduler import Goal
    text, mmproj, make = qwen3_engine
    engine = make(prefix_reuse=False, parallel_sequences=2)
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


def test_prompt_lookup_speculation_after_an_image_decodes_as_mtmd(tmp_path, qwen3_engine, compat):
    """Verify passes of k + 1 tokens after an image take the shifted positions too."""
    compat('qwen3vl', QWEN3_LM.wtype, 'speculation')
    from edge_llm_ros.runtime.speculative_config import SpeculativeConfig
    text, mmproj, make = qwen3_engine
    engine = make(prefix_reuse=False, speculative=SpeculativeConfig(mode='prompt_lookup'))
    # Square: with the wide image this prompt has a near tie at step 2 (mtmd's lead 0.012),
    # speculation or not.
    sizes, prompt = [(128, 128)], 'Hi <__media__> the sky is 0123456789 abcdefgh'
    result, data, _, _ = _check(engine, text, mmproj, sizes, prompt, tmp_path)
    assert result.timings.draft_passes > 0
    assert result.token_ids == [int(t) for t in data['tokens']]


def test_kv_index_positions_would_not_match(tmp_path, qwen3_engine, monkeypatch):
    """The check above sees the positions: rows at their KV index leave mtmd's path."""
    from edge_llm_ros.runtime.sequence import Sequence
    text, mmproj, make = qwen3_engine
    monkeypatch.setattr(Sequence, 'rope_positions', lambda self, start, length: None)
    engine = make(prefix_reuse=False)
    result, data, gap, tolerance = _check(engine, text, mmproj, *LM_CASES[2], tmp_path)
    assert result.token_ids != [int(t) for t in data['tokens']] and gap > 5 * tolerance


def test_a_session_turn_after_a_stored_image_keeps_its_positions(qwen3_engine, compat):
    """The second turn reads the stored image's rows (DeepStack too) and grid: as one chat."""
    compat('qwen3vl', QWEN3_LM.wtype, 'sessions')
    from test_vision_llm_parity import image as vimage
    from edge_llm_ros.runtime.types import ChatMessage, GenerationRequest, SamplingConfig
    _, _, make = qwen3_engine
    engine = make()
    frame, look = vimage(7, 150, 230), 'What is in <__media__> this?'
    greedy = SamplingConfig(logprobs=True, top_logprobs=4)

    def ask(messages, images=(), session='', **kw):
        return engine.generate(GenerationRequest(
            messages=messages, images=list(images), max_tokens=12, session_id=session,
            sampling=greedy, **kw)).run_to_end()
    first = ask([ChatMessage('user', look)], [frame], 'qwen3', choices=('a red box', 'blue'))
    second = ask([ChatMessage('user', 'And the color?')], session='qwen3')
    assert first.error == '' and second.error == '' and second.timings.cached_prompt_tokens
    turns = [ChatMessage('user', look), ChatMessage('assistant', first.text),
             ChatMessage('user', 'And the color?')]
    whole = ask(turns, [frame])
    assert second.token_ids == whole.token_ids
    assert max(abs(a.logprob - b.logprob) for a, b in zip(second.logprobs, whole.logprobs)) \
        < 1e-3


def test_a_pair_whose_deepstack_counts_differ_is_refused_before_anything_is_written(tmp_path):
    """An mmproj with 2 DeepStack mergers beside a language model that takes 1 (or 0)."""
    import dataclasses
    from edge_llm_ros.convert.converter import convert
    mmproj = write_qwen3vl_mmproj(tmp_path / 'mmproj.gguf', n_text=QWEN3_TEXT.dims.hidden)
    for arch, deepstack in (('qwen3vl', 1), ('qwen3', 0)):
        text = write_gguf(tmp_path / f'{arch}.gguf', dataclasses.replace(
            QWEN3_TEXT, arch=arch, deepstack=deepstack))
        with pytest.raises(MmprojError, match=f'2 DeepStack rows .* takes {deepstack}'):
            convert(str(text), str(tmp_path / arch), mmproj=str(mmproj), progress=False)
        assert not (tmp_path / arch).exists()


def test_n_deepstack_layers_not_under_the_layer_count_is_refused(tmp_path):
    """llama.cpp adds the rows after layers 0..D-1 and needs a layer after them."""
    import dataclasses
    from edge_llm_ros.convert.converter import convert
    from edge_llm_ros.errors import UnsupportedModelError
    text = write_gguf(tmp_path / 'text.gguf', dataclasses.replace(QWEN3_TEXT, deepstack=3))
    with pytest.raises(UnsupportedModelError, match='n_deepstack_layers 3 must be under the 3'):
        convert(str(text), str(tmp_path / 'out'), progress=False)
