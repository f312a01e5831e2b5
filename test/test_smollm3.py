"""SmolLM3: the llama skeleton whose every fourth layer attends without RoPE.

llama.cpp (src/models/smollm3.cpp) rotates q and k of layer il only when (il + 1) % 4 != 0
(n_no_rope_layer_step, fixed at 4 for the family: the GGUF has no key for it). The converter
reads it as ModelSpec.nope_layers and the graph feeds those layers' attention an identity
rotation (cos 1, sin 0: x * 1 - y * 0 is x exactly). Checked against llama.cpp on a tiny
4-layer smollm3 GGUF (gguf_fixtures.smollm3_case): 32 greedy ids equal for F16 (MatMulNBits
at level 0), Q8_0 and Q4_K (kquant), every logit on llama.cpp's path within
test_llama_cpp_parity's bounds. Control: llama.cpp's logits of the same weights as a llama
file (every layer rotated) are 10x the parity difference away from the smollm3 ones, so the
fixture does show the unrotated layer. Engine: goals batched equal each alone, bit for bit;
a session continues from its snapshot bit for bit; speculation (prompt lookup, a draft
model) gives plain decoding's output. An HF folder (config no_rope_layers) converts to the
GGUF's graph, byte for byte.
"""
import json
import pathlib

from gguf_fixtures import ParityCase, smollm3_case, SMOLLM3_DIMS, write_gguf, write_hf
from llama_cpp_parity import compare, converted, engine_logits, llama_cpp_greedy, PROMPT
import numpy as np
import onnx
import pytest
from state_family_checks import (alone_bits, check_batched_equals_alone,
                                 check_speculation_equals_plain, engine, result_bits, turn,
                                 USER1, USER2)
from test_llama_cpp_parity import KQUANT_MAX_ABS_DIFF, MAX_ABS_DIFF, MIN_MARGIN
import yaml

from edge_llm_ros.convert.checkpoint import load_checkpoint
from edge_llm_ros.convert.converter import convert
from edge_llm_ros.errors import ModelLoadError
from edge_llm_ros.runtime import model_config as mc
from edge_llm_ros.runtime.types import ChatMessage

CASE = smollm3_case('Q8_0')


@pytest.fixture(scope='module')
def work(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp('smollm3')


def gguf_of(work: pathlib.Path, case: ParityCase) -> pathlib.Path:
    path = work / f'{case.tag}.gguf'
    if not path.is_file():
        write_gguf(path, case)
    return path


@pytest.fixture(scope='module')
def kquant_dir(work, native_library) -> pathlib.Path:
    return converted(gguf_of(work, CASE), work, accuracy_level=4, weights='kquant')


def test_the_fourth_layer_reads_the_identity_rotation(work, kquant_dir):
    spec = load_checkpoint(str(gguf_of(work, CASE))).spec
    assert spec.nope_layers == (False, False, False, True)
    meta = yaml.safe_load((kquant_dir / 'model.yaml').read_text())
    assert meta['architecture'] == 'smollm3'
    assert meta['rope_scaling']['no_rope_layers'] == [3]
    assert mc.family_for_model_dir(kquant_dir).family == 'smollm3'
    graph = onnx.load(str(kquant_dir / 'model.onnx')).graph
    rope = {n.name: tuple(n.input[7:9]) for n in graph.node if n.op_type == 'CausalAttention'}
    assert rope == {'layers.0/attn': ('cos_cache', 'sin_cache'),
                    'layers.1/attn': ('cos_cache', 'sin_cache'),
                    'layers.2/attn': ('cos_cache', 'sin_cache'),
                    'layers.3/attn': ('cos_cache_nope', 'sin_cache_nope')}
    tables = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer
              if t.name.endswith('_nope')}
    assert (tables['cos_cache_nope'] == 1).all() and (tables['sin_cache_nope'] == 0).all()


@pytest.mark.parametrize('wtype', ['F16', 'Q8_0', 'Q4_K'])
def test_greedy_ids_equal_llama_cpp(work, native_library, wtype, compat):
    compat('smollm3', wtype, 'text')
    case = smollm3_case(wtype)
    path = gguf_of(work, case)
    exact = wtype == 'F16'
    kw = ({'accuracy_level': 0, 'weights': 'matmulnbits'} if exact
          else {'accuracy_level': 4, 'weights': 'kquant'})
    result = compare(path, work, **kw)
    print(f'{case.tag}: {result.summary()}')
    logits, _ = llama_cpp_greedy(path, work / f'{path.stem}.llama_cpp.npz')
    top2 = np.sort(logits, axis=-1)[:, -2:]
    assert float((top2[:, 1] - top2[:, 0]).min()) > MIN_MARGIN, 'fixture has a near-tie'
    assert result.greedy_equal, (result.llama_tokens, result.engine_tokens)
    assert result.max_abs_diff <= (MAX_ABS_DIFF if exact else KQUANT_MAX_ABS_DIFF)


def test_llama_cpp_leaves_the_fourth_layer_unrotated(work):
    """The same weights as a llama file (all layers rotated) move llama.cpp's logits.

    Measured 3.6 at most (one layer in four, beside the head's next-token term), against
    0.35 between llama.cpp and the converted F16 graph.
    """
    smol = gguf_of(work, smollm3_case('F16'))
    llama = gguf_of(work, ParityCase('llama', 'F16', dims=SMOLLM3_DIMS))
    ref, _ = llama_cpp_greedy(smol, work / f'{smol.stem}.llama_cpp.npz')
    rotated, _ = llama_cpp_greedy(llama, work / f'{llama.stem}.llama_cpp.npz')
    # Position 0 turns by angle 0 either way: the prompt's first logits row is not compared.
    assert float(np.abs(ref[1:] - rotated[1:]).max()) > 3 * MAX_ABS_DIFF


@pytest.fixture(scope='module')
def alone(kquant_dir) -> dict:
    return alone_bits(kquant_dir)


def test_batched_goals_equal_each_alone_bit_for_bit(kquant_dir, alone, compat):
    compat('smollm3', CASE.wtype, 'batching')
    check_batched_equals_alone(kquant_dir, alone)


def test_a_session_continues_from_its_snapshot_bit_for_bit(kquant_dir, compat):
    compat('smollm3', CASE.wtype, 'sessions')
    plain = engine(kquant_dir, max_context=256, prefix_reuse=False)
    try:
        first = turn(plain, [USER1])
        second = turn(plain, [USER1, ChatMessage('assistant', first.text), USER2])
    finally:
        plain.close()
    eng = engine(kquant_dir, max_context=256)
    try:
        a1 = turn(eng, [USER1], 'a')
        turn(eng, [USER2], 'b')   # takes the only slot: a's turn is saved as a snapshot
        a2 = turn(eng, [USER1, ChatMessage('assistant', a1.text), USER2], 'a')
    finally:
        eng.close()
    assert result_bits(a1) == result_bits(first)
    assert result_bits(a2) == result_bits(second)
    assert a2.timings.cached_prompt_tokens > 0


def test_speculation_equals_plain_decoding(work, kquant_dir, compat):
    """Verify passes over the unrotated layer give a decode step's bits (greedy)."""
    compat('smollm3', CASE.wtype, 'speculation')
    draft = convert(str(gguf_of(work, smollm3_case('Q8_0', seed=7, chain=0.3))),
                    str(work / 'draft'), progress=False, overwrite=True)
    check_speculation_equals_plain(kquant_dir, draft, max_tokens=24, some_rejected=False)


def test_an_hf_folder_converts_to_the_ggufs_graph(work):
    case = smollm3_case('F32')
    gguf_dir = convert(str(gguf_of(work, case)), str(work / 'f32-gguf'), progress=False,
                       overwrite=True)
    hf_dir = convert(str(write_hf(work / 'hf', case)), str(work / 'f32-hf'), progress=False,
                     overwrite=True)
    for name in ('model.onnx', 'model.onnx.data'):
        assert (hf_dir / name).read_bytes() == (gguf_dir / name).read_bytes(), name
    np.testing.assert_array_equal(engine_logits(hf_dir, PROMPT, [7, 8]),
                                  engine_logits(gguf_dir, PROMPT, [7, 8]))


def test_a_bad_no_rope_layers_list_is_refused(work):
    folder = write_hf(work / 'hf-bad', smollm3_case('F32'))
    config = json.loads((folder / 'config.json').read_text())
    config['no_rope_layers'] = [1, 1, 0]
    (folder / 'config.json').write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match='one 0 or 1 per layer'):
        load_checkpoint(str(folder))
