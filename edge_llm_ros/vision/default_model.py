"""The default perception model: a patch-embedding STAND-IN, not a trained encoder.

It has the shape of a ViT/SigLIP front end so the whole camera -> perception -> LLM path
runs (and is tested) without downloading weights, but its weights are random numbers
from a seed: the embeddings carry the image's pixels through a fixed random projection
and mean nothing to a language model. Give perception a real encoder with ``model.path``.

Graph (opset 18, built with onnx.helper), input ``frame`` uint8 [height, width, 3]
(any size: the dimensions are symbolic):

1. resize to image_size x image_size, nearest neighbour with integer indices
   ``row = (i * height) // image_size`` (exactly reproducible in NumPy)
2. normalize: ``x * (1 / (255 * std)) - mean / std`` per channel, float32
3. patchify into [n_patches, patch_size * patch_size * 3] (row-major patches, HWC inside)
4. ``patches @ weight + bias + position`` -> output ``embeddings`` float32
   [n_patches, hidden_size]

``reference()`` recomputes the same in NumPy (the tests compare the two).
"""
import argparse
import dataclasses
from typing import Optional, Sequence, Tuple

import numpy as np
import onnx
from onnx import helper, numpy_helper, TensorProto

from edge_llm_ros.bringup.parameters import SMOLLM2_HIDDEN
from edge_llm_ros.vision.errors import ModelMismatchError

OPSET = 18
IR_VERSION = 9          # onnxruntime >= 1.16 loads it (onnx 1.23 would write 14 by default)
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


def _const(name: str, array: np.ndarray) -> onnx.NodeProto:
    return helper.make_node('Constant', [], [name],
                            value=numpy_helper.from_array(np.asarray(array), name))


def build_model(spec: Optional[PatchEmbedSpec] = None) -> onnx.ModelProto:
    """Build the ONNX model of the stand-in (checked with onnx.checker)."""
    spec = spec or PatchEmbedSpec()
    w = make_weights(spec)
    size, grid, patch = spec.image_size, spec.grid, spec.patch_size
    nodes = [
        _const('steps', np.arange(size, dtype=np.int64)),
        _const('size', np.array(size, np.int64)),
        _const('zero', np.array(0, np.int64)),
        _const('one', np.array(1, np.int64)),
        _const('scale', w.scale), _const('shift', w.shift),
        _const('patch_shape', np.array([grid, patch, grid, patch, 3], np.int64)),
        _const('flat_shape', np.array([spec.n_patches, spec.patch_dim], np.int64)),
        helper.make_node('Shape', [INPUT_NAME], ['in_shape']),
        helper.make_node('Gather', ['in_shape', 'zero'], ['height'], axis=0),
        helper.make_node('Gather', ['in_shape', 'one'], ['width'], axis=0),
        # Nearest-neighbour indices in integer arithmetic: floor(i * height / size).
        helper.make_node('Mul', ['steps', 'height'], ['rows_scaled']),
        helper.make_node('Div', ['rows_scaled', 'size'], ['rows']),
        helper.make_node('Mul', ['steps', 'width'], ['cols_scaled']),
        helper.make_node('Div', ['cols_scaled', 'size'], ['cols']),
        helper.make_node('Gather', [INPUT_NAME, 'rows'], ['picked_rows'], axis=0),
        helper.make_node('Gather', ['picked_rows', 'cols'], ['resized'], axis=1),
        helper.make_node('Cast', ['resized'], ['pixels'], to=TensorProto.FLOAT),
        helper.make_node('Mul', ['pixels', 'scale'], ['scaled']),
        helper.make_node('Add', ['scaled', 'shift'], ['normalized']),
        helper.make_node('Reshape', ['normalized', 'patch_shape'], ['grid5']),
        helper.make_node('Transpose', ['grid5'], ['patches5'], perm=[0, 2, 1, 3, 4]),
        helper.make_node('Reshape', ['patches5', 'flat_shape'], ['patches']),
        helper.make_node('MatMul', ['patches', 'weight'], ['projected']),
        helper.make_node('Add', ['projected', 'bias'], ['biased']),
        helper.make_node('Add', ['biased', 'position'], [OUTPUT_NAME]),
    ]
    graph = helper.make_graph(
        nodes, 'patch_embed_stand_in',
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.UINT8, ['height', 'width', 3])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT,
                                       [spec.n_patches, spec.hidden_size])],
        initializer=[numpy_helper.from_array(w.weight, 'weight'),
                     numpy_helper.from_array(w.bias, 'bias'),
                     numpy_helper.from_array(w.position, 'position')])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid('', OPSET)],
                              producer_name='edge_llm_ros.vision.default_model',
                              doc_string='Random patch-embedding stand-in (seed '
                                         f'{spec.seed}); not a trained image encoder.')
    model.ir_version = IR_VERSION
    helper.set_model_props(model, {k: str(v) for k, v in dataclasses.asdict(spec).items()})
    onnx.checker.check_model(model)
    return model


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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Write the stand-in model to a file (to inspect it or to pass it as model.path)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('output', help='path of the .onnx file to write')
    parser.add_argument('--hidden-size', type=int, default=SMOLLM2_HIDDEN)
    parser.add_argument('--image-size', type=int, default=224)
    parser.add_argument('--patch-size', type=int, default=16)
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args(argv)
    spec = PatchEmbedSpec(hidden_size=args.hidden_size, image_size=args.image_size,
                          patch_size=args.patch_size, seed=args.seed)
    onnx.save(build_model(spec), args.output)
    print(f'{args.output}: [{spec.n_patches}, {spec.hidden_size}] float32 embeddings')
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
