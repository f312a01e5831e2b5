"""CPU class: the instruction-set features that decide onnxruntime's float rounding.

onnxruntime's MLAS picks its GEMM and quantized-matmul kernels at run time from the CPU's
features (AVX2/FMA, AVX-512, VNNI, AMX on x86; dot product, i8mm, SVE on aarch64).
Kernels of different classes sum in other orders, so the same build gives bit-identical
logits only on CPUs of one class. A class is written as '<arch>:<feature>,<feature>...'
(e.g. 'x86_64:avx2,fma,avx512f,avx512vnni'), features in a fixed order, so two classes
compare as strings. Bags store the recording machine's class (bagio.CPU_CLASS_KEY).

    python -m edge_llm_ros.regression.cpu_class            # prints this machine's class
    python -m edge_llm_ros.regression.cpu_class FILE       # ... of a copied /proc/cpuinfo
"""
from __future__ import annotations

import platform
import re
import sys
from typing import Dict, Iterable, Optional, Sequence, Tuple

from edge_llm_ros.regression.errors import CpuClassError

UNKNOWN = 'unknown'
CPUINFO = '/proc/cpuinfo'

# (name in a class, spellings in /proc/cpuinfo), in class order. Only what MLAS dispatches
# on: other flags do not change the numerics and would only split classes needlessly.
X86_FEATURES: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ('avx2', ('avx2',)),
    ('fma', ('fma',)),
    ('avx512f', ('avx512f',)),
    ('avx512vnni', ('avx512_vnni', 'avx512vnni')),
    ('avx_vnni', ('avx_vnni', 'avxvnni')),
    ('amx_int8', ('amx_int8',)),
    ('amx_tile', ('amx_tile',)),
)
ARM_FEATURES: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ('asimddp', ('asimddp', 'dotprod')),
    ('i8mm', ('i8mm',)),
    ('sve', ('sve',)),
)
_MACHINE_ALIASES = {'amd64': 'x86_64', 'x64': 'x86_64', 'arm64': 'aarch64',
                    'i386': 'x86', 'i486': 'x86', 'i586': 'x86', 'i686': 'x86'}
_CLASS_PATTERN = re.compile(r'^[a-z0-9_]+:[a-z0-9_]*(,[a-z0-9_]+)*$')


def normalize_machine(machine: str) -> str:
    """Return platform.machine()'s name in /proc/cpuinfo's terms ('AMD64' -> 'x86_64')."""
    name = machine.strip().lower()
    if name.startswith('armv7') or name.startswith('armv6'):
        return 'arm'
    return _MACHINE_ALIASES.get(name, name)


def _blocks(text: str) -> Iterable[Dict[str, str]]:
    """Return the processor blocks of a /proc/cpuinfo text as key -> value dicts."""
    for block in re.split(r'\n\s*\n', text):
        fields = {}
        for line in block.splitlines():
            key, sep, value = line.partition(':')
            if sep:
                fields[key.strip().lower()] = value.strip()
        if fields:
            yield fields


def _arch_of(blocks: Sequence[Dict[str, str]]) -> str:
    for fields in blocks:
        if 'flags' in fields:
            return 'x86_64' if 'lm' in fields['flags'].split() else 'x86'
        if 'features' in fields:
            return 'aarch64' if fields.get('cpu architecture', '8') in ('8', '9', 'aarch64') \
                else 'arm'
    return ''


def _feature_sets(blocks: Sequence[Dict[str, str]]) -> list:
    return [set(fields.get('flags', fields.get('features', '')).split()) for fields in blocks
            if 'flags' in fields or 'features' in fields]


def cpu_class_from_cpuinfo(text: str, machine: str = '') -> str:
    """Return the CPU class of a /proc/cpuinfo text; UNKNOWN when it lists no features.

    `machine` (platform.machine()) wins over the architecture the text suggests: a 32-bit
    userland on a 64-bit kernel runs the 32-bit onnxruntime build.
    """
    blocks = list(_blocks(text))
    sets = _feature_sets(blocks)
    arch = normalize_machine(machine) if machine else _arch_of(blocks)
    if not sets or not arch:
        return UNKNOWN
    # A feature counts only when every core has it: the kernel's HWCAP (which MLAS reads)
    # is the intersection too, on big.LITTLE SoCs with unequal cores as well.
    common = set.intersection(*sets)
    table = X86_FEATURES if arch in ('x86_64', 'x86') else (
        ARM_FEATURES if arch in ('aarch64', 'arm') else ())
    names = [name for name, spellings in table if common.intersection(spellings)]
    return f"{arch}:{','.join(names)}"


def current_cpu_class(path: str = CPUINFO, machine: Optional[str] = None) -> str:
    """Return this machine's CPU class; UNKNOWN when /proc/cpuinfo cannot be read."""
    try:
        with open(path, encoding='utf-8', errors='replace') as stream:
            text = stream.read()
    except OSError:
        return UNKNOWN
    return cpu_class_from_cpuinfo(text, platform.machine() if machine is None else machine)


def parse_cpu_class(text: str) -> str:
    """Validate a class given by a user or read from a bag; returns it normalized.

    '' and 'unknown' give UNKNOWN; anything else must look like 'x86_64:avx2,fma'.
    """
    value = (text or '').strip().lower()
    if value in ('', UNKNOWN):
        return UNKNOWN
    if not _CLASS_PATTERN.match(value):
        raise CpuClassError(
            f"CPU class '{text}' is not of the form ARCH:FEATURE,FEATURE (e.g. "
            "'x86_64:avx2,fma' or 'aarch64:asimddp,i8mm') or 'unknown'; print a machine's "
            'class with: python -m edge_llm_ros.regression.cpu_class')
    return value


def is_known(cpu_class: str) -> bool:
    return bool(cpu_class) and cpu_class != UNKNOWN


def same_cpu_class(a: str, b: str) -> bool:
    """Tell whether two classes are known and equal (greedy tokens then must be identical)."""
    return is_known(a) and is_known(b) and a == b


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print this machine's class, or that of a saved cpuinfo file (another machine's)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(current_cpu_class())
        return 0
    try:
        with open(args[0], encoding='utf-8', errors='replace') as stream:
            print(cpu_class_from_cpuinfo(stream.read()))
    except OSError as exc:
        print(f'cpu_class: cannot read {args[0]}: {exc.strerror}', file=sys.stderr)
        return 2
    return 0


if __name__ == '__main__':
    sys.exit(main())
