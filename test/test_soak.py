"""CI-sized soak of llm_node (bench/soak.py has the 1,000-goal run and its figures).

150 goals from 4 concurrent clients on the tiny model, ~20 % cancelled and ~5 % invalid,
after a 40-goal warm-up of the same mix: every goal ends in a terminal state matching what
was sent, the node never crashes, RSS grows at most 5 %, fds and threads return to the
baseline and the KV cache holds nothing left over.
"""
import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _soak_module():
    spec = importlib.util.spec_from_file_location('bench_soak', ROOT / 'bench' / 'soak.py')
    module = importlib.util.module_from_spec(spec)
    sys.modules['bench_soak'] = module   # dataclasses look their module up while defined
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope='module')
def soak():
    return _soak_module()


def test_soak_150_goals_4_clients(soak, tmp_path_factory):
    model = soak.tiny_model(tmp_path_factory.mktemp('soak_model'))
    config = soak.SoakConfig(goals=150, clients=4, max_tokens=8, cancel_rate=0.2,
                             invalid_rate=0.05, model_path=model, max_context=256,
                             max_words=4, warmup=40, goal_timeout_s=60.0, seed=3)
    lines = []
    report = soak.run_soak(config, log=lines.append)
    summary = (f'outcomes {report.outcomes}, lost {report.lost} ({report.lost_where}), '
               f'unexpected {report.unexpected}, baseline {report.baseline}, '
               f'final {report.final}, rss growth {report.rss_growth:+.2%}, '
               f'kv {report.kv_after_warmup} -> {report.kv_after_soak}\n' + '\n'.join(lines))
    assert report.ok, f'failed checks {[k for k, v in report.checks.items() if not v]}: ' \
        + summary
    # The mix really happened: cancels caught mid-stream, invalid goals refused.
    assert report.outcomes.get('canceled', 0) >= 5, summary
    assert report.outcomes.get('aborted', 0) >= 2, summary
    assert report.outcomes.get('succeeded', 0) >= 100, summary
    # The node counted every goal it got (one largest goal per session id, the warm-up mix,
    # the soak and two probes) as ended.
    counters = report.node_counters
    ended = counters['goals_succeeded'] + counters['goals_cancelled'] + counters['goals_aborted']
    assert ended == soak.SESSIONS + config.warmup + config.goals + 2, (counters, summary)
