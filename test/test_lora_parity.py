"""LoRA adapters per row against llama.cpp's own adapter API, on tiny random models.

Each family's Q8_0 fixture (gguf_fixtures) is converted with weights='kquant'; tiny random
adapters on every projection (lora_fixtures, written as convert_lora_to_gguf.py does: the
first in F32, the second in F16, which the engine keeps in F16 and widens in the kernels) are
loaded by llama.cpp (llama_adapter_lora_init + llama_set_adapters_lora) and by the engine
(converted once: convert/lora.py, read in numpy form: runtime/lora_adapter.py, registered on
the op nodes: runtime/lora_ops.py). Both greedy-decode
32 ids after the 8-token prompt: they must be equal at scales 0.5, 1 and 2 and with two
adapters at once. Scale 0 gives the base model's logits bit for bit, and a row's logits are
the same bits alone and beside rows with other adapters (or none) in one call.
"""
import pathlib
from typing import List, Sequence, Tuple

from gguf_fixtures import ParityCase, write_gguf
from llama_cpp_parity import converted, llama_cpp_greedy, PROMPT, TOKENS
from lora_fixtures import ALL_ROLES, FUSED_ROLES, random_pairs, write_lora_gguf
import numpy as np
import pytest
from tiny_model import TinyDims

from edge_llm_ros.convert.lora import ensure_converted
from edge_llm_ros.model_format import load_model_info
from edge_llm_ros.runtime.decoder import OnnxDecoder, SessionConfig
from edge_llm_ros.runtime.lora_adapter import load_converted
from edge_llm_ros.runtime.rows import Row

GEMMA_DIMS = TinyDims(hidden=256, intermediate=512, rms_eps=1e-6, key_length=64,
                      rope_theta=1e6)   # test_llama_cpp_parity's gemma3 case
CASES = [ParityCase('llama', 'Q8_0'), ParityCase('qwen2', 'Q8_0'), ParityCase('qwen3', 'Q8_0'),
         ParityCase('gemma3', 'Q8_0', dims=GEMMA_DIMS, window=6, swa_pattern=2),
         ParityCase('phi3', 'Q8_0')]   # fused attn_qkv and gate|up ffn_up adapters
RANK = 8
STD = 0.06   # the adapters move the logits by > 5 * MAX_ABS_DIFF (asserted)
MAX_ABS_DIFF = 0.4   # test_llama_cpp_parity's KQUANT_MAX_ABS_DIFF: llama.cpp's own rounding
MIN_MARGIN = 2 * MAX_ABS_DIFF   # llama.cpp's top-2 gap on its path: no argmax flips inside


@pytest.fixture(scope='module')
def work(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp('lora_parity')


def setup_case(work: pathlib.Path, case: ParityCase):
    base = work / f'{case.tag}.gguf'
    if not base.is_file():
        write_gguf(base, case)
    adapters = []
    for seed in (1, 2):
        path = work / f'{case.tag}-lora{seed}.gguf'
        if not path.is_file():
            roles = FUSED_ROLES if case.arch == 'phi3' else ALL_ROLES
            write_lora_gguf(path, case.arch, case.dims,
                            random_pairs(case.dims, RANK, seed=seed, std=STD, roles=roles),
                            alpha=16.0, wtype='F32' if seed == 1 else 'F16')
        adapters.append(path)
    model = converted(base, work, accuracy_level=4, weights='kquant')
    dec = OnnxDecoder(str(model), load_model_info(str(model)),
                      SessionConfig(max_context=64, slots=3))
    ids = [dec.enable_lora().add(load_converted(ensure_converted(str(p), str(model)), dec.info))
           for p in adapters]
    return base, adapters, dec, ids


def greedy(dec: OnnxDecoder, uses: Tuple[Tuple[int, float], ...], slot: int = 0,
           tokens: int = TOKENS) -> Tuple[List[int], np.ndarray]:
    """Greedy ids and every step's logits, one row a call."""
    out, logits = [], []
    row = Row(slot, 0, np.array(PROMPT, dtype=np.int64), lora=uses)
    for _ in range(tokens):
        step = dec.run([row])[-1].copy()
        logits.append(step)
        out.append(int(np.argmax(step)))
        row = Row(slot, row.start + row.length, np.array([out[-1]], dtype=np.int64), lora=uses)
    return out, np.stack(logits)


def llama_greedy(work, base, lora: Sequence[Tuple[pathlib.Path, float]], tag: str
                 ) -> Tuple[List[int], np.ndarray]:
    logits, ids = llama_cpp_greedy(base, work / f'{base.stem}-{tag}.npz', PROMPT, TOKENS,
                                   [(str(p), s) for p, s in lora])
    top2 = np.sort(logits, axis=-1)[:, -2:]
    assert float((top2[:, 1] - top2[:, 0]).min()) > MIN_MARGIN, f'{tag}: a near-tie'
    return ids, logits[:TOKENS]


def check(dec, work, base, uses, lora, tag: str) -> Tuple[List[int], np.ndarray]:
    ours, logits = greedy(dec, uses)
    theirs, their_logits = llama_greedy(work, base, lora, tag)
    diff = float(np.abs(logits - their_logits).max())
    print(f'{base.stem} {tag}: greedy equal {ours == theirs}, max |logit diff| {diff:.3g}')
    assert ours == theirs, (tag, ours, theirs)
    assert diff <= MAX_ABS_DIFF, tag
    return ours, logits


@pytest.mark.parametrize('case', CASES, ids=lambda c: c.tag)
def test_adapters_match_llama_cpp(work, native_library, case):
    base, paths, dec, ids = setup_case(work, case)
    _, base_logits = check(dec, work, base, (), (), 'base')
    for scale in (0.5, 1.0, 2.0):
        _, logits = check(dec, work, base, ((ids[0], scale),), [(paths[0], scale)],
                          f'a{scale}')
        # Control: the adapter moves the logits far beyond the bound (not a vacuous check).
        assert float(np.abs(logits - base_logits).max()) > 5 * MAX_ABS_DIFF
    check(dec, work, base, ((ids[0], 1.0), (ids[1], 0.5)), [(paths[0], 1.0), (paths[1], 0.5)],
          'both')


@pytest.mark.parametrize('case', CASES[:1], ids=lambda c: c.tag)
def test_scale_zero_is_the_base_and_rows_are_batch_independent(work, native_library, case):
    _, _, dec, ids = setup_case(work, case)
    _, base = greedy(dec, (), tokens=4)
    _, zero = greedy(dec, ((ids[0], 0.0),), tokens=4)
    assert np.array_equal(base, zero)
    alone_ids, alone = greedy(dec, ((ids[0], 1.0),), slot=0, tokens=4)
    # The same goal beside a row with another adapter and a row on the base, in one call.
    uses = [((ids[0], 1.0),), ((ids[1], 2.0),), ()]
    rows = [Row(s, 0, np.array(PROMPT, dtype=np.int64), lora=uses[s]) for s in range(3)]
    batched = []
    for _ in range(4):
        logits = dec.run(rows).copy()
        batched.append(logits[0])
        rows = [Row(r.slot, r.start + r.length, np.array([int(np.argmax(logits[i]))]),
                    lora=r.lora) for i, r in enumerate(rows)]
    assert np.array_equal(np.stack(batched), alone)


@pytest.mark.parametrize('case', CASES[:1], ids=lambda c: c.tag)
def test_adapter_bits_do_not_depend_on_the_threads(work, native_library, case):
    """The op spreads the rows' shrinks and expands over ORT's pool: 1 thread = 3 threads."""
    base, paths, _, _ = setup_case(work, case)
    model = converted(base, work, accuracy_level=4, weights='kquant')
    runs = []
    for threads in (1, 3):
        dec = OnnxDecoder(str(model), load_model_info(str(model)),
                          SessionConfig(max_context=64, slots=3, intra_op_threads=threads))
        ids = [dec.enable_lora().add(load_converted(ensure_converted(str(p), str(model)),
                                                    dec.info)) for p in paths]
        uses = [((ids[0], 1.0),), ((ids[1], 2.0), (ids[0], 0.5)), ()]
        rows = [Row(s, 0, np.array(PROMPT, dtype=np.int64), lora=uses[s]) for s in range(3)]
        steps = []
        for _ in range(3):
            logits = dec.run(rows).copy()
            steps.append(logits)
            rows = [Row(r.slot, r.start + r.length, np.array([int(np.argmax(logits[i]))]),
                        lora=r.lora) for i, r in enumerate(rows)]
        dec.lora.close()
        runs.append(np.stack(steps))
    assert np.array_equal(runs[0], runs[1])
