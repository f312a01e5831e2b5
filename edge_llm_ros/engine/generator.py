"""The prefill/decode loop: a Generation is an iterator of TokenEvent.

The model runs in the thread that iterates. ``cancel()`` may come from any thread: it sets an
Event that the loop checks once per step (and between prefill chunks), so the generation stops
within one step with StopReason.CANCELLED.

Event/result conventions:
* An EOS token ends the generation with StopReason.STOP; it gets an event (its id, and as text
  whatever the detokenizer still held back) and counts as a completion token.
* ``result.text`` is always the concatenation of the events' ``text_delta``; a stop string and
  what follows it are not part of it.
* Timings: TTFT counts from the call to ``Engine.generate``; prefill tok/s counts only the
  positions actually computed (``cached_prompt_tokens`` were reused); decode tok/s is decode
  steps per second of the engine's own time (what the consumer does between events is not
  counted).
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np

from edge_llm_ros.engine.kv_cache import KVCache
from edge_llm_ros.engine.model import OnnxDecoder
from edge_llm_ros.engine.request import PreparedRequest, split_chunks
from edge_llm_ros.engine.sampling import build_sampler
from edge_llm_ros.engine.stop import StopMatcher
from edge_llm_ros.engine.tokenizer import TextTokenizer
from edge_llm_ros.engine.types import GenerationResult, StopReason, Timings, TokenEvent


# Prompt positions always recomputed on prefix reuse. onnxruntime's MatMulNBits runs one row
# (M=1) through another kernel than several rows (int8 activations at accuracy_level 4), so a
# single recomputed position can get logits ~1.0 away from a cold prefill's; two or more rows
# take the prefill kernel and give a reused prefix the cold run's exact logits.
RECOMPUTE = 2


class Generation:
    """One running generation (see the module docstring). Not thread-safe except cancel()."""

    def __init__(self, decoder: OnnxDecoder, cache: KVCache, tokenizer: TextTokenizer,
                 prepared: PreparedRequest, prefill_chunk: int, lock: threading.RLock,
                 t0: float, on_end: Optional[Callable[['Generation'], None]] = None) -> None:
        self._decoder = decoder
        self._cache = cache
        self._tokenizer = tokenizer
        self._req = prepared
        self._chunk = prefill_chunk
        self._lock = lock
        self._t0 = t0
        self._on_end = on_end
        self._cancel = threading.Event()
        self._steps = self._run()
        self._deltas: List[str] = []
        self._ids: List[int] = []
        self._reason = StopReason.LENGTH
        self._timing = {'prefill_tokens': 0, 'cached': 0, 'ttft': 0.0, 'prefill_s': 0.0,
                        'decode_steps': 0, 'decode_s': 0.0}
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._stream = None
        self._matcher = None
        self._constraint_state = None
        self.result: Optional[GenerationResult] = None

    # --- public ------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop at the next step boundary (thread-safe)."""
        self._cancel.set()

    def __iter__(self) -> Iterator[TokenEvent]:
        return self

    def __next__(self) -> TokenEvent:
        if self.result is not None:
            raise StopIteration
        with self._lock:
            try:
                return next(self._steps)
            except StopIteration:
                self._finish()
                raise
            except Exception as e:  # a runtime failure ends the generation, never the caller
                self._cache.reset()  # its contents beyond the last commit are unknown
                self._finish(f'{type(e).__name__}: {e}')
                raise StopIteration from None
            except BaseException:  # KeyboardInterrupt/SystemExit: end cleanly, then let it go
                self._cache.reset()
                self._reason = StopReason.CANCELLED
                self._finish()
                raise

    def run_to_end(self) -> GenerationResult:
        """Consume every event and return the result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def abandon(self) -> None:
        """End a generation that will not be iterated further (result: CANCELLED)."""
        if self.result is None:
            self._cancel.set()
            self._steps.close()
            self._reason = StopReason.CANCELLED
            self._finish()

    # --- the loop ----------------------------------------------------------------------------
    def _prefill(self) -> Optional[np.ndarray]:
        """Fill the cache with the prompt; returns the last position's logits (None: cancelled)."""
        req, cache, dec = self._req, self._cache, self._decoder
        reused = cache.plan(req.keys, req.session_id, recompute=RECOMPUTE)
        n_emb = 0 if req.embeds is None else req.embeds.shape[0]
        total = len(req.keys)
        logits = None
        t = time.perf_counter()
        for a, b in split_chunks(total, reused, self._chunk):
            if self._cancel.is_set():
                return None
            embeds = req.embeds[a:b] if a < n_emb else None
            ids = np.asarray(req.prompt_ids[max(a - n_emb, 0):max(b - n_emb, 0)], dtype=np.int64)
            logits = dec.forward(ids, embeds, a)
            cache.append(req.keys[a:b])
        tm = self._timing
        tm['prefill_s'] = time.perf_counter() - t
        tm['prefill_tokens'] = total - reused
        tm['cached'] = reused
        return logits

    def _run(self) -> Iterator[TokenEvent]:
        req, cache, dec, tm = self._req, self._cache, self._decoder, self._timing
        if self._cancel.is_set():
            self._reason = StopReason.CANCELLED
            return
        logits = self._prefill()
        if logits is None:
            self._reason = StopReason.CANCELLED
            return
        pick = self._picker(logits.shape[0])
        self._stream = self._tokenizer.new_stream()
        self._matcher = StopMatcher(req.stop)
        cancel, perf = self._cancel, time.perf_counter
        # prepare() checked prompt + max_tokens <= capacity; the min() only guards it.
        budget = min(req.max_tokens, cache.room() + 1)
        pos = cache.length
        token = pick(logits)
        tm['ttft'] = perf() - self._t0
        for index in range(budget):
            if index:  # one decode step: feed the previous token, pick the next
                if cancel.is_set():
                    self._reason = StopReason.CANCELLED
                    return
                t = perf()
                logits = dec.decode(token, pos)
                cache.append_token(token)
                pos += 1
                token = pick(logits)
                tm['decode_s'] += perf() - t
                tm['decode_steps'] += 1
            text, reason = self._text_of(token, index + 1 == budget)
            self._ids.append(token)
            self._deltas.append(text)
            yield TokenEvent(token, text, index, perf() - self._t0)
            if reason is not None:
                self._reason = reason
                return

    def _picker(self, vocab: int) -> Callable[[np.ndarray], int]:
        """Return pick(logits) -> token: sampler chain, under the JSON mask when constrained."""
        sampler = build_sampler(self._req.sampling, vocab)
        sampler.reset(self._req.prompt_ids)
        if self._req.constraint is None:
            def pick(logits: np.ndarray) -> int:
                token = sampler.sample(logits)
                sampler.accept(token)
                return token
            return pick
        state = self._req.constraint.start()
        self._constraint_state = state
        mask = np.ones(vocab, dtype=bool)

        def pick_constrained(logits: np.ndarray) -> int:
            state.fill_mask(mask)
            token = sampler.sample(logits, mask)
            sampler.accept(token)
            state.accept(token)
            return token
        return pick_constrained

    def _text_of(self, token: int, last: bool) -> Tuple[str, Optional[StopReason]]:
        """Text delta of one token, and the stop reason when this token ends the generation."""
        stream, matcher = self._stream, self._matcher
        reason = None
        if token in self._eos:
            reason, delta = StopReason.STOP, stream.flush()  # EOS itself adds no text
        else:
            delta = stream.push(token)
            state = self._constraint_state
            if state is not None and state.is_finished():
                reason = StopReason.STOP
            elif last:
                reason = StopReason.LENGTH
            if reason is not None:
                delta += stream.flush()
        text, stopped = matcher.feed(delta)
        if stopped:
            return text, StopReason.STOP
        if reason is not None:
            text += matcher.flush()
        return text, reason

    # --- end ---------------------------------------------------------------------------------
    def _finish(self, error: str = '') -> None:
        tm = self._timing
        prefill_tps = tm['prefill_tokens'] / tm['prefill_s'] if tm['prefill_s'] > 0 else 0.0
        decode_tps = tm['decode_steps'] / tm['decode_s'] if tm['decode_s'] > 0 else 0.0
        timings = Timings(time_to_first_token_s=tm['ttft'],
                          prefill_tokens=tm['prefill_tokens'],
                          cached_prompt_tokens=tm['cached'],
                          prefill_tokens_per_second=prefill_tps,
                          decode_tokens_per_second=decode_tps,
                          total_s=time.perf_counter() - self._t0)
        reason = StopReason.ERROR if error else self._reason
        self.result = GenerationResult(text=''.join(self._deltas), token_ids=list(self._ids),
                                       stop_reason=reason,
                                       prompt_tokens=self._req.prompt_tokens,
                                       completion_tokens=len(self._ids), timings=timings,
                                       error=error)
        if self._on_end is not None:
            self._on_end(self)
