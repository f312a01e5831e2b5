"""Qwen3-Embedding, Qwen3-Reranker and EmbeddingGemma HF folders convert as their GGUFs do.

Each HF folder is written from one of the tiny GGUF fixtures of test_embed_qwen3.py /
test_embed_gemma.py by undoing llama.cpp's convert_hf_to_gguf.py (hf_from_gguf): GGUF names
back to transformers' (bare, as Qwen3Model / Gemma3TextModel save them; the reranker with
Qwen3ForCausalLM's model. prefix and lm_head), Gemma's norms minus the +1 the converter adds,
cls.output back into the head's 'yes' and 'no' rows, dense_2 / dense_3 into the
sentence-transformers modules 2_Dense / 3_Dense, the pooling into modules.json + 1_Pooling, the
vocabulary into tokenizer.json (Qwen3-Embedding's appends its EOS, as the released one does).
Both are converted (convert/encoder_hf_decoder.py for the folder): model.onnx and
model.onnx.data equal byte for byte, the token ids and the vectors / rerank scores equal.

The GGUF side is checked against llama.cpp already: test_embed_qwen3.py and
test_embed_gemma.py embed the same GGUFs with the llama.cpp peer. The tiny vocabulary has no
'yes' / 'no' tokens, which llama.cpp's converter looks up for a reranker's head, so the
reranker pair adds them (write_gguf tokens=): that GGUF is checked against llama.cpp here.
"""
import json
import struct
import sys

from bert_fixture import TEXTS
import gguf
from gguf_fixtures import ParityCase, write_gguf, write_hf
import numpy as np
import pytest
from test_embed_gemma import gemma_embedding_gguf
from test_embed_parity import llama_cpp_vectors, needs_native
from test_embed_qwen3 import embedding_gguf, RERANK_DIMS, RERANK_PROMPT, reranker_gguf
from tiny_model import CHAT_TEMPLATE, EOS_ID, tiny_vocab

from edge_llm_ros.convert.converter import convert
from edge_llm_ros.convert.encoder import encoder_architecture
from edge_llm_ros.convert.encoder_hf_decoder import HfDecoderEncoder
from edge_llm_ros.errors import ModelLoadError, UnsupportedModelError
from edge_llm_ros.model_format import DATA_FILE, MODEL_FILE
from edge_llm_ros.runtime.encoder import TextEncoder
from edge_llm_ros.serving.embedding import EmbeddingConfig, EmbeddingEngine, model_prefixes

# GGUF layer tensor -> transformers' name (qwen3 / gemma3 decoder layers).
HF_LAYER = {'attn_norm': 'input_layernorm', 'attn_q': 'self_attn.q_proj',
            'attn_k': 'self_attn.k_proj', 'attn_v': 'self_attn.v_proj',
            'attn_output': 'self_attn.o_proj', 'attn_q_norm': 'self_attn.q_norm',
            'attn_k_norm': 'self_attn.k_norm', 'ffn_gate': 'mlp.gate_proj',
            'ffn_up': 'mlp.up_proj', 'ffn_down': 'mlp.down_proj',
            'ffn_norm': 'post_attention_layernorm'}
HF_GEMMA_LAYER = dict(HF_LAYER, ffn_norm='pre_feedforward_layernorm',
                      post_attention_norm='post_attention_layernorm',
                      post_ffw_norm='post_feedforward_layernorm')
YES_NO = ('yes', 'no')


def rerank_yes_no_gguf(path, wtype: str = 'F32'):
    """test_embed_qwen3's reranker GGUF with 'yes' and 'no' tokens, cls.output their rows."""
    templates = [{'name': 'default', 'template': CHAT_TEMPLATE},
                 {'name': 'rerank', 'template': RERANK_PROMPT}]
    case = ParityCase('qwen3', wtype, 5, dims=RERANK_DIMS)
    n = len(tiny_vocab())  # the rows of the appended tokens
    return write_gguf(path, case, header={'pooling_type': gguf.PoolingType.RANK,
                                          'classifier_output_labels': list(YES_NO)},
                      tokenizer={'template': templates}, rank_rows=(n, n + 1), tokens=YES_NO)


def _field(reader, key):
    return reader.fields[key].contents()


def hf_from_gguf(gguf_path, folder, pooling: str = '', rerank: bool = False):
    """Write the F32 GGUF as the HF folder llama.cpp's converter would have read it from."""
    from safetensors.numpy import save_file

    from edge_llm_ros.convert.gguf_tokenizer import write_tokenizer_files
    folder.mkdir(parents=True)
    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, 'general.architecture')
    gemma = arch == 'gemma-embedding'
    w = {}
    for t in reader.tensors:
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
        w[t.name] = np.array(t.data, np.float32).reshape([int(x) for x in t.shape[::-1]])

    def key(k, default=None):
        name = f'{arch}.{k}'
        return _field(reader, name) if name in reader.fields else default

    layers = int(key('block_count'))
    names = HF_GEMMA_LAYER if gemma else HF_LAYER
    prefix = 'model.' if rerank else ''  # Qwen3ForCausalLM; the embedders are base models
    hf = {}
    for name, x in w.items():
        if gemma and name.endswith('norm.weight'):
            x = x - np.float32(1.0)  # Gemma3RMSNorm's weight is stored minus 1
        if name.startswith('blk.'):
            _, i, role, _ = name.split('.')
            hf[f'{prefix}layers.{i}.{names[role]}.weight'] = x
        elif name == 'token_embd.weight':
            hf[prefix + 'embed_tokens.weight'] = x
        elif name == 'output_norm.weight':
            hf[prefix + 'norm.weight'] = x
    modules = [{'idx': 0, 'name': '0', 'path': '', 'type': 'sentence_transformers.models.'
                'Transformer'}]
    if rerank:  # the yes / no rows of lm_head are cls.output's (an untied head)
        head = w['output.weight'].copy()
        ids = [len(head) - 2, len(head) - 1]
        head[ids] = w['cls.output.weight']
        hf['lm_head.weight'] = head
        (folder / 'README.md').write_text('# Qwen3-Reranker (tiny)\n')
    if pooling:
        modules.append({'idx': 1, 'name': '1', 'path': '1_Pooling',
                        'type': 'sentence_transformers.models.Pooling'})
        (folder / '1_Pooling').mkdir()
        flag = {'last': 'pooling_mode_lasttoken', 'mean': 'pooling_mode_mean_tokens'}[pooling]
        (folder / '1_Pooling' / 'config.json').write_text(json.dumps({
            'word_embedding_dimension': int(key('embedding_length')), flag: True}))
    for i, dense in ((2, 'dense_2.weight'), (3, 'dense_3.weight')):
        if dense in w:
            sub = folder / f'{i}_Dense'
            sub.mkdir()
            save_file({'linear.weight': w[dense]}, str(sub / 'model.safetensors'))
            out_f, in_f = w[dense].shape
            (sub / 'config.json').write_text(json.dumps({
                'in_features': in_f, 'out_features': out_f, 'bias': False,
                'activation_function': 'torch.nn.modules.linear.Identity'}))
            modules.append({'idx': len(modules), 'name': str(len(modules)),
                            'path': f'{i}_Dense', 'type': 'sentence_transformers.models.Dense'})
    if len(modules) > 1:
        (folder / 'modules.json').write_text(json.dumps(modules))
    save_file(hf, str(folder / 'model.safetensors'), metadata={'format': 'pt'})
    heads = int(key('attention.head_count'))
    config = {
        'model_type': 'gemma3_text' if gemma else 'qwen3',
        'architectures': ['Gemma3TextModel' if gemma else
                          'Qwen3ForCausalLM' if rerank else 'Qwen3Model'],
        'hidden_size': int(key('embedding_length')), 'num_hidden_layers': layers,
        'intermediate_size': int(key('feed_forward_length')), 'num_attention_heads': heads,
        'num_key_value_heads': int(key('attention.head_count_kv')),
        'head_dim': int(key('attention.key_length')),
        'max_position_embeddings': int(key('context_length')),
        'rms_norm_eps': float(key('attention.layer_norm_rms_epsilon')),
        'rope_theta': float(key('rope.freq_base')), 'rope_scaling': None,
        'vocab_size': len(w['token_embd.weight']), 'tie_word_embeddings': not rerank,
        'bos_token_id': int(_field(reader, 'tokenizer.ggml.bos_token_id')),
        'eos_token_id': int(_field(reader, 'tokenizer.ggml.eos_token_id')),
        'hidden_act': 'silu'}
    if gemma:
        period = int(key('attention.sliding_window_pattern'))
        del config['hidden_act']
        config.update(hidden_activation='gelu_pytorch_tanh', use_bidirectional_attention=True,
                      sliding_window=int(key('attention.sliding_window')),
                      rope_local_base_freq=float(key('rope.freq_base_swa')),
                      query_pre_attn_scalar=config['head_dim'],
                      layer_types=['sliding_attention' if i % period < period - 1 else
                                   'full_attention' for i in range(layers)])
    (folder / 'config.json').write_text(json.dumps(config, indent=2))
    # The vocabulary as tokenizer.json (the GGUF's add_eos: a TemplateProcessing appending EOS).
    write_tokenizer_files(reader, folder)
    (folder / 'chat_template.jinja').unlink()
    (folder / 'tokenizer_config.json').write_text(json.dumps({
        'eos_token': '<|im_end|>', 'pad_token': '<|im_end|>', 'add_bos_token': False}))
    return folder


def convert_both(gguf_path, hf, tmp_path):
    """Convert the GGUF and the HF folder; assert their graphs and weights are the same bytes."""
    a = convert(str(gguf_path), str(tmp_path / 'from-gguf'), progress=False)
    b = convert(str(hf), str(tmp_path / 'from-hf'), progress=False)
    for name in (MODEL_FILE, DATA_FILE):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    return a, b


def test_qwen3_embedding_folder_converts_as_its_gguf(tmp_path):
    gguf_path = embedding_gguf(tmp_path / 'embed.gguf', 'F32')
    hf = hf_from_gguf(gguf_path, tmp_path / 'Qwen3-Embedding-tiny', pooling='last')
    assert encoder_architecture(str(hf)) == 'qwen3'
    a, b = convert_both(gguf_path, hf, tmp_path)
    ea, eb = TextEncoder(str(a)), TextEncoder(str(b))
    assert (eb.kind, eb.pooling) == ('embedding', 'last')
    ids = eb.tokenize(list(TEXTS), truncate=False)
    assert ids == ea.tokenize(list(TEXTS), truncate=False)
    assert all(row[-1] == EOS_ID == eb.meta['eos_token_ids'][0] for row in ids)  # add_eos
    np.testing.assert_array_equal(ea.embed(list(TEXTS)).vectors, eb.embed(list(TEXTS)).vectors)
    assert model_prefixes(str(b))[0].startswith('Instruct:')  # named by the folder: the family


def test_qwen3_reranker_folder_converts_as_its_gguf(tmp_path):
    gguf_path = rerank_yes_no_gguf(tmp_path / 'rerank.gguf')
    hf = hf_from_gguf(gguf_path, tmp_path / 'reranker', rerank=True)
    assert encoder_architecture(str(hf)) == 'qwen3'
    a, b = convert_both(gguf_path, hf, tmp_path)
    ra, rb = (EmbeddingEngine(EmbeddingConfig(str(f))) for f in (a, b))
    assert rb.kind == 'rerank' and rb.encoder.rerank_template == RERANK_PROMPT
    query, docs = TEXTS[1], list(TEXTS[:4])
    assert rb.encoder.tokenize([query] * 4, truncate=False, pairs=docs) == \
        ra.encoder.tokenize([query] * 4, truncate=False, pairs=docs)
    want, got = ra.rerank(query, docs), rb.rerank(query, docs)
    np.testing.assert_array_equal(want.scores, got.scores)
    assert list(want.order) == list(got.order)


@needs_native
def test_qwen3_reranker_with_yes_no_tokens_matches_llama_cpp(tmp_path):
    """The yes / no GGUF above through llama.cpp: the same P(yes) as its converted folder."""
    gguf_path = rerank_yes_no_gguf(tmp_path / 'rerank.gguf')
    engine = EmbeddingEngine(EmbeddingConfig(str(convert(str(gguf_path), str(tmp_path / 'm'),
                                                         progress=False))))
    query, docs = TEXTS[1], list(TEXTS[:4]) + [TEXTS[6]]
    ref, ref_ids = llama_cpp_vectors(gguf_path, [{'query': query, 'document': d} for d in docs],
                                     tmp_path, pooling='rank')
    assert [list(map(int, r)) for r in ref_ids] == \
        engine.encoder.tokenize([query] * len(docs), truncate=False, pairs=docs)
    scores = engine.rerank(query, docs).scores
    assert np.abs(scores - ref[:, 0]).max() <= 1e-3, (scores, ref[:, 0])
    assert 0.02 < ref[:, 0].min() and ref[:, 0].max() < 0.98  # scores not saturated


def test_embedding_gemma_folder_converts_as_its_gguf(tmp_path):
    gguf_path = gemma_embedding_gguf(tmp_path / 'gemma.gguf', 'F32')
    hf = hf_from_gguf(gguf_path, tmp_path / 'embeddinggemma-tiny', pooling='mean')
    assert encoder_architecture(str(hf)) == 'gemma-embedding'
    a, b = convert_both(gguf_path, hf, tmp_path)
    ea, eb = TextEncoder(str(a)), TextEncoder(str(b))
    assert (eb.kind, eb.pooling) == ('embedding', 'mean')
    assert eb.tokenize(list(TEXTS), truncate=False) == ea.tokenize(list(TEXTS), truncate=False)
    np.testing.assert_array_equal(ea.embed(list(TEXTS)).vectors, eb.embed(list(TEXTS)).vectors)
    assert model_prefixes(str(b)) == ('task: search result | query: ', 'title: none | text: ')


def save_bf16(tensors, path):
    """Write float32 arrays as a BF16 safetensors file (their top 16 bits; numpy has no BF16)."""
    header, blobs, at = {}, [], 0
    for k, v in tensors.items():
        b = (np.ascontiguousarray(v, np.float32).view(np.uint32) >> 16).astype('<u2').tobytes()
        header[k] = {'dtype': 'BF16', 'shape': list(v.shape), 'data_offsets': [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    head = json.dumps(header).encode()
    head += b' ' * (-len(head) % 8)
    path.write_bytes(struct.pack('<Q', len(head)) + head + b''.join(blobs))


def test_bf16_folder_converts_as_the_f32_it_widens_to(tmp_path):
    """Released folders are BF16: read as the F32 values they are, the same graph bytes."""
    from safetensors.numpy import load_file, save_file
    gguf_path = embedding_gguf(tmp_path / 'embed.gguf', 'F32')
    bf16, f32 = (hf_from_gguf(gguf_path, tmp_path / f'Qwen3-Embedding-{t}', pooling='last')
                 for t in ('bf16', 'f32'))
    weights = load_file(str(f32 / 'model.safetensors'))
    save_bf16(weights, bf16 / 'model.safetensors')
    save_file({k: (v.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
               for k, v in weights.items()}, str(f32 / 'model.safetensors'))
    a = convert(str(bf16), str(tmp_path / 'from-bf16'), progress=False)
    b = convert(str(f32), str(tmp_path / 'from-f32'), progress=False)
    for name in (MODEL_FILE, DATA_FILE):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_tied_reranker_takes_the_embedding_rows(tmp_path):
    """A tied Qwen3-Reranker (no lm_head): cls.output is the embedding's yes / no rows."""
    from safetensors.numpy import load_file, save_file
    hf = hf_from_gguf(rerank_yes_no_gguf(tmp_path / 'rerank.gguf'), tmp_path / 'r', rerank=True)
    weights = load_file(str(hf / 'model.safetensors'))
    del weights['lm_head.weight']
    save_file(weights, str(hf / 'model.safetensors'))
    cfg = json.loads((hf / 'config.json').read_text())
    (hf / 'config.json').write_text(json.dumps(dict(cfg, tie_word_embeddings=True)))
    n = len(tiny_vocab())
    np.testing.assert_array_equal(HfDecoderEncoder(hf).array('cls.output.weight'),
                                  weights['model.embed_tokens.weight'][[n, n + 1]])


def test_eos_asked_by_tokenizer_config_only_is_appended(tmp_path):
    """add_eos_token in tokenizer_config.json, no post-processor: EOS appended (llama.cpp)."""
    gguf_path = embedding_gguf(tmp_path / 'embed.gguf', 'F32')
    hf = hf_from_gguf(gguf_path, tmp_path / 'Qwen3-Embedding-tiny', pooling='last')
    tok = json.loads((hf / 'tokenizer.json').read_text())
    (hf / 'tokenizer.json').write_text(json.dumps(dict(tok, post_processor=None)))
    tcfg = json.loads((hf / 'tokenizer_config.json').read_text())
    (hf / 'tokenizer_config.json').write_text(json.dumps(dict(tcfg, add_eos_token=True)))
    a = TextEncoder(str(convert(str(gguf_path), str(tmp_path / 'a'), progress=False)))
    b = TextEncoder(str(convert(str(hf), str(tmp_path / 'b'), progress=False)))
    ids = b.tokenize(list(TEXTS), truncate=False)
    assert ids == a.tokenize(list(TEXTS), truncate=False)
    assert all(row[-1] == EOS_ID for row in ids)


def test_qwen3_chat_folder_stays_a_chat_model(tmp_path):
    """A Qwen3 folder without a Pooling module and no reranker is the chat converter's."""
    chat = write_hf(tmp_path / 'Qwen3-tiny', ParityCase('qwen3', 'F32'))
    assert encoder_architecture(str(chat)) is None


def test_reranker_folder_without_yes_no_tokens_is_refused(tmp_path):
    """test_embed_qwen3's own reranker vocabulary has no 'yes' / 'no': no head to take."""
    gguf_path = reranker_gguf(tmp_path / 'rerank.gguf', 'F32')
    hf = hf_from_gguf(gguf_path, tmp_path / 'reranker', rerank=True)
    with pytest.raises(UnsupportedModelError, match="no 'yes'/'no' token"):
        convert(str(hf), str(tmp_path / 'out'), progress=False)
    assert not (tmp_path / 'out').exists()


def test_unknown_layout_and_pooling_are_refused(tmp_path):
    from safetensors.numpy import load_file, save_file
    gguf_path = embedding_gguf(tmp_path / 'embed.gguf', 'F32')
    hf = hf_from_gguf(gguf_path, tmp_path / 'odd', pooling='last')
    weights = load_file(str(hf / 'model.safetensors'))
    save_file({'transformer.' + k: v for k, v in weights.items()}, str(hf / 'model.safetensors'))
    with pytest.raises(ModelLoadError, match='embed_tokens'):
        convert(str(hf), str(tmp_path / 'out'), progress=False)
    hf = hf_from_gguf(gguf_path, tmp_path / 'weighted', pooling='last')
    (hf / '1_Pooling' / 'config.json').write_text(json.dumps({'pooling_mode_weightedmean_tokens':
                                                              True}))
    with pytest.raises(UnsupportedModelError, match='none of mean, cls, last token'):
        convert(str(hf), str(tmp_path / 'out'), progress=False)


if __name__ == '__main__':
    sys.exit(pytest.main([__file__, '-q']))
