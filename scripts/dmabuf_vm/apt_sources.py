#!/usr/bin/env python3
"""Find the Debian archive this machine's apt is configured with (stdlib only).

run.sh fetches the VM's kernel and busybox with `apt-get download` through a private apt
configuration. Instead of naming a mirror host, it asks this for the machine's own: the
`deb` sources apt reads (one-line `sources.list` / `*.list` and deb822 `*.sources` files,
at the paths `apt-config` reports), keeping enabled entries with the `main` component,
whose suite is the wanted release or one of its -updates / -backports pockets. Security
suites (`-security`, `/updates`) are a different archive and are never picked.

    apt_sources.py --suites bookworm bookworm-backports    # prints a sources.list

Exit 0 with the lines on stdout; exit 3 with the reason on stderr when no source fits.
"""
import argparse
from dataclasses import dataclass, field
import os
import re
import shlex
import subprocess
import sys
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

DEFAULT_LIST = '/etc/apt/sources.list'
DEFAULT_PARTS = '/etc/apt/sources.list.d'
FALLBACK_KEYRING = '/usr/share/keyrings/debian-archive-keyring.gpg'
# apt reads only part files with these names (others, like *.disabled, are ignored).
PART_NAME = re.compile(r'^[A-Za-z0-9_.-]+\.(list|sources)$')
NO_SOURCE = 3


class NoMirrorError(LookupError):
    """No configured apt source serves the wanted suites; the message says what to set."""


@dataclass
class Source:
    """One apt source entry (one line, or one deb822 paragraph)."""

    types: List[str]
    uris: List[str]
    suites: List[str]
    components: List[str]
    options: Dict[str, str] = field(default_factory=dict)
    enabled: bool = True
    origin: str = ''  # file the entry came from, for messages

    @property
    def signed_by(self) -> str:
        return self.options.get('signed-by', '')


def parse_one_line(text: str, origin: str = '') -> List[Source]:
    """Parse the one-line format: `deb [opt=v ...] URI SUITE [COMPONENT ...]` per line."""
    out = []
    for raw in text.splitlines():
        line = raw.split('#', 1)[0].strip()
        if not line:
            continue
        options: Dict[str, str] = {}
        match = re.match(r'^(\S+)\s+\[([^\]]*)\]\s*(.*)$', line)
        if match:
            kind, opts, rest = match.groups()
            for opt in opts.split():
                key, _, value = opt.partition('=')
                options[key.lower()] = value
        else:
            kind, _, rest = line.partition(' ')
        words = rest.split()
        if len(words) < 2:
            continue  # malformed: apt would refuse it too
        out.append(Source(types=[kind], uris=[words[0]], suites=[words[1]],
                          components=words[2:], options=options, origin=origin))
    return out


def _deb822_paragraphs(text: str) -> Iterable[Dict[str, str]]:
    fields: Dict[str, str] = {}
    last = ''
    for raw in text.splitlines() + ['']:
        if raw.startswith('#'):
            continue  # a comment line, even inside a paragraph
        if not raw.strip():
            if fields:
                yield fields
            fields, last = {}, ''
        elif raw[0] in ' \t' and last:
            fields[last] += '\n' + raw.strip()  # continuation line (e.g. an inline key)
        else:
            name, _, value = raw.partition(':')
            last = name.strip().lower()
            fields[last] = value.strip()


def parse_deb822(text: str, origin: str = '') -> List[Source]:
    """Parse deb822 `.sources` paragraphs (Types, URIs, Suites, Components, Enabled, ...)."""
    out = []
    for f in _deb822_paragraphs(text):
        main = ('types', 'uris', 'suites', 'components', 'enabled')
        options = {k: v for k, v in f.items() if k not in main}
        out.append(Source(types=f.get('types', '').split(), uris=f.get('uris', '').split(),
                          suites=f.get('suites', '').split(),
                          components=f.get('components', '').split(), options=options,
                          enabled=f.get('enabled', 'yes').lower() not in ('no', 'false', '0'),
                          origin=origin))
    return out


def apt_paths() -> Tuple[str, str]:
    """Return apt's main sources list and parts folder (apt-config, else the defaults)."""
    try:
        out = subprocess.run(['apt-config', 'shell', 'L', 'Dir::Etc::SourceList/f',
                              'P', 'Dir::Etc::SourceParts/d'],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ''
    found = {}
    for line in out.splitlines():
        name, _, value = line.partition('=')
        words = shlex.split(value)
        if words:
            found[name] = words[0]
    return found.get('L', DEFAULT_LIST), found.get('P', DEFAULT_PARTS).rstrip('/')


def read_sources(sources_list: str = DEFAULT_LIST,
                 parts: str = DEFAULT_PARTS) -> List[Source]:
    """Return every entry apt would read, in apt's order (the list, then the parts by name)."""
    files = [sources_list]
    if os.path.isdir(parts):
        files += [os.path.join(parts, n) for n in sorted(os.listdir(parts)) if PART_NAME.match(n)]
    out: List[Source] = []
    for path in files:
        try:
            with open(path, encoding='utf-8') as fh:
                text = fh.read()
        except OSError:
            continue
        parse = parse_deb822 if path.endswith('.sources') else parse_one_line
        out += parse(text, origin=path)
    return out


def is_security(suite: str) -> bool:
    return suite.endswith('-security') or suite.endswith('/updates')


def _pocket_of(suite: str, release: str) -> bool:
    return suite == release or (suite.startswith(release + '-') and not is_security(suite))


def pick_mirror(sources: Sequence[Source], release: str) -> Source:
    """Return the first enabled binary `main` source serving `release` (or its pockets).

    An entry naming the release itself beats one naming only -updates / -backports; the
    first URI of the entry is used (apt itself tries them in order).
    """
    usable = [s for s in sources if s.enabled and 'deb' in s.types and 'main' in s.components
              and any(u.split(':', 1)[0] != 'cdrom' for u in s.uris)]
    for exact in (True, False):
        for source in usable:
            if any((s == release) if exact else _pocket_of(s, release) for s in source.suites):
                return source
    names = ', '.join(sorted({s for src in usable for s in src.suites})) or 'none'
    raise NoMirrorError(
        f'no enabled apt source with suite {release} (or {release}-updates/-backports) and '
        f'component main; usable suites found: {names}. Add one to /etc/apt/sources.list.d, '
        'or set EDGE_LLM_DMABUF_VM_MIRROR to a Debian archive URL')


def keyring_for(source: Optional[Source]) -> str:
    """Return a keyring file for the private config: the source's own, else Debian's."""
    signed_by = source.signed_by if source else ''
    if signed_by.startswith('/') and '\n' not in signed_by:
        return signed_by.split(',')[0].split()[0]
    return FALLBACK_KEYRING if os.path.exists(FALLBACK_KEYRING) else ''


def sources_list(uri: str, suites: Sequence[str], keyring: str) -> str:
    """Return one-line entries for `suites` on `uri` (main component only)."""
    opts = f'[signed-by={keyring}] ' if keyring else ''
    return ''.join(f'deb {opts}{uri} {suite} main\n' for suite in suites)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--suites', nargs='+', required=True,
                   help='suites the private config needs; the first names the release')
    p.add_argument('--mirror', default=os.environ.get('EDGE_LLM_DMABUF_VM_MIRROR', ''),
                   help='use this archive URL instead of the configured one')
    p.add_argument('--sources-list', help='default: apt-config Dir::Etc::SourceList')
    p.add_argument('--sources-parts', help='default: apt-config Dir::Etc::SourceParts')
    args = p.parse_args(argv)
    source = None
    uri = args.mirror
    if not uri:
        default_list, default_parts = apt_paths()
        found = read_sources(args.sources_list or default_list,
                             args.sources_parts or default_parts)
        release = args.suites[0].split('-')[0]
        try:
            source = pick_mirror(found, release)
        except NoMirrorError as exc:
            print(f'apt_sources: {exc}', file=sys.stderr)
            return NO_SOURCE
        uri = next(u for u in source.uris if not u.startswith('cdrom:'))
        print(f'apt_sources: using {uri} from {source.origin}', file=sys.stderr)
    sys.stdout.write(sources_list(uri, args.suites, keyring_for(source)))
    return 0


if __name__ == '__main__':
    sys.exit(main())
