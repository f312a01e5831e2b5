"""Write the perception stand-in encoder (vision/default_model.py) as an ONNX graph.

The stand-in is a patch-embedding model with random weights (see vision/default_model.py for
what it computes and why it exists); this module builds its graph with onnx.helper, so the
perception node's default model needs the converter's onnx, like any other conversion.

    python -m edge_llm_ros.convert.standin_encoder OUT.onnx [--hidden-size N ...]
"""
import argparse
import dataclasses
from typing import Optional, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper, TensorProto

from edge_llm_ros.bringup.parameters import SMOLLM2_HIDDEN
from edge_llm_ros.vision.default_model import (INPUT_NAME, make_weights, OUTPUT_NAME,
                                               PatchEmbedSpec)

OPSET = 18
IR_VERSION = 9          # onnxruntime >= 1.16 loads it (onnx 1.23 would write 14 by default)


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
                              producer_name='edge_llm_ros.convert.standin_encoder',
                              doc_string='Random patch-embedding stand-in (seed '
                                         f'{spec.seed}); not a trained image encoder.')
    model.ir_version = IR_VERSION
    helper.set_model_props(model, {k: str(v) for k, v in dataclasses.asdict(spec).items()})
    onnx.checker.check_model(model)
    return model


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
