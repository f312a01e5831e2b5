"""BridgeConfig: where the OpenAI bridge listens and what it lets in."""
from __future__ import annotations

from dataclasses import dataclass
import ipaddress

LOOPBACK_NAMES = ('localhost',)


@dataclass(frozen=True)
class BridgeConfig:
    """Settings of one bridge; the defaults keep it private to this machine."""

    host: str = '127.0.0.1'        # another address exposes the model to the network
    port: int = 8000               # 0: an ephemeral port (run_bridge returns the bound one)
    api_key: str = ''              # '' = no auth; else "Authorization: Bearer <api_key>"
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    owned_by: str = 'edge_llm_ros'     # /v1/models' owned_by
    log_level: str = 'warning'     # uvicorn's
    shutdown_timeout_s: float = 5.0    # streams still open at stop() are cancelled after this
    # http(s) image_url parts: refused (False) or fetched by the bridge (True), each within
    # image_fetch_timeout_s and image_fetch_max_bytes. data: URLs are always taken.
    fetch_image_urls: bool = False
    image_fetch_timeout_s: float = 5.0
    image_fetch_max_bytes: int = 20 << 20

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError('BridgeConfig.host is empty: use 127.0.0.1 (this machine only)')
        if not 0 <= self.port <= 65535:
            raise ValueError(f'BridgeConfig.port {self.port} is not a TCP port (0..65535; 0 = '
                             'any free port)')
        if self.max_body_bytes <= 0:
            raise ValueError('BridgeConfig.max_body_bytes must be > 0')
        if self.shutdown_timeout_s < 0:
            raise ValueError('BridgeConfig.shutdown_timeout_s must be >= 0')
        if self.image_fetch_timeout_s <= 0 or self.image_fetch_max_bytes <= 0:
            raise ValueError('BridgeConfig.image_fetch_timeout_s and image_fetch_max_bytes '
                             'must be > 0')

    @property
    def is_loopback(self) -> bool:
        if self.host in LOOPBACK_NAMES:
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False
