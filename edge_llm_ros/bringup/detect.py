"""Board detection from the files a Linux machine exposes.

Every read goes through a `root` folder so tests run on recorded trees
(test/data/boards/<board>/) exactly as the live system runs on '/'. Sources, most
specific first: /proc/device-tree/{compatible,model} (Jetson module part numbers,
Raspberry Pi, Rockchip SoCs), /etc/nv_tegra_release (L4T release), /proc/cpuinfo (core
types, x86 vs Arm), /sys/devices/system/cpu/cpu*/{topology,cpufreq} (clusters and big
cores), /proc/meminfo, and /proc/driver/nvidia (a discrete NVIDIA GPU).
"""
from __future__ import annotations

from dataclasses import dataclass, field
import pathlib
import re
from typing import Dict, List, Optional, Tuple

from edge_llm_ros.bringup.affinity import parse_cpu_list
from edge_llm_ros.bringup.errors import BoardDetectionError

# MIDR part numbers of Arm Ltd. cores (implementer 0x41) found on supported boards.
ARM_PARTS = {
    0xd03: 'cortex-a53', 0xd05: 'cortex-a55', 0xd07: 'cortex-a57', 0xd08: 'cortex-a72',
    0xd09: 'cortex-a73', 0xd0a: 'cortex-a75', 0xd0b: 'cortex-a76', 0xd0c: 'neoverse-n1',
    0xd0d: 'cortex-a77', 0xd41: 'cortex-a78', 0xd42: 'cortex-a78ae', 0xd44: 'cortex-x1',
    0xd46: 'cortex-a510', 0xd47: 'cortex-a710', 0xd4b: 'cortex-a78c', 0xd4f: 'neoverse-v2',
}
# Cores of other implementers (0x4e = NVIDIA).
OTHER_PARTS = {(0x4e, 0x004): 'nvidia-carmel'}

# Jetson Orin module part numbers (p3701 = AGX Orin, p3767 = Orin NX / Orin Nano family;
# the SKU after the dash tells NX 16GB/8GB (0000/0001) from Nano 8GB/4GB/devkit
# (0003/0004/0005)), as in the L4T device trees' compatible strings.
_JETSON_COMPATIBLE = (
    (re.compile(r'nvidia,p3701-\d{4}'), 'orin_agx'),
    (re.compile(r'nvidia,p3767-000[01]'), 'orin_nx'),
    (re.compile(r'nvidia,p3767-000[345]'), 'orin_nano'),
)
_JETSON_MODEL = (('AGX Orin', 'orin_agx'), ('Orin NX', 'orin_nx'), ('Orin Nano', 'orin_nano'))

# Discrete GPU names -> SM architecture (first match wins; order matters: A100 before A10).
_GPU_ARCH = (
    (r'\b(GB\d+|B[12]00)\b', 'sm_100'),
    (r'\bRTX (PRO )?50\d\d\b', 'sm_120'),
    (r'\b(GH200|H100|H200|H800|H20)\b', 'sm_90'),
    (r'\b(L4|L40S?|L20|RTX 40\d\d|RTX \d+ Ada)\b', 'sm_89'),
    (r'\b(A100|A800|A30)\b', 'sm_80'),
    (r'\b(A10G?|A16|A2|A40|RTX 30\d\d|RTX A\d+)\b', 'sm_86'),
    (r'\b(T4|RTX 20\d\d|Quadro RTX)\b', 'sm_75'),
)


@dataclass(frozen=True)
class CpuCore:
    """One logical CPU."""

    index: int
    part: str             # 'cortex-a76', ... on Arm; the model name on x86
    max_freq_khz: int     # cpufreq cpuinfo_max_freq; 0 when the kernel has no cpufreq
    cluster_id: int       # -1 when the kernel does not say
    package_id: int


@dataclass(frozen=True)
class GpuInfo:
    """A CUDA-capable GPU."""

    name: str
    sm_arch: str          # '' when the name is not in the table
    integrated: bool


@dataclass(frozen=True)
class BoardInfo:
    """What the machine under a root folder is, and why detection decided so."""

    board: str                      # profile name, or '' when no profile matches
    reason: str
    arch: str                       # 'aarch64', 'x86_64' or 'unknown'
    model: str = ''
    compatible: Tuple[str, ...] = ()
    cores: Tuple[CpuCore, ...] = ()
    mem_total_kb: int = 0
    l4t_release: str = ''           # e.g. 'R36.4.3' on a Jetson
    gpus: Tuple[GpuInfo, ...] = field(default_factory=tuple)

    @property
    def cpu_indices(self) -> Tuple[int, ...]:
        """Return the indices of all detected CPUs."""
        return tuple(c.index for c in self.cores)

    def clusters(self) -> Dict[int, Tuple[int, ...]]:
        """Map cluster id -> CPU indices (one cluster -1 when the kernel does not report them)."""
        out: Dict[int, List[int]] = {}
        for core in self.cores:
            out.setdefault(core.cluster_id, []).append(core.index)
        return {k: tuple(v) for k, v in sorted(out.items())}

    def fast_cores(self) -> Tuple[int, ...]:
        """List the CPUs with the highest maximum clock (the big cores on big.LITTLE SoCs)."""
        top = max((c.max_freq_khz for c in self.cores), default=0)
        return tuple(c.index for c in self.cores if c.max_freq_khz == top)

    def summary(self) -> Dict[str, str]:
        """Flat key/value description (diagnostics, the CLI)."""
        clusters = ' '.join('%s:%s' % (k, ','.join(map(str, v)))
                            for k, v in self.clusters().items())
        return {
            'board': self.board or '(none)', 'reason': self.reason, 'arch': self.arch,
            'model': self.model, 'cores': str(len(self.cores)), 'clusters': clusters,
            'core_types': ','.join(sorted({c.part for c in self.cores})),
            'fast_cores': ','.join(map(str, self.fast_cores())),
            'mem_total_mb': str(self.mem_total_kb // 1024), 'l4t': self.l4t_release,
            'gpus': '; '.join('%s (%s)' % (g.name, g.sm_arch or '?') for g in self.gpus),
        }


def _read(root: pathlib.Path, rel: str) -> Optional[str]:
    try:
        return (root / rel).read_bytes().decode('utf-8', 'replace')
    except OSError:
        return None


def _dt_strings(text: Optional[str]) -> Tuple[str, ...]:
    # Device-tree string lists are NUL-separated and NUL-terminated.
    return tuple(s.strip() for s in (text or '').split('\0') if s.strip())


def parse_cpuinfo(text: str) -> Tuple[str, Dict[int, str]]:
    """Arch ('aarch64'/'x86_64'/'unknown') and processor index -> core type."""
    arch = 'unknown'
    parts: Dict[int, str] = {}
    for block in re.split(r'\n\s*\n', text):
        fields = {}
        for line in block.splitlines():
            key, sep, value = line.partition(':')
            if sep:
                fields[key.strip()] = value.strip()
        if 'processor' not in fields or not fields['processor'].isdigit():
            continue
        index = int(fields['processor'])
        if 'vendor_id' in fields or 'flags' in fields:
            arch = 'x86_64' if ' lm ' in ' %s ' % fields.get('flags', '') else 'x86'
            parts[index] = fields.get('model name', 'x86')
        elif 'CPU implementer' in fields:
            arch = 'aarch64' if fields.get('CPU architecture') == '8' else 'arm'
            implementer = int(fields['CPU implementer'], 16)
            part = int(fields.get('CPU part', '0'), 16)
            if implementer == 0x41:
                parts[index] = ARM_PARTS.get(part, 'arm-0x%03x' % part)
            else:
                parts[index] = OTHER_PARTS.get((implementer, part), 'arm-%#x-%#05x' % (
                    implementer, part))
    return arch, parts


def read_cores(root: pathlib.Path, parts: Dict[int, str]) -> Tuple[CpuCore, ...]:
    """Cores listed online, with cluster/package ids and max clock from sysfs."""
    online = _read(root, 'sys/devices/system/cpu/online')
    indices = parse_cpu_list(online) if online else tuple(sorted(parts))
    cores = []
    for index in indices:
        base = 'sys/devices/system/cpu/cpu%d/' % index
        cores.append(CpuCore(
            index=index, part=parts.get(index, 'unknown'),
            max_freq_khz=_int(_read(root, base + 'cpufreq/cpuinfo_max_freq'), 0),
            cluster_id=_int(_read(root, base + 'topology/cluster_id'), -1),
            package_id=_int(_read(root, base + 'topology/physical_package_id'), 0)))
    return tuple(cores)


def _int(text: Optional[str], default: int) -> int:
    try:
        return int((text or '').strip())
    except ValueError:
        return default


def _mem_total_kb(root: pathlib.Path) -> int:
    match = re.search(r'^MemTotal:\s+(\d+)\s*kB', _read(root, 'proc/meminfo') or '', re.M)
    return int(match.group(1)) if match else 0


def _l4t_release(root: pathlib.Path) -> str:
    text = _read(root, 'etc/nv_tegra_release') or ''
    match = re.search(r'#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)', text)
    return 'R%s.%s' % match.groups() if match else ''


def sm_arch_of(gpu_name: str) -> str:
    """SM architecture of a discrete NVIDIA GPU from its marketing name ('' if unknown)."""
    for pattern, arch in _GPU_ARCH:
        if re.search(pattern, gpu_name):
            return arch
    return ''


def _nvidia_gpus(root: pathlib.Path) -> Tuple[GpuInfo, ...]:
    gpus = []
    base = root / 'proc/driver/nvidia/gpus'
    for entry in sorted(base.iterdir()) if base.is_dir() else ():
        try:
            text = (entry / 'information').read_text(errors='replace')
        except OSError:
            text = ''
        match = re.search(r'^Model:\s*(.+)$', text, re.M)
        name = match.group(1).strip() if match else 'NVIDIA GPU'
        gpus.append(GpuInfo(name=name, sm_arch=sm_arch_of(name), integrated=False))
    return tuple(gpus)


def _board_from_device_tree(compatible: Tuple[str, ...], model: str) -> Tuple[str, str]:
    joined = ' '.join(compatible)
    for pattern, board in _JETSON_COMPATIBLE:
        match = pattern.search(joined)
        if match:
            return board, 'device-tree compatible %s' % match.group(0)
    if 'nvidia,tegra234' in compatible:
        for needle, board in _JETSON_MODEL:
            if needle in model:
                return board, 'device-tree model %r' % model
        return '', ('Jetson Orin (tegra234) module %r not recognized; pick orin_agx, orin_nx or '
                    'orin_nano by its CPU count and memory' % model)
    if any(c.startswith('nvidia,tegra') for c in compatible):
        soc = next(c for c in compatible if c.startswith('nvidia,tegra'))
        return '', ('%s (%s) has no profile: only Jetson Orin (tegra234) is supported, CUDA 12+ '
                    'cannot target older Jetsons' % (model or 'Jetson', soc))
    if 'brcm,bcm2712' in compatible or 'raspberrypi,5-model-b' in compatible:
        return 'rpi5', 'device-tree compatible brcm,bcm2712 (%s)' % model
    rockchip = [c for c in compatible if c in ('rockchip,rk3588', 'rockchip,rk3588s')]
    if rockchip:
        return 'rk3588', 'device-tree compatible %s (%s)' % (rockchip[0], model)
    return '', 'device tree %r (%s) matches no profile' % (model, ', '.join(compatible))


def detect_board(root: str = '/') -> BoardInfo:
    """Describe the machine under `root`; `board` is '' (with a reason) when nothing matches."""
    base = pathlib.Path(root)
    cpuinfo = _read(base, 'proc/cpuinfo')
    if cpuinfo is None:
        raise BoardDetectionError('cannot read %s: is %r the root of a Linux system?' % (
            base / 'proc/cpuinfo', root))
    arch, parts = parse_cpuinfo(cpuinfo)
    compatible = _dt_strings(_read(base, 'proc/device-tree/compatible'))
    model = ' '.join(_dt_strings(_read(base, 'proc/device-tree/model')))
    l4t = _l4t_release(base)
    common = {'arch': arch, 'compatible': compatible, 'cores': read_cores(base, parts),
              'mem_total_kb': _mem_total_kb(base), 'l4t_release': l4t}
    if compatible:
        board, reason = _board_from_device_tree(compatible, model)
        gpus = (GpuInfo('Jetson Orin iGPU (Ampere)', 'sm_87', True),) if board.startswith(
            'orin') else ()
        return BoardInfo(board=board, reason=reason, model=model, gpus=gpus, **common)
    if l4t:
        return BoardInfo(board='', reason='%s found but no device tree under %s' % (
            l4t, base / 'proc/device-tree'), **common)
    if arch == 'x86_64':
        gpus = _nvidia_gpus(base)
        cpu_model = next(iter(parts.values()), 'x86_64')
        if gpus:
            return BoardInfo(board='x86_64_cuda', reason='x86_64 with NVIDIA driver (%s)' % (
                gpus[0].name), model=cpu_model, gpus=gpus, **common)
        return BoardInfo(board='x86_64', reason='x86_64 without an NVIDIA driver',
                         model=cpu_model, **common)
    return BoardInfo(board='', reason='%s machine without a device tree matches no profile' % (
        arch), **common)
