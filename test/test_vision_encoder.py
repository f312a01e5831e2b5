"""The mmproj encoders as ONNX graphs (convert/vision_graph.py) against llama.cpp's libmtmd.

Tiny random mmproj files (test/mmproj_fixtures.py) paired with a tiny 256-wide text model;
llama.cpp's own multimodal library (llama-cpp-python's mtmd bindings in the peer venv,
test/mtmd_runner.py) preprocesses and encodes the same image. First images of one tile exactly
(llama.cpp's resizes are then copies: the encoders alone), then images of other sizes through
runtime/mmproj_preprocess.py (gemma3's letterbox, idefics3's tiles and overview, internvl's tiles
and thumbnail, mlp's grey letterbox), read from model.yaml's vision section: every image chunk
mtmd makes must match ours, and grid_for must count them from the size alone. Stated
tolerance: cosine >= 0.9999 per token, max |difference| <= 1 % of the embeddings' RMS and the
mean |difference| <= 3e-5 of it (the graph keeps llama.cpp's float16 roundings: the im2col of
the patch embedding and the GELU table; without them the mean is 5e-5 to 2.4e-4). Measured:
cosine 1.0000 on every chunk, the mean at most 1.1e-5 of the RMS (a few float16 rounding
flips: one GELU input rounded to the other neighbour than in ggml); resizing the height before
the width (Pillow's own order for a tall image) already fails it at 0.9994.
"""
import pathlib
import subprocess

from gguf_fixtures import ParityCase, write_gguf
from llama_cpp_parity import ggml_tables, peer_python
from mmproj_fixtures import write_mmproj
import numpy as np
import onnxruntime as ort
import pytest
from test_mmproj import with_keys

from edge_llm_ros.convert.mmproj import MmprojError, read_mmproj
from edge_llm_ros.convert.vision_graph import (_Graph, _normalized, build_encoder,
                                               model_yaml_section)
from edge_llm_ros.errors import ModelLoadError
from edge_llm_ros.runtime.mmproj_preprocess import (gemma3_tiles, grid_for, idefics3_tiles,
                                                    ImageShapeError, LLAVA_GREY, preprocess)

RUNNER = pathlib.Path(__file__).resolve().parent / 'mtmd_runner.py'
TEXT_WIDTH = ParityCase().dims.hidden


@pytest.fixture(scope='module')
def text_model(tmp_path_factory) -> pathlib.Path:
    return write_gguf(tmp_path_factory.mktemp('vlm') / 'text.gguf',
                      ParityCase(arch='llama', wtype='F32'))


def mtmd_embeddings(text: pathlib.Path, mmproj: pathlib.Path, image: np.ndarray,
                    work: pathlib.Path) -> list:
    np.save(work / 'image.npy', image)
    out = work / 'mtmd.npz'
    proc = subprocess.run([peer_python(), str(RUNNER), str(text), str(mmproj),
                           str(work / 'image.npy'), str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = np.load(out)
    return [data[f'embeds_{i}'] for i in range(int(data['n_chunks']))]


def our_embeddings(mmproj: pathlib.Path, image: np.ndarray) -> np.ndarray:
    mm = read_mmproj(mmproj)
    session = ort.InferenceSession(build_encoder(mm).SerializeToString(),
                                   providers=['CPUExecutionProvider'])
    (out,) = session.run(None, {'pixels': image[None]})
    assert out.shape == (1, mm.config.tokens_per_tile, mm.config.n_out)
    return out[0]


@pytest.mark.parametrize('projector, scale, chunks', [
    ('gemma3', 4, 1),    # one image, 8 x 8 patches pooled 4 x 4: 4 tokens
    ('idefics3', 2, 2),  # a 1 x 1 grid tile and the overview, 16 tokens each
    ('internvl', 2, 1),  # CLS appended last (llama.cpp), unshuffled by 2: 16 tokens
    ('mlp', None, 1),    # CLS last, one layer fewer, rows 1..64: 64 tokens
])
def test_image_embeddings_match_llamacpps_mtmd(tmp_path, text_model, projector, scale, chunks):
    mmproj = write_mmproj(tmp_path / f'{projector}.gguf', projector, n_text=TEXT_WIDTH,
                          scale=scale, longest_edge=32, seed=5)
    image = np.random.default_rng(7).integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
    ours = our_embeddings(mmproj, image)
    theirs = mtmd_embeddings(text_model, mmproj, image, tmp_path)
    assert len(theirs) == chunks
    for chunk in theirs:
        assert chunk.shape == ours.shape
        _close(ours, chunk)


def _close(ours: np.ndarray, chunk: np.ndarray) -> None:
    """Check one chunk against mtmd's at the module's stated tolerance."""
    cosine = (ours * chunk).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(
        chunk, axis=-1)
    assert cosine.min() >= 0.9999, cosine
    rms = float(np.sqrt((chunk ** 2).mean()))
    diff = np.abs(ours - chunk)
    assert diff.max() <= 0.01 * rms and diff.mean() <= 3e-5 * rms, diff.mean() / rms


@pytest.mark.parametrize('projector, scale, weight_type', [
    ('idefics3', 2, 'F16'), ('idefics3', 2, 'Q8_0'), ('gemma3', 4, 'Q8_0'), ('mlp', None, 'F16')])
def test_quantized_mmproj_files_match_llamacpps_mtmd(tmp_path, text_model, projector, scale,
                                                     weight_type):
    """F16 and Q8_0 mmproj files (as downloaded) are read exactly.

    llama.cpp then rounds its activations to F16 / Q8_0 in those matmuls (this graph rounds
    them to float16 before an F16 matrix too; Q8_0 matrices stay 8-bit blocks with int8
    activations per block, rounded by onnxruntime's quantizer, whose block scale is float32
    where ggml's is float16), so the stated tolerance is wider: cosine >= 0.999, 5 % of the
    RMS; F16 also a mean |difference| <= 3e-5 of the RMS (measured: F16 cosine 1.0000, 1.7e-4
    of the RMS, mean 6.6e-6, 2.4e-4 without the float16 activations; Q8_0 0.99998 and 1.9 %).
    """
    mmproj = write_mmproj(tmp_path / f'{projector}.gguf', projector, n_text=TEXT_WIDTH,
                          scale=scale, longest_edge=32, seed=5, weight_type=weight_type)
    image = np.random.default_rng(7).integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
    ours = our_embeddings(mmproj, image)
    for chunk in mtmd_embeddings(text_model, mmproj, image, tmp_path):
        cosine = (ours * chunk).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(
            chunk, axis=-1)
        assert cosine.min() >= 0.999, cosine
        rms = float(np.sqrt((chunk ** 2).mean()))
        assert np.abs(ours - chunk).max() <= 0.05 * rms, np.abs(ours - chunk).max() / rms
        if weight_type == 'F16':
            assert np.abs(ours - chunk).mean() <= 3e-5 * rms, np.abs(ours - chunk).mean() / rms
    # The file's own values, not a requantization: the graph holds gguf's dequantization.
    from gguf import GGUFReader
    from gguf.quants import dequantize
    reader = GGUFReader(str(mmproj))
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert weight_type in set(kinds.values())
    mm = read_mmproj(mmproj)
    graph = {i.name: i for i in build_encoder(mm).graph.initializer}
    t = next(t for t in reader.tensors if t.name == 'v.blk.0.attn_q.weight')
    from onnx import numpy_helper
    held = [numpy_helper.to_array(v) for v in graph.values()]
    if weight_type == 'Q8_0':   # 8-bit blocks: the codes and scales, dequantized here
        codes, scales = (numpy_helper.to_array(graph[f'v.blk.0.attn_q.{part}'])
                         for part in ('qweight', 'scales'))
        held = [(codes.astype(np.float32) - 128) * scales[..., None]]
        assert codes.dtype == np.uint8 and codes.shape[-1] == 32
    want = dequantize(t.data, t.tensor_type).reshape(-1)
    assert any(h.size == want.size and (np.array_equal(h.reshape(-1), want) or
               np.array_equal(h.T.reshape(-1), want)) for h in held)


def _tiles_match(mmproj: pathlib.Path, tiles: list, theirs: list) -> None:
    assert len(theirs) == len(tiles)
    for tile, chunk in zip(tiles, theirs):
        _close(our_embeddings(mmproj, tile), chunk)


@pytest.mark.parametrize('height, width', [(30, 45), (50, 20), (7, 9)])
def test_gemma3_letterboxes_any_image_as_llamacpp_does(tmp_path, text_model, height, width):
    mmproj = write_mmproj(tmp_path / 'g.gguf', 'gemma3', n_text=TEXT_WIDTH, scale=4, seed=2)
    image = np.random.default_rng(height).integers(0, 256, (height, width, 3), np.uint8)
    tiles = gemma3_tiles(image, 32)
    assert tiles.tiles[0].shape == (32, 32, 3)
    _tiles_match(mmproj, tiles.tiles, mtmd_embeddings(text_model, mmproj, image, tmp_path))


@pytest.mark.parametrize('height, width, grid', [(30, 45, (2, 2)), (40, 100, (2, 1)),
                                                 (90, 20, (1, 2))])
def test_idefics3_tiles_like_llamacpp(tmp_path, text_model, height, width, grid):
    mmproj = write_mmproj(tmp_path / 'i.gguf', 'idefics3', n_text=TEXT_WIDTH, scale=2,
                          longest_edge=64, seed=4)
    image = np.random.default_rng(width).integers(0, 256, (height, width, 3), np.uint8)
    tiles = idefics3_tiles(image, 32, 64)
    assert tiles.grid == grid and len(tiles.tiles) == grid[0] * grid[1] + 1
    _tiles_match(mmproj, tiles.tiles, mtmd_embeddings(text_model, mmproj, image, tmp_path))


@pytest.mark.parametrize('shape, tiles, grid', [
    ((20, 30), (1, 12), (0, 0)),   # no larger than a tile: stretched, the only chunk
    ((32, 32), (1, 12), (0, 0)),   # exactly one tile: a copy
    ((30, 50), (1, 12), (2, 1)),   # 2 x 1 and the thumbnail
    ((50, 30), (1, 12), (1, 2)),
    ((45, 60), (1, 12), (2, 2)),   # letterboxed into 64 x 64: black bands in the tiles
    ((100, 170), (1, 12), (4, 3)),  # needs 6 x 4 tiles: the best of at most 12
    ((45, 60), (1, 1), (1, 1)),    # max_tiles 1 from the mmproj: one tile and the thumbnail
    ((30, 50), (2, 6), (2, 2)),    # min_tiles 2: libmtmd's candidates are b >= min, not 2 x 1
], ids=lambda v: 'x'.join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_internvl_tiles_like_llamacpp(tmp_path, text_model, monkeypatch, shape, tiles, grid):
    """Measured: cosine 1.0000 on every chunk, tiles row by row then the thumbnail.

    The alternatives fail: the grid stretched instead of letterboxed (HF's way) 0.08 or less,
    the thumbnail first 0.05 or less, the bilinear instead of the bicubic 0.98.
    """
    height, width = shape
    if tiles != (1, 12):
        with_keys(monkeypatch, preproc_min_tiles=tiles[0], preproc_max_tiles=tiles[1])
    mmproj = write_mmproj(tmp_path / 'v.gguf', 'internvl', n_text=TEXT_WIDTH, scale=2, seed=8)
    monkeypatch.undo()
    vision = model_yaml_section(read_mmproj(mmproj), 'vision.onnx')
    assert (vision['min_tiles'], vision['max_tiles']) == tiles
    image = np.random.default_rng(height * width).integers(0, 256, (height, width, 3), np.uint8)
    got = preprocess(image, vision)
    n = grid[0] * grid[1] + 1 if grid[0] else 1
    assert got.grid == grid and len(got.tiles) == n
    assert grid_for(height, width, vision) == (*grid, n)
    _tiles_match(mmproj, got.tiles, mtmd_embeddings(text_model, mmproj, image, tmp_path))


@pytest.mark.parametrize('height, width', [(30, 45), (50, 20), (7, 9), (3, 70), (64, 64)])
def test_mlp_letterboxes_on_grey_as_llamacpp_does(tmp_path, text_model, height, width):
    """Measured: cosine 1.0000 (64 x 64: a resize alone).

    The alternatives fail on every padded shape: on black 0.93, on the image's mean colour
    0.987..0.996, the bilinear 0.9956..0.9998, stretched without bands 0.88..0.93.
    """
    mmproj = write_mmproj(tmp_path / 'm.gguf', 'mlp', n_text=TEXT_WIDTH, seed=9)
    vision = model_yaml_section(read_mmproj(mmproj), 'vision.onnx')
    image = np.random.default_rng(width).integers(0, 256, (height, width, 3), np.uint8)
    got = preprocess(image, vision)
    assert got.grid == (0, 0) and len(got.tiles) == 1 and grid_for(height, width, vision) == (
        0, 0, 1)
    tile = got.tiles[0]
    if height != width:  # the bands are libmtmd's grey, not the image's mean colour
        assert (tile[0, 0] == LLAVA_GREY).all() or (tile[-1, -1] == LLAVA_GREY).all()
    _tiles_match(mmproj, got.tiles, mtmd_embeddings(text_model, mmproj, image, tmp_path))


VISIONS = [
    {'preprocess': 'letterbox_bilinear', 'image_size': 32},
    {'preprocess': 'letterbox_bicubic', 'image_size': 32},
    {'preprocess': 'idefics3_tiles', 'image_size': 32, 'longest_edge': 64},
    {'preprocess': 'idefics3_tiles', 'image_size': 32, 'longest_edge': 0},
    {'preprocess': 'internvl_tiles', 'image_size': 32, 'min_tiles': 1, 'max_tiles': 12},
    {'preprocess': 'internvl_tiles', 'image_size': 16, 'min_tiles': 2, 'max_tiles': 6},
    {'preprocess': 'internvl_tiles', 'image_size': 16, 'min_tiles': 1, 'max_tiles': 3},
]


@pytest.mark.parametrize('vision', VISIONS, ids=lambda v: f'{v["preprocess"]}-{v["image_size"]}')
def test_grid_for_counts_the_tiles_preprocess_makes_without_the_pixels(vision):
    rng = np.random.default_rng(1)
    shapes = [(1, 1), (1, 300), (300, 1), (16, 16), (17, 16), (32, 33), (64, 64), (65, 64)]
    shapes += [tuple(int(v) for v in rng.integers(1, 200, 2)) for _ in range(40)]
    for h, w in shapes:
        tiles = preprocess(np.zeros((h, w, 3), np.uint8), vision)
        cols, rows, n = grid_for(h, w, vision)
        assert (cols, rows) == tiles.grid and n == len(tiles.tiles), (h, w)
        assert all(t.shape == (vision['image_size'],) * 2 + (3,) for t in tiles.tiles)
    with pytest.raises(ModelLoadError, match='vision.preprocess .* reconvert'):
        grid_for(10, 10, {**vision, 'preprocess': 'anyres'})


def test_bad_images_are_refused_before_any_work():
    for bad in (np.zeros((0, 4, 3), np.uint8), np.zeros((4, 4), np.uint8),
                np.zeros((4, 4, 3), np.float32), np.zeros((4, 4, 4), np.uint8)):
        with pytest.raises(ImageShapeError, match=r'\[H, W, 3\] uint8'):
            gemma3_tiles(bad, 32)


def test_convert_writes_the_vision_graph_and_refuses_a_bad_pair(tmp_path, text_model):
    from edge_llm_ros.convert.converter import convert
    from edge_llm_ros.model_format import load_model_info
    mmproj = write_mmproj(tmp_path / 'g.gguf', 'gemma3', n_text=TEXT_WIDTH, scale=4, seed=6)
    out = convert(str(text_model), str(tmp_path / 'vlm'), mmproj=str(mmproj), progress=False)
    vision = load_model_info(str(out)).extra['vision']
    assert (vision['file'], vision['projector'], vision['tokens_per_tile']) == (
        'vision.onnx', 'gemma3', 4)
    assert vision['embedding_size'] == TEXT_WIDTH and vision['attention'] == 'bidirectional'
    session = ort.InferenceSession(str(out / 'vision.onnx'), providers=['CPUExecutionProvider'])
    image = np.random.default_rng(3).integers(0, 256, (32, 32, 3), np.uint8)
    ours = session.run(None, {'pixels': image[None]})[0][0]
    (theirs,) = mtmd_embeddings(text_model, mmproj, image, tmp_path)
    cosine = (ours * theirs).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(
        theirs, axis=-1)
    assert cosine.min() >= 0.9999
    # An execution provider this onnxruntime lacks is a load error, never a quiet CPU run.
    from edge_llm_ros.runtime.mmproj_encoder import ImageEncoder
    assert ImageEncoder(out, vision).providers == ('CPUExecutionProvider',)
    with pytest.raises(ModelLoadError, match='NoSuchExecutionProvider not available .* '
                       'CPUExecutionProvider'):
        ImageEncoder(out, vision, providers=('NoSuchExecutionProvider',))
    # A projector of another width, or a file of another kind: refused, nothing written.
    narrow = write_mmproj(tmp_path / 'n.gguf', 'gemma3', n_text=64, scale=4)
    with pytest.raises(MmprojError, match=f'64-wide .* is {TEXT_WIDTH} wide'):
        convert(str(text_model), str(tmp_path / 'bad'), mmproj=str(narrow), progress=False)
    with pytest.raises(MmprojError, match='not a vision mmproj'):
        convert(str(text_model), str(tmp_path / 'bad'), mmproj=str(text_model), progress=False)
    assert not (tmp_path / 'bad').exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith('.bad')]


def test_the_graph_normalizes_uint8_tiles_as_llamacpp_does_bit_for_bit(tmp_path):
    """(u8 / 255 - mean) / std in float32, planar: the arithmetic of libmtmd's normalize."""
    from onnx import helper, TensorProto
    config = read_mmproj(write_mmproj(tmp_path / 'n.gguf', 'idefics3',
                                      n_text=TEXT_WIDTH, scale=2, seed=1)).config
    g = _Graph()
    out = _normalized(g, config)
    graph = helper.make_graph(
        g.nodes, 'normalize', [helper.make_tensor_value_info('pixels', TensorProto.UINT8,
                                                             ['b', 'h', 'w', 3])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], list(g.inits.values()))
    session = ort.InferenceSession(helper.make_model(graph).SerializeToString(),
                                   providers=['CPUExecutionProvider'])
    tiles = np.random.default_rng(5).integers(0, 256, (2, 16, 24, 3), np.uint8)
    tiles[0, 0, :3] = [[0, 0, 0], [255, 255, 255], [128, 1, 254]]
    (got,) = session.run(None, {'pixels': tiles})
    f = tiles.astype(np.float32) / np.float32(255.0)
    mean, std = (np.asarray(v, np.float32) for v in (config.image_mean, config.image_std))
    want = (f - mean) / std
    assert got.tobytes() == np.ascontiguousarray(want.transpose(0, 3, 1, 2)).tobytes()


def test_a_vision_graph_that_takes_float_pixels_is_refused_with_what_to_do(tmp_path):
    """A vision.onnx from before the normalization moved into the graph: reconvert."""
    from onnx import helper, TensorProto
    from edge_llm_ros.runtime.mmproj_encoder import ImageEncoder
    graph = helper.make_graph(
        [helper.make_node('Identity', ['pixel_values'], ['image_embeds'])], 'old',
        [helper.make_tensor_value_info('pixel_values', TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info('image_embeds', TensorProto.FLOAT, [1, 3, 8, 8])])
    (tmp_path / 'vision.onnx').write_bytes(helper.make_model(graph).SerializeToString())
    with pytest.raises(ModelLoadError, match="not uint8 tiles 'pixels'.*reconvert the model "
                                             'with --mmproj'):
        ImageEncoder(tmp_path, {'file': 'vision.onnx', 'embedding_size': 8})


def test_the_graph_gelu_is_llamacpps_float16_table(tmp_path):
    """GELU and quick GELU as ggml's CPU tables (read from llama.cpp's library) give them.

    GELU: equal for every input from -2 up (x itself from 10, where ggml skips the table);
    below -2, where ggml's 1 + tanhf cancels, 343 of the 37 376 float16 inputs in (-10, 10)
    differ, by at most 2^-15 (one float16 step at -2; a few steps of the tiny values below
    -3.7). Quick GELU: 3 inputs from -2 up one step away; below, within 2^-15. Without the
    float16 roundings either fails.
    """
    from onnx import helper, TensorProto
    from edge_llm_ros.convert.vision_graph import _gelu, _quick_gelu
    tables = ggml_tables(tmp_path / 'tables.npz')
    half = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    x = np.concatenate([half[np.isfinite(half)], [9.9999, 10.0, 10.3, 12.0, -10.0, -10.3,
                                                  0.3333333, -1.2345678]]).astype(np.float32)
    for name, build in (('gelu', _gelu), ('gelu_quick', _quick_gelu)):
        g = _Graph()
        y = build(g, 'x')
        graph = helper.make_graph(
            g.nodes, name, [helper.make_tensor_value_info('x', TensorProto.FLOAT, [None])],
            [helper.make_tensor_value_info(y, TensorProto.FLOAT, None)], list(g.inits.values()))
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid('', 20)])
        (got,) = ort.InferenceSession(model.SerializeToString(),
                                      providers=['CPUExecutionProvider']).run(None, {'x': x})
        want = tables[name][x.astype(np.float16).view(np.uint16)]
        if name == 'gelu':
            want = np.where(x <= -10, 0.0, np.where(x >= 10, x, want))
            assert np.array_equal(got[x >= -2], want[x >= -2])
            assert np.abs(got - want).max() <= 2 ** -15
            continue
        above = x >= -2   # quick GELU: ORT's sigmoid and expf disagree in the far tail
        with np.errstate(over='ignore'):   # the step above 65504 is infinite
            step = np.abs(np.spacing(want[above].astype(np.float16))).astype(np.float32)
        assert (got[above] != want[above]).sum() <= 8
        assert (np.abs(got - want)[above] <= step).all()
        assert np.abs(got - want)[~above].max() <= 2 ** -15
