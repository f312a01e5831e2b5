"""What the benchmark peers' builds share: one error type, one way to run a build step."""
from __future__ import annotations

import subprocess
from typing import Dict, List, Optional


class PeerBuildError(RuntimeError):
    """A benchmark peer cannot be built or run; the message says which step failed and why."""


def run_step(cmd: List[str], what: str, env: Optional[Dict[str, str]] = None) -> str:
    """Run one build step and return its stdout; raise PeerBuildError with its output's tail."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = ' | '.join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise PeerBuildError(f'could not {what} (exit {proc.returncode}): {tail}')
    return proc.stdout
