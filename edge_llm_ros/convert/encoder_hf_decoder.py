"""Qwen3-Embedding, Qwen3-Reranker and EmbeddingGemma from HF safetensors folders.

The folder is read by checkpoint.py's HF reader (safetensors, dtypes, HF names, Gemma's norm
+1) and its tensors renamed to the GGUF names decoder_encoder_graph.py reads, so the graph is
the one a GGUF of the model gets. What makes the folder an embedder or a reranker, and how,
is decided as llama.cpp's convert_hf_to_gguf.py decides it:

- `Gemma3TextModel` (gemma3_text without a head) is EmbeddingGemma (`gemma-embedding`), its
  pooling the sentence-transformers Pooling module's (modules.json, 1_Pooling/config.json), its
  Dense modules 2_Dense and 3_Dense (linear.weight) the dense_2 / dense_3 projections after
  the pooling (llama.cpp's --sentence-transformers-dense-modules: the vectors
  sentence-transformers gives). Token rows past the tokenizer's vocabulary are dropped. The
  sliding window is config.json's own; which layers are local is its layer_types.
- A qwen3 folder is a Qwen3-Reranker when its README's title, folder name, _name_or_path,
  model_type or architecture says qwen3-reranker (or the architecture is a
  SequenceClassification one): pooling rank, labels yes / no, cls.output the head's rows of
  the tokenizer's 'yes' and 'no' tokens (the embedding's when the head is tied), and
  llama.cpp's rerank prompt. A qwen3 folder with a Pooling module is an embedder
  (Qwen3-Embedding: last-token pooling). Any other qwen3 folder is a chat model: the probe
  declines it and the chat converter takes it.

BF16 tensors (the released folders' type) are read as the F32 values they widen to exactly
(the graph's float matrices are F32 or F16), widened one tensor at a time as it is written.

The tokenizer is the folder's tokenizer.json, copied: its post-processor appends what llama.cpp
appends (Qwen3-Embedding's TemplateProcessing adds <|endoftext|>, which gguf-py reads as
add_eos with that token as EOS); where only tokenizer_config.json asks for BOS / EOS, a
post-processor that adds them is set, as llama.cpp's tokenizer adds them.
"""
import json
import pathlib
from typing import Dict, List, Optional

import numpy as np

from edge_llm_ros.convert.checkpoint import (GGUF_LAYER_NAMES, load_hf_folder, read_safetensors,
                                             SourceTensor, write_hf_tokenizer)
from edge_llm_ros.convert.encoder_graph import EncoderSource, EncoderSpec
from edge_llm_ros.errors import ModelLoadError, UnsupportedModelError

QWEN3, GEMMA = 'qwen3', 'gemma-embedding'
GEMMA_HF_ARCHITECTURE = 'Gemma3TextModel'
# llama.cpp's Qwen3Model writes this rerank prompt ({query}, {document}) into the GGUF.
QWEN3_RERANK_PROMPT = (
    '<|im_start|>system\nJudge whether the Document meets the requirements based on the Query '
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    '<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that '
    'answer the query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n'
    '<|im_start|>assistant\n<think>\n\n</think>\n\n')
RERANK_LABELS = ('yes', 'no')  # cls.output's rows, in this order
# sentence-transformers Pooling config -> pooling (llama.cpp's _try_set_pooling_type).
_POOLING_FLAGS = (('pooling_mode_mean_tokens', 'mean'), ('pooling_mode_cls_token', 'cls'),
                  ('pooling_mode_lasttoken', 'last'))
_POOLING_MODES = {'mean': 'mean', 'cls': 'cls', 'lasttoken': 'last'}
_DENSE_NAMES = {'2_Dense': 'dense_2', '3_Dense': 'dense_3'}


def _config(folder: pathlib.Path) -> Optional[dict]:
    try:
        cfg = json.loads((folder / 'config.json').read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _modules(folder: pathlib.Path) -> List[dict]:
    """Return modules.json's sentence-transformers modules (none when absent)."""
    path = folder / 'modules.json'
    if not path.is_file():
        return []
    try:
        mods = json.loads(path.read_text())
    except ValueError as exc:
        raise ModelLoadError(f'{path}: not valid JSON ({exc}); download the model again') from exc
    return [m for m in mods if isinstance(m, dict)]


def _pooling(folder: pathlib.Path) -> Optional[str]:
    """Return the Pooling module's pooling ('mean', 'cls', 'last'), None without one."""
    path = next((m.get('path', '') for m in _modules(folder)
                 if str(m.get('type', '')).endswith('Pooling')), None)
    if path is None:
        return None
    try:
        cfg = json.loads((folder / path / 'config.json').read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f'{folder / path}: the Pooling module has no readable config.json '
                             f'({exc}); download the model again') from exc
    found = next((name for key, name in _POOLING_FLAGS if cfg.get(key)), None)
    found = found or _POOLING_MODES.get(cfg.get('pooling_mode'))
    if found is None:
        raise UnsupportedModelError(f'{folder / path}: pooling {cfg!r} is none of mean, cls, '
                                    'last token (what llama.cpp and this converter pool by)')
    return found


def _is_qwen3_reranker(folder: pathlib.Path, cfg: dict) -> bool:
    """Tell a Qwen3-Reranker folder by llama.cpp's hints (module docstring)."""
    readme = folder / 'README.md'
    if readme.is_file() and '# qwen3-reranker' in readme.read_text(errors='replace').lower():
        return True
    arch = str((cfg.get('architectures') or [''])[0])
    hints = (folder.name, str(cfg.get('_name_or_path', '')), str(cfg.get('model_type', '')),
             arch)
    return any('qwen3-reranker' in h.lower() for h in hints) or \
        'sequenceclassification' in arch.lower()


def hf_decoder_encoder_arch(folder: pathlib.Path) -> Optional[str]:
    """Return 'qwen3' / 'gemma-embedding' for an embedder or reranker folder, else None."""
    cfg = _config(folder)
    if cfg is None:
        return None
    if cfg.get('model_type') == 'gemma3_text' and \
            GEMMA_HF_ARCHITECTURE in (cfg.get('architectures') or []):
        return GEMMA
    if cfg.get('model_type') == QWEN3 and (_is_qwen3_reranker(folder, cfg)
                                           or _pooling(folder) is not None):
        return QWEN3
    return None


class HfDecoderEncoder(EncoderSource):
    """An HF Qwen3-Embedding / Qwen3-Reranker / EmbeddingGemma folder as an EncoderSource."""

    def __init__(self, folder: pathlib.Path) -> None:
        self.path = folder
        arch = hf_decoder_encoder_arch(folder)
        if arch is None:
            raise UnsupportedModelError(
                f'{folder}: not a Qwen3-Embedding / Qwen3-Reranker (qwen3 with a '
                'sentence-transformers Pooling module, or a reranker) or EmbeddingGemma '
                '(Gemma3TextModel) folder')
        self.cfg = _config(folder)
        self.rerank = arch == QWEN3 and _is_qwen3_reranker(folder, self.cfg)
        ckpt = load_hf_folder(folder)
        s = ckpt.spec
        if s.rope_scale != 1.0 or s.rope_freq_factors or s.rope_dims:
            raise UnsupportedModelError(f'{folder}: RoPE scaling / partial rotation is not '
                                        'part of the embedding graph; use the model as '
                                        'released (no rope_scaling)')
        self.tensors: Dict[str, SourceTensor] = {}
        for key, t in ckpt.tensors.items():
            name = {'embed': 'token_embd.weight', 'final_norm': 'output_norm.weight'}.get(key)
            layer, _, role = key.partition('.')
            if name is None and layer.isdigit() and role in GGUF_LAYER_NAMES:
                name = f'blk.{layer}.{GGUF_LAYER_NAMES[role]}'
            if name is not None:
                self.tensors[name] = _widened(t)
        pooling, labels, extra = _pooling(folder) or 'none', 0, {}
        if self.rerank:
            head = _widened(ckpt.tensors.get('lm_head', ckpt.tensors['embed']))  # tied: embed
            rows = np.asarray(head.values())[list(self._label_ids())]
            self.tensors['cls.output.weight'] = SourceTensor('cls.output.weight', head.qtype,
                                                             rows.shape, rows)
            pooling, labels = 'rank', len(RERANK_LABELS)
        if arch == GEMMA:
            self._gemma_vocab()
            self._dense(s.hidden_size)
            if not s.sliding_window:
                raise ModelLoadError(f'{folder}: config.json has no sliding_window, which '
                                     'EmbeddingGemma needs; download the model again')
            extra = {'local_layers': s.local_layers, 'window': s.sliding_window,
                     'local_rope_base': s.local_rope_theta}
        elif pooling == 'none' and not self.rerank:
            raise UnsupportedModelError(f'{folder}: a qwen3 folder without pooling is a chat '
                                        'model; convert it as one')
        self.spec = EncoderSpec(arch, s.hidden_size, s.num_heads, s.num_layers,
                                s.intermediate_size, s.max_position_embeddings,
                                s.rms_norm_eps, pooling,
                                self.tensors['token_embd.weight'].shape[0], labels,
                                kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                                rope_base=s.rope_theta, **extra)

    def _tokenizer(self):
        from tokenizers import Tokenizer
        path = self.path / 'tokenizer.json'
        if not path.is_file():
            raise ModelLoadError(f'{self.path}: tokenizer.json is missing (a fast HF tokenizer '
                                 'is needed; save it with transformers: save_pretrained)')
        return Tokenizer.from_file(str(path))

    def _label_ids(self) -> List[int]:
        """Return the ids of the 'yes' and 'no' tokens (llama.cpp's convert_tokens_to_ids)."""
        tok = self._tokenizer()
        ids = [tok.token_to_id(t) for t in RERANK_LABELS]
        if None in ids:
            raise UnsupportedModelError(
                f'{self.path}: a Qwen3-Reranker whose tokenizer has no '
                f'{"/".join(repr(t) for t, i in zip(RERANK_LABELS, ids) if i is None)} token; '
                'its score is the head row of "yes" against "no": use the released '
                "Qwen3-Reranker folder's tokenizer.json")
        return ids

    def _gemma_vocab(self) -> None:
        """Drop token rows past the tokenizer's vocabulary (llama.cpp's Gemma3 converter)."""
        data = json.loads((self.path / 'tokenizer.json').read_text()) \
            if (self.path / 'tokenizer.json').is_file() else None
        if data is None:
            raise ModelLoadError(f'{self.path}: tokenizer.json is missing (a fast HF tokenizer '
                                 'is needed; save it with transformers: save_pretrained)')
        n = len(data['model']['vocab']) + len(data.get('added_tokens', []))
        embed = self.tensors['token_embd.weight']
        if n < embed.shape[0]:
            self.tensors['token_embd.weight'] = embed.rows(0, n)

    def _dense(self, hidden: int) -> None:
        """Read the Dense modules (2_Dense, 3_Dense) as dense_2 / dense_3 (module docstring)."""
        for mod in _modules(self.path):
            path = str(mod.get('path', ''))
            if not str(mod.get('type', '')).endswith('Dense') or \
                    not (self.path / path / 'model.safetensors').is_file():
                continue
            name = _DENSE_NAMES.get(path)
            if name is None:
                raise UnsupportedModelError(f'{self.path}: Dense module {path!r}; EmbeddingGemma '
                                            'has 2_Dense and 3_Dense only (what llama.cpp reads)')
            weights = read_safetensors([self.path / path / 'model.safetensors'])
            if any(not k.endswith('.weight') for k in weights):
                raise UnsupportedModelError(f'{self.path / path}: a Dense module with a bias; '
                                            "EmbeddingGemma's have none (llama.cpp drops it)")
            if 'linear.weight' not in weights:
                raise ModelLoadError(f'{self.path / path}: no linear.weight; download the model '
                                     'again')
            t = _widened(weights['linear.weight'])
            t.name = f'{name}.weight'
            self.tensors[t.name] = t
        d2, d3 = self.tensors.get('dense_2.weight'), self.tensors.get('dense_3.weight')
        chain = ([hidden] + [d for t in (d2, d3) if t is not None for d in t.shape[::-1]]
                 + [hidden])
        if any(a != b for a, b in zip(chain[::2], chain[1::2])):
            raise ModelLoadError(f'{self.path}: Dense modules of shapes '
                                 f'{d2 and d2.shape} and {d3 and d3.shape} do not chain from '
                                 f'and back to the hidden size {hidden}; the folder is corrupt')

    def display_name(self) -> str:
        """Return the model's name: config's _name_or_path, the HF cache's repo, the folder."""
        name = str(self.cfg.get('_name_or_path') or '').rstrip('/').split('/')[-1]
        if not name and self.path.parent.name == 'snapshots':  # models--org--name/snapshots/rev
            name = self.path.parent.parent.name.split('--')[-1]
        return name or self.path.name

    def rerank_template(self) -> Optional[str]:
        return QWEN3_RERANK_PROMPT if self.rerank else None

    def write_tokenizer(self, out_dir: pathlib.Path) -> Dict[str, object]:
        self._tokenizer()  # a missing tokenizer.json: the error that says what to do
        specials = write_hf_tokenizer(self.path, self.cfg, out_dir, chat=False)
        data = json.loads((out_dir / 'tokenizer.json').read_text())
        tail = _appended_token(data.get('post_processor'))
        eos = list(specials['eos_token_ids'])
        if tail is not None:  # gguf-py: the appended token is the EOS, and it is added
            tail_id = self._tokenizer().token_to_id(tail)
            specials['eos_token_ids'] = [tail_id] + [e for e in eos if e != tail_id]
            specials['add_eos_token'] = True
        elif specials['add_eos_token'] or specials['add_bos_token']:
            from tokenizers import Tokenizer

            from edge_llm_ros.convert.gguf_tokenizer import _set_post_processor
            tok = Tokenizer.from_file(str(out_dir / 'tokenizer.json'))
            bos = specials['bos_token_id'] if specials['add_bos_token'] else None
            end = (eos or [None])[0] if specials['add_eos_token'] else None
            if (specials['add_bos_token'] and bos is None) or \
                    (specials['add_eos_token'] and end is None):
                raise ModelLoadError(f'{self.path}: tokenizer_config.json adds a BOS / EOS '
                                     'token it does not name; the folder is incomplete')
            tokens = {i: tok.id_to_token(i) for i in (bos, end) if i is not None}
            _set_post_processor(tok, tokens, bos, end)
            tok.save(str(out_dir / 'tokenizer.json'))
        return specials


class _Bf16AsF32(SourceTensor):
    """A BF16 tensor read as the F32 it widens to exactly, widened only when read."""

    def values(self) -> np.ndarray:
        return (np.asarray(super().values()).astype(np.uint32) << 16).view(np.float32)


def _widened(t: SourceTensor) -> SourceTensor:
    """Return a BF16 tensor as F32 (the graph's float matrices are F32 or F16), else t."""
    if t.qtype != 'BF16':
        return t
    return _Bf16AsF32(t.name, 'F32', t.shape, t.data, shift=t.shift)


def _appended_token(post: Optional[dict]) -> Optional[str]:
    """Return the special token a TemplateProcessing appends to a single text, else None."""
    if not isinstance(post, dict):
        return None
    for proc in post.get('processors', [post]):
        if proc.get('type') == 'TemplateProcessing' and len(proc.get('single', [])) > 1:
            return proc['single'][-1].get('SpecialToken', {}).get('id')
    return None
