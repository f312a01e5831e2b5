"""Run one GGUF through llama.cpp (the format's reference) and through converter + ONNX graph.

llama.cpp runs in the portable llama-cpp-python venv of bench/llama_peer.py (built on first
use: ~6-8 min once, then cached in .cache/llama_cpp_peer), in a subprocess that feeds token
ids directly (test/llama_cpp_runner.py). Our side converts the GGUF with
edge_llm_ros.convert.converter and drives the graph with ort_driver.OrtDriver, which binds the KV
buffers exactly as the engine's OnnxDecoder does (test_llama_cpp_parity also checks that the
engine's decoder gives the same logits).

    result = compare(gguf_path, work_dir, accuracy_level=0)
    result.greedy_equal, result.max_abs_diff, result.max_kl
"""
from dataclasses import dataclass
import importlib
import json
import os
import pathlib
import subprocess
import sys
import threading
from typing import Dict, List, Sequence, Tuple

import numpy as np
from ort_driver import OrtDriver

from edge_llm_ros.convert.converter import convert

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNNER = pathlib.Path(__file__).with_name('llama_cpp_runner.py')
PROMPT = (5, 17, 99, 120, 3, 250, 44, 61)
TOKENS = 32
_LOCK = threading.Lock()
_CONVERTED: Dict[tuple, pathlib.Path] = {}


def peer_python() -> str:
    """Return the llama-cpp-python venv's python, building the peer first when it is missing."""
    sys.path.insert(0, str(ROOT / 'bench'))
    try:
        llama_peer = importlib.import_module('llama_peer')
    finally:
        sys.path.remove(str(ROOT / 'bench'))
    return llama_peer.ensure_peer(install=True)['python']


GGML_TABLES = """
import ctypes, os, sys
import llama_cpp
import numpy as np
lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), 'lib', 'libggml-cpu.so'))
lib.ggml_cpu_init()
np.savez(sys.argv[1], **{name: np.ctypeslib.as_array((ctypes.c_uint16 * 65536).in_dll(
    lib, f'ggml_table_{name}_f16')).copy() for name in ('gelu', 'gelu_quick')})
"""


def ggml_tables(out_npz) -> Dict[str, np.ndarray]:
    """Return ggml-cpu's float16 GELU and quick GELU tables, read from the peer's library.

    Keys `gelu` and `gelu_quick`: float32 [65536], indexed by the float16 input's bits.
    """
    proc = subprocess.run([peer_python(), '-c', GGML_TABLES, str(out_npz)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {k: v.view(np.float16).astype(np.float32) for k, v in np.load(out_npz).items()}


def llama_cpp_greedy(gguf_path, out_npz, prompt: Sequence[int] = PROMPT,
                     tokens: int = TOKENS, lora: Sequence[Tuple[str, float]] = ()
                     ) -> Tuple[np.ndarray, List[int]]:
    """Greedy-decode with llama.cpp (LoRA GGUFs at their scales); return (logits, ids)."""
    out_npz = pathlib.Path(out_npz)
    if not out_npz.is_file():
        cmd = [peer_python(), str(RUNNER), str(gguf_path), str(out_npz),
               '--prompt', ','.join(map(str, prompt)), '--tokens', str(tokens)]
        for path, scale in lora:
            cmd += ['--lora', f'{path}:{scale!r}']
        env = dict(os.environ, OMP_NUM_THREADS='1')
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f'llama.cpp failed on {gguf_path} (exit {proc.returncode}): '
                               f'{proc.stderr[-2000:]}')
    data = np.load(out_npz)
    return data['logits'], [int(t) for t in data['tokens']]


def converted(gguf_path, work_dir, **convert_kwargs) -> pathlib.Path:
    """Convert a GGUF once per (file, options) in this process; return the model folder."""
    key = (str(gguf_path), tuple(sorted(convert_kwargs.items())))
    with _LOCK:
        if key not in _CONVERTED:
            tag = '-'.join(f'{k}{v}' for k, v in sorted(convert_kwargs.items())) or 'default'
            out = pathlib.Path(work_dir) / f'{pathlib.Path(gguf_path).stem}-{tag}'
            _CONVERTED[key] = convert(str(gguf_path), str(out), progress=False,
                                      overwrite=True, **convert_kwargs)
        return _CONVERTED[key]


def engine_logits(model_dir, prompt: Sequence[int], follow: Sequence[int]) -> np.ndarray:
    """Logits after the prompt, then after each id of `follow` fed one at a time."""
    drv = OrtDriver(model_dir, max_ctx=len(prompt) + len(follow) + 1)
    rows = [drv.step(list(prompt)).copy()]
    for tok in follow:
        rows.append(drv.step([tok]).copy())
    return np.stack(rows)


def engine_greedy(model_dir, prompt: Sequence[int], tokens: int) -> List[int]:
    """Greedy-decode `tokens` ids with the converted model."""
    return OrtDriver(model_dir, max_ctx=len(prompt) + tokens + 1).greedy(list(prompt), tokens)


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(softmax(p) || softmax(q)) per row, in nats."""
    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)


@dataclass
class ParityResult:
    """How the converted model compares with llama.cpp on one GGUF."""

    llama_tokens: List[int]
    engine_tokens: List[int]
    max_abs_diff: float  # over every step, on llama.cpp's greedy path
    peak_logit: float
    max_kl: float
    mean_kl: float

    @property
    def greedy_equal(self) -> bool:
        return self.llama_tokens == self.engine_tokens

    def summary(self) -> str:
        return json.dumps({'greedy_equal': self.greedy_equal,
                           'max_abs_diff': round(self.max_abs_diff, 6),
                           'peak_logit': round(self.peak_logit, 3),
                           'max_kl': float(f'{self.max_kl:.3g}'),
                           'mean_kl': float(f'{self.mean_kl:.3g}')})


def compare(gguf_path, work_dir, prompt: Sequence[int] = PROMPT, tokens: int = TOKENS,
            **convert_kwargs) -> ParityResult:
    """Greedy both ways and compare logits along llama.cpp's path."""
    gguf_path = pathlib.Path(gguf_path)
    ref_logits, ref_tokens = llama_cpp_greedy(
        gguf_path, pathlib.Path(work_dir) / f'{gguf_path.stem}.llama_cpp.npz', prompt, tokens)
    model = converted(gguf_path, work_dir, **convert_kwargs)
    ours = engine_logits(model, prompt, ref_tokens)
    kl = kl_divergence(ref_logits, ours)
    return ParityResult(ref_tokens, engine_greedy(model, prompt, tokens),
                        float(np.abs(ours - ref_logits).max()),
                        float(np.abs(ref_logits).max()), float(kl.max()), float(kl.mean()))


# --- docs/quantization.md figures --------------------------------------------------------

def bits_per_weight(qtype: str, precision: str = 'source', accuracy_level: int = 4,
                    k: int = 4096) -> float:
    """Bits the converted graph reads per weight of a [64, k] matrix stored as `qtype`."""
    import gguf
    from gguf_fixtures import random_blocks, RAW_SCALE_FIELDS

    from edge_llm_ros.convert.checkpoint import SourceTensor
    from edge_llm_ros.convert.quant import fold_offsets, to_blocks
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, k)) * 0.02).astype(np.float32)
    if qtype in RAW_SCALE_FIELDS:
        data = random_blocks(64, k, qtype, 0.02, rng)
    elif qtype in ('F32', 'F16'):
        data = w.astype(np.float32 if qtype == 'F32' else np.float16)
    else:
        data = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    b = to_blocks(SourceTensor('w', qtype, (64, k), data), 32, precision)
    extra = 0
    if b.offsets is not None and accuracy_level == 4 and b.bits == 4:
        b, _ = fold_offsets(b, 2)
    elif b.offsets is not None:
        extra = b.offsets.nbytes
    total = b.packed.nbytes + b.scales.nbytes + extra
    if not b.default_zero_points():
        total += b.packed_zero_points().nbytes
    return total * 8 / (64 * k)


def measure_table(work_dir) -> List[dict]:
    """Measure KL and max |dlogit| vs llama.cpp per type (docs/quantization.md's table).

    On a random-head fixture (no next-token term, so the distributions are not peaked),
    teacher-forced on llama.cpp's greedy path.
    """
    import gguf
    from gguf_fixtures import ParityCase, write_gguf
    work = pathlib.Path(work_dir)
    rows = []
    types = ('F32', 'F16', 'BF16', 'Q8_0', 'Q4_0', 'Q4_1', 'Q5_0', 'Q5_1', 'Q2_K', 'Q3_K',
             'Q4_K', 'Q5_K', 'Q6_K', 'IQ4_NL', 'IQ4_XS')
    for qtype in types:
        case = ParityCase('llama', qtype, chain=0.0)
        path = work / f'{case.tag}-nochain.gguf'
        if not path.is_file():
            write_gguf(path, case)
        ref, ref_tokens = llama_cpp_greedy(path, work / f'{path.stem}.llama_cpp.npz')
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
        row = {'type': qtype, 'gguf_bpw': size * 8 / block}
        for label, kwargs in (('exact', {'accuracy_level': 0}),
                              ('default', {'accuracy_level': 4}),
                              ('int4', {'accuracy_level': 4, 'precision': 'int4'})):
            ours = engine_logits(converted(path, work, **kwargs), PROMPT, ref_tokens)
            kl = kl_divergence(ref, ours)
            row[label] = {'mean_kl': float(kl.mean()), 'max_kl': float(kl.max()),
                          'max_abs_diff': float(np.abs(ours - ref).max()),
                          'bpw': bits_per_weight(qtype, kwargs.get('precision', 'source'),
                                                 kwargs['accuracy_level'])}
        rows.append(row)
    return rows


def measure_gguf(gguf_path, work_dir, tokens: int = 8) -> dict:
    """KL and max |dlogit| vs llama.cpp of one (real-shape random) GGUF at the default settings.

    Random weights give flat distributions where argmax ties are common, so only the
    teacher-forced logits on llama.cpp's path are compared.
    """
    path = pathlib.Path(gguf_path)
    ref, ref_tokens = llama_cpp_greedy(path, pathlib.Path(work_dir) / f'{path.stem}.npz',
                                       tokens=tokens)
    ours = engine_logits(converted(path, work_dir), PROMPT, ref_tokens)
    kl = kl_divergence(ref, ours)
    return {'gguf': path.name, 'max_kl': float(kl.max()), 'mean_kl': float(kl.mean()),
            'max_abs_diff': float(np.abs(ours - ref).max()),
            'peak_logit': float(np.abs(ref).max())}


if __name__ == '__main__':
    import tempfile
    if len(sys.argv) > 2 and sys.argv[1] == '--gguf':  # --gguf WORK_DIR a.gguf b.gguf ...
        for g in sys.argv[3:]:
            print(json.dumps(measure_gguf(g, sys.argv[2])))
        sys.exit(0)
    with tempfile.TemporaryDirectory() as tmp:
        for r in measure_table(sys.argv[1] if len(sys.argv) > 1 else tmp):
            print(json.dumps(r))
