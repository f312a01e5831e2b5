"""Helpers shared by the test_ipc_* tests: allocator selection, child processes, leaks."""
import gc
import json
import os
import pwd
import select
import signal
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from forking import fork_clean
import numpy as np
import pytest

from edge_llm_ros.ipc.allocators import select_allocator
from edge_llm_ros.ipc.errors import AllocatorUnavailableError

ALLOCATORS = ('memfd', 'udmabuf', 'dma_heap')
# Set by scripts/dmabuf_vm/run.sh: inside the VM a missing DMA-BUF device is a failure.
REQUIRE_DMABUF = os.environ.get('EDGE_LLM_REQUIRE_DMABUF') == '1'


def require_allocator(name: str) -> None:
    """Skip (or fail inside the DMA-BUF VM) when an allocator cannot work here."""
    try:
        select_allocator(name).close()
    except AllocatorUnavailableError as exc:
        if REQUIRE_DMABUF:
            pytest.fail(f'DMA-BUF VM: allocator {name} unavailable: {exc}')
        pytest.skip(f'{name} unavailable here ({exc}); scripts/dmabuf_vm/run.sh tests it')


# --- leak accounting ---------------------------------------------------------------------
def open_fds() -> List[str]:
    """Sorted targets of this process's open fds."""
    out = []
    for name in os.listdir('/proc/self/fd'):
        try:
            out.append(f'{name}:{os.readlink(f"/proc/self/fd/{name}")}')
        except FileNotFoundError:
            pass  # the fd of the listdir itself
    return sorted(out)


def shared_mapped_bytes() -> int:
    """Bytes mapped from memfds and dma-bufs in this process."""
    total = 0
    with open('/proc/self/maps') as f:
        for line in f:
            parts = line.split(None, 5)
            path = parts[5] if len(parts) > 5 else ''
            if 'memfd:' in path or 'dmabuf' in path:
                lo, hi = (int(x, 16) for x in parts[0].split('-'))
                total += hi - lo
    return total


class Baseline:
    """Open fds and shared mapped bytes before a test, compared after it."""

    def __init__(self) -> None:
        gc.collect()
        self.fds = len(open_fds())
        self.mapped = shared_mapped_bytes()

    def check(self, timeout_s: float = 10.0) -> None:
        """Assert both returned to baseline (allowing async cleanup to finish)."""
        deadline = time.monotonic() + timeout_s
        while True:
            gc.collect()
            fds, mapped = len(open_fds()), shared_mapped_bytes()
            if (fds, mapped) == (self.fds, self.mapped) or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert mapped == self.mapped, f'mapped bytes {mapped} != baseline {self.mapped}'
        assert fds == self.fds, f'open fds {fds} != baseline {self.fds}:\n' + \
            '\n'.join(open_fds())


# --- child processes -----------------------------------------------------------------------
class Child:
    """A forked process running target(tell, *args); tell(dict) streams events to the parent.

    Fork (not spawn) keeps children cheap under TCG emulation; fork before creating any
    pool in the parent so no service thread is duplicated.
    """

    def __init__(self, target: Callable[..., Any], *args: Any) -> None:
        r, w = os.pipe()
        pid = fork_clean()
        if pid == 0:  # child
            os.close(r)
            code = 0

            def tell(event: Dict[str, Any]) -> None:
                os.write(w, (json.dumps(event) + '\n').encode())

            try:
                result = target(tell, *args)
                tell({'result': result})
            except BaseException:  # report everything, the parent asserts on it
                tell({'error': traceback.format_exc()})
                code = 1
            os._exit(code)
        os.close(w)
        self.pid = pid
        self._r = r
        self._buf = b''
        self.events: List[Dict[str, Any]] = []
        self.status: Optional[int] = None

    def _read(self, timeout_s: float) -> bool:
        ready, _, _ = select.select([self._r], [], [], timeout_s)
        if not ready:
            return False
        chunk = os.read(self._r, 65536)
        if not chunk:
            return False
        self._buf += chunk
        while b'\n' in self._buf:
            line, self._buf = self._buf.split(b'\n', 1)
            self.events.append(json.loads(line))
        return True

    def wait_for(self, key: str, timeout_s: float = 30.0) -> Dict[str, Any]:
        """Next event containing key (raises if the child failed or timed out)."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        while True:
            for event in self.events[seen:]:
                if 'error' in event:
                    raise AssertionError(f'child {self.pid} failed:\n{event["error"]}')
                if key in event:
                    self.events.remove(event)
                    return event
            seen = len(self.events)
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f'child {self.pid}: no {key!r} event in {timeout_s} s')
            if not self._read(min(left, 0.2)) and self.poll() is not None and \
                    not self._read(0):
                raise AssertionError(f'child {self.pid} exited ({self.status}) before {key!r}')

    def join(self, timeout_s: float = 60.0) -> Any:
        """Return the child's result (raises with its traceback if it failed)."""
        event = self.wait_for('result', timeout_s)
        self.wait(timeout_s)
        return event['result']

    def poll(self) -> Optional[int]:
        """Exit status if the child ended."""
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = status
        return self.status

    def wait(self, timeout_s: float = 10.0) -> int:
        """Wait for the child to end; returns its wait status."""
        deadline = time.monotonic() + timeout_s
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f'child {self.pid} did not exit')
            time.sleep(0.01)
        return self.status

    def kill(self) -> None:
        """SIGKILL the child and reap it."""
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.wait()

    def close(self) -> None:
        """Kill if still running and close the event pipe."""
        self.kill()
        if self._r >= 0:
            os.close(self._r)
            self._r = -1


def nobody_uid() -> int:
    """Uid of the unprivileged 'nobody' user."""
    return pwd.getpwnam('nobody').pw_uid


# --- frame content that reveals tearing --------------------------------------------------
def fill_frame(array: np.ndarray, sequence: int) -> None:
    """Fill a uint8 array so that every byte depends on the frame's sequence number."""
    flat = array.reshape(-1)
    flat[:] = sequence % 251
    flat[::4093] = (sequence * 7) % 253


def frame_ok(array: np.ndarray, sequence: int) -> bool:
    """Whether a frame holds exactly what fill_frame wrote for this sequence."""
    expected = np.empty(array.shape, np.uint8)
    fill_frame(expected, sequence)
    return bool(np.array_equal(array, expected))
