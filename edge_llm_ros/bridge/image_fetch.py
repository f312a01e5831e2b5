"""http(s) image URLs, fetched only where the bridge's configuration allows it.

By default the bridge fetches nothing on a client's behalf (a robot's network is not the
client's to reach through it); `BridgeConfig.fetch_image_urls` turns fetching on, bounded in
time and bytes. Every failure is an OpenAI-shaped 400 naming the part.
"""
from __future__ import annotations

from dataclasses import dataclass
import urllib.error
import urllib.request

from edge_llm_ros.bridge.errors import InvalidRequestError

USER_AGENT = 'edge_llm_ros-openai-bridge'


@dataclass(frozen=True)
class ImageFetcher:
    """Fetch one image URL's bytes: at most `max_bytes`, within `timeout_s` per socket wait."""

    timeout_s: float
    max_bytes: int

    def __call__(self, url: str, param: str) -> bytes:
        shown = url if len(url) <= 80 else url[:77] + '...'
        request = urllib.request.Request(url, headers={'User-Agent': USER_AGENT})
        try:
            # urllib follows http(s) redirects only (never to file: or ftp: URLs).
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                data = response.read(self.max_bytes + 1)
        except urllib.error.HTTPError as exc:
            raise InvalidRequestError(f'fetching the image {shown} failed: HTTP {exc.code}',
                                      param=param, code='image_url_unreachable') from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, 'reason', exc)
            raise InvalidRequestError(f'fetching the image {shown} failed: {reason}',
                                      param=param, code='image_url_unreachable') from None
        if len(data) > self.max_bytes:
            raise InvalidRequestError(
                f'the image {shown} is larger than {self.max_bytes} bytes, the most this '
                'server fetches: send a smaller image', param=param, code='image_too_large')
        return data
