"""Rewrite build-host include paths baked into the ROS wheels' CMake files.

The PyPI ROS 2 wheels export CMake config files that point at the wheel
builder's Python (/opt/python/cp311-cp311/...) and its numpy headers; rosidl's
Python generator needs this venv's paths instead.
"""
import pathlib
import re
import sys
import sysconfig

import numpy


def main(venv: str) -> int:
    py_inc = sysconfig.get_paths()['include']
    np_inc = numpy.get_include()
    pattern_np = re.compile(
        r'/opt/python/cp3\d+-cp3\d+/lib/python3\.\d+/site-packages/numpy/[\w/]*include')
    pattern_py = re.compile(r'/opt/python/cp3\d+-cp3\d+/include/python3\.\d+')
    changed = 0
    for path in pathlib.Path(venv, 'share').glob('*/cmake/**/*.cmake'):
        text = path.read_text()
        new = pattern_py.sub(py_inc, pattern_np.sub(np_inc, text))
        if new != text:
            path.write_text(new)
            changed += 1
    print(f'fix_wheel_cmake_paths: rewrote {changed} file(s)')
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1]))
