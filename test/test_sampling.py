"""Sampler chain: validation, each stage against a plain (full-sort) reference, seeding."""
from dataclasses import dataclass
import math
from typing import Any

from hypothesis import given, settings, strategies as st
import numpy as np
import pytest

from edge_llm_ros.errors import EngineError, InvalidSamplingError
from edge_llm_ros.runtime.sampling import (_draw, _top_indices, build_sampler, Candidates, MinP,
                                           TopK, TopP, validate)
from edge_llm_ros.runtime.types import SamplingConfig

VOCAB = 49152


def logits_for(seed, n=VOCAB, scale=4.0):
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


# --- validation ----------------------------------------------------------------------------

@pytest.mark.parametrize('field, value, words', [
    ('temperature', -0.1, 'temperature=-0.1 is out of range: it must be >= 0'),
    ('temperature', math.nan, 'temperature=nan'),
    ('temperature', math.inf, 'temperature=inf'),
    ('top_p', 0.0, r'top_p=0.0 is out of range: it must be in \(0, 1\]'),
    ('top_p', 1.5, r'top_p=1.5 .* \(0, 1\]'),
    ('top_k', -1, 'top_k=-1 is out of range: it must be >= 0'),
    ('top_k', 2.5, 'top_k must be an integer'),
    ('min_p', 1.0, r'min_p=1.0 .* \[0, 1\)'),
    ('min_p', -0.1, r'min_p=-0.1 .* \[0, 1\)'),
    ('repetition_penalty', 0.0, 'repetition_penalty=0.0 .* > 0'),
    ('repetition_penalty', -1.0, 'repetition_penalty=-1.0'),
    ('presence_penalty', 2.5, r'presence_penalty=2.5 .* \[-2, 2\]'),
    ('presence_penalty', -2.01, 'presence_penalty=-2.01'),
    ('seed', -1, 'seed=-1 is out of range: it must be >= 0'),
    ('temperature', 'hot', 'temperature must be a number'),
    ('top_p', True, 'top_p must be a number'),
])
def test_invalid_values_name_field_and_range(field, value, words):
    config = SamplingConfig(**{field: value})
    with pytest.raises(InvalidSamplingError, match=words):
        validate(config)
    with pytest.raises(InvalidSamplingError, match=field):
        build_sampler(config, VOCAB)


@pytest.mark.parametrize('config', [
    SamplingConfig(), SamplingConfig(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05,
                                     repetition_penalty=1.1, presence_penalty=-2.0, seed=0),
    SamplingConfig(top_p=1.0, min_p=0.0, presence_penalty=2.0, seed=2**40),
])
def test_valid_values_pass(config):
    validate(config)


# --- chain composition ---------------------------------------------------------------------

def test_disabled_stages_are_left_out():
    assert build_sampler(SamplingConfig(), VOCAB).stage_names == []
    full = SamplingConfig(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05,
                          repetition_penalty=1.1, presence_penalty=0.5, seed=1)
    assert build_sampler(full, VOCAB).stage_names == [
        'repetition_penalty', 'presence_penalty', 'temperature', 'top_k', 'top_p', 'min_p']
    # Greedy: only what can change the argmax remains.
    greedy = SamplingConfig(temperature=0.0, top_k=40, top_p=0.9, repetition_penalty=1.2)
    sampler = build_sampler(greedy, VOCAB)
    assert sampler.greedy and sampler.stage_names == ['repetition_penalty']
    # Temperature 1 is a no-op stage.
    assert build_sampler(SamplingConfig(temperature=1.0, seed=3), VOCAB).stage_names == []


# --- selection -----------------------------------------------------------------------------

@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_greedy_is_argmax_and_leaves_input_alone(seed):
    logits = logits_for(seed)
    before = logits.copy()
    sampler = build_sampler(SamplingConfig(), VOCAB)
    assert sampler.sample(logits) == int(np.argmax(logits))
    assert np.array_equal(logits, before)
    assert sampler.sample(logits.reshape(1, 1, -1)) == int(np.argmax(logits))


CONFIGS = [
    SamplingConfig(temperature=0.8),
    SamplingConfig(temperature=1.2, top_k=40),
    SamplingConfig(temperature=0.9, top_p=0.9),
    SamplingConfig(temperature=0.7, min_p=0.05),
    SamplingConfig(temperature=0.7, top_k=50, top_p=0.95, min_p=0.02, repetition_penalty=1.3,
                   presence_penalty=0.5),
]


@pytest.mark.parametrize('config', CONFIGS)
def test_same_seed_same_tokens(config):
    def run(seed):
        from dataclasses import replace
        sampler = build_sampler(replace(config, seed=seed), VOCAB)
        sampler.reset([5, 6, 7])
        out = []
        for step in range(40):
            token = sampler.sample(logits_for(step, scale=2.0))
            sampler.accept(token)
            out.append(token)
        return out, sampler

    first, sampler = run(1234)
    assert run(1234)[0] == first
    assert run(99)[0] != first
    # reset() re-seeds: the same sampler repeats itself.
    sampler.reset([5, 6, 7])
    again = []
    for step in range(40):
        again.append(sampler.sample(logits_for(step, scale=2.0)))
        sampler.accept(again[-1])
    assert again == first


def test_unset_seed_is_drawn_and_reported():
    a = build_sampler(SamplingConfig(temperature=1.0), VOCAB)
    b = build_sampler(SamplingConfig(temperature=1.0), VOCAB)
    assert a.seed is not None and a.seed >= 0 and a.seed != b.seed


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), config=st.sampled_from(CONFIGS + [SamplingConfig()]),
       allowed=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30))
def test_allowed_mask_is_always_respected(seed, config, allowed):
    from dataclasses import replace
    mask = np.zeros(VOCAB, dtype=bool)
    mask[allowed] = True
    sampler = build_sampler(replace(config, seed=seed) if config.temperature else config, VOCAB)
    for step in range(3):
        token = sampler.sample(logits_for(seed + step), allowed_mask=mask)
        assert mask[token]
        sampler.accept(token)


def test_nothing_allowed_is_an_error():
    sampler = build_sampler(SamplingConfig(temperature=0.5, seed=1), VOCAB)
    with pytest.raises(EngineError, match='no token is allowed'):
        sampler.sample(logits_for(0), allowed_mask=np.zeros(VOCAB, dtype=bool))
    with pytest.raises(EngineError, match='vocabulary of 49152'):
        sampler.sample(np.zeros(100, dtype=np.float32))


# --- stages against references -------------------------------------------------------------

def _kept(stage, logits):
    cand = Candidates(logits.copy())
    stage.apply(cand)
    return set(range(logits.size)) if cand.ids is None else set(cand.ids.tolist())


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(1, 5000),
       n=st.sampled_from([10, 1000, VOCAB]))
def test_top_indices_are_the_k_largest(seed, k, n):
    values = logits_for(seed, n)
    k = min(k, n)
    got = _top_indices(values, k)
    assert got.size == k and len(set(got.tolist())) == k
    assert set(got.tolist()) == set(np.argsort(-values, kind='stable')[:k].tolist())


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), p=st.floats(0.01, 0.999), scale=st.floats(0.5, 8.0))
def test_top_p_keeps_smallest_nucleus(seed, p, scale):
    logits = logits_for(seed, scale=scale)
    probs = np.exp(logits.astype(np.float64) - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    n = int(np.searchsorted(np.cumsum(probs[order]), p)) + 1
    kept = _kept(TopP(p), logits)
    # float32 vs float64 rounding may move the edge by one token at most.
    assert abs(len(kept) - n) <= 1
    # The top tokens are kept, up to which of equal logits at the edge goes first.
    m = min(n, len(kept))
    ties = set(np.flatnonzero(probs == probs[order[m - 1]]).tolist())
    assert set(order[:m].tolist()) - ties <= kept


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), min_p=st.floats(0.001, 0.9))
def test_min_p_keeps_tokens_above_fraction_of_best(seed, min_p):
    logits = logits_for(seed, scale=3.0).astype(np.float64)
    probs = np.exp(logits - logits.max())
    expected = set(np.flatnonzero(probs >= min_p * probs.max() * (1 + 1e-6)).tolist())
    kept = _kept(MinP(min_p), logits)
    assert expected <= kept
    assert all(probs[i] >= min_p * probs.max() * (1 - 1e-6) for i in kept)


def test_top_k_then_draw_stays_in_top_k():
    sampler = build_sampler(SamplingConfig(temperature=5.0, top_k=3, seed=7), VOCAB)
    logits = logits_for(1)
    top3 = set(np.argsort(-logits)[:3].tolist())
    assert {sampler.sample(logits) for _ in range(200)} == top3
    assert _kept(TopK(VOCAB + 10), logits) == set(range(VOCAB))


def test_repetition_and_presence_penalties():
    logits = np.zeros(VOCAB, dtype=np.float32)
    logits[[10, 11, 12]] = [2.0, -2.0, 1.9]
    rep = build_sampler(SamplingConfig(repetition_penalty=2.0), VOCAB, penalty_window=2)
    rep.reset([10, 11])
    assert rep.sample(logits) == 12  # 10 -> 1.0, 11 -> -4.0
    rep.accept(99)
    rep.accept(98)  # 10 and 11 slid out of the 2-token window
    assert rep.sample(logits) == 10
    pres = build_sampler(SamplingConfig(presence_penalty=0.2), VOCAB)
    pres.reset([10, 10, 10])
    assert pres.sample(logits) == 12  # 2.0 - 0.2 once, not per occurrence
    pres = build_sampler(SamplingConfig(presence_penalty=-2.0), VOCAB)
    pres.reset([11])
    assert pres.sample(logits) == 10  # a negative penalty favours seen tokens, but not enough


@pytest.mark.parametrize('n', [50, 3000, VOCAB])
def test_draw_follows_softmax(n):
    rng = np.random.default_rng(0)
    logits = np.full(n, -5.0, dtype=np.float32)
    hot = [0, n // 2, n - 1]  # first block, a middle block, the tail
    logits[hot] = [1.0, 0.5, 0.0]
    probs = np.exp(logits.astype(np.float64) - logits.max())
    probs /= probs.sum()
    draws = 20000
    counts = np.bincount([_draw(logits, rng) for _ in range(draws)], minlength=n)
    for i in hot:
        sigma = math.sqrt(draws * probs[i] * (1 - probs[i]))
        assert abs(counts[i] - draws * probs[i]) < 5 * sigma
    rest = counts.sum() - counts[hot].sum()
    expected_rest = draws * (1 - probs[hot].sum())
    assert abs(rest - expected_rest) < 5 * math.sqrt(expected_rest) + 5


def test_draw_never_picks_impossible_tokens():
    logits = np.full(5000, -np.inf, dtype=np.float32)
    logits[[17, 4321]] = [0.0, 0.0]
    rng = np.random.default_rng(5)
    assert {_draw(logits, rng) for _ in range(500)} == {17, 4321}


# --- logit_bias, frequency_penalty, logprobs ------------------------------------------------

@dataclass(frozen=True)
class Extended(SamplingConfig):
    """SamplingConfig with the OpenAI fields (the engine reads them where present)."""

    logit_bias: Any = None
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0


@pytest.mark.parametrize('kwargs, words', [
    ({'frequency_penalty': 2.5}, r'frequency_penalty=2.5 .* \[-2, 2\]'),
    ({'frequency_penalty': math.nan}, 'frequency_penalty=nan'),
    ({'top_logprobs': 21}, r'top_logprobs=21 .* \[0, 20\]'),
    ({'top_logprobs': -1}, 'top_logprobs=-1'),
    ({'top_logprobs': 1.0}, 'top_logprobs must be an integer'),
    ({'logprobs': 1}, 'logprobs must be true or false'),
    ({'logit_bias': {5: 101.0}}, r'logit_bias\[5\]=101.0 .* \[-100, 100\]'),
    ({'logit_bias': {-1: 1.0}}, 'logit_bias token id=-1'),
    ({'logit_bias': {'x': 1.0}}, 'logit_bias token id must be an integer'),
    ({'logit_bias': {5: 'hi'}}, r'logit_bias\[5\] must be a number'),
    ({'logit_bias': [1, 2]}, 'must map token ids to biases'),
    ({'logit_bias': dict.fromkeys(range(1025), 1.0)}, 'at most 1024'),
])
def test_invalid_extra_values(kwargs, words):
    with pytest.raises(InvalidSamplingError, match=words):
        validate(Extended(**kwargs))


def test_logit_bias_ids_must_be_in_the_vocabulary():
    validate(Extended(logit_bias={VOCAB: 1.0}))  # the vocabulary is known only at build
    with pytest.raises(InvalidSamplingError, match=f'token id {VOCAB} is outside'):
        build_sampler(Extended(logit_bias={VOCAB: 1.0}), VOCAB)


def test_logit_bias_moves_the_choice():
    logits = logits_for(3)
    best = int(np.argmax(logits))
    low = int(np.argmin(logits))
    boost = build_sampler(Extended(logit_bias={str(low): 100.0}), VOCAB)  # JSON-style key
    assert boost.stage_names == ['logit_bias']
    assert boost.sample(logits) == low
    ban = build_sampler(Extended(logit_bias={best: -100.0}), VOCAB)
    assert ban.sample(logits) == int(np.argsort(-logits)[1])
    assert np.array_equal(logits, logits_for(3))  # the input is left alone


def test_frequency_penalty_counts_occurrences():
    logits = np.zeros(VOCAB, dtype=np.float32)
    logits[[10, 12]] = [2.0, 1.5]
    freq = build_sampler(Extended(frequency_penalty=0.2), VOCAB)
    freq.reset([10, 10])
    assert freq.sample(logits) == 10  # 2.0 - 2 * 0.2 = 1.6 > 1.5
    freq.accept(10)
    assert freq.sample(logits) == 12  # 2.0 - 3 * 0.2 = 1.4 < 1.5
    both = build_sampler(Extended(frequency_penalty=0.2, presence_penalty=0.5,
                                  repetition_penalty=1.1), VOCAB)
    assert both.stage_names == ['repetition_penalty', 'presence_penalty', 'frequency_penalty']
    both.reset([10])
    both.accept(10)
    # 2.0 / 1.1 - 0.5 - 2 * 0.2 = 0.918: the shared history counted each token once.
    assert both.sample(logits) == 12


def reference_logprobs(processed):
    values = processed.astype(np.float64)
    return values - (values.max() + np.log(np.exp(values - values.max()).sum()))


@pytest.mark.parametrize('config', [
    Extended(logprobs=True), Extended(top_logprobs=5),
    Extended(temperature=0.7, top_logprobs=20, seed=1),
    Extended(temperature=1.0, top_k=3, top_logprobs=5, seed=2),
])
def test_logprobs_of_the_final_distribution(config):
    sampler = build_sampler(config, VOCAB)
    sampler.reset([])
    logits = logits_for(4)
    mask = np.ones(VOCAB, dtype=bool)
    mask[int(np.argmax(logits))] = False  # the mask is part of the final distribution
    token = sampler.sample(logits, mask)
    lp = sampler.last_logprobs
    masked = np.where(mask, logits, -np.inf)
    temp = config.temperature if config.temperature else 1.0
    ref = reference_logprobs(masked / temp)
    if config.top_k:
        keep = np.argsort(-masked)[:config.top_k]
        ref = np.full(VOCAB, -np.inf)
        ref[keep] = reference_logprobs((masked / temp)[keep])
    assert lp.token_id == token
    assert lp.logprob == pytest.approx(ref[token], abs=1e-4)
    n = min(config.top_logprobs, config.top_k or VOCAB)
    order = np.argsort(-ref, kind='stable')[:n]
    assert [t for t, _ in lp.top] == order.tolist()
    assert [v for _, v in lp.top] == pytest.approx(ref[order].tolist(), abs=1e-4)
    assert all(a >= b for (_, a), (_, b) in zip(lp.top, lp.top[1:]))


def test_no_logprobs_means_the_plain_sampler():
    sampler = build_sampler(Extended(), VOCAB)
    assert type(sampler).__name__ == 'Sampler' and not hasattr(sampler, 'last_logprobs')


def test_logprob_sampler_draws_like_the_plain_one():
    config = {'temperature': 0.9, 'top_p': 0.9, 'seed': 7}
    plain = build_sampler(Extended(**config), VOCAB)
    withlp = build_sampler(Extended(top_logprobs=3, **config), VOCAB)
    for s in (plain, withlp):
        s.reset([])
    picks = [(plain.sample(logits_for(i)), withlp.sample(logits_for(i))) for i in range(20)]
    assert all(a == b for a, b in picks)
