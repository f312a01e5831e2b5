"""BERT-style embedding and rerank models against llama.cpp's own vectors on the same GGUF.

Tiny random `bert` GGUFs (test/bert_fixture.py) in F32, F16 and Q8_0, with mean, CLS and last
pooling, `nomic-bert` ones (nomic-embed-text's layout) in F32, F16 and Q8_0 with mean
pooling, and a cross-encoder with its classifier head (rank pooling), are converted and run by
runtime/encoder.py; llama.cpp (the llama-cpp-python peer, test/llama_cpp_embed_runner.py)
embeds the same texts from the same file. Each text's vector must have cosine >= 0.9999 with
llama.cpp's, its token ids must be llama.cpp's, and rerank scores must match to 1e-3.
"""
import json
import pathlib
import subprocess
import sys

from bert_fixture import BertCase, TEXTS, write_bert_gguf
from llama_cpp_parity import peer_python
import numpy as np
import pytest

from edge_llm_ros.convert.converter import convert
from edge_llm_ros.runtime import native_ops
from edge_llm_ros.runtime.encoder import TextEncoder

RUNNER = pathlib.Path(__file__).with_name('llama_cpp_embed_runner.py')
COSINE = 0.9999
CASES = [BertCase('F32', 'mean'), BertCase('F16', 'mean'), BertCase('Q8_0', 'mean'),
         BertCase('F16', 'cls', seed=1), BertCase('Q8_0', 'last', seed=2)]
# nomic-embed-text (v1, v1.5): rotary positions, fused q|k|v, SwiGLU, no biases.
NOMIC_CASES = [BertCase(t, 'mean', seed=5, arch='nomic-bert') for t in ('F32', 'F16', 'Q8_0')]

needs_native = pytest.mark.skipif(native_ops.library_path() is None,
                                  reason='the op library (native/) is not built')


def llama_cpp_vectors(gguf, texts, tmp_path, pooling='gguf'):
    """Return llama.cpp's (vectors, token ids per text) for `texts` (strings or id lists)."""
    src = tmp_path / 'texts.json'
    src.write_text(json.dumps(texts))
    out = tmp_path / 'llama.npz'
    subprocess.run([peer_python(), str(RUNNER), str(gguf), str(out), str(src),
                    '--pooling', pooling], check=True, timeout=300)
    d = np.load(out)
    return d['vectors'], np.split(d['tokens'], np.cumsum(d['lengths'])[:-1])


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@needs_native
@pytest.mark.parametrize('case', CASES + NOMIC_CASES, ids=lambda c: c.tag)
def test_embeddings_match_llama_cpp(case, tmp_path, compat):
    gguf = write_bert_gguf(tmp_path / f'{case.tag}.gguf', case)
    folder = convert(str(gguf), str(tmp_path / 'model'), progress=False)
    ref, ref_ids = llama_cpp_vectors(gguf, list(TEXTS), tmp_path)
    enc = TextEncoder(str(folder))
    ours = enc.embed(list(TEXTS))
    ids = enc.tokenize(list(TEXTS), truncate=False)
    assert [list(map(int, r)) for r in ref_ids] == ids
    cos = (ours.vectors * unit(ref)).sum(axis=1)
    assert cos.min() >= COSINE, f'{case.tag}: cosine per text {cos}'
    compat(case.arch, case.wtype, 'embeddings')


# Q8_0: one 19-token pair's states differ from llama.cpp's by 4e-3 (relative). Not ours: our
# states equal an exact float64 emulation of ggml's ops (q8_0 activations) to 1e-7 at every
# length. llama.cpp's float attention matmuls take tinyBLAS or ggml's vec_dot by shape (e.g.
# token count a multiple of 4), summing in another order (1e-7); where that moves a value
# across a Q8_0 activation rounding step, the next layer sees a whole quantization step, and
# this tiny random model amplifies it (a 1e-5 perturbation gives 7e-3; 1e-6 flips nothing).
# Which lengths flip is chance (here 19 tokens; a sweep of one Q8_0 file: only 15 of 8..32).
# docs/embeddings.md, "Q8_0 and llama.cpp". Its cell is not recorded.
Q8_0_PAIR = pytest.param('Q8_0', marks=pytest.mark.xfail(
    reason="a 19-token Q8_0 pair: llama.cpp's own Q8_0 rounding flips (see the comment above)"))


@needs_native
@pytest.mark.parametrize('wtype', ['F32', 'F16', Q8_0_PAIR])
def test_cross_encoder_scores_match_llama_cpp(wtype, tmp_path, compat):
    case = BertCase(wtype, 'rank', seed=3)
    gguf = write_bert_gguf(tmp_path / 'rank.gguf', case)
    folder = convert(str(gguf), str(tmp_path / 'model'), progress=False)
    enc = TextEncoder(str(folder))
    query, docs = TEXTS[1], list(TEXTS[:4]) + [TEXTS[6]]
    pairs = enc.tokenize([query] * len(docs), truncate=False, pairs=docs)
    ref, _ = llama_cpp_vectors(gguf, pairs, tmp_path, pooling='rank')
    scores = enc.rerank(query, docs)
    assert np.abs(scores - ref[:, 0]).max() <= 1e-3 * max(1.0, np.abs(ref).max()), (scores, ref)
    assert np.argsort(-scores).tolist() == np.argsort(-ref[:, 0]).tolist()
    compat('bert', case.wtype, 'rerank')


if __name__ == '__main__':
    sys.exit(pytest.main([__file__, '-q']))
