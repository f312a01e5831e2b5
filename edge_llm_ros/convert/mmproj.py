"""llama.cpp's multimodal projector files (mmproj GGUFs, `clip` architecture), read and checked.

A vision-language model comes as two GGUFs: the language model, and an mmproj holding the
vision encoder and the projector into the language model's embeddings. `read_mmproj` reads
one the way llama.cpp's clip loader does (the same required keys, defaults and tensor names,
and its swap of legacy fc1/fc2 names) and checks that the tensors of its projector family are
there with consistent shapes; `check_pair` refuses an mmproj whose projector width is not the
language model's hidden size. Both run before anything is written.

Families (`clip.projector_type`), with the language models they come with:
- idefics3 (SmolVLM, Idefics3): SigLIP, pixel unshuffle by `scale_factor`, one linear layer;
- gemma3: SigLIP, average pooling by `scale_factor` (default 4), an RMSNorm, a projection;
- internvl (InternVL 2.5/3): InternViT with a CLS token, pixel unshuffle, LayerNorm + MLP;
- mlp (LLaVA-1.5 style): CLIP ViT with a CLS token, a two-layer MLP;
- qwen2.5vl_merger (Qwen2.5-VL): a ViT over any image size (multiples of patch x merge),
  the patch embedding split in two frames (v.patch_embd.weight and .weight.1: Qwen's temporal
  patch of 2), RMSNorm, 2-D RoPE, windowed attention with every n_wa_pattern-th layer full,
  a SwiGLU MLP, then the 2 x 2 patch merger (mm.0, GELU, mm.2);
- qwen3vl_merger (Qwen3-VL): the same two-frame patch embedding (with a bias) and 2-D RoPE,
  plus learned position embeddings interpolated to the image's grid, LayerNorm blocks with a
  fused attn_qkv and a GELU MLP, no windows, the 2 x 2 merger (v.post_ln, mm.0, GELU, mm.2)
  and DeepStack: after each layer with v.deepstack.<layer>.* tensors, its own merger
  (LayerNorm over the 4 merged patches, fc1, GELU, fc2), whose rows go after the main ones;
- gemma4v (Gemma 4 E2B / E4B): a ViT over any image size (multiples of patch x 3), no patch
  bias, learned x and y position tables, RMSNorm blocks with per-head q/k norms, V normalized,
  2-D RoPE, post-attention and post-FFN norms, a gated MLP and a per-layer output scale;
  optional input / output clamps on every matrix (Gemma4ClippableLinear); then 3 x 3 average
  pooling, x sqrt(n_embd), optional std_bias / std_scale, RMSNorm and mm.input_projection.
  Its file usually also holds the audio tower (`gemma4a`, tensors a.* / mm.a.*): that is
  refused by name unless the caller asks for the vision tower only (vision_only=True: the
  audio tensors are dropped with a warning).
The key and tensor layout is docs/design/issue22_mmproj_research.md, sections 1 and 5.
"""
from dataclasses import dataclass
import logging
import os
import pathlib
from typing import Dict, Optional, Tuple

import numpy as np

from edge_llm_ros.convert.checkpoint import gguf_field, gguf_tensor, open_gguf, SourceTensor
from edge_llm_ros.errors import UnsupportedModelError

QWEN25VL, QWEN3VL, GEMMA4V = 'qwen2.5vl_merger', 'qwen3vl_merger', 'gemma4v'
PROJECTORS = ('idefics3', 'gemma3', 'internvl', 'mlp', QWEN25VL, QWEN3VL, GEMMA4V)
QWEN_PROJECTORS = (QWEN25VL, QWEN3VL)
# The families that take one image of any size (no tiles): Qwen-VL and Gemma 4.
DYNAMIC_PROJECTORS = (*QWEN_PROJECTORS, GEMMA4V)
# clip.cpp's gemma4v defaults: 3 x 3 pooling (n_merge), images of 70 to 1120 pooled tokens
# (set_limit_image_tokens), RoPE base 100.
GEMMA4_POOL, GEMMA4_MIN_TOKENS, GEMMA4_MAX_TOKENS, GEMMA4_ROPE_BASE = 3, 70, 1120, 100.0
# Audio projectors (clip.audio.projector_type) whose towers ride in a vision mmproj.
AUDIO_PROJECTORS = ('gemma4a',)
_log = logging.getLogger(__name__)
# The families whose loader swaps ffn_up / ffn_down when ffn_down reads n_embd wide (legacy
# fc1 / fc2 names), as clip.cpp does.
_FFN_SWAP = ('idefics3', 'gemma3', 'mlp', 'qwen2.5vl_merger')
_GEMMA3_POOL = 4  # clip.cpp's n_merge default for gemma3
# clip.cpp's Qwen-VL defaults: a 2 x 2 merge, images of 8 to 4096 merged tokens (its
# set_limit_image_tokens), windows of 112 pixels (attn_window_size unset for qwen2.5vl).
QWEN_MERGE, QWEN_MIN_TOKENS, QWEN_MAX_TOKENS, QWEN_WINDOW = 2, 8, 4096, 112


class MmprojError(UnsupportedModelError):
    """An mmproj file this converter cannot use (or not the pair of the language model)."""


class AudioTowerError(MmprojError):
    """An mmproj that also holds an audio tower (gemma4a), which is not converted."""


@dataclass(frozen=True)
class VisionConfig:
    """The encoder and projector an mmproj describes (keys as llama.cpp's clip loader reads)."""

    projector: str
    image_size: int      # the tile side the encoder takes
    patch_size: int
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    eps: float
    image_mean: Tuple[float, float, float]
    image_std: Tuple[float, float, float]
    scale_factor: int    # pixel unshuffle (idefics3, internvl) or pooling (gemma3) factor
    activation: str      # 'gelu_tanh' (clip.use_gelu), 'silu' (clip.use_silu) or 'quick_gelu'
    longest_edge: int    # idefics3's preproc_image_size (0: none)
    n_out: int           # the projector's output width: the language model's hidden size
    min_tiles: int = 1   # internvl's preproc_min_tiles / preproc_max_tiles (clip.cpp's defaults)
    max_tiles: int = 12
    wa_pattern: int = 0  # qwen2.5vl: layer i attends fully when (i + 1) % wa_pattern == 0
    deepstack: Tuple[int, ...] = ()  # qwen3vl: the encoder layers whose outputs DeepStack takes

    @property
    def dynamic(self) -> bool:
        """Say whether the encoder takes any image size (Qwen-VL, gemma4v), not fixed tiles."""
        return self.projector in DYNAMIC_PROJECTORS

    @property
    def row_width(self) -> int:
        """Return an image row's width: n_out, then n_out per DeepStack layer (Qwen3-VL)."""
        return self.n_out * (1 + len(self.deepstack))

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        """Embeddings one tile of image_size x image_size becomes (clip_n_output_tokens)."""
        n = self.patches_per_side ** 2
        if self.projector in ('idefics3', 'internvl', 'gemma3', *DYNAMIC_PROJECTORS):
            return n // self.scale_factor ** 2
        return n


@dataclass
class Mmproj:
    """An mmproj file: its configuration and its tensors by GGUF name (not yet dequantized)."""

    path: str
    config: VisionConfig
    tensors: Dict[str, SourceTensor]

    def array(self, name: str) -> np.ndarray:
        """Return tensor `name` as float32 in its numpy ([out, in]) shape."""
        return self.tensors[name].dequantize()


def _required(path: str, reader, key: str):
    value = gguf_field(reader, key)
    if value is None:
        raise MmprojError(f'{path}: mmproj key {key!r} is missing; llama.cpp cannot load this '
                          "file either: use an mmproj written by llama.cpp's converter")
    return value


def _config(path: str, reader, projector: str) -> VisionConfig:
    def u32(name: str, default: Optional[int] = None) -> int:
        key = f'clip.vision.{name}'
        value = gguf_field(reader, key) if default is not None else _required(path, reader, key)
        return int(default if value is None else value)

    mean = _required(path, reader, 'clip.vision.image_mean')
    std = _required(path, reader, 'clip.vision.image_std')
    if len(mean) < 3 or len(std) < 3:
        raise MmprojError(f'{path}: clip.vision.image_mean / image_std need 3 values (got '
                          f'{len(mean)} and {len(std)})')
    gelu, silu = bool(gguf_field(reader, 'clip.use_gelu', False)), bool(
        gguf_field(reader, 'clip.use_silu', False))
    if gelu and silu:
        raise MmprojError(f'{path}: clip.use_gelu and clip.use_silu are both set')
    qwen = projector in QWEN_PROJECTORS
    cfg = VisionConfig(
        projector=projector, image_size=u32('image_size'), patch_size=u32('patch_size'),
        n_embd=u32('embedding_length'), n_ff=u32('feed_forward_length'),
        n_layer=u32('block_count'), n_head=u32('attention.head_count'),
        eps=float(_required(path, reader, 'clip.vision.attention.layer_norm_epsilon')),
        image_mean=tuple(float(v) for v in mean[:3]), image_std=tuple(float(v) for v in std[:3]),
        scale_factor=(u32('spatial_merge_size', QWEN_MERGE) if qwen else u32(
            'projector.scale_factor', {'gemma3': _GEMMA3_POOL, GEMMA4V: GEMMA4_POOL}.get(
                projector, 1))),
        activation='gelu_tanh' if gelu else 'silu' if silu else 'quick_gelu',
        longest_edge=u32('preproc_image_size', 0), n_out=0,
        min_tiles=u32('preproc_min_tiles', 1), max_tiles=u32('preproc_max_tiles', 12),
        wa_pattern=u32('n_wa_pattern') if projector == QWEN25VL else 0)
    if qwen and cfg.scale_factor != QWEN_MERGE:
        raise MmprojError(f'{path}: a {projector} mmproj needs spatial_merge_size 2 (got '
                          f"{cfg.scale_factor}), as llama.cpp's encoder does")
    if projector == QWEN25VL and cfg.wa_pattern <= 0:
        raise MmprojError(f'{path}: a qwen2.5vl_merger mmproj needs n_wa_pattern > 0 (got '
                          f"{cfg.wa_pattern}), as llama.cpp's encoder does")
    if not (0 < cfg.patch_size <= cfg.image_size <= 8192) or cfg.image_size % cfg.patch_size:
        raise MmprojError(f'{path}: image_size {cfg.image_size} is not a whole number of '
                          f'{cfg.patch_size}-pixel patches')
    if cfg.n_embd <= 0 or cfg.n_head <= 0 or cfg.n_embd % cfg.n_head:
        raise MmprojError(f'{path}: embedding_length {cfg.n_embd} does not split into '
                          f'{cfg.n_head} heads')
    if projector == 'internvl' and not 1 <= cfg.min_tiles <= cfg.max_tiles:
        raise MmprojError(f'{path}: clip.vision.preproc_min_tiles {cfg.min_tiles} and '
                          f'preproc_max_tiles {cfg.max_tiles} need 1 <= min <= max (llama.cpp '
                          'cannot tile an image otherwise)')
    if projector in ('internvl', 'mlp') and gguf_field(reader, 'clip.vision.image_grid_pinpoints'):
        # llama.cpp then tiles as LLaVA-1.6's anyres (or adds grids to InternVL's): not built.
        raise MmprojError(f'{path}: clip.vision.image_grid_pinpoints is set: that {projector} '
                          'tiling (LLaVA-1.6 anyres) is not supported; LLaVA-1.5 style mlp and '
                          'InternVL 2.5/3 mmproj files are')
    if projector == GEMMA4V:  # any image size: image_size is a placeholder (224)
        if cfg.scale_factor <= 0 or (cfg.n_embd // cfg.n_head) % 4:
            raise MmprojError(f'{path}: a gemma4v mmproj needs projector.scale_factor > 0 '
                              f'(got {cfg.scale_factor}) and a head size that is a multiple '
                              f'of 4 for its 2-D RoPE (got {cfg.n_embd // cfg.n_head})')
        return cfg
    if cfg.scale_factor <= 0 or cfg.patches_per_side % cfg.scale_factor:
        raise MmprojError(f'{path}: {cfg.patches_per_side} patches a side do not merge by '
                          f'scale_factor {cfg.scale_factor}')
    return cfg


# The projector's tensors per family, and which of them gives the output width (and on which
# axis of its numpy shape).
_PROJECTOR_TENSORS = {
    'idefics3': (('mm.model.fc.weight',), ('mm.model.fc.weight', 0)),
    'gemma3': (('mm.input_projection.weight', 'mm.soft_emb_norm.weight'),
               ('mm.input_projection.weight', 1)),
    'internvl': (('mm.model.mlp.0.weight', 'mm.model.mlp.0.bias', 'mm.model.mlp.1.weight',
                  'mm.model.mlp.1.bias', 'mm.model.mlp.3.weight', 'mm.model.mlp.3.bias',
                  'v.class_embd'), ('mm.model.mlp.3.weight', 0)),
    'mlp': (('mm.0.weight', 'mm.0.bias', 'mm.2.weight', 'mm.2.bias', 'v.class_embd'),
            ('mm.2.weight', 0)),
    QWEN25VL: (('mm.0.weight', 'mm.0.bias', 'mm.2.weight', 'mm.2.bias', 'v.post_ln.weight'),
               ('mm.2.weight', 0)),
    QWEN3VL: (('mm.0.weight', 'mm.0.bias', 'mm.2.weight', 'mm.2.bias', 'v.post_ln.weight',
               'v.post_ln.bias', 'v.patch_embd.bias'), ('mm.2.weight', 0)),
    GEMMA4V: (('mm.input_projection.weight',), ('mm.input_projection.weight', 0)),
}
# Qwen3-VL's DeepStack merger after encoder layer i: v.deepstack.<i>.<part>.weight / .bias.
_DEEPSTACK_PARTS = ('norm', 'fc1', 'fc2')


def deepstack_layers(tensors: Dict[str, SourceTensor], n_layer: int) -> Tuple[int, ...]:
    """Return the encoder layers with DeepStack tensors, as clip.cpp finds them."""
    return tuple(i for i in range(n_layer)
                 if any(f'v.deepstack.{i}.{part}.weight' in tensors for part in _DEEPSTACK_PARTS))


def _check_shapes(path: str, cfg: VisionConfig, tensors: Dict[str, SourceTensor]) -> None:
    """Raise MmprojError where a tensor the family needs is missing or of the wrong shape."""
    c, ff, p, s = cfg.n_embd, cfg.n_ff, cfg.patch_size, cfg.scale_factor
    qwen = cfg.projector in QWEN_PROJECTORS
    expected = {'v.patch_embd.weight': (c, 3, p, p)}
    if qwen:  # the temporal patch's second frame
        expected['v.patch_embd.weight.1'] = (c, 3, p, p)
    if cfg.projector != QWEN25VL:  # Qwen2.5-VL has no learned position embeddings (RoPE)
        expected['v.position_embd.weight'] = None
    if cfg.projector == QWEN3VL:   # a square grid of them, interpolated to each image's
        expected['v.position_embd.weight'] = (cfg.patches_per_side ** 2, c)
    gemma4 = cfg.projector == GEMMA4V
    if gemma4:  # a table of x positions, then one of y positions
        expected['v.position_embd.weight'] = (2, None, c)
    for i in range(cfg.n_layer):
        b = f'v.blk.{i}'
        if gemma4:
            d = c // cfg.n_head
            for name in ('ln1', 'ln2', 'attn_post_norm', 'ffn_post_norm'):
                expected[f'{b}.{name}.weight'] = (c,)
            expected[f'{b}.attn_q_norm.weight'] = (d,)
            expected[f'{b}.attn_k_norm.weight'] = (d,)
            expected[f'{b}.ffn_gate.weight'] = (ff, c)
        if cfg.projector == QWEN3VL:
            expected[f'{b}.attn_qkv.weight'] = (3 * c, c)
            expected[f'{b}.attn_qkv.bias'] = (3 * c,)
            expected[f'{b}.attn_out.weight'] = (c, c)
        else:
            for name in ('attn_q', 'attn_k', 'attn_v', 'attn_out'):
                expected[f'{b}.{name}.weight'] = (c, c)
        expected[f'{b}.ffn_up.weight'] = (ff, c)
        expected[f'{b}.ffn_down.weight'] = (c, ff)
        if cfg.projector == QWEN25VL:
            expected[f'{b}.ffn_gate.weight'] = (ff, c)
    for i in cfg.deepstack:
        for part in _DEEPSTACK_PARTS:
            expected[f'v.deepstack.{i}.{part}.weight'] = None
            expected[f'v.deepstack.{i}.{part}.bias'] = None
        expected[f'v.deepstack.{i}.norm.weight'] = (c * s * s,)
        expected[f'v.deepstack.{i}.fc1.weight'] = (None, c * s * s)
        expected[f'v.deepstack.{i}.fc2.weight'] = (cfg.n_out or None, None)
    names, _ = _PROJECTOR_TENSORS[cfg.projector]
    for name in names:
        expected.setdefault(name, None)
    merged = c * s * s
    if cfg.projector == 'idefics3':
        expected['mm.model.fc.weight'] = (None, merged)
    elif cfg.projector == 'gemma3':
        expected['mm.input_projection.weight'] = (c, None)
    elif cfg.projector == 'internvl':
        expected['mm.model.mlp.1.weight'] = (None, merged)
    elif gemma4:  # pooled, not merged: n_embd wide
        expected['mm.input_projection.weight'] = (None, c)
    elif qwen:
        expected['mm.0.weight'] = (None, merged)
    else:
        expected['mm.0.weight'] = (None, c)
    missing = sorted(n for n in expected if n not in tensors)
    if missing:
        raise MmprojError(f'{path}: the {cfg.projector} mmproj lacks {", ".join(missing[:6])}'
                          f'{" ..." if len(missing) > 6 else ""}; the file is incomplete or of '
                          'another layout')
    for name, shape in expected.items():
        got = tuple(tensors[name].shape)
        if shape is not None and (len(got) != len(shape) or any(
                want is not None and want != have for want, have in zip(shape, got))):
            want = ', '.join('*' if w is None else str(w) for w in shape)
            raise MmprojError(f'{path}: tensor {name} is {got}, the {cfg.projector} layout with '
                              f'these keys needs ({want})')


def _drop_audio(path: str, reader, tensors: Dict[str, SourceTensor],
                vision_only: bool) -> None:
    """Refuse an audio tower by name, or drop its tensors with a warning (vision_only)."""
    if not gguf_field(reader, 'clip.has_audio_encoder', False):
        return
    audio = gguf_field(reader, 'clip.audio.projector_type') or 'unknown'
    if not vision_only:
        raise AudioTowerError(
            f'{path}: this mmproj also holds a {audio!r} audio tower, which is not converted '
            '(only the vision tower is); pass --mmproj-vision-only (vision_only=True) to '
            'convert the vision tower and leave the audio tower out')
    dropped = [n for n in tensors if n.startswith(('a.', 'mm.a.'))]
    for name in dropped:
        del tensors[name]
    _log.warning('%s: the %r audio tower (%d tensors) is left out: only the vision tower '
                 'is converted (--mmproj-vision-only)', path, audio, len(dropped))


def read_mmproj(path: os.PathLike, vision_only: bool = False) -> Mmproj:
    """Read and check an mmproj GGUF; raise MmprojError (or ModelLoadError) on a bad file.

    An mmproj with an audio tower (gemma4a) raises AudioTowerError unless vision_only, which
    drops the audio tensors with a warning.
    """
    path = str(path)
    if not pathlib.Path(path).is_file():
        raise MmprojError(f'{path}: no such mmproj file')
    reader = open_gguf(pathlib.Path(path))
    if not gguf_field(reader, 'clip.has_vision_encoder', False):
        audio = gguf_field(reader, 'clip.audio.projector_type') or gguf_field(
            reader, 'clip.projector_type')
        if gguf_field(reader, 'clip.has_audio_encoder', False):
            raise AudioTowerError(f'{path}: an audio-only mmproj ({audio!r}): audio towers '
                                  'are not converted; pass the vision mmproj of the model, '
                                  'or convert the language model alone')
        raise MmprojError(f'{path}: not a vision mmproj (clip.has_vision_encoder is not set); '
                          f'architecture {gguf_field(reader, "general.architecture")!r}')
    projector = gguf_field(reader, 'clip.projector_type') or gguf_field(
        reader, 'clip.vision.projector_type')
    if projector not in PROJECTORS:
        raise MmprojError(f'{path}: projector type {projector!r} is not supported (supported: '
                          f'{", ".join(PROJECTORS)})')
    cfg = _config(path, reader, projector)
    tensors = {t.name: gguf_tensor(pathlib.Path(path), t) for t in reader.tensors}
    _drop_audio(path, reader, tensors, vision_only)
    if projector in _FFN_SWAP:
        for i in range(cfg.n_layer):
            up, down = f'v.blk.{i}.ffn_up', f'v.blk.{i}.ffn_down'
            t = tensors.get(f'{down}.weight')
            if t is not None and len(t.shape) == 2 and t.shape[1] == cfg.n_embd:
                for suffix in ('weight', 'bias'):
                    a = tensors.pop(f'{up}.{suffix}', None)
                    b = tensors.pop(f'{down}.{suffix}', None)
                    if a is not None:
                        tensors[f'{down}.{suffix}'] = a
                    if b is not None:
                        tensors[f'{up}.{suffix}'] = b
    name, axis = _PROJECTOR_TENSORS[projector][1]
    n_out = int(tensors[name].shape[axis]) if name in tensors else 0
    deepstack = deepstack_layers(tensors, cfg.n_layer) if projector == QWEN3VL else ()
    cfg = VisionConfig(**{**cfg.__dict__, 'n_out': n_out, 'deepstack': deepstack})
    _check_shapes(path, cfg, tensors)
    return Mmproj(path, cfg, tensors)


def check_pair(mmproj: Mmproj, llm_hidden: int, llm_path: str, llm_deepstack: int = 0) -> None:
    """Raise MmprojError unless the projector feeds embeddings as wide as the language model's.

    Qwen3-VL: the mmproj's DeepStack layers must be as many as the language model's
    n_deepstack_layers (llama.cpp checks the rows' whole width, n_embd x (1 + D)).
    """
    deepstack = len(mmproj.config.deepstack)
    if deepstack != llm_deepstack:
        raise MmprojError(
            f'{mmproj.path}: its {mmproj.config.projector} projector makes {deepstack} '
            f'DeepStack rows per image token, but the language model {llm_path} takes '
            f'{llm_deepstack} (n_deepstack_layers): they are not a pair; use the mmproj '
            'published with this model')
    if mmproj.config.n_out != llm_hidden:
        raise MmprojError(
            f'{mmproj.path}: its {mmproj.config.projector} projector makes '
            f'{mmproj.config.n_out}-wide embeddings, but the language model {llm_path} is '
            f'{llm_hidden} wide: they are not a pair; use the mmproj published with this model')
