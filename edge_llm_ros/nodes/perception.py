"""perception: map frames zero-copy, run an ONNX image model, publish embedding handles.

Input: TensorHandles on ``input.topic`` (frame_source's ``~/frames``), resolved into
read-only views of the producer's buffers; the view is bound as the model input through
onnxruntime IOBinding (no copy) and held until the run ends. Output: the model writes
straight into a loaned buffer of this node's own pool (IOBinding again), which is then
published with the frame's header as a TensorHandle on ``~/embeddings`` (and as a copy
on ``~/embeddings_copy`` for consumers that cannot map it). A Generate goal can carry
that handle in ``prefix_embeddings``.

Default model: the random patch-embedding stand-in of edge_llm_ros.vision.default_model
(written by edge_llm_ros.convert.standin_encoder)
(NOT a trained encoder) sized to the LLM's hidden size; ``model.path`` takes any
single-input ONNX image model whose input accepts the frames as they are, or a converted VLM
folder (edge-llm-convert --mmproj): then the frames go through its vision encoder, the code
llm_node runs (vision/vlm_frames.py), and a goal brings the handle in ``images`` where its
prompt says ``<__media__>``.
Inference runs on a worker thread; the newest frame wins, older unread ones are dropped.

Time window (``window.seconds`` > 0, vision/window.py): every frame the worker takes is also
copied once into the node's window pool (``window.pool_id``, at most ``window.max_frames``
frames within ``window.max_mb``) and indexed by its header stamp; the ``~/window`` service
(edge_llm_msgs/GetWindow) resolves "the last N seconds" or two stamps to those frames' handles,
sampled at a given fps / count, oldest first: a goal then carries them in ``images``. No pixels
travel in the reply or the goal.
"""
import os
import sys
import threading
import time
from typing import Optional, Tuple

import numpy as np
from rclpy.node import Node

from edge_llm_ros.bringup.errors import BringupError
from edge_llm_ros.bringup.parameters import schema
from edge_llm_ros.convert.standin_encoder import build_model
from edge_llm_ros.errors import EngineError
from edge_llm_ros.ipc.errors import DescriptorError, IpcError, PoolExhaustedError
from edge_llm_ros.ipc.pool import PoolConfig, TensorPool
from edge_llm_ros.nodes.handles import to_handle
from edge_llm_ros.nodes.node_params import ConfigError, declare_and_read
from edge_llm_ros.nodes.runner import run_node
from edge_llm_ros.nodes.tensor_input import Sample, TensorInput
from edge_llm_ros.nodes.tensor_output import CopyKind, TensorOutput
from edge_llm_ros.vision.errors import ModelMismatchError, VisionError
from edge_llm_ros.vision.params import perception_config
from edge_llm_ros.vision.runner import VisionModel
from edge_llm_ros.vision.vlm_frames import vlm_folder, VlmFrameEncoder
from edge_llm_ros.vision.window import NS, window_request, WindowError, WindowRing

LOG_THROTTLE_S = 5.0
TAKE_TIMEOUT_S = 0.2


class PerceptionNode(Node):
    """Frames in (mapped), embeddings out (written by the model into our own pool)."""

    def __init__(self, **kwargs) -> None:
        super().__init__('perception', **kwargs)
        try:
            self.config = perception_config(declare_and_read(self, schema('perception')))
        except (BringupError, EngineError) as exc:
            raise ConfigError(str(exc)) from None
        cfg = self.config
        if cfg.process_cpus:
            os.sched_setaffinity(0, cfg.process_cpus)
        vlm = vlm_folder(cfg.model_path)
        if vlm is not None:   # a converted VLM: its own encoder, rows in their wire form
            self.model = VlmFrameEncoder(vlm, cfg.runner)
        else:
            source = cfg.model_path or build_model(cfg.stand_in).SerializeToString()
            self.model = VisionModel(source, cfg.runner)
        self.pool: Optional[TensorPool] = None
        self._layout: Optional[Tuple[str, Tuple[int, ...]]] = None
        self._stop = threading.Event()
        self._last_log = {}
        self.processed = 0
        self.rejected = 0
        self.window: Optional[WindowRing] = None
        try:
            if cfg.window.seconds > 0:
                self._open_window()
            self.output = TensorOutput(self, '~/embeddings', CopyKind.TENSOR,
                                       cfg.pool.copy_fallback)
            if all(d is not None for d in self.model.output.shape):
                self._ensure_pool(self.model.output.dtype, self.model.output.shape)
            self.input = TensorInput(self, cfg.input_topic, CopyKind.IMAGE,
                                     socket_dir=cfg.pool.socket_dir, transport=cfg.transport,
                                     pool_id=cfg.input_pool_id, max_inflight=1)
        except BaseException:
            if self.pool is not None:
                self.pool.close()
            raise
        model = (f'VLM encoder of {cfg.model_path} (goals take its handles in images)' if vlm
                 else cfg.model_path or (f'built-in stand-in (random weights, seed '
                                         f'{cfg.stand_in.seed}, NOT a trained encoder)'))
        self.get_logger().info(
            f'{model}: input {self.model.input.describe()} -> output '
            f'{self.model.output.describe()} on {", ".join(self.model.providers)}; frames '
            f'from {self.input.topic} -> {self.output.topic}')
        self._worker = threading.Thread(target=self._work, name='inference', daemon=True)
        self._worker.start()

    def _open_window(self) -> None:
        """Make the window ring (its pool comes with the first frame) and ~/window."""
        from edge_llm_msgs.srv import GetWindow
        cfg, win = self.config.pool, self.config.window

        def make_pool(nbytes: int, slots: int) -> TensorPool:
            return TensorPool(PoolConfig(pool_id=win.pool_id, slot_nbytes=nbytes, slots=slots,
                                         allocator=cfg.allocator, lease_s=cfg.lease_s,
                                         socket_dir=cfg.socket_dir))
        self.window = WindowRing(win.seconds, win.max_frames, win.max_bytes, make_pool)
        self.create_service(GetWindow, '~/window', self._on_window)

    def _on_window(self, request, response):
        """Resolve a time window to its frames' handles (GetWindow; errors in the reply)."""
        now = self.get_clock().now().nanoseconds
        try:
            frames = self.window.select(window_request(
                request.last_seconds, _ns(request.start), _ns(request.end), request.fps,
                request.max_frames, now))
        except WindowError as exc:
            response.success, response.error_message = False, str(exc)
        else:
            response.success = True
            response.frames = [to_handle(desc, header) for desc, header in
                               (held.item for held in frames)]
        count, oldest, newest = self.window.span()
        response.held_frames = count
        if count:
            response.held_oldest = _stamp(oldest)
            response.held_newest = _stamp(newest)
        return response

    def _ensure_pool(self, dtype: np.dtype, shape: Tuple[int, ...]) -> None:
        if self.pool is not None:
            return
        cfg = self.config.pool
        self._layout = (np.dtype(dtype).name, tuple(int(d) for d in shape))
        nbytes = int(np.prod(self._layout[1], dtype=np.int64)) * np.dtype(dtype).itemsize
        self.pool = TensorPool(PoolConfig(pool_id=cfg.pool_id, slot_nbytes=max(nbytes, 1),
                                          slots=cfg.slots, allocator=cfg.allocator,
                                          lease_s=cfg.lease_s, socket_dir=cfg.socket_dir))
        self.get_logger().info(f'embeddings pool {cfg.pool_id!r}: {cfg.slots} x '
                               f'{self._layout[0]} {list(self._layout[1])} '
                               f'({self.pool.kind.name})')

    # --- worker thread ------------------------------------------------------------------
    def _work(self) -> None:
        period = 1.0 / self.config.rate_hz if self.config.rate_hz else 0.0
        next_t = time.monotonic()
        while not self._stop.is_set():
            wait = next_t - time.monotonic()
            if self.window is None and wait > 0 and self._stop.wait(wait):
                return   # (with a window every frame is taken; rate_hz paces inference only)
            sample = self.input.take(TAKE_TIMEOUT_S)
            if sample is None:
                continue
            with sample:
                if self.window is not None:
                    self._keep(sample)
                    if time.monotonic() < next_t:
                        continue
                next_t = time.monotonic() + period
                try:
                    self._infer(sample)
                except (ModelMismatchError, DescriptorError) as exc:
                    self.rejected += 1
                    self._log('error', 'mismatch', f'frame rejected: {exc}')
                except PoolExhaustedError as exc:
                    self._log('warn', 'full', f'skipping a frame: {exc}')
                except Exception as exc:  # noqa: B902 - keep serving; onnxruntime errors vary
                    self._log('error', 'run', f'inference failed: {exc!r}')

    def _keep(self, sample: Sample) -> None:
        """Copy the frame into the time window (one copy; the producer's slot is let go)."""
        try:
            made = self.window.add(sample.array, _ns(sample.header.stamp), sample.header)
        except (WindowError, PoolExhaustedError) as exc:
            self._log('warn', 'window', f'frame not kept in the window: {exc}')
        except Exception as exc:  # noqa: B902 - keep serving inference and the older frames
            self._log('error', 'window', f'frame not kept in the window: {exc!r}')
        else:
            if made:
                self.get_logger().info(made)

    def _infer(self, sample: Sample) -> None:
        frame = sample.array   # held (mapped read-only) until the with-block in _work ends
        self.model.input_shape(frame.dtype, frame.shape)
        if self.pool is None:
            self._ensure_pool(*self.model.output_layout(frame))
        dtype, shape = self._layout
        if isinstance(self.model, VlmFrameEncoder) and \
                self.model.output_layout(frame)[1] != shape:
            raise ModelMismatchError(f'a {list(frame.shape)} frame makes image rows of another '
                                     f'shape than the pool holds ({list(shape)}): the camera '
                                     'changed size; restart perception for the new size')
        loan = self.pool.loan()
        try:
            out = loan.ndarray(dtype, shape)
            self.model.run(frame, out)
            desc = loan.publish()
        except BaseException:
            loan.discard()
            raise
        self.output.publish(desc, out, sample.header)
        self.processed += 1

    def _log(self, level: str, key: str, text: str) -> None:
        now = time.monotonic()
        if now - self._last_log.get(key, -LOG_THROTTLE_S) >= LOG_THROTTLE_S:
            self._last_log[key] = now
            getattr(self.get_logger(), level)(text)

    def shutdown(self) -> None:
        """Stop the worker, disconnect from the frames pool, free the embeddings pool."""
        self._stop.set()
        self._worker.join(timeout=5.0)
        self.get_logger().info(f'{self.processed} frames processed, {self.rejected} rejected; '
                               f'input {self.input.stats}; output {self.output.stats}')
        self.input.close()
        if self.window is not None:
            self.window.close()
        if self.pool is not None:
            self.pool.close()


def _ns(stamp) -> int:
    """Return a builtin_interfaces/Time as nanoseconds."""
    return int(stamp.sec) * NS + int(stamp.nanosec)


def _stamp(ns: int):
    """Return nanoseconds as a builtin_interfaces/Time."""
    from builtin_interfaces.msg import Time
    return Time(sec=ns // NS, nanosec=ns % NS)


def main(args=None) -> int:
    """Console script entry point: 0 after Ctrl-C, 2 on a configuration or model error."""
    return run_node('perception', PerceptionNode, (ConfigError, VisionError, IpcError), args)


if __name__ == '__main__':
    sys.exit(main())
