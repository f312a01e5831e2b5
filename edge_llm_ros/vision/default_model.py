"""The default perception model: a patch-embedding STAND-IN, not a trained encoder.

It has the shape of a ViT/SigLIP front end so the whole camera -> perception -> LLM path
runs (and is tested) without downloading weights, but its weights are random numbers
from a seed: the embeddings carry the image's pixels through a fixed random projection
and mean nothing to a language model. Give perception a real encoder with ``model.path``.

The ONNX graph is written by edge_llm_ros/convert/standin_encoder.py (the one place that
imports onnx); this module holds its spec, weights and a NumPy reference. Graph (opset 18),
input ``frame`` uint8 [height, width, 3] (any size: the dimensions are symbolic):

1. resize to image_size x image_size, nearest neighbour with integer indices
   ``row = (i * height) // image_size`` (exactly reproducible in NumPy)
2. normalize: ``x * (1 / (255 * std)) - mean / std`` per channel, float32
3. patchify into [n_patches, patch_size * patch_size * 3] (row-major patches, HWC inside)
4. ``patches @ weight + bias + position`` -> output ``embeddings`` float32
   [n_patches, hidden_size]

``reference()`` recomputes the same in NumPy (the tests compare the two).
"""
import dataclasses
from typing import Optional, Tuple

import numpy as np

from edge_llm_ros.bringup.parameters import SMOLLM2_HIDDEN
from edge_llm_ros.vision.errors import ModelMismatchError

INPUT_NAME = 'frame'
OUTPUT_NAME = 'embeddings'


@dataclasses.dataclass(frozen=True)
class PatchEmbedSpec:
    """Shape and seed of the stand-in model."""

    hidden_size: int = SMOLLM2_HIDDEN
    image_size: int = 224
    patch_size: int = 16
    seed: int = 0
    mean: Tuple[float, float, float] = (0.485, 0.456, 0.406)   # ImageNet statistics
    std: Tuple[float, float, float] = (0.229, 0.224, 0.225)
    # Target spread of the output values: roughly that of a small LLM's token embeddings.
    embed_std: float = 0.05

    def __post_init__(self) -> None:
        for name in ('hidden_size', 'image_size', 'patch_size'):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ModelMismatchError(f'{name} must be a positive integer, got {value!r}')
        if self.image_size % self.patch_size:
            raise ModelMismatchError(f'image_size {self.image_size} is not a multiple of '
                                     f'patch_size {self.patch_size}')

    @property
    def grid(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size

    @property
    def n_patches(self) -> int:
        """Rows of the output."""
        return self.grid * self.grid

    @property
    def patch_dim(self) -> int:
        """Values per patch (P * P * 3)."""
        return self.patch_size * self.patch_size * 3


@dataclasses.dataclass(frozen=True)
class Weights:
    """Deterministic parameters of the stand-in (from spec.seed)."""

    scale: np.ndarray       # [3] float32
    shift: np.ndarray       # [3] float32
    weight: np.ndarray      # [patch_dim, hidden] float32
    bias: np.ndarray        # [hidden] float32
    position: np.ndarray    # [n_patches, hidden] float32


def make_weights(spec: PatchEmbedSpec) -> Weights:
    """Draw the parameters of the model (identical for identical specs)."""
    rng = np.random.default_rng(spec.seed)
    std = np.asarray(spec.std, np.float64)
    scale = (1.0 / (255.0 * std)).astype(np.float32)
    shift = (-np.asarray(spec.mean, np.float64) / std).astype(np.float32)
    # Normalized pixels are ~unit variance: weights of std embed_std / sqrt(fan_in) keep the
    # projection's output near embed_std.
    weight = (rng.standard_normal((spec.patch_dim, spec.hidden_size)) *
              (spec.embed_std / np.sqrt(spec.patch_dim))).astype(np.float32)
    bias = (rng.standard_normal(spec.hidden_size) * spec.embed_std * 0.1).astype(np.float32)
    position = (rng.standard_normal((spec.n_patches, spec.hidden_size)) *
                spec.embed_std * 0.1).astype(np.float32)
    return Weights(scale, shift, weight, bias, position)


def resize_indices(length: int, size: int) -> np.ndarray:
    """Return the source indices of the nearest-neighbour resize from length to size."""
    return (np.arange(size, dtype=np.int64) * length) // size


def reference(frame: np.ndarray, spec: Optional[PatchEmbedSpec] = None) -> np.ndarray:
    """Recompute the model in NumPy on one uint8 [H, W, 3] frame."""
    spec = spec or PatchEmbedSpec()
    w = make_weights(spec)
    frame = np.asarray(frame)
    if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3:
        raise ModelMismatchError(f'reference() takes uint8 [H, W, 3] frames, got '
                                 f'{frame.dtype} {list(frame.shape)}')
    resized = frame[resize_indices(frame.shape[0], spec.image_size)][
        :, resize_indices(frame.shape[1], spec.image_size)]
    normalized = resized.astype(np.float32) * w.scale + w.shift
    g, p = spec.grid, spec.patch_size
    patches = normalized.reshape(g, p, g, p, 3).transpose(0, 2, 1, 3, 4).reshape(
        spec.n_patches, spec.patch_dim)
    return patches @ w.weight + w.bias + w.position
