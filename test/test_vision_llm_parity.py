"""Images through the engine against llama.cpp's libmtmd: prompt layout and greedy ids.

Tiny VLM pairs (a random mmproj of each family, test/mmproj_fixtures.py, and a 256-wide text
GGUF whose vocabulary has the image wrapper tokens) are converted with --mmproj. For the same
raw prompt with `<__media__>` markers and the same images, llama.cpp's multimodal library
(test/mtmd_runner.py in the peer venv) tokenizes, encodes, evaluates the prompt with
mtmd_helper_eval_chunks and decodes greedily. The engine must lay the prompt out exactly as
mtmd's chunks (token ids of every text chunk, the size of every image chunk, in order) and
give the same first 32 greedy ids.
"""
import pathlib
import subprocess

import gguf
from gguf_fixtures import ParityCase, write_gguf
from llama_cpp_parity import ggml_tables, peer_python
from mmproj_fixtures import write_mmproj
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edge_llm_ros.convert.converter import convert
from edge_llm_ros.errors import ContextOverflowError
from edge_llm_ros.runtime.media import encoded_form, ImageInputError
from edge_llm_ros.runtime.mmproj_preprocess import grid_for, preprocess
from edge_llm_ros.runtime.types import ChatMessage, GenerationRequest, SamplingConfig
from edge_llm_ros.serving.engine import Engine, EngineConfig

RUNNER = pathlib.Path(__file__).resolve().parent / 'mtmd_runner.py'
TOKENS = 32
TOP = 8
SCALES = {'gemma3': 4, 'idefics3': 2, 'internvl': 2, 'mlp': None}


@pytest.fixture(scope='module')
def pair(tmp_path_factory):
    """Return make(projector) -> (text.gguf, mmproj.gguf, engine), one per family."""
    work = tmp_path_factory.mktemp('vlm_pair')
    text = write_gguf(work / 'text.gguf', ParityCase(arch='llama', wtype='F32', vision=True))
    made = {}

    def make(projector: str):
        if projector not in made:
            mmproj = write_mmproj(work / f'{projector}.gguf', projector, n_text=256,
                                  scale=SCALES[projector], longest_edge=64, seed=11)
            folder = convert(str(text), str(work / projector), mmproj=str(mmproj),
                             progress=False)
            engine = Engine(EngineConfig(model_dir=str(folder), max_context=256,
                                         intra_op_threads=1, prefix_reuse=False))
            made[projector] = (text, mmproj, engine)
        return made[projector]
    yield make
    for _, _, engine in made.values():
        engine.close()


def mtmd_run(text, mmproj, images, prompt: str, work: pathlib.Path, tokens: int = TOKENS,
             extra=()):
    files = []
    for i, image in enumerate(images):
        files.append(str(work / f'image{i}.npy'))
        np.save(files[-1], image)
    out = work / 'mtmd.npz'
    proc = subprocess.run([peer_python(), str(RUNNER), str(text), str(mmproj), ','.join(files),
                           str(out), '--prompt', prompt, '--tokens', str(tokens), *extra],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(out)


def mtmd_layout(data):
    """Return mtmd's chunks as (ids, spans) in the engine's terms."""
    ids, spans, pos = [], [], 0
    for j, kind in enumerate(data['chunk_types']):
        record = [int(x) for x in data[f'chunk_{j}']]
        if kind == 0:
            ids += record
            pos += len(record)
        else:
            spans.append((pos, record[0]))
            pos += record[0]
    return ids, spans


def image(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)


CASES = [
    # projector, image sizes, prompt
    ('gemma3', [(32, 32)], 'Hi <__media__> the sky is'),          # rows attend both ways
    ('gemma3', [(30, 45), (50, 20)], '<__media__>Hello<__media__> blue'),  # letterboxed
    ('idefics3', [(30, 45)], 'Hi <__media__> the sky is'),        # 2 x 2 tiles + overview
    ('idefics3', [(40, 100), (90, 20)], '<__media__>Hello<__media__> blue'),  # two images
    ('internvl', [(30, 45)], 'Hi <__media__> the sky is'),        # tiles + thumbnail
    ('internvl', [(32, 32)], 'the <__media__>'),                  # one tile
    ('internvl', [(20, 100), (90, 40)], '<__media__> and <__media__>'),  # wide and tall grids
    ('internvl', [(70, 100)], 'a <__media__>'),                   # 4 x 3 tiles + thumbnail
    ('mlp', [(32, 32)], 'Hello <__media__>\nthe color'),
    ('mlp', [(20, 45)], '<__media__> sky'),                        # letterboxed on grey
    ('mlp', [(32, 32), (32, 32)], '<__media__><__media__> is'),  # the same image twice
]


def logprob_gap(result, logits: np.ndarray) -> float:
    """Largest |our log prob - mtmd's| over every step's top tokens (the same greedy path)."""
    x = logits.astype(np.float64)
    lse = x.max(-1) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))
    return max(abs(lp - (x[i, tid] - lse[i]))
               for i, step in enumerate(result.logprobs) for tid, lp in step.top)


def generate(engine, prompt: str, images, **kw):
    return engine.generate(GenerationRequest(
        prompt=prompt, use_chat_template=False, images=images, max_tokens=TOKENS,
        sampling=SamplingConfig(logprobs=True, top_logprobs=TOP), **kw)).run_to_end()


@pytest.mark.parametrize('projector, sizes, prompt', CASES)
def test_images_lay_out_and_decode_as_llamacpps_mtmd(tmp_path, pair, projector, sizes, prompt):
    text, mmproj, engine = pair(projector)
    images = [image(7 + i, h, w) for i, (h, w) in enumerate(sizes)]
    if projector == 'mlp' and len(images) == 2:
        images[1] = images[0]
    data = mtmd_run(text, mmproj, images, prompt, tmp_path)
    prepared = engine.prepare(GenerationRequest(prompt=prompt, use_chat_template=False,
                                                images=images, max_tokens=TOKENS))
    ids, spans = mtmd_layout(data)
    assert (list(prepared.prompt_ids), list(prepared.spans)) == (ids, spans)
    result = generate(engine, prompt, images)
    assert result.error == ''
    assert result.token_ids == [int(t) for t in data['tokens']]
    assert result.prompt_tokens == len(ids) + sum(rows for _, rows in spans)
    # The image's embeddings reach the logits as llama.cpp's do: within 1.2 % of the peak
    # logit (measured 0.5-1.01 %: the language model's 8-bit weights and activations; mtmd's
    # own rows fed in the wire form give the same gaps, 1.01 % for gemma3's 32 x 32), while
    # another image moves them beyond it (1.4-8 times as far; least for a letterboxed,
    # mostly grey tile).
    tolerance = 0.012 * float(np.abs(data['logits']).max())
    assert logprob_gap(result, data['logits']) <= tolerance
    other = generate(engine, prompt, [image(99, h, w) for h, w in sizes])
    assert logprob_gap(other, data['logits']) > tolerance


def test_images_in_a_chat_turn_go_where_the_marker_is(tmp_path, pair):
    text, mmproj, engine = pair('idefics3')
    img = image(3, 30, 45)
    messages_prompt = engine.tokenizer.apply_chat_template(
        [{'role': 'user', 'content': 'What is in <__media__> this?'}], True)
    data = mtmd_run(text, mmproj, [img], messages_prompt, tmp_path)
    result = engine.generate(GenerationRequest(prompt='What is in <__media__> this?',
                                               images=[img], max_tokens=TOKENS)).run_to_end()
    assert result.token_ids == [int(t) for t in data['tokens']]


def test_images_in_later_turns_go_where_their_markers_are(tmp_path, pair):
    """An image in the first user turn and another in the third, after the assistant's."""
    text, mmproj, engine = pair('internvl')
    first, second = image(4, 30, 45), image(5, 32, 32)
    turns = [{'role': 'user', 'content': 'What is in <__media__> this?'},
             {'role': 'assistant', 'content': 'A box.'},
             {'role': 'user', 'content': 'And here: <__media__> ?'}]
    data = mtmd_run(text, mmproj, [first, second],
                    engine.tokenizer.apply_chat_template(turns, True), tmp_path)
    messages = [ChatMessage(role=t['role'], content=t['content']) for t in turns]
    prepared = engine.prepare(GenerationRequest(messages=messages, images=[first, second],
                                                max_tokens=TOKENS))
    ids, spans = mtmd_layout(data)
    assert (list(prepared.prompt_ids), list(prepared.spans)) == (ids, spans)
    result = engine.generate(GenerationRequest(messages=messages, images=[first, second],
                                               max_tokens=TOKENS)).run_to_end()
    assert result.token_ids == [int(t) for t in data['tokens']]


def test_bad_images_are_refused_before_any_model_work(pair):
    _, _, engine = pair('mlp')
    good = image(1, 32, 32)
    for bad, match in [(np.zeros((0, 4, 3), np.uint8), 'at least one pixel'),
                       (np.zeros((4, 4), np.uint8), r'RGB \[height, width, 3\] uint8'),
                       (np.zeros((4, 4, 4), np.uint8), 'RGB'),
                       (np.zeros((4, 4, 3), np.float32), 'uint8'),
                       ('photo.jpg', 'RGB uint8 array')]:
        with pytest.raises(ImageInputError, match=match):
            engine.prepare(GenerationRequest(prompt='<__media__>', use_chat_template=False,
                                             images=[bad], max_tokens=8))
    with pytest.raises(ImageInputError, match='megapixels'):
        from edge_llm_ros.runtime.media import DeclaredImage
        engine.prepare(GenerationRequest(prompt='<__media__>', use_chat_template=False,
                                         images=[DeclaredImage(10000, 10000)],
                                         max_tokens=8))
    with pytest.raises(ImageInputError, match='1 <__media__> markers for 2 images'):
        engine.prepare(GenerationRequest(prompt='<__media__>', use_chat_template=False,
                                         images=[good, good], max_tokens=8))
    with pytest.raises(ContextOverflowError, match='images take'):
        engine.prepare(GenerationRequest(prompt='<__media__>' * 4, use_chat_template=False,
                                         images=[good] * 4, max_tokens=8))
    # The engine still serves after every refusal.
    result = engine.generate(GenerationRequest(prompt='<__media__> the', images=[good],
                                               use_chat_template=False, max_tokens=3)
                             ).run_to_end()
    assert result.error == '' and result.completion_tokens == 3


def test_a_text_only_model_refuses_images(tmp_path, pair):
    text, _, _ = pair('mlp')
    folder = convert(str(text), str(tmp_path / 'text_only'), progress=False)
    engine = Engine(EngineConfig(model_dir=str(folder), max_context=256))
    try:
        with pytest.raises(ImageInputError, match='no vision encoder'):
            engine.prepare(GenerationRequest(prompt='<__media__>', use_chat_template=False,
                                             images=[image(1, 8, 8)], max_tokens=8))
    finally:
        engine.close()


@pytest.mark.parametrize('projector, case, mmproj_type', [
    # gemma3 with a gemma3 text model whose sliding window is shorter than an image
    ('gemma3', ParityCase(arch='gemma3', wtype='Q8_0', window=3, swa_pattern=2, vision=True),
     'F32'),
    ('internvl', ParityCase(arch='qwen2', wtype='Q8_0', vision=True), 'F32'),  # InternVL's LLM
    ('mlp', ParityCase(arch='phi3', wtype='Q8_0', vision=True), 'F32'),  # a LLaVA-style pair
    # SmolVLM as published: a Q8_0 language model and a Q8_0 mmproj (kept 8-bit in the graph)
    ('idefics3', ParityCase(arch='llama', wtype='Q8_0', vision=True), 'Q8_0'),
], ids=['gemma3', 'internvl-qwen2', 'mlp-phi3', 'idefics3-llama-q8_0-mmproj'])
def test_each_family_with_its_own_language_model_decodes_as_llamacpps_mtmd(
        tmp_path, projector, case, mmproj_type, compat):
    text = write_gguf(tmp_path / 'text.gguf', case)
    mmproj = write_mmproj(tmp_path / 'mm.gguf', projector, n_text=256,
                          scale=SCALES[projector], longest_edge=64, seed=5,
                          weight_type=mmproj_type)
    folder = convert(str(text), str(tmp_path / 'vlm'), mmproj=str(mmproj), progress=False)
    images = [image(4, 32, 32), image(5, 24, 40)]
    prompt = 'Look <__media__> and <__media__> then'
    data = mtmd_run(text, mmproj, images, prompt, tmp_path)
    engine = Engine(EngineConfig(model_dir=str(folder), max_context=256, intra_op_threads=1,
                                 prefix_reuse=False))
    try:
        result = generate(engine, prompt, images)
        assert result.error == ''
        assert result.token_ids == [int(t) for t in data['tokens']]
        compat(case.arch, case.wtype, 'vision')
    finally:
        engine.close()


def test_gemma3_images_are_one_bidirectional_forward_each(pair):
    """Each image is one prefill piece, whatever the chunk size, and only it sees both ways."""
    _, _, engine = pair('gemma3')
    assert engine.model_info()['capabilities']['vision']
    images = [image(1, 32, 32), image(2, 20, 40)]
    prepared = engine.prepare(GenerationRequest(
        prompt='Hi <__media__> the <__media__> sky', use_chat_template=False,
        images=images, max_tokens=4))
    assert prepared.whole_spans and len(prepared.spans) == 2
    encoded = [engine.vision.encode(im) for im in images]
    prepared = prepared.bind_images([e.rows for e in encoded], [e.digest for e in encoded])
    from edge_llm_ros.runtime.sequence import Sequence
    seq = Sequence(engine.tokenizer, prepared, None, (), t0=0.0)
    pieces = seq.chunks(0, 1)   # one-position chunks split the text, never an image
    for at, rows in prepared.spans:
        assert (at, at + rows) in pieces and seq.whole_span(at, at + rows)
    assert all(b - a == 1 for a, b in pieces if not seq.whole_span(a, b))
    # A reused prefix that would end inside an image restarts at its first row.
    from edge_llm_ros.runtime import media
    at, rows = prepared.spans[0]
    assert media.span_floor(prepared.spans, at + 1) == at
    assert media.span_floor(prepared.spans, at + rows) == at + rows


def test_a_gemma3_folder_without_the_bidirectional_input_refuses_images(tmp_path, pair):
    """A model.onnx converted before the input existed: text works, images say reconvert."""
    import shutil
    import yaml
    pair('gemma3')
    _, _, mlp = pair('mlp')
    old = tmp_path / 'old'
    shutil.copytree(mlp.model_dir, old)        # a decoder graph without `bidirectional`
    gemma3 = pathlib.Path(mlp.model_dir).parent / 'gemma3'
    shutil.copy(gemma3 / 'vision.onnx', old / 'vision.onnx')
    meta = yaml.safe_load((old / 'model.yaml').read_text())
    meta['vision'] = yaml.safe_load((gemma3 / 'model.yaml').read_text())['vision']
    (old / 'model.yaml').write_text(yaml.safe_dump(meta, sort_keys=False))
    engine = Engine(EngineConfig(model_dir=str(old), max_context=256))
    try:
        with pytest.raises(ImageInputError, match='reconvert the model'):
            engine.prepare(GenerationRequest(prompt='<__media__>', use_chat_template=False,
                                             images=[image(1, 32, 32)], max_tokens=8))
        result = engine.generate(GenerationRequest(prompt='the sky', use_chat_template=False,
                                                   max_tokens=3)).run_to_end()
        assert result.error == '' and result.completion_tokens == 3
    finally:
        engine.close()


# Square, wide, tall and odd sizes (height, width): resized, tiled or letterboxed by each
# family. 96 x 160 is issue 40's held-out size; 1 x 1 the smallest image; 53 x 89 primes.
SIZES = [(48, 48), (96, 160), (211, 97), (97, 211), (127, 333), (33, 517), (1, 1), (2, 3),
         (53, 89), (89, 53)]


def gelu_inputs(folder: pathlib.Path, vision, img: np.ndarray) -> list:
    """Return our graph's GELU (and quick GELU) inputs for img's tiles, in graph order.

    convert/vision_graph.py rounds each to float16 first, Cast(Cast(x, float16), float):
    the x behind a Gelu node's input, or behind the Mul that feeds a quick GELU's Sigmoid.
    """
    model = onnx.load(str(folder / 'vision.onnx'))
    made = {out: node for node in model.graph.node for out in node.output}

    def unrounded(name: str) -> str:
        return made[made[name].input[0]].input[0]

    names = [unrounded(n.input[0]) if n.op_type == 'Gelu' else
             unrounded(made[n.input[0]].input[0])
             for n in model.graph.node if n.op_type in ('Gelu', 'Sigmoid')]
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names)
    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=['CPUExecutionProvider'])
    tiles = np.stack(preprocess(img, vision).tiles)
    return session.run(names, {session.get_inputs()[0].name: tiles})


def mtmd_gelu_inputs(data, ours: list) -> list:
    """Return mtmd's GELU inputs shaped as ours, for those clip.cpp names (`ffn_up_b`).

    They are dumped tile by tile; the `mlp` projector's GELU input has no name.
    mtmd_helper_eval_chunks encodes the image again: the first encode's tiles are taken.
    """
    keys = sorted((k for k in data if k.startswith('dump_')), key=lambda k: int(k.split('_')[1]))
    per_tile = len({k.split('_', 2)[2] for k in keys})
    return [np.concatenate([data[k].reshape(mine.shape[1:])[None]
                            for k in keys[i::per_tile][:len(mine)]])
            for i, mine in enumerate(ours[:per_tile])]


@pytest.fixture(scope='module')
def tables(tmp_path_factory):
    """Return ggml-cpu's float16 GELU and quick GELU tables, read from the peer's library."""
    return ggml_tables(tmp_path_factory.mktemp('ggml_tables') / 'tables.npz')


def ggml_gelu(x: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Return ggml's GELU of float32 x: its float16 table between -10 and 10."""
    looked_up = table[x.astype(np.float16).view(np.uint16)]
    return np.where(x >= 10, x, np.where(x <= -10, 0, looked_up))


@pytest.mark.parametrize('projector', ['idefics3', 'gemma3', 'internvl', 'mlp'])
@pytest.mark.parametrize('height, width', SIZES, ids=str)
def test_any_image_size_embeds_and_decodes_as_llamacpps_mtmd(tmp_path, pair, tables,
                                                             projector, height, width):
    """Every image row as mtmd's, then the same 32 greedy ids.

    The graph keeps ggml's float16 roundings (the im2col of the patch embedding; GELU and
    quick GELU as float16 tables, test_vision_encoder.py: exact ones did not change a bit of
    these rows). Every stage before a GELU matches mtmd's to float32 noise (its intermediate
    tensors compared, docs/vision.md). What is left are float16 rounding ties: a GELU input
    within float32 noise of the midpoint of two float16 values rounds to one in ggml and to
    the other here (1 to 200 per image here, most moving nothing visible), because the
    matmul before it sums in another order. They are checked as ties:
    - the first GELU's inputs (nothing but float32 arithmetic before them) are within 1e-6
      of mtmd's (measured 4.2e-7 at most), so every float16 rounding that differs there
      is a tie;
    - internvl's projector (LayerNorm, Linear, GELU, Linear) turns a tie into a whole
      float16 step times a column of mm.model.mlp.3: those steps, taken from both sides'
      GELU inputs, account for the rows to 1e-5 (measured: what is left is 5-8e-7 at every
      size; at 211 x 97, height x width, a row 1.4e-4 away is one such step: mtmd's input
      there is 1 float32 ulp below the midpoint, ours on it);
    - every value is within 1e-4 of mtmd's but where an encoder tie spreads through the
      layers after it, bounded at 2e-4 (idefics3 at 89 x 53: 1.3e-4; the same graph with
      its matmuls summed in float64 is as far from mtmd, docs/vision.md);
    - the mean difference stays within 1e-5 of the RMS (measured 1.2e-7 to 4.5e-6): a
      systematic difference would show there.
    """
    text, mmproj, engine = pair(projector)
    img = image(height + width, height, width)
    prompt = 'a <__media__> sky'
    data = mtmd_run(text, mmproj, [img], prompt, tmp_path, extra=('--dump', 'ffn_up_b'))
    theirs = np.concatenate([data[f'embeds_{i}'] for i in range(int(data['n_chunks']))])
    ours = engine.vision.encode(img).rows
    assert ours.shape == theirs.shape
    diff = np.abs(ours - theirs)
    rms = float(np.sqrt((theirs ** 2).mean()))
    assert float(diff.mean()) <= 1e-5 * rms, float(diff.mean()) / rms
    our_inputs = gelu_inputs(mmproj.parent / projector, engine.vision.vision, img)
    their_inputs = mtmd_gelu_inputs(data, our_inputs)
    assert float(np.abs(our_inputs[0] - their_inputs[0]).max()) <= 1e-6
    assert float(diff.max()) <= 2e-4
    if projector == 'internvl':  # the projector's ties taken out
        steps = (ggml_gelu(our_inputs[-1], tables['gelu'])
                 - ggml_gelu(their_inputs[-1], tables['gelu']))
        w3 = next(t.data for t in gguf.GGUFReader(str(mmproj)).tensors
                  if t.name == 'mm.model.mlp.3.weight')  # [out, in]
        moved = (steps @ np.asarray(w3, np.float64).T).reshape(ours.shape)
        assert float(np.abs(ours - theirs - moved).max()) <= 1e-5
    result = generate(engine, prompt, [img])
    assert result.error == ''
    assert result.token_ids == [int(t) for t in data['tokens']]
    # mtmd's own rows in the wire form (a one-column grid for a tall image: refused before)
    # give the same ids.
    wire = encoded_form(theirs, grid_for(height, width, engine.vision.vision),
                        int(engine.vision.vision['tokens_per_tile']))
    fed = generate(engine, prompt, [wire])
    assert fed.token_ids == result.token_ids
