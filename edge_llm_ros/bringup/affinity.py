"""CPU pinning: CPU-list parsing, validation against the machine, and applying it for real.

Linux applies `sched_setaffinity(0, ...)` to the calling *thread* only; threads inherit
their creator's mask when they start. So `pin_process` walks /proc/<pid>/task to move
threads that already exist, and a process pinned before it creates its ONNX Runtime
session has every ORT worker start inside the mask. ORT can additionally pin each intra-op
worker to one core (`ort_intra_op_affinity`): the decode thread keeps `cpus[0]` and worker
i gets `cpus[i]`, so no two busy threads share a core.
"""
from __future__ import annotations

from dataclasses import dataclass
import os
import pathlib
import re
from typing import Dict, FrozenSet, Iterable, Optional, Sequence, Tuple

from edge_llm_ros.bringup.errors import AffinityError

_ITEM = re.compile(r'(\d{1,5})(?:-(\d{1,5}))?')
# Linux supports at most 8192 CPUs (NR_CPUS): bounds the set a CPU list can expand into.
MAX_CPUS = 8192


def parse_cpu_list(text: str) -> Tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6); '' -> (). Raises AffinityError on bad syntax."""
    cpus = set()
    text = text.strip()
    if not text:
        return ()
    for item in text.split(','):
        match = _ITEM.fullmatch(item.strip())
        if match is None:
            raise AffinityError("bad CPU list %r: write cores like '4-7' or '0,2,4-5'" % text)
        first = int(match.group(1))
        last = int(match.group(2)) if match.group(2) is not None else first
        if last < first:
            raise AffinityError('bad CPU list %r: range %s runs backwards' % (text, item))
        if last >= MAX_CPUS:
            raise AffinityError('bad CPU list %r: CPU %d is beyond the %d CPUs Linux supports'
                                % (text, last, MAX_CPUS))
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 3, 6) -> '0-3,6' (the kernel's Cpus_allowed_list form)."""
    ordered = sorted(set(cpus))
    parts = []
    start = prev = None
    for cpu in ordered + [None]:
        if cpu is not None and prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            parts.append(str(start) if start == prev else '%d-%d' % (start, prev))
        start = prev = cpu
    return ','.join(parts)


def online_cpus(root: str = '/') -> Tuple[int, ...]:
    """List the CPUs the kernel under `root` reports online (/sys/devices/system/cpu/online)."""
    path = pathlib.Path(root, 'sys/devices/system/cpu/online')
    try:
        return parse_cpu_list(path.read_text())
    except OSError as exc:
        raise AffinityError('cannot read %s: %s' % (path, exc)) from None


def usable_cpus(root: str = '/') -> Tuple[int, ...]:
    """List the CPUs a process may use: online ones, on the live system within our mask.

    A container's cpuset shows up only in the mask, so the live system asks the kernel.
    """
    online = online_cpus(root)
    if os.path.realpath(root) == '/':
        allowed = os.sched_getaffinity(0)
        return tuple(c for c in online if c in allowed)
    return online


def check_cpus(cpus: Sequence[int], available: Sequence[int],
               what: str = 'engine.cpu_affinity') -> None:
    """Raise AffinityError naming the valid cores if `cpus` has any core not available."""
    missing = sorted(set(cpus) - set(available))
    if missing:
        raise AffinityError('%s names core(s) %s that this machine does not have; valid cores: '
                            '%s' % (what, format_cpu_list(missing), format_cpu_list(available)))


def ort_intra_op_affinity(cpus: Sequence[int], threads: int) -> str:
    """ORT 'session.intra_op_thread_affinities' for `threads` threads pinned one per core.

    ORT wants threads-1 entries (it never pins the calling thread) of 1-based processor ids
    separated by ';'. The calling (decode) thread is meant to run on cpus[0].
    """
    if not cpus or threads <= 1:
        return ''
    if threads > len(cpus):
        raise AffinityError('%d intra-op threads cannot each have one of the %d core(s) %s' % (
            threads, len(cpus), format_cpu_list(cpus)))
    return ';'.join(str(cpu + 1) for cpu in list(cpus)[1:threads])


@dataclass(frozen=True)
class AffinityPlan:
    """Where each thread of the LLM process runs."""

    process_cpus: Tuple[int, ...]     # every thread of the process (DDS, executor, ORT pool)
    decode_cpus: Tuple[int, ...]      # the thread that runs the decode loop
    intra_op_threads: int
    intra_op_affinity: str            # for EngineConfig.intra_op_affinity


def plan_affinity(cpus: Sequence[int], threads: int) -> AffinityPlan:
    """Plan pinning for `threads` intra-op threads on `cpus` (empty: no pinning at all)."""
    cpus = tuple(sorted(set(cpus)))
    if not cpus:
        return AffinityPlan((), (), threads, '')
    threads = threads or len(cpus)
    return AffinityPlan(cpus, cpus[:1], threads, ort_intra_op_affinity(cpus, threads))


def thread_ids(pid: Optional[int] = None) -> Tuple[int, ...]:
    """Thread ids of process `pid` (default: this process)."""
    task = pathlib.Path('/proc', str(pid or os.getpid()), 'task')
    return tuple(sorted(int(t) for t in os.listdir(task)))


def pin_thread(cpus: Iterable[int], tid: int = 0) -> FrozenSet[int]:
    """Pin one thread (0 = the calling thread); returns its previous mask."""
    cpus = frozenset(cpus)
    previous = frozenset(os.sched_getaffinity(tid))
    try:
        os.sched_setaffinity(tid, cpus)
    except OSError as exc:
        raise AffinityError('cannot pin thread %d to %s: %s' % (
            tid, format_cpu_list(cpus), exc)) from None
    return previous


def pin_process(cpus: Iterable[int], pid: Optional[int] = None) -> Dict[int, FrozenSet[int]]:
    """Pin every existing thread of `pid` (default: this process); returns previous masks."""
    cpus = frozenset(cpus)
    if not cpus:
        raise AffinityError('refusing to pin to an empty CPU set')
    previous: Dict[int, FrozenSet[int]] = {}
    for tid in thread_ids(pid):
        try:
            previous[tid] = pin_thread(cpus, tid)
        except AffinityError:
            if tid in thread_ids(pid):
                raise
            # The thread ended between listing and pinning: nothing left to pin.
    return previous


def restore(previous: Dict[int, FrozenSet[int]], fallback: Iterable[int] = (),
            pid: Optional[int] = None) -> None:
    """Give threads back the masks `pin_process` returned (threads that ended are skipped).

    Threads of `pid` that did not exist when pinning get `fallback` when it is given.
    """
    fallback = frozenset(fallback)
    targets = dict(previous)
    if fallback:
        for tid in thread_ids(pid):
            targets.setdefault(tid, fallback)
    for tid, cpus in targets.items():
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, FileNotFoundError):
            continue


def allowed_cpu_list(pid: Optional[int] = None, tid: Optional[int] = None) -> str:
    """Cpus_allowed_list the kernel reports for a process (or one of its threads)."""
    base = pathlib.Path('/proc', str(pid or os.getpid()))
    status = (base / 'task' / str(tid) / 'status') if tid else base / 'status'
    for line in status.read_text().splitlines():
        if line.startswith('Cpus_allowed_list:'):
            return line.split(':', 1)[1].strip()
    raise AffinityError('%s has no Cpus_allowed_list line' % status)
