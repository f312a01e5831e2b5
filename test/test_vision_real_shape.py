"""SmolVLM-256M's vision encoder at its real shape (random weights) against llama.cpp's libmtmd.

The mmproj has SmolVLM-256M's SigLIP: 512 px tiles of 16 px patches, 12 layers 768 wide,
pixel unshuffle 4 into a 576-wide language model (64 rows per tile), written in F16 as
people download it. It is converted in a child process (its heap peak is measured there, so
this process's own memory does not count), then a tile and its overview go through vision.onnx
and through libmtmd: every chunk must match (the F16 tolerance of test_vision_encoder.py).
Encode time is reported, not asserted
(bench/bench_vlm.py times it against llama.cpp). Gemma 3's SigLIP-400M (896 px, 27 layers)
takes minutes per image on a 2-core machine: bench_vlm.py runs it, not the suite.
"""
import json
import subprocess
import sys
import time

from gguf_fixtures import ParityCase, write_gguf
from mmproj_fixtures import write_mmproj
import numpy as np
import pytest
from test_vision_encoder import mtmd_embeddings
from tiny_model import TinyDims

from edge_llm_ros.runtime.mmproj_encoder import ImageEncoder

pytestmark = pytest.mark.timeout(900)
SMOLVLM = {'projector': 'idefics3', 'n_embd': 768, 'n_ff': 3072, 'n_layer': 12, 'n_head': 12,
           'image_size': 512, 'patch': 16, 'scale': 4, 'longest_edge': 512}
TEXT = TinyDims(hidden=576, layers=1, heads=9, kv_heads=3, intermediate=1536)
CONVERT = """
import json, resource, sys, time, tracemalloc
from edge_llm_ros.convert.converter import convert
tracemalloc.start()
t = time.perf_counter()
convert(sys.argv[1], sys.argv[2], mmproj=sys.argv[3], progress=False)
print(json.dumps({'seconds': time.perf_counter() - t,
                  'heap_peak': tracemalloc.get_traced_memory()[1],
                  'peak_rss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def test_smolvlm_256m_shape_converts_lean_and_matches_libmtmd(tmp_path):
    text = write_gguf(tmp_path / 'text.gguf',
                      ParityCase(arch='llama', wtype='Q8_0', vision=True, dims=TEXT))
    mmproj = write_mmproj(tmp_path / 'mmproj.gguf', n_text=TEXT.hidden, seed=3,
                          weight_type='F16', **SMOLVLM)
    proc = subprocess.run([sys.executable, '-c', CONVERT, str(text), str(tmp_path / 'vlm'),
                           str(mmproj)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(proc.stdout.strip().splitlines()[-1])
    # The weights stream into vision.onnx.data one tensor at a time. The bound is on the
    # heap (tracemalloc sees every numpy buffer), not on RSS: RSS counts the mapped file's
    # pages as they are read, which varies with the machine's page cache (317 MiB here,
    # 1.2 GiB on a CI run). The float32 encoder held whole would be twice the F16 file;
    # streamed, the peak is one tensor's conversion (measured 59 MiB for the 180 MiB file).
    file_bytes = mmproj.stat().st_size
    assert stats['heap_peak'] <= file_bytes // 2, (stats, file_bytes)
    folder = tmp_path / 'vlm'
    import yaml
    vision = yaml.safe_load((folder / 'model.yaml').read_text())['vision']
    assert (vision['tokens_per_tile'], vision['embedding_size']) == (64, TEXT.hidden)
    encoder = ImageEncoder(folder, vision, threads=2)
    image = np.random.default_rng(5).integers(0, 256, (300, 600, 3), np.uint8)
    t0 = time.perf_counter()
    ours = encoder.encode(image)
    seconds = time.perf_counter() - t0
    theirs = mtmd_embeddings(text, mmproj, image, tmp_path)
    # 600x300 -> longest edge 512 -> one 512 px tile, then the overview.
    assert len(theirs) == 2 and ours.rows.shape == (2 * 64, TEXT.hidden)
    for i, chunk in enumerate(theirs):
        mine = ours.rows[i * 64:(i + 1) * 64]
        cosine = (mine * chunk).sum(-1) / np.linalg.norm(mine, axis=-1) / np.linalg.norm(
            chunk, axis=-1)
        assert cosine.min() >= 0.999, (i, cosine.min())
        rms = float(np.sqrt((chunk ** 2).mean()))
        assert np.abs(mine - chunk).max() <= 0.05 * rms, (i, np.abs(mine - chunk).max() / rms)
    print(f'\nSmolVLM-256M shape: converted in {stats["seconds"]:.1f} s, heap peak '
          f'{stats["heap_peak"] / 2**20:.0f} MiB, peak RSS {stats["peak_rss"] / 2**20:.0f} MiB '
          f'for a {file_bytes / 2**20:.0f} MiB mmproj; '
          f'2 tiles encoded in {seconds:.2f} s (preprocess {ours.preprocess_s:.2f} s)')
