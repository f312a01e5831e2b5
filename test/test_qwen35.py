"""Qwen3.5 (dense): Gated DeltaNet layers with a recurrent state beside gated attention.

Conversion: a qwen35 GGUF (DeltaNet, attention, DeltaNet layers; gguf_fixtures) becomes a
folder whose model.yaml declares each DeltaNet layer's state (`recurrent`: its conv inputs
and delta-rule state in one vector per slot), whose graph runs the op library's GatedDeltaNet
over past_conv.{i} / present_conv.{i} and the library's attention with the output gate and a
partial rotary (q/k dims reordered, checkpoint.rotary_order). Checked against llama.cpp: the
greedy ids of 32 steps are equal for F16 (MatMulNBits at level 0) and every type the op
library holds (kquant), with every logit on llama.cpp's path within the parity bounds of
test_llama_cpp_parity. Control: the same graph with its DeltaNet states cleared after the
prompt moves the logits far past the bound. At Qwen3.5-0.8B's layer shapes (4 layers) the
exact graph equals a float64 transcription of llama.cpp's graph within float32 rounding, and
the kquant graph stays within KL 2e-3 of llama.cpp on average.

Engine (the state machinery lfm2's conv states use, unchanged): a prompt in chunks gives the
bits of one call; goals batched (prompt chunks beside decode rows) equal each alone, bit for
bit, and so does a preempted goal; prefix reuse stops at kept states and equals the uncached
run; a session continues from its saved states bit for bit, in memory and in SQLite after a
restart; speculation goes back to the
states at the verify's start (output equal to plain decoding). An HF folder (Qwen3_5ForCausalLM
or Qwen3_5ForConditionalGeneration's text model) converts to its GGUF's graph, byte for byte.
"""
import json
import pathlib

import gguf
from gguf_fixtures import (QWEN35_08B_DIMS, QWEN35_08B_GDN, qwen35_case, QWEN35_DIMS,
                           QWEN35_GDN, write_gguf, write_qwen35_gguf, write_qwen35_hf)
from llama_cpp_parity import (compare, converted, engine_logits, kl_divergence,
                              llama_cpp_greedy, PROMPT)
import numpy as np
import onnx
import pytest
from state_family_checks import (alone_bits, check_batched_equals_alone,
                                 check_chunks_equal_one_call, check_forced_tool_call,
                                 check_preempted_goals_resume,
                                 check_prefix_reuse_equals_uncached, check_session_continues,
                                 check_speculation_equals_plain,
                                 check_sqlite_session_after_restart,
                                 check_uncleared_states_matter, two_turns_sent_whole)
from test_llama_cpp_parity import KQUANT_TYPES, MAX_ABS_DIFF, MIN_MARGIN
import yaml

from edge_llm_ros.convert.checkpoint import DELTA_CHUNK, load_checkpoint, rotary_order
from edge_llm_ros.convert.converter import convert
from edge_llm_ros.errors import UnsupportedModelError
from edge_llm_ros.model_format import LayerState, load_model_info
from edge_llm_ros.serving.engine import kv_budget_bytes

CASE = qwen35_case('Q8_0')
# kquant: llama.cpp's activation rounding, but the delta rule's sums in another order than
# ggml's SIMD dot products and multiply-adds, carried from step to step in the state and
# renormalized (q/k L2 norms): measured 4e-6 (Q5_K) to 0.40 (Q5_1) over peak logits of 47-55,
# against test_llama_cpp_parity's 0.4 for attention-only families.
QWEN35_KQUANT_MAX_ABS_DIFF = 0.5
LONG_PROMPT = [5, 17, 99, 120, 3, 250, 44, 61, 7, 12, 31]
# QWEN35_GDN's 4 value heads over 2 key heads: HF's grouped order read in ggml's tiled one.
QWEN35_TILED = np.array([0, 2, 1, 3])


def state_floats() -> int:
    g = QWEN35_GDN
    d = g['head_dim']
    return ((g['kernel'] - 1) * (2 * g['k_heads'] + g['v_heads']) * d
            + g['v_heads'] * (d * d + DELTA_CHUNK * (2 * d + 1)))


@pytest.fixture(scope='module')
def work(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp('qwen35')


def gguf_of(work: pathlib.Path, case) -> pathlib.Path:
    path = work / f'{case.tag}.gguf'
    if not path.is_file():
        write_gguf(path, case)
    return path


@pytest.fixture(scope='module')
def source(work) -> pathlib.Path:
    return gguf_of(work, CASE)


@pytest.fixture(scope='module')
def kquant_dir(work, source, native_library) -> pathlib.Path:
    return converted(source, work, accuracy_level=4, weights='kquant')


def test_the_folder_declares_recurrent_states_and_runs_gated_delta_net(kquant_dir):
    meta = yaml.safe_load((kquant_dir / 'model.yaml').read_text())
    rec = {'kind': 'recurrent', 'shape': [state_floats()]}
    assert meta['layer_states'] == [rec, {'kind': 'kv', 'window': 0}, rec]
    assert meta['architecture'] == 'qwen35' and meta['attention'] == 'causal'
    assert meta['quantization']['source_types'] == ['Q8_0']   # the F32 conv is no matrix
    info = load_model_info(str(kquant_dir))
    assert info.kv_layers == (1,) and info.conv_layers == (0, 2) and not info.rewindable
    assert info.state_of(0) == LayerState('recurrent', 0, (state_floats(),))
    graph = onnx.load(str(kquant_dir / 'model.onnx'), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count('GatedDeltaNet') == 2 and ops.count('CausalAttention') == 1
    assert ops.count('Sigmoid') == 1   # the attention output gate
    names = {i.name for i in graph.input}
    assert {'past_conv.0', 'past_conv.2', 'past_key_values.1.key'} <= names


def test_the_kv_budget_counts_the_recurrent_states(kquant_dir):
    info = load_model_info(str(kquant_dir))
    kv = 2 * QWEN35_DIMS.kv_heads * 64 * QWEN35_DIMS.head_dim   # one attention layer
    assert kv_budget_bytes(info, 64, 3) == 3 * (kv + 2 * state_floats()) * 4


def test_the_rotary_reorder_pairs_the_rotated_dims_across_the_half():
    order = rotary_order(8, 4)
    # rotated pairs (0, 2), (1, 3) land at (0, 4), (1, 5); dims 4..7 pair with each other.
    assert order.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert sorted(rotary_order(64, 16).tolist()) == list(range(64))


@pytest.mark.parametrize('wtype', ['F16'] + list(KQUANT_TYPES))
def test_greedy_ids_equal_llama_cpp(work, native_library, wtype, compat):
    compat('qwen35', wtype, 'text')
    case = qwen35_case(wtype)
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
    assert result.max_abs_diff <= (MAX_ABS_DIFF if exact else QWEN35_KQUANT_MAX_ABS_DIFF)


class Reference:
    """llama.cpp's qwen35 graph in float64 NumPy over a GGUF's dequantized tensors."""

    def __init__(self, path: pathlib.Path, dims, gdn: dict) -> None:
        reader = gguf.GGUFReader(str(path))
        self.w = {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type),
                                     np.float64).reshape(tuple(reversed(t.shape.tolist())))
                  for t in reader.tensors}
        self.d, self.g = dims, gdn

    def rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.d.rms_eps) * w

    @staticmethod
    def silu(x: np.ndarray) -> np.ndarray:
        return x / (1 + np.exp(-x))

    def rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """NEOX rotary of each head's first quarter (IMROPE over text positions)."""
        rot = self.d.head_dim // 4
        half = rot // 2
        angle = pos[:, None] * self.d.rope_theta ** (-np.arange(0, rot, 2) / rot)
        c, s = np.cos(angle), np.sin(angle)
        x0, x1 = x[..., :half], x[..., half:rot]
        return np.concatenate([x0 * c - x1 * s, x1 * c + x0 * s, x[..., rot:]], -1)

    def delta_net(self, h: np.ndarray, p: str) -> np.ndarray:
        w, g, n = self.w, self.g, h.shape[0]
        hk, hv, d, kernel = g['k_heads'], g['v_heads'], g['head_dim'], g['kernel']
        qkv = h @ w[p + 'attn_qkv.weight'].T
        z = h @ w[p + 'attn_gate.weight'].T
        beta = 1 / (1 + np.exp(-(h @ w[p + 'ssm_beta.weight'].T)))
        alpha = h @ w[p + 'ssm_alpha.weight'].T + w[p + 'ssm_dt.bias']
        decay = np.exp(np.log1p(np.exp(alpha)) * w[p + 'ssm_a'])
        ext = np.concatenate([np.zeros((kernel - 1, qkv.shape[1])), qkv])
        taps = w[p + 'ssm_conv1d.weight']
        conv = self.silu(np.stack([sum(ext[t + j] * taps[:, j] for j in range(kernel))
                                   for t in range(n)]))
        state, y = np.zeros((hv, d, d)), np.zeros((n, hv, d))
        for t in range(n):
            q = conv[t, :hk * d].reshape(hk, d)
            k = conv[t, hk * d:2 * hk * d].reshape(hk, d)
            v = conv[t, 2 * hk * d:].reshape(hv, d)
            q = q / np.sqrt((q * q).sum(-1, keepdims=True) + self.d.rms_eps)
            k = k / np.sqrt((k * k).sum(-1, keepdims=True) + self.d.rms_eps)
            for h in range(hv):
                state[h] *= decay[t, h]
                delta = (v[h] - k[h % hk] @ state[h]) * beta[t, h]
                state[h] += np.outer(k[h % hk], delta)
                o = (q[h % hk] @ state[h]) / np.sqrt(d)
                y[t, h] = (self.rms(o, w[p + 'ssm_norm.weight'])
                           * self.silu(z[t, h * d:(h + 1) * d]))
        return y.reshape(n, -1) @ w[p + 'ssm_out.weight'].T

    def attention(self, h: np.ndarray, p: str) -> np.ndarray:
        w, d, n = self.w, self.d, h.shape[0]
        hd = d.head_dim
        qg = (h @ w[p + 'attn_q.weight'].T).reshape(n, d.heads, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(n, -1)
        k = (h @ w[p + 'attn_k.weight'].T).reshape(n, d.kv_heads, hd)
        v = (h @ w[p + 'attn_v.weight'].T).reshape(n, d.kv_heads, hd)
        pos = np.arange(n)
        q = self.rope(self.rms(q, w[p + 'attn_q_norm.weight']).transpose(1, 0, 2), pos)
        k = self.rope(self.rms(k, w[p + 'attn_k_norm.weight']).transpose(1, 0, 2), pos)
        group = d.heads // d.kv_heads
        k, v = np.repeat(k, group, 0), np.repeat(v.transpose(1, 0, 2), group, 0)
        att = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + np.triu(np.full((n, n), -np.inf), 1)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        o = (att @ v).transpose(1, 0, 2).reshape(n, -1) / (1 + np.exp(-gate))
        return o @ w[p + 'attn_output.weight'].T

    def logits(self, ids) -> np.ndarray:
        """Return the logits of every position of ids."""
        w = self.w
        x = w['token_embd.weight'][list(ids)]
        for i in range(self.d.layers):
            p = f'blk.{i}.'
            h = self.rms(x, w[p + 'attn_norm.weight'])
            recurrent = (i + 1) % self.g['interval']
            x = x + (self.delta_net(h, p) if recurrent else self.attention(h, p))
            h = self.rms(x, w[p + 'post_attention_norm.weight'])
            act = self.silu(h @ w[p + 'ffn_gate.weight'].T) * (h @ w[p + 'ffn_up.weight'].T)
            x = x + act @ w[p + 'ffn_down.weight'].T
        return self.rms(x, w['output_norm.weight']) @ w['output.weight'].T


def test_qwen35_08b_layer_shapes_equal_a_float64_reference(work, native_library):
    """Qwen3.5-0.8B's layers (4 of them): exact graph = llama.cpp's math; KL to llama.cpp.

    Random weights, no next-token term. Q8_0 weights at accuracy level 0 (MatMulNBits repacks
    Q8_0 exactly, float activations) equal a float64 transcription of llama.cpp's graph
    within float32 rounding, over the prompt and 8 steps of llama.cpp's greedy path; the
    kquant graph (llama.cpp's activation rounding) stays within KL 2e-3 of llama.cpp on
    average (measured 1.1e-3 mean, 5.2e-3 max: llama.cpp is itself 0.30 off the exact
    logits here, the exact graph 1.4e-5).
    """
    case = qwen35_case('Q8_0', dims=QWEN35_08B_DIMS, chain=0.0)
    path = work / f'{case.tag}-nochain.gguf'
    write_qwen35_gguf(path, case, QWEN35_08B_GDN)
    ref_logits, tokens = llama_cpp_greedy(path, work / f'{path.stem}.llama_cpp.npz')
    exact = Reference(path, QWEN35_08B_DIMS, QWEN35_08B_GDN).logits(
        list(PROMPT) + tokens[:8])[len(PROMPT) - 1:]
    ours = engine_logits(converted(path, work, accuracy_level=0, weights='matmulnbits'),
                         PROMPT, tokens[:8])
    peak = np.abs(exact).max()
    assert np.abs(ours - exact).max() < 2e-5 * peak, (np.abs(ours - exact).max(), peak)
    kquant = engine_logits(converted(path, work, accuracy_level=4, weights='kquant'),
                           PROMPT, tokens)
    kl = kl_divergence(ref_logits, kquant)
    print(f'0.8B layers, kquant Q8_0: KL mean {kl.mean():.3g}, max {kl.max():.3g}; llama.cpp '
          f'vs exact {np.abs(ref_logits[:9] - exact).max():.3g}')
    assert kl.mean() < 2e-3 and kl.max() < 1e-2


def test_a_recurrent_state_that_is_not_carried_is_visible_to_the_harness(
        work, source, kquant_dir):
    """Control: the DeltaNet states cleared after the prompt move the logits past the bound."""
    check_uncleared_states_matter(work, source, kquant_dir, 2, 'DeltaNet')


def test_a_prompt_in_chunks_gives_the_bits_of_one_call(kquant_dir):
    check_chunks_equal_one_call(kquant_dir, LONG_PROMPT)


def test_a_moe_gguf_is_refused_by_name(tmp_path):
    import gguf
    path = write_gguf(tmp_path / 'dense.gguf', CASE)
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / 'moe.gguf'), 'qwen35')
    for field in reader.fields.values():
        if field.name.startswith(('GGUF.', 'general.architecture')):
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0],
                             field.types[-1] if field.types[0] ==
                             gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.add_tensor('blk.0.ffn_gate_exps.weight', np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match='mixture-of-experts'):
        load_checkpoint(str(tmp_path / 'moe.gguf'))


def test_the_qwen35_family_switches_reasoning_and_forces_its_tool_calls(kquant_dir, compat):
    """Qwen3.5's family: XML tool calls (qwen3_xml), reasoning off by enable_thinking=False.

    A random model writes no XML call by itself: the tool constraint forces one (a Hermes
    JSON object between <tool_call> markers, which the qwen3_xml parser reads as well),
    after a <think> block closed at once by a reasoning budget of 0 (the random model would
    otherwise think until max_tokens); the XML form itself is read in test_tool_calls.
    """
    from edge_llm_ros.runtime import model_config as mc
    compat('qwen35', CASE.wtype, 'tools')
    family = mc.family_for_model_dir(kquant_dir)
    assert (family.family, family.tool_call_format) == ('qwen35', 'qwen3_xml')
    assert family.template_kwargs(reasoning=False) == {'enable_thinking': False}
    assert family.reasoning.open_tag == '<think>' and family.can_disable_reasoning
    check_forced_tool_call(kquant_dir, 'qwen3_xml', reasoning_budget=0)


# --- HF folders ----------------------------------------------------------------------------------
@pytest.mark.parametrize('multimodal', [False, True], ids=['causal_lm', 'conditional_generation'])
def test_an_hf_folder_converts_to_the_model_of_its_gguf(work, native_library, multimodal):
    """The same float32 weights as a GGUF and an HF folder give the same graph and logits.

    The folder holds what llama.cpp's converter reads (norms minus one, A_log, Conv1d's
    kernel, value heads grouped by key head: 4 value heads over 2 key heads, so the reorder
    to the GGUF's tiled order is exercised).
    """
    case = qwen35_case('F32')
    gguf_dir = convert(str(gguf_of(work, case)), str(work / 'f32-gguf'), progress=False,
                       overwrite=True)
    hf = write_qwen35_hf(work / f'hf-{multimodal}', case, multimodal=multimodal)
    hf_dir = convert(str(hf), str(work / f'f32-hf-{multimodal}'), progress=False,
                     overwrite=True)
    for name in ('model.onnx', 'model.onnx.data'):
        assert (hf_dir / name).read_bytes() == (gguf_dir / name).read_bytes(), name
    follow = [7, 8, 9]
    np.testing.assert_array_equal(engine_logits(hf_dir, PROMPT, follow),
                                  engine_logits(gguf_dir, PROMPT, follow))
    assert yaml.safe_load((hf_dir / 'model.yaml').read_text())['layer_states'] == \
        yaml.safe_load((gguf_dir / 'model.yaml').read_text())['layer_states']


def test_a_bfloat16_a_log_gives_the_bfloat16_decay_rate_llama_cpp_writes(work):
    """llama.cpp's converter takes -exp(A_log) in the checkpoint's bfloat16 (torch rounds).

    The reader rounds -exp of the widened bits to bfloat16 as well, then tiles the heads.
    """
    import ml_dtypes
    from safetensors import serialize_file, TensorSpec
    folder = write_qwen35_hf(work / 'hf-bf16', qwen35_case('F32'))
    name = 'model.layers.0.linear_attn.A_log'
    a_log = load_checkpoint(str(folder)).tensor('0.ssm_a')   # F32: -exp, heads tiled
    hf = np.log(-a_log.dequantize())[np.argsort(QWEN35_TILED)].astype(np.float32)
    bits = (hf.view(np.uint32) >> 16).astype(np.uint16)   # truncated: any bfloat16 will do
    serialize_file({name: TensorSpec(dtype='bfloat16', shape=list(bits.shape),
                                     data_ptr=bits.ctypes.data, data_len=bits.nbytes)},
                   str(folder / 'zz-bf16.safetensors'))
    got = load_checkpoint(str(folder)).tensor('0.ssm_a').dequantize()
    widened = (bits.astype(np.uint32) << 16).view(np.float32)
    want = (-np.exp(widened)).astype(ml_dtypes.bfloat16).astype(np.float32)[QWEN35_TILED]
    np.testing.assert_array_equal(got, want)


def test_an_hf_moe_folder_is_refused_by_name(work):
    folder = write_qwen35_hf(work / 'hf-moe', qwen35_case('F32'), multimodal=True)
    config = json.loads((folder / 'config.json').read_text())
    config.update(model_type='qwen3_5_moe', architectures=['Qwen3_5MoeForConditionalGeneration'])
    config['text_config'].update(model_type='qwen3_5_moe_text', num_experts=8)
    (folder / 'config.json').write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match='mixture-of-experts'):
        load_checkpoint(str(folder))


@pytest.fixture(scope='module')
def alone(kquant_dir) -> dict:
    return alone_bits(kquant_dir)


def test_batched_goals_equal_each_alone_bit_for_bit(kquant_dir, alone, compat):
    compat('qwen35', CASE.wtype, 'batching')
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


def test_a_session_in_sqlite_continues_after_a_restart_bit_for_bit(
        kquant_dir, tmp_path, two_turns_whole, compat):
    compat('qwen35', CASE.wtype, 'sessions')
    check_sqlite_session_after_restart(kquant_dir, str(tmp_path / 'sessions.db'),
                                       two_turns_whole)


@pytest.fixture(scope='module')
def draft_dir(work, native_library) -> pathlib.Path:
    """Give another qwen35 of the same vocabulary (other weights): a draft it often rejects."""
    # A weaker next-token term than the target's: it disagrees at some steps.
    return converted(gguf_of(work, qwen35_case('Q8_0', seed=3, chain=0.1)), work,
                     accuracy_level=4, weights='kquant')


def test_speculation_goes_back_to_the_verify_start_and_equals_plain_decoding(
        kquant_dir, draft_dir, compat):
    """Rejected drafts (prompt lookup, a qwen35 draft model): output equals plain decoding."""
    compat('qwen35', CASE.wtype, 'speculation')
    check_speculation_equals_plain(kquant_dir, draft_dir)
