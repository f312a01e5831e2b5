"""CI-sized soak with continuous batching (issue 14): 4 slots, priorities, cancels.

bench/soak.py --parallel-sequences 4 --priority-rate 0.3 on the tiny model: 150 goals from 8
clients (more than the slots, so goals queue), ~20 % cancelled (queued or running), ~5 %
invalid (out-of-range priorities among them), 30 % with a random priority, half of those
with preempt. Nothing is lost, every outcome matches what was sent, and memory, fds, threads
and KV return to the baseline. The tiny model's goals last milliseconds, so a preemption is
rare here (report.paused counts them); test_batching_node.py pauses and cancels
deterministically.
"""
from test_soak import _soak_module


def test_soak_with_4_slots_priorities_and_cancels(tmp_path_factory):
    soak = _soak_module()
    model = soak.tiny_model(tmp_path_factory.mktemp('soak_batching_model'))
    config = soak.SoakConfig(goals=150, clients=8, max_tokens=32, cancel_rate=0.2,
                             invalid_rate=0.05, model_path=model, max_context=256,
                             max_words=4, warmup=40, goal_timeout_s=60.0, seed=5,
                             parallel_sequences=4, priority_rate=0.3, cancel_tokens=192)
    lines = []
    report = soak.run_soak(config, log=lines.append)
    summary = (f'outcomes {report.outcomes}, lost {report.lost} ({report.lost_where}), '
               f'unexpected {report.unexpected}, baseline {report.baseline}, '
               f'final {report.final}, rss growth {report.rss_growth:+.2%}, '
               f'kv {report.kv_after_warmup} -> {report.kv_after_soak}, '
               f'paused {report.paused}\n' + '\n'.join(lines))
    assert report.lost == 0, summary
    assert report.ok, f'failed checks {[k for k, v in report.checks.items() if not v]}: ' \
        + summary
    assert report.outcomes.get('canceled', 0) >= 5, summary
    assert report.outcomes.get('succeeded', 0) >= 100, summary
