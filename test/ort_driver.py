"""Minimal onnxruntime driver of a converted model folder, for the converter's own tests.

It binds one preallocated KV buffer per layer as both past and present (the contract's
share-buffer mode), and a conv layer's state (model.yaml layer_states) the same way, so it
exercises the graph exactly as the runtime does, without depending on the runtime
(runtime/decoder.py).
"""
import pathlib
from typing import Optional, Sequence

import numpy as np
import onnxruntime as ort
import yaml

from edge_llm_ros.runtime import native_ops


class OrtDriver:
    """Feed tokens (and optional embeddings) step by step; returns last-position logits."""

    def __init__(self, model_dir, max_ctx: int = 128, threads: int = 1) -> None:
        model_dir = pathlib.Path(model_dir)
        self.meta = yaml.safe_load((model_dir / 'model.yaml').read_text())
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        if native_ops.DOMAIN in (self.meta.get('op_domains') or ()):
            native_ops.register(so, f'the test driver of {model_dir.name}')
        self.sess = ort.InferenceSession(str(model_dir / 'model.onnx'), so,
                                         providers=['CPUExecutionProvider'])
        self.dtype = np.float16 if self.meta['activation_dtype'] == 'float16' else np.float32
        shape = (1, self.meta['num_kv_heads'], max_ctx, self.meta['head_dim'])
        layers = self.meta['num_layers']
        states = self.meta.get('layer_states') or [{'kind': 'kv'}] * layers
        # (graph input, graph output, buffer) per bound state: a layer's K and V, or its conv
        # state (B * x of its last kernel - 1 positions).
        self.bound = []
        for i, state in enumerate(states):
            if state['kind'] in ('conv', 'recurrent'):  # one vector per slot: qwen35
                buf = np.zeros((1, *state['shape']), self.dtype)
                self.bound.append((f'past_conv.{i}', f'present_conv.{i}', buf))
                continue
            if state['kind'] == 'shared':
                continue   # reads its owner's buffers inside the graph (gemma4)
            # A layer may have its own heads and head size (gemma4).
            layer_shape = (1, state.get('kv_heads') or shape[1], max_ctx,
                           state.get('head_dim') or shape[3])
            for kind in ('key', 'value'):
                self.bound.append((f'past_key_values.{i}.{kind}', f'present.{i}.{kind}',
                                   np.zeros(layer_shape, self.dtype)))
        self.kv = [buf for _, _, buf in self.bound]
        self.kv_values = [ort.OrtValue.ortvalue_from_numpy(a) for a in self.kv]
        self.max_ctx = max_ctx
        self.pos = 0
        # A graph of the op library's attention runs rows (runtime/rows.py: converter 9).
        self.inputs = {i.name for i in self.sess.get_inputs()}
        self.varlen = 'rows' in self.inputs

    def step(self, ids: Sequence[int], embeds: Optional[np.ndarray] = None) -> np.ndarray:
        """Run the new tokens; return logits [vocab] of the last one."""
        # qwen3vl: an embedding row also carries its DeepStack rows.
        hidden = self.meta['hidden_size'] * (1 + int(self.meta.get('deepstack_layers', 0)))
        if embeds is None:
            embeds = np.zeros((0, hidden), self.dtype)
        n = len(ids) + len(embeds)
        total = self.pos + n
        if total > self.max_ctx:
            raise ValueError('context full')
        io = self.sess.io_binding()
        e = len(embeds)
        if self.varlen:   # one row (slot 0): embeddings at packed places 0..e-1, then ids
            io.bind_cpu_input('input_ids', np.concatenate(
                [np.zeros(e, np.int64), np.asarray(ids, np.int64)]).reshape(1, -1))
            io.bind_cpu_input('inputs_embeds', np.asarray(embeds, self.dtype).reshape(e, hidden))
            io.bind_cpu_input('embeds_at', np.arange(e, dtype=np.int64).reshape(e, 1))
            io.bind_cpu_input('rows', np.array([[0, self.pos, n, 0]], np.int32))
            io.bind_cpu_input('logits_at', np.array([n - 1], np.int64))
            if 'rope_positions' in self.inputs:   # M-RoPE: text is t = h = w
                io.bind_cpu_input('rope_positions', np.repeat(
                    np.arange(self.pos, total, dtype=np.int32)[None], 3, axis=0))
        else:
            io.bind_cpu_input('input_ids', np.asarray(ids, np.int64).reshape(1, -1))
            io.bind_cpu_input('inputs_embeds', np.asarray(embeds, self.dtype)[None])
            io.bind_cpu_input('seqlens_k', np.array([total - 1], np.int32))
            io.bind_cpu_input('total_sequence_length', np.array(total, np.int32))
            io.bind_cpu_input('logits_count', np.array([1], np.int64))
        io.bind_output('logits')
        for (past, present, _), ov in zip(self.bound, self.kv_values):
            io.bind_ortvalue_input(past, ov)
            io.bind_ortvalue_output(present, ov)
        self.sess.run_with_iobinding(io)
        self.pos = total
        return io.copy_outputs_to_cpu()[0].reshape(-1)

    def greedy(self, ids: Sequence[int], n: int, stop_ids: Sequence[int] = ()) -> list:
        """Greedy-decode up to n tokens after the prompt ids."""
        logits = self.step(ids)
        out = []
        for _ in range(n):
            tok = int(np.argmax(logits))
            out.append(tok)
            if tok in stop_ids:
                break
            logits = self.step([tok])
        return out
