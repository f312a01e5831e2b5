"""Minimal onnxruntime driver of a converted model folder, for the converter's own tests.

It binds one preallocated KV buffer per layer as both past and present (the contract's
share-buffer mode), so it exercises the graph exactly as the runtime does, without depending
on the runtime (runtime/decoder.py).
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
        self.kv = [np.zeros(shape, self.dtype) for _ in range(2 * self.meta['num_layers'])]
        self.kv_values = [ort.OrtValue.ortvalue_from_numpy(a) for a in self.kv]
        self.max_ctx = max_ctx
        self.pos = 0

    def step(self, ids: Sequence[int], embeds: Optional[np.ndarray] = None) -> np.ndarray:
        """Run the new tokens; return logits [vocab] of the last one."""
        hidden = self.meta['hidden_size']
        if embeds is None:
            embeds = np.zeros((0, hidden), self.dtype)
        n = len(ids) + len(embeds)
        total = self.pos + n
        if total > self.max_ctx:
            raise ValueError('context full')
        io = self.sess.io_binding()
        io.bind_cpu_input('input_ids', np.asarray(ids, np.int64).reshape(1, -1))
        io.bind_cpu_input('inputs_embeds', np.asarray(embeds, self.dtype)[None])
        io.bind_cpu_input('seqlens_k', np.array([total - 1], np.int32))
        io.bind_cpu_input('total_sequence_length', np.array(total, np.int32))
        io.bind_cpu_input('logits_count', np.array([1], np.int64))
        io.bind_output('logits')
        for i in range(self.meta['num_layers']):
            for j, kind in enumerate(('key', 'value')):
                ov = self.kv_values[2 * i + j]
                io.bind_ortvalue_input(f'past_key_values.{i}.{kind}', ov)
                io.bind_ortvalue_output(f'present.{i}.{kind}', ov)
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
