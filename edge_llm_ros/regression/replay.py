"""Replay a recorded llm_node session against a running llm_node and report what changed.

    edge-llm-replay BAG [--node /llm_node] [--timing fast|original] [--thresholds FILE]
                        [--out NEWBAG] [--report DIR] [--set max_tokens=8 ...]
                        [--cpu-class CLASS]

Every recorded goal is sent again through the real Generate action with LLMClient; the
node's new transcripts (and feedback/status) go into a new bag, the two runs are compared
(compare.py) and a report is written (report.py), also when the run fails early. Greedy
outputs must be identical when the bag's CPU class (cpu_class.py) is the node's; across
CPU classes float drift within the cross-CPU thresholds is a warning.
Exit status: 0 pass, 1 regression, 2 bad input (bag, thresholds), 3 node unavailable,
130 interrupted (Ctrl-C; the report covers what was answered).
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field, fields, replace
import datetime
import json
from pathlib import Path
import signal
import sys
import threading
import time
from typing import Any, Dict, Optional, Sequence

from lifecycle_msgs.srv import GetState
import rclpy
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.serialization import deserialize_message
from rclpy.signals import SignalHandlerOptions
from rclpy.time import Time as RosTime
from unique_identifier_msgs.msg import UUID

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import ChatMessage, TensorHandle, ToolCall, ToolSpec, Transcript
from edge_llm_ros.client import (GenerationHandle, GenerationOutcome, GoalRejectedError, LLMClient,
                                 LLMClientError, make_goal, NodeNotActiveError)
from edge_llm_ros.nodes.messages import build_transcript
from edge_llm_ros.regression.bagio import (BagContents, BagWriter, LlmTopics, read_bag, STORAGES,
                                           TRANSCRIPT_TYPE, wire_cdr)
from edge_llm_ros.regression.compare import (ABORTED, ACTION_STATUSES, compare_run,
                                             ComparisonResult, CpuClasses, EXIT_INPUT,
                                             NOT_SENT, REJECTED, ReplayOutcome, SKIPPED,
                                             TIMEOUT, TOKEN_RULE_TEXT)
from edge_llm_ros.regression.cpu_class import current_cpu_class, parse_cpu_class
from edge_llm_ros.regression.errors import (CpuClassError, NodeUnavailableError,
                                            RegressionToolError)
from edge_llm_ros.regression.live import RawRecorder
from edge_llm_ros.regression.records import (adapter_problem, ChatRecord, SamplingRecord,
                                             TensorHandleRecord, transcript_from_msg,
                                             TranscriptRecord, uuid_bytes)
from edge_llm_ros.regression.report import now_iso, RunInfo, write_report
from edge_llm_ros.regression.thresholds import load_thresholds, Thresholds

TIMINGS = ('fast', 'original')
INTERRUPTED = 'interrupted (Ctrl-C): the goals not answered yet were not compared'
EXIT_INTERRUPTED = 130
# Goal fields `--set` may override, with their types.
_GOAL_OVERRIDES = {'max_tokens': int, 'system_prompt': str, 'json_schema': str,
                   'session_id': str}
_SAMPLING_OVERRIDES = {f.name: f.type for f in fields(SamplingRecord)
                       if f.type in (float, int, 'float', 'int')}
# TensorHandle fields a TensorHandleRecord holds under the same name (the header apart).
_HANDLE_FIELDS = tuple(f.name for f in fields(TensorHandleRecord)
                       if f.name not in ('frame_id', 'stamp_ns'))
# How long a cancel (goal timeout, Ctrl-C) waits for the node's answer.
CANCEL_WAIT_S = 2.0


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
    # CPU class of the machine the node runs on ('' = this machine's, from /proc/cpuinfo).
    cpu_class: str = ''

    def node_cpu_class(self) -> str:
        """Return the CPU class the replayed answers are computed on."""
        return parse_cpu_class(self.cpu_class) if self.cpu_class else current_cpu_class()


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

def goal_fields(record: TranscriptRecord) -> dict:
    """Keyword arguments of `make_goal` (and LLMClient.generate) that resend `record`.

    Every sampling field goes as recorded, UNSET ones included, so the node applies its
    current defaults exactly where the recorded goal left them to it.
    """
    sampling = asdict(record.sampling)
    for name in ('logit_bias_token_ids', 'logit_bias_values'):
        sampling[name] = list(sampling[name])
    messages, history_mode = session_messages(record)
    return dict(prompt=record.prompt, messages=messages,
                system_prompt=record.system_prompt, max_tokens=record.max_tokens,
                stop=list(record.stop), json_schema=record.json_schema,
                session_id=record.session_id, history_mode=history_mode,
                prefix_embeddings=handle_msgs(record.prefix_embeddings),
                images=handle_msgs(record.images), raw_prompt=record.raw_prompt,
                max_image_tokens=record.max_image_tokens,
                video_frames=handle_msgs(record.video_frames),
                video_timestamps=list(record.video_timestamps), video_fps=record.video_fps,
                tools=[ToolSpec(name=t.name, description=t.description,
                                parameters=t.parameters) for t in record.tools],
                tool_choice=record.tool_choice,
                parallel_tool_calls=not record.no_parallel_tool_calls, grammar=record.grammar,
                regex=record.regex, choices=list(record.choices),
                reasoning={Generate.Goal.REASONING_ON: True,
                           Generate.Goal.REASONING_OFF: False}.get(record.reasoning_mode),
                reasoning_budget=(None if record.reasoning_budget < 0
                                  else record.reasoning_budget),
                priority=record.priority, preempt=record.preempt,
                no_speculation=record.no_speculation,
                lora={u.name: u.scale for u in record.lora}, **sampling)


def handle_msgs(records) -> list:
    """Return the TensorHandle messages of recorded handles (header included)."""
    handles = []
    for h in records:
        msg = TensorHandle(**{name: getattr(h, name) for name in _HANDLE_FIELDS})
        msg.header.frame_id = h.frame_id
        msg.header.stamp = RosTime(nanoseconds=h.stamp_ns).to_msg()
        handles.append(msg)
    return handles


def session_messages(record: TranscriptRecord) -> tuple:
    """(messages, history_mode) that resend a goal with the conversation it continued.

    A session goal is sent as HISTORY_REPLACE with the session's stored turns it continued
    (recorded in session_turns) followed by its own new turns: the replayed node then holds
    the same conversation before the goal as the recorded one did, whatever it held before
    (another replay, goals not in the bag). Without a session the goal goes as recorded.
    """
    messages = list(record.messages)
    if not record.session_id:
        return [chat_msg(m) for m in messages], record.history_mode
    stored = list(record.session_turns)
    own = messages
    if record.history_mode != Generate.Goal.HISTORY_REPLACE:
        if own and own[0].role == 'system' and own[0].content == record.system_prompt:
            own = own[1:]
        if record.history_mode == Generate.Goal.HISTORY_AUTO and own[:len(stored)] == stored:
            own = own[len(stored):]
    else:
        stored = []
    return [chat_msg(m) for m in stored + own], Generate.Goal.HISTORY_REPLACE


def chat_msg(record: ChatRecord) -> ChatMessage:
    """Return the ChatMessage of a recorded turn (with its tool calls)."""
    return ChatMessage(role=record.role, content=record.content,
                       tool_calls=[ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                                   for c in record.tool_calls],
                       tool_call_id=record.tool_call_id, name=record.name)


@dataclass
class SentGoal:
    """One replayed goal in flight: its LLMClient handle and what it was sent from."""

    index: int
    fields: dict                       # goal_fields() of the request
    handle: Optional[GenerationHandle] = None   # None when the goal could not be built
    error: str = ''
    sent_ns: int = field(default_factory=time.time_ns)
    started: float = field(default_factory=time.monotonic)

    @property
    def goal_id(self) -> str:
        return self.handle.goal_id if self.handle is not None else ''


class ReplayRunner:
    """rclpy side of a replay: an LLMClient, the new bag and the node's transcripts.

    One executor thread spins the node for the client, the recorder and the transcript
    subscription; the main thread sends goals and waits for their outcomes.
    """

    def __init__(self, options: ReplayOptions, writer: BagWriter) -> None:
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
            rclpy.init(args=None, signal_handler_options=SignalHandlerOptions.NO)
        self.node = rclpy.create_node('edge_llm_replay')
        self.executor = SingleThreadedExecutor()
        # Added before the client is made: LLMClient then only waits, never spins itself.
        self.executor.add_node(self.node)
        self.client = LLMClient(self.node, options.node)
        self.recorder = RawRecorder(self.node, writer, self.topics.core(),
                                    goal_filter=self._is_ours, on_message=self._on_message)
        self._stop = threading.Event()
        self._spinner = threading.Thread(target=self._spin, daemon=True)
        self._spinner.start()
        self.node_publishes_transcripts = True
        self._adapters: Optional[Dict[str, str]] = None

    def adapters(self) -> Dict[str, str]:
        """Return the node's LoRA adapters, name -> digest (asked once; none if it cannot say)."""
        if self._adapters is None:
            try:
                answer = self.client.list_adapters(timeout=self.options.server_timeout_s)
                self._adapters = {a.name: a.digest for a in answer.adapters}
            except (LLMClientError, TimeoutError):
                self._adapters = {}
        return self._adapters

    def _spin(self) -> None:
        try:
            while not self._stop.is_set():
                self.executor.spin_once(timeout_sec=0.05)
        except ExternalShutdownException:
            pass  # the context went down (another owner shut it): nothing left to serve

    def _is_ours(self, goal_id: str) -> bool:
        with self._cond:
            return goal_id in self._expected

    def _on_message(self, topic: str, msgtype: str, stamp: int, data: bytes) -> None:
        if msgtype != TRANSCRIPT_TYPE:
            return
        record = transcript_from_msg(deserialize_message(data, Transcript), stamp, topic)
        with self._cond:
            self._transcripts[record.goal_id] = record
            self._cond.notify_all()

    def send(self, index: int, request: TranscriptRecord) -> SentGoal:
        """Send one goal through the client; a goal that cannot be built fails alone."""
        sent = SentGoal(index, goal_fields(request))
        # The recorder's goal filter (executor thread) waits for this lock, so the goal's
        # first feedback cannot be judged before its id is known.
        with self._cond:
            try:
                sent.handle = self.client.generate(**sent.fields)
            except (AssertionError, TypeError, ValueError) as exc:  # rosidl's field checks
                sent.error = f'the goal cannot be built: {type(exc).__name__}: {exc}'
                return sent
            self._expected.add(sent.goal_id)
        return sent

    def finish(self, sent: SentGoal) -> ReplayOutcome:
        """Wait for `sent`'s result and transcript (or build one) within the goal timeout."""
        options = self.options
        if sent.handle is None:
            return ReplayOutcome(ABORTED, None, sent.error)
        left = options.goal_timeout_s - (time.monotonic() - sent.started)
        try:
            outcome = sent.handle.result(timeout=max(left, 0.0))
        except GoalRejectedError:
            new = self.wait_transcript(sent.goal_id)
            return ReplayOutcome(REJECTED, new, 'the node rejected the goal')
        except TimeoutError:
            sent.handle.cancel(timeout=CANCEL_WAIT_S)
            return ReplayOutcome(TIMEOUT, None, f'no result within {options.goal_timeout_s:g} '
                                 's (cancel requested)')
        except LLMClientError as exc:   # the server went away, or rclpy failed the request
            return ReplayOutcome(ABORTED, None, str(exc))
        status = outcome.status if outcome.status in ACTION_STATUSES else ABORTED
        new = self.wait_transcript(sent.goal_id)
        if new is not None:
            return ReplayOutcome(status, new)
        return ReplayOutcome(status, self._synthesize(sent, outcome), synthesized=True)

    def cancel(self, sent: SentGoal) -> None:
        if sent.handle is not None:
            sent.handle.cancel(timeout=CANCEL_WAIT_S)

    def wait_transcript(self, goal_id: str) -> Optional[TranscriptRecord]:
        timeout_s = self.options.transcript_wait_s if self.node_publishes_transcripts else 0.0
        with self._cond:
            self._cond.wait_for(lambda: goal_id in self._transcripts, timeout_s)
            return self._transcripts.get(goal_id)

    def _synthesize(self, sent: SentGoal, outcome: GenerationOutcome) -> TranscriptRecord:
        """Record the transcript the node did not publish, built as llm_node builds it."""
        now = time.time_ns()
        msg = build_transcript(
            Transcript.SOURCE_ACTION, UUID(uuid=list(uuid_bytes(sent.goal_id))),
            make_goal(**sent.fields), None, outcome, True, '',
            RosTime(nanoseconds=sent.sent_ns).to_msg(), RosTime(nanoseconds=now).to_msg(),
            outcome.error_message)
        self.writer.add_topic(self.topics.transcript, TRANSCRIPT_TYPE)
        self.writer.write(self.topics.transcript, now, wire_cdr(msg, TRANSCRIPT_TYPE))
        return transcript_from_msg(msg, now, self.topics.transcript)

    def wait_for_node(self) -> None:
        """Block until the node is active and serves goals; also let the transcripts match."""
        timeout = self.options.server_timeout_s
        if not self.client.wait_for_server(timeout):
            raise NodeUnavailableError(
                f'no Generate action server at {self.topics.action} after {timeout:g} s: '
                'start llm_node (or pass --node with its full name, e.g. /robot/llm_node) '
                'and check ROS_DOMAIN_ID')
        if self._is_lifecycle_node():
            try:
                self.client.wait_until_active(timeout)
            except NodeNotActiveError as exc:
                raise NodeUnavailableError(str(exc)) from None
        # Transcripts published before the subscription matched would be lost.
        deadline = time.monotonic() + min(timeout, 5.0)
        while self.recorder.publisher_count(self.topics.transcript) == 0 and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        self.node_publishes_transcripts = \
            self.recorder.publisher_count(self.topics.transcript) > 0
        if not self.node_publishes_transcripts:
            print(f'edge-llm-replay: warning: nothing publishes {self.topics.transcript}: '
                  'new transcripts are built from the action results', file=sys.stderr)

    def _is_lifecycle_node(self) -> bool:
        """Tell whether the node serves ~/get_state (llm_node does; a plain node is active)."""
        client = self.node.create_client(GetState, f'{self.options.node}/get_state')
        try:
            return client.wait_for_service(timeout_sec=min(2.0, self.options.server_timeout_s))
        finally:
            self.node.destroy_client(client)

    def close(self) -> None:
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
    in_flight = []
    error = ''
    times = _send_times(olds, options.timing)
    start = time.monotonic()
    try:
        for index, old in enumerate(olds):
            ctrl_c.check()
            if options.skip_tensor_goals and old.tensor_handles:
                outcomes[index] = ReplayOutcome(
                    SKIPPED, None, '--skip-tensor-goals: the goal carries tensor handles')
                continue
            problem = adapter_problem(old, runner.adapters()) if old.lora else ''
            if problem:
                outcomes[index] = ReplayOutcome(NOT_SENT, None, problem)
                continue
            if not runner.client.wait_for_server(options.server_timeout_s):
                error = (f'the action server {runner.topics.action} went away before goal '
                         f'{index}: the remaining goals were not replayed')
                break
            if times[index] is not None:
                time.sleep(max(0.0, start + times[index] - time.monotonic()))
            sent = runner.send(index, apply_overrides(old, options.overrides))
            if sent.goal_id:
                goal_map[old.goal_id] = sent.goal_id
            in_flight.append(sent)
            if times[index] is None:
                outcomes[index] = runner.finish(sent)
                _progress(index, len(olds), outcomes[index])
        for sent in in_flight:
            ctrl_c.check()
            if outcomes[sent.index] is None:
                outcomes[sent.index] = runner.finish(sent)
                _progress(sent.index, len(olds), outcomes[sent.index])
        ctrl_c.check()
        ctrl_c.quiet()   # closing the bag and writing the report must not be interrupted
    except KeyboardInterrupt:
        ctrl_c.quiet()
        error = INTERRUPTED
        for sent in in_flight:
            if outcomes[sent.index] is None:
                runner.cancel(sent)
    for index, outcome in enumerate(outcomes):
        if outcome is None:
            outcomes[index] = ReplayOutcome(NOT_SENT, None, error or 'not sent')
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
        cpu = CpuClasses(contents.cpu_class, options.node_cpu_class())
        run.notes.extend(contents.warnings)
        for problem in contents.problems + contents.warnings:
            print(f'edge-llm-replay: warning: {problem}', file=sys.stderr)
        print(f'edge-llm-replay: {cpu.describe()}: greedy goals compared '
              f'{TOKEN_RULE_TEXT[cpu.token_rule]}', flush=True)
        outcomes, error = _replay_into_bag(contents, options, out_bag, ctrl_c, cpu.replay)
        ctrl_c.quiet()
        if ctrl_c.event.is_set():
            error = INTERRUPTED
        result = compare_run(contents.transcripts, outcomes, thresholds, contents.problems,
                             cpu)
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
                     ctrl_c: Optional[CtrlC] = None, cpu_class: Optional[str] = None) -> tuple:
    # The new bag records the node's CPU class: edge-llm-report compares it later.
    writer = BagWriter(out_bag, storage=options.storage, cpu_class=cpu_class)
    runner = None
    outcomes: list = [ReplayOutcome(NOT_SENT, None, 'the node was not reached')
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
          f"{summary['greedy_compared']} ({summary['greedy_cross_cpu_drift']} within the "
          f"cross-CPU drift thresholds), {summary['regressions']} regressions, "
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
    parser.add_argument('--cpu-class', default='', metavar='CLASS',
                        help='CPU class of the machine llm_node runs on when it is not this '
                             'one (print it there: python -m edge_llm_ros.regression.cpu_class'
                             "), or 'unknown'; decides whether greedy outputs must be "
                             'identical (same class as the bag) or may drift')
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        overrides = dict(parse_override(text) for text in args.overrides)
        LlmTopics(args.node)
        cpu_class = parse_cpu_class(args.cpu_class) if args.cpu_class else ''
    except (ValueError, CpuClassError) as exc:
        parser.error(str(exc))
    options = ReplayOptions(
        bag=args.bag, node=args.node, timing=args.timing, thresholds_file=args.thresholds,
        out_bag=args.out, report_dir=args.report, storage=args.storage, overrides=overrides,
        skip_tensor_goals=args.skip_tensor_goals, server_timeout_s=args.server_timeout,
        goal_timeout_s=args.goal_timeout, cpu_class=cpu_class)
    return run_replay(options)


if __name__ == '__main__':
    sys.exit(main())
