"""The arm64 stage: `edge-llm generate` on aarch64, under qemu-user, without ROS.

scripts/test.sh builds the userland once (scripts/arm64_rootfs.sh: a Debian arm64 rootfs and
the engine's aarch64 wheels in .cache/arm64/). The embedded SmolLM2 folder converted on this
host runs there greedily, with the op library cross-built for aarch64 when the folder is kquant
(its NEON dotprod kernels give the AVX2 kernels' bits); its first tokens must equal the host's,
or differ only as float drift does between CPU classes (the regression replay's cross-CPU
rule). The stage's wall
time is recorded in .cache/arm64/last_run.json; qemu timings say nothing about a board's
speed, so none is reported as performance.
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

from native_build import aarch64_build
import pytest
from tokenizers import Tokenizer

from edge_llm_ros.model_format import embedded_model_dir, load_model_info
from edge_llm_ros.regression.compare import cross_cpu_drift, similarity
from edge_llm_ros.regression.thresholds import OutputThresholds
from edge_llm_ros.runtime import native_ops

ROOT = pathlib.Path(__file__).resolve().parents[1]
STAGE = pathlib.Path(os.environ.get('EDGE_LLM_ARM64_DIR', ROOT / '.cache' / 'arm64'))
# The first 8 greedy steps keep a top-2 margin >= 0.34 logits (kquant and matmulnbits), so
# float drift between CPU classes cannot flip them: a prompt with a near tie at its first token
# (0.19 for 'Name three parts of a wheeled robot.') fails the cross-CPU rule by chance.
PROMPT = 'What color is the sky?'
TOKENS = 16
# The whole aarch64 run (interpreter start, model load, prefill, 16 tokens) under emulation.
STAGE_TIMEOUT_S = 600


def _stage() -> pathlib.Path:
    unavailable = STAGE / 'unavailable'
    if unavailable.exists():
        pytest.skip(f'arm64 stage unavailable: {unavailable.read_text().strip()}')
    qemu = shutil.which('qemu-aarch64-static')
    if qemu is None or not (STAGE / 'site.stamp').exists():
        pytest.fail('the arm64 userland is missing: scripts/test.sh builds it '
                    '(bash scripts/arm64_rootfs.sh)')
    return pathlib.Path(qemu)


def _aarch64(qemu: pathlib.Path, cpu: str, *args: str) -> subprocess.CompletedProcess:
    rootfs = STAGE / 'rootfs'
    env = {'PATH': '/usr/bin:/bin', 'HOME': str(STAGE), 'LANG': 'C.UTF-8',
           'PYTHONPATH': f'{STAGE / "site"}:{ROOT}', 'PYTHONDONTWRITEBYTECODE': '1',
           'EDGE_LLM_CACHE': str(embedded_model_dir().parents[1])}
    if native_ops.DOMAIN in load_model_info(str(embedded_model_dir())).op_domains:
        library = aarch64_build('edge_llm_ort_ops') / native_ops.LIBRARY_FILE
        env[native_ops.ENV_LIBRARY] = str(library)
    return subprocess.run([str(qemu), '-cpu', cpu, '-L', str(rootfs),
                           str(rootfs / 'usr' / 'bin' / 'python3'), *args],
                          env=env, capture_output=True, text=True, timeout=STAGE_TIMEOUT_S)


def _generate_args() -> list:
    return ['-m', 'edge_llm_ros.cli', 'generate', '--max-tokens', str(TOKENS),
            '--threads', '1', '--verbose', PROMPT]


def test_edge_llm_generate_on_aarch64_agrees_with_the_host():
    qemu = _stage()
    probe = _aarch64(qemu, 'cortex-a76', '-c',
                     'import platform, onnxruntime; print(platform.machine(), '
                     'onnxruntime.__version__)')
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split()[0] == 'aarch64', probe.stdout

    host = subprocess.run([sys.executable, *_generate_args()], capture_output=True, text=True,
                          timeout=300)
    assert host.returncode == 0, host.stderr
    start = time.monotonic()
    arm = _aarch64(qemu, 'cortex-a76', *_generate_args())
    seconds = time.monotonic() - start
    assert arm.returncode == 0, arm.stdout + arm.stderr
    assert f'{TOKENS} generated' in arm.stderr, arm.stderr
    if native_ops.DOMAIN in load_model_info(str(embedded_model_dir())).op_domains:
        # cortex-a76 has dotprod: the dispatcher picked it at run time.
        assert 'kernel kquant (neon_dotprod)' in arm.stderr, arm.stderr
        assert 'kernel kquant (' in host.stderr, host.stderr

    tokenizer = Tokenizer.from_file(str(embedded_model_dir() / 'tokenizer.json'))
    host_ids = tokenizer.encode(host.stdout.rstrip('\n'), add_special_tokens=False).ids
    arm_ids = tokenizer.encode(arm.stdout.rstrip('\n'), add_special_tokens=False).ids
    (STAGE / 'last_run.json').write_text(json.dumps({
        'what': 'edge-llm generate under qemu-aarch64-static -cpu cortex-a76 (not a speed)',
        'wall_s': round(seconds, 1), 'tokens': TOKENS, 'equal': host_ids == arm_ids,
        'host': host.stdout, 'aarch64': arm.stdout}, indent=2) + '\n')
    print(f'arm64 stage: {seconds:.1f} s wall under emulation')
    if host_ids != arm_ids:
        verdict = cross_cpu_drift(host_ids, arm_ids,
                                  similarity(host.stdout, arm.stdout), OutputThresholds())
        assert verdict.within, (f'aarch64 {arm.stdout!r} vs host {host.stdout!r}: '
                                f'{verdict.reason}')
