"""Tiny random BERT-style GGUFs (llama.cpp's `bert` layout) for the embedding parity tests.

What llama.cpp's bert loader requires: `bert.attention.layer_norm_epsilon`, the token type
count (tokenizer.ggml.token_type_count), token_embd / token_types / position_embd, the
embedding LayerNorm (token_embd_norm), and per layer attn_q/k/v (+ bias), attn_output,
attn_output_norm, ffn_up, ffn_down, layer_output_norm; cls / cls.output for a reranker.
The vocabulary is a WPM one as llama.cpp's converter writes it: word-initial pieces carry the
phantom space '▁', continuation pieces are stored without BERT's '##'. With vocab='ugm' it is
an XLM-RoBERTa-style SentencePiece unigram one instead (tokenizer model 't5', as llama.cpp's
converter writes bge-m3 and bge-reranker-v2-m3): <s> <pad> </s> <unk>, scored pieces, a
user-defined piece and an unused one, <s> text </s>, pairs <s> a </s></s> b </s>.
arch='modern-bert' (ModernBERT) writes its own layout (write_modern_bert_tensors) and a
byte-level BPE vocabulary (test/tiny_model.py's) with pre-tokenizer 'modern-bert', BOS and
EOS added, as llama.cpp's converter writes ModernBERT's.
"""
from dataclasses import dataclass
import pathlib
import string
from typing import List, Tuple

import gguf
import numpy as np

WORDS = ('the', 'robot', 'arm', 'kitchen', 'door', 'is', 'open', 'closed', 'red', 'cup',
         'table', 'battery', 'low', 'charge', 'dock', 'map', 'room', 'left', 'right', 'go',
         'pick', 'up', 'put', 'down', 'where', 'what', 'a', 'an', 'of', 'in', 'on', 'to')
SPECIALS = ('[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]')
PAD_ID, UNK_ID, CLS_ID, SEP_ID = 0, 1, 2, 3
POOLING = {'none': 0, 'mean': 1, 'cls': 2, 'last': 3, 'rank': 4}


@dataclass(frozen=True)
class BertCase:
    """One tiny encoder: its weight type, pooling and shape."""

    wtype: str = 'F32'
    pooling: str = 'mean'
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    ff: int = 128
    context: int = 128
    seed: int = 0
    vocab: str = 'wpm'              # or 'ugm' (XLM-RoBERTa's SentencePiece unigram)
    # ('bpe': the WPM pieces under the name 'gpt2', as jina-v2-code's is: to test the refusal)
    merge_spaces: bool = True       # ugm: remove_extra_whitespaces
    # 'nomic-bert' (nomic-embed-text): no position table but RoPE (base 1000), fused q|k|v,
    # a SwiGLU MLP (ffn_gate), no biases on the matrices.
    # 'jina-bert-v2' (jina-embeddings-v2): no position table (ALiBi), a GEGLU MLP whose ffn_up
    # holds gate then up rows (no bias); with split=True the older layout instead: ffn_gate +
    # ffn_up (biased), LayerNorms on q and k, and a second attention LayerNorm (attn_norm_2).
    arch: str = 'bert'
    split: bool = False
    # modern-bert: 'silu' (granite-embedding R2's SwiGLU, with its own local RoPE base) or
    # '' (GEGLU, no hidden_activation key, llama.cpp's default local base). jina-bert-v2:
    # 'gelu' = a plain GELU MLP (ffn_up of ff rows, no gate), as llama.cpp also runs it.
    act: str = ''

    @property
    def tag(self) -> str:
        tail = '' if self.vocab == 'wpm' else f'-ugm{"" if self.merge_spaces else "-spaces"}'
        tail += '-split' if self.split else ''
        tail += f'-{self.act}' if self.act else ''
        return f'{self.arch}-{self.wtype}-{self.pooling}{tail}'


UGM_SPECIALS = ('<s>', '<pad>', '</s>', '<unk>')
UGM_USER_DEFINED = '<dock>'
UGM_UNUSED = '[PAD7]'


def ugm_vocab(seed: int = 0) -> Tuple[List[str], List[float], List[int]]:
    """Return (pieces, scores, token types) of a small unigram vocabulary.

    Whole words score above their letters (as a trained unigram model has it), with random
    jitter so segmentations differ; some letters have no bare piece, so [UNK] shows up.
    """
    rng = np.random.default_rng(seed + 100)
    toks, scores, types = list(UGM_SPECIALS), [0.0] * 4, [3, 3, 3, 2]
    pieces = ['\u2581' + w for w in WORDS] + ['\u2581' + c for c in string.ascii_lowercase]
    pieces += list('abcdefghijklmnoprstu0123456789') + ['ing', 'ed', 'er', 'ro', 'bot', '\u2581']
    pieces += ['\u2581' + c for c in '.,?!:;'] + list('.,?!:;')
    for piece in dict.fromkeys(pieces):
        toks.append(piece)
        scores.append(float(-2.0 - 3.0 / len(piece) - rng.uniform(0, 1.5)))
        types.append(1)
    toks += [UGM_USER_DEFINED, UGM_UNUSED]
    scores += [0.0, -10000.0]
    types += [4, 5]
    return toks, scores, types


def vocab() -> List[str]:
    """Specials, whole words, single letters and digits (both forms), punctuation."""
    toks = list(SPECIALS)
    toks += ['\u2581' + w for w in WORDS]
    toks += ['\u2581' + c for c in string.ascii_lowercase + string.digits]
    toks += list(string.ascii_lowercase + string.digits)
    toks += ['s', 'ing', 'ed', 'er']
    toks += ['\u2581' + c for c in '.,?!:;\'"-()']
    return list(dict.fromkeys(toks))


def write_bert_gguf(path, case: BertCase) -> pathlib.Path:
    """Write the case's GGUF (matrices in case.wtype, vectors F32) and return its path."""
    path = pathlib.Path(path)
    rng = np.random.default_rng(case.seed)
    h, ff = case.hidden, case.ff
    nomic = case.arch == 'nomic-bert'
    jina = case.arch == 'jina-bert-v2'
    w = gguf.GGUFWriter(str(path), case.arch)
    w.add_name(f'tiny-{case.tag}')
    w.add_block_count(case.layers)
    w.add_context_length(case.context)
    w.add_embedding_length(h)
    w.add_feed_forward_length(ff)
    w.add_head_count(case.heads)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    if nomic:
        w.add_rope_freq_base(1000.0)
    modern = case.arch == 'modern-bert'
    if modern:   # layers 1, 2 see 4 positions either way; 0 and 3 all (pattern 3)
        w.add_rope_freq_base(160000.0)
        w.add_sliding_window(8)
        w.add_sliding_window_pattern(3)
        if case.act:
            w.add_string('modern-bert.hidden_activation', case.act)
            w.add_rope_freq_base_swa(5000.0)
    w.add_pooling_type(gguf.PoolingType(POOLING[case.pooling]))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    types_count = 2
    if modern:
        from tiny_model import BOS_ID, EOS_ID, MERGES, SPECIAL_TOKENS, tiny_vocab
        toks = tiny_vocab()
        w.add_tokenizer_model('gpt2')
        w.add_tokenizer_pre('modern-bert')
        w.add_token_list(toks)
        w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in toks])
        w.add_token_merges(list(MERGES))
        w.add_bos_token_id(BOS_ID)
        w.add_eos_token_id(EOS_ID)
        w.add_sep_token_id(EOS_ID)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(True)
        w.add_add_sep_token(True)
    elif case.vocab == 'ugm':
        toks, scores, kinds = ugm_vocab(case.seed)
        w.add_tokenizer_model('t5')
        w.add_tokenizer_pre('default')
        w.add_token_list(toks)
        w.add_token_scores(scores)
        w.add_token_types(kinds)
        w.add_add_space_prefix(True)
        w.add_remove_extra_whitespaces(case.merge_spaces)
        types_count = 1                     # XLM-RoBERTa: one token type
        w.add_bos_token_id(0)
        w.add_pad_token_id(1)
        w.add_eos_token_id(2)
        w.add_sep_token_id(2)
        w.add_unk_token_id(3)
        w.add_add_bos_token(True)
        w.add_add_eos_token(True)
        w.add_add_sep_token(True)
    else:
        toks = vocab()
        w.add_tokenizer_model('gpt2' if case.vocab == 'bpe' else 'bert')
        w.add_token_list(toks)
        w.add_token_types([3 if t in SPECIALS else 1 for t in toks])
        w.add_bos_token_id(CLS_ID)
        w.add_sep_token_id(SEP_ID)
        w.add_unk_token_id(UNK_ID)
        w.add_pad_token_id(PAD_ID)
        w.add_mask_token_id(4)
    w.add_token_type_count(types_count)

    def put(name: str, x: np.ndarray, matrix: bool = True) -> None:
        if not matrix or case.wtype == 'F32':
            w.add_tensor(name, x.astype(np.float32))
        elif case.wtype == 'F16':
            w.add_tensor(name, x.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[case.wtype]
            w.add_tensor(name, gguf.quants.quantize(x.astype(np.float32), qtype), raw_dtype=qtype)

    def mat(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    def vec(n: int, centre: float = 0.0, spread: float = 0.1) -> np.ndarray:
        return (centre + spread * rng.standard_normal(n)).astype(np.float32)

    put('token_embd.weight', rng.standard_normal((len(toks), h)).astype(np.float32))
    if modern:
        write_modern_bert_tensors(case, put, mat, vec)
        return _finish(w, path)
    put('token_types.weight', 0.1 * rng.standard_normal((types_count, h)).astype(np.float32),
        False)
    if case.arch == 'bert':
        put('position_embd.weight',
            0.3 * rng.standard_normal((case.context, h)).astype(np.float32))
    put('token_embd_norm.weight', vec(h, 1.0), False)
    put('token_embd_norm.bias', vec(h), False)
    for i in range(case.layers):
        b = f'blk.{i}'
        if nomic:
            put(f'{b}.attn_qkv.weight', np.concatenate([mat(h, h, 2.0), mat(h, h, 2.0),
                                                        mat(h, h)]))
            put(f'{b}.attn_output.weight', mat(h, h))
        for r in (() if nomic else ('attn_q', 'attn_k', 'attn_v', 'attn_output')):
            put(f'{b}.{r}.weight', mat(h, h, 2.0 if r in ('attn_q', 'attn_k') else 1.0))
            put(f'{b}.{r}.bias', vec(h), False)
        put(f'{b}.attn_output_norm.weight', vec(h, 1.0), False)
        put(f'{b}.attn_output_norm.bias', vec(h), False)
        norms = ('attn_q_norm', 'attn_k_norm', 'attn_norm_2') if jina and case.split else ()
        for r in norms:
            put(f'{b}.{r}.weight', vec(h, 1.0), False)
            put(f'{b}.{r}.bias', vec(h), False)
        fused = jina and not case.split and case.act != 'gelu'   # gate rows, then up rows
        put(f'{b}.ffn_up.weight', mat(2 * ff if fused else ff, h))
        if nomic or (jina and case.split):
            put(f'{b}.ffn_gate.weight', mat(ff, h))
        if not nomic and not fused:
            put(f'{b}.ffn_up.bias', vec(ff), False)
        put(f'{b}.ffn_down.weight', mat(h, ff))
        if not nomic:
            put(f'{b}.ffn_down.bias', vec(h), False)
        put(f'{b}.layer_output_norm.weight', vec(h, 1.0), False)
        put(f'{b}.layer_output_norm.bias', vec(h), False)
    if case.pooling == 'rank':  # a cross-encoder's classifier head (one label)
        put('cls.weight', mat(h, h))
        put('cls.bias', vec(h), False)
        put('cls.output.weight', mat(1, h, 4.0), False)
        put('cls.output.bias', vec(1), False)
    return _finish(w, path)


def _finish(w: gguf.GGUFWriter, path: pathlib.Path) -> pathlib.Path:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_modern_bert_tensors(case: BertCase, put, mat, vec) -> None:
    """Write ModernBERT's tensors: LayerNorms without biases, fused q|k|v, ffn_up of 2 ff."""
    h, ff = case.hidden, case.ff
    put('token_embd_norm.weight', vec(h, 1.0), False)
    for i in range(case.layers):
        b = f'blk.{i}'
        if i:        # layer 0 has no attention norm (identity)
            put(f'{b}.attn_norm.weight', vec(h, 1.0), False)
        put(f'{b}.attn_qkv.weight', np.concatenate([mat(h, h, 2.0), mat(h, h, 2.0), mat(h, h)]))
        put(f'{b}.attn_output.weight', mat(h, h))
        put(f'{b}.ffn_norm.weight', vec(h, 1.0), False)
        put(f'{b}.ffn_up.weight', mat(2 * ff, h))
        put(f'{b}.ffn_down.weight', mat(h, ff))
    put('output_norm.weight', vec(h, 1.0), False)


TEXTS: Tuple[str, ...] = (
    'the robot arm is in the kitchen',
    'where is the red cup?',
    'battery low: go to the dock and charge',
    'pick up the cup on the table, then put it down to the left of the door',
    'a',
    'the map of room 42 is open; the door is closed',
    'zzq unknownish words xylophone',
)
# Unigram segmentation edge cases: spaces (leading, repeated, trailing), tabs and newlines,
# code points no piece covers (merged [UNK] runs), the user-defined piece, mixed scripts.
UGM_TEXTS: Tuple[str, ...] = TEXTS + (
    '  the   robot  ', 'dock the robot at the <dock> now', 'vwxyz qq kitchen', '\tgo\nleft',
    'Grüße aus der Küche 中文 🤖', 'roboting robotted', '...the cup?!', 'a' * 40)
