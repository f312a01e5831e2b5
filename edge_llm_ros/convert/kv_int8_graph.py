"""The int8-KV graph beside model.onnx: the same nodes over int8 KV buffers (kv.dtype int8).

The op library's CausalAttention reads and writes int8 K/V rows with one float32 scale per
(head, position) row when its past key/value are int8 and its inputs 11 and 12 (the scales)
are given (native/include/edge_llm_kquant/attention_i8.h). A graph's input types are fixed, so
the runtime loads this second graph (model_format.KV_INT8_MODEL_FILE) when kv.dtype is int8:
model.onnx with every ``past_key_values.{i}.key/value`` and ``present.{i}.key/value`` int8
and ``past_key_values.{i}.key_scale/value_scale`` [N, kv_heads, L, 1] float32 inputs, bound
as past and present (``present.{i}.key_scale/value_scale``) like the buffers. The weights stay
in model.onnx.data, which both graphs name: this file is a few hundred KB.

``python -m edge_llm_ros.convert.kv_int8_graph FOLDER`` adds it to a folder converted before
the converter wrote it.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys

import onnx
from onnx import TensorProto

from edge_llm_ros.convert.onnx_graph import KQUANT_DOMAIN
from edge_llm_ros.model_format import KV_INT8_MODEL_FILE, MODEL_FILE

# Where CausalAttention takes the past scales and gives the present ones.
_SCALE_INPUTS = 11


def scale_name(kv_name: str) -> str:
    """Return the scale buffer's name of a KV buffer name ('...key' -> '...key_scale')."""
    return f'{kv_name}_scale'


def int8_kv_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """Return a copy of `model` over int8 KV buffers (ValueError: no CausalAttention)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    kv_names = set()
    for node in graph.node:
        if node.op_type != 'CausalAttention' or node.domain != KQUANT_DOMAIN:
            continue
        if any(a.name == 'shared_kv' and a.i for a in node.attribute):
            raise ValueError('the graph has shared-KV layers (gemma4), whose attention reads '
                             'float32 KV only: use kv.dtype float32 for it')
        past_key, past_value = node.input[3], node.input[4]
        present_key, present_value = node.output[1], node.output[2]
        while len(node.input) < _SCALE_INPUTS:
            node.input.append('')
        node.input.extend([scale_name(past_key), scale_name(past_value)])
        node.output.extend([scale_name(present_key), scale_name(present_value)])
        kv_names.update((past_key, past_value, present_key, present_value))
    if not kv_names:
        raise ValueError('the graph has no CausalAttention of the op library: int8 KV needs a '
                         'model converted with attention: causal (converter 9)')
    for infos in (graph.input, graph.output):
        scales = []
        for info in infos:
            if info.name not in kv_names:
                continue
            info.type.tensor_type.elem_type = TensorProto.INT8
            scale = onnx.ValueInfoProto()
            scale.CopyFrom(info)
            scale.name = scale_name(info.name)
            scale.type.tensor_type.elem_type = TensorProto.FLOAT
            dims = scale.type.tensor_type.shape.dim
            dims[len(dims) - 1].Clear()
            dims[len(dims) - 1].dim_value = 1
            scales.append(scale)
        infos.extend(scales)
    return out


def write_int8_kv_graph(folder: pathlib.Path) -> pathlib.Path:
    """Write folder/KV_INT8_MODEL_FILE from folder/model.onnx (its weights stay where they are)."""
    model = onnx.load_model(str(folder / MODEL_FILE), load_external_data=False)
    path = folder / KV_INT8_MODEL_FILE
    tmp = path.with_suffix('.tmp')
    onnx.save_model(int8_kv_graph(model), str(tmp))
    tmp.replace(path)
    return path


def linked_folder(source: pathlib.Path, folder: pathlib.Path) -> pathlib.Path:
    """Make `folder`: hard links to (or copies of) source's files, and its int8-KV graph.

    For a folder that must stay as it is (a shared cache): not symbolic links, since
    onnxruntime refuses external data that resolves outside the model's folder.
    """
    folder.mkdir(parents=True)
    for path in source.iterdir():
        if path.is_file() and path.name != KV_INT8_MODEL_FILE:
            try:
                os.link(path.resolve(), folder / path.name)
            except OSError:   # another file system
                shutil.copy2(path, folder / path.name)
    write_int8_kv_graph(folder)
    return folder


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('folder', type=pathlib.Path, help='a converted model folder')
    args = parser.parse_args(argv)
    try:
        print(write_int8_kv_graph(args.folder))
    except (OSError, ValueError) as e:
        print(f'kv_int8_graph: {e}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
