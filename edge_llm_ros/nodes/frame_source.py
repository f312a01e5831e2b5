"""frame_source: publish camera frames into a shared pool, TensorHandles on ~/frames.

Frames (uint8 [height, width, 3], RGB) are written straight into a loaned buffer of the
node's TensorPool, published, and announced by a small TensorHandle on ``~/frames``
(sensor QoS: best effort, keep last 2). Consumers on this host map the buffer read-only;
for consumers that cannot (another host), copies go out on ``~/frames_copy`` as
``sensor_msgs/Image`` (parameter copy_fallback).

Sources (parameter ``source``): the synthetic counter pattern (default), an image folder or
file (Pillow), a video file or a V4L2 camera (PyAV), or ``topic:<name>``: an existing
``sensor_msgs/Image`` camera topic, copied once into the pool as each image arrives.
A capture thread paces file and device sources at ``rate_hz``; the executor only serves
ROS traffic.
"""
import sys
import threading
import time
from typing import Optional

import numpy as np
from rclpy.node import Node
from sensor_msgs.msg import Image

from edge_llm_ros.bringup.parameters import schema
from edge_llm_ros.ipc.errors import IpcError, PoolExhaustedError
from edge_llm_ros.ipc.pool import PoolConfig, TensorPool
from edge_llm_ros.nodes import copy_codec
from edge_llm_ros.nodes.handles import make_header
from edge_llm_ros.nodes.node_params import ConfigError, declare_and_read
from edge_llm_ros.nodes.runner import run_node
from edge_llm_ros.nodes.tensor_output import CopyKind, SENSOR_QOS, TensorOutput
from edge_llm_ros.vision.errors import FrameDecodeError, SourceError, VisionError
from edge_llm_ros.vision.params import frame_source_config
from edge_llm_ros.vision.sources import FrameReader, open_source, parse_source, SourceKind
from edge_llm_ros.vision.synthetic import CHANNELS

LOG_THROTTLE_S = 5.0


class FrameSourceNode(Node):
    """Owns the frames pool; a capture thread (or an Image subscription) fills it."""

    def __init__(self, **kwargs) -> None:
        super().__init__('frame_source', **kwargs)
        self.config = frame_source_config(declare_and_read(self, schema('frame_source')))
        cfg = self.config
        self.shape = (cfg.height, cfg.width, CHANNELS)
        spec = parse_source(cfg.source)
        self._reader: Optional[FrameReader] = open_source(cfg.source, cfg.width, cfg.height,
                                                          cfg.rate_hz, cfg.loop)
        self.pool: Optional[TensorPool] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.published = 0
        self.skipped = 0
        self._last_log = {}
        try:
            self.pool = TensorPool(PoolConfig(
                pool_id=cfg.pool.pool_id, slot_nbytes=int(np.prod(self.shape)),
                slots=cfg.pool.slots, allocator=cfg.pool.allocator, lease_s=cfg.pool.lease_s,
                socket_dir=cfg.pool.socket_dir))
            self.output = TensorOutput(self, '~/frames', CopyKind.IMAGE,
                                       cfg.pool.copy_fallback)
        except BaseException:
            self.shutdown()
            raise
        if spec.kind is SourceKind.TOPIC:
            self.create_subscription(Image, spec.location, self._on_image, SENSOR_QOS)
            what = f'images of {spec.location} (one copy each)'
        else:
            what = self._reader.describe()
            self._thread = threading.Thread(target=self._capture, name='capture', daemon=True)
            self._thread.start()
        self.get_logger().info(
            f'{what} -> pool {self.pool.pool_id!r} ({self.pool.kind.name}, '
            f'{cfg.pool.slots} slots at {self.pool.socket_path}) -> {self.output.topic} at '
            f'{cfg.rate_hz:g} Hz, copies {cfg.pool.copy_fallback}')

    # --- producing --------------------------------------------------------------------
    def _capture(self) -> None:
        period = 1.0 / self.config.rate_hz
        next_t = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now < next_t:
                self._stop.wait(next_t - now)
                continue
            # Fixed schedule; after a stall, start again from now instead of bursting.
            next_t = next_t + period if next_t + period > now else now + period
            try:
                self._produce(lambda out: self._reader.read_into(out),
                              make_header(self, self.config.frame_id))
            except FrameDecodeError as exc:
                self._log('decode', f'skipping a frame: {exc}')
            except SourceError as exc:
                self.get_logger().error(f'source stopped: {exc}')
                return
            except Exception as exc:  # noqa: B902 - say why frames stopped, do not die silently
                self.get_logger().error(f'capture failed, no more frames: {exc!r}')
                return

    def _on_image(self, msg: Image) -> None:
        try:
            self._produce(lambda out: copy_codec.image_to_rgb(msg, out), msg.header)
        except copy_codec.CopyCodecError as exc:
            self._log('image', f'dropping an image of {msg.width}x{msg.height} '
                      f'{msg.encoding}: {exc}')

    def _produce(self, fill, header) -> None:
        """Loan a slot, fill it, publish it and its handle (skip if the ring is full)."""
        try:
            loan = self.pool.loan()
        except PoolExhaustedError as exc:
            self.skipped += 1
            self._log('full', f'skipping a frame: {exc}')
            return
        try:
            view = loan.ndarray('uint8', self.shape)
            fill(view)
            desc = loan.publish()
        except BaseException:
            loan.discard()
            raise
        self.output.publish(desc, view, header)
        self.published += 1

    def _log(self, key: str, text: str) -> None:
        now = time.monotonic()
        if now - self._last_log.get(key, -LOG_THROTTLE_S) >= LOG_THROTTLE_S:
            self._last_log[key] = now
            self.get_logger().warn(text)

    def shutdown(self) -> None:
        """Stop capturing and free the pool (consumers' views stay valid)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self.get_logger().info(f'{self.published} frames published, {self.skipped} skipped '
                               '(ring full)')
        if self._reader is not None:
            self._reader.close()
        if self.pool is not None:
            self.pool.close()


def main(args=None) -> int:
    """Console script entry point: 0 after Ctrl-C, 2 on a configuration error."""
    return run_node('frame_source', FrameSourceNode,
                    (ConfigError, VisionError, IpcError, ValueError), args)


if __name__ == '__main__':
    sys.exit(main())
