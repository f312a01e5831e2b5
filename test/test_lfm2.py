"""LFM2, the first hybrid family: gated short convolutions with a conv state per sequence.

Conversion: an lfm2 GGUF (conv, attention, conv layers; gguf_fixtures) becomes a folder whose
model.yaml declares each layer's state (`layer_states`: attention KV, or a conv state of
shape [kernel - 1, hidden]), whose graph runs the op library's ShortConv over
past_conv.{i} / present_conv.{i}, and whose logits equal a float64 NumPy reference of
llama.cpp's graph (src/models/lfm2.cpp) at the exact settings, over a prompt, a chunk and
decode steps. What the converter does not build (a sliding window, embedding models, an
mmproj) is refused before anything is written. Token parity with llama.cpp per
type is in test_llama_cpp_parity.py.

Engine: the conv states live beside the KV buffers, one per slot and conv layer, and move with
the slot's KV (a paused goal parked and resumed); a step's one model call touches only the
slots it has rows for, so a slot between prefill chunks keeps its state. Each goal's logprobs
equal the same goal run alone, bit for bit, through chunks that share calls with decode rows
and through a preemption. A conv state cannot be
rewound by position, so a slot keeps copies of it at a prompt's end and a turn's end: prefix
reuse stops there (and equals the uncached run); speculation keeps it at a verify's start,
goes back there when drafts are rejected and feeds the accepted tokens again (output equal to
plain decoding, greedy and seeded, solo and batched). A session_id and sessions.store are
refused, and so is an lfm2 draft model, each with what to do. The KV budget counts the conv
states' bytes.
"""
import pathlib

import gguf
from gguf_fixtures import layer_kinds, LFM2_CONV_KERNEL, LFM2_DIMS, ParityCase, write_gguf
import numpy as np
import onnx
from ort_driver import OrtDriver
import pytest
from state_family_checks import (alone_bits, check_batched_equals_alone,
                                 check_forced_tool_call, check_int8_kv_session,
                                 check_preempted_goals_resume,
                                 check_prefix_reuse_equals_uncached, check_session_continues,
                                 check_speculation_equals_plain,
                                 check_sqlite_session_after_restart, engine, GREEDY,
                                 result_bits, TEXTS, turn, two_turns_sent_whole, USER2)
import yaml

from edge_llm_ros.convert.converter import convert
from edge_llm_ros.errors import ConversionError, ModelLoadError, UnsupportedModelError
from edge_llm_ros.model_format import LayerState, load_model_info
from edge_llm_ros.runtime.speculative import DraftModel, SpeculativeConfig
from edge_llm_ros.runtime.types import ChatMessage, SamplingConfig
from edge_llm_ros.serving.engine import kv_budget_bytes

CASE = ParityCase('lfm2', 'Q8_0', dims=LFM2_DIMS, seed=6, chain=0.3)
PROMPT = [5, 17, 99, 120, 3, 250, 44, 61, 7, 12, 31]


@pytest.fixture(scope='module')
def work(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp('lfm2')


@pytest.fixture(scope='module')
def source(work) -> pathlib.Path:
    return write_gguf(work / f'{CASE.tag}.gguf', CASE)


@pytest.fixture(scope='module')
def kquant_dir(work, source, native_library) -> pathlib.Path:
    return convert(str(source), str(work / 'kquant'), progress=False)


@pytest.fixture(scope='module')
def exact_dir(work, source, native_library) -> pathlib.Path:
    # Q8_0 weights as 8-bit MatMulNBits blocks (exact), float activations.
    return convert(str(source), str(work / 'exact'), progress=False, accuracy_level=0,
                   weights='matmulnbits')


class Reference:
    """llama.cpp's lfm2 graph in float64 NumPy over the GGUF's dequantized tensors."""

    def __init__(self, path: pathlib.Path) -> None:
        reader = gguf.GGUFReader(str(path))
        self.w = {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type),
                                     np.float64).reshape(tuple(reversed(t.shape.tolist())))
                  for t in reader.tensors}
        self.kinds = layer_kinds(CASE)
        self.ids = []

    @staticmethod
    def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + LFM2_DIMS.rms_eps) * w

    @staticmethod
    def rope(x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        d = x.shape[-1]
        angle = pos[:, None] * LFM2_DIMS.rope_theta ** (-np.arange(0, d, 2) / d)
        c, s = np.cos(angle), np.sin(angle)
        x0, x1 = x[..., :d // 2], x[..., d // 2:]
        return np.concatenate([x0 * c - x1 * s, x1 * c + x0 * s], -1)

    def feed(self, ids) -> np.ndarray:
        """Append ids; return the logits of the last one (the whole sequence recomputed)."""
        self.ids += list(ids)
        d, w = LFM2_DIMS, self.w
        x = w['token_embd.weight'][self.ids]
        n, hd, hidden = len(self.ids), d.head_dim, d.hidden
        pos = np.arange(n)
        for i, kind in enumerate(self.kinds):
            p = f'blk.{i}.'
            h = self.rms(x, w[p + 'attn_norm.weight'])
            if kind == 'conv':
                bcx = h @ w[p + 'shortconv.in_proj.weight'].T
                b, c, v = bcx[:, :hidden], bcx[:, hidden:2 * hidden], bcx[:, 2 * hidden:]
                bx = np.concatenate([np.zeros((LFM2_CONV_KERNEL - 1, hidden)), b * v])
                kernel = w[p + 'shortconv.conv.weight']
                conv = np.stack([sum(bx[t + j] * kernel[:, j] for j in range(LFM2_CONV_KERNEL))
                                 for t in range(n)])
                y = (c * conv) @ w[p + 'shortconv.out_proj.weight'].T
            else:
                q = (h @ w[p + 'attn_q.weight'].T).reshape(n, d.heads, hd)
                k = (h @ w[p + 'attn_k.weight'].T).reshape(n, d.kv_heads, hd)
                v = (h @ w[p + 'attn_v.weight'].T).reshape(n, d.kv_heads, hd)
                q = self.rope(self.rms(q, w[p + 'attn_q_norm.weight']).transpose(1, 0, 2), pos)
                k = self.rope(self.rms(k, w[p + 'attn_k_norm.weight']).transpose(1, 0, 2), pos)
                group = d.heads // d.kv_heads
                k, v = np.repeat(k, group, 0), np.repeat(v.transpose(1, 0, 2), group, 0)
                att = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
                att = att + np.triu(np.full((n, n), -np.inf), 1)
                att = np.exp(att - att.max(-1, keepdims=True))
                att /= att.sum(-1, keepdims=True)
                y = (att @ v).transpose(1, 0, 2).reshape(n, -1) @ w[p + 'attn_output.weight'].T
            x = x + y
            h = self.rms(x, w[p + 'ffn_norm.weight'])
            gate = h @ w[p + 'ffn_gate.weight'].T
            act = gate / (1 + np.exp(-gate)) * (h @ w[p + 'ffn_up.weight'].T)
            x = x + act @ w[p + 'ffn_down.weight'].T
        return (self.rms(x, w['token_embd_norm.weight']) @ w['output.weight'].T)[-1]


def test_the_folder_declares_each_layers_state_and_runs_shortconv(kquant_dir, source):
    meta = yaml.safe_load((kquant_dir / 'model.yaml').read_text())
    conv = {'kind': 'conv', 'shape': [LFM2_CONV_KERNEL - 1, LFM2_DIMS.hidden]}
    assert meta['layer_states'] == [conv, {'kind': 'kv', 'window': 0}, conv]
    assert meta['architecture'] == 'lfm2' and meta['attention'] == 'causal'
    assert meta['op_domains'] == ['edge_llm_ros']
    assert meta['quantization']['source_types'] == ['Q8_0']   # the F32 kernel is no matrix
    info = load_model_info(str(kquant_dir))
    assert info.kv_layers == (1,) and info.conv_layers == (0, 2) and not info.rewindable
    assert info.state_of(0) == LayerState('conv', 0, (2, LFM2_DIMS.hidden))
    graph = onnx.load(str(kquant_dir / 'model.onnx'), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count('ShortConv') == 2 and ops.count('CausalAttention') == 1
    names = {i.name for i in graph.input}
    assert {'past_conv.0', 'past_conv.2', 'past_key_values.1.key'} <= names
    assert not {'past_key_values.0.key', 'past_conv.1'} & names
    assert {o.name for o in graph.output} >= {'present_conv.0', 'present_conv.2'}
    # Every tensor of the GGUF is a parameter (the head is not tied here).
    reader = gguf.GGUFReader(str(source))
    assert meta['parameters'] == sum(int(np.prod(t.shape)) for t in reader.tensors)


def test_exact_graph_equals_the_reference_over_prefill_chunk_and_decode(exact_dir, source):
    ref = Reference(source)
    drv = OrtDriver(exact_dir, max_ctx=64)
    r, o = ref.feed(PROMPT), drv.step(PROMPT)
    diffs, peak = [np.abs(r - o).max()], np.abs(r).max()
    chunk = [9, 200, 4]   # a second prefill chunk continues the conv states
    r, o = ref.feed(chunk), drv.step(chunk)
    diffs.append(np.abs(r - o).max())
    for _ in range(6):
        tok = int(np.argmax(r))
        r, o = ref.feed([tok]), drv.step([tok])
        diffs.append(np.abs(r - o).max())
    assert max(diffs) < 2e-4 * peak, (max(diffs), peak)


def test_a_prompt_in_chunks_gives_the_bits_of_one_call(kquant_dir):
    whole = OrtDriver(kquant_dir, max_ctx=64)
    want = whole.step(PROMPT)
    parts = OrtDriver(kquant_dir, max_ctx=64)
    for a, b in ((0, 4), (4, 5), (5, len(PROMPT))):
        got = parts.step(PROMPT[a:b])
    np.testing.assert_array_equal(got, want)
    for (name, _, buf), (_, _, other) in zip(whole.bound, parts.bound):
        if name.startswith('past_conv.'):   # the conv states, whole
            np.testing.assert_array_equal(buf, other)
        else:   # the KV positions written
            np.testing.assert_array_equal(buf[:, :, :len(PROMPT)], other[:, :, :len(PROMPT)])


@pytest.mark.parametrize('header, match', [
    ({'sliding_window': 64}, 'with a sliding window is not supported'),
    ({'causal_attention': False}, 'embedding model'),
    ({'shortconv_l_cache': 17}, 'shortconv.l_cache 17 is not a conv kernel'),
    ({'head_count_kv': [2, 2, 1]}, r'KV head counts \[1, 2\]'),
])
def test_what_the_converter_does_not_build_is_refused(tmp_path, native_library, header, match):
    src = write_gguf(tmp_path / 'bad.gguf', CASE, header=header)
    with pytest.raises((ModelLoadError, ConversionError), match=match):
        convert(str(src), str(tmp_path / 'out'), progress=False)
    assert not (tmp_path / 'out').exists()


def test_per_layer_kv_heads_of_a_plain_family_are_refused(tmp_path):
    src = write_gguf(tmp_path / 'bad.gguf', ParityCase('llama', 'Q8_0'),
                     header={'head_count_kv': [2, 2]})
    with pytest.raises(UnsupportedModelError, match='per-layer attention.head_count_kv is not '
                                                    'supported for llama'):
        convert(str(src), str(tmp_path / 'out'), progress=False)


def test_an_mmproj_is_refused(tmp_path, source, native_library):
    # HF lfm2 folders convert: test_lfm2_hf.py.
    with pytest.raises(ConversionError, match=r'VLMs \(--mmproj\) are not converted yet'):
        convert(str(source), str(tmp_path / 'out'), progress=False, mmproj=str(source))
    assert not (tmp_path / 'out').exists()


# --- engine ------------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def alone(kquant_dir) -> dict:
    return alone_bits(kquant_dir)


def test_batched_goals_equal_each_alone_bit_for_bit(kquant_dir, alone, compat):
    compat('lfm2', CASE.wtype, 'batching')
    calls = check_batched_equals_alone(kquant_dir, alone)
    # No call touched a slot it had no row for (the conv states of a slot between chunks stay
    # as they were).
    assert all(len({slot for slot, _ in call}) == len(call) for call in calls)


def test_a_preempted_goal_resumes_with_its_conv_states(kquant_dir, alone):
    check_preempted_goals_resume(kquant_dir, alone)


def test_prefix_reuse_stops_at_kept_conv_states_and_equals_the_uncached_run(kquant_dir):
    """A prompt that extends an earlier one reuses it up to a kept end, bit for bit."""
    check_prefix_reuse_equals_uncached(kquant_dir, (TEXTS[1], TEXTS[2]))


@pytest.fixture(scope='module')
def two_turns_whole(kquant_dir) -> tuple:
    return two_turns_sent_whole(kquant_dir)


def test_a_session_continues_from_its_saved_conv_states_bit_for_bit(kquant_dir, two_turns_whole):
    ends = check_session_continues(kquant_dir, two_turns_whole)
    assert len(ends) == 2   # b's snapshot (saved as a took the slot back): prompt end, turn end


def test_int8_kv_sessions_with_conv_states_continue_bit_for_bit(kquant_dir):
    """kv.dtype int8 (the converter's model_kv_int8.onnx): int8 KV beside float conv states."""
    check_int8_kv_session(kquant_dir)


def test_a_session_in_sqlite_continues_after_a_restart_bit_for_bit(
        kquant_dir, tmp_path, two_turns_whole, compat):
    compat('lfm2', CASE.wtype, 'sessions')
    check_sqlite_session_after_restart(kquant_dir, str(tmp_path / 'sessions.db'),
                                       two_turns_whole)


@pytest.fixture(scope='module')
def draft_dir(work, native_library) -> pathlib.Path:
    """Give another lfm2 of the same vocabulary (other weights): a draft it often rejects."""
    case = ParityCase('lfm2', 'Q8_0', dims=LFM2_DIMS, seed=7, chain=0.15)
    return convert(str(write_gguf(work / 'draft.gguf', case)), str(work / 'draft'),
                   progress=False)


@pytest.mark.parametrize('slots', [1, 3])
def test_speculation_rewinds_conv_states_to_the_verify_start(kquant_dir, draft_dir, slots, compat):
    """Rejected drafts: the conv states go back to the verify's start, accepted tokens again.

    With an lfm2 draft model its own slots go back to a position they kept states at too.
    """
    compat('lfm2', CASE.wtype, 'speculation')
    seeded = SamplingConfig(temperature=0.8, top_k=20, seed=3, logprobs=True)
    check_speculation_equals_plain(kquant_dir, draft_dir, slots=slots, n_texts=3,
                                   max_tokens=24, samplings=(GREEDY, seeded))


def test_an_lfm2_draft_model_goes_back_to_kept_states_after_a_rejection(kquant_dir, draft_dir):
    """Drafts after rejections equal those of a slot that never drafted, states bit for bit."""
    eng = engine(kquant_dir, 2, max_context=256,
                 speculative=SpeculativeConfig(mode='draft', draft_model=str(draft_dir)))
    try:
        draft = eng.speculation.draft_model
        context = list(eng.tokenize(TEXTS[0]))
        for step in range(6):
            drafted = draft.draft_rows({0: (context, 4)})[0]
            fresh = DraftModel(draft._decoder).draft_rows({1: (context, 4)})[1]
            assert drafted == fresh, step
            # Both slots fed the context and 3 drafts: their conv states are the same bits.
            for ours, theirs in zip(*(draft._decoder.slot_states(i) for i in (0, 1))):
                assert np.array_equal(ours, theirs), step
            # Keep `step % 5` drafts, then a token the draft did not propose (a rejection;
            # 4 kept: all accepted, then the target's own next token).
            keep = step % 5
            context += drafted[:keep] + [(drafted[keep] + 1) % 200 if keep < 4 else 7]
    finally:
        eng.close()


def test_the_kv_budget_counts_the_conv_states(kquant_dir):
    info = load_model_info(str(kquant_dir))
    d = LFM2_DIMS
    kv = 2 * d.kv_heads * 96 * d.head_dim   # one attention layer
    states = 2 * (LFM2_CONV_KERNEL - 1) * d.hidden   # two conv layers
    assert kv_budget_bytes(info, 96, 3) == 3 * (kv + states) * 4
    eng = engine(kquant_dir, 3)
    try:
        assert eng.kv_bytes == kv_budget_bytes(info, 96, 3)
        assert [b.shape for b in eng._decoder.state_buffers] == [(3, 2, d.hidden)] * 2
        assert len(eng._decoder.kv_buffers) == 2
    finally:
        eng.close()


def test_the_lfm2_family_names_the_model_and_forces_its_tool_calls(kquant_dir, compat):
    compat('lfm2', CASE.wtype, 'tools')
    info = check_forced_tool_call(kquant_dir, 'lfm2')
    assert info['family'] == 'lfm2'
    assert info['model_name'].startswith('LFM2 ') and '(lfm2, Q8_0)' in info['model_name']


def test_a_warm_prompt_keeps_its_conv_states_across_a_restart_bit_for_bit(kquant_dir, tmp_path):
    system = ChatMessage('system', 'You are a robot. The sky is blue.')
    messages = [system, USER2]
    plain = engine(kquant_dir, max_context=256, prefix_reuse=False)
    try:
        want = turn(plain, messages)
    finally:
        plain.close()
    store = str(tmp_path / 'sessions.db')
    for restored in (False, True):   # prefilled, then read back from the store
        eng = engine(kquant_dir, max_context=256, session_store=store,
                     warm_prompts=(system.content,))
        try:
            (prompt,) = eng.warm_prompts()
            got = turn(eng, messages)
        finally:
            eng.close()
        # The pinned snapshot holds the conv states at its end: the goal continues there.
        assert prompt.restored is restored
        assert got.timings.cached_prompt_tokens == prompt.tokens
        assert result_bits(got) == result_bits(want)
