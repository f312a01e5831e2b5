"""No package registry host is written in the repo: tools use the machine's configured ones.

apt, pip and rosdep each know their mirrors (apt sources, pip.conf, rosdep sources); a host
written here breaks on machines that must use another one (a local mirror, no internet).
"""
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Escaped dots: this file never contains the host names it looks for.
HOSTS = re.compile(r'\b(deb|security|ftp[0-9]*\.[a-z]{2})\.debian\.org\b'
                   r'|\b(archive|security|ports)\.ubuntu\.com\b'
                   r'|\bpypi\.(org|python\.org)\b|\bfiles\.pythonhosted\.org\b'
                   r'|\bpackages\.ros\.org\b|\bdownload\.pytorch\.org\b'
                   r'|\bregistry\.npmjs\.org\b', re.IGNORECASE)


def _repo_files():
    if not shutil.which('git') or not (ROOT / '.git').exists():
        pytest.skip('not a git checkout: cannot tell repo files from build outputs')
    out = subprocess.run(['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'],
                         cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    return [ROOT / name for name in out.decode().split('\0') if name]


def test_no_registry_host_names_in_repo_files():
    found = []
    for path in _repo_files():
        try:
            text = path.read_text(encoding='utf-8')
        except (OSError, UnicodeDecodeError):
            continue  # binary or vanished while listing
        for number, line in enumerate(text.splitlines(), 1):
            if HOSTS.search(line):
                found.append(f'{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}')
    assert not found, 'package hosts written in the repo (read them from the machine):\n' + \
        '\n'.join(found)


def test_the_pattern_finds_what_it_must():
    for host in ('deb', 'security'):
        assert HOSTS.search(f'http://{host}.debian' + '.org/debian bookworm main')
    assert HOSTS.search('https://files.pythonhosted' + '.org/packages/x.whl')
    assert HOSTS.search('http://archive.ubuntu' + '.com/ubuntu jammy main')
    assert not HOSTS.search('http://first.mirror.test/debian bookworm main')
