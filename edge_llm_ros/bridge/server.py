"""run_bridge: serve the app with uvicorn on a thread of this process, and stop it cleanly."""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Optional

import uvicorn

from edge_llm_ros.bridge.app import create_app
from edge_llm_ros.bridge.backend import Backend
from edge_llm_ros.bridge.config import BridgeConfig

LOG = logging.getLogger('edge_llm_ros.bridge')


class BridgeStartError(RuntimeError):
    """The bridge could not listen (address in use, no such address) or did not start."""


def _listen(host: str, port: int) -> socket.socket:
    """Bind here, not in uvicorn, so that a busy port is an exception the caller sees."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise BridgeStartError(f'cannot listen on {host}:{port}: {exc}') from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise BridgeStartError(f'cannot listen on {host}:{port}: {exc} (another bridge on that '
                               'port? choose another port, or 0 for any free one)') from None
    return sock


class RunningBridge:
    """A bridge serving on a thread; `port` is the bound port, `stop()` ends it."""

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, host: str,
                 port: int) -> None:
        self._server = server
        self._thread = thread
        self.host = host
        self.port = port

    @property
    def base_url(self) -> str:
        """Give the URL an OpenAI client takes as base_url: http://host:port/v1."""
        host = f'[{self.host}]' if ':' in self.host else self.host
        return f'http://{host}:{self.port}/v1'

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: Optional[float] = None) -> None:
        """Stop serving: open streams get shutdown_timeout_s to end, then are cancelled."""
        self._server.should_exit = True
        grace = self._server.config.timeout_graceful_shutdown or 0.0
        self._thread.join(grace + 5.0 if timeout is None else timeout)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(5.0)
        if self._thread.is_alive():
            LOG.error('the OpenAI bridge thread did not stop')

    def __enter__(self) -> 'RunningBridge':
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_bridge(backend: Backend, config: Optional[BridgeConfig] = None,
               start_timeout: float = 10.0) -> RunningBridge:
    """Serve `backend` on config.host:config.port from a daemon thread; return when listening."""
    config = config or BridgeConfig()
    if not config.is_loopback and not config.api_key:
        LOG.warning('the OpenAI bridge listens on %s without an API key: anyone on that '
                    'network can use the model', config.host)
    sock = _listen(config.host, config.port)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(
        create_app(backend, config), host=config.host, port=port, lifespan='off',
        log_level=config.log_level, access_log=False,
        timeout_graceful_shutdown=config.shutdown_timeout_s))
    thread = threading.Thread(target=server.run, kwargs={'sockets': [sock]}, daemon=True,
                              name='openai-bridge')
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise BridgeStartError(f'the bridge on {config.host}:{port} did not start within '
                                   f'{start_timeout} s (see the log above)')
        time.sleep(0.01)
    return RunningBridge(server, thread, config.host, port)
