"""Speculative decoding: draft tokens, checked by the target model in one verify pass.

Decode reads every weight once per token. A verify pass feeds the token to decode plus k
drafted tokens at once (a verify row, runtime/rows.py) and gets the logits of all k + 1
positions for
about the bytes of one step; the sequence then picks each next token from those logits with
its own sampler, exactly as plain decoding would, and keeps the drafts only while they equal
what it picked (runtime/sequence.py, Sequence.advance_verified). So:

* greedy output is plain greedy output, token for token;
* sampled output has plain sampling's distribution: a draft is a point mass q = delta(d), for
  which the standard accept/resample rule (accept d with min(1, p(d) / q(d)) = p(d), else
  draw from the residual p without d) gives exactly p; drawing x ~ p and keeping the draft
  while x == d is that rule. With the same seed it even draws the same tokens, because each
  position gets the same logits and the same random draw as without speculation.

Both need a verify pass to give each position the bits a one-token decode step gives it:
the folder must be row-exact (OnnxDecoder.row_exact: the op library's CausalAttention and
KQuantMatMul compute every position alone). onnxruntime's GroupQueryAttention and MLAS
matmuls take other kernels for one row than for several, so a MatMulNBits folder cannot
speculate exactly; configure refuses it (auto mode stays off and says why).

Drafters, chosen once per engine (SpeculativeConfig.mode):

* grammar fast-forward (every mode): the tokens a constraint forces next (llguidance's
  compute_ff_tokens) come first in every draft;
* prompt lookup: the continuation of the latest earlier occurrence of the context's last
  n-gram (prompt plus output so far), n from ngram_max down to ngram_min;
* draft model: a second, smaller converted folder with the same tokenizer, decoding its
  greedy continuation with its own KV, one slot per target slot; the drafts of a step's
  speculating goals are rows of its own batched calls.

The draft length adapts to recent acceptance and to what a pass costs: the engine measures
at load cost[k], the time of a (k + 1)-position verify pass over a 1-position step, and each
sequence keeps a running acceptance rate a of its drafted tokens; a draft is cut to the k
that maximizes the expected tokens per pass over its cost, (1 + a + ... + a^k) / cost[k].
Auto mode also turns speculation off for a sequence whose tokens per pass, over its passes so
far, fall below what those passes cost (break-even).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from edge_llm_ros.model_format import load_model_info
from edge_llm_ros.runtime.decoder import OnnxDecoder
from edge_llm_ros.runtime.rows import decode_row, Row
from edge_llm_ros.runtime.speculative_config import (SPECULATIVE_MODES, SpeculativeConfig,
                                                     SpeculativeConfigError)
from edge_llm_ros.runtime.tokenizer import TextTokenizer

__all__ = ['build_speculation', 'DraftAsk', 'DraftModel', 'measure_break_even', 'NgramIndex',
           'SPECULATIVE_MODES', 'Speculation', 'SpeculationStats', 'SpeculativeConfig',
           'SpeculativeConfigError', 'Speculator']


class NgramIndex:
    """The latest continuation of every n-gram of a growing token list (prompt lookup)."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.tokens: List[int] = []
        self._sizes = tuple(range(n_max, n_min - 1, -1))
        # n -> n-gram -> index of the token that followed its latest occurrence
        self._next: Dict[int, Dict[Tuple[int, ...], int]] = {n: {} for n in self._sizes}

    def extend(self, tokens: Sequence[int]) -> None:
        toks = self.tokens
        for t in tokens:
            j = len(toks)          # t's index: it continues the n-grams ending at j - 1
            for n in self._sizes:
                if j >= n:
                    self._next[n][tuple(toks[j - n:j])] = j
            toks.append(int(t))

    def draft(self, k: int, after: Sequence[int] = ()) -> List[int]:
        """Up to k tokens that followed the list's last n-gram earlier ([] if none).

        after: tokens about to follow the list (forced ones): the n-gram ends with them.
        """
        toks = self.tokens
        suffix = toks[max(len(toks) - self._sizes[0], 0):] + list(after)
        for n in self._sizes:
            if len(suffix) < n:
                continue
            start = self._next[n].get(tuple(suffix[len(suffix) - n:]))
            if start is not None:
                return toks[start:start + k]
        return []


class DraftModel:
    """A second decoder, one slot per target slot, that drafts greedy continuations.

    Slot i's KV holds the tokens in `_fed[i]`; a new context reuses their common prefix, so
    after a verify pass only the accepted tokens are fed, and a rejection is a shorter prefix.
    The drafts of every speculating goal of a step are rows of its own batched calls: one
    call catches each slot up with its context, then one call per drafted token.

    A hybrid draft model (lfm2) has conv states, which hold the last fed position only: each
    slot keeps a copy of them after every row it ran since its last catch-up (a few KB each,
    at most max_draft + 1), so a rejection goes back to one of those positions.
    """

    def __init__(self, decoder) -> None:
        self._decoder = decoder
        self._fed: List[List[int]] = [[] for _ in range(decoder.slots)]
        self._kept: List[Dict[int, List[np.ndarray]]] = [{} for _ in range(decoder.slots)]
        self._states = [decoder.slot_states(slot) for slot in range(decoder.slots)]

    @property
    def capacity(self) -> int:
        return self._decoder.capacity

    def draft_rows(self, asks: Dict[int, Tuple[Sequence[int], int]]) -> Dict[int, List[int]]:
        """Draft k tokens after each slot's context: {slot: (context, k)} -> {slot: tokens}."""
        dec = self._decoder
        out: Dict[int, List[int]] = {slot: [] for slot in asks}
        want: Dict[int, int] = {}
        rows = []
        for slot, (context, k) in asks.items():
            if k < 1 or len(context) + k > dec.capacity:
                continue
            fed = self._fed[slot]
            n = 0
            limit = min(len(fed), len(context) - 1)   # the last context token is fed now
            while n < limit and fed[n] == context[n]:
                n += 1
            n = self._rewind_states(slot, n)
            del fed[n:]
            rows.append(Row(slot, n, np.asarray(context[n:], dtype=np.int64)))
            fed.extend(int(t) for t in context[n:])
            want[slot] = k
        while rows:
            logits = dec.run(rows)
            self._keep_states(rows)
            follow = []
            for i, row in enumerate(rows):
                token = int(np.argmax(logits[i]))
                got = out[row.slot]
                got.append(token)
                if len(got) < want[row.slot]:   # the last drafted token is never fed
                    fed = self._fed[row.slot]
                    follow.append(decode_row(row.slot, token, len(fed)))
                    fed.append(token)
            rows = follow
        return out

    def _rewind_states(self, slot: int, n: int) -> int:
        """Return the position slot continues from (<= n): one its conv states were kept at.

        The kept copies are dropped: the catch-up row starts at or after each one still needed.
        """
        kept = self._kept[slot]
        if self._states[slot] and n < len(self._fed[slot]):
            n = max((m for m in kept if m <= n), default=0)   # 0: a row there reads zeros
            for dst, src in zip(self._states[slot], kept.get(n, ())):
                dst[...] = src
        kept.clear()
        return n

    def _keep_states(self, rows: Sequence[Row]) -> None:
        for row in rows:
            if self._states[row.slot]:
                self._kept[row.slot][row.start + row.length] = [
                    s.copy() for s in self._states[row.slot]]


@dataclass
class DraftAsk:
    """One sequence's next draft in the making: the forced head and the drafter's share."""

    speculator: 'Speculator'
    head: List[int]   # tokens a constraint forces next (they come first)
    want: int         # drafter tokens to follow them


def check_same_tokenizer(target, draft, draft_dir: str) -> None:
    """Raise SpeculativeConfigError naming the first ids whose tokens differ."""
    a = target.hf_tokenizer.get_vocab()
    b = draft.hf_tokenizer.get_vocab()
    by_id_a = {i: t for t, i in a.items()}
    by_id_b = {i: t for t, i in b.items()}
    differ = [i for i in sorted(set(by_id_a) | set(by_id_b))
              if by_id_a.get(i) != by_id_b.get(i)]
    if differ:
        shown = ', '.join(f'{i}: {by_id_a.get(i)!r} vs {by_id_b.get(i)!r}' for i in differ[:5])
        raise SpeculativeConfigError(
            f'speculative.draft_model {draft_dir} has another tokenizer than the model '
            f'({len(differ)} ids differ; first: {shown}): a draft model must share the '
            "target's vocabulary")


def measure_break_even(decoder, max_draft: int, repeats: int = 3) -> List[float]:
    """Return cost[k] = time of a (k + 1)-position verify pass / a 1-position decode step.

    Measured at load on positions 1.. of slot 0 (before any request: they are overwritten).
    """
    ids = [1] * (max_draft + 1)

    def best(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    decoder.run([decode_row(0, 1, 0)])
    one = best(lambda: decoder.run([decode_row(0, 1, 1)]))
    cost = [1.0]
    for k in range(1, max_draft + 1):
        verify = Row(0, 1, np.array(ids[:k + 1], dtype=np.int64), logits=k + 1)
        cost.append(best(lambda: decoder.run([verify])) / one)
    return cost


@dataclass
class SpeculationStats:
    """Totals of one sequence (Timings) or of the engine (metrics, diagnostics)."""

    passes: int = 0      # verify passes
    drafted: int = 0     # draft tokens fed to them
    accepted: int = 0    # draft tokens kept

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return (self.accepted + self.passes) / self.passes if self.passes else 0.0


class Speculation:
    """The engine's drafting setup (made once at load) and its totals."""

    def __init__(self, config: SpeculativeConfig, row_exact: bool,
                 draft_model: Optional[DraftModel] = None,
                 cost: Optional[List[float]] = None, why_off: str = '') -> None:
        self.config = config
        self.draft_model = draft_model
        self.cost = cost or []
        self.stats = SpeculationStats()
        self.why_off = why_off
        self.enabled = config.mode != 'off' and row_exact and not why_off

    def start(self, prompt_ids: Sequence[int]) -> Optional['Speculator']:
        """Return the drafting state of a new sequence (None: it decodes plainly)."""
        if not self.enabled:
            return None
        return Speculator(self, prompt_ids)

    def draft(self, asks: Dict[int, DraftAsk]) -> Dict[int, List[int]]:
        """Complete the drafts of a step's speculating goals, {slot: ask} -> {slot: draft}.

        With a draft model its passes over every slot that asks are rows of its own calls.
        """
        model = self.draft_model
        if model is None:
            return {slot: ask.head + ask.speculator.lookup(ask.want, ask.head)
                    for slot, ask in asks.items()}
        got = model.draft_rows({slot: (ask.speculator.context + ask.head, ask.want)
                                for slot, ask in asks.items() if ask.want > 0})
        return {slot: ask.head + got.get(slot, []) for slot, ask in asks.items()}


class Speculator:
    """One sequence's drafts: its context index, draft length and auto-mode judgement."""

    def __init__(self, owner: Speculation, prompt_ids: Sequence[int]) -> None:
        cfg = owner.config
        self._owner = owner
        self._cfg = cfg
        self._index = NgramIndex(cfg.ngram_min, cfg.ngram_max)
        self._index.extend(prompt_ids)
        self._rate = 0.6       # running acceptance of drafted tokens
        self._auto = cfg.mode == 'auto'
        self.stats = SpeculationStats()
        self._gain = 0.0       # auto: tokens made and pass cost of this sequence's passes
        self._spent = 0.0
        self.off = False

    def _length(self) -> int:
        """Draft length with the best expected tokens per cost of a pass (>= 1)."""
        cost, top = self._owner.cost, self._cfg.max_draft
        if len(cost) <= top:
            return top
        a, best, best_k, made = self._rate, 0.0, 1, 1.0
        for k in range(1, top + 1):
            made += a ** k
            if made / cost[k] > best:
                best, best_k = made / cost[k], k
        return best_k

    def add(self, tokens: Sequence[int]) -> None:
        """Append tokens the sequence emitted (its context grows)."""
        self._index.extend(tokens)

    @property
    def context(self) -> List[int]:
        """Return the sequence's tokens so far (prompt, then output)."""
        return self._index.tokens

    def ask(self, forced: Sequence[int], room: int) -> Optional[DraftAsk]:
        """Return the next draft's shape: forced tokens first, then the drafter's (<= room).

        None: no draft now (off, or no room). Speculation.draft completes it.
        """
        if self.off or room < 1:
            return None
        k = min(self._length(), room)
        head = list(forced[:k])
        return DraftAsk(self, head, k - len(head))

    def lookup(self, k: int, after: Sequence[int]) -> List[int]:
        """Up to k prompt-lookup tokens after the context and `after`."""
        return self._index.draft(k, after=after) if k > 0 else []

    def observe(self, drafted: int, accepted: int) -> None:
        """Take a verify pass's outcome: adapt the draft length, judge auto mode."""
        for stats in (self.stats, self._owner.stats):
            stats.passes += 1
            stats.drafted += drafted
            stats.accepted += accepted
        if drafted:
            self._rate = 0.7 * self._rate + 0.3 * accepted / drafted
        if self._auto:
            cost = self._owner.cost
            self._gain += accepted + 1
            self._spent += cost[min(drafted, len(cost) - 1)] if cost else 1.0
            if self.stats.passes >= self._cfg.auto_probe and self._gain < self._spent:
                self.off = True   # below break-even: plain decoding for the rest


def build_speculation(config: SpeculativeConfig, decoder, tokenizer, model_dir: str,
                      session) -> Speculation:
    """Set up speculation for an engine's decoder (configure errors are typed and explain).

    session: the target's SessionConfig; a draft model runs with the same providers, threads
    and kernels, one slot of the same capacity.
    """
    config.check()
    if config.mode == 'off':
        return Speculation(config, decoder.row_exact)
    if not decoder.row_exact:
        why = (f'{model_dir} is not row-exact (model.yaml attention '
               f'{decoder.info.attention!r}, op domains {list(decoder.info.op_domains)}): its '
               'verify pass would not give a position the bits a decode step gives it, so '
               'speculation could change the output; reconvert it with `edge-llm-convert '
               '--weights kquant` (needs the op library) to speculate')
        if config.mode == 'auto':
            return Speculation(config, False, why_off=why)
        raise SpeculativeConfigError(f'speculative.mode {config.mode}: {why}')
    draft = None
    if config.draft_model and config.mode in ('draft', 'auto'):
        # One draft slot per target slot: every speculating goal drafts in its own.
        draft = DraftModel(_load_draft(config.draft_model, decoder, tokenizer,
                                       # the draft's own KV stays float32
                                       replace(session, slots=decoder.slots,
                                               kv_dtype='float32')))
    return Speculation(config, True, draft, measure_break_even(decoder, config.max_draft))


def _load_draft(folder: str, target: OnnxDecoder, tokenizer: TextTokenizer,
                session) -> OnnxDecoder:
    info = load_model_info(folder)
    check_same_tokenizer(tokenizer, TextTokenizer.from_dir(folder), folder)
    if info.vocab_size != target.info.vocab_size:
        raise SpeculativeConfigError(
            f'speculative.draft_model {folder} has {info.vocab_size} logits, the model '
            f'{target.info.vocab_size}: a draft model must share the vocabulary')
    return OnnxDecoder(folder, info, session)
