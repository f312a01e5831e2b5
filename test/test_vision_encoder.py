"""The mmproj encoders as ONNX graphs (convert/vision_graph.py) against llama.cpp's libmtmd.

Tiny random mmproj files (test/mmproj_fixtures.py) paired with a tiny 256-wide text model;
llama.cpp's own multimodal library (llama-cpp-python's mtmd bindings in the peer venv,
test/mtmd_runner.py) preprocesses and encodes the same image. First images of one tile exactly
(llama.cpp's resizes are then copies: the encoders alone), then images of other sizes through
vision/mmproj_preprocess.py (gemma3's letterbox, idefics3's tiles and overview): every image
chunk mtmd makes must match ours. Stated tolerance: cosine >= 0.9999 per token and max
|difference| <= 1 % of the embeddings' RMS (llama.cpp's CPU GELU is an fp16 table, ours exact).
Measured: cosine 1.0000 on every chunk; resizing the height before the width (Pillow's own
order for a tall image) already fails it at 0.9994.
"""
import pathlib
import subprocess

from gguf_fixtures import ParityCase, write_gguf
from llama_cpp_parity import peer_python
from mmproj_fixtures import write_mmproj
import numpy as np
import onnxruntime as ort
import pytest

from edge_llm_ros.convert.mmproj import MmprojError, read_mmproj
from edge_llm_ros.convert.vision_graph import build_encoder
from edge_llm_ros.vision.mmproj_preprocess import (gemma3_tiles, idefics3_tiles, ImageShapeError,
                                                   normalize)

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
    pixels = normalize(image, mm.config.image_mean, mm.config.image_std)[None]
    (out,) = session.run(None, {'pixel_values': pixels})
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
        cosine = (ours * chunk).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(
            chunk, axis=-1)
        assert cosine.min() >= 0.9999, cosine
        rms = float(np.sqrt((chunk ** 2).mean()))
        assert np.abs(ours - chunk).max() <= 0.01 * rms


def _tiles_match(mmproj: pathlib.Path, tiles: list, theirs: list) -> None:
    assert len(theirs) == len(tiles)
    for tile, chunk in zip(tiles, theirs):
        ours = our_embeddings(mmproj, tile)
        cosine = (ours * chunk).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(
            chunk, axis=-1)
        assert cosine.min() >= 0.9999, cosine
        assert np.abs(ours - chunk).max() <= 0.01 * float(np.sqrt((chunk ** 2).mean()))


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
    pixels = normalize(image, vision['image_mean'], vision['image_std'])[None]
    ours = session.run(None, {'pixel_values': pixels})[0][0]
    (theirs,) = mtmd_embeddings(text_model, mmproj, image, tmp_path)
    cosine = (ours * theirs).sum(-1) / np.linalg.norm(ours, axis=-1) / np.linalg.norm(
        theirs, axis=-1)
    assert cosine.min() >= 0.9999
    # A projector of another width, or a file of another kind: refused, nothing written.
    narrow = write_mmproj(tmp_path / 'n.gguf', 'gemma3', n_text=64, scale=4)
    with pytest.raises(MmprojError, match=f'64-wide .* is {TEXT_WIDTH} wide'):
        convert(str(text_model), str(tmp_path / 'bad'), mmproj=str(narrow), progress=False)
    with pytest.raises(MmprojError, match='not a vision mmproj'):
        convert(str(text_model), str(tmp_path / 'bad'), mmproj=str(text_model), progress=False)
    assert not (tmp_path / 'bad').exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith('.bad')]
