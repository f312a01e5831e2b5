"""Read an HF encoder folder (config.json, *.safetensors, tokenizer.json) for the graph builders.

The folder's tensors get llama.cpp's GGUF names and layouts as convert_hf_to_gguf.py gives
them (its BertModel, XLMRobertaModel, NomicBertModel, JinaBertV2Model, ModernBertModel), so
the graph built from the folder is the one built from the GGUF that converter writes of it:

- `bert` (BertModel, BertForMaskedLM, BertForSequenceClassification: all-MiniLM, bge, e5,
  ms-marco cross-encoders) and `xlm-roberta` (XLMRobertaModel / ...ForSequenceClassification:
  bge-m3, bge-reranker-v2-m3), both llama.cpp's `bert` graph. The `bert.` / `roberta.` prefix
  goes, LayerNorm gamma / beta are weight / bias, the pooler and the masked-LM head are
  dropped. XLM-RoBERTa's positions start at pad_token_id + 1: those first rows of the
  position table are cut off, and the context is max_position_embeddings less them.
- `nomic-bert` (model_type nomic_bert: nomic-embed-text v1 / v1.5): fused Wqkv, SwiGLU
  (fc11 up, fc12 gate), RoPE at rotary_emb_base; the settings llama.cpp's converter asserts
  are checked (a variant off them, the MoE v2 among them, is refused).
- `jina-bert-v2` (JinaBertModel / JinaBertForMaskedLM, whose model_type is 'bert':
  jina-embeddings-v2-small/base-en): BERT's names, the GEGLU `mlp.gated_layers` (or the split
  gated_layers_w / _v), `mlp.wo`, `mlp.layernorm`, q / k LayerNorms; ALiBi, no position
  table. Only its WordPiece (BertTokenizer) vocabulary, as for its GGUF.
- `modern-bert` (ModernBertModel / ...ForMaskedLM: ModernBERT, gte-modernbert, granite-embedding
  R2): the `model.` prefix goes; norm_eps, global / local_rope_theta, local_attention and
  global_attn_every_n_layers are the GGUF's keys, read by the GGUF reader's rules (its
  ...ForSequenceClassification head is refused, as for its GGUF).
- A classifier (a ...ForSequenceClassification, a cross-encoder) is rank pooling: BERT's single
  `classifier` is cls.output (unless its id2label is AutoConfig's dummy pair), RoBERTa's head
  is classifier.dense (cls, + tanh) and classifier.out_proj (cls.output). Otherwise pooling is
  sentence-transformers' (modules.json -> the Pooling module's config.json: mean, cls,
  lasttoken), and 'none' without one, as llama.cpp's converter decides it.

Matrices stay in their safetensors type: F32 as F32, F16 as F16 (the op library path of an F16
GGUF). BF16, which llama.cpp's converter keeps as BF16 and the encoder graph has no matmul for,
is widened to F32 (exact). tokenizer.json is copied: it carries its own normalizer and
post-processor ([CLS] a [SEP] b [SEP], <s> a </s></s> b </s>).
"""
import dataclasses
import json
import pathlib
import re
import shutil
from typing import Dict, List, Optional, Tuple

from edge_llm_ros.convert.checkpoint import hf_token_ids, read_safetensors, SourceTensor
from edge_llm_ros.convert.encoder_graph import (EncoderSource, EncoderSpec,
                                                JINA_MAX_ALIBI_BIAS, modern_bert_fields,
                                                POOLING_NAMES)
from edge_llm_ros.errors import ModelLoadError, UnsupportedModelError

# The folder's family (its model_type) -> llama.cpp's architecture, for the folders read here.
HF_ENCODER_TYPES = {'bert': 'bert', 'xlm-roberta': 'bert', 'nomic_bert': 'nomic-bert',
                    'jina_bert': 'jina-bert-v2', 'modernbert': 'modern-bert'}
# config.json `architectures` llama.cpp's converter registers -> family; these win over
# model_type (jina-embeddings-v2's model_type is 'bert', its architecture JinaBert...).
_HF_ARCHITECTURES = {'BertModel': 'bert', 'BertForMaskedLM': 'bert', 'CamembertModel': 'bert',
                     'BertForSequenceClassification': 'bert',
                     'XLMRobertaModel': 'xlm-roberta',
                     'XLMRobertaForSequenceClassification': 'xlm-roberta',
                     'NomicBertModel': 'nomic_bert', 'JinaBertModel': 'jina_bert',
                     'JinaBertForMaskedLM': 'jina_bert', 'ModernBertModel': 'modernbert',
                     'ModernBertForMaskedLM': 'modernbert',
                     'ModernBertForSequenceClassification': 'modernbert'}
# sentence-transformers' Pooling config -> pooling (llama.cpp's _try_set_pooling_type).
_POOLING_FLAGS = (('pooling_mode_mean_tokens', 'mean'), ('pooling_mode_cls_token', 'cls'),
                  ('pooling_mode_lasttoken', 'last'))
_POOLING_MODES = {'mean': 'mean', 'cls': 'cls', 'lasttoken': 'last'}
# HF name (after the prefix / gamma / beta clean-up) -> GGUF name, {i} a layer.
_BERT_NAMES = (
    ('embeddings.word_embeddings', 'token_embd'),
    ('embeddings.token_type_embeddings', 'token_types'),
    ('embeddings.position_embeddings', 'position_embd'),
    ('embeddings.LayerNorm', 'token_embd_norm'),
    ('encoder.layer.{i}.attention.self.query', 'blk.{i}.attn_q'),
    ('encoder.layer.{i}.attention.self.key', 'blk.{i}.attn_k'),
    ('encoder.layer.{i}.attention.self.value', 'blk.{i}.attn_v'),
    ('encoder.layer.{i}.attention.output.dense', 'blk.{i}.attn_output'),
    ('encoder.layer.{i}.attention.output.LayerNorm', 'blk.{i}.attn_output_norm'),
    ('encoder.layer.{i}.intermediate.dense', 'blk.{i}.ffn_up'),
    ('encoder.layer.{i}.output.dense', 'blk.{i}.ffn_down'),
    ('encoder.layer.{i}.output.LayerNorm', 'blk.{i}.layer_output_norm'),
    ('classifier.dense', 'cls'),
    ('classifier.out_proj', 'cls.output'),
)
# jina-bert-v2 (JinaBert): BERT's names and its GEGLU MLP (gated_layers: gate rows, then up
# rows; or the older split gated_layers_w / _v), q / k LayerNorms; no position table (ALiBi).
_JINA_NAMES = (
    ('encoder.layer.{i}.mlp.gated_layers', 'blk.{i}.ffn_up'),
    ('encoder.layer.{i}.mlp.gated_layers_v', 'blk.{i}.ffn_up'),
    ('encoder.layer.{i}.mlp.gated_layers_w', 'blk.{i}.ffn_gate'),
    ('encoder.layer.{i}.mlp.up_gated_layer', 'blk.{i}.ffn_up'),
    ('encoder.layer.{i}.mlp.wo', 'blk.{i}.ffn_down'),
    ('encoder.layer.{i}.mlp.down_layer', 'blk.{i}.ffn_down'),
    ('encoder.layer.{i}.mlp.layernorm', 'blk.{i}.layer_output_norm'),
    ('encoder.layer.{i}.layer_norm_1', 'blk.{i}.attn_norm_2'),
    ('encoder.layer.{i}.layer_norm_2', 'blk.{i}.layer_output_norm'),
    ('encoder.layer.{i}.attention.self.layer_norm_q', 'blk.{i}.attn_q_norm'),
    ('encoder.layer.{i}.attention.self.layer_norm_k', 'blk.{i}.attn_k_norm'),
)
# ModernBERT (after the `model.` prefix): pre-norm layers (none before layer 0), fused Wqkv,
# Wi of 2 * intermediate_size rows (GLU), a final norm; its MLM head is not an embedder's.
_MODERN_NAMES = (
    ('embeddings.tok_embeddings', 'token_embd'),
    ('embeddings.norm', 'token_embd_norm'),
    ('layers.{i}.attn_norm', 'blk.{i}.attn_norm'),
    ('layers.{i}.attn.Wqkv', 'blk.{i}.attn_qkv'),
    ('layers.{i}.attn.Wo', 'blk.{i}.attn_output'),
    ('layers.{i}.mlp_norm', 'blk.{i}.ffn_norm'),
    ('layers.{i}.mlp.Wi', 'blk.{i}.ffn_up'),
    ('layers.{i}.mlp.Wo', 'blk.{i}.ffn_down'),
    ('final_norm', 'output_norm'),
)
_NOMIC_NAMES = (
    ('embeddings.word_embeddings', 'token_embd'),
    ('embeddings.token_type_embeddings', 'token_types'),
    ('emb_ln', 'token_embd_norm'),
    ('encoder.layers.{i}.attn.Wqkv', 'blk.{i}.attn_qkv'),
    ('encoder.layers.{i}.attn.out_proj', 'blk.{i}.attn_output'),
    ('encoder.layers.{i}.norm1', 'blk.{i}.attn_output_norm'),
    ('encoder.layers.{i}.mlp.fc11', 'blk.{i}.ffn_up'),
    ('encoder.layers.{i}.mlp.fc12', 'blk.{i}.ffn_gate'),
    ('encoder.layers.{i}.mlp.fc2', 'blk.{i}.ffn_down'),
    ('encoder.layers.{i}.norm2', 'blk.{i}.layer_output_norm'),
)
# Tensors llama.cpp's converter drops: the pooler, the masked-LM / next-sentence heads.
_DROPPED = ('embeddings.position_ids', 'pooler.', 'cls.predictions', 'cls.seq_relationship',
            'lm_head.', 'head.', 'decoder.')
# nomic-bert settings llama.cpp's converter asserts (anything else is another model).
_NOMIC_SETTINGS = {'activation_function': 'swiglu', 'causal': False, 'qkv_proj_bias': False,
                   'mlp_fc1_bias': False, 'mlp_fc2_bias': False, 'prenorm': False,
                   'rotary_emb_fraction': 1.0, 'rotary_emb_interleaved': False,
                   'rotary_emb_scale_base': None}


def read_config(folder: pathlib.Path) -> Optional[dict]:
    """Return the folder's config.json, None when it has none; ModelLoadError when unreadable."""
    path = folder / 'config.json'
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding='utf-8'))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f'{path}: not valid JSON ({exc}); download the model again') \
            from exc


def probe_hf_encoder(folder: pathlib.Path) -> Optional[str]:
    """Return llama.cpp's architecture of an HF BERT-style encoder folder, else None."""
    cfg = read_config(folder)
    family = hf_family(cfg or {})
    return HF_ENCODER_TYPES.get(family)


def hf_family(cfg: dict) -> Optional[str]:
    """Return the folder's family: its registered architecture's, else its model_type."""
    for name in cfg.get('architectures') or ():
        if name in _HF_ARCHITECTURES:
            return _HF_ARCHITECTURES[name]
    return cfg.get('model_type')


def _hparam(cfg: dict, names: Tuple[str, ...], folder: pathlib.Path):
    """Return the first of `names` in config.json (llama.cpp's find_hparam)."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    raise ModelLoadError(f'{folder}/config.json has none of {", ".join(names)}; the config is '
                         'incomplete: download it again')


class EncoderHf(EncoderSource):
    """An HF BERT-style encoder folder, its tensors under llama.cpp's GGUF names."""

    def __init__(self, folder: pathlib.Path) -> None:
        self.path = folder
        cfg = read_config(folder)
        if cfg is None:
            raise ModelLoadError(f'{folder}: config.json is missing; an HF encoder folder needs '
                                 'config.json, *.safetensors and tokenizer.json')
        self.cfg = cfg
        model_type = hf_family(cfg)
        arch = HF_ENCODER_TYPES.get(model_type)
        if arch is None:
            raise UnsupportedModelError(
                f'{folder}: model_type {model_type!r} is not an encoder read from HF folders '
                f'({", ".join(HF_ENCODER_TYPES)}); convert its GGUF instead')
        names = self._check_variant(model_type)
        self.labels = self._labels()
        files = sorted(folder.glob('*.safetensors'))
        if not files:
            raise ModelLoadError(f'{folder}: no *.safetensors files; PyTorch .bin checkpoints '
                                 'are not read (save the model with safe_serialization=True)')
        self.tensors = self._map(read_safetensors(files), names, arch)
        self.spec = self._spec(arch)
        missing = [n for n in self.required() if n not in self.tensors]
        if missing:
            back = {g: h for h, g in self._names_by_layer(names)}
            raise ModelLoadError(
                f'{folder}: the safetensors lack {", ".join(back.get(n, n) for n in missing[:5])}'
                f'{" ..." if len(missing) > 5 else ""}; the download is incomplete (fetch every '
                '*.safetensors shard) or the checkpoint is not a plain '
                f'{model_type} encoder')

    # --- config --------------------------------------------------------------------------
    def _check_variant(self, model_type: str) -> tuple:
        """Refuse the trust_remote_code variants llama.cpp converts as other architectures."""
        cfg = self.cfg
        if model_type == 'xlm-roberta' and cfg.get('lora_adaptations'):
            raise UnsupportedModelError(
                f'{self.path}: jina-embeddings-v3 (XLM-RoBERTa with task LoRAs, the jina-bert-v3 '
                'of llama.cpp) is not built; use bge-m3 or another plain XLM-RoBERTa encoder')
        if model_type == 'jina_bert':
            tcfg = self.path / 'tokenizer_config.json'
            tclass = json.loads(tcfg.read_text(encoding='utf-8')).get(
                'tokenizer_class', 'BertTokenizer') if tcfg.is_file() else 'BertTokenizer'
            if tclass != 'BertTokenizer':
                raise UnsupportedModelError(
                    f'{self.path}: this jina-bert-v2 has a {tclass} (BPE) vocabulary; only the '
                    'WordPiece one of jina-embeddings-v2-small/base-en is read: use one of '
                    'those, or a bert / nomic-bert embedder')
            return _BERT_NAMES + _JINA_NAMES
        if model_type == 'modernbert':
            if self._pooling() == 'rank':
                raise UnsupportedModelError(
                    f'{self.path}: a modern-bert reranker (its head.dense / head.norm / '
                    'classifier) is not built; convert an embedding model, or use a bert '
                    'cross-encoder')
            return _MODERN_NAMES
        if model_type != 'nomic_bert':
            return _BERT_NAMES
        if cfg.get('moe_every_n_layers'):
            raise UnsupportedModelError(
                f'{self.path}: nomic-embed-text-v2-moe (nomic-bert-moe) is not built; use '
                'nomic-embed-text v1 / v1.5')
        off = {k: cfg.get(k) for k, v in _NOMIC_SETTINGS.items() if cfg.get(k, v) != v}
        if off:
            raise UnsupportedModelError(
                f'{self.path}: a nomic_bert variant ({off}) that the converter of llama.cpp '
                'refuses too; nomic-embed-text v1 / v1.5 are read')
        tok = self.path / 'tokenizer.json'
        if tok.is_file() and json.loads(tok.read_text(encoding='utf-8')).get(
                'model', {}).get('type') == 'Unigram':
            raise UnsupportedModelError(f'{self.path}: a nomic_bert with an XLM-RoBERTa '
                                        'vocabulary is not read; nomic-embed-text v1 / v1.5 '
                                        '(WordPiece) are')
        return _NOMIC_NAMES

    def _labels(self) -> bool:
        """Whether `classifier` is the output layer (llama.cpp's cls_out_labels)."""
        labels = self.cfg.get('id2label')
        if labels and len(labels) == 2 and labels.get('0', labels.get(0)) == 'LABEL_0':
            return False  # AutoConfig's dummy pair
        return bool(labels)

    def _pooling(self) -> str:
        """Return rank for a classifier, else sentence-transformers' pooling, else none."""
        if any(a.endswith('ForSequenceClassification')
               for a in self.cfg.get('architectures') or ()):
            return 'rank'
        modules = self.path / 'modules.json'
        if not modules.is_file():
            return 'none'
        pooling_dir = next((m['path'] for m in json.loads(modules.read_text(encoding='utf-8'))
                            if str(m.get('type', '')).endswith('Pooling')), None)
        if pooling_dir is None:
            return 'none'
        path = self.path / pooling_dir / 'config.json'
        if not path.is_file():
            raise ModelLoadError(f'{path} is missing (modules.json names a Pooling module '
                                 f'in {pooling_dir!r}); download the whole model folder')
        pooling = json.loads(path.read_text(encoding='utf-8'))
        for flag, name in _POOLING_FLAGS:
            if pooling.get(flag):
                return name
        mode = pooling.get('pooling_mode')
        if mode in _POOLING_MODES:
            return _POOLING_MODES[mode]
        raise UnsupportedModelError(f'{path}: pooling {pooling} is not mean, CLS or last '
                                    'token, the ones llama.cpp runs')

    def _spec(self, arch: str) -> EncoderSpec:
        cfg, folder = self.cfg, self.path
        hidden = int(_hparam(cfg, ('hidden_size', 'n_embd', 'dim'), folder))
        heads = int(_hparam(cfg, ('num_attention_heads', 'n_head', 'n_heads'), folder))
        layers = int(_hparam(cfg, ('n_layers', 'num_hidden_layers', 'n_layer', 'num_layers'),
                             folder))
        ff = int(_hparam(cfg, ('intermediate_size', 'n_inner', 'hidden_dim'), folder))
        eps = float(_hparam(cfg, ('layer_norm_eps', 'layer_norm_epsilon', 'norm_epsilon',
                                  'norm_eps'),
                            folder))
        extra = {}
        if arch == 'nomic-bert':
            npos, trained = int(cfg['n_positions']), int(cfg.get('max_trained_positions', 2048))
            context = {(8192, 2048): 2048, (2048, 2048): 512}.get((npos, trained))
            if context is None:
                raise UnsupportedModelError(
                    f'{folder}: n_positions {npos} / max_trained_positions {trained} are not '
                    "nomic-embed-text v1 / v1.5's (8192 / 2048); llama.cpp's converter refuses "
                    'them too')
            extra = {'head_dim': hidden // heads,
                     'rope_base': float(cfg.get('rotary_emb_base') or 10000.0)}
        else:
            context = int(_hparam(cfg, ('max_position_embeddings', 'n_positions'), folder)) \
                - self._position_offset()
        if arch == 'jina-bert-v2':  # ALiBi instead of a position table
            extra = {'alibi_bias': JINA_MAX_ALIBI_BIAS}
        pooling = self._pooling()
        if arch == 'modern-bert':  # the GGUF reader's rules over the keys llama.cpp writes
            keys = {'hidden_activation': cfg.get('hidden_activation'),
                    'attention.sliding_window': cfg.get('local_attention'),
                    'attention.sliding_window_pattern': cfg.get('global_attn_every_n_layers'),
                    'rope.freq_base': cfg.get('global_rope_theta', cfg.get('rope_theta')),
                    'rope.freq_base_swa': cfg.get('local_rope_theta')}
            codes = {name: code for code, name in POOLING_NAMES.items()}
            extra = modern_bert_fields(
                folder, lambda k, default=None: default if keys[k] is None else keys[k],
                layers, hidden // heads, codes[pooling])
        labels = self.tensors['cls.output.weight'].shape[0] \
            if 'cls.output.weight' in self.tensors else 0
        if pooling == 'rank' and not labels:
            raise ModelLoadError(f'{folder}: a ...ForSequenceClassification without its '
                                 'classifier weights (classifier / classifier.out_proj); the '
                                 'checkpoint is incomplete')
        vocab = int(cfg.get('vocab_size') or self.tensors['token_embd.weight'].shape[0])
        return EncoderSpec(arch, hidden, heads, layers, ff, context, eps, pooling, vocab, labels,
                           **extra)

    def _position_offset(self) -> int:
        """XLM-RoBERTa's positions start at pad_token_id + 1 (llama.cpp cuts those rows)."""
        pad = self.cfg.get('pad_token_id')
        return 1 + int(pad) if hf_family(self.cfg) == 'xlm-roberta' and pad is not None \
            else 0

    # --- tensors -------------------------------------------------------------------------
    def _names_by_layer(self, names: tuple) -> List[Tuple[str, str]]:
        """Return (HF, GGUF) name pairs with `.weight` / `.bias`, {i} over the layers."""
        layers = int(_hparam(self.cfg, ('n_layers', 'num_hidden_layers', 'n_layer',
                                        'num_layers'), self.path))
        out = []
        for hf, gg in names:
            for i in (range(layers) if '{i}' in hf else (None,)):
                for tail in ('.weight', '.bias'):
                    out.append((hf.format(i=i) + tail, gg.format(i=i) + tail))
        if names in (_NOMIC_NAMES, _MODERN_NAMES):
            return out
        if self.labels:  # BertForSequenceClassification's
            out += [('classifier.weight', 'cls.output.weight'),
                    ('classifier.bias', 'cls.output.bias')]
        else:  # a bare `classifier` (jina's) is cls
            out += [('classifier.weight', 'cls.weight'), ('classifier.bias', 'cls.bias')]
        return out

    def _map(self, raw: Dict[str, SourceTensor], names: tuple,
             arch: str) -> Dict[str, SourceTensor]:
        """Rename the tensors as llama.cpp's converter does; BF16 becomes F32, exactly."""
        table = dict(self._names_by_layer(names))
        offset = self._position_offset()
        out: Dict[str, SourceTensor] = {}
        for name, t in raw.items():
            clean = re.sub(r'^(bert|roberta|model)\.', '', name)
            clean = re.sub(r'\.gamma$', '.weight', re.sub(r'\.beta$', '.bias', clean))
            if clean.startswith(_DROPPED):
                continue
            target = table.get(clean)
            if target is None:
                raise UnsupportedModelError(
                    f'{self.path}: tensor {name!r} has no place in the {arch} layout of '
                    'llama.cpp; the checkpoint is a variant this converter does not build')
            if t.qtype == 'BF16':  # llama.cpp keeps BF16; the graph has no BF16 matmul
                t = SourceTensor(name, 'F32', t.shape, t.dequantize())
            data, shape = t.data, t.shape
            if target == 'position_embd.weight' and offset:
                data, shape = data[offset:], (shape[0] - offset,) + tuple(shape[1:])
            out[target] = dataclasses.replace(t, name=target, shape=shape, data=data)
        return out

    # --- EncoderSource ---------------------------------------------------------------------
    def display_name(self) -> str:
        return str(self.cfg.get('_name_or_path') or self.path.name).rstrip('/').split('/')[-1] \
            or self.path.name

    def rerank_template(self) -> Optional[str]:
        return None  # a cross-encoder scores the tokenizer's pair

    def write_tokenizer(self, out_dir: pathlib.Path) -> Dict[str, object]:
        """Copy tokenizer.json; return bos (CLS / <s>), eos (SEP / </s>), pad and unk ids."""
        tok = self.path / 'tokenizer.json'
        if not tok.is_file():
            raise ModelLoadError(f'{self.path}: tokenizer.json is missing (a fast HF tokenizer '
                                 'is needed; save it with transformers: '
                                 'AutoTokenizer.from_pretrained(...).save_pretrained)')
        shutil.copyfile(tok, out_dir / 'tokenizer.json')
        ids = hf_token_ids(tok)
        tcfg_path = self.path / 'tokenizer_config.json'
        tcfg = json.loads(tcfg_path.read_text(encoding='utf-8')) if tcfg_path.is_file() else {}

        def token_id(key: str, defaults: Tuple[str, ...], cfg_key: str) -> Optional[int]:
            value = tcfg.get(key)
            value = value.get('content') if isinstance(value, dict) else value
            for text in ((value,) if value else ()) + defaults:
                if text in ids:
                    return int(ids[text])
            return None if self.cfg.get(cfg_key) is None else int(self.cfg[cfg_key])

        bos = token_id('cls_token', ('[CLS]', '<s>'), 'bos_token_id')
        eos = token_id('sep_token', ('[SEP]', '</s>'), 'eos_token_id')
        return {'bos_token_id': bos, 'eos_token_ids': [] if eos is None else [eos],
                'pad_token_id': token_id('pad_token', ('[PAD]', '<pad>'), 'pad_token_id'),
                'unk_token_id': token_id('unk_token', ('[UNK]', '<unk>'), 'unk_token_id'),
                'vocab_size': self.spec.vocab_size}


def read_hf_encoder(folder: pathlib.Path) -> EncoderHf:
    """Open an HF encoder folder (probe_hf_encoder named it) for the graph builders."""
    return EncoderHf(folder)
