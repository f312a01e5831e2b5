"""llm_node's ~/update_model: install a signed model and swap it in through the lifecycle.

What a request does (docs/model_updates.md):
1. Refused at once, nothing changed, when update.public_key or update.models_root is ''
   or the node has no model loaded (unconfigured): the response says which.
2. The folder or delta package is verified (ed25519 signature first, then every file's
   sha256) and installed as a new version under update.models_root (edge_llm_ros.update),
   while the node keeps serving. A delta patches the model the node serves now.
3. The drain: from here new goals (and ~/complete calls) are held by the node's admission,
   unprepared, and so are the goals that waited in the worker's queue; the running goals
   (paused ones too) finish. Those still running after update.drain_timeout_s are
   cancelled: ABORTED, finish_reason cancelled, error_kind model_update, partial text kept.
4. The swap goes through the lifecycle with no goal left to stop: deactivate, cleanup (the
   old model is freed: only one model is in memory at a time), configure with the new
   version (model.path is overridden), then `<models_root>/current` is switched to it and
   the node is activated again if it was active.
5. The sessions' conversations go to the new model as text (their ids and KV were the old
   model's): each one's next turn prefills it again. With sessions.store the new engine
   finds them in the file (rows of another model keep their text).
6. The held goals are prepared for the new model and queued in their order. If the new
   model does not load, the override is dropped and the old model is configured (and
   activated) again; the response gives the load error, the new version is removed and the
   held goals run on the old model.
`current` is switched only after the new model loaded, so a kill -9 at any point (the drain
included) leaves it naming a model that loads, and sessions.store holds every turn that
ended before.

Threading: the service is in the node's default (mutually exclusive) callback group, like
the lifecycle services, so a change_state request never runs in the middle of a swap. Its
coroutine awaits a plain thread doing the verification and the transitions, so no executor
thread is held meanwhile and the other services, the action and diagnostics keep answering.
What it uses of the node: `lifecycle_state()`, `engine`, `load_error` and the trigger_*
transitions; llm_node calls `configured()` from on_configure, which also verifies a model
folder installed under update.models_root before it loads (a version corrupted on disk
fails configure with the reason).
"""
from __future__ import annotations

from dataclasses import replace
import os
import pathlib
import threading
import time
import traceback
from typing import Any, Dict, Tuple

from rclpy.lifecycle import TransitionCallbackReturn
from rclpy.task import Future

from edge_llm_msgs.srv import UpdateModel
from edge_llm_ros.nodes.node_params import ConfigError
from edge_llm_ros.serving.goal import CancelReason
from edge_llm_ros.update import signing
from edge_llm_ros.update.errors import UpdateError
from edge_llm_ros.update.install import Installed, ModelsRoot
from edge_llm_ros.update.manifest import verify_folder

# Versions kept under the models root after a successful swap: the new one and the previous.
KEEP_VERSIONS = 2
# How long the goals cancelled at the drain's end, and the session hand-over, may take.
CANCEL_WAIT_S = 10.0


class ModelUpdater:
    """Serves ~/update_model for one llm_node (see the module docstring)."""

    def __init__(self, node: Any) -> None:
        self._node = node
        # The version folder installed by the last successful update ('' = model.path).
        self._override = ''
        self._just_installed = ''   # verified by the update that is being configured
        self._swapping = False
        self._service = node.create_service(UpdateModel, '~/update_model', self._on_update,
                                            callback_group=node.default_callback_group)

    def configured(self, config):
        """Return on_configure's config, model.path replaced by the installed update if any.

        A model folder installed under update.models_root is verified first (signature and
        every hash, ~0.3 s per 100 MB), except the one an update just installed and
        verified: a version corrupted on disk since (a failing SD card) fails configure
        with ConfigError instead of loading.
        """
        model_dir = self._override or config.engine.model_dir
        if model_dir and model_dir != self._just_installed:
            self._check_installed(model_dir)
        self._just_installed = ''
        if not self._override:
            return config
        return replace(config, engine=replace(config.engine, model_dir=self._override))

    def _check_installed(self, model_dir: str) -> None:
        key = str(self._node.get_parameter('update.public_key').value)
        root = str(self._node.get_parameter('update.models_root').value)
        if not key or not root:
            return
        folder = pathlib.Path(os.path.realpath(model_dir))
        if folder.parent != pathlib.Path(os.path.realpath(ModelsRoot(root).versions)):
            return
        try:
            verify_folder(folder, signing.load_public(key))
        except UpdateError as exc:
            raise ConfigError(f'model.path {model_dir} is an installed update that does not '
                              f'verify ({exc}); switch {root}/current to a good version '
                              '(edge-llm-update switch) or install it again') from None

    async def _on_update(self, request: UpdateModel.Request,
                         response: UpdateModel.Response) -> UpdateModel.Response:
        done = Future()
        threading.Thread(target=self._answer, args=(request.path, response, done),
                         name='model_update', daemon=True).start()
        return await done

    def _answer(self, path: str, response: UpdateModel.Response, done: Future) -> None:
        log = self._node.get_logger()
        try:
            response.success, response.message = self._update(path, response)
        except UpdateError as exc:
            response.success, response.message = False, f'update refused: {exc}'
        except Exception as exc:  # noqa: B902 - answer, never end the process
            log.error(f'~/update_model failed unexpectedly: '
                      f'{"".join(traceback.format_exception(exc)).rstrip()}')
            response.success = False
            response.message = (f'update failed unexpectedly ({type(exc).__name__}: {exc}); '
                                'see the node log')
        finally:
            done.set_result(response)
            executor = self._node.executor
            if executor is not None:
                executor.wake()
        # One call site per severity: rclpy refuses to change it between calls of one site.
        if response.success:
            log.info(f'~/update_model: {response.message}')
        else:
            log.warn(f'~/update_model: {response.message}')

    def _settings(self) -> Tuple[Any, ModelsRoot]:
        node = self._node
        key = str(node.get_parameter('update.public_key').value)
        root = str(node.get_parameter('update.models_root').value)
        if not key or not root:
            raise UpdateError(f'{node.get_name()} does not take model updates: set both '
                              "update.public_key (the signing key's public half) and "
                              'update.models_root')
        return signing.load_public(key), ModelsRoot(root)

    def _update(self, path: str, response: UpdateModel.Response) -> Tuple[bool, str]:
        node = self._node
        trusted, root = self._settings()
        engine = node.engine
        state = node.lifecycle_state()
        if state not in ('inactive', 'active') or engine is None:
            raise UpdateError(f'{node.get_name()} is {state}: configure it first (an '
                              'update replaces the loaded model)')
        if str(node.get_parameter('engine.backend').value) != 'local':
            raise UpdateError(f'{node.get_name()} forwards goals to a remote server '
                              '(engine.backend remote): there is no local model to update')
        previous = os.path.realpath(engine.model_dir)
        response.previous_model_dir = previous
        installed = root.install(pathlib.Path(path), trusted, base=previous)
        if os.path.realpath(installed.path) == previous:
            response.model_dir = previous
            return True, f'{installed.path} is already serving: nothing to do'
        timeout = float(node.get_parameter('update.drain_timeout_s').value)
        node.get_logger().info(f'model update: {previous} -> {installed.path}; draining: the '
                               f'running goals finish (at most {timeout:g} s), new goals wait')
        return self._swap(root, installed, previous, response, timeout)

    @property
    def swapping(self) -> bool:
        """Whether an update is draining or swapping the model now."""
        return self._swapping

    def _swap(self, root: ModelsRoot, installed: Installed, previous: str,
              response: UpdateModel.Response, timeout: float) -> Tuple[bool, str]:
        node = self._node
        admission, worker = node.admission, node.worker
        was_active = node.lifecycle_state() == 'active'
        admission.hold(worker.queue_depth + worker.slots)
        self._swapping = True
        try:
            drained = self._drain(worker, timeout)
            conversations = self._conversations(worker)
            if was_active:
                node.trigger_deactivate()
            node.trigger_cleanup()
            success, message = self._load(root, installed, previous, response)
            self._adopt(conversations)
            return success, message + drained
        finally:
            # Whatever happened, a node that was serving serves again (if a model is loaded),
            # and the goals that waited run on whichever model serves now.
            if was_active and node.lifecycle_state() == 'inactive':
                node.trigger_activate()
            self._swapping = False
            admission.release_held()

    def _drain(self, worker: Any, timeout: float) -> str:
        """Let the running goals finish (at most `timeout` s); say how it went.

        The waiting goals move to the node's hold first, so no goal starts on the old model;
        the ones still running when `timeout` runs out are cancelled (MODEL_UPDATE).
        """
        t0 = time.monotonic()
        self._node.admission.hold_waiting(worker)
        running = worker.unfinished()
        cancelled = 0
        if not worker.wait_idle(timeout):
            cancelled = worker.unfinished()
            worker.cancel_all(CancelReason.MODEL_UPDATE)
            if not worker.wait_idle(CANCEL_WAIT_S):
                self._node.get_logger().error(
                    f'the engine worker did not go idle within {CANCEL_WAIT_S:g} s')
        waited = time.monotonic() - t0
        self._node.get_logger().info(
            f'model update: drained {running} running goal(s) in {waited:.2f} s'
            + (f', {cancelled} cancelled at update.drain_timeout_s' if cancelled else ''))
        return (f' (drained {running} running goal(s) in {waited:.2f} s'
                + (f', {cancelled} cancelled at update.drain_timeout_s {timeout:g} s)'
                   if cancelled else ')'))

    def _conversations(self, worker: Any) -> Dict[str, Any]:
        """Return the old model's session conversations (the new one keeps them as text)."""
        engine = worker.engine
        if not hasattr(engine, 'conversations'):
            return {}   # a remote backend keeps no sessions here
        return worker.run_between_jobs(lambda e: e.conversations(), CANCEL_WAIT_S)

    def _adopt(self, conversations: Dict[str, Any]) -> None:
        engine = self._node.engine
        if not conversations or engine is None:
            return
        adopted = self._node.worker.run_between_jobs(
            lambda e: e.adopt_conversations(conversations), CANCEL_WAIT_S)
        self._node.get_logger().info(
            f'model update: {adopted} session(s) kept as text for the new model (their next '
            f'turn prefills them again), {len(conversations) - adopted} restored from '
            'sessions.store')

    def _load(self, root: ModelsRoot, installed: Installed, previous: str,
              response: UpdateModel.Response) -> Tuple[bool, str]:
        node = self._node
        old_override, self._override = self._override, str(installed.path)
        self._just_installed = self._override
        if node.trigger_configure() == TransitionCallbackReturn.SUCCESS:
            response.model_dir = str(installed.path)
            try:
                root.switch(installed.path)
                root.prune(KEEP_VERSIONS)
            except (UpdateError, OSError) as exc:
                return True, (f'now serving {installed.path}, but {root.current_link} could '
                              f'not be switched to it ({exc}): a restart loads the old model')
            return True, (f'now serving {installed.manifest.model_name} from '
                          f'{installed.path}{self._model_path_note(root)}')
        why = node.load_error
        self._override = old_override
        restored = node.trigger_configure() == TransitionCallbackReturn.SUCCESS
        if not installed.reused:
            root.remove(installed.path)
        response.model_dir = previous if restored else ''
        if restored:
            return False, (f'the new model {installed.path} failed to load ({why}); '
                           f'{previous} is serving again')
        return False, (f'the new model {installed.path} failed to load ({why}) and reloading '
                       f'{previous} failed too ({node.load_error}): the node is '
                       f'{node.lifecycle_state()}; configure it again')

    def _model_path_note(self, root: ModelsRoot) -> str:
        model_path = str(self._node.get_parameter('model.path').value)
        if model_path and os.path.realpath(model_path) == os.path.realpath(root.current_link):
            return ''
        return (f' (model.path is {model_path or "the embedded default"}: a restart loads '
                f'that again; set model.path to {root.current_link})')
