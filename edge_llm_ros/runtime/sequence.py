"""The prefill/decode loop: a Generation is an iterator of TokenEvent.

The model runs in the thread that iterates. ``cancel()`` may come from any thread: it sets an
Event that the loop checks once per step (and between prefill chunks), so the generation stops
within one step with StopReason.CANCELLED.

Event/result conventions:
* An EOS token ends the generation with StopReason.STOP; it gets an event (its id, and as text
  whatever the detokenizer still held back) and counts as a completion token.
* ``result.text`` is always the concatenation of the events' ``text_delta``; a stop string and
  what follows it are not part of it.
* Output with structure (a request with tools, or a model with reasoning tags; see
  structured.OutputPlan) goes through an OutputPipeline per generation: ``text_delta`` is only
  the user-visible answer, reasoning comes as ``reasoning_delta`` and tool calls as
  ``tool_call_deltas`` (``result.reasoning`` joins the former, ``result.tool_calls`` holds
  the parsed calls). Stop strings apply to the user-visible text only. A generation that
  made tool calls and stopped (EOS, end of the constraint or a stop string) ends with
  StopReason.TOOL_CALLS. A spent reasoning budget forces the close tag: those tokens are
  fed instead of sampled, yet still go through the sampler's history and the constraint.
* Logprobs (SamplingConfig.logprobs / top_logprobs): each event carries the sampler's
  TokenLogprobs; a forced token has log probability 0 (it was certain).
* Every choice (logprobs or not, constraint or not, pipeline or not) is made once when the
  generation starts: the per-token path of a plain request is what it always was.
* Drivers: the per-sequence logic (prefix planning, prefill chunks, sampling, constraints,
  output pipeline, stop strings, logprobs, timings) lives in the driver methods ``begin`` /
  ``prefill_chunk`` / ``first`` / ``advance`` / ``fail``. Iterating a Generation drives them
  alone (one decode per step); engine.scheduler drives many at once, batching their decode
  steps into one model call (docs/batching.md).
* Timings: TTFT counts from the call to ``Engine.generate``; prefill tok/s counts only the
  positions actually computed (``cached_prompt_tokens`` were reused); decode tok/s is decode
  steps per second of the engine's own time (what the consumer does between events is not
  counted).
"""
from __future__ import annotations

from collections import deque
import threading
import time
from typing import Callable, Deque, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from edge_llm_ros.runtime.decoder import OnnxDecoder
from edge_llm_ros.runtime.kv_cache import KVCache
from edge_llm_ros.runtime.request import PreparedRequest, split_chunks
from edge_llm_ros.runtime.sampling import build_sampler, LogprobSampler, Sampler, TokenLogprobs
from edge_llm_ros.runtime.stop import StopMatcher
from edge_llm_ros.runtime.structured import OutputPipeline
from edge_llm_ros.runtime.tokenizer import TextTokenizer
from edge_llm_ros.runtime.types import GenerationResult, StopReason, Timings, TokenEvent

Picker = Callable[[np.ndarray], int]


# Prompt positions always recomputed on prefix reuse. onnxruntime's MatMulNBits runs one row
# (M=1) through another kernel than several rows (int8 activations at accuracy_level 4), so a
# single recomputed position can get logits ~1.0 away from a cold prefill's; two or more rows
# take the prefill kernel and give a reused prefix the cold run's exact logits.
RECOMPUTE = 2


class Generation:
    """One running generation (see the module docstring). Not thread-safe except cancel()."""

    def __init__(self, decoder: OnnxDecoder, cache: KVCache, tokenizer: TextTokenizer,
                 prepared: PreparedRequest, prefill_chunk: int, lock: threading.RLock,
                 t0: float, on_end: Optional[Callable[['Generation'], None]] = None,
                 eos: Iterable[int] = (), slot: int = 0) -> None:
        self._decoder = decoder
        self._cache = cache
        self.slot = slot  # the decoder slot whose KV this generation writes (see move_to)
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
        # The model's EOS ids and the family's other end-of-turn tokens (see Engine).
        self._eos = frozenset(eos or tokenizer.eos_token_ids)
        self._stream = None
        self._matcher = None
        self._constraint_state = None
        self._pipeline: Optional[OutputPipeline] = None
        self._reasoning: List[str] = []
        self._logprobs: List[TokenLogprobs] = []
        self._last_logprobs: Optional[TokenLogprobs] = None
        self.result: Optional[GenerationResult] = None
        # Decode state (set by first()): the token to feed next at position pos.
        self.token = 0
        self.pos = 0
        self.done = False
        self._index = 0
        self._budget = 0
        self._pick: Optional[Picker] = None
        self._emit = self._emit_plain

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
    def _run(self) -> Iterator[TokenEvent]:
        """Drive this generation alone: prefill every chunk, then one decode per step."""
        cancel = self._cancel
        chunks = self.begin() if not cancel.is_set() else None
        logits = None
        for a, b in chunks or ():
            if cancel.is_set():
                break
            logits = self.prefill_chunk(a, b)
        if cancel.is_set():
            self._reason = StopReason.CANCELLED
            return
        event = self.first(logits)
        if event is not None:
            yield event
        dec, perf = self._decoder, time.perf_counter
        while not self.done:
            if cancel.is_set():
                self._reason = StopReason.CANCELLED
                return
            t = perf()
            yield self.advance(dec.decode(self.token, self.pos), t)

    # --- driver API (the solo loop above, or engine.scheduler) --------------------------------
    def move_to(self, cache: KVCache, slot: int) -> None:
        """Continue in another slot whose cache now holds this generation's positions."""
        self._cache = cache
        self.slot = slot

    def begin(self) -> List[Tuple[int, int]]:
        """Plan prefix reuse in the cache; return the prompt chunks (a, b) still to prefill."""
        req, tm = self._req, self._timing
        reused = self._cache.plan(req.keys, req.session_id, recompute=RECOMPUTE)
        tm['cached'] = reused
        return list(split_chunks(len(req.keys), reused, self._chunk))

    def prefill_chunk(self, a: int, b: int) -> np.ndarray:
        """Prefill prompt positions a..b-1 in this generation's slot; returns the logits view."""
        req = self._req
        t = time.perf_counter()
        n_emb = 0 if req.embeds is None else req.embeds.shape[0]
        embeds = req.embeds[a:b] if a < n_emb else None
        ids = np.asarray(req.prompt_ids[max(a - n_emb, 0):max(b - n_emb, 0)], dtype=np.int64)
        logits = self._decoder.forward(ids, embeds, a, self.slot)
        self._cache.append(req.keys[a:b])
        tm = self._timing
        tm['prefill_s'] += time.perf_counter() - t
        tm['prefill_tokens'] += b - a   # positions actually computed
        return logits

    def first(self, logits: np.ndarray) -> Optional[TokenEvent]:
        """Set up the output side and pick the first token from the prompt's last logits.

        Returns its event (None when the budget allows no token at all).
        """
        req, cache = self._req, self._cache
        plan = req.output
        if plan.tool_format is not None or plan.reasoning is not None:
            self._pipeline = plan.start()
        self._pick = self._picker(logits.shape[0])
        # Tool-call markers may be special tokens (Mistral's [TOOL_CALLS]): keep them as text
        # for the parser, which takes them out of the answer.
        self._stream = self._tokenizer.new_stream(skip_special_tokens=plan.tool_format is None)
        self._matcher = StopMatcher(req.stop)
        self._emit = self._emit_split if self._pipeline is not None else self._emit_plain
        # prepare() checked prompt + max_tokens <= capacity; the min() only guards it.
        self._budget = min(req.max_tokens, cache.room() + 1)
        self.pos = cache.length
        self.token = self._pick(logits)
        self._timing['ttft'] = time.perf_counter() - self._t0
        if self._budget < 1:
            self.done = True
            return None
        return self._emit_token()

    def advance(self, logits: np.ndarray, t: float) -> TokenEvent:
        """Take the logits of feeding `token` at `pos`; pick and emit the next token.

        t: perf_counter time when that model call started (decode timing).
        """
        self._cache.append_token(self.token)
        self.pos += 1
        self.token = self._pick(logits)
        tm = self._timing
        tm['decode_s'] += time.perf_counter() - t
        tm['decode_steps'] += 1
        return self._emit_token()

    def _emit_token(self) -> TokenEvent:
        index = self._index
        event, reason = self._emit(self.token, index, index + 1 == self._budget)
        self._ids.append(self.token)
        self._index = index + 1
        if reason is not None:
            self._reason = reason
            self.done = True
        return event

    def end(self, reason: Optional[StopReason] = None) -> None:
        """Finish now (a driver's call): with `reason` if given, else the one reached."""
        if self.result is None:
            if reason is not None:
                self._reason = reason
            self._steps.close()
            self._finish()

    def fail(self, exc: BaseException) -> None:
        """End with ERROR after a runtime failure; the slot's cache contents are unknown."""
        if self.result is None:
            self._cache.reset()
            self._steps.close()
            self._finish(f'{type(exc).__name__}: {exc}')

    def _picker(self, vocab: int) -> Picker:
        """Return pick(logits) -> token: sampler chain, under the mask when constrained.

        Logprob recording and the reasoning budget's forced tokens wrap it only when asked.
        """
        req = self._req
        sampler = build_sampler(req.sampling, vocab)
        sampler.reset(req.prompt_ids)
        state = req.constraint.start() if req.constraint is not None else None
        self._constraint_state = state
        if state is None:
            def pick(logits: np.ndarray) -> int:
                token = sampler.sample(logits)
                sampler.accept(token)
                return token
        else:
            mask = np.ones(vocab, dtype=bool)

            def pick(logits: np.ndarray) -> int:
                state.fill_mask(mask)
                token = sampler.sample(logits, mask)
                sampler.accept(token)
                state.accept(token)
                return token
        if isinstance(sampler, LogprobSampler):
            pick = self._recording(pick, sampler)
        plan = req.output
        if plan.reasoning is not None and plan.reasoning_budget is not None:
            pick = self._forcing(pick, sampler, state)
        return pick

    def _recording(self, pick: Picker, sampler: LogprobSampler) -> Picker:
        """Wrap pick to keep the sampler's TokenLogprobs of every picked token."""
        record = self._logprobs.append

        def pick_recorded(logits: np.ndarray) -> int:
            token = pick(logits)
            self._last_logprobs = sampler.last_logprobs
            record(sampler.last_logprobs)
            return token
        return pick_recorded

    def _forcing(self, pick: Picker, sampler: Sampler, state) -> Picker:
        """Wrap pick to feed the reasoning close tag once the pipeline says the budget is spent.

        Forced tokens skip the draw but not the bookkeeping: the penalties' history and the
        constraint see them like sampled ones (the constraint must allow them).
        """
        queue: Deque[int] = deque()
        forced_tokens = self._pipeline.forced_tokens
        top_n = sampler.top_n if isinstance(sampler, LogprobSampler) else None
        record = self._logprobs.append

        def pick_forcing(logits: np.ndarray) -> int:
            if not queue:
                queue.extend(forced_tokens())
                if not queue:
                    return pick(logits)
            token = queue.popleft()
            sampler.accept(token)
            if state is not None:
                state.accept(token)
            if top_n is not None:
                self._last_logprobs = TokenLogprobs(token, 0.0, ((token, 0.0),) if top_n else ())
                record(self._last_logprobs)
            return token
        return pick_forcing

    def _emit_plain(self, token: int, index: int,
                    last: bool) -> Tuple[TokenEvent, Optional[StopReason]]:
        """Event of one token when all output is text."""
        text, reason = self._text_of(token, last)
        self._deltas.append(text)
        return TokenEvent(token, text, index, time.perf_counter() - self._t0,
                          logprobs=self._last_logprobs), reason

    def _emit_split(self, token: int, index: int,
                    last: bool) -> Tuple[TokenEvent, Optional[StopReason]]:
        """Event of one token through the output pipeline: text, reasoning and call deltas."""
        raw, reason = self._raw_text_of(token, last)
        pipeline = self._pipeline
        out = pipeline.feed(raw)
        text, reasoning, calls = out.text, out.reasoning, out.tool_calls
        if reason is not None:
            end = pipeline.finish()
            text, reasoning, calls = text + end.text, reasoning + end.reasoning, \
                calls + end.tool_calls
        shown, stopped = self._matcher.feed(text)
        if stopped:
            reason = StopReason.STOP
        elif reason is not None:
            shown += self._matcher.flush()
        self._deltas.append(shown)
        self._reasoning.append(reasoning)
        return TokenEvent(token, shown, index, time.perf_counter() - self._t0, reasoning,
                          calls, self._last_logprobs), reason

    def _raw_text_of(self, token: int, last: bool) -> Tuple[str, Optional[StopReason]]:
        """Model text of one token (before stop strings), and whether it ends the output."""
        stream = self._stream
        if token in self._eos:
            return stream.flush(), StopReason.STOP  # EOS itself adds no text
        delta = stream.push(token)
        state = self._constraint_state
        if state is not None and state.is_finished():
            return delta + stream.flush(), StopReason.STOP
        if last:
            return delta + stream.flush(), StopReason.LENGTH
        return delta, None

    def _text_of(self, token: int, last: bool) -> Tuple[str, Optional[StopReason]]:
        """Text delta of one token, and the stop reason when this token ends the generation."""
        delta, reason = self._raw_text_of(token, last)
        text, stopped = self._matcher.feed(delta)
        if stopped:
            return text, StopReason.STOP
        if reason is not None:
            text += self._matcher.flush()
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
        pipeline = self._pipeline
        calls = pipeline.tool_calls if pipeline is not None else []
        if reason is StopReason.STOP and calls:
            reason = StopReason.TOOL_CALLS
        self.result = GenerationResult(
            text=''.join(self._deltas), token_ids=list(self._ids), stop_reason=reason,
            prompt_tokens=self._req.prompt_tokens, completion_tokens=len(self._ids),
            timings=timings, error=error, reasoning=''.join(self._reasoning), tool_calls=calls,
            invalid_tool_calls=pipeline.invalid_tool_calls if pipeline is not None else [],
            logprobs=list(self._logprobs))
        if self._on_end is not None:
            self._on_end(self)
