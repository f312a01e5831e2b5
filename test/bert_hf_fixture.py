"""The tiny encoders of test/bert_fixture.py as HF folders: the same weights, HF's names.

write_bert_hf_folder reads the case's GGUF back and writes what llama.cpp's
convert_hf_to_gguf.py would have converted into it: config.json, model.safetensors under HF's
names and layouts (llama.cpp's mapping inverted), a sentence-transformers Pooling module, and
a tokenizer.json built with the `tokenizers` library from the same vocabulary (BERT's
WordPiece with '##' continuations, or XLM-RoBERTa's Unigram with <s> a </s></s> b </s> pairs).
XLM-RoBERTa's position table gets the pad_token_id + 1 leading rows llama.cpp cuts off (random
rows here, so a wrong offset shows). dtype 'BF16' writes the matrices rounded to bfloat16.
"""
import json
import pathlib

from bert_fixture import BertCase, PAD_ID, SPECIALS, UGM_USER_DEFINED, ugm_vocab, vocab
import numpy as np
from tiny_model import BOS_ID, EOS_ID, MERGES, SPECIAL_TOKENS, tiny_vocab

from edge_llm_ros.convert.encoder_graph import EncoderGguf

# GGUF name -> HF name, {i} a layer (convert_hf_to_gguf.py's mapping, inverted).
BERT_NAMES = {
    'token_embd': 'embeddings.word_embeddings',
    'token_types': 'embeddings.token_type_embeddings',
    'position_embd': 'embeddings.position_embeddings',
    'token_embd_norm': 'embeddings.LayerNorm',
    'blk.{i}.attn_q': 'encoder.layer.{i}.attention.self.query',
    'blk.{i}.attn_k': 'encoder.layer.{i}.attention.self.key',
    'blk.{i}.attn_v': 'encoder.layer.{i}.attention.self.value',
    'blk.{i}.attn_output': 'encoder.layer.{i}.attention.output.dense',
    'blk.{i}.attn_output_norm': 'encoder.layer.{i}.attention.output.LayerNorm',
    'blk.{i}.ffn_up': 'encoder.layer.{i}.intermediate.dense',
    'blk.{i}.ffn_down': 'encoder.layer.{i}.output.dense',
    'blk.{i}.layer_output_norm': 'encoder.layer.{i}.output.LayerNorm',
    'cls': 'classifier.dense',
    'cls.output': 'classifier.out_proj',
}
NOMIC_NAMES = {
    'token_embd': 'embeddings.word_embeddings',
    'token_types': 'embeddings.token_type_embeddings',
    'token_embd_norm': 'emb_ln',
    'blk.{i}.attn_qkv': 'encoder.layers.{i}.attn.Wqkv',
    'blk.{i}.attn_output': 'encoder.layers.{i}.attn.out_proj',
    'blk.{i}.attn_output_norm': 'encoder.layers.{i}.norm1',
    'blk.{i}.ffn_up': 'encoder.layers.{i}.mlp.fc11',
    'blk.{i}.ffn_gate': 'encoder.layers.{i}.mlp.fc12',
    'blk.{i}.ffn_down': 'encoder.layers.{i}.mlp.fc2',
    'blk.{i}.layer_output_norm': 'encoder.layers.{i}.norm2',
}
# jina-bert-v2 (JinaBert): BERT's names, its GEGLU MLP and q / k LayerNorms.
JINA_NAMES = dict(BERT_NAMES, **{
    'blk.{i}.ffn_gate': 'encoder.layer.{i}.mlp.gated_layers_w',
    'blk.{i}.ffn_down': 'encoder.layer.{i}.mlp.wo',
    'blk.{i}.layer_output_norm': 'encoder.layer.{i}.mlp.layernorm',
    'blk.{i}.attn_q_norm': 'encoder.layer.{i}.attention.self.layer_norm_q',
    'blk.{i}.attn_k_norm': 'encoder.layer.{i}.attention.self.layer_norm_k',
    'blk.{i}.attn_norm_2': 'encoder.layer.{i}.layer_norm_1'})
MODERN_NAMES = {
    'token_embd': 'model.embeddings.tok_embeddings',
    'token_embd_norm': 'model.embeddings.norm',
    'blk.{i}.attn_norm': 'model.layers.{i}.attn_norm',
    'blk.{i}.attn_qkv': 'model.layers.{i}.attn.Wqkv',
    'blk.{i}.attn_output': 'model.layers.{i}.attn.Wo',
    'blk.{i}.ffn_norm': 'model.layers.{i}.mlp_norm',
    'blk.{i}.ffn_up': 'model.layers.{i}.mlp.Wi',
    'blk.{i}.ffn_down': 'model.layers.{i}.mlp.Wo',
    'output_norm': 'model.final_norm',
}
XLMR_PAD = 1  # XLM-RoBERTa's <pad>: positions start at 2


def hf_name(gguf_name: str, names: dict) -> str:
    """Return the HF name of a GGUF tensor name."""
    stem, tail = gguf_name.rsplit('.', 1)
    parts = stem.split('.')
    if parts[0] == 'blk':
        key = 'blk.{i}.' + '.'.join(parts[2:])
        return names[key].format(i=parts[1]) + '.' + tail
    return names[stem] + '.' + tail


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest even); return the raw uint16 bits."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def write_safetensors(path: pathlib.Path, arrays: dict) -> None:
    """Write float32 / float16 arrays and BF16 ones (given as (uint16 bits, 'BF16'))."""
    header, blobs, offset = {}, [], 0
    for name, value in arrays.items():
        data, dtype = (value if isinstance(value, tuple)
                       else (value, {'float32': 'F32', 'float16': 'F16'}[value.dtype.name]))
        raw = np.ascontiguousarray(data).tobytes()
        header[name] = {'dtype': dtype, 'shape': list(data.shape),
                        'data_offsets': [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b' ' * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, 'little') + head + b''.join(blobs))


def write_bert_hf_folder(folder, gguf_path, case: BertCase, dtype: str = '') -> pathlib.Path:
    """Write the HF folder of the case's GGUF (written by write_bert_gguf) and return it.

    dtype: '' keeps the GGUF's matrix type (F32 or F16), 'BF16' rounds the matrices.
    """
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    src = EncoderGguf(pathlib.Path(gguf_path))
    s = src.spec
    xlmr = case.vocab == 'ugm'
    nomic = case.arch == 'nomic-bert'
    jina = case.arch == 'jina-bert-v2'
    modern = case.arch == 'modern-bert'
    names = NOMIC_NAMES if nomic else MODERN_NAMES if modern else BERT_NAMES
    if jina:  # ffn_up: gate|up rows (gated_layers), or the up half of the split layout
        names = dict(JINA_NAMES, **{'blk.{i}.ffn_up': 'encoder.layer.{i}.mlp.gated_layers'
                                    + ('_v' if case.split else '')})
    rng = np.random.default_rng(case.seed + 1000)
    arrays = {}
    for name, t in src.tensors.items():
        value = t.data if t.qtype == 'F16' else t.dequantize()
        if name == 'position_embd.weight' and xlmr:  # rows llama.cpp's converter cuts off
            junk = rng.standard_normal((XLMR_PAD + 1, s.hidden)).astype(value.dtype)
            value = np.concatenate([junk, value])
        if dtype == 'BF16' and len(value.shape) == 2:
            value = (_bf16(value), 'BF16')
        arrays[('roberta.' if xlmr else '') + hf_name(name, names)] = value
    write_safetensors(folder / 'model.safetensors', arrays)
    rank = s.pooling == 'rank'
    if nomic:
        cfg = {'model_type': 'nomic_bert', 'architectures': ['NomicBertModel'],
               'n_embd': s.hidden, 'n_head': s.heads, 'n_layer': s.layers, 'n_inner': s.ff,
               'n_positions': 8192, 'max_trained_positions': 2048,
               'layer_norm_epsilon': 1e-12, 'rotary_emb_base': s.rope_base,
               'activation_function': 'swiglu', 'causal': False, 'qkv_proj_bias': False,
               'mlp_fc1_bias': False, 'mlp_fc2_bias': False, 'prenorm': False,
               'rotary_emb_fraction': 1.0, 'rotary_emb_interleaved': False,
               'rotary_emb_scale_base': None, 'type_vocab_size': 2, 'vocab_size': s.vocab_size}
    elif modern:  # bert_fixture's modern-bert keys (sliding window 8, every 3rd global)
        cfg = {'model_type': 'modernbert', 'architectures': ['ModernBertModel'],
               'hidden_size': s.hidden, 'num_attention_heads': s.heads,
               'num_hidden_layers': s.layers, 'intermediate_size': s.ff,
               'max_position_embeddings': s.context, 'norm_eps': 1e-12,
               'global_rope_theta': 160000.0, 'local_rope_theta': s.local_rope_base,
               'local_attention': 8, 'global_attn_every_n_layers': 3,
               'vocab_size': s.vocab_size, 'pad_token_id': 0}
        if case.act:
            cfg['hidden_activation'] = case.act
    else:
        head = 'XLMRobertaFor' if xlmr else 'BertFor'
        cfg = {'model_type': 'xlm-roberta' if xlmr else 'bert',
               'architectures': [head + 'SequenceClassification' if rank else
                                 ('XLMRobertaModel' if xlmr else
                                  'JinaBertModel' if jina else 'BertModel')],
               'hidden_size': s.hidden, 'num_attention_heads': s.heads,
               'num_hidden_layers': s.layers, 'intermediate_size': s.ff,
               'max_position_embeddings': s.context + (XLMR_PAD + 1 if xlmr else 0),
               'layer_norm_eps': 1e-12, 'type_vocab_size': 1 if xlmr else 2,
               'vocab_size': s.vocab_size, 'pad_token_id': XLMR_PAD if xlmr else PAD_ID,
               'hidden_act': 'gelu'}
        if rank:
            cfg['id2label'] = {'0': 'LABEL_0'}
    cfg['_name_or_path'] = f'tiny-hf-{case.tag}'
    (folder / 'config.json').write_text(json.dumps(cfg, indent=1))
    if not rank:
        (folder / 'modules.json').write_text(json.dumps([
            {'idx': 0, 'name': '0', 'path': '',
             'type': 'sentence_transformers.models.Transformer'},
            {'idx': 1, 'name': '1', 'path': '1_Pooling',
             'type': 'sentence_transformers.models.Pooling'}]))
        (folder / '1_Pooling').mkdir(exist_ok=True)
        (folder / '1_Pooling' / 'config.json').write_text(json.dumps({
            'word_embedding_dimension': s.hidden,
            'pooling_mode_cls_token': s.pooling == 'cls',
            'pooling_mode_mean_tokens': s.pooling == 'mean',
            'pooling_mode_lasttoken': s.pooling == 'last'}))
    (_ugm_tokenizer(case) if xlmr else _bpe_tokenizer() if modern
     else _wpm_tokenizer()).save(str(folder / 'tokenizer.json'))
    specials = (('<s>', '</s>', '<pad>', '<unk>') if xlmr else
                (SPECIAL_TOKENS[BOS_ID], SPECIAL_TOKENS[EOS_ID], SPECIAL_TOKENS[0], '')
                if modern else ('[CLS]', '[SEP]', '[PAD]', '[UNK]'))
    (folder / 'tokenizer_config.json').write_text(json.dumps(dict(zip(
        ('cls_token', 'sep_token', 'pad_token', 'unk_token'), specials),
        tokenizer_class='XLMRobertaTokenizer' if xlmr else 'BertTokenizer')))
    return folder


def _wpm_tokenizer():
    """Return BERT's WordPiece tokenizer of bert_fixture.vocab() ('▁w' -> 'w', 'x' -> '##x')."""
    from tokenizers import normalizers, pre_tokenizers, processors, Tokenizer
    from tokenizers.models import WordPiece
    toks = vocab()
    hf = [t if t in SPECIALS else t[1:] if t.startswith('\u2581') else '##' + t for t in toks]
    tok = Tokenizer(WordPiece({t: i for i, t in enumerate(hf)}, unk_token='[UNK]'))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = hf.index('[CLS]'), hf.index('[SEP]')
    tok.post_processor = processors.TemplateProcessing(
        single='[CLS] $A [SEP]', pair='[CLS] $A [SEP] $B:1 [SEP]:1',
        special_tokens=[('[CLS]', cls), ('[SEP]', sep)])
    tok.add_special_tokens(list(SPECIALS))
    return tok


def _bpe_tokenizer():
    """Return ModernBERT-style byte-level BPE of tiny_model's vocabulary, BOS a EOS."""
    from tokenizers import decoders, models, pre_tokenizers, processors, Tokenizer
    toks = tiny_vocab()
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(toks)},
                               [tuple(m.split(' ')) for m in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    bos, eos = SPECIAL_TOKENS[BOS_ID], SPECIAL_TOKENS[EOS_ID]
    tok.post_processor = processors.TemplateProcessing(
        single=f'{bos} $A {eos}', pair=f'{bos} $A {eos} $B:1 {eos}:1',
        special_tokens=[(bos, BOS_ID), (eos, EOS_ID)])
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def _ugm_tokenizer(case: BertCase):
    """Return XLM-RoBERTa's Unigram tokenizer of bert_fixture.ugm_vocab (bge-m3's pipeline)."""
    from tokenizers import AddedToken, normalizers, pre_tokenizers, processors, Regex, Tokenizer
    from tokenizers.models import Unigram
    toks, scores, _ = ugm_vocab(case.seed)
    tok = Tokenizer(Unigram(list(zip(toks, scores)), unk_id=3, byte_fallback=False))
    steps = [normalizers.Replace(Regex(' {2,}'), ' ')] if case.merge_spaces else []
    if steps:
        tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement='\u2581', prepend_scheme='always')
    tok.post_processor = processors.TemplateProcessing(
        single='<s> $A </s>', pair='<s> $A </s> </s> $B </s>',
        special_tokens=[('<s>', 0), ('</s>', 2)])
    tok.add_special_tokens(['<s>', '<pad>', '</s>', '<unk>'])
    tok.add_tokens([AddedToken(UGM_USER_DEFINED, special=False, normalized=False)])
    return tok
