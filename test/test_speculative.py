"""Speculative decoding and grammar fast-forward (issue 23): exact under greedy and sampling.

A verify pass feeds a token and its draft in one call; the sequence picks every position's
token from those logits as plain decoding would and keeps drafts only while they equal the
picks. That is exact only if a verify pass gives each position the bits a decode step gives
it, which the op library's CausalAttention and KQuantMatMul promise (each position computed
alone): checked here per family, then the outputs of whole generations with speculation on
and off are compared token for token (greedy, seeded sampling, a sampled distribution, JSON
schema / tool calls / Lark / regex with fast-forward), beside batching, cancel and sessions.
"""
import collections
import json
import shutil

from decoder_calls import record_calls
from gguf_fixtures import ParityCase, write_gguf
import numpy as np
import onnx
from onnx import helper, TensorProto
import onnxruntime as ort
import pytest
from test_llama_cpp_parity import FAMILY_OPTIONS

from edge_llm_ros.convert.converter import convert
from edge_llm_ros.model_format import load_model_info
from edge_llm_ros.runtime import native_ops
from edge_llm_ros.runtime.decoder import OnnxDecoder, SessionConfig
from edge_llm_ros.runtime.rows import decode_row, Row
from edge_llm_ros.runtime.speculative import (measure_break_even, NgramIndex, Speculation,
                                              SpeculativeConfig, SpeculativeConfigError)
from edge_llm_ros.runtime.tokenizer import TextTokenizer
from edge_llm_ros.runtime.types import ChatMessage, GenerationRequest, SamplingConfig
from edge_llm_ros.serving.engine import Engine, EngineConfig
from edge_llm_ros.serving.goal import Goal

# Every family that can speculate, gemma3 with its sliding window; lfm2's conv state cannot
# be rewound, so it refuses speculation (test_lfm2).
FAMILIES = {arch: opts for arch, opts in FAMILY_OPTIONS.items() if arch != 'lfm2'}
CONTEXT = 'Dock A, shelf 14, red box, station 3, dock A.'
PROMPTS = [CONTEXT + ' Repeat the plan word for word.', 'Count: one two three one two three',
           'a b c d a b c d a b', 'Write a short poem about a robot.', 'hi',
           CONTEXT + ' Where does the robot charge?', 'x y z x y z x y z x y z',
           'List the steps: first, second, third, first, second, third,']


@pytest.fixture(scope='module')
def family_models(native_library, tmp_path_factory):
    root = tmp_path_factory.mktemp('spec')
    out = {}
    for arch, opts in FAMILIES.items():
        path = root / f'{arch}.gguf'
        write_gguf(path, ParityCase(arch, 'Q4_K', **opts))
        out[arch] = convert(str(path), str(root / arch), progress=False)
    return out


def quoting(model) -> list:
    """Return raw prompts whose continuation is earlier in them, as in a quoting answer.

    The tiny models count up (id t + 1 follows id t): the prompt holds that run earlier.
    """
    tok = TextTokenizer.from_dir(str(model))
    return [tok.decode(list(range(a, b)) + list(range(c, d)))
            for a, b, c, d in ((40, 90, 30, 45), (100, 130, 60, 101), (20, 60, 15, 22))]


def request(prompt, **kw):
    if isinstance(prompt, RawPrompt):
        return GenerationRequest(prompt=prompt, use_chat_template=False, **kw)
    return GenerationRequest(messages=[ChatMessage('user', prompt)], **kw)


class RawPrompt(str):
    """Prompt text fed as is (no chat template)."""


def run(model, mode, prompts=PROMPTS, sampling=SamplingConfig(), max_tokens=40, **kw):
    engine = Engine(EngineConfig(model_dir=str(model), intra_op_threads=2, max_context=256,
                                 speculative=SpeculativeConfig(mode=mode, **kw)))
    try:
        results = []
        for p in prompts:
            gen = engine.generate(request(p, max_tokens=max_tokens, sampling=sampling))
            for _ in gen:
                pass
            results.append(gen.result)
        return results, engine.speculation.stats
    finally:
        engine.close()


# --- the drafter --------------------------------------------------------------------------------
def test_prompt_lookup_drafts_the_latest_continuation_of_the_last_ngram():
    index = NgramIndex(1, 3)
    index.extend([5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6])
    assert index.draft(3) == [7, 1, 2]     # 5 6 was last followed by 7 1 2
    assert index.draft(2, after=[7]) == [1, 2]
    index.extend([7])
    assert index.draft(8) == [1, 2, 5, 6, 7]   # cut at the list's end
    assert NgramIndex(2, 3).draft(4) == []
    fresh = NgramIndex(2, 2)
    fresh.extend([1, 2, 3])
    assert fresh.draft(2) == []            # 2 3 never occurred before


def test_bad_settings_are_refused_with_what_to_change():
    for cfg, words in ((SpeculativeConfig(mode='fast'), 'not one of'),
                       (SpeculativeConfig(mode='prompt_lookup', max_draft=0), '1..32'),
                       (SpeculativeConfig(mode='draft'), 'draft_model')):
        with pytest.raises(SpeculativeConfigError, match=words):
            cfg.check()


# --- the attention op ---------------------------------------------------------------------------
def attention_session(op: str, heads: int, kv_heads: int, d: int, cap: int, window: int,
                      flag: bool = False, **norms):
    """One attention node; flag: CausalAttention's optional `bidirectional` input `bi`."""
    attrs = {'num_heads': heads, 'kv_num_heads': kv_heads, 'scale': 0.3, **norms}
    if op == 'CausalAttention':
        domain, attrs = native_ops.DOMAIN, {**attrs, 'window': window}
    else:
        domain = 'com.microsoft'
        attrs.update(do_rotary=1, rotary_interleaved=0)
        if window:
            attrs['local_window_size'] = window
    names = ['q', 'k', 'v', 'pk', 'pv', 'sl', 'tot', 'cos', 'sin'] + (['bi'] if flag else [])
    node = helper.make_node(op, names, ['o', 'ok', 'ov'], domain=domain, **attrs)
    f = TensorProto.FLOAT
    kv = ['b', kv_heads, cap, d]
    graph = helper.make_graph([node], 'g', [
        helper.make_tensor_value_info('q', f, ['b', 's', heads * d]),
        helper.make_tensor_value_info('k', f, ['b', 's', kv_heads * d]),
        helper.make_tensor_value_info('v', f, ['b', 's', kv_heads * d]),
        helper.make_tensor_value_info('pk', f, kv), helper.make_tensor_value_info('pv', f, kv),
        helper.make_tensor_value_info('sl', TensorProto.INT32, ['b']),
        helper.make_tensor_value_info('tot', TensorProto.INT32, []),
        helper.make_tensor_value_info('cos', f, [cap, d // 2]),
        helper.make_tensor_value_info('sin', f, [cap, d // 2])] +
        ([helper.make_tensor_value_info('bi', TensorProto.INT32, [1])] if flag else []),
        [helper.make_tensor_value_info('o', f, ['b', 's', heads * d]),
         helper.make_tensor_value_info('ok', f, kv), helper.make_tensor_value_info('ov', f, kv)])
    model = helper.make_model(graph, opset_imports=[
        helper.make_opsetid('', 17), helper.make_opsetid('com.microsoft', 1),
        helper.make_opsetid(native_ops.DOMAIN, 1)])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    if op == 'CausalAttention':
        native_ops.register(opts, 'the attention test')
    return ort.InferenceSession(model.SerializeToString(), opts,
                                providers=['CPUExecutionProvider'])


@pytest.mark.parametrize('window', [0, 5])
def test_causal_attention_matches_group_query_attention_and_is_row_exact(
        native_library, window):
    heads, kv_heads, d, cap, n0, n = 6, 2, 32, 48, 9, 7
    rng = np.random.default_rng(window)
    q, k, v = (rng.standard_normal((1, n0 + n, h * d)).astype(np.float32)
               for h in (heads, kv_heads, kv_heads))
    angle = np.arange(cap)[:, None] / (1e4 ** (np.arange(d // 2) / (d // 2)))
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    zeros = np.zeros((1, kv_heads, cap, d), np.float32)

    def step(sess, a, b, pk, pv):
        return sess.run(None, {'q': q[:, a:b], 'k': k[:, a:b], 'v': v[:, a:b], 'pk': pk,
                               'pv': pv, 'sl': np.array([b - 1], np.int32),
                               'tot': np.array(b, np.int32), 'cos': cos, 'sin': sin})

    ours = attention_session('CausalAttention', heads, kv_heads, d, cap, window)
    gqa = attention_session('GroupQueryAttention', heads, kv_heads, d, cap, window)
    o_ours, pk, pv = step(ours, 0, n0, zeros, zeros)
    o_gqa, gk, gv = step(gqa, 0, n0, zeros, zeros)
    np.testing.assert_allclose(o_ours, o_gqa, atol=2e-5)
    np.testing.assert_allclose(pk[:, :, :n0], gk[:, :, :n0], atol=2e-6)
    np.testing.assert_array_equal(pv[:, :, :n0], gv[:, :, :n0])
    # n positions in one call == n one-position calls, bit for bit (GQA's are not).
    multi, mk, _ = step(ours, n0, n0 + n, pk.copy(), pv.copy())
    sk, sv, rows = pk.copy(), pv.copy(), []
    for i in range(n):
        o, sk, sv = step(ours, n0 + i, n0 + i + 1, sk, sv)
        rows.append(o)
    np.testing.assert_array_equal(multi, np.concatenate(rows, axis=1))
    np.testing.assert_array_equal(mk, sk)
    o_gqa_multi, _, _ = step(gqa, n0, n0 + n, gk, gv)
    np.testing.assert_allclose(multi, o_gqa_multi, atol=2e-5)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Half-split rotary of x [positions, d] by the rows of cos/sin [positions, d/2]."""
    half = x.shape[-1] // 2
    a, b = x[:, :half], x[:, half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


@pytest.mark.parametrize('window', [0, 5])
def test_a_bidirectional_call_lets_every_row_see_all_of_its_keys(native_library, window):
    """gemma3's image rows: one call whose rows attend to each other both ways."""
    heads, kv_heads, d, cap, n0, n = 4, 2, 16, 32, 6, 8
    rng = np.random.default_rng(3 + window)
    q, k, v = (rng.standard_normal((1, n0 + n, h * d)).astype(np.float32)
               for h in (heads, kv_heads, kv_heads))
    angle = np.arange(cap)[:, None] / (1e4 ** (np.arange(d // 2) / (d // 2)))
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    zeros = np.zeros((1, kv_heads, cap, d), np.float32)
    sess = attention_session('CausalAttention', heads, kv_heads, d, cap, window, flag=True)

    def step(a, b, pk, pv, flag):
        return sess.run(None, {'q': q[:, a:b], 'k': k[:, a:b], 'v': v[:, a:b], 'pk': pk,
                               'pv': pv, 'sl': np.array([b - 1], np.int32),
                               'tot': np.array(b, np.int32), 'cos': cos, 'sin': sin,
                               'bi': np.array([flag], np.int32)})

    _, pk, pv = step(0, n0, zeros, zeros, 0)
    both, _, _ = step(n0, n0 + n, pk.copy(), pv.copy(), 1)
    causal, _, _ = step(n0, n0 + n, pk.copy(), pv.copy(), 0)
    # float64 reference: row p sees keys first..n0+n-1 (its window counted back from p).
    pos = np.arange(n0 + n)
    want = np.zeros((n, heads * d))
    for h in range(heads):
        g = h // (heads // kv_heads)
        keys = rotate(k[0, :, g * d:(g + 1) * d].astype(np.float64), cos[pos], sin[pos])
        rq = rotate(q[0, n0:, h * d:(h + 1) * d].astype(np.float64), cos[pos[n0:]],
                    sin[pos[n0:]])
        for i, p in enumerate(range(n0, n0 + n)):
            first = max(0, p + 1 - window) if window else 0
            logits = keys[first:] @ rq[i] * 0.3
            w = np.exp(logits - logits.max())
            want[i, h * d:(h + 1) * d] = (w / w.sum()) @ v[0, first:, g * d:(g + 1) * d]
    np.testing.assert_allclose(both[0], want, atol=2e-5)
    # The last row sees the same keys either way; every earlier row sees more than causal.
    np.testing.assert_allclose(both[0, -1], causal[0, -1], atol=1e-6)
    assert all(np.abs(both[0, i] - causal[0, i]).max() > 1e-3 for i in range(n - 1))


# --- verify passes are decode steps -----------------------------------------------------------
@pytest.mark.parametrize('arch', list(FAMILIES))
def test_a_verify_pass_gives_each_position_the_bits_of_a_decode_step(family_models, arch):
    model = family_models[arch]
    info = load_model_info(str(model))
    assert info.attention == 'causal'
    dec = OnnxDecoder(str(model), info, SessionConfig(intra_op_threads=2, max_context=64))
    assert dec.row_exact
    prompt = np.array([3, 17, 42, 9, 100, 7, 55, 21, 8], dtype=np.int64)
    fed = [11, 12, 13, 14, 15, 16]
    dec.run([Row(0, 0, prompt)])
    steps = [dec.run([decode_row(0, t, len(prompt) + i)])[0].copy() for i, t in enumerate(fed)]
    dec.run([Row(0, 0, prompt)])

    def verify(ids, start):
        return dec.run([Row(0, start, np.array(ids, dtype=np.int64), logits=len(ids))])
    np.testing.assert_array_equal(verify(fed[:2], len(prompt)), np.stack(steps[:2]))
    np.testing.assert_array_equal(verify(fed[2:], len(prompt) + 2), np.stack(steps[2:]))
    cost = measure_break_even(dec, 3, repeats=1)
    assert len(cost) == 4 and cost[0] == 1.0 and all(c > 0 for c in cost)


# --- whole generations: speculation on == off ---------------------------------------------
@pytest.mark.parametrize('arch', list(FAMILIES))
def test_greedy_output_is_plain_greedy_output_for_every_family(family_models, arch, compat):
    prompts = PROMPTS + [RawPrompt(p) for p in quoting(family_models[arch])]
    plain, _ = run(family_models[arch], 'off', prompts)
    spec, stats = run(family_models[arch], 'prompt_lookup', prompts)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.stop_reason == b.stop_reason
    assert stats.passes > 0 and stats.accepted > 0, stats   # it did speculate
    timed = [r.timings for r in spec if r.timings.draft_passes]
    assert timed and all(t.accepted_draft_tokens <= t.draft_tokens for t in timed)
    compat(arch, 'Q4_K', 'speculation')


def test_a_draft_model_gives_plain_output_and_is_checked_for_its_tokenizer(
        family_models, tmp_path):
    target = family_models['llama']
    prompts = PROMPTS[:2] + [RawPrompt(p) for p in quoting(target)]
    plain, _ = run(target, 'off', prompts)
    # Another family's tiny model shares the tiny tokenizer: a poor but legal draft.
    spec, stats = run(target, 'draft', prompts, draft_model=str(family_models['qwen2']))
    assert [r.token_ids for r in plain] == [r.token_ids for r in spec]
    assert stats.passes > 0
    selfdraft, stats = run(target, 'draft', prompts, draft_model=str(target))
    assert [r.token_ids for r in plain] == [r.token_ids for r in selfdraft]
    assert stats.accepted == stats.drafted > 0     # the model drafts its own greedy tokens
    other = tmp_path / 'other'
    shutil.copytree(target, other)
    data = json.loads((other / 'tokenizer.json').read_text())
    vocab = data['model']['vocab']
    by_id = {i: t for t, i in vocab.items()}
    i = len(by_id) // 2
    vocab[by_id[i]], vocab[by_id[i + 1]] = i + 1, i     # two ids swapped
    (other / 'tokenizer.json').write_text(json.dumps(data))
    with pytest.raises(SpeculativeConfigError, match=f'2 ids differ; first: {i}: '):
        run(target, 'draft', [], draft_model=str(other))


def test_seeded_sampling_draws_the_same_tokens(family_models):
    sampling = SamplingConfig(temperature=0.9, top_k=40, top_p=0.95, seed=11,
                              repetition_penalty=1.1)
    prompts = PROMPTS[:4] + [RawPrompt(p) for p in quoting(family_models['qwen3'])]
    plain, _ = run(family_models['qwen3'], 'off', prompts, sampling=sampling)
    spec, stats = run(family_models['qwen3'], 'prompt_lookup', prompts, sampling=sampling)
    assert [r.token_ids for r in plain] == [r.token_ids for r in spec]
    assert stats.passes > 0


def test_sampled_distribution_is_unchanged(family_models):
    """Different seeds on each side: two samples of one distribution (chi-square, TV)."""
    model = family_models['llama']
    prompt = [RawPrompt(quoting(model)[2])]
    draws = 150

    def sample(mode, base):
        engine = Engine(EngineConfig(model_dir=str(model), intra_op_threads=2,
                                     max_context=128,
                                     speculative=SpeculativeConfig(mode=mode)))
        counts, passes = collections.Counter(), 0
        try:
            for s in range(draws):
                gen = engine.generate(request(
                    prompt[0], max_tokens=4,
                    sampling=SamplingConfig(temperature=0.7, seed=base + s)))
                for _ in gen:
                    pass
                ids = gen.result.token_ids
                counts.update((i, t) for i, t in enumerate(ids[1:3], 1))
                passes += gen.result.timings.draft_passes
        finally:
            engine.close()
        return counts, passes

    plain, _ = sample('off', 0)
    spec, passes = sample('prompt_lookup', 10_000)
    assert passes > 0
    keys = set(plain) | set(spec)
    tv = 0.5 * sum(abs(plain[k] - spec[k]) for k in keys) / (2 * draws)
    # Pool rare outcomes, then a chi-square test of homogeneity.
    big = [k for k in keys if plain[k] + spec[k] >= 10]
    table = np.array([[plain[k] for k in big] + [sum(plain[k] for k in keys - set(big))],
                      [spec[k] for k in big] + [sum(spec[k] for k in keys - set(big))]],
                     dtype=float)
    table = table[:, table.sum(axis=0) > 0]
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0) / table.sum()
    chi2 = float(((table - expected) ** 2 / expected).sum())
    dof = table.shape[1] - 1
    # 0.999 quantile of chi-square ~ dof + 3.1 sqrt(2 dof) + 10 (a loose, safe bound)
    assert chi2 < dof + 3.1 * np.sqrt(2 * dof) + 10, (chi2, dof)
    assert tv < 0.2, tv


# --- grammar fast-forward ------------------------------------------------------------------
TOOL = {'type': 'function', 'function': {
    'name': 'move_to', 'description': 'Drive the robot to a named place',
    'parameters': {'type': 'object', 'properties': {
        'place': {'type': 'string', 'enum': ['kitchen', 'dock', 'office']},
        'speed': {'type': 'number'}, 'reason': {'type': 'string'}},
        'required': ['place', 'speed', 'reason']}}}
SCHEMA = ('{"type": "object", "properties": {"robot_name": {"type": "string"}, '
          '"battery_percent": {"type": "integer"}, "location": {"type": "string", '
          '"enum": ["dock", "hall", "lab"]}}, "required": ["robot_name", "battery_percent", '
          '"location"]}')
CONSTRAINED = [
    {'prompt': 'Describe the robot as JSON.', 'json_schema': SCHEMA},
    {'prompt': 'Go to the kitchen slowly.', 'tools': [TOOL], 'tool_choice': 'required'},
    {'prompt': 'Say a status line.',
     'grammar': 'start: "status: " WORD " battery=" NUM "%"\nWORD: /[a-z]+/\nNUM: /[0-9]+/'},
    {'prompt': 'Give a robot id.', 'regex': r'robot-(alpha|beta)-[0-9]{3}-ready'},
]


@pytest.fixture(scope='module')
def smol_engines():
    made = [Engine(EngineConfig(intra_op_threads=2, max_context=1024,
                                speculative=SpeculativeConfig(mode=mode)))
            for mode in ('off', 'prompt_lookup')]
    yield made
    for e in made:
        e.close()


@pytest.mark.parametrize('kind', range(len(CONSTRAINED)),
                         ids=['json_schema', 'tool_call', 'lark', 'regex'])
def test_fast_forward_output_equals_step_by_step_constrained_decoding(smol_engines, kind):
    plain, spec = smol_engines
    before = spec.speculation.stats.accepted
    results = []
    for engine in (plain, spec):
        gen = engine.generate(GenerationRequest(max_tokens=120, **CONSTRAINED[kind]))
        for _ in gen:
            pass
        results.append(gen.result)
    a, b = results
    assert a.token_ids == b.token_ids and a.text == b.text
    assert [(c.name, c.arguments) for c in a.tool_calls] == \
        [(c.name, c.arguments) for c in b.tool_calls]
    assert a.stop_reason == b.stop_reason
    # The forced keys and punctuation went through verify passes and were kept.
    assert spec.speculation.stats.accepted > before
    assert b.timings.decode_steps < len(b.token_ids) - 1


# --- speculation at any batch size --------------------------------------------------------------
def run_batched(model, mode, prompts, sampling=SamplingConfig(), **kw):
    """Run the prompts at once on 3 slots; return results, stats and each call's rows."""
    engine = Engine(EngineConfig(model_dir=str(model), intra_op_threads=2, max_context=256,
                                 parallel_sequences=3,
                                 speculative=SpeculativeConfig(mode=mode, **kw)))
    recorded = record_calls(engine._decoder)
    try:
        sched = engine.scheduler()
        goals = [sched.submit(Goal(engine.prepare(request(p, max_tokens=40,
                                                          sampling=sampling))))
                 for p in prompts]
        for _ in range(3000):
            if all(g.done for g in goals):
                break
            engine.step()
        calls = [[(row.length, row.logits) for row in call] for call in recorded]
        return [g.result for g in goals], engine.speculation.stats, calls
    finally:
        engine.close()


@pytest.mark.parametrize('mode', ['prompt_lookup', 'draft'])
def test_speculation_at_any_batch_size_equals_plain_decoding(family_models, mode):
    """Three goals decode together; each may verify drafts in the same call as the others."""
    model = family_models['llama']
    prompts = [RawPrompt(p) for p in quoting(model)] + PROMPTS[:3]
    kw = {'draft_model': str(model)} if mode == 'draft' else {}
    seeded = SamplingConfig(temperature=0.9, top_k=40, top_p=0.95, seed=5)
    for sampling in (SamplingConfig(), seeded):
        plain, _, _ = run_batched(model, 'off', prompts, sampling)
        spec, stats, calls = run_batched(model, mode, prompts, sampling, **kw)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
        assert [r.stop_reason for r in spec] == [r.stop_reason for r in plain]
        assert stats.passes > 0 and stats.accepted > 0, stats
        # A verify row (k + 1 positions, all with logits) ran beside another goal's row.
        assert any(len(call) > 1 and any(n > 1 and n == k for n, k in call) for call in calls)


# --- the engine around it -----------------------------------------------------------------------
def test_per_request_off_batching_cancel_and_sessions_behave_as_without(family_models):
    model = family_models['qwen2']
    cfgs = [EngineConfig(model_dir=str(model), intra_op_threads=2, max_context=256,
                         parallel_sequences=2, speculative=SpeculativeConfig(mode=m))
            for m in ('off', 'prompt_lookup')]
    outs = []
    for cfg in cfgs:
        engine = Engine(cfg)
        try:
            sched = engine.scheduler()
            goals = [sched.submit(Goal(engine.prepare(GenerationRequest(
                messages=[ChatMessage('user', p)], max_tokens=30)))) for p in PROMPTS[:3]]
            for _ in range(2000):
                if all(g.done for g in goals):
                    break
                engine.step()
            batch = [g.result.token_ids for g in goals]
            # Per request: speculation off for this one.
            gen = engine.generate(GenerationRequest(messages=[ChatMessage('user', PROMPTS[1])],
                                                    max_tokens=30, speculative=False))
            for _ in gen:
                pass
            off = gen.result
            # A session of two turns: the second reuses the first's KV.
            turns = []
            for text in (PROMPTS[2], 'and again'):
                g = engine.generate(GenerationRequest(messages=[ChatMessage('user', text)],
                                                      session_id='s1', max_tokens=20))
                for _ in g:
                    pass
                turns.append((g.result.token_ids, g.result.timings.cached_prompt_tokens))
            # Cancel in the middle of a speculating goal: it ends, the engine goes on.
            g = engine.generate(GenerationRequest(messages=[ChatMessage('user', PROMPTS[0])],
                                                  max_tokens=60))
            seen = 0
            for _ in g:
                seen += 1
                if seen == 5:
                    g.cancel()
            cancelled = g.result.stop_reason
            assert sched.idle()
            outs.append((batch, off.token_ids, off.timings.draft_passes, turns, cancelled))
        finally:
            engine.close()
    plain, spec = outs
    assert plain[0] == spec[0]                   # batched goals
    assert plain[1] == spec[1] and spec[2] == 0  # the goal that asked for no speculation
    assert plain[3] == spec[3]                   # session turns and their reuse
    assert plain[4] == spec[4]


def test_preemption_parks_a_speculating_goal_exactly(family_models):
    """One slot: a priority goal pauses a speculating one, which resumes where it was."""
    outs = []
    for mode in ('off', 'prompt_lookup'):
        engine = Engine(EngineConfig(model_dir=str(family_models['llama']), intra_op_threads=2,
                                     max_context=256,
                                     speculative=SpeculativeConfig(mode=mode)))
        try:
            sched = engine.scheduler()
            long = sched.submit(Goal(engine.prepare(request(
                RawPrompt(quoting(family_models['llama'])[0]), max_tokens=50))))
            for _ in range(8):
                engine.step()
            urgent = sched.submit(Goal(engine.prepare(request(PROMPTS[1], max_tokens=10)),
                                       priority=50, preempt=True))
            for _ in range(2000):
                if long.done and urgent.done:
                    break
                engine.step()
            outs.append((long.result.token_ids, urgent.result.token_ids,
                         long.result.timings.draft_passes))
        finally:
            engine.close()
    (a_long, a_urgent, _), (b_long, b_urgent, passes) = outs
    assert a_long == b_long and a_urgent == b_urgent
    assert passes > 0


def test_a_folder_that_is_not_row_exact_cannot_speculate(tmp_path, family_models):
    src = tmp_path / 'llama.gguf'
    write_gguf(src, ParityCase('llama', 'Q4_K'))
    mnb = convert(str(src), str(tmp_path / 'mnb'), weights='matmulnbits', progress=False)
    assert load_model_info(str(mnb)).attention == 'gqa'
    with pytest.raises(SpeculativeConfigError, match='not row-exact.*--weights kquant'):
        run(mnb, 'prompt_lookup', [])
    engine = Engine(EngineConfig(model_dir=str(mnb), intra_op_threads=2, max_context=64,
                                 speculative=SpeculativeConfig(mode='auto')))
    try:
        assert not engine.speculation.enabled and 'not row-exact' in engine.speculation.why_off
    finally:
        engine.close()
    graph = onnx.load(str(mnb / 'model.onnx'), load_external_data=False)
    assert 'GroupQueryAttention' in {n.op_type for n in graph.graph.node}


def test_auto_mode_turns_off_a_sequence_below_break_even_and_keeps_one_above(family_models):
    cost = [1.0, 1.3, 1.6, 1.9, 2.2]
    owner = Speculation(SpeculativeConfig(mode='auto', max_draft=4), True, cost=cost)
    losing, winning = owner.start([1, 2, 3]), owner.start([1, 2, 3])
    for _ in range(4):
        losing.observe(3, 0)     # 1 token for a pass costing 1.9 steps
        winning.observe(3, 3)    # 4 tokens for 1.9
    assert losing.off and losing.ask([], 8) is None
    ask = winning.ask([7, 8, 9, 10, 11], 8)
    assert not winning.off and (ask.head, ask.want) == ([7, 8, 9, 10], 0)
    assert owner.draft({0: ask}) == {0: [7, 8, 9, 10]}
    # The draft length follows acceptance: a sequence whose drafts fail drafts short.
    explicit = Speculation(SpeculativeConfig(mode='prompt_lookup', max_draft=4), True,
                           cost=cost).start([1, 2, 3])
    for _ in range(6):
        explicit.observe(4, 0)
    assert not explicit.off and explicit._length() == 1
    # And on a model: auto's output is still plain output.
    prompt = ['Write a short poem about a robot.']
    results, _ = run(family_models['phi3'], 'auto', prompt, max_tokens=60)
    plain, _ = run(family_models['phi3'], 'off', prompt, max_tokens=60)
    assert results[0].token_ids == plain[0].token_ids


def head_norm(x: np.ndarray, weight: np.ndarray, eps: float, d: int) -> np.ndarray:
    """ggml_rms_norm per head of x [1, S, heads * d], then the weight, in ggml's float steps."""
    out = np.empty_like(x)
    for s in range(x.shape[1]):
        for h in range(x.shape[2] // d):
            row = x[0, s, h * d:(h + 1) * d]
            total = 0.0  # the squares (float32) summed in double, in order
            for value in (row * row).tolist():
                total += value
            mean = np.float32(total / d)
            scale = np.float32(1) / np.sqrt(mean + np.float32(eps))
            out[0, s, h * d:(h + 1) * d] = (row * scale) * weight
    return out


def test_causal_attention_normalizes_each_head_of_q_and_k_before_the_rotary(native_library):
    """qwen3 / gemma3's q_norm and k_norm inside the op: the bits of normalizing outside."""
    heads, kv_heads, d, cap, n0, n = 4, 2, 16, 24, 5, 3
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, n0 + n, h * d)).astype(np.float32) * 3
               for h in (heads, kv_heads, kv_heads))
    q_w, k_w = (rng.standard_normal(d).astype(np.float32) for _ in range(2))
    angle = np.arange(cap)[:, None] / (1e4 ** (np.arange(d // 2) / (d // 2)))
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    zeros = np.zeros((1, kv_heads, cap, d), np.float32)
    eps = 1e-6
    normed = attention_session('CausalAttention', heads, kv_heads, d, cap, 0,
                               q_norm=q_w.tolist(), k_norm=k_w.tolist(), norm_epsilon=eps)
    plain = attention_session('CausalAttention', heads, kv_heads, d, cap, 0)

    def step(sess, qq, kk, a, b, pk, pv):
        return sess.run(None, {'q': qq[:, a:b], 'k': kk[:, a:b], 'v': v[:, a:b], 'pk': pk,
                               'pv': pv, 'sl': np.array([b - 1], np.int32),
                               'tot': np.array(b, np.int32), 'cos': cos, 'sin': sin})

    q_n, k_n = head_norm(q, q_w, eps, d), head_norm(k, k_w, eps, d)
    inside, pk, pv = step(normed, q, k, 0, n0, zeros, zeros)
    outside, ok, ov = step(plain, q_n, k_n, 0, n0, zeros, zeros)
    assert inside.tobytes() == outside.tobytes() and pk.tobytes() == ok.tobytes()
    later, _, _ = step(normed, q, k, n0, n0 + n, pk.copy(), pv.copy())
    want, _, _ = step(plain, q_n, k_n, n0, n0 + n, ok.copy(), ov.copy())
    assert later.tobytes() == want.tobytes()
    assert np.abs(step(plain, q, k, 0, n0, zeros, zeros)[0] - inside).max() > 1e-2
    with pytest.raises(Exception, match='q_norm and k_norm come together'):
        attention_session('CausalAttention', heads, kv_heads, d, cap, 0, q_norm=q_w.tolist(),
                          norm_epsilon=eps)
    short = attention_session('CausalAttention', heads, kv_heads, d, cap, 0,
                              q_norm=q_w[:8].tolist(), k_norm=k_w[:8].tolist(),
                              norm_epsilon=eps)
    with pytest.raises(Exception, match='q_norm / k_norm hold 8 / 8 weights for heads of 16'):
        step(short, q, k, 0, n0, zeros, zeros)
