"""Thread safety of the worker: many goals, cancels and queue queries at once (no ROS).

Submitters, a canceller and readers of the published queue view run on their own threads
against a real tiny engine with 3 slots while the worker thread steps. Every goal must end
exactly once, readers must only ever see consistent views, and nothing may raise.
"""
import random
import threading
import time

import test_engine

from edge_llm_ros.runtime.types import GenerationRequest, StopReason
from edge_llm_ros.serving.engine import Engine, EngineConfig
from edge_llm_ros.serving.goal import CancelReason, FeedbackPolicy, Goal
from edge_llm_ros.serving.worker import EngineWorker, QueueFullError

tiny_dir = test_engine.tiny_dir   # fixture: the tiny model at accuracy level 0
GOALS_PER_SUBMITTER = 25
SUBMITTERS = 3


def test_goals_cancels_and_queries_from_many_threads_lose_nothing(tiny_dir):
    def factory():
        return Engine(EngineConfig(model_dir=str(tiny_dir), max_context=128,
                                   intra_op_threads=1, parallel_sequences=3))
    worker = EngineWorker(factory, 16, FeedbackPolicy(3, 0.0))
    worker.start()
    worker.set_accepting(True)
    lock = threading.Lock()
    goals, ends, feedback_after_end, errors = [], {}, [], []
    stop = threading.Event()

    def on_done(goal):
        with lock:
            ends[goal.uid] = ends.get(goal.uid, 0) + 1

    def submitter(seed):
        rng = random.Random(seed)
        try:
            for _ in range(GOALS_PER_SUBMITTER):
                prompt = ' '.join(rng.choice(('robot', 'sky', 'blue', 'arm', 'the'))
                                  for _ in range(rng.randint(1, 8)))
                prepared = worker.engine.prepare(GenerationRequest(
                    prompt=prompt, max_tokens=rng.randint(1, 20), use_chat_template=False))
                goal = Goal(prepared, priority=rng.randint(-3, 3),
                            preempt=rng.random() < 0.3, on_done=on_done)

                def feedback(chunk, goal=goal):
                    if goal.done and chunk.queue_position:
                        feedback_after_end.append(goal.uid)
                goal.on_feedback = feedback
                while True:
                    try:
                        position = worker.submit(goal)
                        break
                    except QueueFullError:
                        time.sleep(0.005)
                assert position >= 0
                with lock:
                    goals.append(goal)
        except Exception as exc:  # noqa: B902 - reported by the test below
            errors.append(exc)

    def canceller():
        rng = random.Random(99)
        while not stop.is_set():
            with lock:
                pick = rng.choice(goals) if goals else None
            if pick is not None and rng.random() < 0.3:
                worker.cancel(pick, CancelReason.CLIENT)
            time.sleep(0.002)

    def reader():
        try:
            while not stop.is_set():
                snap = worker.snapshot()
                assert snap.waiting >= 0 and snap.queue_depth == 16
                # One published view is consistent in itself, whatever the worker does now.
                view = worker.view
                assert len(view.positions) == view.waiting
                assert view.free_slots == max(3 - view.running, 0)
                ahead = sorted(p for p in view.positions.values() if p > 0)
                assert ahead == list(range(1, len(ahead) + 1)), view
                assert len(ahead) == max(view.waiting - view.free_slots, 0), view
                with lock:
                    sample = list(goals[-8:])
                for goal in sample:
                    assert worker.position(goal) >= 0
                worker.has_room()
        except Exception as exc:  # noqa: B902 - reported by the test below
            errors.append(exc)

    threads = [threading.Thread(target=submitter, args=(i,)) for i in range(SUBMITTERS)]
    helpers = [threading.Thread(target=canceller)] + [threading.Thread(target=reader)
                                                      for _ in range(2)]
    try:
        for t in threads + helpers:
            t.start()
        for t in threads:
            t.join(120)
        assert worker.wait_idle(120), 'the worker did not go idle'
    finally:
        stop.set()
        for t in helpers:
            t.join(30)
        worker.stop()
    assert not errors, errors
    total = SUBMITTERS * GOALS_PER_SUBMITTER
    assert len(goals) == total
    assert sorted(ends) == sorted(g.uid for g in goals), 'a goal never ended'
    assert set(ends.values()) == {1}, 'a goal ended twice'
    assert all(g.result.stop_reason in (StopReason.LENGTH, StopReason.STOP,
                                        StopReason.CANCELLED) for g in goals)
    cancelled = sum(g.result.stop_reason is StopReason.CANCELLED for g in goals)
    assert 0 < cancelled < total
    assert not feedback_after_end, 'a queue position arrived after the goal had ended'
    # Every finished goal's output is its result (one copy of the tokens).
    for goal in goals:
        assert goal.result.token_ids == goal.output.token_ids()
