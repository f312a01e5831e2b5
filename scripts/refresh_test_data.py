#!/usr/bin/env python3
"""Regenerate test/data/rosdistro and test/data/rclpy_api from their upstream sources.

test/test_rosdep.py, test/test_interfaces_humble.py, test/test_humble_api.py and
test/test_rclpy_internals.py read these files; the repository keeps only the parts they read
(test/data/README.md says where and when each was taken).

  rosdistro SOURCE   SOURCE is a checkout of the ros/rosdistro repository (a git work tree: its
                     HEAD is recorded) or a snapshot folder with a COMMIT file (copied). Only
                     the rules of rosdep/base.yaml and rosdep/python.yaml, and the released
                     packages of humble/ and jazzy/distribution.yaml, whose names are keys this
                     repository uses (package.xml dependencies, modules edge_llm_ros/ and
                     launch/ import) are kept; keys.txt lists those keys.
  rclpy SOURCE BRANCH
                     SOURCE is a git repository of ros2/rclpy (then --commit is a
                     commit, tag or branch of it, default BRANCH) or a source folder (then
                     --commit, the commit it was taken at, is required). Writes
                     rclpy_api/BRANCH.json: every module of the rclpy package with its classes
                     (bases and members), functions and other top-level names.

With --check (after the command) nothing is written: the exit status is 1 when a file would
change. For instance, with the project venv (it has PyYAML):

  .venv/bin/python scripts/refresh_test_data.py rosdistro ~/src/rosdistro
  .venv/bin/python scripts/refresh_test_data.py rclpy ~/src/rclpy humble --commit b488272b1ba8
"""
import argparse
import ast
import difflib
import io
import json
import pathlib
import re
import subprocess
import sys
import tarfile
from typing import Dict, FrozenSet, Iterable, List, Optional, Set
import xml.etree.ElementTree as ET

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / 'test' / 'data'
DISTROS = ('humble', 'jazzy')
RULE_FILES = ('rosdep/base.yaml', 'rosdep/python.yaml')
KEYS_FILE = 'keys.txt'
COMMIT_FILE = 'COMMIT'
KEYS_HEADER = ('# The keys test/data/rosdistro was trimmed to (scripts/refresh_test_data.py):\n'
               '# package.xml dependencies and modules edge_llm_ros/ and launch/ import.\n')


class UsageError(Exception):
    """A bad argument or input: printed as `refresh_test_data: error: ...`, exit 2."""


# ---- the keys this repository uses -----------------------------------------------------------
def package_xmls(root: pathlib.Path) -> List[pathlib.Path]:
    """Return the package.xml of the repository and of the packages one folder down."""
    return sorted([*root.glob('package.xml'), *root.glob('*/package.xml')])


def dependency_keys(xml_path: pathlib.Path) -> Set[str]:
    """Return the keys of every dependency tag (depend, exec_depend, test_depend, ...)."""
    root = ET.parse(xml_path).getroot()
    return {(child.text or '').strip() for child in root
            if child.tag == 'depend' or
            (child.tag.endswith('_depend') and child.tag != 'group_depend')}


def imported_modules(root: pathlib.Path) -> Set[str]:
    """Return the top-level modules edge_llm_ros/ and launch/ import, less the stdlib's."""
    modules = set()
    for path in [*(root / 'edge_llm_ros').rglob('*.py'), *(root / 'launch').rglob('*.py')]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split('.')[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split('.')[0])
    return modules - set(sys.stdlib_module_names) - {'edge_llm_ros'}


def used_keys(root: pathlib.Path) -> FrozenSet[str]:
    """Return every name the tests look up in rosdistro: dependency keys and imports."""
    xmls = package_xmls(root)
    if not xmls:
        raise UsageError(f'{root} has no package.xml: --repo must be the repository root')
    keys = set().union(*(dependency_keys(path) for path in xmls)) | imported_modules(root)
    return frozenset(key for key in keys if key)


# ---- rosdistro -------------------------------------------------------------------------------
def load_yaml(path: pathlib.Path) -> dict:
    loader = getattr(yaml, 'CSafeLoader', yaml.SafeLoader)
    try:
        data = yaml.load(path.read_text(), loader)
    except (OSError, yaml.YAMLError) as error:
        raise UsageError(f'cannot read {path}: {error}') from error
    if not isinstance(data, dict):
        raise UsageError(f'{path}: expected a mapping at the top')
    return data


def dump_yaml(data: dict) -> str:
    return yaml.safe_dump(data, default_flow_style=False, sort_keys=True, width=99)


def trim_rules(rules: dict, keys: FrozenSet[str]) -> dict:
    """Return the rosdep rules (rosdep/*.yaml) of the keys."""
    return {key: rule for key, rule in rules.items() if key in keys}


def trim_distribution(data: dict, keys: FrozenSet[str]) -> dict:
    """Return what rosdep and the tests read of a distribution.yaml, for the keys' packages.

    rosdistro's parser wants `type`, `version` and each release's `url` (and `tags` when it
    has a `version`); rosdep makes one rule per released package for each of
    `release_platforms`. Doc, source and status entries are dropped.
    """
    repositories = {}
    for name, repo in (data.get('repositories') or {}).items():
        release = (repo or {}).get('release')
        if not release:
            continue
        packages = release.get('packages', [name])
        kept = [package for package in packages if package in keys]
        if not kept:
            continue
        release = {field: value for field, value in release.items()
                   if field in ('packages', 'tags', 'url', 'version', 'type')}
        if 'packages' in release:
            release['packages'] = kept
        repositories[name] = {'release': release}
    return {'release_platforms': data.get('release_platforms'), 'repositories': repositories,
            'type': data.get('type'), 'version': data.get('version')}


def git_output(source: pathlib.Path, *args: str) -> bytes:
    """Run git in `source` (a work tree or a bare repository) and return its stdout."""
    try:
        proc = subprocess.run(['git', '-C', str(source), *args], capture_output=True,
                              check=False, timeout=300)
    except FileNotFoundError as error:
        raise UsageError('git is not installed') from error
    if proc.returncode != 0:
        raise UsageError(f'git {" ".join(args)} in {source} failed: '
                         f'{proc.stderr.decode(errors="replace").strip()}')
    return proc.stdout


def git(source: pathlib.Path, *args: str) -> str:
    return git_output(source, *args).decode()


def is_git(source: pathlib.Path) -> bool:
    """Say whether `source` is the top of a git work tree, or a bare repository."""
    try:
        git_output(source, 'rev-parse', '--git-dir')
    except UsageError:
        return False
    try:   # inside another repository's work tree (test/data/rosdistro) does not count
        top = git(source, 'rev-parse', '--show-toplevel').strip()
    except UsageError:
        return (source / 'HEAD').is_file()   # a bare repository
    return pathlib.Path(top).resolve() == source.resolve()


def rosdistro_commit(source: pathlib.Path) -> str:
    """Return the COMMIT text: a snapshot's own file, or the checkout's HEAD and its date."""
    if (source / COMMIT_FILE).is_file():
        return (source / COMMIT_FILE).read_text()
    if is_git(source):
        line = git(source, 'log', '-1', '--format=%H %cd').strip()
        dirty = git(source, 'status', '--porcelain', '--untracked-files=no').strip()
        note = '(with uncommitted changes)\n' if dirty else ''
        return f'{line}\n{note}'
    raise UsageError(f'{source} is neither a git checkout nor a snapshot with a COMMIT file: '
                     'say which rosdistro commit it is (write it to COMMIT)')


def rosdistro_files(source: pathlib.Path, keys: FrozenSet[str]) -> Dict[str, str]:
    """Return {relative path: text} of the trimmed rosdistro data."""
    needed = [*RULE_FILES, *(f'{distro}/distribution.yaml' for distro in DISTROS)]
    missing = [name for name in needed if not (source / name).is_file()]
    if missing:
        raise UsageError(f'{source} is not a rosdistro checkout: it lacks {", ".join(missing)}')
    if (source / KEYS_FILE).is_file():   # a trimmed copy (test/data/rosdistro) as the source
        had = read_keys(source / KEYS_FILE)
        if not keys <= had:
            raise UsageError(f'{source} is a trimmed copy (it has {KEYS_FILE}) without '
                             f'{", ".join(sorted(keys - had))}: refresh from a full rosdistro '
                             'checkout (a clone of the ros/rosdistro repository)')
    files = {COMMIT_FILE: rosdistro_commit(source),
             KEYS_FILE: KEYS_HEADER + ''.join(f'{key}\n' for key in sorted(keys))}
    for name in RULE_FILES:
        files[name] = dump_yaml(trim_rules(load_yaml(source / name), keys))
    for distro in DISTROS:
        name = f'{distro}/distribution.yaml'
        files[name] = dump_yaml(trim_distribution(load_yaml(source / name), keys))
    return files


def parse_keys(text: str) -> FrozenSet[str]:
    """Return the keys of a keys.txt's text (one a line, # comments)."""
    return frozenset(line.strip() for line in text.splitlines()
                     if line.strip() and not line.startswith('#'))


def read_keys(path: pathlib.Path) -> FrozenSet[str]:
    return parse_keys(path.read_text())


# ---- rclpy -----------------------------------------------------------------------------------
def module_name(relative: pathlib.PurePath) -> str:
    """rclpy/action/client.py -> rclpy.action.client, rclpy/__init__.py -> rclpy."""
    parts = list(relative.with_suffix('').parts)
    if parts[-1] == '__init__':
        parts.pop()
    return '.'.join(parts)


def _assigned(node: ast.Assign) -> List[str]:
    return [target.id for target in node.targets if isinstance(target, ast.Name)]


def extract_class(node: ast.ClassDef) -> dict:
    """Return a class's bases (as written) and members: what its own body defines.

    Members are the functions (a property's getter and setter both count, so a name may
    repeat) and the names assigned or annotated in the body, sorted. Nested classes and
    what methods assign to self are not members.
    """
    members: List[str] = []
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members.append(item.name)
        elif isinstance(item, ast.Assign):
            members.extend(_assigned(item))
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members.append(item.target.id)
    return {'bases': [ast.unparse(base) for base in node.bases], 'members': sorted(members)}


def extract_module(source: str, filename: str) -> dict:
    """Return a module's top level: classes, functions, and names imported or assigned.

    Only statements at the top level count (not those under `if TYPE_CHECKING:` or
    `try:`); functions and names keep their source order, `import a.b` binds `a`, and
    annotated assignments (`X: 'TypeAlias' = ...`) are not names.
    """
    try:
        tree = ast.parse(source, filename)
    except SyntaxError as error:
        raise UsageError(f'{filename} does not parse: {error}') from error
    classes, functions, names = {}, [], []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            classes[node.name] = extract_class(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.append(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.extend(alias.asname or alias.name.split('.')[0] for alias in node.names)
        elif isinstance(node, ast.Assign):
            names.extend(_assigned(node))
    return {'classes': classes, 'functions': functions, 'names': names}


def extract_api(sources: Dict[str, str]) -> Dict[str, dict]:
    """Return {module: extract} for {path relative to the package's parent: source}."""
    return {module_name(pathlib.PurePosixPath(path)): extract_module(text, path)
            for path, text in sources.items()}


def api_json(branch: str, commit: str, modules: Dict[str, dict]) -> str:
    """Return the JSON text of rclpy_api/<branch>.json (keys sorted, indent 1, no newline)."""
    return json.dumps({'branch': branch, 'commit': commit, 'modules': modules},
                      indent=1, sort_keys=True)


def package_folder(source: pathlib.Path) -> pathlib.Path:
    """Find the rclpy package (the folder with __init__.py) in a source folder."""
    for candidate in (source / 'rclpy' / 'rclpy', source / 'rclpy', source):
        if candidate.name == 'rclpy' and (candidate / '__init__.py').is_file():
            return candidate
    raise UsageError(f'no rclpy package (rclpy/__init__.py) in {source}, {source}/rclpy or '
                     f'{source}/rclpy/rclpy')


def folder_sources(source: pathlib.Path) -> Dict[str, str]:
    """Return {rclpy/...py: source} of an rclpy source folder (or an installed rclpy)."""
    package = package_folder(source)
    return {path.relative_to(package.parent).as_posix(): path.read_text()
            for path in sorted(package.rglob('*.py'))}


def git_sources(source: pathlib.Path, commit: str) -> Dict[str, str]:
    """Return {rclpy/...py: source} of the rclpy package at a commit of a git repository."""
    archive = git_output(source, 'archive', '--format=tar', commit, '--', 'rclpy/rclpy')
    sources = {}
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith('.py'):
                relative = pathlib.PurePosixPath(member.name).relative_to('rclpy')
                sources[relative.as_posix()] = tar.extractfile(member).read().decode()
    if 'rclpy/__init__.py' not in sources:
        raise UsageError(f'{source} at {commit} has no rclpy/rclpy/__init__.py: not ros2/rclpy')
    return sources


def rclpy_files(source: pathlib.Path, branch: str, commit: Optional[str]) -> Dict[str, str]:
    """Return {rclpy_api/<branch>.json: text} from a git repository or a source folder."""
    if not re.fullmatch(r'[A-Za-z0-9_.-]+', branch):
        raise UsageError(f'branch {branch!r}: expected a name like humble or jazzy')
    if is_git(source):
        sha = git(source, 'rev-parse', '--verify', '--quiet',
                  f'{commit or branch}^{{commit}}').strip()
        sources = git_sources(source, sha)
    else:
        sources = folder_sources(source)
        if not commit or not re.fullmatch(r'[0-9a-f]{40}', commit):
            raise UsageError(f'{source} is a source folder, not a git repository: give the '
                             'full 40-digit commit it was taken at (--commit)')
        sha = commit
    return {f'{branch}.json': api_json(branch, sha, extract_api(sources))}


# ---- writing ---------------------------------------------------------------------------------
def changes(out: pathlib.Path, files: Dict[str, str]) -> List[str]:
    """Return a unified diff (a few lines per file) of what writing `files` would change."""
    lines = []
    for name, text in sorted(files.items()):
        path = out / name
        old = path.read_text() if path.is_file() else ''
        if old != text:
            diff = list(difflib.unified_diff(old.splitlines(), text.splitlines(),
                                             str(path), f'{path} (new)', lineterm='', n=1))
            lines += diff[:40] + ([f'... ({len(diff) - 40} more lines)'] if len(diff) > 40
                                  else [])
    return lines


def write(out: pathlib.Path, files: Dict[str, str]) -> None:
    for name, text in files.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def parse_args(argv: Optional[Iterable[str]]) -> argparse.Namespace:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument('--check', action='store_true',
                        help='write nothing; exit 1 (with a diff) when a file would change')
    parser = argparse.ArgumentParser(
        prog='refresh_test_data', description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog='test/data/README.md describes the data.')
    commands = parser.add_subparsers(dest='command', required=True)
    rosdistro = commands.add_parser('rosdistro', parents=[common],
                                    help='trim a rosdistro checkout')
    rosdistro.add_argument('source', type=pathlib.Path,
                           help='a ros/rosdistro checkout or snapshot folder')
    rosdistro.add_argument('--out', type=pathlib.Path, default=DATA / 'rosdistro',
                           help='where to write (default: test/data/rosdistro)')
    rosdistro.add_argument('--repo', type=pathlib.Path, default=ROOT,
                           help='the repository whose keys to keep (default: this one)')
    rclpy = commands.add_parser('rclpy', parents=[common],
                                help="extract rclpy's API at one commit")
    rclpy.add_argument('source', type=pathlib.Path,
                       help='a ros2/rclpy git repository, or a source folder of it')
    rclpy.add_argument('branch', help='the rclpy branch the commit is on (humble, jazzy)')
    rclpy.add_argument('--commit', help='the commit (git: default BRANCH; required for a '
                                        'folder: the full hash it was taken at)')
    rclpy.add_argument('--out', type=pathlib.Path, default=DATA / 'rclpy_api',
                       help='where to write (default: test/data/rclpy_api)')
    return parser.parse_args(argv)


def main(argv: Optional[Iterable[str]] = None) -> int:
    args = parse_args(argv)
    try:
        if not args.source.is_dir():
            raise UsageError(f'{args.source} is not a folder')
        if args.command == 'rosdistro':
            files = rosdistro_files(args.source, used_keys(args.repo))
        else:
            files = rclpy_files(args.source, args.branch, args.commit)
    except UsageError as error:
        print(f'refresh_test_data: error: {error}', file=sys.stderr)
        return 2
    diff = changes(args.out, files)
    if args.check:
        print('\n'.join(diff) if diff else f'{args.out}: up to date')
        return 1 if diff else 0
    write(args.out, files)
    print(f'{args.out}: {len(files)} file(s), {"changed" if diff else "unchanged"}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
