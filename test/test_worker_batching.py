"""The engine worker over a real tiny engine with several slots (no ROS).

Batching, priorities, preemption feedback, cancel in every state, run_between_jobs and stop.
"""
import threading

import pytest
import test_engine
from test_llm_worker import _wait

from edge_llm_ros.runtime.types import GenerationRequest, StopReason
from edge_llm_ros.serving.engine import Engine, EngineConfig
from edge_llm_ros.serving.goal import CancelReason, FeedbackPolicy, Goal
from edge_llm_ros.serving.worker import EngineWorker


tiny_dir = test_engine.tiny_dir   # fixture: the tiny model at accuracy level 0


class Slow:
    """A pacer: steps of >= 10 ms, so a long job surely runs while the test acts."""

    token_pause_s = 0.01


class Recorder:
    def __init__(self) -> None:
        self.chunks = []
        self.outcomes = []
        self.done = threading.Event()

    def feedback(self, chunk) -> None:
        self.chunks.append(chunk)

    def finish(self, outcome) -> None:
        self.outcomes.append(outcome)
        self.done.set()

    def outcome(self):
        assert self.done.wait(60), 'job did not finish'
        assert len(self.outcomes) == 1
        return self.outcomes[0]


@pytest.fixture
def worker_of(tiny_dir):
    workers = []

    def make(n=2, depth=8, pacer=None, **kw):
        def factory():
            return Engine(EngineConfig(model_dir=str(tiny_dir), max_context=128,
                                       intra_op_threads=1, parallel_sequences=n, **kw))
        worker = EngineWorker(factory, depth, FeedbackPolicy(4, 0.0), pacer=pacer)
        worker.start()
        worker.set_accepting(True)
        workers.append(worker)
        return worker
    yield make
    for worker in workers:
        worker.stop()


def job(worker, prompt, max_tokens=8, **kw):
    rec = Recorder()
    prepared = worker.engine.prepare(GenerationRequest(prompt=prompt, max_tokens=max_tokens,
                                                       use_chat_template=False))
    return Goal(prepared, on_done=rec.finish, on_feedback=rec.feedback, **kw), rec


def test_jobs_in_a_batch_equal_the_same_jobs_alone(worker_of, tiny_dir):
    prompts = ('once upon a time there was', 'robot arm', 'the blue sky', 'What color is')
    worker = worker_of(n=4)
    runs = [job(worker, p, max_tokens=12) for p in prompts]
    for j, _ in runs:
        worker.submit(j)
    batched = [rec.outcome().result for _, rec in runs]
    alone = Engine(EngineConfig(model_dir=str(tiny_dir), max_context=96, intra_op_threads=1))
    try:
        for p, result, (_, rec) in zip(prompts, batched, runs):
            want = alone.generate(GenerationRequest(prompt=p, max_tokens=12,
                                                    use_chat_template=False)).run_to_end()
            assert result.token_ids == want.token_ids
            # Feedback adds up to the result, first token alone then batches of 4.
            assert ''.join(c.text_delta for c in rec.chunks) == result.text
            assert rec.chunks[-1].completion_tokens == result.completion_tokens
            assert len(rec.chunks[0].token_ids) == 1
    finally:
        alone.close()
    assert worker.stats.finished['length'] == 4


def test_preempted_job_reports_paused_then_resumed(worker_of):
    worker = worker_of(n=1, pacer=Slow())
    long_job, long_rec = job(worker, 'once upon a time there was', max_tokens=80)
    worker.submit(long_job)
    _wait(lambda: long_rec.chunks, 'the first token')
    urgent, urgent_rec = job(worker, 'robot arm', max_tokens=4, priority=10, preempt=True)
    worker.submit(urgent)
    assert urgent_rec.outcome().result.stop_reason is StopReason.LENGTH
    result = long_rec.outcome().result
    assert result.stop_reason is StopReason.LENGTH and result.completion_tokens == 80
    flags = [c.paused for c in long_rec.chunks]
    assert True in flags
    paused_at = flags.index(True)
    # Paused, then a chunk saying it runs again, and tokens after it.
    assert any(not c.paused for c in long_rec.chunks[paused_at + 1:])
    assert sum(len(c.token_ids) for c in long_rec.chunks) == 80


def test_priority_orders_the_queue_and_cancel_works_everywhere(worker_of):
    worker = worker_of(n=1, depth=6, pacer=Slow())
    running, running_rec = job(worker, 'once upon a time there was', max_tokens=85)
    worker.submit(running)
    _wait(lambda: running_rec.chunks, 'the first token')
    low, low_rec = job(worker, 'a', priority=-5)
    mid, mid_rec = job(worker, 'b', priority=0)
    high, high_rec = job(worker, 'c', priority=7)
    assert worker.submit(low) == 1
    assert worker.submit(mid) == 1          # ahead of `low` now
    assert worker.submit(high) == 1
    assert [c.queue_position for c in low_rec.chunks if c.queue_position][-1] == 3
    worker.cancel(mid, CancelReason.CLIENT)  # waiting: ends at once
    assert mid_rec.outcome().result.stop_reason is StopReason.CANCELLED
    worker.cancel(running, CancelReason.CLIENT)
    assert running_rec.outcome().result.stop_reason is StopReason.CANCELLED
    assert high_rec.outcome().result.stop_reason is StopReason.LENGTH
    assert low_rec.outcome().result.stop_reason is StopReason.LENGTH
    assert high_rec.done.is_set() and low_rec.outcomes
    assert worker.wait_idle(10)


def test_cancel_a_paused_job_and_stop_with_jobs_everywhere(worker_of):
    worker = worker_of(n=1, depth=6, pacer=Slow())
    victim, victim_rec = job(worker, 'once upon a time there was', max_tokens=85)
    worker.submit(victim)
    _wait(lambda: victim_rec.chunks, 'the first token')
    urgent, urgent_rec = job(worker, 'robot arm', max_tokens=85, priority=5, preempt=True)
    worker.submit(urgent)
    _wait(lambda: any(c.paused for c in victim_rec.chunks), 'the pause')
    worker.cancel(victim, CancelReason.CLIENT)
    assert victim_rec.outcome().result.stop_reason is StopReason.CANCELLED
    waiting, waiting_rec = job(worker, 'x', max_tokens=4)
    worker.submit(waiting)
    worker.stop()
    for rec in (urgent_rec, waiting_rec):
        assert rec.outcome().cancel_reason is CancelReason.SHUTDOWN
    assert not worker.alive


def test_run_between_jobs_waits_for_running_jobs_and_blocks_admission(worker_of):
    worker = worker_of(n=2, pacer=Slow())
    assert worker.run_between_jobs(lambda eng: eng.kv_occupancy()[1], 5) == 2 * 128
    first, first_rec = job(worker, 'once upon a time there was', max_tokens=40)
    worker.submit(first)
    _wait(lambda: first_rec.chunks, 'the first token')
    seen = []

    def action(eng):
        seen.append((first_rec.done.is_set(), later_rec.chunks[:]))
        return 'ran'
    later, later_rec = job(worker, 'robot arm', max_tokens=4)
    result = {}

    def call():
        result['v'] = worker.run_between_jobs(action, 30)
    thread = threading.Thread(target=call)
    thread.start()
    _wait(lambda: worker._between, 'the action to queue')
    worker.submit(later)
    thread.join(30)
    assert result['v'] == 'ran'
    # The action ran after the running job ended and before the later one was admitted.
    assert seen == [(True, [])]
    assert later_rec.outcome().result.stop_reason is StopReason.LENGTH
