"""A tiny llama/qwen2 model written as a real GGUF (and as an HF folder) for fast tests.

`build_tiny_gguf` writes random weights in a mix of GGUF tensor types with a small byte-level
BPE vocabulary and a ChatML template, the way llama.cpp's converter would (llama Q/K rows
permuted for its interleaved RoPE, qwen2 left in NEOX order). `build_tiny_hf` writes the same
weights as an HF folder (config.json + model.safetensors + tokenizer files) so tests can check
that both sources convert to the same model. `tiny_model_dir` converts the GGUF once per
process and caches the result.
"""
from dataclasses import dataclass
import json
import pathlib
import threading
from typing import Dict, List, Optional, Sequence, Union

import gguf
import numpy as np

CHAT_TEMPLATE = (
    '{% for message in messages %}'
    '{{ "<|im_start|>" + message["role"] + "\\n" + message["content"] + "<|im_end|>\\n" }}'
    '{% endfor %}'
    '{% if add_generation_prompt %}{{ "<|im_start|>assistant\\n" }}{% endif %}'
)
SPECIAL_TOKENS = ('<|endoftext|>', '<|im_start|>', '<|im_end|>')
BOS_ID, EOS_ID = 1, 2
# Merges in rank order; each merge's parts exist before it (byte-level, 'Ġ' is a space).
MERGES = (
    'Ġ t', 'h e', 'Ġt he', 'i n', 'Ġ a', 'e r', 'o n', 'Ġ s', 'r e', 'a t', 'Ġ i', 'e n',
    'Ġ o', 'Ġ w', 'Ġ b', 'l u', 'Ġb lu', 'Ġblu e', 'Ġ c', 'o l', 'o r', 'Ġc ol', 'Ġcol or',
    'Ġs k', 'Ġsk y', 'Ġi s', 'H e', 'l l', 'He ll', 'Hell o',
)
# A VLM's vocabulary also has '\n\n' (idefics3's overview wrapper) and the image tokens.
VISION_MERGES = ('Ċ Ċ',)
VISION_TOKENS = (('<start_of_image>', '<end_of_image>', '<fake_token_around_image>',
                  '<global-img>', '<img>', '</img>')
                 + tuple(f'<row_{r}_col_{c}>' for r in range(1, 7) for c in range(1, 7)))
# Qwen-VL's image wrapper (and pad) tokens: tiny_vocab('qwen') adds them after VISION_TOKENS.
QWEN_VISION_TOKENS = ('<|vision_start|>', '<|vision_end|>', '<|image_pad|>')
# Gemma 4's image wrapper: tiny_vocab('gemma4') adds them after VISION_TOKENS.
GEMMA4_VISION_TOKENS = ('<|image>', '<image|>')
# GGUF tensor types per role ('mixed' is the default fixture; 'f32' keeps weights exact).
QUANT_MIXES: Dict[str, Dict[str, str]] = {
    'mixed': {'embed': 'Q8_0', 'lm_head': 'Q8_0', 'q': 'Q4_0', 'k': 'Q4_1', 'v': 'Q4_0',
              'o': 'Q4_1', 'gate': 'Q4_1', 'up': 'Q4_0', 'down': 'Q4_1'},
    'q4_0': {'embed': 'Q4_0', 'lm_head': 'Q4_0', 'q': 'Q4_0', 'k': 'Q4_0', 'v': 'Q4_0',
             'o': 'Q4_0', 'gate': 'Q4_0', 'up': 'Q4_0', 'down': 'Q4_0'},
    'f32': {'embed': 'F32', 'lm_head': 'F32', 'q': 'F32', 'k': 'F32', 'v': 'F32',
            'o': 'F32', 'gate': 'F32', 'up': 'F32', 'down': 'F32'},
}
_LAYER_GGUF = {'q': 'attn_q', 'k': 'attn_k', 'v': 'attn_v', 'o': 'attn_output',
               'gate': 'ffn_gate', 'up': 'ffn_up', 'down': 'ffn_down'}
_LAYER_HF = {'q': 'self_attn.q_proj', 'k': 'self_attn.k_proj', 'v': 'self_attn.v_proj',
             'o': 'self_attn.o_proj', 'gate': 'mlp.gate_proj', 'up': 'mlp.up_proj',
             'down': 'mlp.down_proj'}
# LFM2 (transformers' Lfm2): per-layer names of the roles a conv or an attention layer has.
_LAYER_HF_LFM2 = {'attn_norm': 'operator_norm', 'ffn_norm': 'ffn_norm',
                  'q': 'self_attn.q_proj', 'k': 'self_attn.k_proj', 'v': 'self_attn.v_proj',
                  'o': 'self_attn.out_proj', 'q_norm': 'self_attn.q_layernorm',
                  'k_norm': 'self_attn.k_layernorm', 'gate': 'feed_forward.w1',
                  'up': 'feed_forward.w3', 'down': 'feed_forward.w2',
                  'in_proj': 'conv.in_proj', 'conv': 'conv.conv', 'out_proj': 'conv.out_proj'}


@dataclass(frozen=True)
class TinyDims:
    """Shapes of the tiny decoder (multiples of 32 where GGUF blocks need them)."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    context: int = 256
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    key_length: Optional[int] = None  # head_dim when it is not hidden / heads (qwen3)

    @property
    def head_dim(self) -> int:
        return self.key_length or self.hidden // self.heads


def byte_level_alphabet() -> List[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    printable = (list(range(ord('!'), ord('~') + 1)) + list(range(ord('¡'), ord('¬') + 1))
                 + list(range(ord('®'), ord('ÿ') + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tiny_vocab(vision: Union[bool, str] = False) -> List[str]:
    """List the special tokens, the 256 byte symbols, then one token per merge.

    vision: then also the double newline as one token and the image wrapper tokens of the mmproj
    families (VISION_TOKENS, control tokens), as a VLM's vocabulary has them; vision 'qwen'
    then also Qwen-VL's (QWEN_VISION_TOKENS), vision 'gemma4' Gemma 4's (GEMMA4_VISION_TOKENS).
    """
    merges = MERGES + (VISION_MERGES if vision else ())
    return (list(SPECIAL_TOKENS) + byte_level_alphabet() + [m.replace(' ', '') for m in merges]
            + (list(VISION_TOKENS) if vision else [])
            + (list(QWEN_VISION_TOKENS) if vision == 'qwen' else [])
            + (list(GEMMA4_VISION_TOKENS) if vision == 'gemma4' else []))


def tiny_weights(arch: str = 'llama', seed: int = 0, dims: TinyDims = TinyDims(),
                 tied: Optional[bool] = None) -> Dict[str, np.ndarray]:
    """Random float32 weights in HF layout (NEOX rope order), keyed by role names.

    Keys: embed, final_norm, lm_head (absent when tied), and per layer `L.{role}` with roles
    attn_norm, ffn_norm, q, k, v, o, gate, up, down (+ q_bias, k_bias, v_bias for qwen2).
    """
    if arch not in ('llama', 'qwen2'):
        raise ValueError(f'unknown tiny arch {arch!r}')
    tied = (arch == 'llama') if tied is None else tied
    rng = np.random.default_rng(seed)
    vocab = len(tiny_vocab())
    hd = dims.head_dim

    def mat(rows: int, cols: int, scale: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    w = {'embed': mat(vocab, dims.hidden, 1.0),
         'final_norm': (1.0 + 0.1 * rng.standard_normal(dims.hidden)).astype(np.float32)}
    if not tied:
        w['lm_head'] = mat(vocab, dims.hidden, 0.3)
    for i in range(dims.layers):
        p = f'{i}.'
        w[p + 'attn_norm'] = (1.0 + 0.1 * rng.standard_normal(dims.hidden)).astype(np.float32)
        w[p + 'ffn_norm'] = (1.0 + 0.1 * rng.standard_normal(dims.hidden)).astype(np.float32)
        w[p + 'q'] = mat(dims.heads * hd, dims.hidden, 0.25)
        w[p + 'k'] = mat(dims.kv_heads * hd, dims.hidden, 0.25)
        w[p + 'v'] = mat(dims.kv_heads * hd, dims.hidden, 0.2)
        w[p + 'o'] = mat(dims.hidden, dims.heads * hd, 0.15)
        w[p + 'gate'] = mat(dims.intermediate, dims.hidden, 0.2)
        w[p + 'up'] = mat(dims.intermediate, dims.hidden, 0.2)
        w[p + 'down'] = mat(dims.hidden, dims.intermediate, 0.1)
        if arch == 'qwen2':
            w[p + 'q_bias'] = (0.1 * rng.standard_normal(dims.heads * hd)).astype(np.float32)
            w[p + 'k_bias'] = (0.1 * rng.standard_normal(dims.kv_heads * hd)).astype(np.float32)
            w[p + 'v_bias'] = (0.1 * rng.standard_normal(dims.kv_heads * hd)).astype(np.float32)
    return w


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder Q/K rows from NEOX halves to interleaved pairs, as llama.cpp's converter does."""
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _encode(w: np.ndarray, qtype_name: str):
    qtype = gguf.GGMLQuantizationType[qtype_name]
    if qtype == gguf.GGMLQuantizationType.F32:
        return w.astype(np.float32), None
    if qtype == gguf.GGMLQuantizationType.F16:
        return w.astype(np.float16), None
    return gguf.quants.quantize(w, qtype), qtype


def build_tiny_gguf(path, arch: str = 'llama', seed: int = 0, *, dims: TinyDims = TinyDims(),
                    quant: str = 'mixed', tied: Optional[bool] = None,
                    overrides: Optional[Dict[str, str]] = None,
                    raw_tensors: Optional[Dict[str, tuple]] = None) -> pathlib.Path:
    """Write a tiny decoder GGUF and return its path.

    quant picks a row of QUANT_MIXES; overrides maps roles to other GGUF types; raw_tensors
    maps GGUF tensor names to (uint8 bytes [rows, row_bytes], GGMLQuantizationType name) to
    store pre-encoded blocks (e.g. Q4_K/Q6_K, which gguf-py cannot quantize).
    """
    path = pathlib.Path(path)
    types = dict(QUANT_MIXES[quant])
    types.update(overrides or {})
    weights = tiny_weights(arch, seed, dims, tied)
    vocab = tiny_vocab()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f'tiny-{arch}')
    writer.add_block_count(dims.layers)
    writer.add_context_length(dims.context)
    writer.add_embedding_length(dims.hidden)
    writer.add_feed_forward_length(dims.intermediate)
    writer.add_head_count(dims.heads)
    writer.add_head_count_kv(dims.kv_heads)
    writer.add_rope_freq_base(dims.rope_theta)
    writer.add_layer_norm_rms_eps(dims.rms_eps)
    writer.add_rope_dimension_count(dims.head_dim)
    writer.add_vocab_size(len(vocab))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    add_tokenizer(writer, vocab, arch)

    def put(name: str, w: np.ndarray, role: str) -> None:
        if raw_tensors and name in raw_tensors:
            data, tname = raw_tensors[name]
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[tname])
            return
        data, qtype = _encode(w, types.get(role, 'F32'))
        writer.add_tensor(name, data, raw_dtype=qtype)

    put('token_embd.weight', weights['embed'], 'embed')
    put('output_norm.weight', weights['final_norm'], 'norm')
    if 'lm_head' in weights:
        put('output.weight', weights['lm_head'], 'lm_head')
    for i in range(dims.layers):
        p = f'{i}.'
        for role, gname in _LAYER_GGUF.items():
            w = weights[p + role]
            if arch == 'llama' and role in ('q', 'k'):
                w = llama_cpp_permute(w, dims.heads if role == 'q' else dims.kv_heads)
            put(f'blk.{i}.{gname}.weight', w, role)
        put(f'blk.{i}.attn_norm.weight', weights[p + 'attn_norm'], 'norm')
        put(f'blk.{i}.ffn_norm.weight', weights[p + 'ffn_norm'], 'norm')
        for role in ('q', 'k', 'v'):
            if p + role + '_bias' in weights:
                put(f'blk.{i}.attn_{role}.bias', weights[p + role + '_bias'], 'bias')
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_tokenizer(writer: gguf.GGUFWriter, vocab: Sequence[str], arch: str,
                  pre: Optional[str] = None, template: str = CHAT_TEMPLATE) -> None:
    """Write the byte-level BPE vocabulary, special ids and chat template (ChatML).

    A vocabulary with the vision tokens (tiny_vocab(vision=True)) gets their merge too.
    """
    writer.add_tokenizer_model('gpt2')
    qwen = ('qwen2', 'qwen3', 'qwen2vl', 'qwen3vl')
    writer.add_tokenizer_pre(pre or ('qwen2' if arch in qwen else
                                     'lfm2' if arch == 'lfm2' else 'smollm'))
    writer.add_token_list(list(vocab))
    control = (set(SPECIAL_TOKENS) | set(VISION_TOKENS) | set(QWEN_VISION_TOKENS)
               | set(GEMMA4_VISION_TOKENS))
    types = [gguf.TokenType.CONTROL if t in control else gguf.TokenType.NORMAL for t in vocab]
    writer.add_token_types(types)
    vision = VISION_TOKENS[0] in vocab
    writer.add_token_merges(list(MERGES + (VISION_MERGES if vision else ())))
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_pad_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(template)


def build_tiny_hf(folder, arch: str = 'llama', seed: int = 0, *, dims: TinyDims = TinyDims(),
                  tied: Optional[bool] = None, dtype: str = 'float32') -> pathlib.Path:
    """Write the same weights as an HF checkpoint folder (NEOX layout, safetensors)."""
    weights = tiny_weights(arch, seed, dims, tied)
    config = {
        'architectures': ['Qwen2ForCausalLM' if arch == 'qwen2' else 'LlamaForCausalLM'],
        'model_type': arch, 'hidden_size': dims.hidden, 'intermediate_size': dims.intermediate,
        'num_hidden_layers': dims.layers, 'num_attention_heads': dims.heads,
        'num_key_value_heads': dims.kv_heads, 'max_position_embeddings': dims.context,
        'rms_norm_eps': dims.rms_eps, 'rope_theta': dims.rope_theta, 'rope_scaling': None,
        'vocab_size': len(tiny_vocab()), 'tie_word_embeddings': 'lm_head' not in weights,
        'bos_token_id': BOS_ID, 'eos_token_id': EOS_ID, 'torch_dtype': dtype,
        'hidden_act': 'silu',
    }
    return write_hf_folder(folder, weights, config, dtype)


def write_hf_folder(folder, weights: Dict[str, np.ndarray], config: dict,
                    dtype: str = 'float32') -> pathlib.Path:
    """Write role-keyed weights (NEOX layout) as an HF folder with config and tokenizer files."""
    from safetensors.numpy import save_file
    from tokenizers import decoders, models, pre_tokenizers, Tokenizer
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    np_dtype = {'float32': np.float32, 'float16': np.float16}[dtype]
    tensors = {'model.embed_tokens.weight': weights['embed'],
               'model.norm.weight': weights['final_norm']}
    if 'lm_head' in weights:
        tensors['lm_head.weight'] = weights['lm_head']
    kind = config.get('model_type')
    llama_layers = config['num_hidden_layers']
    if kind == 'lfm2':   # its own names, none of the llama ones below
        tensors.update(_lfm2_layers(weights, llama_layers))
        tensors['model.embedding_norm.weight'] = tensors.pop('model.norm.weight')
        llama_layers = 0
    for i in range(llama_layers):
        p, hp = f'{i}.', f'model.layers.{i}.'
        for role, hname in _LAYER_HF.items():
            tensors[f'{hp}{hname}.weight'] = weights[p + role]
        if kind == 'phi3':  # Phi-3 fuses q|k|v and gate|up
            tensors[hp + 'self_attn.qkv_proj.weight'] = np.concatenate(
                [tensors.pop(f'{hp}self_attn.{r}_proj.weight') for r in 'qkv'])
            tensors[hp + 'mlp.gate_up_proj.weight'] = np.concatenate(
                [tensors.pop(f'{hp}mlp.{r}_proj.weight') for r in ('gate', 'up')])
        tensors[hp + 'input_layernorm.weight'] = weights[p + 'attn_norm']
        if kind == 'gemma3_text':  # four norms; the MLP's input norm is pre_feedforward
            tensors[hp + 'pre_feedforward_layernorm.weight'] = weights[p + 'ffn_norm']
            tensors[hp + 'post_attention_layernorm.weight'] = weights[p + 'post_attn_norm']
            tensors[hp + 'post_feedforward_layernorm.weight'] = weights[p + 'post_ffn_norm']
        else:
            tensors[hp + 'post_attention_layernorm.weight'] = weights[p + 'ffn_norm']
        for role in ('q', 'k', 'v'):
            if p + role + '_bias' in weights:
                tensors[f'{hp}self_attn.{role}_proj.bias'] = weights[p + role + '_bias']
        for role in ('q', 'k'):
            if p + role + '_norm' in weights:
                tensors[f'{hp}self_attn.{role}_norm.weight'] = weights[p + role + '_norm']
    save_file({k: np.ascontiguousarray(v.astype(np_dtype)) for k, v in tensors.items()},
              str(folder / 'model.safetensors'), metadata={'format': 'pt'})
    (folder / 'config.json').write_text(json.dumps(config, indent=2))
    vocab = tiny_vocab()
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(vocab)},
                               [tuple(m.split(' ')) for m in MERGES]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(folder / 'tokenizer.json'))
    (folder / 'tokenizer_config.json').write_text(json.dumps({
        'bos_token': SPECIAL_TOKENS[BOS_ID], 'eos_token': SPECIAL_TOKENS[EOS_ID],
        'add_bos_token': False, 'chat_template': CHAT_TEMPLATE}, indent=2))
    return folder


def _lfm2_layers(weights: Dict[str, np.ndarray], layers: int) -> Dict[str, np.ndarray]:
    """Name an LFM2's layer weights as transformers saves them (the conv kernel as Conv1d's)."""
    out = {}
    for i in range(layers):
        for role, hname in _LAYER_HF_LFM2.items():
            w = weights.get(f'{i}.{role}')
            if w is not None:   # a conv layer has no q/k/v/o, an attention layer no conv
                out[f'model.layers.{i}.{hname}.weight'] = w[:, None] if role == 'conv' else w
    return out


_CACHE: Dict[tuple, pathlib.Path] = {}
_CACHE_LOCK = threading.Lock()


def tiny_model_dir(tmp_root, arch: str = 'llama', seed: int = 0, **convert_kwargs) -> pathlib.Path:
    """Build and convert the tiny GGUF under tmp_root once per process; return the model dir."""
    from edge_llm_ros.convert.converter import convert
    key = (str(tmp_root), arch, seed, tuple(sorted(convert_kwargs.items())))
    with _CACHE_LOCK:
        if key in _CACHE and (_CACHE[key] / 'model.yaml').is_file():
            return _CACHE[key]
        root = pathlib.Path(tmp_root)
        root.mkdir(parents=True, exist_ok=True)
        tag = '-'.join([arch, str(seed)] + [f'{k}{v}' for k, v in sorted(convert_kwargs.items())])
        src = build_tiny_gguf(root / f'tiny-{tag}.gguf', arch=arch, seed=seed)
        out = convert(str(src), str(root / f'tiny-{tag}'), progress=False, **convert_kwargs)
        _CACHE[key] = out
        return out
