"""scripts/dmabuf_vm/apt_sources.py: the VM's kernel comes from the machine's own apt mirror."""
import importlib
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'scripts' / 'dmabuf_vm' / 'apt_sources.py'
sys.path.insert(0, str(SCRIPT.parent))

apt_sources = importlib.import_module('apt_sources')  # a script folder, not a package

# Hosts are examples in the .test / .invalid domains: nothing here names a real archive.
DEB822 = """\
# The security archive comes first on purpose: it must never be picked.
Types: deb
URIs: http://security.mirror.test/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://src.mirror.test/debian
Suites: bookworm
Components: main

Types: deb
URIs: http://off.mirror.test/debian
Suites: bookworm
Components: main
Enabled: no

Types: deb deb-src
# a comment inside the paragraph
URIs: http://first.mirror.test/debian
  http://second.mirror.test/debian
Suites: bookworm bookworm-updates
Components: main contrib non-free-firmware
Signed-By: /etc/apt/keyrings/local.gpg
"""

ONE_LINE = """\
# deb http://commented.mirror.test/debian bookworm main
deb-src http://src.mirror.test/debian bookworm main
deb http://security.mirror.test/debian-security bookworm-security main
deb http://old.mirror.test/debian-security bookworm/updates main
deb [ arch=amd64,arm64 signed-by=/usr/share/keyrings/x.gpg ] http://arch.mirror.test/debian \
bookworm main  # trailing comment
deb http://contrib.mirror.test/debian bookworm contrib
"""


def test_deb822_fields_comments_multiple_uris_and_disabled():
    entries = apt_sources.parse_deb822(DEB822, origin='debian.sources')
    assert [e.enabled for e in entries] == [True, True, False, True]
    last = entries[-1]
    assert last.types == ['deb', 'deb-src']
    assert last.uris == ['http://first.mirror.test/debian', 'http://second.mirror.test/debian']
    assert last.suites == ['bookworm', 'bookworm-updates']
    assert last.components == ['main', 'contrib', 'non-free-firmware']
    assert last.signed_by == '/etc/apt/keyrings/local.gpg'
    assert last.origin == 'debian.sources'
    picked = apt_sources.pick_mirror(entries, 'bookworm')
    # Not the security archive, not deb-src, not the disabled one: the first URI of the rest.
    assert picked is last
    assert apt_sources.keyring_for(picked) == '/etc/apt/keyrings/local.gpg'


def test_one_line_options_comments_and_deb_src():
    entries = apt_sources.parse_one_line(ONE_LINE.replace('\\\n', ''))
    assert [(e.types[0], e.uris[0]) for e in entries] == [
        ('deb-src', 'http://src.mirror.test/debian'),
        ('deb', 'http://security.mirror.test/debian-security'),
        ('deb', 'http://old.mirror.test/debian-security'),
        ('deb', 'http://arch.mirror.test/debian'),
        ('deb', 'http://contrib.mirror.test/debian')]
    arch = entries[3]
    assert arch.options == {'arch': 'amd64,arm64', 'signed-by': '/usr/share/keyrings/x.gpg'}
    assert arch.suites == ['bookworm'] and arch.components == ['main']
    # Security suites (both spellings), deb-src and a source without main are passed over.
    assert apt_sources.pick_mirror(entries, 'bookworm') is arch


def test_the_release_itself_beats_a_pocket_and_pockets_are_a_fallback():
    pocket = apt_sources.parse_one_line(
        'deb http://bp.mirror.test/debian bookworm-backports main\n')
    release = apt_sources.parse_one_line('deb http://rel.mirror.test/debian bookworm main\n')
    assert apt_sources.pick_mirror(pocket + release, 'bookworm') is release[0]
    assert apt_sources.pick_mirror(pocket, 'bookworm') is pocket[0]
    # Another release's suites, or only its security suite, do not serve this one.
    other = apt_sources.parse_one_line('deb http://t.mirror.test/debian trixie main\n'
                                       'deb http://s.mirror.test/d bookworm-security main\n')
    with pytest.raises(apt_sources.NoMirrorError, match='usable suites found: '
                       'bookworm-security, trixie.*EDGE_LLM_DMABUF_VM_MIRROR'):
        apt_sources.pick_mirror(other, 'bookworm')


def test_inline_key_falls_back_to_the_archive_keyring():
    text = ('Types: deb\nURIs: http://k.mirror.test/debian\nSuites: bookworm\n'
            'Components: main\nSigned-By:\n -----BEGIN PGP PUBLIC KEY BLOCK-----\n .\n'
            ' abc\n -----END PGP PUBLIC KEY BLOCK-----\n')
    (entry,) = apt_sources.parse_deb822(text)
    assert entry.signed_by.startswith('\n-----BEGIN PGP')
    expected = (apt_sources.FALLBACK_KEYRING if os.path.exists(apt_sources.FALLBACK_KEYRING)
                else '')
    assert apt_sources.keyring_for(entry) == expected


def test_read_sources_follows_apts_file_rules(tmp_path):
    parts = tmp_path / 'sources.list.d'
    parts.mkdir()
    (tmp_path / 'sources.list').write_text('deb http://list.mirror.test/debian trixie main\n')
    (parts / 'b.sources').write_text(DEB822)
    (parts / 'a.list').write_text(ONE_LINE)
    (parts / 'c.sources.disabled-by-farm').write_text(
        'Types: deb\nURIs: http://ignored.mirror.test/x\nSuites: bookworm\nComponents: main\n')
    entries = apt_sources.read_sources(str(tmp_path / 'sources.list'), str(parts))
    origins = [pathlib.Path(e.origin).name for e in entries]
    assert origins == ['sources.list'] + ['a.list'] * 5 + ['b.sources'] * 4
    assert apt_sources.pick_mirror(entries, 'bookworm').uris[0] == 'http://arch.mirror.test/debian'


def _cli(tmp_path, *args, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), '--sources-list',
                           str(tmp_path / 'sources.list'), '--sources-parts',
                           str(tmp_path / 'parts'), *args], capture_output=True, text=True,
                          env=env or {k: v for k, v in os.environ.items()
                                      if k != 'EDGE_LLM_DMABUF_VM_MIRROR'}, timeout=60)


def test_cli_prints_a_private_sources_list_or_says_why_not(tmp_path):
    (tmp_path / 'parts').mkdir()
    (tmp_path / 'parts' / 'debian.sources').write_text(DEB822)
    proc = _cli(tmp_path, '--suites', 'bookworm', 'bookworm-backports')
    assert proc.returncode == 0, proc.stderr
    key = '[signed-by=/etc/apt/keyrings/local.gpg]'
    assert proc.stdout == (f'deb {key} http://first.mirror.test/debian bookworm main\n'
                           f'deb {key} http://first.mirror.test/debian bookworm-backports main\n')
    assert 'debian.sources' in proc.stderr
    proc = _cli(tmp_path, '--suites', 'jammy')
    assert proc.returncode == apt_sources.NO_SOURCE
    assert proc.stdout == '' and 'no enabled apt source with suite jammy' in proc.stderr
    env = dict(os.environ, EDGE_LLM_DMABUF_VM_MIRROR='http://override.mirror.test/debian')
    proc = _cli(tmp_path, '--suites', 'jammy', env=env)
    assert proc.returncode == 0 and 'http://override.mirror.test/debian jammy main' in proc.stdout


def test_this_machines_apt_configuration_gives_a_mirror():
    """The real apt paths (apt-config) parse; on a Debian host they name a bookworm mirror."""
    sources_list, parts = apt_sources.apt_paths()
    assert sources_list.startswith('/') and parts.startswith('/')
    entries = apt_sources.read_sources(sources_list, parts)
    release = _os_release().get('VERSION_CODENAME', '')
    if _os_release().get('ID') != 'debian' or not release:
        pytest.skip('not a Debian host: its apt sources need not serve Debian')
    picked = apt_sources.pick_mirror(entries, release)
    assert picked.enabled and 'deb' in picked.types and release in picked.suites


def _os_release():
    try:
        lines = pathlib.Path('/etc/os-release').read_text().splitlines()
    except OSError:
        return {}
    return {k: v.strip('"') for k, _, v in (ln.partition('=') for ln in lines)}
