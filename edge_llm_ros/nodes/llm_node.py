"""llm_node: a lifecycle node serving the engine as a queued, streaming action and services.

Interfaces (all relative to the node's name):
  ~/generate   edge_llm_msgs/action/Generate   streamed, cancellable, queued (llm_action.py)
  ~/complete   edge_llm_msgs/srv/Complete      one-shot, through the same queue (llm_complete.py)
  ~/tokenize   edge_llm_msgs/srv/Tokenize      answered at once, never queued (llm_services.py)
  ~/detokenize edge_llm_msgs/srv/Detokenize    answered at once, never queued
  ~/embed      edge_llm_msgs/srv/Embed         texts -> vectors, an embedding folder only
  ~/rerank     edge_llm_msgs/srv/Rerank        query + documents -> scores (llm_embed.py)
  ~/get_model_info edge_llm_msgs/srv/GetModelInfo  answered at once, in every state
  ~/get_session edge_llm_msgs/srv/GetSession   one conversation: turns, tokens, KV bytes
  ~/list_sessions edge_llm_msgs/srv/ListSessions  the conversations kept
  ~/reset_session edge_llm_msgs/srv/ResetSession  forgets sessions between two generations
  ~/warm_prompt edge_llm_msgs/srv/WarmPrompt      pins one more warm prompt between two
                                                  generations (kv.warm_prompts at configure)
  ~/list_adapters, ~/load_adapter, ~/unload_adapter  LoRA adapters per goal, loaded and
                                                  unloaded at run time (llm_adapters.py)
  ~/update_model edge_llm_msgs/srv/UpdateModel  installs a signed model, swaps it in
                                                  (model_update.py)
  ~/transcript edge_llm_msgs/msg/Transcript    one message per finished or refused request
                                                  (llm_admission.py)
  ~/detections vision_msgs (or edge_llm_msgs) Detection2DArray  a grounding VLM's boxes and
                                                  points in the frame's pixels
                                                  (llm_detections.py)
  /diagnostics diagnostic_msgs/DiagnosticArray every diagnostics.period_s (llm_health.py)
Parameters: bringup.parameters' llm_node schema (see nodes/llm_config.py).

This module is the lifecycle: on_configure reads the parameters once and builds the node's
resources (llm_resources.py: the engine worker loads the model on its own thread; a failure
returns FAILURE, the node stays unconfigured, the error is logged and shown in /diagnostics);
on_activate opens the queue; on_deactivate closes it and cancels the running and queued goals
(they end ABORTED with finish_reason 'cancelled', their partial text and an error_message
saying why) and waits for the worker to go idle; on_cleanup and on_shutdown free the model.
The node's state is rclpy's (lifecycle_state()), never a copy.

Threading: inference runs only on the engine worker thread (serving/worker.py). Callback
groups: lifecycle services + autostart share the default (mutually exclusive) group, so a slow
configure blocks only other transitions; the action, ~/complete, ~/tokenize, the other small
services and the diagnostics timer each have their own group.
Shutdown (Ctrl-C, SIGTERM): see nodes/spin.py and nodes/runner.py; the goals still running
or queued end ABORTED, the model is freed, the process exits 0.
CPU pinning (engine.cpu_affinity): every thread of the process is pinned before the model
loads, the worker (decode) thread to the first core, ORT's intra-op threads one per core;
the thermal governor (thermal.*) narrows the cores and paces tokens when the SoC runs hot.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, List, Optional

import psutil
from rclpy.exceptions import InvalidParameterTypeException, InvalidParameterValueException
from rclpy.executors import MultiThreadedExecutor
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.parameter import Parameter

from edge_llm_ros import rclpy_internals
from edge_llm_ros.metrics.figures import FigureRecorder
from edge_llm_ros.nodes.llm_action import GenerateServer
from edge_llm_ros.nodes.llm_adapters import LLMAdapterServices
from edge_llm_ros.nodes.llm_admission import Admission
from edge_llm_ros.nodes.llm_complete import CompleteService
from edge_llm_ros.nodes.llm_config import (check_changes, ConfigError, current_values,
                                           declare_parameters, read_config, runtime_config,
                                           RuntimeConfig)
from edge_llm_ros.nodes.llm_detections import DetectionPublisher, DetectionsConfigError
from edge_llm_ros.nodes.llm_embed import EmbedServices
from edge_llm_ros.nodes.llm_health import Health
from edge_llm_ros.nodes.llm_resources import configure, Configured, ConfigureFailed, release
from edge_llm_ros.nodes.llm_services import LLMServices
from edge_llm_ros.nodes.model_update import ModelUpdater
from edge_llm_ros.nodes.runner import run_node
from edge_llm_ros.rclpy_compat import add_set_parameters_callbacks
from edge_llm_ros.serving.goal import CancelReason
from edge_llm_ros.serving.worker import EngineWorker

NODE_NAME = 'llm_node'
# On Ctrl-C, how long the goals and ~/complete calls that release() ended may take to send
# their answers before the executor stops.
ANSWER_GRACE_S = 2.0
# The decode thread needs the GIL between two model steps (ORT runs without it); an executor
# thread holding it (a wait set rebuilt, a callback) otherwise keeps it up to CPython's 5 ms
# switch interval: a token's (and the first token's) delay. Waiting threads get it sooner.
GIL_SWITCH_INTERVAL_S = 0.0001
# How long deactivation waits for the cancelled goals to end.
DEACTIVATE_WAIT_S = 10.0


class LLMNode(LifecycleNode):
    """Lifecycle node wrapping one engine (see the module docstring)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(NODE_NAME, **kwargs)
        declare_parameters(self)
        self.runtime: RuntimeConfig = runtime_config(current_values(self))
        add_set_parameters_callbacks(self, check_changes, self._on_parameters_set)
        self.configured: Optional[Configured] = None
        self.detections: Optional[DetectionPublisher] = None   # ~/detections, once configured
        self.load_error = ''
        # Goal counts and latency histograms: /diagnostics and /metrics both read these.
        self.figures = FigureRecorder()
        self.process = psutil.Process()
        self.admission = Admission(self)        # one NodeGoal per request, ~/transcript
        self.action = GenerateServer(self, self.admission)       # ~/generate
        self.complete = CompleteService(self, self.admission)    # ~/complete
        self.llm_services = LLMServices(self)   # ~/tokenize, ~/detokenize, ...
        self.adapter_services = LLMAdapterServices(self)   # ~/list_adapters, ~/load_adapter, ...
        self.embed_services = EmbedServices(self)   # ~/embed, ~/rerank
        self.updater = ModelUpdater(self)       # ~/update_model
        self.health = Health(self, self.get_parameter('diagnostics.period_s').value)
        self._autostart_timer = None
        if self.get_parameter('autostart').value:
            # Default group: runs like a change_state request, once the executor spins.
            self._autostart_timer = self.create_timer(0.0, self._autostart)

    # ---- what the collaborators read ---------------------------------------------------------
    @property
    def worker(self) -> Optional[EngineWorker]:
        configured = self.configured
        return configured.worker if configured is not None else None

    @property
    def engine(self) -> Any:
        """Return the worker's loaded engine, local or remote; None while unconfigured."""
        worker = self.worker
        return worker.engine if worker is not None else None

    def lifecycle_state(self) -> str:
        """Return rclpy's current lifecycle state label: 'unconfigured', 'configuring', ..."""
        return rclpy_internals.lifecycle_state(self)

    # ---- lifecycle ---------------------------------------------------------------------------
    def _autostart(self) -> None:
        self._autostart_timer.cancel()
        self.destroy_timer(self._autostart_timer)
        if self.trigger_configure() == TransitionCallbackReturn.SUCCESS:
            self.trigger_activate()

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        t0 = time.monotonic()
        try:
            config = self.updater.configured(read_config(self))
            for warning in config.warnings:
                self.get_logger().warn(warning)
            self.configured = configure(config, current_values(self), self.figures,
                                        self.health.gauges, self.get_logger())
        except ConfigError as exc:
            return self._configure_failed(f'invalid parameter: {exc}')
        except ConfigureFailed as exc:
            return self._configure_failed(str(exc))
        engine = self.engine
        self._drop_detections()
        try:
            self.detections = DetectionPublisher(self, config.detections, engine)
        except DetectionsConfigError as exc:
            self.release()
            return self._configure_failed(f'invalid parameter: {exc}')
        self.load_error = ''
        self.get_logger().info(
            f'loaded {engine.model_name} from {engine.model_dir} in {time.monotonic() - t0:.1f}'
            f' s (context {engine.context_length}, providers {", ".join(engine.providers)})')
        if config.engine.session_store and hasattr(engine, 'sessions'):
            self.get_logger().info(f'sessions.store {config.engine.session_store}: '
                                   f'{len(engine.sessions())} saved sessions restored')
        for prompt in engine.warm_prompts() if hasattr(engine, 'warm_prompts') else ():
            log = self.get_logger().warning if prompt.stored_error else self.get_logger().info
            log(f'warm prompt {prompt.label!r}: {prompt.tokens} tokens, {prompt.nbytes} bytes '
                f'pinned, {prompt.status}')
        return TransitionCallbackReturn.SUCCESS

    def _configure_failed(self, message: str) -> TransitionCallbackReturn:
        self.load_error = message
        self.get_logger().error(f'configure failed, staying unconfigured: {message}')
        return TransitionCallbackReturn.FAILURE

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.worker.set_accepting(True)
        self.get_logger().info('active: serving ~/generate, ~/complete and ~/tokenize')
        return super().on_activate(state)

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        worker = self.worker
        if worker is not None:
            worker.set_accepting(False)
            worker.cancel_all(CancelReason.DEACTIVATED)
            if not worker.wait_idle(timeout=DEACTIVATE_WAIT_S):
                self.get_logger().error(
                    f'the engine worker did not go idle within {DEACTIVATE_WAIT_S:g} s')
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.release()
        self._drop_detections()
        return super().on_cleanup(state)

    def _drop_detections(self) -> None:
        detections, self.detections = self.detections, None
        if detections is not None:
            detections.destroy()

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.release()
        return super().on_shutdown(state)

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.release()
        return TransitionCallbackReturn.SUCCESS

    def release(self) -> None:
        """Free the model (safe in any state; also the process exit path after Ctrl-C).

        Requests held by a model update end too, unless that update is swapping the model
        now (its cleanup comes here): it queues them on the new model itself.
        """
        if not self.updater.swapping:
            self.admission.end_held(CancelReason.SHUTDOWN)
        configured, self.configured = self.configured, None
        if configured is not None:
            release(configured, CancelReason.SHUTDOWN)
        self.embed_services.close()   # its reply pool: sized to the model just freed

    def wait_requests_answered(self, timeout: float) -> bool:
        """Wait until no goal or ~/complete call is being answered (the executor spins)."""
        return self.admission.wait_requests_answered(timeout)

    def _on_parameters_set(self, parameters: List[Parameter]) -> None:
        """Rebuild the runtime config with the accepted values (on Humble not yet stored)."""
        values = current_values(self)
        values.update((param.name, param.value) for param in parameters)
        self.runtime = runtime_config(values)
        worker = self.worker
        if worker is not None:
            worker.feedback = self.runtime.feedback


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
        hint='a string that YAML reads as a number or a boolean (off, on, yes, no) needs '
             'quotes: -p engine.cpu_affinity:="\'2-3\'" -p speculative.mode:="\'off\'"')


if __name__ == '__main__':
    raise SystemExit(main())
