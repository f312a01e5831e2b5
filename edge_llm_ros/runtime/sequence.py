"""One sequence's token logic: pick, detokenize, split and stop. No model calls, no threads.

A Sequence turns the logits a model call produced into the next token and its TokenEvent; the
serving layer decides when to call the model (serving/scheduler.py plans, serving/executor.py
runs) and hands each sequence the logits of its row. The sequence appends every event to its
Output (runtime/output.py), the one copy of what it produced, and builds the result from it.

Event/result conventions:
* An EOS token ends the sequence with StopReason.STOP; it gets an event (its id, and as text
  whatever the detokenizer still held back) and counts as a completion token.
* ``result.text`` is always the concatenation of the events' ``text_delta``; a stop string and
  what follows it are not part of it.
* Output with structure (a request with tools, or a model with reasoning tags; see
  structured.OutputPlan) goes through an OutputPipeline: ``text_delta`` is only the
  user-visible answer, reasoning comes as ``reasoning_delta`` and tool calls as
  ``tool_call_deltas`` (``result.reasoning`` joins the former, ``result.tool_calls`` holds the
  parsed calls). Stop strings apply to the user-visible text only. A sequence that made tool
  calls and stopped (EOS, end of the constraint or a stop string) ends with
  StopReason.TOOL_CALLS. A spent reasoning budget forces the close tag: those tokens are fed
  instead of sampled, yet still go through the sampler's history and the constraint.
* Logprobs (SamplingConfig.logprobs / top_logprobs): each event carries the sampler's
  TokenLogprobs; a forced token has log probability 0 (it was certain).
* Every choice (logprobs or not, constraint or not, pipeline or not) is made once, in
  ``start``: the per-token path of a plain request has no branch for the features it lacks.
* Timings: TTFT counts from ``t0`` (when the sequence got its slot); prefill tok/s counts only
  the positions actually computed (``cached_prompt_tokens`` were reused); decode tok/s is
  tokens decoded per second of the model calls' own time.
* Speculation (runtime/speculative.py): with a Speculator, ``draft`` proposes tokens after
  ``token`` and ``advance_verified`` takes the logits of a verify pass over them: each
  position's token is picked exactly as ``advance`` would pick it, and the drafts are kept
  only while they equal the picks. The output is the output of plain decoding.
"""
from __future__ import annotations

from collections import deque
import time
from typing import Callable, Deque, Iterable, List, Optional, Sequence as Seq, Tuple

import numpy as np

from edge_llm_ros.runtime import media, mrope
from edge_llm_ros.runtime.output import Output
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


class Sequence:
    """One request's token state from its first prompt chunk to its result (owner thread)."""

    def __init__(self, tokenizer: TextTokenizer, prepared: PreparedRequest, output: Output,
                 eos: Iterable[int] = (), t0: Optional[float] = None) -> None:
        if not prepared.bound or prepared.images or prepared.awaits_conversation:
            raise ValueError('the request was not bound before running: its prefix '
                             'embeddings or its session conversation are missing')
        self._tokenizer = tokenizer
        self._req = prepared
        self.output = output
        self._t0 = time.perf_counter() if t0 is None else t0
        self._reason = StopReason.LENGTH
        self._timing = {'prefill_tokens': 0, 'cached': 0, 'ttft': 0.0, 'prefill_s': 0.0,
                        'decode_steps': 0, 'decode_tokens': 0, 'decode_s': 0.0}
        # The model's EOS ids and the family's other end-of-turn tokens (see Engine).
        self._eos = frozenset(eos or tokenizer.eos_token_ids)
        self._stream = None
        self._matcher: Optional[StopMatcher] = None
        self._constraint_state = None
        self._pipeline: Optional[OutputPipeline] = None
        self._last_logprobs: Optional[TokenLogprobs] = None
        self.result: Optional[GenerationResult] = None
        # Decode state (set by start()): the token to feed next at position pos.
        self.token = 0
        self.pos = 0
        self.done = False
        self._budget = 0
        self._pick: Optional[Picker] = None
        self._emit = self._emit_plain
        self.speculator = None   # runtime/speculative.Speculator, when the engine speculates

    @property
    def request(self) -> PreparedRequest:
        return self._req

    def rope_positions(self, start: int, length: int) -> Optional[np.ndarray]:
        """Return M-RoPE positions [3, length] of KV positions start.. (None: the KV index).

        Only a prompt with an M-RoPE image (Qwen-VL) has positions of its own.
        """
        req = self._req
        if not mrope.shifted(req.spans, req.grids):
            return None
        return mrope.positions(req.spans, req.grids, start, length)

    # --- the prompt --------------------------------------------------------------------------
    def chunks(self, reused: int, chunk: int) -> List[Tuple[int, int]]:
        """Return the prompt pieces (a, b) to prefill after `reused` positions already in KV.

        Pieces start at every embedding span (media.span_starts): rows go ahead of ids.
        With whole spans (bidirectional images) each span is one piece of its own, whatever
        `chunk` is, and `reused` never ends inside one (the scheduler's span_floor).
        """
        self._timing['cached'] = reused
        req = self._req
        total = len(req.keys)
        if req.whole_spans:
            cuts = [reused] + media.whole_span_cuts(req.spans, reused, total) + [total]
            return [piece for a, b in zip(cuts[:-1], cuts[1:])
                    for piece in ([(a, b)] if self.whole_span(a, b) else
                                  split_chunks(b, a, chunk))]
        cuts = [reused] + media.span_starts(req.spans, reused, total) + [total]
        return [piece for a, b in zip(cuts[:-1], cuts[1:])
                for piece in split_chunks(b, a, chunk)]

    def whole_span(self, a: int, b: int) -> bool:
        """Whether prompt positions a..b-1 are exactly one span prefilled bidirectionally."""
        return self._req.whole_spans and (a, b - a) in self._req.spans

    def prefill_inputs(self, a: int, b: int) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """Token ids and embedding rows of prompt positions a..b-1 (embeddings first)."""
        req = self._req
        if not req.spans:
            return np.asarray(req.prompt_ids[a:b], dtype=np.int64), None
        ra, rb = media.rows_before(req.spans, a), media.rows_before(req.spans, b)
        ids = np.asarray(req.prompt_ids[a - ra:b - rb], dtype=np.int64)
        return ids, (req.embeds[ra:rb] if rb > ra else None)

    def prefilled(self, a: int, b: int, seconds: float) -> None:
        """Count a prefill chunk the model computed (positions a..b-1 in `seconds`)."""
        tm = self._timing
        tm['prefill_s'] += seconds
        tm['prefill_tokens'] += b - a

    # --- tokens ------------------------------------------------------------------------------
    def start(self, logits: np.ndarray, pos: int, room: int) -> Optional[TokenEvent]:
        """Set up the output side and pick the first token from the prompt's last logits.

        pos: positions now in KV (the prompt's length); room: free positions after them.
        Returns its event (None when the budget allows no token at all).
        """
        req = self._req
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
        self._budget = min(req.max_tokens, room + 1)
        self.pos = pos
        self.token = self._pick(logits)
        self._timing['ttft'] = time.perf_counter() - self._t0
        if self._budget < 1:
            self.done = True
            return None
        return self._emit_token()

    def advance(self, logits: np.ndarray, started: float) -> TokenEvent:
        """Take the logits of feeding `token` at `pos`; pick and emit the next token.

        started: perf_counter time when that model call started (decode timing).
        """
        self.pos += 1
        self.token = self._pick(logits)
        tm = self._timing
        tm['decode_s'] += time.perf_counter() - started
        tm['decode_steps'] += 1
        tm['decode_tokens'] += 1
        return self._emit_token()

    def draft_ask(self, room: int):
        """Return the shape of the draft to verify after `token` (None: none now).

        room: positions the slot and the token budget allow beyond `token`'s.
        Returns a runtime.speculative.DraftAsk, which the engine's Speculation completes.
        """
        spec = self.speculator
        if spec is None or spec.off:
            return None
        room = min(room, self._budget - len(self.output) - 1)
        state = self._constraint_state
        forced = state.forced_tokens() if state is not None else []
        return spec.ask(forced, room)

    def advance_verified(self, logits: np.ndarray, draft: Seq[int],
                         started: float) -> int:
        """Take a verify pass's logits [len(draft) + 1, vocab]; return the drafts kept.

        Row i holds the logits after feeding `token` then draft[:i]. Tokens are picked row by
        row until a pick differs from its draft (that pick is kept: it is the next token), the
        last row is used, or the sequence ends.
        """
        accepted = 0
        for i in range(len(draft) + 1):
            self.pos += 1
            self.token = self._pick(logits[i])
            self._emit_token()
            if self.done or i == len(draft) or self.token != draft[i]:
                break
            accepted += 1
        tm = self._timing
        tm['decode_s'] += time.perf_counter() - started
        tm['decode_steps'] += 1
        tm['decode_tokens'] += accepted + 1
        self.speculator.observe(len(draft), accepted)
        return accepted

    def _emit_token(self) -> TokenEvent:
        index = len(self.output)
        event, reason = self._emit(self.token, index, index + 1 == self._budget)
        if self.speculator is not None:
            self.speculator.add((self.token,))
        self.output.add(event)
        if reason is not None:
            self._reason = reason
            self.done = True
        return event

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
        def pick_recorded(logits: np.ndarray) -> int:
            token = pick(logits)
            self._last_logprobs = sampler.last_logprobs
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
            return token
        return pick_forcing

    def _emit_plain(self, token: int, index: int,
                    last: bool) -> Tuple[TokenEvent, Optional[StopReason]]:
        """Event of one token when all output is text."""
        text, reason = self._text_of(token, last)
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
    def finish(self, reason: Optional[StopReason] = None, error: str = '') -> GenerationResult:
        """Build the result once (later calls return it) and end the sequence.

        With `reason` if given, ERROR when `error` is given, else the reason reached.
        """
        if self.result is not None:
            return self.result
        tm = self._timing
        prefill_tps = tm['prefill_tokens'] / tm['prefill_s'] if tm['prefill_s'] > 0 else 0.0
        decode_tps = tm['decode_tokens'] / tm['decode_s'] if tm['decode_s'] > 0 else 0.0
        spec = self.speculator.stats if self.speculator is not None else None
        timings = Timings(time_to_first_token_s=tm['ttft'],
                          prefill_tokens=tm['prefill_tokens'],
                          cached_prompt_tokens=tm['cached'],
                          prefill_tokens_per_second=prefill_tps,
                          decode_tokens_per_second=decode_tps,
                          total_s=time.perf_counter() - self._t0,
                          draft_passes=spec.passes if spec else 0,
                          draft_tokens=spec.drafted if spec else 0,
                          accepted_draft_tokens=spec.accepted if spec else 0,
                          decode_steps=tm['decode_steps'])
        if error:
            reason = StopReason.ERROR
        elif reason is None:
            reason = self._reason
        pipeline = self._pipeline
        calls = pipeline.tool_calls if pipeline is not None else []
        if reason is StopReason.STOP and calls:
            reason = StopReason.TOOL_CALLS
        out = self.output
        self.done = True
        self.result = GenerationResult(
            text=out.text(), token_ids=out.token_ids(), stop_reason=reason,
            prompt_tokens=self._req.prompt_tokens, completion_tokens=len(out),
            timings=timings, error=error, reasoning=out.reasoning(), tool_calls=calls,
            invalid_tool_calls=pipeline.invalid_tool_calls if pipeline is not None else [],
            logprobs=out.logprobs(),
            dropped_turns=self._req.session.dropped if self._req.session is not None else 0)
        return self.result
