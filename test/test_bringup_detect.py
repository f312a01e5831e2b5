"""Board detection on recorded /proc, /sys and /etc trees of every supported board."""
import os
import pathlib

import pytest

from edge_llm_ros.bringup.affinity import parse_cpu_list
from edge_llm_ros.bringup.detect import detect_board, parse_cpuinfo, sm_arch_of
from edge_llm_ros.bringup.errors import BoardDetectionError

BOARDS = pathlib.Path(__file__).parent / 'data' / 'boards'

# tree -> (profile, cores, clusters, fast cores, L4T release, GPU arch)
EXPECTED = {
    'orin_agx': ('orin_agx', 12, {0: (0, 1, 2, 3), 1: (4, 5, 6, 7), 2: (8, 9, 10, 11)},
                 tuple(range(12)), 'R36.4.3', 'sm_87'),
    'orin_nx': ('orin_nx', 8, {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}, tuple(range(8)),
                'R35.4.1', 'sm_87'),
    'orin_nx_8gb': ('orin_nx', 6, {0: (0, 1, 2, 3), 1: (4, 5)}, tuple(range(6)), 'R36.3.0',
                    'sm_87'),
    'orin_nano': ('orin_nano', 6, {0: (0, 1, 2, 3), 1: (4, 5)}, tuple(range(6)), 'R36.3.0',
                  'sm_87'),
    'rpi5': ('rpi5', 4, {0: (0, 1, 2, 3)}, (0, 1, 2, 3), '', None),
    'rk3588': ('rk3588', 8, {0: (0, 1, 2, 3), 1: (4, 5), 2: (6, 7)}, (4, 5, 6, 7), '', None),
    'rk3588s_orangepi5': ('rk3588', 8, {0: (0, 1, 2, 3), 1: (4, 5), 2: (6, 7)}, (4, 5, 6, 7),
                          '', None),
    'x86_64': ('x86_64', 16, {i: (i, i + 8) for i in range(8)}, tuple(range(16)), '', None),
    'x86_64_cuda': ('x86_64_cuda', 16, {i: (i, i + 8) for i in range(8)}, tuple(range(16)),
                    '', 'sm_90'),
    'x86_64_cuda_rtx4090': ('x86_64_cuda', 16, {i: (i, i + 8) for i in range(8)},
                            tuple(range(16)), '', 'sm_89'),
}


def test_every_recorded_tree_is_covered():
    trees = {p.name for p in BOARDS.iterdir() if p.is_dir()}
    assert trees == set(EXPECTED) | {'jetson_xavier_nx', 'rpi4'}


@pytest.mark.parametrize('tree', sorted(EXPECTED))
def test_detects_recorded_board(tree):
    board, cores, clusters, fast, l4t, gpu_arch = EXPECTED[tree]
    info = detect_board(str(BOARDS / tree))
    assert info.board == board, info.reason
    assert len(info.cores) == cores
    assert info.clusters() == clusters
    assert info.fast_cores() == fast
    assert info.l4t_release == l4t
    assert (info.gpus[0].sm_arch if info.gpus else None) == gpu_arch
    assert info.mem_total_kb > 1024 * 1024


def test_core_types_from_midr():
    rk = detect_board(str(BOARDS / 'rk3588'))
    assert [c.part for c in rk.cores] == ['cortex-a55'] * 4 + ['cortex-a76'] * 4
    assert {c.max_freq_khz for c in rk.cores[:4]} == {1800000}
    orin = detect_board(str(BOARDS / 'orin_agx'))
    assert {c.part for c in orin.cores} == {'cortex-a78ae'}
    pi = detect_board(str(BOARDS / 'rpi5'))
    assert {c.part for c in pi.cores} == {'cortex-a76'}


def test_orin_nx_and_nano_told_apart_by_module_sku():
    # Same p3768 carrier, same tegra234 SoC; only the p3767 SKU differs.
    assert 'p3767-0000' in detect_board(str(BOARDS / 'orin_nx')).reason
    assert 'p3767-0005' in detect_board(str(BOARDS / 'orin_nano')).reason


@pytest.mark.parametrize('tree, words', [
    ('jetson_xavier_nx', ('tegra194', 'Jetson Orin')),
    ('rpi4', ('Raspberry Pi 4', 'matches no profile')),
])
def test_unsupported_boards_get_a_reason(tree, words):
    info = detect_board(str(BOARDS / tree))
    assert info.board == ''
    for word in words:
        assert word in info.reason


def test_unknown_tegra234_module_falls_back_to_model_string(tmp_path):
    root = tmp_path / 'orin'
    (root / 'proc/device-tree').mkdir(parents=True)
    (root / 'proc/device-tree/compatible').write_bytes(b'acme,carrier\0nvidia,tegra234\0')
    (root / 'proc/device-tree/model').write_bytes(b'Acme robot with Jetson Orin NX\0')
    (root / 'proc/cpuinfo').write_text((BOARDS / 'orin_nx/proc/cpuinfo').read_text())
    assert detect_board(str(root)).board == 'orin_nx'
    (root / 'proc/device-tree/model').write_bytes(b'Acme robot\0')
    info = detect_board(str(root))
    assert info.board == '' and 'not recognized' in info.reason


def test_missing_root_is_a_clear_error(tmp_path):
    with pytest.raises(BoardDetectionError, match='proc/cpuinfo'):
        detect_board(str(tmp_path / 'nothing'))


def test_cpuinfo_parsing_distinguishes_arches():
    arch, parts = parse_cpuinfo((BOARDS / 'x86_64/proc/cpuinfo').read_text())
    assert arch == 'x86_64' and len(parts) == 16 and 'i7-10700' in parts[0]
    arch, parts = parse_cpuinfo((BOARDS / 'rpi5/proc/cpuinfo').read_text())
    assert arch == 'aarch64' and parts == dict.fromkeys(range(4), 'cortex-a76')


@pytest.mark.parametrize('name, arch', [
    ('NVIDIA H100 80GB HBM3', 'sm_90'), ('NVIDIA H200', 'sm_90'), ('NVIDIA L4', 'sm_89'),
    ('NVIDIA GeForce RTX 4090', 'sm_89'), ('NVIDIA A100-SXM4-40GB', 'sm_80'),
    ('NVIDIA A10G', 'sm_86'), ('NVIDIA GeForce RTX 3060', 'sm_86'), ('Tesla T4', 'sm_75'),
    ('NVIDIA Something New', ''),
])
def test_gpu_name_to_sm_arch(name, arch):
    assert sm_arch_of(name) == arch


def test_live_machine_is_described():
    info = detect_board('/')
    online = pathlib.Path('/sys/devices/system/cpu/online').read_text()
    assert info.cpu_indices == parse_cpu_list(online)
    assert set(os.sched_getaffinity(0)) <= set(info.cpu_indices)
    assert info.arch in ('x86_64', 'aarch64') and info.reason
