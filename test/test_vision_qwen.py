"""Qwen2.5-VL (mmproj `qwen2.5vl_merger`) against llama.cpp's libmtmd: encoder and resize.

A tiny random Qwen2.5-VL mmproj (test/mmproj_fixtures.py: patch 14 as Qwen's, so llama.cpp's
112-pixel windows split the larger images; every second layer full attention) beside a tiny
qwen2vl text GGUF whose vocabulary has `<|vision_start|>` / `<|vision_end|>`. llama.cpp's own
multimodal library (test/mtmd_runner.py in the peer venv) resizes and encodes the same image;
ours is convert/vision_qwen.py's graph fed by runtime/mmproj_qwen.py.

Stated tolerance: 90 % of the tokens within 1e-4 x the embeddings' peak in every value, and
every value within 2.5e-4 x the peak. libmtmd rounds the pixels and patch kernel to fp16
(ggml_conv_2d's im2col) and takes GELU from an fp16 table; the graph does both (exact float32
instead: 6e-4 x the peak everywhere). What is left is that table: where float32 noise moves a
merger value across an fp16 rounding boundary, the GELU output moves one fp16 step, and mm.2
spreads it over the whole token (measured: 1-2 tokens of 9-36, up to 1.4e-4 x the peak; the
other tokens within 3e-6 absolute).
"""
import pathlib
import subprocess

from gguf_fixtures import ParityCase, write_gguf
from llama_cpp_parity import peer_python
from mmproj_fixtures import write_qwen25vl_mmproj
import numpy as np
import onnxruntime as ort
import pytest

from edge_llm_ros.convert.mmproj import MmprojError, read_mmproj
from edge_llm_ros.convert.vision_graph import build_encoder, model_yaml_section
from edge_llm_ros.runtime.mmproj_preprocess import grid_for, preprocess
from edge_llm_ros.runtime.mmproj_qwen import encoder_inputs, smart_size

RUNNER = pathlib.Path(__file__).resolve().parent / 'mtmd_runner.py'
QWEN_TEXT = ParityCase(arch='qwen2vl', wtype='F32', vision='qwen')


@pytest.fixture(scope='module')
def qwen_pair(tmp_path_factory):
    work = tmp_path_factory.mktemp('qwen')
    text = write_gguf(work / 'text.gguf', QWEN_TEXT)
    mmproj = write_qwen25vl_mmproj(work / 'mmproj.gguf', n_text=QWEN_TEXT.dims.hidden, seed=3)
    return text, mmproj


def mtmd(text, mmproj, image: np.ndarray, work: pathlib.Path, *extra: str):
    np.save(work / 'image.npy', image)
    out = work / 'mtmd.npz'
    proc = subprocess.run([peer_python(), str(RUNNER), str(text), str(mmproj),
                           str(work / 'image.npy'), str(out), *extra],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(out)


def image(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)


def our_embeddings(mmproj, img: np.ndarray) -> np.ndarray:
    mm = read_mmproj(mmproj)
    vision = model_yaml_section(mm, 'vision.onnx')
    session = ort.InferenceSession(build_encoder(mm).SerializeToString(),
                                   providers=['CPUExecutionProvider'])
    (resized,) = preprocess(img, vision).tiles
    (out,) = session.run(None, {'pixels': resized[None], **encoder_inputs(resized, vision)})
    return out[0]


@pytest.mark.parametrize('height, width', [
    (224, 224),   # square, 2 x 2 windows, no resize
    (150, 230),   # wide, resized to 140 x 224 (letterboxed by a few columns)
    (250, 100),   # tall, resized to 252 x 112
    (97, 131),    # odd sides
    (600, 700),   # 2,100 patches, over FLASH_FROM: per-window and flash attention (blocked)
])
def test_image_embeddings_match_llamacpps_mtmd(tmp_path, qwen_pair, height, width):
    text, mmproj = qwen_pair
    img = image(7, height, width)
    data = mtmd(text, mmproj, img, tmp_path)
    assert int(data['n_chunks']) == 1
    theirs, ours = data['embeds_0'], our_embeddings(mmproj, img)
    assert ours.shape == theirs.shape
    peak = float(np.abs(theirs).max())
    per_token = np.abs(ours - theirs).max(-1)
    assert float(per_token.max()) <= 2.5e-4 * peak
    assert np.mean(per_token <= 1e-4 * peak) >= 0.9
    # Another image is far outside that: the tolerance sees the pixels.
    other = our_embeddings(mmproj, image(8, height, width))
    assert float(np.abs(other - theirs).max()) > 100 * 1e-4 * peak


@pytest.mark.parametrize('height, width', [
    (10, 10),       # under the 8-token minimum: scaled up
    (20, 300),      # a thin strip
    (480, 640),     # VGA: 17 x 23 tokens
    (1080, 1920),   # 1080p: over 4096 tokens, scaled down
    (3000, 41),     # tall and thin, over the limit
])
def test_smart_resize_gives_mtmds_token_counts(tmp_path, qwen_pair, height, width):
    text, mmproj = qwen_pair
    data = mtmd(text, mmproj, np.zeros((height, width, 3), np.uint8), tmp_path,
                '--layout-only')
    vision = model_yaml_section(read_mmproj(mmproj), 'vision.onnx')
    cols, rows, tiles = grid_for(height, width, vision)
    types = list(data['chunk_types'])
    assert types.count(1) == 1 and tiles == 1
    assert int(data[f'chunk_{types.index(1)}'][0]) == cols * rows
    h, w = smart_size(height, width, 14)
    assert (h % 28, w % 28) == (0, 0) and 8 <= cols * rows <= 4096


def test_a_qwen_mmproj_without_its_window_pattern_or_second_frame_is_refused(tmp_path):
    bad = write_qwen25vl_mmproj(tmp_path / 'bad.gguf', skip=('v.patch_embd.weight.1',))
    with pytest.raises(MmprojError, match=r'v\.patch_embd\.weight\.1'):
        read_mmproj(bad)


# --- the language model: M-RoPE positions through the engine's rows --------------------------
# chain 0.1: the head's next-token term is weak, so the greedy path follows the image's
# positions: with every row at its KV index instead (no M-RoPE) the ids leave mtmd's after
# 1-27 tokens and the log probs move 20-30 (measured), with M-RoPE 32/32 and within 1 %.
QWEN_LM = ParityCase(arch='qwen2vl', wtype='F32', vision='qwen', chain=0.1)
LM_CASES = [
    ([(112, 112)], 'Hi <__media__> the sky is'),                  # square, one window
    ([(150, 230)], 'Hi <__media__> the sky is'),                  # wide: 8 x 5 tokens
    ([(250, 100), (97, 131)], '<__media__>Hello<__media__> blue'),  # tall, then odd-sized
]


@pytest.fixture(scope='module')
def qwen_engine(tmp_path_factory):
    from edge_llm_ros.convert.converter import convert
    from edge_llm_ros.serving.engine import Engine, EngineConfig
    work = tmp_path_factory.mktemp('qwen_lm')
    text = write_gguf(work / 'text.gguf', QWEN_LM)
    mmproj = write_qwen25vl_mmproj(work / 'mmproj.gguf', n_text=QWEN_LM.dims.hidden, seed=3)
    folder = convert(str(text), str(work / 'vlm'), mmproj=str(mmproj), progress=False)
    engines = []

    def make(**kw):
        engines.append(Engine(EngineConfig(model_dir=str(folder), max_context=256,
                                           intra_op_threads=1, **kw)))
        return engines[-1]
    yield text, mmproj, make
    for engine in engines:
        engine.close()


# The largest log-prob gap to mtmd allowed, as a share of mtmd's largest |logit|. mtmd's own
# sums change with the CPU's ISA: 0.0105-0.0120 on a 2-core AVX2-only EPYC (2026-12-07),
# under 0.01 on the AVX-512 machine the bound was first set on. The control below (positions
# at their KV index) stays above 7x this (over 0.1 of the largest logit).
GAP_TOLERANCE = 0.015


def _check_against_mtmd(engine, text, mmproj, sizes, prompt, work):
    from test_vision_llm_parity import generate, image as vimage, logprob_gap, mtmd_layout, \
        mtmd_run
    from edge_llm_ros.runtime.types import GenerationRequest
    images = [vimage(7 + i, h, w) for i, (h, w) in enumerate(sizes)]
    data = mtmd_run(text, mmproj, images, prompt, work)
    prepared = engine.prepare(GenerationRequest(prompt=prompt, use_chat_template=False,
                                                images=images, max_tokens=32))
    assert (list(prepared.prompt_ids), list(prepared.spans)) == mtmd_layout(data)
    result = generate(engine, prompt, images)
    assert result.error == ''
    return result, data, logprob_gap(result, data['logits']), \
        GAP_TOLERANCE * float(np.abs(data['logits']).max())


@pytest.mark.parametrize('sizes, prompt', LM_CASES)
def test_greedy_ids_match_mtmd_with_mrope_positions(tmp_path, qwen_engine, sizes, prompt, compat):
    compat('qwen2vl', QWEN_LM.wtype, 'vision')
    text, mmproj, make = qwen_engine
    engine = make(prefix_reuse=False)
    result, data, gap, tolerance = _check_against_mtmd(engine, text, mmproj, sizes, prompt,
                                                       tmp_path)
    assert result.token_ids == [int(t) for t in data['tokens']]
    assert gap <= tolerance


def test_kv_index_positions_would_not_match(tmp_path, qwen_engine, monkeypatch):
    """The check above sees the positions: rows at their KV index leave mtmd's path."""
    from edge_llm_ros.runtime.sequence import Sequence
    text, mmproj, make = qwen_engine
    monkeypatch.setattr(Sequence, 'rope_positions', lambda self, start, length: None)
    engine = make(prefix_reuse=False)
    result, data, gap, tolerance = _check_against_mtmd(engine, text, mmproj, *LM_CASES[2],
                                                       tmp_path)
    assert result.token_ids != [int(t) for t in data['tokens']] and gap > 7 * tolerance


def test_a_reused_prefix_with_an_image_keeps_its_positions(tmp_path, qwen_engine):
    """The second run reuses the first's KV (image included) and decodes the same ids."""
    text, mmproj, make = qwen_engine
    engine = make(prefix_reuse=True)
    first, data, _, _ = _check_against_mtmd(engine, text, mmproj, *LM_CASES[1], tmp_path)
    second, _, gap, tolerance = _check_against_mtmd(engine, text, mmproj, *LM_CASES[1],
                                                    tmp_path)
    assert second.timings.cached_prompt_tokens > 0
    assert first.token_ids == second.token_ids == [int(t) for t in data['tokens']]
    assert gap <= tolerance


def test_an_image_over_the_context_or_its_cap_is_refused_before_any_model_work(qwen_engine):
    """A 1080p frame is 39 x 69 = 2,691 tokens: a typed error first, then text works."""
    from edge_llm_ros.errors import ContextOverflowError
    from edge_llm_ros.runtime.media import ImageInputError
    from edge_llm_ros.runtime.types import GenerationRequest
    _, _, make = qwen_engine
    engine = make(prefix_reuse=False)
    frame = np.zeros((1080, 1920, 3), np.uint8)
    with pytest.raises(ContextOverflowError, match='images take'):
        engine.prepare(GenerationRequest(prompt='<__media__> what?', use_chat_template=False,
                                         images=[frame], max_tokens=8))
    with pytest.raises(ImageInputError, match='not pre-encoded rows'):
        engine.vision.encoded_shape(1080, 1920)
    # A request's own cap: a 640x480 frame (17 x 23 = 391 tokens) over 300.
    vga = np.zeros((480, 640, 3), np.uint8)
    with pytest.raises(ImageInputError, match='images.0. takes 391 tokens, over '
                                              'max_image_tokens 300'):
        engine.prepare(GenerationRequest(prompt='<__media__> what?', use_chat_template=False,
                                         images=[vga], max_tokens=8, max_image_tokens=300))
    small = np.zeros((112, 112, 3), np.uint8)   # 16 tokens: under the cap
    assert engine.prepare(GenerationRequest(prompt='<__media__> what?', use_chat_template=False,
                                            images=[small], max_tokens=8,
                                            max_image_tokens=16)).prompt_tokens > 16
    result = engine.generate(GenerationRequest(prompt='the sky', use_chat_template=False,
                                               max_tokens=3)).run_to_end()
    assert result.error == '' and result.completion_tokens == 3


def test_two_image_goals_batched_in_one_step_each_decode_as_mtmd(tmp_path, qwen_engine, compat):
    """Two slots, each row with its own M-RoPE positions, in the same decoder calls."""
    compat('qwen2vl', QWEN_LM.wtype, 'batching')
    from test_vision_llm_parity import image as vimage, mtmd_run
    from edge_llm_ros.runtime.types import GenerationRequest, SamplingConfig
    from edge_llm_ros.serving.scheduler import Goal
    text, mmproj, make = qwen_engine
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


def test_prompt_lookup_speculation_after_an_image_decodes_as_mtmd(tmp_path, qwen_engine, compat):
    """Verify passes of k + 1 tokens after an image take the shifted positions too."""
    compat('qwen2vl', QWEN_LM.wtype, 'speculation')
    from edge_llm_ros.runtime.speculative_config import SpeculativeConfig
    text, mmproj, make = qwen_engine
    engine = make(prefix_reuse=False, speculative=SpeculativeConfig(mode='prompt_lookup'))
    sizes, prompt = [(150, 230)], 'Hi <__media__> the sky is 0123456789 abcdefgh'
    result, data, gap, tolerance = _check_against_mtmd(engine, text, mmproj, sizes, prompt,
                                                       tmp_path)
    assert result.timings.draft_passes > 0
    assert result.token_ids == [int(t) for t in data['tokens']]


def test_a_session_turn_after_a_stored_image_keeps_its_positions(qwen_engine, compat):
    """The second turn reads the stored image's rows and grid: as the whole chat at once.

    The first reply is one of two choices, so its text tokenizes back to its own ids (a free
    reply of the random model is bytes that do not).
    """
    compat('qwen2vl', QWEN_LM.wtype, 'sessions')
    from test_vision_llm_parity import image as vimage
    from edge_llm_ros.runtime.types import ChatMessage, GenerationRequest, SamplingConfig
    _, _, make = qwen_engine
    engine = make()
    frame, look = vimage(7, 150, 230), 'What is in <__media__> this?'
    greedy = SamplingConfig(logprobs=True, top_logprobs=4)

    def ask(messages, images=(), session='', **kw):
        return engine.generate(GenerationRequest(
            messages=messages, images=list(images), max_tokens=12, session_id=session,
            sampling=greedy, **kw)).run_to_end()
    first = ask([ChatMessage('user', look)], [frame], 'qwen', choices=('a red box', 'blue'))
    second = ask([ChatMessage('user', 'And the color?')], session='qwen')
    assert first.error == '' and second.error == '' and second.timings.cached_prompt_tokens
    turns = [ChatMessage('user', look), ChatMessage('assistant', first.text),
             ChatMessage('user', 'And the color?')]
    whole = ask(turns, [frame])
    assert second.token_ids == whole.token_ids
    assert max(abs(a.logprob - b.logprob) for a, b in zip(second.logprobs, whole.logprobs)) \
        < 1e-3
