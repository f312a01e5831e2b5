"""Build native/ once per test session (cmake, the ORT headers from scripts/ort_headers.sh).

The same folder and flags as scripts/setup.sh (build/native), so after the setup this is
cmake's up-to-date check, and the converter and runtime find the library the tests built.
"""
import functools
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUILD = ROOT / 'build' / 'native'


@functools.lru_cache(maxsize=None)
def native_build() -> pathlib.Path:
    """Return the build folder holding libedge_llm_kquant.so and libedge_llm_ort_ops.so."""
    include = subprocess.run(['bash', str(ROOT / 'scripts' / 'ort_headers.sh')], check=True,
                             capture_output=True, text=True).stdout.strip()
    for command in (['cmake', '-S', str(ROOT / 'native'), '-B', str(BUILD),
                     '-DCMAKE_BUILD_TYPE=Release', f'-DORT_INCLUDE_DIR={include}'],
                    ['cmake', '--build', str(BUILD), '-j2']):
        proc = subprocess.run(command, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return BUILD
