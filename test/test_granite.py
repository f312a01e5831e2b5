"""Granite 4.0-H (dense): Mamba-2 layers with a recurrent state beside attention layers.

Conversion: a granitehybrid GGUF (Mamba-2, attention, Mamba-2 layers; gguf_fixtures) becomes
a folder whose model.yaml declares each Mamba-2 layer's state (`recurrent`: its conv inputs
and SSM state in one vector per slot), whose graph runs the op library's Mamba2 over
past_conv.{i} / present_conv.{i} (ssm_in's z | xBC | dt rows as three projections) and the
library's attention without RoPE (rope.scaling.finetuned false), with Granite's embedding,
residual, attention and logit scales. Checked against llama.cpp: the greedy ids of 32 steps
are equal for F16 (MatMulNBits at level 0) and every type the op library holds (kquant), with
every logit on llama.cpp's path within the parity bounds of test_llama_cpp_parity. Control:
the same graph with its Mamba-2 states cleared after the prompt moves the logits far past the
bound. The mixture-of-experts variants (H-Tiny, H-Small) are refused by name.

Engine (the state machinery of lfm2 and qwen35, unchanged; test/state_family_checks): a
prompt in chunks gives the bits of one call; goals batched equal each alone, bit for bit, and
so does a preempted goal; prefix reuse stops at kept states and equals the uncached run; a
session continues from its saved states bit for bit, in memory and in SQLite after a restart;
speculation goes back to the states at the verify's start (output equal to plain decoding).
"""
import json
import pathlib
import shutil

from gguf_fixtures import (granite_case, GRANITE_DIMS, GRANITE_SCALES, GRANITE_SSM,
                           write_granite_gguf, write_granite_hf)
from llama_cpp_parity import compare, converted, engine_logits, llama_cpp_greedy
import numpy as np
import onnx
import pytest
from state_family_checks import (alone_bits, check_batched_equals_alone,
                                 check_chunks_equal_one_call, check_forced_tool_call,
                                 check_int8_kv_session,
                                 check_preempted_goals_resume,
                                 check_prefix_reuse_equals_uncached, check_session_continues,
                                 check_speculation_equals_plain,
                                 check_sqlite_session_after_restart,
                                 check_uncleared_states_matter, two_turns_sent_whole)
from test_llama_cpp_parity import KQUANT_MAX_ABS_DIFF, KQUANT_TYPES, MAX_ABS_DIFF, MIN_MARGIN
import yaml

from edge_llm_ros.convert.checkpoint import load_checkpoint
from edge_llm_ros.errors import ModelLoadError, UnsupportedModelError
from edge_llm_ros.model_format import LayerState, load_model_info
from edge_llm_ros.serving.engine import kv_budget_bytes

CASE = granite_case('Q8_0')
LONG_PROMPT = [5, 17, 99, 120, 3, 250, 44, 61, 7, 12, 31]


def state_floats() -> int:
    m = GRANITE_SSM
    inner = 2 * GRANITE_DIMS.hidden
    channels = inner + 2 * m['groups'] * m['state']
    return (m['kernel'] - 1) * channels + inner * m['state']


@pytest.fixture(scope='module')
def work(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp('granite')


def gguf_of(work: pathlib.Path, case) -> pathlib.Path:
    path = work / f'{case.tag}.gguf'
    if not path.is_file():
        write_granite_gguf(path, case)
    return path


@pytest.fixture(scope='module')
def source(work) -> pathlib.Path:
    return gguf_of(work, CASE)


@pytest.fixture(scope='module')
def kquant_dir(work, source, native_library) -> pathlib.Path:
    return converted(source, work, accuracy_level=4, weights='kquant')


def test_the_folder_declares_recurrent_states_and_runs_mamba2(kquant_dir):
    meta = yaml.safe_load((kquant_dir / 'model.yaml').read_text())
    rec = {'kind': 'recurrent', 'shape': [state_floats()]}
    assert meta['layer_states'] == [rec, {'kind': 'kv', 'window': 0}, rec]
    assert meta['architecture'] == 'granitehybrid' and meta['attention'] == 'causal'
    assert meta['embed_scale'] == GRANITE_SCALES['embedding_scale']
    assert meta['attention_scale'] == GRANITE_SCALES['attention_scale']
    assert meta['rope_scaling']['no_rope_layers'] == [0, 1, 2]
    info = load_model_info(str(kquant_dir))
    assert info.kv_layers == (1,) and info.conv_layers == (0, 2) and not info.rewindable
    assert info.state_of(0) == LayerState('recurrent', 0, (state_floats(),))
    graph = onnx.load(str(kquant_dir / 'model.onnx'), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count('Mamba2') == 2 and ops.count('CausalAttention') == 1
    # Granite's multipliers: both residual branches of each layer, and the logits.
    assert sum(n.name.endswith('/residual_scale') for n in graph.node) == 6
    inits = {t.name for t in graph.initializer}
    assert 'logit_scale_inv' in inits
    # No layer rotates: an identity cos/sin row per packed token, no table per position (a
    # Granite 4.0-H GGUF says 2**20 positions).
    assert not {'cos_cache', 'sin_cache', 'cos_cache_nope', 'sin_cache_nope'} & inits
    attn = next(n for n in graph.node if n.op_type == 'CausalAttention')
    assert {'cos_tokens_nope', 'sin_tokens_nope'} <= set(attn.input)
    assert onnx.helper.get_node_attr_value(attn, 'rope_per_token') == 1
    names = {i.name for i in graph.input}
    assert {'past_conv.0', 'past_conv.2', 'past_key_values.1.key'} <= names


def test_the_kv_budget_counts_the_recurrent_states(kquant_dir):
    info = load_model_info(str(kquant_dir))
    kv = 2 * GRANITE_DIMS.kv_heads * 64 * GRANITE_DIMS.head_dim   # one attention layer
    assert kv_budget_bytes(info, 64, 3) == 3 * (kv + 2 * state_floats()) * 4


@pytest.mark.parametrize('wtype', ['F16'] + list(KQUANT_TYPES))
def test_greedy_ids_equal_llama_cpp(work, native_library, wtype, compat):
    compat('granitehybrid', wtype, 'text')
    case = granite_case(wtype)
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


def test_granites_rope_switch_on_rotates_and_equals_llama_cpp(work, native_library):
    """rope.scaling.finetuned true: the attention layers rotate (RoPE tables), as llama.cpp."""
    path = write_granite_gguf(work / 'granite-rope.gguf', CASE, rope=True)
    model = converted(path, work, accuracy_level=4, weights='kquant')
    meta = yaml.safe_load((model / 'model.yaml').read_text())
    assert 'no_rope_layers' not in meta['rope_scaling']
    inits = {t.name for t in onnx.load(str(model / 'model.onnx'),
                                       load_external_data=False).graph.initializer}
    assert {'cos_cache', 'sin_cache'} <= inits
    result = compare(path, work, accuracy_level=4, weights='kquant')
    print(f'granitehybrid with RoPE: {result.summary()}')
    assert result.greedy_equal, (result.llama_tokens, result.engine_tokens)
    assert result.max_abs_diff <= KQUANT_MAX_ABS_DIFF
    # Control: the same weights without RoPE are another model for llama.cpp (the same
    # greedy path, its logits moved past the bound).
    nope, nope_ids = llama_cpp_greedy(gguf_of(work, CASE), work / f'{CASE.tag}.llama_cpp.npz')
    rope, rope_ids = llama_cpp_greedy(path, work / 'granite-rope.llama_cpp.npz')
    assert list(rope_ids) == list(nope_ids)
    moved = float(np.abs(rope - nope).max())
    print(f'llama.cpp with and without RoPE: max |dlogit| {moved:.2f}')
    assert moved > 2 * MAX_ABS_DIFF


def test_a_recurrent_state_that_is_not_carried_is_visible_to_the_harness(
        work, source, kquant_dir):
    """Control: the Mamba-2 states cleared after the prompt move the logits past the bound."""
    check_uncleared_states_matter(work, source, kquant_dir, 2, 'Mamba-2')


def test_the_granite_family_forces_and_reads_its_tool_calls(kquant_dir, compat):
    """Granite 4.0's tool calls are Hermes': <tool_call>{"name", "arguments"}</tool_call>.

    That is what its chat template asks for and writes back (llama.cpp ships it as
    models/templates/ibm-granite-granite-4.0.jinja), so the family reads them as hermes.
    """
    from edge_llm_ros.runtime import model_config as mc
    family = mc.family_for_model_dir(kquant_dir)
    assert (family.family, family.tool_call_format, family.reasoning) == ('granite4', 'hermes',
                                                                          None)
    check_forced_tool_call(kquant_dir, 'hermes')
    compat('granitehybrid', CASE.wtype, 'tools')


def test_a_prompt_in_chunks_gives_the_bits_of_one_call(kquant_dir):
    check_chunks_equal_one_call(kquant_dir, LONG_PROMPT)


def test_a_moe_variant_is_refused_by_name(tmp_path):
    path = write_granite_gguf(tmp_path / 'moe.gguf', granite_case('F32'), moe=True)
    with pytest.raises(UnsupportedModelError,
                       match=r'Granite 4.0-H Tiny and Small .*supported: Granite 4.0-H Micro'):
        load_checkpoint(str(path))


@pytest.fixture(scope='module')
def alone(kquant_dir) -> dict:
    return alone_bits(kquant_dir)


def test_batched_goals_equal_each_alone_bit_for_bit(kquant_dir, alone, compat):
    compat('granitehybrid', CASE.wtype, 'batching')
    check_batched_equals_alone(kquant_dir, alone)


def test_a_preempted_goal_resumes_with_its_recurrent_states(kquant_dir, alone):
    check_preempted_goals_resume(kquant_dir, alone)


def test_prefix_reuse_stops_at_kept_states_and_equals_the_uncached_run(kquant_dir):
    check_prefix_reuse_equals_uncached(kquant_dir)


@pytest.fixture(scope='module')
def two_turns_whole(kquant_dir) -> tuple:
    return two_turns_sent_whole(kquant_dir)


def test_a_session_continues_from_its_saved_states_bit_for_bit(kquant_dir, two_turns_whole):
    check_session_continues(kquant_dir, two_turns_whole)


def test_int8_kv_sessions_with_mamba2_states_continue_bit_for_bit(kquant_dir):
    """kv.dtype int8 (the converter's model_kv_int8.onnx): int8 KV beside the SSM states."""
    check_int8_kv_session(kquant_dir)


def test_a_session_in_sqlite_continues_after_a_restart_bit_for_bit(
        kquant_dir, tmp_path, two_turns_whole, compat):
    compat('granitehybrid', CASE.wtype, 'sessions')
    check_sqlite_session_after_restart(kquant_dir, str(tmp_path / 'sessions.db'),
                                       two_turns_whole)


@pytest.fixture(scope='module')
def draft_dir(work, native_library) -> pathlib.Path:
    """Give another granitehybrid of the same vocabulary (other weights): a draft it rejects."""
    return converted(gguf_of(work, granite_case('Q8_0', seed=3, chain=0.1)), work,
                     accuracy_level=4, weights='kquant')


def test_speculation_goes_back_to_the_verify_start_and_equals_plain_decoding(
        kquant_dir, draft_dir, compat):
    """Rejected drafts (prompt lookup, a granitehybrid draft): output equals plain decoding."""
    compat('granitehybrid', CASE.wtype, 'speculation')
    check_speculation_equals_plain(kquant_dir, draft_dir)


# --- HF folders ----------------------------------------------------------------------------------
def test_an_hf_folder_converts_to_the_model_of_its_gguf(work, native_library):
    """The same float32 weights as a GGUF and a GraniteMoeHybrid HF folder: one graph, one model.

    The folder holds what llama.cpp's converter reads: q / k in HF's row order, the shared
    MLP's gate and up rows fused in input_linear, A_log, Conv1d's kernel, the multipliers
    and position_embedding_type "nope" in config.json.
    """
    from edge_llm_ros.convert.converter import convert
    gguf_path = write_granite_gguf(work / 'from-a-log.gguf', granite_case('F32'),
                                   from_a_log=True)
    gguf_dir = convert(str(gguf_path), str(work / 'f32-gguf'), progress=False, overwrite=True)
    hf = write_granite_hf(work / 'hf', gguf_path)
    hf_dir = convert(str(hf), str(work / 'f32-hf'), progress=False, overwrite=True)
    for name in ('model.onnx', 'model.onnx.data'):
        assert (hf_dir / name).read_bytes() == (gguf_dir / name).read_bytes(), name
    follow = [7, 8, 9]
    np.testing.assert_array_equal(engine_logits(hf_dir, LONG_PROMPT, follow),
                                  engine_logits(gguf_dir, LONG_PROMPT, follow))
    assert yaml.safe_load((hf_dir / 'model.yaml').read_text())['layer_states'] == \
        yaml.safe_load((gguf_dir / 'model.yaml').read_text())['layer_states']


def test_an_hf_moe_folder_is_refused_by_name(work):
    gguf_path = write_granite_gguf(work / 'moe-twin.gguf', granite_case('F32'), from_a_log=True)
    hf = write_granite_hf(work / 'hf-moe', gguf_path, moe=True)
    with pytest.raises(UnsupportedModelError,
                       match=r'Granite 4.0-H Tiny and Small .*supported: Granite 4.0-H Micro'):
        load_checkpoint(str(hf))


@pytest.mark.parametrize('edit, error, message', [
    ({'layer_types': ['mamba']}, ModelLoadError, 'layer_types is not one mamba / attention'),
    ({'layer_types': ['mamba', 'mamba', 'mamba']}, UnsupportedModelError, 'no attention layer'),
    ({'mamba_n_heads': 7}, UnsupportedModelError, 'are not Mamba-2 layers the op library runs'),
    ({'mamba_proj_bias': True}, UnsupportedModelError, 'mamba_proj_bias true'),
    ({'hidden_act': 'gelu'}, UnsupportedModelError, "activation 'gelu'"),
], ids=['layer-count', 'no-attention', 'mamba-heads', 'proj-bias', 'activation'])
def test_a_bad_hf_config_is_refused_before_any_weight_is_read(work, edit, error, message):
    gguf_path = work / 'bad-cfg-twin.gguf'
    if not gguf_path.is_file():
        write_granite_gguf(gguf_path, granite_case('F32'), from_a_log=True)
    hf = work / f'hf-bad-{"-".join(edit)}'
    shutil.rmtree(hf, ignore_errors=True)
    write_granite_hf(hf, gguf_path)
    config = json.loads((hf / 'config.json').read_text())
    (hf / 'config.json').write_text(json.dumps(dict(config, **edit)))
    (hf / 'model.safetensors').unlink()   # refused before the weights: none are needed
    with pytest.raises(error, match=message):
        load_checkpoint(str(hf))


def test_an_hf_folder_without_safetensors_says_so(work):
    gguf_path = write_granite_gguf(work / 'no-st-twin.gguf', granite_case('F32'),
                                   from_a_log=True)
    hf = write_granite_hf(work / 'hf-no-st', gguf_path)
    (hf / 'model.safetensors').unlink()
    with pytest.raises(ModelLoadError, match=r'no \*\.safetensors files'):
        load_checkpoint(str(hf))
