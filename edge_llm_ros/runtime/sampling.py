"""Token selection: a chain of small stages ended by greedy or a seeded draw.

The shape follows llama.cpp's sampler chain (each stage has apply / accept / reset) in the order
logit bias -> penalties -> temperature -> top-k -> top-p -> min-p.  The chain is built once per
request from a validated `SamplingConfig`; disabled stages are left out, and at temperature 0
only the penalties remain (the filters cannot change the argmax).  Temperatures below
`GREEDY_TEMPERATURE` are greedy too: that is their limit, and 1/T would overflow float32.

Runs every token over the whole vocabulary, so it avoids full sorts: top-k and top-p first
narrow the vocabulary with a threshold taken from a strided sample (see `_top_indices`).

Fields beyond the original SamplingConfig (logit_bias, frequency_penalty, logprobs,
top_logprobs) are read with getattr and their OpenAI defaults, so a config type without them
still works. With logprobs on, the sampler is a LogprobSampler: the chosen token's log
probability and the top-n of the final distribution (after every stage, at temperature 1 when
greedy) are left in `last_logprobs` after each pick; without, the loop does no extra work.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
import math
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from edge_llm_ros.errors import EngineError, InvalidSamplingError
from edge_llm_ros.runtime.types import SamplingConfig

# Tokens of history the penalties look at (llama.cpp's penalty_last_n default); 0 = all.
DEFAULT_PENALTY_WINDOW = 64
# Temperatures below this are decoded greedily (the T -> 0 limit of sampling).
GREEDY_TEMPERATURE = 1e-6
_FLOAT32_MAX = float(np.finfo(np.float32).max)
MAX_TOP_LOGPROBS = 20          # OpenAI's limit
MAX_LOGIT_BIAS = 100.0         # OpenAI's range is [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 1024


def extra(config: Any, name: str) -> Any:
    """Read a field that older SamplingConfig types lack (else its disabled default)."""
    return getattr(config, name, _EXTRA_DEFAULTS[name])


_EXTRA_DEFAULTS: Dict[str, Any] = {'logit_bias': None, 'frequency_penalty': 0.0,
                                   'logprobs': False, 'top_logprobs': 0}


def validate(config: SamplingConfig) -> None:
    """Raise InvalidSamplingError naming the first out-of-range field and its valid range."""
    if not 0.0 <= _real(config.temperature, 'temperature') < math.inf:
        raise InvalidSamplingError(f'temperature={config.temperature} is out of range: it must '
                                   'be >= 0 and finite (0 = greedy)')
    _check_int(config.top_k, 'top_k', '>= 0 (0 = disabled)')
    if not 0.0 < _real(config.top_p, 'top_p') <= 1.0:
        raise InvalidSamplingError(f'top_p={config.top_p} is out of range: it must be in (0, 1] '
                                   '(1 = disabled)')
    if not 0.0 <= _real(config.min_p, 'min_p') < 1.0:
        raise InvalidSamplingError(f'min_p={config.min_p} is out of range: it must be in [0, 1) '
                                   '(0 = disabled)')
    if not 0.0 < _real(config.repetition_penalty, 'repetition_penalty') < math.inf:
        raise InvalidSamplingError(f'repetition_penalty={config.repetition_penalty} is out of '
                                   'range: it must be > 0 (1 = disabled)')
    _check_real(config.presence_penalty, 'presence_penalty', -2.0, 2.0,
                'in [-2, 2] (0 = disabled)')
    if config.seed is not None:
        _check_int(config.seed, 'seed', '>= 0, or unset for a random seed')
    _check_real(extra(config, 'frequency_penalty'), 'frequency_penalty', -2.0, 2.0,
                'in [-2, 2] (0 = disabled)')
    top = extra(config, 'top_logprobs')
    _check_int(top, 'top_logprobs', f'in [0, {MAX_TOP_LOGPROBS}]')
    if top > MAX_TOP_LOGPROBS:
        raise InvalidSamplingError(f'top_logprobs={top} is out of range: it must be in '
                                   f'[0, {MAX_TOP_LOGPROBS}]')
    if not isinstance(extra(config, 'logprobs'), bool):
        raise InvalidSamplingError('logprobs must be true or false')
    logit_bias_items(extra(config, 'logit_bias'))


def logit_bias_items(bias: Any, vocab_size: Optional[int] = None) -> Tuple[Tuple[int, float], ...]:
    """Check logit_bias ({token id: bias} or (id, bias) pairs); ids within the vocabulary."""
    if not bias:
        return ()
    items = list(bias.items()) if isinstance(bias, Mapping) else bias
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        raise InvalidSamplingError('logit_bias must map token ids to biases') from None
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidSamplingError(f'logit_bias has {len(pairs)} entries; at most '
                                   f'{MAX_LOGIT_BIAS_ENTRIES}')
    out: Dict[int, float] = {}
    for key, value in pairs:
        if isinstance(key, str) and key.strip().lstrip('-').isdigit():
            key = int(key)  # JSON object keys (OpenAI sends token ids as strings)
        _check_int(key, 'logit_bias token id', '>= 0')
        if vocab_size is not None and key >= vocab_size:
            raise InvalidSamplingError(f'logit_bias token id {key} is outside the vocabulary '
                                       f'(0..{vocab_size - 1})')
        _check_real(value, f'logit_bias[{key}]', -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS,
                    f'in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]')
        out[int(key)] = float(value)
    return tuple(sorted(out.items()))


class Candidates:
    """The tokens still in play: `ids` None means the whole vocabulary, in id order."""

    __slots__ = ('ids', 'logits')

    def __init__(self, logits: np.ndarray) -> None:
        self.ids: Optional[np.ndarray] = None
        self.logits = logits

    def keep(self, positions: np.ndarray) -> None:
        """Keep only the candidates at `positions` (indices into the current arrays)."""
        self.ids = positions if self.ids is None else self.ids[positions]
        self.logits = self.logits[positions]

    def token_id(self, position: int) -> int:
        return int(position if self.ids is None else self.ids[position])


class Stage:
    """One step of the chain. Stages that keep history override accept/reset."""

    name = 'stage'

    def apply(self, cand: Candidates) -> None:
        raise NotImplementedError

    def accept(self, token_id: int) -> None:
        """Record the chosen token."""

    def reset(self, prompt_ids: Sequence[int]) -> None:
        """Start a new sequence whose context is `prompt_ids`."""


class _History:
    """Counts of the last `window` tokens (0 = all), shared by the penalty stages."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._recent: Deque[int] = deque()
        self._counts: Dict[int, int] = {}
        self._ids_cache: Optional[np.ndarray] = None

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self._recent.clear()
        self._counts.clear()
        self._ids_cache = None
        tail = prompt_ids[-self.window:] if self.window else prompt_ids
        for t in tail:
            self.add(int(t))

    def add(self, token_id: int) -> None:
        self._ids_cache = None
        self._recent.append(token_id)
        self._counts[token_id] = self._counts.get(token_id, 0) + 1
        if self.window and len(self._recent) > self.window:
            old = self._recent.popleft()
            left = self._counts[old] - 1
            if left:
                self._counts[old] = left
            else:
                del self._counts[old]

    def ids(self) -> np.ndarray:
        """Distinct token ids in the window."""
        if self._ids_cache is None:
            self._ids_cache = np.fromiter(self._counts, dtype=np.int64, count=len(self._counts))
        return self._ids_cache

    def counts(self) -> np.ndarray:
        """How often each of ids() occurs in the window (same order)."""
        return np.fromiter(self._counts.values(), dtype=np.float32, count=len(self._counts))


class LogitBias(Stage):
    """Add a fixed bias to chosen tokens (OpenAI's logit_bias); -100 all but bans a token."""

    name = 'logit_bias'

    def __init__(self, pairs: Sequence[Tuple[int, float]]) -> None:
        self.ids = np.array([p[0] for p in pairs], dtype=np.int64)
        self.bias = np.array([p[1] for p in pairs], dtype=np.float32)

    def apply(self, cand: Candidates) -> None:
        cand.logits[self.ids] += self.bias  # first stage: the whole vocabulary, in id order


class RepetitionPenalty(Stage):
    """CTRL-style: divide positive logits of seen tokens by the penalty, multiply negative."""

    name = 'repetition_penalty'

    def __init__(self, penalty: float, history: _History) -> None:
        self.penalty = float(penalty)
        self._history = history

    def apply(self, cand: Candidates) -> None:
        ids = self._history.ids()
        if ids.size:
            # In float64 and capped: a penalty < 1 (down to 5e-324) raises seen logits past
            # float32's range, and an inf here would turn later max-shifts into NaN.
            # Overflow towards -inf is intended (the token gets probability 0).
            seen = cand.logits[ids].astype(np.float64)
            with np.errstate(over='ignore'):
                scaled = np.where(seen > 0, seen / self.penalty, seen * self.penalty)
                cand.logits[ids] = np.minimum(scaled, _FLOAT32_MAX)

    def accept(self, token_id: int) -> None:
        self._history.add(token_id)

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self._history.reset(prompt_ids)


class PresencePenalty(Stage):
    """OpenAI-style: subtract the penalty once from every token seen in the window."""

    name = 'presence_penalty'

    def __init__(self, penalty: float, history: _History, owns_history: bool) -> None:
        self.penalty = float(penalty)
        self._history = history
        self._owns = owns_history  # the repetition stage updates a shared history

    def apply(self, cand: Candidates) -> None:
        ids = self._history.ids()
        if ids.size:
            cand.logits[ids] -= self.penalty

    def accept(self, token_id: int) -> None:
        if self._owns:
            self._history.add(token_id)

    def reset(self, prompt_ids: Sequence[int]) -> None:
        if self._owns:
            self._history.reset(prompt_ids)


class FrequencyPenalty(PresencePenalty):
    """OpenAI-style: subtract the penalty times how often each token occurs in the window."""

    name = 'frequency_penalty'

    def apply(self, cand: Candidates) -> None:
        ids = self._history.ids()
        if ids.size:
            cand.logits[ids] -= self.penalty * self._history.counts()


class Temperature(Stage):
    """Divide logits by the temperature, relative to the best one."""

    name = 'temperature'

    def __init__(self, temperature: float) -> None:
        self.inv = 1.0 / float(temperature)

    def apply(self, cand: Candidates) -> None:
        # Shifting by the max first (softmax is shift-invariant) leaves every logit <= 0, so a
        # large 1/T can only push tokens towards -inf (probability 0), never overflow to +inf.
        logits = cand.logits
        top = float(logits.max())
        with np.errstate(over='ignore'):  # overflow here only ever gives -inf: intended
            if math.isfinite(top):  # all -inf is reported by the picker; leave it as it is
                logits -= top
            logits *= self.inv


class TopK(Stage):
    name = 'top_k'

    def __init__(self, k: int) -> None:
        self.k = int(k)

    def apply(self, cand: Candidates) -> None:
        if cand.logits.size > self.k:
            cand.keep(_top_indices(cand.logits, self.k))


class TopP(Stage):
    """Keep the smallest set of most likely tokens whose probability reaches p."""

    name = 'top_p'
    _FIRST_GUESS = 64     # real models' nuclei are usually this small
    _BAND = 4096          # sort at most about this many tokens at the nucleus edge

    def __init__(self, p: float) -> None:
        self.p = float(p)

    def apply(self, cand: Candidates) -> None:
        logits = cand.logits
        probs = np.exp(logits - logits.max())  # unnormalised, the best token has 1
        target = self.p * float(probs.sum(dtype=np.float64))
        if logits.size <= self._FIRST_GUESS:
            cand.keep(_nucleus(np.arange(logits.size), probs, 0.0, target))
            return
        top = _top_indices(logits, self._FIRST_GUESS)
        top_mass = float(probs[top].sum(dtype=np.float64))
        if top_mass >= target:
            cand.keep(_nucleus(top, probs, 0.0, target))
            return
        # Wide nucleus (flat distribution): find by bisection, in log-probability, a band
        # [lo, hi) of probabilities holding the nucleus edge, then sort only that band.
        # Invariant: mass(probs >= hi) < target <= mass(probs >= lo).
        hi = float(probs[top].min())
        lo = 0.0
        floor = hi * 1e-12
        while np.count_nonzero((probs >= lo) & (probs < hi)) > self._BAND and lo < hi:
            mid = math.sqrt(max(lo, floor) * hi)
            if mid <= floor * 1.0001:
                break  # the edge lies among negligible tokens: sort the whole band
            if float(probs[probs >= mid].sum(dtype=np.float64)) >= target:
                lo = mid
            else:
                hi = mid
        above = np.flatnonzero(probs >= hi)
        band = np.flatnonzero((probs >= lo) & (probs < hi))
        base = float(probs[above].sum(dtype=np.float64))
        cand.keep(np.concatenate([above, _nucleus(band, probs, base, target)]))


def _nucleus(ids: np.ndarray, probs: np.ndarray, base: float, target: float) -> np.ndarray:
    """Most probable prefix of `ids` whose mass, added to `base`, first reaches `target`."""
    ids = ids[np.argsort(-probs[ids], kind='stable')]
    cumulative = base + np.cumsum(probs[ids], dtype=np.float64)
    return ids[:min(int(np.searchsorted(cumulative, target)) + 1, ids.size)]


class MinP(Stage):
    """Drop tokens whose probability is below min_p times the best one's."""

    name = 'min_p'

    def __init__(self, min_p: float) -> None:
        self.log_min_p = math.log(min_p)

    def apply(self, cand: Candidates) -> None:
        # p_i / p_max = exp(l_i - l_max): compare in logit space, no softmax needed.
        keep = np.flatnonzero(cand.logits >= cand.logits.max() + self.log_min_p)
        if keep.size < cand.logits.size:
            cand.keep(keep)


class Sampler:
    """Applies the stages to each step's logits and picks one token."""

    def __init__(self, stages: List[Stage], vocab_size: int, seed: Optional[int]) -> None:
        """Greedy when `seed` is None, else a draw from a numpy Generator seeded with it."""
        self.stages = stages
        self.vocab_size = int(vocab_size)
        self.greedy = seed is None
        self.seed = seed
        self._rng = np.random.default_rng(seed)
        self._buf = np.empty(self.vocab_size, dtype=np.float32)
        self._blocked = np.empty(self.vocab_size, dtype=bool)

    def reset(self, prompt_ids: Sequence[int] = ()) -> None:
        """Start a new sequence: clear penalty history and re-seed the draw."""
        for stage in self.stages:
            stage.reset(prompt_ids)
        self._rng = np.random.default_rng(self.seed)

    def sample(self, logits: np.ndarray, allowed_mask: Optional[np.ndarray] = None) -> int:
        """Pick the next token; `allowed_mask` (bool, vocab) removes the False tokens first."""
        flat = self._flat(logits)
        if self.greedy and not self.stages and allowed_mask is None:
            return self._checked(flat, int(np.argmax(flat)))  # nothing to modify: no copy
        cand = self._candidates(flat, allowed_mask)
        best = self._checked(cand.logits, int(np.argmax(cand.logits)))
        if self.greedy:
            return cand.token_id(best)
        return cand.token_id(_draw(cand.logits, self._rng))

    def _candidates(self, logits: np.ndarray, allowed_mask: Optional[np.ndarray]) -> Candidates:
        """Return the logits after the mask and every stage (a copy: the input is left alone)."""
        np.copyto(self._buf, self._flat(logits))  # never modify the runtime-owned input
        if allowed_mask is not None:
            np.logical_not(allowed_mask, out=self._blocked)
            np.copyto(self._buf, -np.inf, where=self._blocked)
        cand = Candidates(self._buf)
        for stage in self.stages:
            stage.apply(cand)
        return cand

    def _flat(self, logits: np.ndarray) -> np.ndarray:
        flat = logits.reshape(-1)
        if flat.size != self.vocab_size:
            raise EngineError(f'logits have {flat.size} entries but the sampler was built for a '
                              f'vocabulary of {self.vocab_size}')
        return flat

    @staticmethod
    def _checked(logits: np.ndarray, best: int) -> int:
        value = logits[best]
        if value == -np.inf or value != value:  # all -inf, or NaN from the model
            raise EngineError('no token is allowed at this step (all logits are -inf or NaN); '
                              'check the constraint or the model output')
        return best

    def accept(self, token_id: int) -> None:
        """Record the token actually appended to the sequence."""
        for stage in self.stages:
            stage.accept(token_id)

    @property
    def stage_names(self) -> List[str]:
        return [s.name for s in self.stages]


def build_sampler(config: SamplingConfig, vocab_size: int,
                  penalty_window: int = DEFAULT_PENALTY_WINDOW) -> 'Sampler':
    """Validate `config` and build its chain once (greedy below GREEDY_TEMPERATURE)."""
    validate(config)
    stages: List[Stage] = []
    bias = logit_bias_items(extra(config, 'logit_bias'), vocab_size)
    if bias:
        stages.append(LogitBias(bias))
    history = _History(penalty_window)
    owner = True  # the first penalty stage keeps the shared history up to date
    if config.repetition_penalty != 1.0:
        stages.append(RepetitionPenalty(config.repetition_penalty, history))
        owner = False
    if config.presence_penalty != 0.0:
        stages.append(PresencePenalty(config.presence_penalty, history, owns_history=owner))
        owner = False
    if extra(config, 'frequency_penalty') != 0.0:
        stages.append(FrequencyPenalty(extra(config, 'frequency_penalty'), history,
                                       owns_history=owner))
    greedy = config.temperature < GREEDY_TEMPERATURE
    if not greedy:
        if config.temperature != 1.0:
            stages.append(Temperature(config.temperature))
        if config.top_k:
            stages.append(TopK(config.top_k))
        if config.top_p < 1.0:
            stages.append(TopP(config.top_p))
        if config.min_p > 0.0:
            stages.append(MinP(config.min_p))
    seed = None
    if not greedy:
        # An unset seed gets a fresh one, kept on the sampler so the run can be repeated.
        seed = config.seed if config.seed is not None else int(
            np.random.SeedSequence().generate_state(1, dtype=np.uint64)[0] >> 1)
    if extra(config, 'logprobs') or extra(config, 'top_logprobs'):
        return LogprobSampler(stages, vocab_size, seed, extra(config, 'top_logprobs'))
    return Sampler(stages, vocab_size, seed)


@dataclass(frozen=True)
class TokenLogprobs:
    """Log probability of the chosen token and the top-n (id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: Tuple[Tuple[int, float], ...] = ()


class LogprobSampler(Sampler):
    """A Sampler that also reports log probabilities of the final distribution."""

    def __init__(self, stages: List[Stage], vocab_size: int, seed: Optional[int],
                 top_n: int) -> None:
        super().__init__(stages, vocab_size, seed)
        self.top_n = int(top_n)
        self.last_logprobs: Optional[TokenLogprobs] = None

    def sample(self, logits: np.ndarray, allowed_mask: Optional[np.ndarray] = None) -> int:
        cand = self._candidates(logits, allowed_mask)
        best = self._checked(cand.logits, int(np.argmax(cand.logits)))
        pos = best if self.greedy else _draw(cand.logits, self._rng)
        values = cand.logits.astype(np.float64)
        top = float(values[best])
        log_total = top + math.log(float(np.exp(values - top).sum()))
        pairs: Tuple[Tuple[int, float], ...] = ()
        if self.top_n:
            n = min(self.top_n, values.size)
            idx = _top_indices(cand.logits, n)
            idx = idx[np.argsort(-cand.logits[idx], kind='stable')]
            pairs = tuple((cand.token_id(int(i)), float(values[i] - log_total)) for i in idx
                          if values[i] > -math.inf)
        token = cand.token_id(pos)
        self.last_logprobs = TokenLogprobs(token, float(values[pos] - log_total), pairs)
        return token


# --- helpers -----------------------------------------------------------------------------

_SAMPLE_STRIDE = 16


def _top_indices(values: np.ndarray, k: int) -> np.ndarray:
    """Return the indices of the k largest values (unordered).

    argpartition over 49k floats costs ~0.5 ms.  The k-th largest of a strided sample is a
    value that at least k entries reach (the sample is a subset), so keeping the entries at or
    above it is exact, and leaves ~16*k for a small argpartition.
    """
    n = values.size
    sample = values[::_SAMPLE_STRIDE]
    if k >= sample.size:
        return np.argpartition(values, n - k)[n - k:]
    threshold = np.partition(sample, sample.size - k)[sample.size - k]
    pool = np.flatnonzero(values >= threshold)
    if pool.size > k:
        pool = pool[np.argpartition(values[pool], pool.size - k)[pool.size - k:]]
    return pool


_BLOCK = 256


def _draw(logits: np.ndarray, rng: np.random.Generator) -> int:
    """Draw a position with probability softmax(logits), by inverse CDF."""
    weights = np.exp(logits - logits.max())
    u = rng.random()
    n = weights.size
    if n <= 4 * _BLOCK:
        cdf = np.cumsum(weights, dtype=np.float64)
        pos = int(np.searchsorted(cdf, u * cdf[-1], side='right'))
    else:
        # Two-level CDF: a cumsum over 49k floats is slow, block sums + one block's are not.
        full = n - n % _BLOCK
        sums = weights[:full].reshape(-1, _BLOCK).sum(axis=1, dtype=np.float64)
        if full < n:
            sums = np.append(sums, weights[full:].sum(dtype=np.float64))
        cdf = np.cumsum(sums)
        target = u * cdf[-1]
        block = min(int(np.searchsorted(cdf, target, side='right')), cdf.size - 1)
        start = block * _BLOCK
        inner = np.cumsum(weights[start:start + _BLOCK], dtype=np.float64)
        before = cdf[block - 1] if block else 0.0
        pos = start + int(np.searchsorted(inner, target - before, side='right'))
    pos = min(pos, n - 1)
    if weights[pos] == 0.0:
        # Only reachable through rounding at a CDF edge: take the nearest possible token.
        nonzero = np.flatnonzero(weights)
        below = nonzero[nonzero <= pos]
        pos = int(below[-1]) if below.size else int(nonzero[0])
    return pos


def _real(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise InvalidSamplingError(f'{name} must be a number, not {type(value).__name__}')
    return float(value)


def _check_real(value: object, name: str, lo: float, hi: float, valid: str) -> None:
    v = _real(value, name)
    if not lo <= v <= hi:  # also rejects NaN
        raise InvalidSamplingError(f'{name}={value} is out of range: it must be {valid}')


def _check_int(value: object, name: str, valid: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidSamplingError(f'{name} must be an integer, not {type(value).__name__}')
    if value < 0:
        raise InvalidSamplingError(f'{name}={value} is out of range: it must be {valid}')
