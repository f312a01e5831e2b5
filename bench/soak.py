"""Soak llm_node: N goals from C concurrent clients, random cancels and invalid goals (issue 8).

    .venv/bin/python bench/soak.py [--goals 1000] [--clients 4] [--max-tokens 8]
                                   [--cancel-rate 0.2] [--invalid-rate 0.05] [--tiny]
                                   [--model-path DIR] [--json bench/results/soak.json]
                                   [--parallel-sequences 4 --priority-rate 0.3]

With --parallel-sequences N the node batches N goals at once (issue 14); --priority-rate R
gives that share of the goals a random priority in [-5, 5], half of them with preempt, so
goals are paused and resumed, and cancels also hit queued, running and paused goals; an
out-of-range priority joins the invalid kinds.

Starts a real llm_node process (the embedded SmolLM2 by default, the tiny random test model
with --tiny), drives it through the ~/generate action from C client nodes on threads, and
checks what issue 8 asks:

- every goal ends in a terminal state (succeeded / aborted / canceled, or rejected) within
  its timeout: none is lost, the node never crashes;
- invalid goals end aborted with an error message; goals that were not cancelled and not
  invalid succeed;
- after warm-up, the node's RSS grows by at most 5 %, and its open fds and threads return
  to the warm-up baseline (/proc/<pid>/fd, /proc/<pid>/task) once it is idle;
- the KV cache holds nothing left over: after the soak, the same probe goal as after
  warm-up leaves the same kv_used_tokens in /diagnostics (occupancy is the probe's own
  sequence, not accumulated; with several slots, ~/reset_session '' empties them before
  each probe).

Prints one JSON object and a short table; exits 1 if any check failed. run_soak() is what
test/test_soak.py calls for the CI-sized run.
"""
from __future__ import annotations

import argparse
import collections
from dataclasses import asdict, dataclass, field
import json
import os
import pathlib
import random
import sys
import threading
import time
from typing import Dict, List, Optional, TYPE_CHECKING

if TYPE_CHECKING:
    from edge_llm_ros.node_process import NodeProcess

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORDS = ('robot', 'arm', 'gripper', 'shelf', 'box', 'battery', 'path', 'map', 'dock', 'aisle',
         'camera', 'sky', 'blue', 'why', 'how', 'move', 'stop', 'left', 'right', 'slowly',
         'the', 'a', 'is', 'to', 'and', 'what', 'color', 'distance', 'meters', 'safe', 'é',
         '数', '🤖', '{{ x }}', '<|im_end|>', 'newline\n')
SCHEMAS = ('{"type": "string", "maxLength": 6}', '{"type": "integer"}',
           '{"type": "object", "properties": {"ok": {"type": "boolean"}}}')
INVALID_KINDS = ('empty', 'role', 'sampling', 'schema', 'handle', 'overflow')
# Goals picked for cancelling run long enough to be caught mid-stream: the schema forbids
# EOS until cancel_tokens (a cancel that still arrives late finds them succeeded).
LONG_SCHEMA = '{"type": "string", "minLength": 5000}'
CANCEL_TOKENS = 64
SESSIONS = 20   # session ids in use: more than kv.max_sessions (8), so the LRU evicts
SETTLE_S = 30.0   # how long fds and threads may take to return to the baseline after the soak


@dataclass
class SoakConfig:
    """One soak run."""

    goals: int = 1000
    clients: int = 4
    max_tokens: int = 8
    cancel_rate: float = 0.2
    invalid_rate: float = 0.05
    model_path: str = ''          # '' = embedded SmolLM2
    max_context: int = 0          # 0 = the node's default (the tiny model needs 256)
    warmup: int = 40              # goals of the same mix before the baseline is taken
    max_words: int = 40           # prompt length (the tiny model's byte-level BPE: use ~4)
    session_rate: float = 0.3     # goals continuing one of 20 sessions (LRU keeps 8)
    goal_timeout_s: float = 120.0
    seed: int = 1
    node_name: str = ''
    rss_growth_limit: float = 0.05
    parallel_sequences: int = 1   # engine.parallel_sequences of the node (issue 14)
    priority_rate: float = 0.0    # goals with a random priority (half with preempt)
    # Tokens of the goals picked for cancelling: long enough that most cancels land while
    # they run (a batching node decodes the tiny model's tokens in well under 1 ms).
    cancel_tokens: int = CANCEL_TOKENS


@dataclass
class Sample:
    """The node process as the kernel sees it."""

    rss_bytes: int
    fds: int
    threads: int


@dataclass
class SoakReport:
    config: dict
    wall_s: float = 0.0
    goals_per_s: float = 0.0
    outcomes: Dict[str, int] = field(default_factory=dict)
    lost: int = 0
    lost_where: List[str] = field(default_factory=list)
    # Goals whose result LLMClient had to request again (a response lost on the way).
    recovered: int = 0
    # Goals paused by a preempting goal at least once (feedback.paused; issue 14).
    paused: int = 0
    unexpected: List[str] = field(default_factory=list)
    node_alive: bool = True
    node_exit_code: Optional[int] = None
    node_traceback: bool = False
    baseline: Optional[dict] = None
    final: Optional[dict] = None
    peak_rss_bytes: int = 0
    rss_growth: float = 0.0
    kv_after_warmup: int = -1
    kv_after_soak: int = -1
    kv_capacity: int = 0
    kv_peak_seen: int = 0
    node_counters: Dict[str, int] = field(default_factory=dict)
    checks: Dict[str, bool] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(self.checks.values())


def sample(pid: int) -> Sample:
    with open(f'/proc/{pid}/status') as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith('VmRSS:'))
    return Sample(rss_bytes=rss, fds=len(os.listdir(f'/proc/{pid}/fd')),
                  threads=len(os.listdir(f'/proc/{pid}/task')))


class Transcripts:
    """Goal ids the node reports finished on ~/transcript (to tell where a loss happened)."""

    def __init__(self, node, server: str) -> None:
        from rclpy.qos import QoSProfile, ReliabilityPolicy

        from edge_llm_msgs.msg import Transcript
        self.finished: Dict[str, str] = {}
        node.create_subscription(Transcript, server + '/transcript', self._on_msg,
                                 QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE))

    def _on_msg(self, msg) -> None:
        self.finished[bytes(msg.goal_id.uuid).hex()] = msg.finish_reason

    def explain(self, record: dict) -> str:
        """Say where a lost goal was lost."""
        reason = self.finished.get(record['goal_id'])
        if not record['responded']:
            where = 'the node never finished it' if reason is None \
                else f'the node finished it ({reason})'
            return f'no goal response reached the client; {where}'
        if reason is None:
            return 'accepted, but the node never finished it'
        return f'the node finished it ({reason}) but the result never reached the client'


class Diagnostics:
    """The node's latest /diagnostics values (and the peak KV occupancy seen)."""

    def __init__(self, node, server: str) -> None:
        from diagnostic_msgs.msg import DiagnosticArray
        self._prefix = server + ':'
        self._lock = threading.Lock()
        self._latest: Dict[str, str] = {}
        self._count = 0
        self.kv_peak = 0
        node.create_subscription(DiagnosticArray, '/diagnostics', self._on_msg, 20)

    def _on_msg(self, msg) -> None:
        for status in msg.status:
            if status.name.startswith(self._prefix):
                values = {kv.key: kv.value for kv in status.values}
                with self._lock:
                    self._latest = values
                    self._count += 1
                    self.kv_peak = max(self.kv_peak, int(values.get('kv_used_tokens', 0)))

    def fresh(self, timeout: float = 10.0) -> Dict[str, str]:
        """Return the first status published after this call."""
        with self._lock:
            start = self._count
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._count > start:
                    return dict(self._latest)
            time.sleep(0.05)
        raise TimeoutError(f'no /diagnostics from {self._prefix[:-1]} within {timeout} s')

    def idle(self, timeout: float = 60.0) -> Dict[str, str]:
        """Wait for a status showing nothing queued and nothing generating."""
        deadline = time.monotonic() + timeout
        while True:
            values = self.fresh()
            if values.get('queue_waiting') == '0' and values.get('generating') == 'false':
                return values
            if time.monotonic() > deadline:
                raise TimeoutError('llm_node did not go idle')


def _prompt(rng: random.Random, max_words: int) -> str:
    return ' '.join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))


def _invalid_kinds(config: SoakConfig) -> tuple:
    # Added only with priorities on, so that earlier seeds keep their goal sequences.
    return INVALID_KINDS + (('priority',) if config.priority_rate else ())


def _goal_kwargs(rng: random.Random, config: SoakConfig, invalid: Optional[str],
                 cancel: bool = False) -> dict:
    """Return the keyword arguments of LLMClient.generate for one random goal."""
    from edge_llm_msgs.msg import TensorHandle
    kw: dict = {'max_tokens': rng.randint(1, config.max_tokens)}
    if config.priority_rate and rng.random() < config.priority_rate:
        kw.update(priority=rng.randint(-5, 5), preempt=rng.random() < 0.5)
    if rng.random() < 0.3:
        kw['messages'] = [('user', _prompt(rng, config.max_words)),
                          ('assistant', _prompt(rng, config.max_words))]
    if rng.random() < 0.3:
        kw['system_prompt'] = _prompt(rng, config.max_words)
    if rng.random() < config.session_rate:
        kw['session_id'] = f'soak-{rng.randrange(SESSIONS)}'   # > max_sessions: eviction
    if rng.random() < 0.4:
        kw.update(temperature=0.7, top_p=0.9, seed=rng.randrange(1000))
    if rng.random() < 0.15:
        kw['stop'] = [rng.choice(WORDS)]
    if rng.random() < 0.1:
        kw['json_schema'] = rng.choice(SCHEMAS)
    prompt = _prompt(rng, config.max_words)
    if cancel:
        # A short prompt and no conversation, so that cancel_tokens fits in a small context.
        kw.pop('messages', None)
        kw.pop('system_prompt', None)
        kw.pop('session_id', None)
        kw.update(max_tokens=config.cancel_tokens, json_schema=LONG_SCHEMA)
    if invalid == 'empty':
        prompt = ''
        kw.pop('messages', None)
    elif invalid == 'role':
        kw['messages'] = [('operator', 'open the gripper')]
    elif invalid == 'sampling':
        kw['top_p'] = 1.5
    elif invalid == 'schema':
        kw['json_schema'] = '{"type": 5}'
    elif invalid == 'handle':
        kw['prefix_embeddings'] = [TensorHandle(pool_id='soak_no_such_pool', dtype='float32',
                                                shape=[1, 8], nbytes=32)]
    elif invalid == 'overflow':
        kw['max_tokens'] = 1_000_000
    elif invalid == 'priority':
        kw['priority'] = rng.choice([-101, 101, 1000])
    return {'prompt': prompt, **kw}


def _largest_goal(config: SoakConfig, session: int) -> dict:
    """Return a longest-case goal of the mix, continuing session `session`."""
    # '{{ x }}' is the word of WORDS with the most tokens in both test vocabularies.
    longest = ' '.join(['{{ x }}'] * config.max_words)
    return {'prompt': longest, 'system_prompt': longest, 'max_tokens': config.max_tokens,
            'messages': [('user', longest), ('assistant', longest)],
            'session_id': f'soak-{session}'}


class ClientThread(threading.Thread):
    """One client node sending goals until the shared budget is spent."""

    def __init__(self, llm, config: SoakConfig, budget, results: list, lock, seed: int) -> None:
        super().__init__(daemon=True)
        self.llm, self.config, self.budget = llm, config, budget
        self.results, self.lock = results, lock
        self.rng = random.Random(seed)

    def run(self) -> None:
        from edge_llm_ros.client import GoalRejectedError, LLMClientError
        while next(self.budget, None) is not None:
            invalid = self.rng.choice(_invalid_kinds(self.config)) \
                if self.rng.random() < self.config.invalid_rate else None
            cancel = invalid is None and self.rng.random() < self.config.cancel_rate
            record = {'invalid': invalid, 'cancel': cancel, 'status': 'lost', 'error': '',
                      'goal_id': '', 'responded': False, 'result_requests': 0,
                      'paused': False}

            def on_feedback(feedback, record=record) -> None:
                record['paused'] = record['paused'] or feedback.paused
            handle = None
            try:
                handle = self.llm.generate(**_goal_kwargs(self.rng, self.config, invalid,
                                                          cancel), on_feedback=on_feedback)
                if cancel:
                    time.sleep(self.rng.choice([0.0, 0.005, 0.02, 0.05]))
                    handle.cancel(timeout=self.config.goal_timeout_s)
                outcome = handle.result(timeout=self.config.goal_timeout_s)
                record.update(status=outcome.status, error=outcome.error_message,
                              finish=outcome.finish_reason, tokens=outcome.completion_tokens)
            except GoalRejectedError as exc:
                record.update(status='rejected', error=str(exc))
            except (TimeoutError, LLMClientError) as exc:
                record.update(status='lost', error=f'{type(exc).__name__}: {exc}')
            if handle is not None:   # for the loss diagnosis
                record.update(goal_id=handle.goal_id, responded=handle.responded,
                              result_requests=handle.result_requests)
            with self.lock:
                self.results.append(record)


def _drive(clients, config: SoakConfig, goals: int, seed: int, node: NodeProcess,
           log=None) -> tuple:
    """Send `goals` goals from every client at once; return (records, peak node RSS)."""
    results: list = []
    lock = threading.Lock()
    budget = iter(range(goals))
    threads = [ClientThread(c, config, budget, results, lock, seed * 100 + i)
               for i, c in enumerate(clients)]
    for thread in threads:
        thread.start()
    peak, last_log = 0, time.monotonic()
    while any(t.is_alive() for t in threads) and node.alive():
        time.sleep(0.25)
        if node.alive():
            peak = max(peak, sample(node.pid).rss_bytes)
        if log is not None and time.monotonic() - last_log > 15:
            last_log = time.monotonic()
            log(f'soak: {len(results)}/{goals} goals, rss {peak / 2**20:.1f} MiB peak')
    for thread in threads:
        thread.join(timeout=config.goal_timeout_s)
    return results, peak


def _unexpected(record: dict) -> Optional[str]:
    """Why a finished goal's outcome contradicts what was sent, or None."""
    status = record['status']
    if status == 'lost':
        return f'lost: {record["error"]}'
    if record['invalid']:
        if status != 'aborted' or not record['error'].strip():
            return f'invalid goal ({record["invalid"]}) ended {status}: {record["error"]!r}'
        return None
    if status == 'aborted':
        return f'valid goal aborted: {record["error"]}'
    if status == 'canceled' and not record['cancel']:
        return 'canceled without a cancel request'
    if status == 'rejected':
        return f'rejected: {record["error"]}'
    return None


def run_soak(config: SoakConfig, log=print) -> SoakReport:
    """Run one soak against a fresh llm_node process; see the module docstring."""
    import rclpy
    from rclpy.executors import MultiThreadedExecutor

    from edge_llm_ros.client import LLMClient
    from edge_llm_ros.node_process import NodeProcess, NodeStopError
    name = config.node_name or f'llm_soak_{os.getpid()}'
    server = '/' + name
    params: Dict[str, object] = {'autostart': True, 'model.path': config.model_path,
                                 'max_tokens': config.max_tokens,
                                 'diagnostics.period_s': 0.5,
                                 'engine.parallel_sequences': config.parallel_sequences}
    if config.max_context:
        params['kv.max_context'] = config.max_context
    report = SoakReport(config=asdict(config))
    node = NodeProcess('llm_node', name=name, params=params, keep_lines=300)
    rclpy.init()
    executor = MultiThreadedExecutor(num_threads=4 + config.clients)
    ros_nodes, clients = [], []
    spin = threading.Thread(target=executor.spin, daemon=True)
    try:
        for i in range(config.clients):
            ros_node = rclpy.create_node(f'soak_client_{os.getpid()}_{i}')
            executor.add_node(ros_node)
            ros_nodes.append(ros_node)
        diag = Diagnostics(ros_nodes[0], server)
        transcripts = Transcripts(ros_nodes[0], server)
        spin.start()
        clients = [LLMClient(n, server) for n in ros_nodes]
        node.wait_until_active(clients[0], timeout=180)
        for client in clients:
            if not client.wait_for_server(timeout=120):
                raise RuntimeError(f'{server}/generate never appeared:\n{node.tail()}')
        log(f'soak: {name} (pid {node.pid}) active; warm-up {config.warmup} goals')

        probe = {'prompt': 'What color is the sky?', 'max_tokens': 4}

        def run_probe() -> None:
            # With N slots each keeps its last sequence for prefix reuse, so occupancy
            # depends on which slots the last goals took: empty them all first (a slot
            # that is not freed shows up as more than the probe's own positions).
            if config.parallel_sequences > 1:
                clients[0].reset_session('', timeout=30)
            clients[0].generate(**probe).result(timeout=120)
        # Warm-up, part 1: the largest request of the mix once per session id, so the ORT
        # arena has seen the longest prefill and the session LRU holds its largest prefixes
        # (memory that is reused later, not leaked). Part 2: the mix itself (cancels,
        # invalid goals, schemas) so every code path has allocated its caches.
        for session in range(SESSIONS):
            outcome = clients[0].generate(**_largest_goal(config, session)).result(timeout=120)
            if outcome.status != 'succeeded':
                raise RuntimeError(f'the largest warm-up goal failed: {outcome}')
        warm = _drive(clients, config, config.warmup, config.seed + 7919, node)[0]
        bad = [u for u in map(_unexpected, warm) if u]
        if bad:
            raise RuntimeError(f'warm-up goals went wrong: {bad[:5]}')
        run_probe()
        diag.idle()
        report.kv_after_warmup = int(diag.fresh()['kv_used_tokens'])
        base = sample(node.pid)
        report.baseline = asdict(base)
        log(f'soak: baseline rss {base.rss_bytes / 2**20:.1f} MiB, {base.fds} fds, '
            f'{base.threads} threads, kv {report.kv_after_warmup}')

        start = time.monotonic()
        results, peak = _drive(clients, config, config.goals, config.seed, node, log)
        peak = max(peak, base.rss_bytes)
        report.wall_s = round(time.monotonic() - start, 1)
        report.goals_per_s = round(len(results) / max(report.wall_s, 1e-9), 2)
        report.node_alive = node.alive()
        report.outcomes = dict(collections.Counter(r['status'] for r in results))
        report.lost = config.goals - sum(v for k, v in report.outcomes.items() if k != 'lost')
        report.unexpected = [u for u in map(_unexpected, results) if u][:20]
        report.lost_where = [transcripts.explain(r) for r in results if r['status'] == 'lost']
        report.recovered = sum(r['result_requests'] > 1 for r in results)
        report.paused = sum(r['paused'] for r in results)

        if report.node_alive:
            diag.idle()
            run_probe()
            idle = diag.idle()
            report.kv_after_soak = int(diag.fresh()['kv_used_tokens'])
            report.kv_capacity = int(idle['kv_capacity_tokens'])
            # Executor threads finish their last callbacks in their own time (slower under
            # load): wait up to SETTLE_S for fds and threads to return, then take the sample.
            settle_until = time.monotonic() + SETTLE_S
            final = sample(node.pid)
            while (final.fds, final.threads) != (base.fds, base.threads) and \
                    time.monotonic() < settle_until:
                time.sleep(0.25)
                final = sample(node.pid)
            report.final = asdict(final)
            report.peak_rss_bytes = max(peak, final.rss_bytes)
            report.rss_growth = round((final.rss_bytes - base.rss_bytes) / base.rss_bytes, 4)
            report.node_counters = {k: int(idle[k]) for k in (
                'goals_succeeded', 'goals_cancelled', 'goals_aborted', 'invalid_requests',
                'rejected_queue_full', 'rejected_not_active')}
        report.kv_peak_seen = diag.kv_peak
    finally:
        for client in clients:
            client.destroy()
        executor.shutdown(timeout_sec=2)
        if spin.is_alive():
            spin.join(timeout=5)
        for ros_node in ros_nodes:
            ros_node.destroy_node()
        rclpy.try_shutdown()
        try:
            report.node_exit_code = node.stop()
        except NodeStopError as exc:
            log(f'soak: {exc}')
            report.node_exit_code = exc.returncode
        report.node_traceback = 'Traceback' in node.log()
    final = report.final or {}
    report.checks = {
        'node never crashed': report.node_alive and report.node_exit_code == 0 and
        not report.node_traceback,
        'every goal ended in a terminal state': report.lost == 0,
        'outcomes match what was sent': not report.unexpected,
        f'rss growth <= {config.rss_growth_limit:.0%}':
            report.final is not None and report.rss_growth <= config.rss_growth_limit,
        'fds back to baseline': final.get('fds') == report.baseline['fds']
        if report.baseline else False,
        'threads back to baseline': final.get('threads') == report.baseline['threads']
        if report.baseline else False,
        'kv occupancy back to the probe baseline':
            report.kv_after_soak == report.kv_after_warmup,
    }
    if not report.ok:
        log('soak: node log tail:\n' + node.tail())
    return report


def tiny_model(cache: pathlib.Path) -> str:
    """Build (once) and return the tiny random test model of test/tiny_model.py."""
    built = cache / 'tiny-llama-0'
    if (built / 'model.yaml').is_file():
        return str(built)
    sys.path.insert(0, str(ROOT / 'test'))
    from tiny_model import tiny_model_dir
    return str(tiny_model_dir(cache))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--goals', type=int, default=1000)
    parser.add_argument('--clients', type=int, default=4)
    parser.add_argument('--max-tokens', type=int, default=8)
    parser.add_argument('--cancel-rate', type=float, default=0.2)
    parser.add_argument('--invalid-rate', type=float, default=0.05)
    parser.add_argument('--warmup', type=int, default=40)
    parser.add_argument('--seed', type=int, default=1)
    parser.add_argument('--session-rate', type=float, default=0.3)
    parser.add_argument('--model-path', default='', help="'' = the embedded SmolLM2")
    parser.add_argument('--tiny', action='store_true', help='the tiny random test model')
    parser.add_argument('--json', default='', help='also write the JSON report here')
    parser.add_argument('--parallel-sequences', type=int, default=1,
                        help='engine.parallel_sequences of the node (goals batched together)')
    parser.add_argument('--priority-rate', type=float, default=0.0,
                        help='share of goals with a random priority (half with preempt)')
    args = parser.parse_args(argv)
    config = SoakConfig(goals=args.goals, clients=args.clients, max_tokens=args.max_tokens,
                        cancel_rate=args.cancel_rate, invalid_rate=args.invalid_rate,
                        warmup=args.warmup, seed=args.seed, model_path=args.model_path,
                        session_rate=args.session_rate,
                        parallel_sequences=args.parallel_sequences,
                        priority_rate=args.priority_rate)
    if args.tiny:
        config.model_path = tiny_model(ROOT / '.cache' / 'soak_tiny')
        config.max_context = 256
        config.max_words = 4
    report = run_soak(config, log=lambda m: print(m, file=sys.stderr, flush=True))
    text = json.dumps({**asdict(report), 'ok': report.ok}, indent=2)
    print(text)
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(text + '\n')
    mib = 2**20
    base, final = report.baseline or {}, report.final or {}
    print(f'\n{report.config["goals"]} goals, {report.config["clients"]} clients, '
          f'{report.wall_s} s ({report.goals_per_s} goals/s): {report.outcomes}, '
          f'{report.recovered} results requested again, {report.paused} goals paused')
    print(f'rss {base.get("rss_bytes", 0) / mib:.1f} -> {final.get("rss_bytes", 0) / mib:.1f}'
          f' MiB ({report.rss_growth:+.2%}, peak {report.peak_rss_bytes / mib:.1f}); fds '
          f'{base.get("fds")} -> {final.get("fds")}; threads {base.get("threads")} -> '
          f'{final.get("threads")}; kv {report.kv_after_warmup} -> {report.kv_after_soak} '
          f'(peak {report.kv_peak_seen}/{report.kv_capacity})')
    for name, ok in report.checks.items():
        print(f'  [{"ok" if ok else "FAIL"}] {name}')
    for line in report.unexpected + report.lost_where:
        print(f'    {line}')
    return 0 if report.ok else 1


if __name__ == '__main__':
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
