"""The llama.cpp benchmark peer: a portable build, and a crash that fails the run loudly.

No compiling here: the flag choice is checked on cpuinfo texts of known CPUs, and the loud
failure with stand-in peer processes that die the way a crashing llama.cpp does.
"""
import argparse
import importlib
import json
import pathlib
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'bench'))

# bench/ is a script folder, not a package.
bench_engine = importlib.import_module('bench_engine')
llama_peer = importlib.import_module('llama_peer')

# Flag lines as /proc/cpuinfo prints them (trimmed to what matters plus some noise).
SAPPHIRE_RAPIDS = ('fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2 avx512f '
                   'avx512dq avx512ifma avx512cd avx512bw avx512vl avx_vnni avx512_bf16 '
                   'avx512vbmi avx512_vbmi2 avx512_vnni amx_bf16 avx512_fp16 amx_tile amx_int8')
ZEN2 = 'fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2 sha_ni'
# Knights Landing: AVX-512 foundation but none of VL/DQ/BW, which GGML_AVX512 compiles for.
KNIGHTS_LANDING = 'sse sse2 avx f16c fma avx2 bmi2 avx512f avx512pf avx512er avx512cd'
NEHALEM = 'fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt'


def _options(flags: str):
    args = llama_peer.cmake_args(frozenset(flags.split()), 'x86_64')
    assert args[0] == '-DGGML_NATIVE=OFF'
    return dict(a[2:].split('=') for a in args[1:])


def test_an_amx_cpu_gets_every_simd_extension_and_no_amx():
    opts = _options(SAPPHIRE_RAPIDS)
    on = {k for k, v in opts.items() if v == 'ON'}
    assert on == {'GGML_AVX', 'GGML_AVX2', 'GGML_FMA', 'GGML_F16C', 'GGML_BMI2',
                  'GGML_AVX_VNNI', 'GGML_AVX512', 'GGML_AVX512_VBMI', 'GGML_AVX512_VNNI',
                  'GGML_AVX512_BF16'}
    assert {opts[k] for k in ('GGML_AMX_TILE', 'GGML_AMX_INT8', 'GGML_AMX_BF16')} == {'OFF'}


def test_avx512_only_when_the_cpu_has_what_ggml_compiles_it_with():
    zen2 = _options(ZEN2)
    assert {k for k, v in zen2.items() if v == 'ON'} == {
        'GGML_AVX', 'GGML_AVX2', 'GGML_FMA', 'GGML_F16C', 'GGML_BMI2'}
    knl = _options(KNIGHTS_LANDING)
    assert knl['GGML_AVX512'] == 'OFF' and knl['GGML_AVX2'] == 'ON'
    assert set(_options(NEHALEM).values()) == {'OFF'}  # nothing it lacks, native still off


def test_every_option_is_set_explicitly_and_other_machines_keep_ggml_defaults():
    names = [a.split('=')[0] for a in llama_peer.cmake_args(frozenset(), 'x86_64')]
    assert len(names) == len(set(names)) == 1 + len(llama_peer.X86_OPTIONS) + 3
    assert llama_peer.cmake_args(frozenset(ZEN2.split()), 'aarch64') == []


def test_cpuinfo_parsing_and_the_cache_key(tmp_path):
    text = ''.join(f'processor\t: {i}\nvendor_id\t: GenuineIntel\nflags\t\t: '
                   f'{SAPPHIRE_RAPIDS if i == 0 else ZEN2}\n\n' for i in range(2))
    assert llama_peer.cpu_flags(text) == frozenset(SAPPHIRE_RAPIDS.split())
    assert llama_peer.cpu_flags('processor\t: 0\nFeatures\t: fp asimd\n') == frozenset()
    (tmp_path / 'amx').write_text(text)
    (tmp_path / 'zen2').write_text(f'flags\t: {ZEN2}\n')
    amx = llama_peer.build_config(str(tmp_path / 'amx'), 'x86_64')
    zen2 = llama_peer.build_config(str(tmp_path / 'zen2'), 'x86_64')
    assert amx.cpu_has_amx and not zen2.cpu_has_amx
    assert amx.version == zen2.version == llama_peer.VERSION
    assert amx.key != zen2.key and amx.key == llama_peer.build_config(str(tmp_path / 'amx'),
                                                                      'x86_64').key
    missing = llama_peer.build_config(str(tmp_path / 'absent'), 'x86_64')
    assert missing.cmake_args == tuple(llama_peer.cmake_args(frozenset()))


def test_a_missing_or_stale_peer_is_reported_not_silently_used(tmp_path):
    config = llama_peer.build_config()
    with pytest.raises(llama_peer.PeerBuildError, match='not built.*--with-peers'):
        llama_peer.ensure_peer(False, config, tmp_path)
    venv = tmp_path / 'venv'
    (venv / 'bin').mkdir(parents=True)
    (venv / 'bin' / 'python').symlink_to(sys.executable)
    stamp = {'key': 'an-older-build', 'python': str(venv / 'bin' / 'python')}
    (venv / llama_peer.STAMP).write_text(json.dumps(stamp))
    with pytest.raises(llama_peer.PeerBuildError, match='built with other flags'):
        llama_peer.ensure_peer(False, config, tmp_path)
    stamp['key'] = config.key
    (venv / llama_peer.STAMP).write_text(json.dumps(stamp))
    assert llama_peer.ensure_peer(False, config, tmp_path) == stamp


def _fake_peer(tmp_path, body: str) -> str:
    """Write a stand-in interpreter: run_peer starts it like the peer's python."""
    path = tmp_path / 'fake_python'
    path.write_text('#!/bin/sh\nulimit -c 0\n' + body)
    path.chmod(0o755)
    return str(path)


def _args():
    return argparse.Namespace(threads=1, max_context=256, gguf='model.gguf', prompt_text='hi')


def test_a_peer_killed_by_a_signal_raises_with_its_stderr(tmp_path):
    python = _fake_peer(tmp_path, 'echo "ggml_compute_forward_mul_mat: in the AMX path" >&2\n'
                        'kill -SEGV $$\n')
    with pytest.raises(bench_engine.PeerCrashed) as err:
        bench_engine.run_peer(python, 'llama_cpp', _args(), [1, 2, 3])
    msg = str(err.value)
    assert 'llama_cpp peer' in msg and 'killed by SIGSEGV' in msg
    assert 'in the AMX path' in msg


def test_a_failing_or_silent_peer_raises_too(tmp_path):
    lines = ''.join(f'echo "line {i}" >&2\n' for i in range(40))
    python = _fake_peer(tmp_path, lines + 'echo "RuntimeError: no model" >&2\nexit 1\n')
    with pytest.raises(bench_engine.PeerCrashed, match='exited with status 1') as err:
        bench_engine.run_peer(python, 'ortgenai', _args(), [1])
    msg = str(err.value)
    assert 'RuntimeError: no model' in msg and 'line 39' in msg and 'line 10\n' not in msg
    python = _fake_peer(tmp_path, 'echo "not json"\n')
    with pytest.raises(bench_engine.PeerCrashed, match='exited 0 without a JSON result'):
        bench_engine.run_peer(python, 'llama_cpp', _args(), [1])
    python = _fake_peer(tmp_path, 'echo \'{"decode_tok_s": 5.0}\'\n')
    assert bench_engine.run_peer(python, 'llama_cpp', _args(), [1]) == {'decode_tok_s': 5.0}


def test_the_benchmark_exits_non_zero_when_its_peer_crashes(tmp_path):
    """The real bench run: our engine measures, the peer dies by SIGSEGV, no JSON comes out."""
    python = _fake_peer(tmp_path, 'echo "llama peer: about to fault" >&2\nkill -SEGV $$\n')
    proc = subprocess.run([sys.executable, str(ROOT / 'bench' / 'bench_engine.py'),
                           '--repeats', '1', '--threads', '1', '--llama-cpp-python', python],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == bench_engine.PEER_CRASHED, proc.stderr[-3000:]
    assert 'bench: FAILED, no results: llama_cpp peer' in proc.stderr
    assert f'killed by {signal.Signals.SIGSEGV.name}' in proc.stderr
    assert 'about to fault' in proc.stderr
    assert '"peers"' not in proc.stdout
