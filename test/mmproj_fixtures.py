"""Tiny random mmproj GGUFs (llama.cpp's `clip` layout), one per projector family.

Written with gguf as llama.cpp's converters write them: every integer a uint32, mean/std float
lists, F32 weights, HF tensor shapes ([out, in], conv [C_out, 3, p, p]). n_ff differs from
n_embd, so the loader's legacy fc1/fc2 swap never fires by accident. See
docs/design/issue22_mmproj_research.md, section 5.
"""
import pathlib
from typing import Optional

import gguf
import numpy as np

FAMILIES = ('idefics3', 'gemma3', 'internvl', 'mlp')
QWEN25VL = 'qwen2.5vl_merger'


def write_mmproj(path: pathlib.Path, projector: str, n_text: int = 64, n_embd: int = 32,
                 n_ff: int = 48, n_layer: int = 2, n_head: int = 4, image_size: int = 32,
                 patch: int = 4, scale: Optional[int] = 2, seed: int = 0,
                 legacy_ffn_names: bool = False, skip: tuple = (),
                 tensor_scale: Optional[int] = None,
                 longest_edge: Optional[int] = None,
                 weight_type: str = 'F32') -> pathlib.Path:
    """Write a tiny `projector` mmproj to `path`.

    weight_type: the type of the matrices, as the mmproj files people download have them:
    'F32', 'F16' (every weight of two or more dimensions but the position embeddings) or
    'Q8_0' (those of 2-D whose rows are whole blocks); the rest stay F32, as llama.cpp's
    converter and quantizer leave them.

    `skip` leaves those tensors out; `tensor_scale` sizes the projector for another merge
    factor than the one the keys say (a file that does not fit together); `longest_edge` is
    idefics3's preproc_image_size (default twice the tile).
    """
    rng = np.random.default_rng(seed)

    def r(*shape, scale_: float = 0.05) -> np.ndarray:
        return (rng.standard_normal(shape) * scale_).astype(np.float32)

    w = gguf.GGUFWriter(str(path), 'clip')
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(projector)
    w.add_vision_projection_dim(n_text)
    w.add_vision_image_size(image_size)
    w.add_vision_patch_size(patch)
    w.add_vision_embedding_length(n_embd)
    w.add_vision_feed_forward_length(n_ff)
    w.add_vision_block_count(n_layer)
    w.add_vision_head_count(n_head)
    w.add_vision_attention_layernorm_eps(1e-6)
    w.add_vision_image_mean([0.5, 0.5, 0.5])
    w.add_vision_image_std([0.5, 0.5, 0.5])
    if projector != 'mlp':
        w.add_vision_use_gelu(True)
    if scale is not None and projector != 'mlp':
        w.add_vision_projector_scale_factor(scale)
    if projector == 'idefics3':
        w.add_vision_preproc_image_size(longest_edge or 2 * image_size)
    n_patch = (image_size // patch) ** 2
    tensors = {'v.patch_embd.weight': r(n_embd, 3, patch, patch), 'v.patch_embd.bias': r(n_embd)}
    with_cls = projector in ('internvl', 'mlp')
    tensors['v.position_embd.weight'] = r(n_patch + with_cls, n_embd)
    if with_cls:
        tensors['v.class_embd'] = r(n_embd)
    for i in range(n_layer):
        b = f'v.blk.{i}'
        for n in ('ln1', 'ln2'):
            tensors[f'{b}.{n}.weight'] = 1 + r(n_embd)
            tensors[f'{b}.{n}.bias'] = r(n_embd)
        for n in ('attn_q', 'attn_k', 'attn_v', 'attn_out'):
            tensors[f'{b}.{n}.weight'] = r(n_embd, n_embd)
            tensors[f'{b}.{n}.bias'] = r(n_embd)
        up, down = ('ffn_down', 'ffn_up') if legacy_ffn_names else ('ffn_up', 'ffn_down')
        tensors[f'{b}.{up}.weight'] = r(n_ff, n_embd)
        tensors[f'{b}.{up}.bias'] = r(n_ff)
        tensors[f'{b}.{down}.weight'] = r(n_embd, n_ff)
        tensors[f'{b}.{down}.bias'] = r(n_embd)
        if projector == 'internvl':  # InternViT's layer scale
            tensors[f'{b}.ls1.weight'] = 0.1 + r(n_embd)
            tensors[f'{b}.ls2.weight'] = 0.1 + r(n_embd)
    s = tensor_scale or scale or 1
    if projector in ('idefics3', 'gemma3'):
        tensors['v.post_ln.weight'] = 1 + r(n_embd)
        tensors['v.post_ln.bias'] = r(n_embd)
    if projector == 'idefics3':
        tensors['mm.model.fc.weight'] = r(n_text, n_embd * s * s)
    elif projector == 'gemma3':
        tensors['mm.soft_emb_norm.weight'] = 1 + r(n_embd)
        tensors['mm.input_projection.weight'] = r(n_embd, n_text)
    elif projector == 'internvl':
        tensors['mm.model.mlp.0.weight'] = 1 + r(n_embd * s * s)
        tensors['mm.model.mlp.0.bias'] = r(n_embd * s * s)
        tensors['mm.model.mlp.1.weight'] = r(n_text, n_embd * s * s)
        tensors['mm.model.mlp.1.bias'] = r(n_text)
        tensors['mm.model.mlp.3.weight'] = r(n_text, n_text)
        tensors['mm.model.mlp.3.bias'] = r(n_text)
    else:
        tensors['mm.0.weight'] = r(n_text, n_embd)
        tensors['mm.0.bias'] = r(n_text)
        tensors['mm.2.weight'] = r(n_text, n_text)
        tensors['mm.2.bias'] = r(n_text)
    for name, value in tensors.items():
        if name in skip:
            continue
        # Position embeddings are added, not multiplied: llama.cpp's converter keeps them F32.
        matrix = name.endswith('.weight') and value.ndim >= 2 and 'position_embd' not in name
        # gemma3's projection is used transposed: llama.cpp's converter forces it to F16.
        if matrix and weight_type != 'F32' and (weight_type == 'F16' or
                                                'input_projection' in name):
            w.add_tensor(name, value.astype(np.float16))
        elif weight_type == 'Q8_0' and matrix and value.ndim == 2 and value.shape[1] % 32 == 0:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(value, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_qwen25vl_mmproj(path: pathlib.Path, n_text: int = 256, n_embd: int = 64,
                          n_ff: int = 96, n_layer: int = 4, n_head: int = 4,
                          image_size: int = 56, patch: int = 14, wa_pattern: int = 2,
                          seed: int = 0, skip: tuple = (), weight_type: str = 'F32',
                          gain: float = 1.0) -> pathlib.Path:
    """Write a tiny Qwen2.5-VL mmproj (`qwen2.5vl_merger`) as llama.cpp's converter does.

    Qwen2VLVisionModel's layout: the Conv3D patch embedding split into two frames
    (v.patch_embd.weight, v.patch_embd.weight.1, no bias), RMSNorm blocks (weights only) with
    biased q/k/v/out and a biased SwiGLU MLP (clip.use_silu), every wa_pattern-th layer full
    attention (clip.vision.n_wa_pattern), v.post_ln (the merger's ln_q), and the merger MLP
    mm.0 [4C, 4C], mm.2 [n_text, 4C]. Patch 14 as Qwen's: llama.cpp's windows are 112 pixels
    (4 x 4 merged tokens), so an image over 112 pixels a side has several. weight_type 'F16'
    stores the matrices (2-D and more) as F16, as the mmproj-F16 files people download have
    them. gain scales every matrix's spread (1: the tiny widths'; a real width takes about
    sqrt(64 / n_embd) for the same growth per layer, or random weights amplify float32 noise
    layer by layer).
    """
    rng = np.random.default_rng(seed)

    def r(*shape, scale_: float = 0.05) -> np.ndarray:
        scale_ *= gain if len(shape) >= 2 else 1.0
        return (rng.standard_normal(shape) * scale_).astype(np.float32)

    w = gguf.GGUFWriter(str(path), 'clip')
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(QWEN25VL)
    w.add_vision_projection_dim(n_text)
    w.add_vision_image_size(image_size)
    w.add_vision_patch_size(patch)
    w.add_vision_embedding_length(n_embd)
    w.add_vision_feed_forward_length(n_ff)
    w.add_vision_block_count(n_layer)
    w.add_vision_head_count(n_head)
    w.add_vision_attention_layernorm_eps(1e-6)
    w.add_vision_image_mean([0.48145466, 0.4578275, 0.40821073])
    w.add_vision_image_std([0.26862954, 0.26130258, 0.27577711])
    w.add_vision_use_silu(True)
    w.add_vision_n_wa_pattern(wa_pattern)
    tensors = {'v.patch_embd.weight': r(n_embd, 3, patch, patch),
               'v.patch_embd.weight.1': r(n_embd, 3, patch, patch)}
    for i in range(n_layer):
        b = f'v.blk.{i}'
        tensors[f'{b}.ln1.weight'] = 1 + r(n_embd, scale_=0.1)
        tensors[f'{b}.ln2.weight'] = 1 + r(n_embd, scale_=0.1)
        for n in ('attn_q', 'attn_k', 'attn_v', 'attn_out'):
            tensors[f'{b}.{n}.weight'] = r(n_embd, n_embd, scale_=0.15)
            tensors[f'{b}.{n}.bias'] = r(n_embd)
        for n in ('ffn_gate', 'ffn_up'):
            tensors[f'{b}.{n}.weight'] = r(n_ff, n_embd, scale_=0.15)
            tensors[f'{b}.{n}.bias'] = r(n_ff)
        tensors[f'{b}.ffn_down.weight'] = r(n_embd, n_ff, scale_=0.15)
        tensors[f'{b}.ffn_down.bias'] = r(n_embd)
    tensors['v.post_ln.weight'] = 1 + r(n_embd, scale_=0.1)
    tensors['mm.0.weight'] = r(4 * n_embd, 4 * n_embd, scale_=0.1)
    tensors['mm.0.bias'] = r(4 * n_embd)
    tensors['mm.2.weight'] = r(n_text, 4 * n_embd, scale_=0.1)
    tensors['mm.2.bias'] = r(n_text)
    for name, value in tensors.items():
        if name not in skip:
            w.add_tensor(name, value.astype(np.float16) if value.ndim >= 2
                         and weight_type == 'F16' else value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


QWEN3VL = 'qwen3vl_merger'


def write_qwen3vl_mmproj(path: pathlib.Path, n_text: int = 256, n_embd: int = 64,
                         n_ff: int = 96, n_layer: int = 4, n_head: int = 4,
                         image_size: int = 128, patch: int = 16,
                         deepstack: tuple = (1, 2), seed: int = 0,
                         skip: tuple = (), weight_type: str = 'F32',
                         gain: float = 1.0) -> pathlib.Path:
    """Write a tiny Qwen3-VL mmproj (`qwen3vl_merger`) as llama.cpp's converter does.

    Qwen3VLVisionModel's layout: the two-frame patch embedding with a bias, learned position
    embeddings for an image_size grid ((image_size / patch)^2 rows, interpolated to each
    image's grid), LayerNorm blocks with a fused biased attn_qkv, a biased GELU MLP
    (clip.use_gelu), v.post_ln (the merger's norm) and the merger mm.0 [4C, 4C], mm.2
    [n_text, 4C]; DeepStack: after each layer in `deepstack`, v.deepstack.<layer>.norm (over
    4C), fc1 [4C, 4C], fc2 [n_text, 4C] (clip.vision.is_deepstack_layers says which).
    Patch 16 as Qwen3-VL's: images are resized to multiples of 32. weight_type 'F16' stores
    the matrices (2-D and more, not the position embeddings) as F16, as the mmproj-F16 files
    people download have them. gain scales every matrix's spread (1: the tiny widths'; a real
    width takes about sqrt(64 / n_embd) for the same growth per layer).
    """
    rng = np.random.default_rng(seed)

    def r(*shape, scale_: float = 0.05) -> np.ndarray:
        scale_ *= gain if len(shape) >= 2 else 1.0
        return (rng.standard_normal(shape) * scale_).astype(np.float32)

    w = gguf.GGUFWriter(str(path), 'clip')
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(QWEN3VL)
    w.add_vision_projection_dim(n_text)
    w.add_vision_image_size(image_size)
    w.add_vision_patch_size(patch)
    w.add_vision_embedding_length(n_embd)
    w.add_vision_feed_forward_length(n_ff)
    w.add_vision_block_count(n_layer)
    w.add_vision_head_count(n_head)
    w.add_vision_attention_layernorm_eps(1e-6)
    w.add_vision_image_mean([0.5, 0.5, 0.5])
    w.add_vision_image_std([0.5, 0.5, 0.5])
    w.add_vision_use_gelu(True)
    w.add_vision_spatial_merge_size(2)
    w.add_vision_is_deepstack_layers([i in deepstack for i in range(n_layer)])
    c4 = 4 * n_embd
    tensors = {'v.patch_embd.weight': r(n_embd, 3, patch, patch),
               'v.patch_embd.weight.1': r(n_embd, 3, patch, patch),
               'v.patch_embd.bias': r(n_embd),
               'v.position_embd.weight': r((image_size // patch) ** 2, n_embd,
                                           scale_=0.5 / gain)}
    for i in range(n_layer):
        b = f'v.blk.{i}'
        for n in ('ln1', 'ln2'):
            tensors[f'{b}.{n}.weight'] = 1 + r(n_embd, scale_=0.1)
            tensors[f'{b}.{n}.bias'] = r(n_embd)
        tensors[f'{b}.attn_qkv.weight'] = r(3 * n_embd, n_embd, scale_=0.15)
        tensors[f'{b}.attn_qkv.bias'] = r(3 * n_embd)
        tensors[f'{b}.attn_out.weight'] = r(n_embd, n_embd, scale_=0.15)
        tensors[f'{b}.attn_out.bias'] = r(n_embd)
        tensors[f'{b}.ffn_up.weight'] = r(n_ff, n_embd, scale_=0.15)
        tensors[f'{b}.ffn_up.bias'] = r(n_ff)
        tensors[f'{b}.ffn_down.weight'] = r(n_embd, n_ff, scale_=0.15)
        tensors[f'{b}.ffn_down.bias'] = r(n_embd)
    tensors['v.post_ln.weight'] = 1 + r(n_embd, scale_=0.1)
    tensors['v.post_ln.bias'] = r(n_embd)
    merger = [('mm.0', c4), ('mm.2', n_text)]
    for i in deepstack:
        tensors[f'v.deepstack.{i}.norm.weight'] = 1 + r(c4, scale_=0.1)
        tensors[f'v.deepstack.{i}.norm.bias'] = r(c4)
        merger += [(f'v.deepstack.{i}.fc1', c4), (f'v.deepstack.{i}.fc2', n_text)]
    for name, rows in merger:
        tensors[f'{name}.weight'] = r(rows, c4, scale_=0.1)
        tensors[f'{name}.bias'] = r(rows)
    for name, value in tensors.items():
        if name in skip:
            continue
        matrix = value.ndim >= 2 and 'position_embd' not in name
        w.add_tensor(name, value.astype(np.float16) if matrix and weight_type == 'F16'
                     else value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


GEMMA4V = 'gemma4v'
# The matrices given Gemma4ClippableLinear limits in the tiny file (clip.cpp reads
# <name>.input_min / .input_max / .output_min / .output_max, float32 scalars): tight enough
# that some values are clamped.
GEMMA4_CLAMPED = ('v.blk.0.attn_q', 'v.blk.1.ffn_down', 'mm.input_projection')


def write_gemma4v_mmproj(path: pathlib.Path, n_text: int = 256, n_embd: int = 64,
                         n_ff: int = 96, n_layer: int = 2, n_head: int = 4, patch: int = 4,
                         positions: int = 256, seed: int = 0, skip: tuple = (),
                         audio: bool = False, clamps: bool = True,
                         weight_type: str = 'F32') -> pathlib.Path:
    """Write a tiny Gemma 4 mmproj (`gemma4v`) as llama.cpp's converter does.

    Gemma4VisionAudioModel's layout: clip.vision.projector_type gemma4v, image_size 224 (a
    placeholder), no use_gelu (so libmtmd's MLP is the quick-GELU one), no scale_factor (3),
    image mean 0 and std 1; the patch embedding without a bias [C, 3, p, p], the position
    tables [2, positions, C] (F32), per layer RMSNorm weights ln1 / ln2 / attn_post_norm /
    ffn_post_norm, q / k / v / out without biases, per-head q / k norms, the gated MLP
    (ffn_gate, ffn_up, ffn_down) and out_scale [1]; v.std_bias / v.std_scale and
    mm.input_projection [n_text, C]; the clamp scalars of GEMMA4_CLAMPED (clamps=True).
    audio: the file also says it holds a gemma4a audio tower (clip.has_audio_encoder, a few
    a.* / mm.a.* tensors), as the published Gemma 4 mmproj files do.
    """
    rng = np.random.default_rng(seed)

    def r(*shape, scale_: float = 0.05) -> np.ndarray:
        return (rng.standard_normal(shape) * scale_).astype(np.float32)

    d = n_embd // n_head
    w = gguf.GGUFWriter(str(path), 'clip')
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_vision_projector_type(GEMMA4V)
    w.add_vision_projection_dim(n_text)
    w.add_vision_image_size(224)
    w.add_vision_patch_size(patch)
    w.add_vision_embedding_length(n_embd)
    w.add_vision_feed_forward_length(n_ff)
    w.add_vision_block_count(n_layer)
    w.add_vision_head_count(n_head)
    w.add_vision_attention_layernorm_eps(1e-6)
    w.add_vision_image_mean([0.0, 0.0, 0.0])
    w.add_vision_image_std([1.0, 1.0, 1.0])
    if audio:
        w.add_clip_has_audio_encoder(True)
        w.add_clip_audio_projector_type('gemma4a')
        w.add_audio_projection_dim(n_text)
        w.add_audio_embedding_length(32)
        w.add_audio_feed_forward_length(128)
        w.add_audio_block_count(1)
        w.add_audio_head_count(4)
        w.add_audio_num_mel_bins(16)
    tensors = {'v.patch_embd.weight': r(n_embd, 3, patch, patch, scale_=0.2),
               'v.position_embd.weight': r(2, positions, n_embd, scale_=0.5)}
    for i in range(n_layer):
        b = f'v.blk.{i}'
        for n in ('ln1', 'ln2', 'attn_post_norm', 'ffn_post_norm'):
            tensors[f'{b}.{n}.weight'] = 1 + r(n_embd, scale_=0.1)
        for n in ('attn_q', 'attn_k', 'attn_v', 'attn_out'):
            tensors[f'{b}.{n}.weight'] = r(n_embd, n_embd, scale_=0.15)
        tensors[f'{b}.attn_q_norm.weight'] = 1 + r(d, scale_=0.1)
        tensors[f'{b}.attn_k_norm.weight'] = 1 + r(d, scale_=0.1)
        tensors[f'{b}.ffn_gate.weight'] = r(n_ff, n_embd, scale_=0.15)
        tensors[f'{b}.ffn_up.weight'] = r(n_ff, n_embd, scale_=0.15)
        tensors[f'{b}.ffn_down.weight'] = r(n_embd, n_ff, scale_=0.15)
        tensors[f'{b}.out_scale.weight'] = np.array([0.8 + 0.1 * i], np.float32)
    tensors['v.std_bias'] = r(n_embd)
    tensors['v.std_scale'] = 1 + r(n_embd, scale_=0.1)
    tensors['mm.input_projection.weight'] = r(n_text, n_embd, scale_=0.15)
    if clamps:
        for name in GEMMA4_CLAMPED:
            for key, value in (('input_min', -2.0), ('input_max', 2.0),
                               ('output_min', -3.0), ('output_max', 3.0)):
                tensors[f'{name}.{key}'] = np.array([value], np.float32)
    if audio:  # a token of the conformer, as its names go (a.* / mm.a.*)
        tensors['a.blk.0.ln1.weight'] = 1 + r(32)
        tensors['mm.a.input_projection.weight'] = r(n_text, 32)
    for name, value in tensors.items():
        if name in skip:
            continue
        matrix = value.ndim >= 2 and 'position_embd' not in name
        w.add_tensor(name, value.astype(np.float16) if matrix and weight_type == 'F16'
                     else value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
