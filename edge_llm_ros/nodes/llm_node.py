"""llm_node: a lifecycle node serving the engine as a queued, streaming action and services.

Interfaces (all relative to the node's name):
  ~/generate   edge_llm_msgs/action/Generate   streamed, cancellable, queued
  ~/complete   edge_llm_msgs/srv/Complete      one-shot, through the same queue
  ~/tokenize   edge_llm_msgs/srv/Tokenize      answered at once, never queued
  ~/detokenize edge_llm_msgs/srv/Detokenize    answered at once, never queued
  ~/get_model_info edge_llm_msgs/srv/GetModelInfo  answered at once, in every state
  ~/reset_session edge_llm_msgs/srv/ResetSession  drops KV sessions between two generations
  ~/update_model edge_llm_msgs/srv/UpdateModel  installs a signed model, swaps it in
                                                  (nodes/model_update.py)
  ~/transcript edge_llm_msgs/msg/Transcript    one message per finished or refused request
  /diagnostics diagnostic_msgs/DiagnosticArray every diagnostics.period_s (1 s)
Parameters: bringup.parameters' llm_node schema (see nodes/llm_config.py).

Lifecycle: on_configure reads the parameters once and loads the model on the engine worker
thread (a failure returns FAILURE: the node stays unconfigured, the error is logged and shown
in /diagnostics); on_activate starts accepting goals; on_deactivate cancels the running and
queued goals (they end ABORTED with finish_reason 'cancelled', their partial text and an
error_message saying why) and waits for the worker to go idle; on_cleanup and on_shutdown free
the model.

How a goal is refused:
- Not active, or the queue is full: the goal is REJECTED (rclpy cannot attach a reason to a
  rejection), the reason is logged, counted in /diagnostics and published on ~/transcript.
- Anything wrong with the request itself (empty prompt, unknown role, bad sampling value,
  invalid JSON schema, too long for the context, unresolvable tensor handle): the goal is
  ACCEPTED and ABORTED at once with finish_reason 'error' and an error_message saying what to
  fix, so the client gets the reason. It gives its reserved queue slot back at once.
Defaults: SamplingParams fields at UNSET take ~/sampling.*, max_tokens 0 takes ~/max_tokens,
an empty system_prompt takes ~/system_prompt. A max_tokens that does not fit in the context
after the prompt is an error, not clamped: the caller asked for more than can be delivered.

Threading: inference runs only on the engine worker thread (nodes/worker.py). A goal is
validated once (Engine.prepare) and queued in the action's accepted callback; its execute
callback and ~/complete are coroutines that await the worker's result, so a waiting request
holds no executor thread; feedback is published from the worker thread.
Callback groups: lifecycle services + autostart share the default (mutually exclusive)
group, so a slow configure blocks only other transitions; the action server has its own
mutually exclusive group (goals are admitted in arrival order, and a cancel is fully
recorded by rclpy before the goal's end is decided, see _on_cancel); ~/complete is
reentrant; ~/tokenize and the diagnostics timer each have their own group.
Shutdown (Ctrl-C, SIGTERM): see nodes/spin.py and nodes/runner.py; the goals still running
or queued end ABORTED, the model is freed, the process exits 0.
CPU pinning (engine.cpu_affinity): every thread of the process is pinned before the model
loads, the worker (decode) thread to the first core, ORT's intra-op threads one per core;
the thermal governor (thermal.*) narrows the cores and paces tokens when the SoC runs hot.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
import functools
import os
import sys
import threading
import time
import traceback
from typing import Any, Dict, Iterator, List, Optional, Tuple
import uuid

from diagnostic_msgs.msg import DiagnosticArray
import psutil
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.exceptions import InvalidParameterTypeException, InvalidParameterValueException
from rclpy.executors import MultiThreadedExecutor
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.parameter import Parameter
from rclpy.task import Future
from unique_identifier_msgs.msg import UUID

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import Transcript
from edge_llm_msgs.srv import Complete, Detokenize, GetModelInfo, ResetSession, Tokenize
from edge_llm_ros.bringup import affinity
from edge_llm_ros.bringup.thermal import ThermalGovernor, ThermalSettings, ThrottleApplier
from edge_llm_ros.errors import EngineError
from edge_llm_ros.metrics import figures
from edge_llm_ros.metrics.exporter import (FiguresCollector, MetricsError, MetricsServer,
                                           MetricsSettings)
from edge_llm_ros.metrics.figures import FigureRecorder, Gauges
from edge_llm_ros.nodes import llm_services
from edge_llm_ros.nodes.diagnostics import build_status, NodeHealth
from edge_llm_ros.nodes.embeddings import EmbeddingResolver
from edge_llm_ros.nodes.llm_config import (check_changes, ConfigError, current_values,
                                           declare_parameters, LLMNodeConfig, read_config,
                                           runtime_config, RuntimeConfig)
from edge_llm_ros.nodes.messages import (build_transcript, error_kind, fill_result, queue_order,
                                         to_request, tool_call_delta_msgs)
from edge_llm_ros.nodes.model_update import ModelUpdater
from edge_llm_ros.nodes.runner import run_node
from edge_llm_ros.qos import FEEDBACK_QOS, TRANSCRIPT_QOS
from edge_llm_ros.rclpy_compat import add_set_parameters_callbacks
from edge_llm_ros.runtime.types import ChatMessage, GenerationResult, StopReason
from edge_llm_ros.serving.backends import engine_factory
from edge_llm_ros.serving.worker import (CancelReason, EngineWorker, error_result, FeedbackChunk,
                                         Job, JobOutcome, QueueFullError, WorkerStoppedError)

NODE_NAME = 'llm_node'
# On Ctrl-C, how long the goals and ~/complete calls that release() ended may take to send
# their answers before the executor stops.
ANSWER_GRACE_S = 2.0
# The decode thread needs the GIL between two model steps (ORT runs without it); an executor
# thread holding it (a wait set rebuilt, a callback) otherwise keeps it up to CPython's 5 ms
# switch interval: a token's (and the first token's) delay. Waiting threads get it sooner.
GIL_SWITCH_INTERVAL_S = 0.0005


def _pin_worker(cpus) -> None:
    """Pin the engine worker (decode) thread; runs first on that thread."""
    if cpus:
        affinity.pin_thread(cpus)


@dataclass
class _Goal:
    """An accepted goal: when it was accepted, its job (None if invalid), its outcome."""

    stamp: Any
    job: Optional[Job] = None
    done: Future = field(default_factory=Future)
    # Done once rclpy has recorded an accepted client cancel (the goal is CANCELING).
    cancel_applied: Future = field(default_factory=Future)
    # Generate.Result.ERROR_* decided at admission (invalid request), '' otherwise.
    error_kind: str = ''
    accepted_at: float = field(default_factory=time.monotonic)   # for goal_duration_seconds

    @property
    def queued(self) -> bool:
        """Whether the job reached the worker's queue (so its queue wait is known)."""
        return self.job is not None and self.job.enqueued_at > 0.0


@dataclass
class _Configured:
    """What on_configure builds and cleanup drops, as one: a node is configured or not."""

    config: LLMNodeConfig
    worker: EngineWorker            # owns the engine (created on the worker thread)
    governor: ThermalGovernor
    throttle: ThrottleApplier
    embeddings: EmbeddingResolver   # maps the goals' prefix_embeddings handles
    saved_affinity: dict            # CPU masks before engine.cpu_affinity pinned the process
    metrics: Optional[MetricsServer] = None   # /metrics (metrics.port 0: None)


class LLMNode(LifecycleNode):
    """Lifecycle node wrapping one Engine (see the module docstring)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(NODE_NAME, **kwargs)
        declare_parameters(self)
        self._runtime: RuntimeConfig = runtime_config(current_values(self))
        add_set_parameters_callbacks(self, check_changes, self._on_parameters_set)
        self._configured: Optional[_Configured] = None
        self._state = 'unconfigured'
        self._serving = False
        self._load_error = ''
        self._goals: Dict[bytes, _Goal] = {}   # accepted goals until their result is built
        self._cancels_recorded: List[Future] = []   # see _on_cancel
        self._cancels_lock = threading.Lock()
        self._answering = threading.Condition()   # see wait_requests_answered
        self._answering_count = 0
        # Goal counts and latency histograms: /diagnostics and /metrics both read these.
        self._figures = FigureRecorder()
        self._process = psutil.Process()

        self._action_group = MutuallyExclusiveCallbackGroup()
        self._complete_group = ReentrantCallbackGroup()
        self._tokenize_group = MutuallyExclusiveCallbackGroup()
        self._diagnostics_group = MutuallyExclusiveCallbackGroup()
        self._action_server = ActionServer(
            self, Generate, '~/generate', execute_callback=self._execute,
            goal_callback=self._on_goal, handle_accepted_callback=self._on_accepted,
            cancel_callback=self._on_cancel,
            callback_group=self._action_group, feedback_pub_qos_profile=FEEDBACK_QOS)
        # In the action server's group: runs only after the cancel request that triggered it.
        self._cancels_recorded_gc = self.create_guard_condition(
            self._on_cancels_recorded, callback_group=self._action_group)
        self._complete_srv = self.create_service(
            Complete, '~/complete', self._on_complete, callback_group=self._complete_group)
        self._tokenize_srv = self.create_service(
            Tokenize, '~/tokenize', self._on_tokenize, callback_group=self._tokenize_group)
        # Reentrant: a reset waiting for a running generation blocks nothing else.
        self._info_group = ReentrantCallbackGroup()
        self._small_services = [self.create_service(
            kind, name, callback, callback_group=self._info_group) for kind, name, callback in (
                (Detokenize, '~/detokenize', self._on_detokenize),
                (GetModelInfo, '~/get_model_info', self._on_get_model_info),
                (ResetSession, '~/reset_session', self._on_reset_session))]
        self._transcript_pub = self.create_publisher(Transcript, '~/transcript', TRANSCRIPT_QOS)
        self._updater = ModelUpdater(self)   # ~/update_model (nodes/model_update.py)
        self._diagnostics_pub = self.create_publisher(DiagnosticArray, '/diagnostics', 10)
        self._diagnostics_timer = self.create_timer(
            self.get_parameter('diagnostics.period_s').value, self._publish_diagnostics,
            callback_group=self._diagnostics_group)
        self._autostart_timer = None
        if self.get_parameter('autostart').value:
            # Default group: runs like a change_state request, once the executor spins.
            self._autostart_timer = self.create_timer(0.0, self._autostart)

    # ---- lifecycle ---------------------------------------------------------------------------
    def _autostart(self) -> None:
        self._autostart_timer.cancel()
        self.destroy_timer(self._autostart_timer)
        if self.trigger_configure() == TransitionCallbackReturn.SUCCESS:
            self.trigger_activate()

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._state = 'configuring'
        try:
            config = self._updater.configured(read_config(self))
        except ConfigError as exc:
            return self._configure_failed(f'invalid parameter: {exc}')
        for warning in config.warnings:
            self.get_logger().warn(warning)
        try:   # before the model loads: a taken port fails at once
            metrics = self._start_metrics(MetricsSettings.from_params(current_values(self)))
        except MetricsError as exc:
            return self._configure_failed(str(exc))
        governor = ThermalGovernor(config.thermal, config.engine.intra_op_threads or 1,
                                   config.process_cpus)
        worker = EngineWorker(engine_factory(current_values(self), config.engine),
                              config.queue_depth,
                              config.runtime.feedback,
                              thread_setup=functools.partial(_pin_worker, config.decode_cpus),
                              pacer=governor)
        t0 = time.monotonic()
        saved_affinity: dict = {}
        try:
            if config.process_cpus:
                # Before the engine exists, so every ORT thread starts inside the mask.
                saved_affinity = affinity.pin_process(config.process_cpus)
            worker.start()
        except Exception as exc:  # noqa: B902 - any load failure leaves us unconfigured
            if saved_affinity:
                affinity.restore(saved_affinity)
            if metrics is not None:
                metrics.stop()
            return self._configure_failed(f'{type(exc).__name__}: {exc}')
        engine = worker.engine
        self._configured = _Configured(
            config=config, worker=worker, governor=governor,
            throttle=ThrottleApplier(config.process_cpus), embeddings=EmbeddingResolver(),
            saved_affinity=saved_affinity, metrics=metrics)
        self._load_error = ''
        self._state = 'inactive'
        self.get_logger().info(
            f'loaded {engine.model_name} from {engine.model_dir} in {time.monotonic() - t0:.1f}'
            f' s (context {engine.context_length}, providers {", ".join(engine.providers)})')
        if config.engine.session_store and hasattr(engine, 'saved_sessions'):
            self.get_logger().info(f'sessions.store {config.engine.session_store}: '
                                   f'{len(engine.saved_sessions())} saved sessions restored')
        return TransitionCallbackReturn.SUCCESS

    def _start_metrics(self, settings: MetricsSettings) -> Optional[MetricsServer]:
        """Serve /metrics until cleanup (None when metrics.port is 0); MetricsError if not."""
        if not settings.enabled:
            return None
        server = MetricsServer(settings, FiguresCollector(self._figures, self._gauges))
        server.start()
        self.get_logger().info(f'Prometheus metrics on http://{settings.host}:{server.port}'
                               '/metrics')
        return server

    def _configure_failed(self, message: str) -> TransitionCallbackReturn:
        self._load_error = message
        self._state = 'unconfigured'
        self.get_logger().error(f'configure failed, staying unconfigured: {message}')
        return TransitionCallbackReturn.FAILURE

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._configured.worker.set_accepting(True)
        self._serving = True
        self._state = 'active'
        self.get_logger().info('active: serving ~/generate, ~/complete and ~/tokenize')
        return super().on_activate(state)

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._serving = False
        self._state = 'inactive'
        self._cancel_everything(CancelReason.DEACTIVATED)
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._release_engine(CancelReason.SHUTDOWN)
        self._state = 'unconfigured'
        return super().on_cleanup(state)

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._serving = False
        self._release_engine(CancelReason.SHUTDOWN)
        self._state = 'finalized'
        return super().on_shutdown(state)

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._serving = False
        self._release_engine(CancelReason.SHUTDOWN)
        self._state = 'unconfigured'
        return TransitionCallbackReturn.SUCCESS

    def _cancel_everything(self, reason: CancelReason) -> None:
        worker = self._worker
        if worker is None:
            return
        worker.set_accepting(False)
        worker.cancel_all(reason)
        if not worker.wait_idle(timeout=10.0):
            self.get_logger().error('the engine worker did not go idle within 10 s')

    def _release_engine(self, reason: CancelReason) -> None:
        """Stop the worker (which closes the engine); safe to call in any state."""
        configured, self._configured = self._configured, None
        if configured is None:
            return
        configured.worker.stop(reason)
        if configured.throttle.active:
            # A disabled governor's state never throttles: applying it restores the masks.
            configured.throttle.apply(
                ThermalGovernor(ThermalSettings(enabled=False), 1, ()).state)
        configured.embeddings.close()
        if configured.saved_affinity:
            affinity.restore(configured.saved_affinity)
        if configured.metrics is not None:
            configured.metrics.stop()

    @property
    def _worker(self) -> Optional[EngineWorker]:
        configured = self._configured
        return configured.worker if configured is not None else None

    def release(self) -> None:
        """Free the model outside a lifecycle transition (process exit after Ctrl-C)."""
        self._serving = False
        self._release_engine(CancelReason.SHUTDOWN)

    def wait_requests_answered(self, timeout: float) -> bool:
        """Wait until no goal or ~/complete call is being answered (the executor spins)."""
        with self._answering:
            return self._answering.wait_for(lambda: self._answering_count == 0, timeout)

    @contextlib.contextmanager
    def _answering_request(self) -> Iterator[None]:
        with self._answering:
            self._answering_count += 1
        try:
            yield
        finally:
            with self._answering:
                self._answering_count -= 1
                self._answering.notify_all()

    def _on_parameters_set(self, parameters: List[Parameter]) -> None:
        """Rebuild the runtime config with the accepted values (on Humble not yet stored)."""
        values = current_values(self)
        values.update((param.name, param.value) for param in parameters)
        self._runtime = runtime_config(values)
        worker = self._worker
        if worker is not None:
            worker.feedback = self._runtime.feedback

    # ---- admission and request building ------------------------------------------------------
    def _admit(self) -> str:
        """Reserve a queue slot for a new request; return why not ('' when reserved)."""
        worker = self._worker
        if not self._serving or worker is None:
            self._figures.goal_rejected(figures.REJECTED_NOT_ACTIVE)
            return (f'{self.get_name()} is {self._state}, not active: activate it with '
                    f'lifecycle change_state (or start it with autostart:=true)')
        if not worker.reserve():
            self._figures.goal_rejected(figures.REJECTED_QUEUE_FULL)
            return (f'queue full ({worker.queue_depth} goal(s) already wait behind the '
                    f'running one): retry later or raise ~/queue.depth')
        return ''

    def _prepare(self, msg) -> Tuple[EngineWorker, Job]:
        """Validate an admitted request once into a job; on failure give the reservation back.

        Raises InvalidRequestError subclasses (bad request) or WorkerStoppedError (the node
        was deactivated or cleaned up since admission).
        """
        configured = self._configured
        engine = configured.worker.engine if configured is not None else None
        if engine is None:
            raise WorkerStoppedError(f'{self.get_name()} is {self._state}, not configured')
        worker, resolver = configured.worker, configured.embeddings
        try:
            handles = list(msg.prefix_embeddings)
            priority, preempt = queue_order(msg)
            prepared = engine.prepare(to_request(msg, self._runtime.defaults,
                                                 resolver.describe(handles)))
        except BaseException:
            worker.unreserve()
            raise
        # The frames are mapped on the worker, only while the job runs (see embeddings.py).
        embeddings = (functools.partial(resolver.hold, handles)
                      if prepared.embeddings is not None else None)
        return worker, Job(prepared, on_done=_unset_on_done, embeddings=embeddings,
                           priority=priority, preempt=preempt)

    def _refusal(self, exc: Exception, what: str) -> str:
        """Say why `what` could not take a request; log the failures that are not the request's.

        EngineError (a bad request, or e.g. a chat template the sandbox refused) and
        WorkerStoppedError are answers; anything else is a bug, logged with its traceback and
        answered too, so that one request never takes the node down.
        """
        if isinstance(exc, (EngineError, WorkerStoppedError)):
            self._figures.invalid_request()
            return str(exc)
        self.get_logger().error(f'{what} failed unexpectedly: '
                                f'{"".join(traceback.format_exception(exc)).rstrip()}')
        return (f'{self.get_name()} {what} failed unexpectedly ({type(exc).__name__}: {exc}); '
                'see the node log')

    def _submit(self, worker: EngineWorker, job: Job, done: Future) -> None:
        """Queue a prepared job on its reserved slot; its outcome will complete `done`."""
        job.on_done = functools.partial(self._resolve, done)
        try:
            worker.submit(job, reserved=True)
        except (QueueFullError, WorkerStoppedError) as exc:
            # Deactivated or cleaned up between admission and now.
            done.set_result(JobOutcome(error_result(str(exc)), CancelReason.DEACTIVATED))

    async def _run(self, worker: EngineWorker, job: Job) -> JobOutcome:
        """Submit and await the outcome without holding an executor thread."""
        done = Future()
        self._submit(worker, job, done)
        return await done

    # ---- action ------------------------------------------------------------------------------
    def _on_goal(self, goal: Generate.Goal) -> GoalResponse:
        problem = self._admit()
        if not problem:
            return GoalResponse.ACCEPT
        self.get_logger().warn(f'goal rejected: {problem}')
        self._publish_transcript(Transcript.SOURCE_ACTION, UUID(), goal, None, None,
                                 accepted=False, error=problem)
        return GoalResponse.REJECT

    def _on_accepted(self, goal_handle) -> None:
        """Validate and queue the goal at once, then let its execute coroutine await it.

        Runs right after the goal response is sent, so the worker can start before the
        execute coroutine runs (one executor hop less to the first token). The job is queued
        last: the woken worker then never waits for the GIL while this executor thread still
        publishes the EXECUTING status and schedules the coroutine (it awaits state.done).
        """
        key = bytes(goal_handle.goal_id.uuid)
        state = _Goal(stamp=self.get_clock().now().to_msg())
        self._goals[key] = state
        goal_handle.execute()
        try:
            worker, job = self._prepare(goal_handle.request)
        except Exception as exc:  # noqa: B902 - every failure aborts the goal with a message
            state.error_kind = _error_kind(exc)
            state.done.set_result(JobOutcome(error_result(self._refusal(exc, '~/generate'))))
        else:
            job.on_feedback = functools.partial(self._send_feedback, goal_handle)
            state.job = job
            self._submit(worker, job, state.done)

    def _on_cancel(self, goal_handle) -> CancelResponse:
        """Accept every cancel request and stop the goal's job.

        rclpy marks the goal CANCELING only after this returns, and the job can end before
        that (at once when it was still queued): _execute then awaits cancel_applied, which
        _on_cancels_recorded resolves. That callback shares the action server's mutually
        exclusive group, so it runs only once this cancel request has been handled in full.
        A goal that already ended just keeps its terminal state.
        """
        state = self._goals.get(bytes(goal_handle.goal_id.uuid))
        if state is None:
            return CancelResponse.ACCEPT
        with self._cancels_lock:
            self._cancels_recorded.append(state.cancel_applied)
        self._cancels_recorded_gc.trigger()
        worker = self._worker
        if state.job is not None and worker is not None:
            worker.cancel(state.job, CancelReason.CLIENT)
        return CancelResponse.ACCEPT

    def _on_cancels_recorded(self) -> None:
        """Tell the goals whose cancel request rclpy has now recorded (see _on_cancel)."""
        with self._cancels_lock:
            recorded, self._cancels_recorded = self._cancels_recorded, []
        for future in recorded:
            if not future.done():
                self._resolve(future, None)

    async def _execute(self, goal_handle) -> Generate.Result:
        key = bytes(goal_handle.goal_id.uuid)
        state = self._goals[key]
        with self._answering_request():
            try:
                outcome: JobOutcome = await state.done
                if outcome.cancel_reason is CancelReason.CLIENT:
                    await state.cancel_applied   # the goal is CANCELING from here on
            finally:
                self._goals.pop(key, None)
            request = state.job.request if state.job is not None else None
            return self._finish_goal(goal_handle, state.stamp, request, outcome.result,
                                     outcome.cancel_reason, state.error_kind,
                                     started=state.accepted_at, queued=state.queued)

    def _finish_goal(self, goal_handle, stamp, request, result: GenerationResult,
                     cancel_reason: CancelReason = CancelReason.NONE,
                     kind: str = '', *, started: float, queued: bool) -> Generate.Result:
        """Set the goal's terminal state and build its result (and transcript).

        `started`: when it was accepted (time.monotonic); `queued`: it reached the worker.
        """
        error = result.error
        stopped = cancel_reason in (CancelReason.DEACTIVATED, CancelReason.SHUTDOWN)
        if result.stop_reason is StopReason.CANCELLED:
            if cancel_reason is CancelReason.CLIENT and goal_handle.is_cancel_requested:
                goal_handle.canceled()
                outcome = figures.CANCELED
            else:
                error = error or self._stopped_message(cancel_reason)
                stopped = True
                goal_handle.abort()
                outcome = figures.ABORTED
        elif result.stop_reason is StopReason.ERROR:
            goal_handle.abort()
            outcome = figures.ABORTED
        else:
            goal_handle.succeed()
            outcome = figures.SUCCEEDED
        if error:
            self.get_logger().warn(f'goal aborted: {error}')
        msg = fill_result(Generate.Result(), result, error, self._token_strings,
                          error_kind(result, kind, stopped))
        self._figures.goal_ended(outcome, msg.error_kind or msg.finish_reason, result,
                                 time.monotonic() - started, queued)
        self._publish_transcript(Transcript.SOURCE_ACTION, goal_handle.goal_id,
                                 goal_handle.request, request, msg, accepted=True,
                                 accepted_stamp=stamp, error=error)
        return msg

    def _stopped_message(self, reason: CancelReason) -> str:
        why = {CancelReason.DEACTIVATED: 'was deactivated',
               CancelReason.SHUTDOWN: 'is shutting down'}.get(reason, 'stopped the goal')
        return (f'{self.get_name()} {why} while the goal was waiting or running; partial '
                'text kept')

    def _send_feedback(self, goal_handle, chunk: FeedbackChunk) -> None:
        """Publish one feedback message (worker thread)."""
        msg = Generate.Feedback(text_delta=chunk.text_delta, token_ids=list(chunk.token_ids),
                                completion_tokens=chunk.completion_tokens,
                                queue_position=chunk.queue_position,
                                reasoning_delta=chunk.reasoning_delta,
                                tool_call_deltas=tool_call_delta_msgs(chunk.tool_call_deltas),
                                paused=chunk.paused)
        try:
            goal_handle.publish_feedback(msg)
        except Exception as exc:  # noqa: B902 - a lost feedback must not fail the generation
            if self.context.ok():   # after Ctrl-C the context is gone first: nothing to say
                self.get_logger().warn(f'feedback not published: {exc}',
                                       throttle_duration_sec=5.0)

    def _resolve(self, future: Future, outcome: JobOutcome) -> None:
        """Hand a job outcome to the coroutine awaiting it (worker thread) and wake it."""
        future.set_result(outcome)
        executor = self.executor
        if executor is not None:
            executor.wake()

    # ---- services ----------------------------------------------------------------------------
    async def _on_complete(self, request: Complete.Request,
                           response: Complete.Response) -> Complete.Response:
        with self._answering_request():
            try:
                return await self._complete(request, response)
            except Exception as exc:  # noqa: B902 - a service must answer, never end the process
                response.success = False
                response.error_message = self._refusal(exc, '~/complete')
                return response

    async def _complete(self, request: Complete.Request,
                        response: Complete.Response) -> Complete.Response:
        stamp = self.get_clock().now().to_msg()
        started = time.monotonic()
        goal_id = UUID(uuid=list(uuid.uuid4().bytes))
        problem = self._admit()
        if problem:
            self.get_logger().warn(f'complete refused: {problem}')
            kind = (Generate.Result.ERROR_QUEUE_FULL if self._serving and self._worker
                    else Generate.Result.ERROR_UNAVAILABLE)
            return self._finish_service(response, goal_id, request, None,
                                        error_result(problem), stamp, accepted=False,
                                        kind=kind, started=started)
        try:
            worker, job = self._prepare(request)
        except Exception as exc:  # noqa: B902 - answered with the message (see _refusal)
            return self._finish_service(response, goal_id, request, None,
                                        error_result(self._refusal(exc, '~/complete')), stamp,
                                        kind=_error_kind(exc), started=started)
        engine_request = job.request
        outcome = await self._run(worker, job)
        result = outcome.result
        if result.stop_reason is StopReason.CANCELLED and not result.error:
            result = replace(result, error=self._stopped_message(outcome.cancel_reason))
        stopped = outcome.cancel_reason is not CancelReason.NONE
        return self._finish_service(response, goal_id, request, engine_request, result, stamp,
                                    kind=error_kind(result, '', stopped), started=started,
                                    queued=job.enqueued_at > 0.0)

    def _finish_service(self, response, goal_id, request, engine_request, result,
                        stamp, accepted: bool = True, kind: str = '', *, started: float,
                        queued: bool = False) -> Complete.Response:
        fill_result(response, result, token_strings=self._token_strings, kind=kind)
        response.success = result.stop_reason in (StopReason.STOP, StopReason.LENGTH,
                                                  StopReason.TOOL_CALLS)
        if accepted:
            self._figures.goal_ended(figures.SUCCEEDED if response.success else figures.ABORTED,
                                     response.error_kind or response.finish_reason, result,
                                     time.monotonic() - started, queued)
        self._publish_transcript(Transcript.SOURCE_SERVICE, goal_id, request, engine_request,
                                 response, accepted=accepted, accepted_stamp=stamp,
                                 error=response.error_message)
        return response

    def _on_tokenize(self, request: Tokenize.Request,
                     response: Tokenize.Response) -> Tokenize.Response:
        # The tokenizer is thread-safe and independent of the worker: answered at once.
        worker = self._worker
        engine = worker.engine if worker is not None else None
        if engine is None:
            response.success = False
            response.error_message = (f'{self.get_name()} is {self._state}: configure it to '
                                      'load the tokenizer')
            return response
        try:
            messages = [ChatMessage(m.role, m.content) for m in request.messages]
            ids = engine.tokenize(request.text, messages, request.add_generation_prompt)
            tokens = list(engine.token_strings(ids))
        except (EngineError, ValueError, TypeError) as exc:  # e.g. a template the sandbox refused
            response.success = False
            response.error_message = str(exc)
            return response
        except Exception as exc:  # noqa: B902 - answer, never crash (see _refusal)
            response.success = False
            response.error_message = self._refusal(exc, '~/tokenize')
            return response
        response.success = True
        response.token_ids = [int(i) for i in ids]
        response.tokens = tokens
        response.context_length = int(engine.context_length)
        return response

    def _engine(self):
        worker = self._worker
        return worker.engine if worker is not None else None

    def _unloaded(self) -> str:
        return f'{self.get_name()} is {self._state}: configure it to load the model'

    def _token_strings(self, ids) -> list:
        """Token texts for logprobs ('' each when the engine cannot say, e.g. remote)."""
        engine = self._engine()
        try:
            return list(engine.token_strings(ids))
        except Exception:  # noqa: B902 - names are a courtesy: never fail a result for them
            return [''] * len(ids)

    def _on_detokenize(self, request: Detokenize.Request,
                       response: Detokenize.Response) -> Detokenize.Response:
        try:
            return llm_services.detokenize(self._engine(), request, response, self._unloaded())
        except Exception as exc:  # noqa: B902 - answer, never crash (see _refusal)
            response.success, response.error_message = False, self._refusal(exc, '~/detokenize')
            return response

    def _on_get_model_info(self, request: GetModelInfo.Request,
                           response: GetModelInfo.Response) -> GetModelInfo.Response:
        try:
            return llm_services.model_info(self._engine(), response, self._unloaded())
        except Exception as exc:  # noqa: B902 - answer, never crash (see _refusal)
            response.success = False
            response.error_message = self._refusal(exc, '~/get_model_info')
            return response

    def _on_reset_session(self, request: ResetSession.Request,
                          response: ResetSession.Response) -> ResetSession.Response:
        try:
            return llm_services.reset_session(self._worker, request, response, self._unloaded())
        except Exception as exc:  # noqa: B902 - answer, never crash (see _refusal)
            response.success, response.message = False, self._refusal(exc, '~/reset_session')
            return response

    # ---- transcript and diagnostics ----------------------------------------------------------
    def _publish_transcript(self, source: str, goal_id, request_msg, engine_request,
                            outcome_msg, accepted: bool, accepted_stamp=None,
                            error: str = '') -> None:
        self._transcript_pub.publish(build_transcript(
            source, goal_id, request_msg, engine_request, outcome_msg, accepted=accepted,
            model=self._model_name(), accepted_stamp=accepted_stamp,
            finished_stamp=self.get_clock().now().to_msg(), error=error))

    def _model_name(self) -> str:
        worker = self._worker
        engine = worker.engine if worker is not None else None
        return engine.model_name if engine is not None else ''

    def _poll_thermal(self, configured: Optional[_Configured]):
        """Poll the governor (diagnostics timer), apply its core limit; return its state."""
        if configured is None:
            return None
        state = configured.governor.poll()
        configured.throttle.apply(state)
        return state

    def _gauges(self) -> Gauges:
        """Queue, KV, memory and thermal figures now (diagnostics timer and /metrics scrape).

        The temperature and throttle state are the governor's last poll (the diagnostics
        timer polls), so a scrape never reads sysfs nor changes the throttle.
        """
        configured = self._configured
        worker = configured.worker if configured is not None else None
        engine = worker.engine if worker is not None else None
        waiting = depth = running = 0
        if worker is not None:
            snap = worker.snapshot()
            waiting, depth, running = snap.waiting, snap.queue_depth, int(snap.running)
        kv_used, kv_capacity = engine.kv_occupancy() if engine is not None else (0, 0)
        thermal = configured.governor.state if configured is not None else None
        hottest = thermal.hottest if thermal is not None else None
        return Gauges(queue_waiting=waiting, queue_capacity=depth, running=running,
                      kv_used=kv_used, kv_capacity=kv_capacity,
                      rss_bytes=self._process.memory_info().rss,
                      soc_temp_c=hottest.celsius if hottest is not None else None,
                      throttled=thermal is not None and thermal.throttled)

    def health(self) -> NodeHealth:
        configured = self._configured
        worker = configured.worker if configured is not None else None
        config = configured.config if configured is not None else None
        engine = worker.engine if worker is not None else None
        full = worker is not None and not worker.has_room()
        last_error = worker.stats.last_error if worker is not None else ''
        thermal = self._poll_thermal(configured)   # first: the gauges read this poll
        return NodeHealth(
            node_name=self.get_fully_qualified_name(), state=self._state,
            model=engine.model_name if engine else '', model_dir=engine.model_dir if engine
            else '', providers=','.join(engine.providers) if engine else '',
            queue_full=full, gauges=self._gauges(), figures=self._figures.snapshot(),
            board=config.board if config is not None else '',
            warnings=config.warnings if config is not None else (),
            extra=tuple(thermal.diagnostics().items()) if thermal is not None else (),
            load_error=self._load_error, last_error=last_error)

    def _publish_diagnostics(self) -> None:
        msg = DiagnosticArray(status=[build_status(self.health())])
        msg.header.stamp = self.get_clock().now().to_msg()
        self._diagnostics_pub.publish(msg)


def _unset_on_done(outcome: JobOutcome) -> None:
    raise RuntimeError('job submitted before its on_done was set')


def _error_kind(exc: Exception) -> str:
    """Generate.Result.ERROR_* of a request that failed before it was queued."""
    if isinstance(exc, WorkerStoppedError):
        return Generate.Result.ERROR_UNAVAILABLE
    if isinstance(exc, EngineError):
        return Generate.Result.ERROR_INVALID_REQUEST
    return Generate.Result.ERROR_FAILED


def _stop_serving(node: LLMNode) -> None:
    """On Ctrl-C, while the executor still spins: end the goals, let their answers go out."""
    node.release()
    node.wait_requests_answered(ANSWER_GRACE_S)


def main(args=None) -> int:
    """Console script `llm_node`: spin until Ctrl-C or SIGTERM, then free the model; exit 0."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    return run_node(
        'llm_node', LLMNode, (InvalidParameterTypeException, InvalidParameterValueException),
        args, executor_factory=lambda: MultiThreadedExecutor(
            num_threads=max(4, os.cpu_count() or 1)),
        release_while_spinning=_stop_serving, release_after_spin=LLMNode.release,
        # A parameter override of the wrong type or out of range: say which, no traceback.
        hint='a string that looks like a number needs quotes: '
             '-p engine.cpu_affinity:="\'2-3\'"')


if __name__ == '__main__':
    raise SystemExit(main())
