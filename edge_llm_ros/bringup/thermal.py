"""Thermal governor: back generation off before the SoC's own clock throttling hurts the robot.

Reads /sys/class/thermal/thermal_zone*/{type,temp} (millidegrees C) under a root folder.
Zone types differ per board, so profiles name them with shell patterns:
  Jetson Orin, L4T R36: cpu-thermal gpu-thermal cv0..2-thermal soc0..2-thermal tj-thermal
  Jetson Orin, L4T R35: CPU-therm GPU-therm CV0..2-therm SOC0..2-therm tj-therm
  Raspberry Pi 5: cpu-thermal
  RK3588: soc-thermal (vendor kernel) / package-thermal (mainline), bigcore0/1-thermal,
          littlecore-thermal, center-thermal, gpu-thermal, npu-thermal
  x86_64: x86_pkg_temp (Intel), acpitz
The hottest watched zone decides. At or above `limit_c` the governor throttles: fewer cores
for the LLM process (all its threads squeezed onto the first N of its cores) and a pause
between tokens; it resumes only at or below `resume_c` (hysteresis, so it does not flap).
Readings below -40 C are ignored: Jetson reports -256 C for sensors of powered-off blocks.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import enum
import fnmatch
import pathlib
import re
import threading
import time
from typing import Any, Callable, Dict, FrozenSet, Mapping, Optional, Sequence, Tuple

from edge_llm_ros.bringup import affinity
from edge_llm_ros.bringup.errors import ThermalError

MIN_PLAUSIBLE_C = -40.0


@dataclass(frozen=True)
class ThermalSettings:
    """The thermal.* parameters."""

    enabled: bool = True
    zones: Tuple[str, ...] = ('*',)
    limit_c: float = 85.0
    resume_c: float = 75.0
    throttle_threads: int = 0      # 0 = half of the normal count
    token_pause_ms: float = 20.0

    def __post_init__(self) -> None:
        if self.resume_c >= self.limit_c:
            raise ThermalError('thermal.resume_c (%s) must be below thermal.limit_c (%s)' % (
                self.resume_c, self.limit_c))
        if not self.zones:
            raise ThermalError("thermal.zones is empty: name zone types or use ['*']")

    @classmethod
    def from_params(cls, values: Mapping[str, Any]) -> 'ThermalSettings':
        """Build from llm_node parameter values."""
        return cls(enabled=values['thermal.enabled'], zones=tuple(values['thermal.zones']),
                   limit_c=values['thermal.limit_c'], resume_c=values['thermal.resume_c'],
                   throttle_threads=values['thermal.throttle_threads'],
                   token_pause_ms=values['thermal.token_pause_ms'])


@dataclass(frozen=True)
class ZoneReading:
    """One thermal zone's temperature."""

    zone: str        # 'thermal_zone8'
    kind: str        # zone type, e.g. 'tj-thermal'
    celsius: float


class ThermalLevel(str, enum.Enum):
    """What the governor is doing."""

    DISABLED = 'disabled'      # thermal.enabled is false
    NO_SENSOR = 'no_sensor'    # no watched zone gives a plausible reading
    NORMAL = 'normal'
    THROTTLED = 'throttled'


@dataclass(frozen=True)
class ThermalState:
    """Snapshot for diagnostics and for the decode loop."""

    level: ThermalLevel
    hottest: Optional[ZoneReading]
    threads: int                    # intra-op threads' worth of cores allowed now
    cpus: Tuple[int, ...]           # cores the LLM process may use now
    token_pause_s: float            # sleep between generated tokens
    throttle_count: int             # how many times throttling started
    since_s: float                  # clock time of the last level change
    message: str
    readings: Tuple[ZoneReading, ...] = field(default=())

    @property
    def throttled(self) -> bool:
        """Whether generation is being slowed down now."""
        return self.level is ThermalLevel.THROTTLED

    def diagnostics(self) -> Dict[str, str]:
        """Key/values for a diagnostic_msgs/DiagnosticStatus."""
        out = {'thermal.level': self.level.value, 'thermal.message': self.message,
               'thermal.threads': str(self.threads),
               'thermal.cpus': affinity.format_cpu_list(self.cpus),
               'thermal.token_pause_ms': '%.1f' % (self.token_pause_s * 1000.0),
               'thermal.throttle_count': str(self.throttle_count)}
        if self.hottest is not None:
            out['thermal.hottest'] = '%s %.1f C' % (self.hottest.kind, self.hottest.celsius)
        for reading in self.readings:
            out['thermal.%s' % reading.kind] = '%.1f' % reading.celsius
        return out


def list_zones(root: str = '/') -> Tuple[Tuple[str, str], ...]:
    """(zone folder, type) of every thermal zone under `root`."""
    base = pathlib.Path(root, 'sys/class/thermal')
    zones = []
    if base.is_dir():
        for entry in base.iterdir():
            if re.fullmatch(r'thermal_zone\d+', entry.name):
                try:
                    kind = (entry / 'type').read_text().strip()
                except OSError:
                    continue
                zones.append((entry.name, kind))
    zones.sort(key=lambda z: int(z[0][len('thermal_zone'):]))
    return tuple(zones)


def watched_zones(zones: Sequence[Tuple[str, str]], patterns: Sequence[str]
                  ) -> Tuple[Tuple[str, str], ...]:
    """Keep the zones whose type matches any of `patterns`."""
    return tuple(z for z in zones if any(fnmatch.fnmatchcase(z[1], p) for p in patterns))


def read_zone(root: str, zone: str, kind: str) -> Optional[ZoneReading]:
    """One reading, or None when the sensor is unreadable, empty or off (-256 C on Jetson)."""
    try:
        text = pathlib.Path(root, 'sys/class/thermal', zone, 'temp').read_text().strip()
        celsius = int(text) / 1000.0
    except (OSError, ValueError):
        return None
    return ZoneReading(zone, kind, celsius) if celsius >= MIN_PLAUSIBLE_C else None


def hottest_zone(root: str = '/', patterns: Sequence[str] = ('*',)) -> Optional[ZoneReading]:
    """Read the hottest plausible zone matching `patterns` (None when there is none).

    For diagnostics of a node that has no governor; the governor itself reads through poll().
    """
    readings = [r for r in (read_zone(root, z, k) for z, k in watched_zones(
        list_zones(root), patterns)) if r is not None]
    return max(readings, key=lambda r: r.celsius) if readings else None


class ThermalGovernor:
    """Hysteresis between `limit_c` and `resume_c` over the hottest watched zone.

    `poll()` is called from a timer (diagnostics period); the decode loop only reads
    `token_pause_s`, a plain attribute, so the hot path takes no lock and reads no file.
    `threads` is the normal intra-op thread count and `cpus` the LLM process's cores
    (affinity.usable_cpus() when the profile pins nothing); throttling keeps the first
    `throttled_threads()` of them, which ThrottleApplier enforces.
    """

    def __init__(self, settings: ThermalSettings, threads: int, cpus: Sequence[int],
                 root: str = '/', clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._root = root
        self._clock = clock
        self._threads = max(1, threads)
        self._cpus = tuple(cpus)
        self._zones = watched_zones(list_zones(root), settings.zones)
        self._lock = threading.Lock()
        self.token_pause_s = 0.0
        if not settings.enabled:
            level, message = ThermalLevel.DISABLED, 'thermal.enabled is false'
        elif not self._zones:
            level, message = ThermalLevel.NO_SENSOR, self.missing_zones_message()
        else:
            level, message = ThermalLevel.NORMAL, 'not read yet'
        self._state = ThermalState(level, None, self._threads, self._cpus, 0.0, 0, clock(),
                                   message)

    @property
    def zones(self) -> Tuple[Tuple[str, str], ...]:
        """(zone folder, type) of the zones this governor watches."""
        return self._zones

    @property
    def state(self) -> ThermalState:
        """Latest snapshot, without touching any file."""
        return self._state

    def missing_zones_message(self) -> str:
        """Say which zones exist when none of the configured patterns matched."""
        present = sorted({kind for _, kind in list_zones(self._root)})
        return 'no thermal zone matches %s; zones here: %s' % (
            ', '.join(self.settings.zones), ', '.join(present) or 'none')

    def throttled_threads(self) -> int:
        """Threads' worth of cores allowed while throttled."""
        wanted = self.settings.throttle_threads or self._threads // 2
        return max(1, min(wanted, self._threads))

    def poll(self) -> ThermalState:
        """Read the watched zones and move between NORMAL and THROTTLED."""
        with self._lock:
            previous = self._state
            if previous.level is ThermalLevel.DISABLED or not self._zones:
                return previous
            readings = tuple(r for r in (read_zone(self._root, z, k) for z, k in self._zones)
                             if r is not None)
            hottest = max(readings, key=lambda r: r.celsius) if readings else None
            self._state = self._next_state(previous, hottest, readings)
            self.token_pause_s = self._state.token_pause_s
            return self._state

    def _next_state(self, previous: ThermalState, hottest: Optional[ZoneReading],
                    readings: Tuple[ZoneReading, ...]) -> ThermalState:
        s = self.settings
        if hottest is None:
            if previous.throttled:
                # A sensor that stops answering while hot is no reason to speed up again.
                return dataclasses.replace(previous, readings=(),
                                           message='sensors unreadable; staying throttled')
            return ThermalState(ThermalLevel.NO_SENSOR, None, self._threads, self._cpus, 0.0,
                                previous.throttle_count, self._since(previous, False),
                                'no plausible reading from %s' % ', '.join(
                                    k for _, k in self._zones))
        if previous.throttled:
            throttle = hottest.celsius > s.resume_c
        else:
            throttle = hottest.celsius >= s.limit_c
        if throttle:
            threads = self.throttled_threads()
            count = previous.throttle_count + (0 if previous.throttled else 1)
            if previous.throttled:
                message = '%s at %.1f C, resuming at %.1f C' % (
                    hottest.kind, hottest.celsius, s.resume_c)
            else:
                message = '%s at %.1f C >= limit %.1f C' % (
                    hottest.kind, hottest.celsius, s.limit_c)
            return ThermalState(ThermalLevel.THROTTLED, hottest, threads,
                                self._cpus[:threads], s.token_pause_ms / 1000.0, count,
                                self._since(previous, True), message, readings)
        return ThermalState(ThermalLevel.NORMAL, hottest, self._threads, self._cpus, 0.0,
                            previous.throttle_count, self._since(previous, False),
                            '%s at %.1f C' % (hottest.kind, hottest.celsius), readings)

    def _since(self, previous: ThermalState, throttled: bool) -> float:
        return previous.since_s if previous.throttled == throttled else self._clock()


class ThrottleApplier:
    """Applies a governor's core limit to every thread of this process, and undoes it.

    Throttling pins all threads (ORT workers included) to the allowed cores; resuming gives
    each thread its own earlier mask back, and threads born while throttled the full set.
    """

    def __init__(self, base_cpus: Sequence[int], pid: Optional[int] = None) -> None:
        self._base = frozenset(base_cpus)
        self._pid = pid
        self._saved: Optional[Dict[int, FrozenSet[int]]] = None

    @property
    def active(self) -> bool:
        """Whether threads are currently squeezed."""
        return self._saved is not None

    def apply(self, state: ThermalState) -> None:
        """Squeeze or release according to `state` (idempotent)."""
        if state.throttled and state.cpus and self._saved is None:
            self._saved = affinity.pin_process(state.cpus, self._pid)
        elif not state.throttled and self._saved is not None:
            saved, self._saved = self._saved, None
            affinity.restore(saved, fallback=self._base, pid=self._pid)
