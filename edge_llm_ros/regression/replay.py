"""Replay a recorded llm_node session against a running llm_node and report what changed.

    edge-llm-replay BAG [--node /llm_node] [--timing fast|original] [--thresholds FILE]
                        [--out NEWBAG] [--report DIR] [--set max_tokens=8 ...]

Every recorded goal is sent again through the real Generate action; the node's new
transcripts (and feedback/status) go into a new bag, the two runs are compared
(compare.py) and a report is written (report.py), also when the run fails early.
Exit status: 0 pass, 1 regression, 2 bad input (bag, thresholds), 3 node unavailable,
130 interrupted (Ctrl-C; the report covers what was answered).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields, replace
import datetime
import json
from pathlib import Path
import signal
import sys
import threading
import time
from typing import Any, Optional, Sequence
import uuid

from edge_llm_ros.regression.bagio import (
    BagContents, BagWriter, LlmTopics, read_bag, STORAGES, TRANSCRIPT_TYPE)
from edge_llm_ros.regression.compare import (
    compare_run, ComparisonResult, EXIT_INPUT, ReplayOutcome)
from edge_llm_ros.regression.errors import NodeUnavailableError, RegressionToolError
from edge_llm_ros.regression.records import (
    SamplingRecord, transcript_from_msg, TranscriptRecord, uuid_bytes)
from edge_llm_ros.regression.report import now_iso, RunInfo, write_report
from edge_llm_ros.regression.thresholds import load_thresholds, Thresholds

TIMINGS = ('fast', 'original')
INTERRUPTED = 'interrupted (Ctrl-C): the goals not answered yet were not compared'
EXIT_INTERRUPTED = 130
# Goal fields `--set` may override, with their types.
_GOAL_OVERRIDES = {'max_tokens': int, 'system_prompt': str, 'json_schema': str,
                   'session_id': str}
_SAMPLING_OVERRIDES = {f.name: f.type for f in fields(SamplingRecord)}


@dataclass
class ReplayOptions:
    bag: str
    node: str = '/llm_node'
    timing: str = 'fast'
    thresholds_file: str = ''
    out_bag: str = ''
    report_dir: str = ''
    storage: str = 'mcap'
    overrides: dict = field(default_factory=dict)   # e.g. {'max_tokens': 8}
    skip_tensor_goals: bool = False
    server_timeout_s: float = 30.0
    goal_timeout_s: float = 300.0
    # The node publishes its transcript right after the result; a loaded machine may delay it.
    transcript_wait_s: float = 10.0


def parse_override(text: str) -> tuple:
    """'max_tokens=8' / 'sampling.temperature=0.7' -> (key, typed value)."""
    key, sep, raw = text.partition('=')
    key = key.strip()
    if not sep:
        raise ValueError(f"override '{text}' must look like KEY=VALUE")
    if key.startswith('sampling.'):
        name = key.split('.', 1)[1]
        if name not in _SAMPLING_OVERRIDES:
            raise ValueError(f"unknown sampling field '{name}'; known: "
                             f"{', '.join(_SAMPLING_OVERRIDES)}")
        kind = float if _SAMPLING_OVERRIDES[name] in (float, 'float') else int
    elif key in _GOAL_OVERRIDES:
        kind = _GOAL_OVERRIDES[key]
    else:
        raise ValueError(f"cannot override '{key}'; allowed: "
                         f"{', '.join(list(_GOAL_OVERRIDES) + ['sampling.<field>'])}")
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"override {key} needs a {kind.__name__}, got '{raw}'") from None
    if kind is int and key == 'max_tokens' and value < 0:
        raise ValueError('max_tokens must be >= 0')
    return key, value


def apply_overrides(record: TranscriptRecord, overrides: dict) -> TranscriptRecord:
    """Return the request of `record` with `overrides` applied (`record` is unchanged)."""
    goal_values = {k: v for k, v in overrides.items() if not k.startswith('sampling.')}
    sampling_values = {k.split('.', 1)[1]: v for k, v in overrides.items()
                       if k.startswith('sampling.')}
    return replace(record, sampling=replace(record.sampling, **sampling_values), **goal_values)


# ---------------------------------------------------------------- rclpy part

def _goal_msg(record: TranscriptRecord) -> Any:
    from edge_llm_msgs.action import Generate
    from edge_llm_msgs.msg import ChatMessage, SamplingParams, TensorHandle

    goal = Generate.Goal()
    goal.prompt = record.prompt
    goal.messages = [ChatMessage(role=m.role, content=m.content) for m in record.messages]
    goal.system_prompt = record.system_prompt
    s = record.sampling
    goal.sampling = SamplingParams(
        temperature=float(s.temperature), top_k=int(s.top_k), top_p=float(s.top_p),
        min_p=float(s.min_p), repetition_penalty=float(s.repetition_penalty),
        presence_penalty=float(s.presence_penalty), seed=int(s.seed))
    goal.max_tokens = int(record.max_tokens)
    goal.stop = list(record.stop)
    goal.json_schema = record.json_schema
    handles = []
    for h in record.prefix_embeddings:
        msg = TensorHandle(pool_id=h.pool_id, slot=h.slot, generation=h.generation,
                           sequence=h.sequence, buffer_kind=h.buffer_kind, dtype=h.dtype,
                           shape=list(h.shape), strides=list(h.strides),
                           byte_offset=h.byte_offset, nbytes=h.nbytes)
        msg.header.frame_id = h.frame_id
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(h.stamp_ns, 1_000_000_000)
        handles.append(msg)
    goal.prefix_embeddings = handles
    goal.session_id = record.session_id
    return goal


def _synthesize(request: TranscriptRecord, goal_id: str, result: Any,
                sent_ns: int) -> Any:
    """Build a Transcript from the action result, for a node that published none."""
    from edge_llm_msgs.msg import Transcript

    msg = Transcript()
    msg.goal_id.uuid = list(uuid_bytes(goal_id))
    msg.source = Transcript.SOURCE_ACTION
    msg.accepted_stamp.sec, msg.accepted_stamp.nanosec = divmod(sent_ns, 1_000_000_000)
    msg.finished_stamp.sec, msg.finished_stamp.nanosec = divmod(time.time_ns(), 1_000_000_000)
    goal = _goal_msg(request)
    for name in ('prompt', 'messages', 'system_prompt', 'sampling', 'max_tokens', 'stop',
                 'json_schema', 'prefix_embeddings', 'session_id'):
        setattr(msg, name, getattr(goal, name))
    msg.accepted = result is not None
    if result is not None:
        for name in ('text', 'token_ids', 'finish_reason', 'prompt_tokens',
                     'completion_tokens', 'timings', 'error_message'):
            setattr(msg, name, getattr(result, name))
    return msg


class _GoalRun:
    """One goal in flight: send, then collect result and transcript."""

    def __init__(self, runner: 'ReplayRunner', index: int, request: TranscriptRecord) -> None:
        self.runner = runner
        self.index = index
        self.request = request
        self.goal_id = uuid.uuid4().hex
        self.sent_ns = 0
        self.started = 0.0
        self.accepted = threading.Event()
        self.done = threading.Event()
        self.goal_handle = None
        self.result = None
        self.status_code = None
        self.send_error = ''

    def start(self) -> None:
        self.runner.expect(self.goal_id)
        self.sent_ns = time.time_ns()
        self.started = time.monotonic()
        # rclpy's ActionClient is not thread-safe (a response handled before
        # send_goal_async stored its future is dropped): send from the executor thread.
        self.runner.executor.create_task(self._send)

    def _send(self) -> None:
        from unique_identifier_msgs.msg import UUID
        try:
            future = self.runner.client.send_goal_async(
                _goal_msg(self.request), goal_uuid=UUID(uuid=list(uuid_bytes(self.goal_id))))
        except Exception as exc:  # reported as this goal's failure
            self.send_error = f'sending the goal failed: {type(exc).__name__}: {exc}'
            self.accepted.set()
            self.done.set()
            return
        future.add_done_callback(self._on_goal_response)

    def cancel(self) -> None:
        if self.goal_handle is not None:
            self.runner.executor.create_task(self.goal_handle.cancel_goal_async)

    def _on_goal_response(self, future) -> None:
        try:
            self.goal_handle = future.result()
        except Exception as exc:  # reported as this goal's failure
            self.send_error = f'sending the goal failed: {exc}'
            self.accepted.set()
            self.done.set()
            return
        self.accepted.set()
        if not self.goal_handle.accepted:
            self.done.set()
            return
        self.goal_handle.get_result_async().add_done_callback(self._on_result)

    def _on_result(self, future) -> None:
        try:
            response = future.result()
            self.result, self.status_code = response.result, response.status
        except Exception as exc:  # reported as this goal's failure
            self.send_error = f'getting the result failed: {exc}'
        self.done.set()

    def finish(self, options: ReplayOptions) -> ReplayOutcome:
        from action_msgs.msg import GoalStatus
        if not self.accepted.wait(options.server_timeout_s):
            return ReplayOutcome('timeout', None, f'no goal response within '
                                 f'{options.server_timeout_s:g} s')
        if self.send_error:
            return ReplayOutcome('aborted', None, self.send_error)
        if not self.goal_handle.accepted:
            new = self.runner.wait_transcript(self.goal_id, options.transcript_wait_s)
            return ReplayOutcome('rejected', new, 'the node rejected the goal')
        remaining = options.goal_timeout_s - (time.monotonic() - self.started)
        if not self.done.wait(max(remaining, 0.0)):
            self.cancel()
            return ReplayOutcome('timeout', None,
                                 f'no result within {options.goal_timeout_s:g} s (canceled)')
        if self.send_error:
            return ReplayOutcome('aborted', None, self.send_error)
        status = {GoalStatus.STATUS_SUCCEEDED: 'ok', GoalStatus.STATUS_ABORTED: 'aborted',
                  GoalStatus.STATUS_CANCELED: 'canceled'}.get(self.status_code, 'aborted')
        new = self.runner.wait_transcript(self.goal_id, options.transcript_wait_s)
        if new is not None:
            return ReplayOutcome(status, new)
        msg = _synthesize(self.request, self.goal_id, self.result, self.sent_ns)
        self.runner.write_synthesized(msg)
        record = transcript_from_msg(msg, time.time_ns(), self.runner.topics.transcript)
        return ReplayOutcome(status, record, synthesized=True)


class ReplayRunner:
    """rclpy side of a replay: the action client, the new bag and the transcripts."""

    def __init__(self, options: ReplayOptions, writer: BagWriter) -> None:
        import rclpy
        from rclpy.action import ActionClient
        from rclpy.executors import SingleThreadedExecutor

        from edge_llm_msgs.action import Generate
        from edge_llm_ros.regression.live import RawRecorder

        self.options = options
        self.topics = LlmTopics(options.node)
        self.writer = writer
        self._expected = set()
        self._transcripts = {}
        self._cond = threading.Condition()
        self._own_context = not rclpy.ok()
        if self._own_context:
            # Ctrl-C stays a KeyboardInterrupt of the main thread: the replay then stops
            # sending, keeps what it has and still writes its report.
            from rclpy.signals import SignalHandlerOptions
            rclpy.init(args=None, signal_handler_options=SignalHandlerOptions.NO)
        self.node = rclpy.create_node('edge_llm_replay')
        self.client = ActionClient(self.node, Generate, self.topics.action)
        self.recorder = RawRecorder(self.node, writer, self.topics.core(),
                                    goal_filter=self._is_ours, on_message=self._on_message)
        self.executor = SingleThreadedExecutor()
        self.executor.add_node(self.node)
        self._spinner = threading.Thread(target=self._spin, daemon=True)
        self._stop = threading.Event()
        self._spinner.start()
        self.synthesized = []
        self.node_publishes_transcripts = True

    def _spin(self) -> None:
        from rclpy.executors import ExternalShutdownException
        try:
            while not self._stop.is_set():
                self.executor.spin_once(timeout_sec=0.05)
        except ExternalShutdownException:
            pass  # the context went down (another owner shut it): nothing left to serve

    def _is_ours(self, goal_id: str) -> bool:
        with self._cond:
            return goal_id in self._expected

    def expect(self, goal_id: str) -> None:
        with self._cond:
            self._expected.add(goal_id)

    def _on_message(self, topic: str, msgtype: str, stamp: int, data: bytes) -> None:
        if msgtype != TRANSCRIPT_TYPE:
            return
        from rclpy.serialization import deserialize_message

        from edge_llm_msgs.msg import Transcript
        record = transcript_from_msg(deserialize_message(data, Transcript), stamp, topic)
        with self._cond:
            self._transcripts[record.goal_id] = record
            self._cond.notify_all()

    def wait_transcript(self, goal_id: str, timeout_s: float) -> Optional[TranscriptRecord]:
        if not self.node_publishes_transcripts:
            timeout_s = 0.0
        with self._cond:
            self._cond.wait_for(lambda: goal_id in self._transcripts, timeout_s)
            return self._transcripts.get(goal_id)

    def write_synthesized(self, msg: Any) -> None:
        from rclpy.serialization import serialize_message
        self.writer.add_topic(self.topics.transcript, TRANSCRIPT_TYPE)
        self.writer.write(self.topics.transcript, time.time_ns(), serialize_message(msg))
        self.synthesized.append(msg)

    def wait_for_node(self) -> None:
        """Block until the action server answers; also let the transcript topic match."""
        if not self.client.wait_for_server(timeout_sec=self.options.server_timeout_s):
            raise NodeUnavailableError(
                f'no Generate action server at {self.topics.action} after '
                f'{self.options.server_timeout_s:g} s: start llm_node (or pass --node with its '
                'full name, e.g. /robot/llm_node) and check ROS_DOMAIN_ID')
        from edge_llm_ros.regression.live import wait_until_active
        wait_until_active(self.node, self.options.node, self.options.server_timeout_s,
                          time.sleep)
        # Transcripts published before the subscription matched would be lost.
        deadline = time.monotonic() + min(self.options.server_timeout_s, 5.0)
        while self.recorder.publisher_count(self.topics.transcript) == 0 and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        self.node_publishes_transcripts = \
            self.recorder.publisher_count(self.topics.transcript) > 0
        if not self.node_publishes_transcripts:
            print(f'edge-llm-replay: warning: nothing publishes {self.topics.transcript}: '
                  'new transcripts are built from the action results', file=sys.stderr)

    def server_ready(self) -> bool:
        return self.client.server_is_ready()

    def close(self) -> None:
        import rclpy
        self._stop.set()
        self._spinner.join(timeout=2.0)
        self.recorder.close()
        self.client.destroy()
        self.executor.shutdown()
        self.node.destroy_node()
        if self._own_context:
            rclpy.try_shutdown()


class CtrlC:
    """Ctrl-C as a sticky flag as well as a KeyboardInterrupt of the main thread.

    A KeyboardInterrupt that lands where Python swallows exceptions (a __del__ or weakref
    callback run by the garbage collector, 'Exception ignored in ...') would otherwise let
    the replay run to the end and exit 1; the flag still says the user interrupted. After
    the replay phase (`quiet()`), Ctrl-C only sets the flag, so the report is still written.
    """

    def __init__(self) -> None:
        self.event = threading.Event()
        self._raise = True
        self._previous: Any = None

    def __enter__(self) -> 'CtrlC':
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _on_sigint(self, signum, frame) -> None:
        self.event.set()
        if self._raise:
            raise KeyboardInterrupt

    def quiet(self) -> None:
        self._raise = False

    def check(self) -> None:
        """Raise KeyboardInterrupt if Ctrl-C was pressed (even if its exception was lost)."""
        if self.event.is_set():
            raise KeyboardInterrupt


def _send_times(olds: Sequence[TranscriptRecord], timing: str) -> list:
    """Seconds after the start at which each goal is sent (None = after the previous)."""
    if timing == 'fast':
        return [None] * len(olds)
    stamps = [o.accepted_stamp_ns or o.bag_stamp_ns for o in olds]
    first = min(stamps) if stamps else 0
    return [(s - first) / 1e9 for s in stamps]


def replay_goals(runner: ReplayRunner, olds: Sequence[TranscriptRecord],
                 options: ReplayOptions, ctrl_c: Optional[CtrlC] = None) -> tuple:
    """Send every goal; returns (outcomes, goal map old id -> new id, fatal error or '')."""
    ctrl_c = ctrl_c or CtrlC()
    outcomes: list = [None] * len(olds)
    goal_map = {}
    runs = []
    error = ''
    times = _send_times(olds, options.timing)
    start = time.monotonic()
    try:
        for index, old in enumerate(olds):
            ctrl_c.check()
            if options.skip_tensor_goals and old.prefix_embeddings:
                outcomes[index] = ReplayOutcome(
                    'skipped', None, '--skip-tensor-goals: the goal carries tensor handles')
                continue
            if not runner.server_ready() and not runner.client.wait_for_server(
                    timeout_sec=options.server_timeout_s):
                error = (f'the action server {runner.topics.action} went away before goal '
                         f'{index}: the remaining goals were not replayed')
                break
            if times[index] is not None:
                time.sleep(max(0.0, start + times[index] - time.monotonic()))
            run = _GoalRun(runner, index, apply_overrides(old, options.overrides))
            run.start()
            goal_map[old.goal_id] = run.goal_id
            runs.append(run)
            if times[index] is None:
                outcomes[index] = run.finish(options)
                _progress(index, len(olds), outcomes[index])
        for run in runs:
            ctrl_c.check()
            if outcomes[run.index] is None:
                outcomes[run.index] = run.finish(options)
                _progress(run.index, len(olds), outcomes[run.index])
        ctrl_c.check()
        ctrl_c.quiet()   # closing the bag and writing the report must not be interrupted
    except KeyboardInterrupt:
        ctrl_c.quiet()
        error = INTERRUPTED
        for run in runs:
            if outcomes[run.index] is None:
                run.cancel()
    for index, outcome in enumerate(outcomes):
        if outcome is None:
            outcomes[index] = ReplayOutcome('not_sent', None, error or 'not sent')
    return outcomes, goal_map, error


def _progress(index: int, total: int, outcome: ReplayOutcome) -> None:
    new = outcome.new
    tail = f'{new.finish_reason}, {new.completion_tokens} tokens' if new else outcome.detail
    print(f'edge-llm-replay: goal {index + 1}/{total}: {outcome.status} ({tail})', flush=True)


# ---------------------------------------------------------------- orchestration

def _default_report_dir() -> str:
    stamp = datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
    return f'regression_report_{stamp}'


def run_replay(options: ReplayOptions) -> int:
    """Replay, compare, write the report; returns the exit status."""
    report_dir = options.report_dir or _default_report_dir()
    out_bag = options.out_bag or str(Path(report_dir) / 'replay_bag')
    run = RunInfo(bag=options.bag, new_bag=out_bag, node=options.node, timing=options.timing,
                  overrides=dict(options.overrides), thresholds_file=options.thresholds_file,
                  started=now_iso())
    result = ComparisonResult()
    thresholds = Thresholds()
    with CtrlC() as ctrl_c:
        return _run_replay(options, report_dir, out_bag, run, result, thresholds, ctrl_c)


def _run_replay(options: ReplayOptions, report_dir: str, out_bag: str, run: RunInfo,
                result: ComparisonResult, thresholds: Thresholds, ctrl_c: CtrlC) -> int:
    try:
        thresholds = load_thresholds(options.thresholds_file)
        run.thresholds = thresholds.to_dict()
        contents = read_bag(options.bag)
        run.notes.extend(contents.warnings)
        for problem in contents.problems + contents.warnings:
            print(f'edge-llm-replay: warning: {problem}', file=sys.stderr)
        outcomes, error = _replay_into_bag(contents, options, out_bag, ctrl_c)
        ctrl_c.quiet()
        if ctrl_c.event.is_set():
            error = INTERRUPTED
        result = compare_run(contents.transcripts, outcomes, thresholds, contents.problems)
        if error:
            run.error = error
            run.exit_code = EXIT_INTERRUPTED if error == INTERRUPTED else \
                NodeUnavailableError.exit_code
    except RegressionToolError as exc:
        run.error = str(exc)
        run.exit_code = exc.exit_code
        run.thresholds = run.thresholds or thresholds.to_dict()
    run.finished = now_iso()
    if ctrl_c.event.is_set() and run.exit_code is None:
        run.error, run.exit_code = run.error or INTERRUPTED, EXIT_INTERRUPTED
    if run.exit_code is None:
        run.exit_code = result.exit_code()
    try:
        data = write_report(result, run, report_dir)
    except OSError as exc:
        print(f'edge-llm-replay: cannot write the report into {report_dir}: {exc}',
              file=sys.stderr)
        return run.exit_code or EXIT_INPUT
    _print_summary(data, report_dir)
    return run.exit_code


def _replay_into_bag(contents: BagContents, options: ReplayOptions, out_bag: str,
                     ctrl_c: Optional[CtrlC] = None) -> tuple:
    writer = BagWriter(out_bag, storage=options.storage)
    runner = None
    outcomes: list = [ReplayOutcome('not_sent', None, 'the node was not reached')
                      for _ in contents.transcripts]
    goal_map: dict = {}
    error = ''
    try:
        runner = ReplayRunner(options, writer)
        runner.wait_for_node()
        outcomes, goal_map, error = replay_goals(runner, contents.transcripts, options, ctrl_c)
    except NodeUnavailableError as exc:
        error = str(exc)
    finally:
        if runner is not None:
            runner.close()
        writer.set_custom_data('edge_llm_ros.replay_of', str(Path(options.bag).resolve()))
        writer.set_custom_data('edge_llm_ros.goal_map', json.dumps(goal_map))
        if options.overrides:
            writer.set_custom_data('edge_llm_ros.overrides', json.dumps(options.overrides))
        writer.close()
    return outcomes, error


def _print_summary(data: dict, report_dir: str) -> None:
    summary = data['summary']
    print(f"edge-llm-replay: {data['verdict']}: {summary['goals']} goals, "
          f"{summary['compared']} compared, greedy exact {summary['greedy_exact']}/"
          f"{summary['greedy_compared']}, {summary['regressions']} regressions, "
          f"{summary['input_problems']} input problems", flush=True)
    if data['run']['error']:
        print(f"edge-llm-replay: error: {data['run']['error']}", file=sys.stderr, flush=True)
    for finding in data['findings']:
        if finding['severity'] in ('regression', 'input'):
            where = 'run' if finding['goal'] is None else f"goal {finding['goal']}"
            print(f"  {finding['severity']}: {finding['code']} ({where}): "
                  f"{finding['message']}", flush=True)
    print(f'edge-llm-replay: report in {report_dir}/ (summary.md, report.html, report.json)',
          flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog='edge-llm-replay',
        description='Send every goal of a recorded llm_node session to a running llm_node, '
                    'record the new answers and compare them with the recorded ones. Exit '
                    'status: 0 pass, 1 regression, 2 bad input, 3 node unavailable, '
                    '130 interrupted.')
    parser.add_argument('bag', help='bag folder (or .mcap/.db3 file) with transcripts')
    parser.add_argument('--node', default='/llm_node', help='full name of the llm_node')
    parser.add_argument('--timing', choices=TIMINGS, default='fast',
                        help='fast: each goal after the previous result; original: at the '
                             'recorded offsets (goals may overlap and queue)')
    parser.add_argument('--thresholds', default='', metavar='FILE',
                        help='thresholds YAML (default: built-in, see '
                             'config/regression_thresholds.yaml)')
    parser.add_argument('--out', default='', metavar='NEWBAG',
                        help='bag to write the new answers into (default: REPORT/replay_bag)')
    parser.add_argument('--report', default='', metavar='DIR',
                        help='report folder (default: ./regression_report_<time>)')
    parser.add_argument('--storage', choices=STORAGES, default='mcap')
    parser.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                        dest='overrides',
                        help='override a request field in every goal, e.g. max_tokens=8 or '
                             'sampling.temperature=0.7 (repeatable)')
    parser.add_argument('--skip-tensor-goals', action='store_true',
                        help='do not replay goals that carry tensor handles')
    parser.add_argument('--server-timeout', type=float, default=30.0, metavar='S',
                        help='seconds to wait for the action server (default 30)')
    parser.add_argument('--goal-timeout', type=float, default=300.0, metavar='S',
                        help='seconds one goal may take (default 300)')
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        overrides = dict(parse_override(text) for text in args.overrides)
        LlmTopics(args.node)
    except ValueError as exc:
        parser.error(str(exc))
    options = ReplayOptions(
        bag=args.bag, node=args.node, timing=args.timing, thresholds_file=args.thresholds,
        out_bag=args.out, report_dir=args.report, storage=args.storage, overrides=overrides,
        skip_tensor_goals=args.skip_tensor_goals, server_timeout_s=args.server_timeout,
        goal_timeout_s=args.goal_timeout)
    return run_replay(options)


if __name__ == '__main__':
    sys.exit(main())
