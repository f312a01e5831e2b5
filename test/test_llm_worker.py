"""The engine worker's queue, cancellation and feedback batching, with a scripted engine.

No ROS and no model: the fake engine yields one token per `step()` of the test, so every
interleaving below is deterministic.
"""
import contextlib
from dataclasses import dataclass, replace
import threading
import time

import numpy as np
import pytest

from edge_llm_ros.errors import InvalidRequestError, ModelLoadError
from edge_llm_ros.runtime.types import GenerationResult, StopReason, Timings, TokenEvent
from edge_llm_ros.serving.goal import CancelReason, FeedbackPolicy, Goal
from edge_llm_ros.serving.worker import EngineWorker, QueueFullError, WorkerStoppedError


@dataclass(frozen=True)
class FakeRequest:
    """Stands for the engine's PreparedRequest: what the fake engine reads, and bind()."""

    prompt: str
    max_tokens: int
    embeds: object = None

    def bind(self, array) -> 'FakeRequest':
        return replace(self, embeds=array)


class FakeGeneration:
    """Yields token i as text 't{i} ' each time the engine's gate lets one step through."""

    def __init__(self, engine, request: FakeRequest) -> None:
        self._engine = engine
        self._request = request
        self._cancel = threading.Event()
        self._ids = []
        self.result = None

    def cancel(self) -> None:
        self._cancel.set()
        self._engine.gate.release()   # wake a step waiting for the test

    def __iter__(self):
        return self

    def __next__(self) -> TokenEvent:
        if len(self._ids) >= self._request.max_tokens:
            return self._end(StopReason.LENGTH)
        if self._engine.gated:
            self._engine.gate.acquire()
        if self._cancel.is_set():
            return self._end(StopReason.CANCELLED)
        index = len(self._ids)
        self._ids.append(100 + index)
        self._engine.steps += 1
        return TokenEvent(100 + index, f't{index} ', index, 0.0)

    def _end(self, reason: StopReason):
        text = ''.join(f't{i} ' for i in range(len(self._ids)))
        self.result = GenerationResult(text, list(self._ids), reason, 3, len(self._ids),
                                       Timings(time_to_first_token_s=0.01,
                                               decode_tokens_per_second=50.0))
        raise StopIteration


class FakeEngine:
    def __init__(self, gated: bool = False) -> None:
        self.gated = gated
        self.gate = threading.Semaphore(0)
        self.steps = 0
        self.closed = False
        self.requests = []

    def generate(self, request: FakeRequest) -> FakeGeneration:
        self.requests.append(request)
        if not request.prompt:
            raise InvalidRequestError('the request is empty: give a prompt or messages')
        return FakeGeneration(self, request)

    def close(self) -> None:
        self.closed = True


class Recorder:
    """on_done / on_feedback of one goal."""

    def __init__(self) -> None:
        self.chunks = []
        self.outcomes = []
        self.done = threading.Event()
        self.done_thread = None

    def feedback(self, chunk) -> None:
        self.chunks.append(chunk)

    def finish(self, outcome) -> None:
        self.outcomes.append(outcome)
        self.done_thread = threading.current_thread().name
        self.done.set()

    def job(self, prompt: str = 'hi', max_tokens: int = 5, **kwargs) -> Goal:
        return Goal(FakeRequest(prompt=prompt, max_tokens=max_tokens), on_done=self.finish,
                    on_feedback=self.feedback, **kwargs)

    def outcome(self):
        assert self.done.wait(30), 'job did not finish'
        assert len(self.outcomes) == 1
        return self.outcomes[0]


@pytest.fixture
def make_worker():
    workers = []

    def make(depth: int = 2, gated: bool = False, policy=FeedbackPolicy(3, 0.0), **kwargs):
        engine = FakeEngine(gated)
        worker = EngineWorker(lambda: engine, depth, policy, **kwargs)
        worker.start()
        worker.set_accepting(True)
        workers.append(worker)
        return worker, engine
    yield make
    for worker in workers:
        worker.stop()


def _wait(predicate, what: str, timeout: float = 30.0) -> None:
    pause = threading.Event()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        pause.wait(0.01)
    raise AssertionError(f'timed out after {timeout} s waiting for {what}')


def test_feedback_batches_and_adds_up_to_the_result(make_worker):
    worker, _ = make_worker(policy=FeedbackPolicy(tokens=3, period_s=0.0))
    rec = Recorder()
    worker.submit(rec.job(max_tokens=8))
    result = rec.outcome().result
    assert result.stop_reason is StopReason.LENGTH and result.completion_tokens == 8
    # First token alone, then batches of 3; the last chunk carries the rest and the count.
    assert [len(c.token_ids) for c in rec.chunks] == [1, 3, 3, 1]
    assert ''.join(c.text_delta for c in rec.chunks) == result.text
    assert rec.chunks[-1].completion_tokens == 8
    assert result.timings.queue_wait_s >= 0
    assert rec.done_thread == 'llm_engine_worker'


def test_reservations_bound_the_queue(make_worker):
    worker, _ = make_worker(depth=1)
    assert worker.reserve() and worker.reserve()      # one running + one waiting
    assert not worker.reserve()
    worker.unreserve()
    assert worker.reserve()
    worker.set_accepting(False)                        # deactivated: reservations dropped
    assert not worker.reserve()
    with pytest.raises(WorkerStoppedError):
        worker.submit(Recorder().job())
    worker.set_accepting(True)
    assert worker.reserve() and worker.reserve() and not worker.has_room()


def test_queue_positions_cancel_while_queued_and_running(make_worker):
    worker, engine = make_worker(depth=2, gated=True)
    first, second, third = Recorder(), Recorder(), Recorder()
    first_job, second_job = first.job(max_tokens=50), second.job()
    assert worker.submit(first_job) == 0
    engine.gate.release()
    _wait(lambda: engine.steps == 1, 'the first token')
    assert worker.submit(second_job) == 1
    assert worker.submit(third.job()) == 2
    with pytest.raises(QueueFullError):
        worker.submit(Recorder().job())
    assert [c.queue_position for c in third.chunks] == [2]
    # A waiting job ends at once, on the cancelling thread; the one behind moves up.
    worker.cancel(second_job, CancelReason.CLIENT)
    outcome = second.outcome()
    assert outcome.result.stop_reason is StopReason.CANCELLED
    assert outcome.cancel_reason is CancelReason.CLIENT and outcome.result.text == ''
    assert second.done_thread == threading.current_thread().name
    assert third.chunks[-1].queue_position == 1
    # The running job stops within one step and keeps its partial text.
    worker.cancel(first_job, CancelReason.CLIENT)
    outcome = first.outcome()
    assert outcome.result.stop_reason is StopReason.CANCELLED
    assert outcome.result.text == 't0 ' and outcome.result.token_ids == [100]
    for _ in range(5):
        engine.gate.release()
    assert third.outcome().result.completion_tokens == 5


def test_invalid_request_and_bind_errors_end_the_job_not_the_worker(make_worker):
    worker, _ = make_worker()
    bad = Recorder()
    worker.submit(bad.job(prompt=''))
    result = bad.outcome().result
    assert result.stop_reason is StopReason.ERROR and 'empty' in result.error
    entered = []

    @contextlib.contextmanager
    def failing_bind():
        entered.append('in')
        raise InvalidRequestError('prefix_embeddings[0] cannot be mapped: stale')
        yield  # pragma: no cover

    mapped = Recorder()
    worker.submit(mapped.job(embeddings=failing_bind))
    result = mapped.outcome().result
    assert entered == ['in'] and 'stale' in result.error
    good = Recorder()
    worker.submit(good.job(max_tokens=2))
    assert good.outcome().result.stop_reason is StopReason.LENGTH
    assert worker.stats.finished['error'] == 2 and worker.stats.last_error.startswith('prefix')


def test_embeddings_are_bound_around_the_generation(make_worker):
    worker, engine = make_worker()
    events = []
    array = np.ones((3, 4), np.float32)

    @contextlib.contextmanager
    def embeddings():
        events.append('enter')
        yield array
        events.append(f'exit after {engine.steps} steps')

    rec = Recorder()
    worker.submit(rec.job(max_tokens=5, embeddings=embeddings))
    assert rec.outcome().result.completion_tokens == 5
    assert engine.requests[-1].embeds is array   # the request ran with the bound array
    assert events == ['enter', 'exit after 5 steps']   # held for the whole generation


def test_pacer_pauses_every_token(make_worker):
    class Pacer:
        reads = 0

        @property
        def token_pause_s(self) -> float:
            Pacer.reads += 1
            return 0.001

    worker, _ = make_worker(pacer=Pacer())
    rec = Recorder()
    worker.submit(rec.job(max_tokens=4))
    rec.outcome()
    assert Pacer.reads >= 4


def test_load_failure_is_raised_by_start():
    def broken():
        raise ModelLoadError('model.onnx is corrupt: regenerate it')
    worker = EngineWorker(broken, 1)
    with pytest.raises(ModelLoadError, match='corrupt'):
        worker.start()
    assert not worker.alive


def test_stop_cancels_everything_and_closes_the_engine(make_worker):
    worker, engine = make_worker(gated=True)
    running, waiting = Recorder(), Recorder()
    worker.submit(running.job(max_tokens=50))
    worker.submit(waiting.job())
    worker.stop()
    assert running.outcome().cancel_reason is CancelReason.SHUTDOWN
    assert waiting.outcome().cancel_reason is CancelReason.SHUTDOWN
    assert engine.closed and not worker.alive


def test_a_job_cancelled_before_submission_ends_cancelled(make_worker):
    worker, engine = make_worker()
    rec = Recorder()
    job = rec.job(max_tokens=50)
    worker.cancel(job, CancelReason.CLIENT)   # the client cancelled between accept and submit
    worker.submit(job)
    outcome = rec.outcome()
    assert outcome.result.stop_reason is StopReason.CANCELLED
    assert outcome.cancel_reason is CancelReason.CLIENT and engine.steps == 0


def test_priority_orders_waiting_jobs_and_out_of_range_is_refused(make_worker):
    worker, engine = make_worker(depth=5, gated=True)
    first = Recorder()
    worker.submit(first.job(max_tokens=1))
    order = []
    recs = {}
    for name, priority in (('low', -3), ('mid', 0), ('high', 9), ('mid2', 0)):
        recs[name] = Recorder()
        job = recs[name].job(max_tokens=1, priority=priority)
        job.on_done = (lambda n, r: lambda outcome: (order.append(n), r.finish(outcome)))(
            name, recs[name])
        worker.submit(job)
    with pytest.raises(ValueError, match='priority'):
        worker.submit(Recorder().job(priority=101))
    assert [c.queue_position for c in recs['low'].chunks][-1] == 4
    for _ in range(5):
        engine.gate.release()
    for rec in recs.values():
        rec.outcome()
    assert order == ['high', 'mid', 'mid2', 'low']


def test_a_failing_step_ends_every_job_with_an_error(make_worker):
    worker, engine = make_worker(depth=3, gated=True)
    running, waiting = Recorder(), Recorder()
    worker.submit(running.job(max_tokens=50))
    engine.gate.release()
    _wait(lambda: engine.steps == 1, 'the first token')
    worker.submit(waiting.job())
    step = worker._loop.step

    def broken(*args):
        raise RuntimeError('scheduler bug')
    worker._loop.step = broken
    engine.gate.release()
    for rec in (running, waiting):
        result = rec.outcome().result
        assert result.stop_reason is StopReason.ERROR and 'scheduler bug' in result.error
    worker._loop.step = step
    again = Recorder()
    worker.submit(again.job(max_tokens=1))
    engine.gate.release()
    assert again.outcome().result.stop_reason is StopReason.LENGTH


def test_take_waiting_hands_back_the_waiting_goals_unsubmitted(make_worker):
    # A model update takes the waiting goals (to prepare them for the new model); the
    # running one goes on. Taken goals can be submitted again.
    worker, engine = make_worker(depth=3, gated=True)
    running, waiting = Recorder(), [Recorder(), Recorder()]
    running_job = running.job(max_tokens=3)
    worker.submit(running_job)
    engine.gate.release()
    _wait(lambda: engine.steps == 1, 'the first token')
    jobs = [rec.job(priority=p) for rec, p in zip(waiting, (0, 5))]
    for job in jobs:
        worker.submit(job)
    taken = worker.take_waiting()
    assert taken == [jobs[1], jobs[0]]             # admission order: priority, then arrival
    assert all(job.submitted_at == 0.0 and not job.done for job in taken)
    assert worker.view.waiting == 0 and worker.unfinished() == 1
    assert worker.take_waiting() == []
    for _ in range(3):
        engine.gate.release()
    assert running.outcome().result.completion_tokens == 3
    assert worker.wait_idle(30)                    # the taken goals are not the worker's
    assert not any(rec.done.is_set() for rec in waiting)
    for job in taken:
        worker.submit(job)
    for _ in range(10):
        engine.gate.release()
    assert [rec.outcome().result.completion_tokens for rec in waiting] == [5, 5]
