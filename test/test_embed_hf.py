"""Embedding and rerank models from HF safetensors folders (convert/encoder_hf.py).

Each case writes a tiny encoder GGUF (test/bert_fixture.py) and the HF folder of the same
weights (test/bert_hf_fixture.py: llama.cpp's convert_hf_to_gguf.py mapping inverted, a
tokenizer.json built with `tokenizers` from the same vocabulary). Both are converted: the
folder must give the GGUF's model.onnx and model.onnx.data byte for byte, and the same token
ids, vectors and rerank scores. The GGUF side is itself checked against llama.cpp's own vectors
in test/test_embed_parity.py, so the HF folder is held to llama.cpp through it. A BF16 folder
(stored as F32 here, exactly widened) is held to the F32 GGUF within that parity tolerance.
Then one bad folder per typed error.
"""
import json
import shutil

from bert_fixture import BertCase, TEXTS, write_bert_gguf
from bert_hf_fixture import write_bert_hf_folder
import numpy as np
import pytest

from edge_llm_ros.convert.converter import convert
from edge_llm_ros.convert.encoder import encoder_architecture
from edge_llm_ros.errors import ModelLoadError, UnsupportedModelError
from edge_llm_ros.runtime import native_ops
from edge_llm_ros.runtime.encoder import TextEncoder

COSINE = 0.9999  # test_embed_parity's tolerance against llama.cpp
CASES = [BertCase('F32', 'mean'), BertCase('F16', 'cls', seed=1),
         # XLM-RoBERTa (bge-m3; bge-reranker-v2-m3 below): Unigram vocabulary, offset positions
         BertCase('F16', 'mean', vocab='ugm', seed=4),
         BertCase('F32', 'rank', vocab='ugm', seed=6),
         # nomic-embed-text v1 / v1.5
         BertCase('F32', 'mean', seed=5, arch='nomic-bert'),
         BertCase('F16', 'mean', seed=5, arch='nomic-bert'),
         # jina-embeddings-v2: ALiBi, GEGLU (gated_layers), and the split layout with q/k norms
         BertCase('F32', 'mean', seed=7, arch='jina-bert-v2'),
         BertCase('F16', 'mean', seed=7, arch='jina-bert-v2'),
         BertCase('F32', 'cls', seed=8, arch='jina-bert-v2', split=True),
         # ModernBERT (GEGLU) and granite-embedding R2's SwiGLU with its own local RoPE base
         BertCase('F32', 'mean', seed=9, layers=4, arch='modern-bert'),
         BertCase('F16', 'mean', seed=9, layers=4, arch='modern-bert'),
         BertCase('F32', 'cls', seed=10, layers=4, arch='modern-bert', act='silu')]
PAIRS = ('where is the red cup?', list(TEXTS))

needs_native = pytest.mark.skipif(native_ops.library_path() is None,
                                  reason='the op library (native/) is not built')


def both(case, tmp_path, dtype=''):
    """Return (GGUF model folder, HF model folder) of the case."""
    gguf = write_bert_gguf(tmp_path / f'{case.tag}.gguf', case)
    hf = write_bert_hf_folder(tmp_path / 'hf', gguf, case, dtype)
    return (convert(str(gguf), str(tmp_path / 'from_gguf'), progress=False),
            convert(str(hf), str(tmp_path / 'from_hf'), progress=False))


def outputs(folder):
    """Return the folder's token ids, vectors (or rerank scores) for the test texts."""
    enc = TextEncoder(str(folder))
    if enc.kind == 'rerank':
        query, docs = PAIRS
        return enc.tokenize([query] * len(docs), False, pairs=docs), enc.rerank(query, docs)
    return enc.tokenize(list(TEXTS), truncate=False), enc.embed(list(TEXTS)).vectors


@needs_native
@pytest.mark.parametrize('case', CASES, ids=lambda c: c.tag)
def test_hf_folder_converts_to_the_gguf_graph(case, tmp_path, compat):
    from_gguf, from_hf = both(case, tmp_path)
    for name in ('model.onnx', 'model.onnx.data'):
        assert (from_gguf / name).read_bytes() == (from_hf / name).read_bytes(), name
    ids, vectors = outputs(from_gguf)
    hf_ids, hf_vectors = outputs(from_hf)
    assert hf_ids == ids
    np.testing.assert_array_equal(hf_vectors, vectors)
    import yaml
    meta = yaml.safe_load((from_hf / 'model.yaml').read_text())
    assert meta['embedding']['pooling'] == case.pooling
    assert meta['kind'] == ('rerank' if case.pooling == 'rank' else 'embedding')
    assert meta['architecture'] == case.arch
    compat(case.arch, f'HF {case.wtype}', 'rerank' if case.pooling == 'rank' else 'embeddings')


@needs_native
def test_bf16_folder_matches_the_f32_gguf_within_parity(tmp_path):
    case = BertCase('F32', 'mean', seed=3)
    from_gguf, from_hf = both(case, tmp_path, dtype='BF16')
    ids, vectors = outputs(from_gguf)
    hf_ids, hf_vectors = outputs(from_hf)
    assert hf_ids == ids
    cos = np.sum(vectors * hf_vectors, axis=-1)  # both normalized
    assert cos.min() >= COSINE, cos


@pytest.fixture
def folder(tmp_path):
    """Write the HF bert folder of the F32 mean case (not converted)."""
    case = BertCase('F32', 'mean')
    gguf = write_bert_gguf(tmp_path / f'{case.tag}.gguf', case)
    return write_bert_hf_folder(tmp_path / 'hf', gguf, case)


def edit_config(folder, **changes):
    cfg = json.loads((folder / 'config.json').read_text())
    cfg.update(changes)
    (folder / 'config.json').write_text(json.dumps(cfg))


def test_probe_names_the_architecture(folder):
    assert encoder_architecture(str(folder)) == 'bert'
    edit_config(folder, model_type='llama', architectures=['LlamaForCausalLM'])
    assert encoder_architecture(str(folder)) is None  # a decoder folder: not ours


def test_unknown_encoder_type_is_refused(folder):
    from edge_llm_ros.convert.encoder_hf import EncoderHf
    edit_config(folder, model_type='deberta-v2', architectures=['DebertaV2Model'])
    assert encoder_architecture(str(folder)) is None   # left to the decoder loader's refusal
    with pytest.raises(UnsupportedModelError, match="model_type 'deberta-v2'"):
        EncoderHf(folder)


def test_modern_bert_classifier_is_refused(folder, tmp_path):
    edit_config(folder, model_type='modernbert',
                architectures=['ModernBertForSequenceClassification'])
    with pytest.raises(UnsupportedModelError, match='modern-bert reranker'):
        convert(str(folder), str(tmp_path / 'out'), progress=False)


def test_trust_remote_code_variant_is_refused(folder, tmp_path):
    edit_config(folder, model_type='xlm-roberta', architectures=['XLMRobertaModel'],
                lora_adaptations=['retrieval.query'])
    with pytest.raises(UnsupportedModelError, match='jina-embeddings-v3'):
        convert(str(folder), str(tmp_path / 'out'), progress=False)


def test_nomic_moe_is_refused(folder, tmp_path):
    edit_config(folder, model_type='nomic_bert', architectures=['NomicBertModel'],
                moe_every_n_layers=2)
    with pytest.raises(UnsupportedModelError, match='moe'):
        convert(str(folder), str(tmp_path / 'out'), progress=False)


def test_missing_weights_are_named(folder, tmp_path):
    from bert_hf_fixture import write_safetensors
    from safetensors.numpy import load_file
    arrays = load_file(str(folder / 'model.safetensors'))
    del arrays['encoder.layer.1.output.dense.weight']
    write_safetensors(folder / 'model.safetensors', arrays)
    with pytest.raises(ModelLoadError, match=r'encoder\.layer\.1\.output\.dense\.weight'):
        convert(str(folder), str(tmp_path / 'out'), progress=False)
    (folder / 'model.safetensors').unlink()
    with pytest.raises(ModelLoadError, match='no \\*.safetensors'):
        convert(str(folder), str(tmp_path / 'out'), progress=False)


def test_unmapped_tensor_is_refused(folder, tmp_path):
    from bert_hf_fixture import write_safetensors
    from safetensors.numpy import load_file
    arrays = load_file(str(folder / 'model.safetensors'))
    arrays['encoder.layer.0.attention.self.rel_bias.weight'] = np.zeros((4, 4), np.float32)
    write_safetensors(folder / 'model.safetensors', arrays)
    with pytest.raises(UnsupportedModelError, match='rel_bias'):
        convert(str(folder), str(tmp_path / 'out'), progress=False)


def test_missing_tokenizer_is_refused(folder, tmp_path):
    (folder / 'tokenizer.json').unlink()
    with pytest.raises(ModelLoadError, match='tokenizer.json is missing'):
        convert(str(folder), str(tmp_path / 'out'), progress=False)
    assert not (tmp_path / 'out').exists()


def test_unknown_pooling_is_refused(folder, tmp_path):
    (folder / '1_Pooling' / 'config.json').write_text(json.dumps(
        {'pooling_mode_max_tokens': True}))
    with pytest.raises(UnsupportedModelError, match='not mean, CLS or last'):
        convert(str(folder), str(tmp_path / 'out'), progress=False)
    shutil.rmtree(folder / '1_Pooling')
    with pytest.raises(ModelLoadError, match='1_Pooling'):
        convert(str(folder), str(tmp_path / 'out'), progress=False)


def test_check_says_how_the_folder_converts(folder):
    from edge_llm_ros.convert.check import check_source
    report = check_source(str(folder))
    assert report.ok, report.render()
    assert report.architecture == 'bert' and 'embedding model, pooling mean' in report.summary
    assert [(g.qtype, g.storage) for g in report.groups] == [('F32', 'float32 MatMul')]
    edit_config(folder, model_type='nomic_bert', architectures=['NomicBertModel'],
                moe_every_n_layers=2)
    report = check_source(str(folder))
    assert not report.ok and 'nomic-embed-text-v2-moe' in report.render()


def test_jina_bpe_vocabulary_is_refused(folder, tmp_path):
    edit_config(folder, architectures=['JinaBertForMaskedLM'])  # model_type stays 'bert'
    assert encoder_architecture(str(folder)) == 'jina-bert-v2'
    (folder / 'tokenizer_config.json').write_text(json.dumps(
        {'tokenizer_class': 'RobertaTokenizer'}))
    with pytest.raises(UnsupportedModelError, match='RobertaTokenizer'):
        convert(str(folder), str(tmp_path / 'out'), progress=False)


def test_bert_classifier_is_the_output_layer(tmp_path):
    """Map BertForSequenceClassification's one `classifier` to cls.output, as llama.cpp does."""
    from bert_hf_fixture import write_safetensors
    from safetensors.numpy import load_file
    from edge_llm_ros.convert.encoder_hf import EncoderHf
    case = BertCase('F32', 'rank', seed=2)
    gguf = write_bert_gguf(tmp_path / f'{case.tag}.gguf', case)
    folder = write_bert_hf_folder(tmp_path / 'hf', gguf, case)
    arrays = {k.replace('classifier.out_proj', 'classifier'): v for k, v in
              load_file(str(folder / 'model.safetensors')).items()
              if not k.startswith('classifier.dense')}
    write_safetensors(folder / 'model.safetensors', arrays)
    m = EncoderHf(folder)
    assert m.spec.pooling == 'rank' and m.spec.labels == 1
    assert m.has('cls.output.weight') and not m.has('cls.weight')
    out = convert(str(folder), str(tmp_path / 'out'), progress=False)
    assert TextEncoder(str(out)).rerank(*PAIRS).shape == (len(TEXTS),)
    edit_config(folder, id2label={'0': 'LABEL_0', '1': 'LABEL_1'})  # AutoConfig's dummies
    with pytest.raises(ModelLoadError, match='without its classifier weights'):
        EncoderHf(folder)
