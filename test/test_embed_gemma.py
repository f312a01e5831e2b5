"""EmbeddingGemma (`gemma-embedding`) against llama.cpp's own vectors on the same GGUF.

A tiny random gemma-embedding GGUF (gguf_fixtures.write_gguf): gemma3's layers attending both
ways, a symmetric sliding window of 8 on the local layer (layer 0 of 2: pattern 2) with its
own RoPE base, mean pooling, and the dense projections (dense_2 [512, 256], dense_3 [256,
512], the keys llama.cpp reads) as llama.cpp's converter writes them with
--sentence-transformers-dense-modules. Converted by convert/decoder_encoder_graph.py, run by
runtime/encoder.py; llama.cpp (the llama-cpp-python peer) embeds the same texts: token ids
equal and cosine >= 0.9999 per text, in F32, F16 and Q8_0.
"""
import dataclasses
import sys

from bert_fixture import TEXTS
import gguf
from gguf_fixtures import ParityCase, write_gguf
import pytest
from test_embed_parity import COSINE, llama_cpp_vectors, needs_native, unit

from edge_llm_ros.convert.converter import convert
from edge_llm_ros.runtime.encoder import TextEncoder

# Global RoPE base 1e6, local 1e4 (EmbeddingGemma's); a window of 8 (texts are 3-30 tokens).
DIMS = dataclasses.replace(ParityCase.dims, rope_theta=1e6)


def gemma_embedding_gguf(path, wtype: str, dense: int = 512):
    """Write a tiny EmbeddingGemma GGUF (mean pooling, dense projections)."""
    case = ParityCase('gemma-embedding', wtype, seed=4, dims=DIMS, window=8, swa_pattern=2,
                      swa_base=1e4)
    return write_gguf(path, case, header={'pooling_type': gguf.PoolingType.MEAN}, dense=dense)


@needs_native
@pytest.mark.parametrize('wtype', ['F32', 'F16', 'Q8_0'])
def test_embedding_gemma_matches_llama_cpp(wtype, tmp_path, compat):
    gguf_path = gemma_embedding_gguf(tmp_path / f'gemma-embed-{wtype}.gguf', wtype)
    folder = convert(str(gguf_path), str(tmp_path / 'model'), progress=False)
    enc = TextEncoder(str(folder))
    assert (enc.kind, enc.pooling, enc.dimensions) == ('embedding', 'mean', DIMS.hidden)
    ref, ref_ids = llama_cpp_vectors(gguf_path, list(TEXTS), tmp_path)
    ids = enc.tokenize(list(TEXTS), truncate=False)
    assert [list(map(int, r)) for r in ref_ids] == ids
    ours = enc.embed(list(TEXTS))
    cos = (ours.vectors * unit(ref)).sum(axis=1)
    assert cos.min() >= COSINE, f'gemma-embedding {wtype}: cosine per text {cos}'
    compat('gemma-embedding', wtype, 'embeddings')


if __name__ == '__main__':
    sys.exit(pytest.main([__file__, '-q']))
