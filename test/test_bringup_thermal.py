"""Thermal governor on fake sysfs trees: throttle, hysteresis, resume, odd sensors."""
import os
import pathlib
import subprocess
import sys

import pytest

from edge_llm_ros.bringup import affinity
from edge_llm_ros.bringup.errors import ThermalError
from edge_llm_ros.bringup.thermal import (hottest_zone, list_zones, ThermalGovernor, ThermalLevel,
                                          ThermalSettings)

ROOT = pathlib.Path(__file__).resolve().parents[1]
BOARDS = ROOT / 'test' / 'data' / 'boards'


class FakeSysfs:
    """A writable /sys/class/thermal under a temporary root."""

    def __init__(self, root: pathlib.Path, zones):
        self.root = root
        self.index = {}
        for i, (kind, milli) in enumerate(zones):
            zone = root / 'sys/class/thermal' / ('thermal_zone%d' % i)
            zone.mkdir(parents=True)
            (zone / 'type').write_text(kind + '\n')
            self.index[kind] = zone
            self.write(kind, milli)

    def write(self, kind, milli):
        (self.index[kind] / 'temp').write_text('' if milli is None else '%d\n' % milli)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def governor(root, clock=None, **settings):
    defaults = {'zones': ('cpu-thermal', 'gpu-thermal'), 'limit_c': 80.0, 'resume_c': 70.0,
                'token_pause_ms': 25.0}
    defaults.update(settings)
    return ThermalGovernor(ThermalSettings(**defaults), threads=4, cpus=(4, 5, 6, 7),
                           root=str(root), clock=clock or Clock())


def test_throttle_hysteresis_resume(tmp_path):
    fs = FakeSysfs(tmp_path, [('cpu-thermal', 60000), ('gpu-thermal', 55000),
                              ('board-thermal', 99000)])   # not watched: ignored
    clock = Clock()
    gov = governor(tmp_path, clock)
    state = gov.poll()
    assert state.level is ThermalLevel.NORMAL and not state.throttled
    assert state.hottest.kind == 'cpu-thermal' and state.hottest.celsius == 60.0
    assert (state.threads, state.cpus, gov.token_pause_s) == (4, (4, 5, 6, 7), 0.0)

    clock.now = 110.0
    fs.write('gpu-thermal', 80000)                   # reaching the limit throttles
    state = gov.poll()
    assert state.throttled and state.hottest.kind == 'gpu-thermal'
    assert (state.threads, state.cpus, state.token_pause_s) == (2, (4, 5), 0.025)
    assert gov.token_pause_s == 0.025 and state.throttle_count == 1 and state.since_s == 110.0

    clock.now = 120.0
    fs.write('gpu-thermal', 75000)                   # between resume and limit: stays
    state = gov.poll()
    assert state.throttled and state.since_s == 110.0 and 'resuming at 70.0' in state.message

    fs.write('gpu-thermal', 70500)
    assert gov.poll().throttled
    clock.now = 130.0
    fs.write('gpu-thermal', 70000)                   # at resume_c: back to normal
    state = gov.poll()
    assert state.level is ThermalLevel.NORMAL and state.since_s == 130.0
    assert (state.threads, state.cpus, gov.token_pause_s) == (4, (4, 5, 6, 7), 0.0)

    fs.write('gpu-thermal', 79900)                   # below the limit: no flapping
    assert not gov.poll().throttled
    fs.write('cpu-thermal', 81000)
    assert gov.poll().throttle_count == 2


def test_off_and_unreadable_sensors_are_ignored(tmp_path):
    # Jetson reports -256 C for the sensors of powered-off blocks; some zones read empty.
    fs = FakeSysfs(tmp_path, [('cv0-thermal', -256000), ('tj-thermal', None),
                              ('cpu-thermal', 45000)])
    gov = governor(tmp_path, zones=('cv?-thermal', 'tj-thermal', 'cpu-thermal'))
    state = gov.poll()
    assert [r.kind for r in state.readings] == ['cpu-thermal']
    assert state.hottest.celsius == 45.0
    fs.write('cpu-thermal', None)
    state = gov.poll()
    assert state.level is ThermalLevel.NO_SENSOR and 'no plausible reading' in state.message


def test_lost_sensor_while_hot_keeps_throttling(tmp_path):
    fs = FakeSysfs(tmp_path, [('cpu-thermal', 90000)])
    gov = governor(tmp_path, zones=('cpu-thermal',))
    assert gov.poll().throttled
    fs.write('cpu-thermal', None)
    state = gov.poll()
    assert state.throttled and 'staying throttled' in state.message
    assert gov.token_pause_s == 0.025


def test_no_matching_zone_names_the_zones_present(tmp_path):
    FakeSysfs(tmp_path, [('x86_pkg_temp', 50000), ('acpitz', 30000)])
    gov = governor(tmp_path, zones=('cpu-thermal',))
    state = gov.poll()
    assert state.level is ThermalLevel.NO_SENSOR
    assert 'acpitz, x86_pkg_temp' in state.message and not state.throttled


def test_disabled_never_reads(tmp_path):
    FakeSysfs(tmp_path, [('cpu-thermal', 99000)])
    gov = governor(tmp_path, enabled=False)
    state = gov.poll()
    assert state.level is ThermalLevel.DISABLED and not state.throttled


def test_throttle_threads_setting(tmp_path):
    FakeSysfs(tmp_path, [('cpu-thermal', 99000)])
    state = governor(tmp_path, throttle_threads=3).poll()
    assert state.threads == 3 and state.cpus == (4, 5, 6)
    state = governor(tmp_path, throttle_threads=9).poll()
    assert state.threads == 4


def test_settings_validation():
    with pytest.raises(ThermalError, match='below'):
        ThermalSettings(limit_c=70.0, resume_c=70.0)
    with pytest.raises(ThermalError, match='empty'):
        ThermalSettings(zones=())


def test_diagnostics_report_state(tmp_path):
    FakeSysfs(tmp_path, [('cpu-thermal', 85500), ('gpu-thermal', 60000)])
    diag = governor(tmp_path).poll().diagnostics()
    assert diag['thermal.level'] == 'throttled'
    assert diag['thermal.hottest'] == 'cpu-thermal 85.5 C'
    assert diag['thermal.cpus'] == '4-5' and diag['thermal.token_pause_ms'] == '25.0'
    assert diag['thermal.gpu-thermal'] == '60.0'


@pytest.mark.parametrize('tree, zones, hottest', [
    ('orin_nano', ('cpu-thermal', 'gpu-thermal', 'cv?-thermal', 'soc?-thermal', 'tj-thermal'),
     ('cpu-thermal', 44.906)),
    ('orin_nx', ('CPU-therm', 'GPU-therm', 'SOC?-therm', 'tj-therm'), ('CPU-therm', 51.25)),
    ('rpi5', ('cpu-thermal',), ('cpu-thermal', 52.65)),
    ('rk3588', ('soc-thermal', 'package-thermal', 'bigcore?-thermal'),
     ('bigcore1-thermal', 43.461)),
])
def test_recorded_board_zones(tree, zones, hottest):
    gov = ThermalGovernor(ThermalSettings(zones=zones), threads=2, cpus=(0, 1),
                          root=str(BOARDS / tree))
    state = gov.poll()
    assert (state.hottest.kind, state.hottest.celsius) == hottest
    assert state.level is ThermalLevel.NORMAL
    assert all(r.celsius > -40 for r in state.readings)


def test_hottest_zone_helper(tmp_path):
    fs = FakeSysfs(tmp_path, [('cpu-thermal', 50000), ('gpu-thermal', -256000),
                              ('soc0-thermal', 61000)])
    assert hottest_zone(str(tmp_path)).kind == 'soc0-thermal'
    assert hottest_zone(str(tmp_path), ('cpu-thermal', 'gpu-thermal')).celsius == 50.0
    fs.write('cpu-thermal', None)
    assert hottest_zone(str(tmp_path), ('cpu-thermal', 'gpu-thermal')) is None


def test_list_zones_sorted_numerically(tmp_path):
    FakeSysfs(tmp_path, [('z%d' % i, 1000) for i in range(12)])
    assert [z for z, _ in list_zones(str(tmp_path))][:3] == [
        'thermal_zone0', 'thermal_zone1', 'thermal_zone2']


CHILD = r"""
import sys, threading
from edge_llm_ros.bringup.thermal import ThermalGovernor, ThermalSettings, ThrottleApplier
root, cpus = sys.argv[1], tuple(int(c) for c in sys.argv[2].split(','))
stop = threading.Event()
worker = threading.Thread(target=stop.wait)
worker.start()
gov = ThermalGovernor(ThermalSettings(zones=('cpu-thermal',), limit_c=80.0, resume_c=70.0),
                      threads=len(cpus), cpus=cpus, root=root)
applier = ThrottleApplier(cpus)
for line in sys.stdin:
    state = gov.poll()
    applier.apply(state)
    print(state.level.value, worker.native_id, flush=True)
stop.set()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason='needs two cores to squeeze')
def test_throttle_applier_squeezes_and_releases_a_real_process(tmp_path):
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    fs = FakeSysfs(tmp_path, [('cpu-thermal', 50000)])
    child = subprocess.Popen([sys.executable, '-c', CHILD, str(tmp_path),
                              ','.join(map(str, cpus))], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=str(ROOT),
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))

    def step():
        child.stdin.write('\n')
        child.stdin.flush()
        level, worker = child.stdout.readline().split()
        return level, int(worker)

    try:
        full = affinity.format_cpu_list(cpus)
        level, worker = step()
        assert level == 'normal' and affinity.allowed_cpu_list(child.pid) == full
        fs.write('cpu-thermal', 85000)
        level, worker = step()
        squeezed = affinity.format_cpu_list(cpus[:max(1, len(cpus) // 2)])
        assert level == 'throttled'
        for tid in affinity.thread_ids(child.pid):
            assert affinity.allowed_cpu_list(child.pid, tid) == squeezed
        fs.write('cpu-thermal', 65000)
        level, worker = step()
        assert level == 'normal'
        for tid in affinity.thread_ids(child.pid):
            assert affinity.allowed_cpu_list(child.pid, tid) == full
        child.stdin.close()
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
