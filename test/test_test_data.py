"""The data the rosdistro and rclpy API tests read lives in the repository (test/data).

- A copy of the checkout in a fresh temporary folder, with nothing beside it (no ../shared),
  passes the tests that read that data.
- scripts/refresh_test_data.py is a fixpoint on the committed data: trimming
  test/data/rosdistro again for this repository's keys changes nothing (a new dependency or
  import fails here, saying to refresh from a rosdistro checkout), and the rclpy extractor
  gives back each committed JSON from a source tree that has exactly its API.
- The extractor's rules on real syntax, the trimming on a small rosdistro, and the
  README naming the commits the data was taken at.
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys
from types import ModuleType
from typing import Dict, List, Tuple

import pytest
from rosdistro_snapshot import refresh_script, require_keys, ROOT
import yaml

DATA = ROOT / 'test' / 'data'
# The tests that read test/data/rosdistro and test/data/rclpy_api (one pytest run: about
# 17 s on 2 cores, mostly rosdep's subprocesses and the rclpy walks; two concurrent runs
# were slower there).
DATA_TESTS = ('test/test_rosdep.py', 'test/test_interfaces_humble.py', 'test/test_humble_api.py',
              'test/test_rclpy_internals.py')


@pytest.fixture(scope='module')
def refresh() -> ModuleType:
    return refresh_script()


# ---- a clone with nothing beside it ----------------------------------------------------------
def _checkout_files() -> List[str]:
    """Files a clone would have, with this checkout's uncommitted work (tracked or new)."""
    proc = subprocess.run(['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'],
                          cwd=ROOT, capture_output=True, timeout=60, check=True)
    return sorted({name for name in proc.stdout.decode().split('\0') if name})


def _copy_checkout(target: pathlib.Path) -> None:
    for name in _checkout_files():
        source = ROOT / name
        if not os.path.lexists(source):   # deleted in the work tree, not yet committed
            continue
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target / name, follow_symlinks=False)


def test_a_clone_with_nothing_beside_it_passes_the_data_tests(tmp_path):
    # A copy of what `git ls-files` lists rather than a `git clone`: a clone holds only the
    # commits, and this must hold for the work tree under test (test/data before it is
    # committed too). What a clone has beside that (.git) no test reads.
    clone = tmp_path / 'edge_llm_ros'
    _copy_checkout(clone)
    assert sorted(path.name for path in tmp_path.iterdir()) == ['edge_llm_ros']
    env = {key: value for key, value in os.environ.items()
           if key not in ('ROS_HOME', 'ROS_LOG_DIR', 'PYTHONPATH')}   # the clone's own
    # `python -m` puts the working folder first on sys.path: the clone's package, not the
    # checkout's that the venv's editable install points at.
    where = subprocess.run([sys.executable, '-c', 'import edge_llm_ros; print(edge_llm_ros.'
                            '__file__)'], cwd=clone, env=env, capture_output=True, text=True,
                           timeout=60)
    assert where.stdout.strip() == str(clone / 'edge_llm_ros' / '__init__.py'), where
    run = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
                          *DATA_TESTS], cwd=clone, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=900)
    assert run.returncode == 0, (f'{" ".join(DATA_TESTS)} in a clone with nothing beside it '
                                 f'(exit {run.returncode}):\n{run.stdout[-8000:]}')
    summary = run.stdout.strip().splitlines()[-1]
    assert ' passed' in summary and 'skipped' not in summary, summary   # each one really ran


# ---- refresh_test_data.py: fixpoint on the committed data ------------------------------------
def test_rosdistro_refresh_of_the_committed_data_changes_nothing(refresh, capsys):
    rosdistro = DATA / 'rosdistro'
    code = refresh.main(['rosdistro', str(rosdistro), '--check', '--out', str(rosdistro)])
    out, err = capsys.readouterr()
    assert code == 0, (
        'test/data/rosdistro is not what scripts/refresh_test_data.py makes of it for this '
        f'repository (keys.txt: package.xml dependencies and imports):\n{err}{out}\nrefresh '
        'it: python3 scripts/refresh_test_data.py rosdistro PATH/TO/rosdistro (a clone of '
        'the ros/rosdistro repository; test/data/rosdistro itself when keys only went)')


def _module_path(module: str, modules: List[str]) -> str:
    parts = module.split('.')
    if any(other.startswith(module + '.') for other in modules):
        return '/'.join(parts) + '/__init__.py'
    return '/'.join(parts) + '.py'


def render_api(modules: Dict[str, dict]) -> Dict[str, str]:
    """Return {path: source} of a package whose API is exactly `modules` (an extract's)."""
    sources = {}
    for module, entry in modules.items():
        lines = [f'from _ import {name}' for name in entry['names']]   # also '*'
        lines += [f'def {name}():\n    pass' for name in entry['functions']]
        for name, info in entry['classes'].items():
            body = [f'    def {member}(self):\n        pass' for member in info['members']]
            lines.append(f'class {name}({", ".join(info["bases"])}):\n' +
                         ('\n'.join(body) or '    pass'))
        sources[_module_path(module, list(modules))] = '\n\n'.join(lines) + '\n'
    return sources


def _write_tree(root: pathlib.Path, sources: Dict[str, str]) -> None:
    for name, text in sources.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.mark.parametrize('branch', ['humble', 'jazzy'])
def test_rclpy_extract_gives_back_the_committed_json(refresh, tmp_path, capsys, branch):
    committed = DATA / 'rclpy_api' / f'{branch}.json'
    data = json.loads(committed.read_text())
    assert data['branch'] == branch and len(data['modules']) > 40
    _write_tree(tmp_path / 'rclpy', render_api(data['modules']))
    code = refresh.main(['rclpy', str(tmp_path / 'rclpy'), branch, '--commit', data['commit'],
                         '--check', '--out', str(committed.parent)])
    out, err = capsys.readouterr()
    assert code == 0, f'{committed} is not what the extractor writes:\n{err}{out}'


# ---- the extractor on real syntax ------------------------------------------------------------
SYNTHETIC = {
    'rclpy/__init__.py': """'Doc.'
from typing import TYPE_CHECKING
from rclpy.utilities import shutdown as _shutdown
import builtin_interfaces.msg
if TYPE_CHECKING:
    from rclpy.node import Node
__executor = None
Alias: 'TypeAlias' = int


def init(*, args=None):
    'Doc.'


async def spin_async():
    pass
""",
    'rclpy/node.py': """from collections import namedtuple


class Node(object):
    PARAM_REL_TOL = 1e-6
    label: str

    class Inner:
        pass

    if True:
        hidden = 1

    def __init__(self):
        self.attribute = 1

    @property
    def handle(self):
        return 1

    @handle.setter
    def handle(self, value):
        pass

    async def spin(self):
        pass


class CallerId(namedtuple('CallerId', ['function_name', 'file_path'])):
    pass


def create_node():
    def nested():
        pass
""",
    'rclpy/impl/__init__.py': '',
    'rclpy/impl/rcutils_logger.py': 'supported_filters = {}\nsupported_filters["once"] = 1\n'
                                    'a = b = 2\n',
}
SYNTHETIC_API = {
    'rclpy': {'classes': {}, 'functions': ['init', 'spin_async'],
              'names': ['TYPE_CHECKING', '_shutdown', 'builtin_interfaces', '__executor']},
    'rclpy.impl': {'classes': {}, 'functions': [], 'names': []},
    'rclpy.impl.rcutils_logger': {'classes': {}, 'functions': [],
                                  'names': ['supported_filters', 'a', 'b']},
    'rclpy.node': {
        'classes': {
            'CallerId': {'bases': ["namedtuple('CallerId', ['function_name', 'file_path'])"],
                         'members': []},
            'Node': {'bases': ['object'],
                     'members': ['PARAM_REL_TOL', '__init__', 'handle', 'handle', 'label',
                                 'spin']}},
        'functions': ['create_node'], 'names': ['namedtuple']},
}


def test_extractor_rules_on_a_source_folder(refresh, tmp_path):
    _write_tree(tmp_path / 'src' / 'rclpy', SYNTHETIC)   # a checkout: rclpy/rclpy/...
    commit = '0123456789abcdef' * 2 + '01234567'
    assert refresh.main(['rclpy', str(tmp_path / 'src'), 'humble', '--commit', commit,
                         '--out', str(tmp_path / 'out')]) == 0
    text = (tmp_path / 'out' / 'humble.json').read_text()
    assert json.loads(text) == {'branch': 'humble', 'commit': commit, 'modules': SYNTHETIC_API}
    # The committed files' layout: keys sorted, one space of indent, no final newline.
    assert text == json.dumps(json.loads(text), indent=1, sort_keys=True)


def _git(repo: pathlib.Path, *args: str) -> str:
    return subprocess.run(['git', '-c', 'user.name=t', '-c', 'user.email=t@example.com',
                           '-c', 'init.defaultBranch=humble', *args], cwd=repo, check=True,
                          capture_output=True, text=True, timeout=60).stdout.strip()


def test_extractor_reads_a_commit_of_a_git_repository(refresh, tmp_path):
    repo = tmp_path / 'rclpy_repo'
    _write_tree(repo / 'rclpy', SYNTHETIC)
    (repo / 'rclpy' / 'rclpy' / 'notes.txt').write_text('not python\n')
    _git(repo, 'init', '-q')
    _git(repo, 'add', '.')
    _git(repo, 'commit', '-q', '-m', 'synthetic rclpy')
    first = _git(repo, 'rev-parse', 'HEAD')
    # A later commit in the work tree, and an uncommitted edit: the commit asked for counts.
    (repo / 'rclpy' / 'rclpy' / 'later.py').write_text('def later():\n    pass\n')
    _git(repo, 'add', '.')
    _git(repo, 'commit', '-q', '-m', 'later')
    (repo / 'rclpy' / 'rclpy' / 'node.py').write_text('')
    out = tmp_path / 'out'
    assert refresh.main(['rclpy', str(repo), 'humble', '--commit', first[:12],
                         '--out', str(out)]) == 0
    assert json.loads((out / 'humble.json').read_text()) == {
        'branch': 'humble', 'commit': first, 'modules': SYNTHETIC_API}
    assert refresh.main(['rclpy', str(repo), 'humble', '--out', str(out)]) == 0   # the branch
    latest = json.loads((out / 'humble.json').read_text())
    assert latest['commit'] == _git(repo, 'rev-parse', 'HEAD')
    assert latest['modules']['rclpy.later']['functions'] == ['later']


def test_refresh_usage_errors(refresh, tmp_path, capsys):
    _write_tree(tmp_path / 'rclpy', SYNTHETIC)
    cases: List[Tuple[List[str], str]] = [
        (['rclpy', str(tmp_path / 'rclpy'), 'humble'], 'give the full 40-digit commit'),
        (['rclpy', str(tmp_path / 'rclpy'), 'humble', '--commit', 'abc'], '40-digit'),
        (['rclpy', str(tmp_path / 'rclpy' / 'rclpy' / 'impl'), 'humble', '--commit', '0' * 40],
         'no rclpy package'),
        (['rclpy', str(tmp_path / 'missing'), 'humble'], 'is not a folder'),
        (['rosdistro', str(tmp_path)], 'is not a rosdistro checkout'),
    ]
    for argv, message in cases:
        assert refresh.main([*argv, '--out', str(tmp_path / 'out')]) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert not (tmp_path / 'out').exists()
    with pytest.raises(SystemExit):
        refresh.main(['rclpy'])   # argparse: the missing arguments named, exit 2
    assert 'required' in capsys.readouterr().err


# ---- the rosdistro trimming ------------------------------------------------------------------
def _distribution(packages: Dict[str, dict]) -> dict:
    return {'type': 'distribution', 'version': 2, 'tags': ['x'],
            'release_platforms': {'ubuntu': ['jammy']}, 'repositories': packages}


def _release(*packages: str) -> dict:
    release = {'tags': {'release': 'release/humble/{package}/{version}'},
               'url': 'https://github.com/ros2-gbp/x-release.git', 'version': '1.0.0-1'}
    if packages:
        release['packages'] = list(packages)
    return {'doc': {'type': 'git', 'url': 'https://github.com/ros2/x.git', 'version': 'h'},
            'release': release, 'source': {'type': 'git', 'url': 'u', 'version': 'h'},
            'status': 'maintained'}


def test_rosdistro_trim_keeps_the_keys_packages_and_rules(refresh, tmp_path):
    from rosdistro.distribution_file import DistributionFile
    source = tmp_path / 'rosdistro'
    rules = {'python3-numpy': {'ubuntu': ['python3-numpy']}, 'unused': {'ubuntu': ['u']}}
    distribution = _distribution({
        'common_interfaces': _release('std_msgs', 'sensor_msgs', 'geometry_msgs'),
        'rclpy': _release(),                  # one package, named as its repository
        'unused_repo': _release('unused'),
        'source_only': {'source': {'type': 'git', 'url': 'u', 'version': 'h'}}})
    for name, data in (('rosdep/base.yaml', rules), ('rosdep/python.yaml', {}),
                       ('humble/distribution.yaml', distribution),
                       ('jazzy/distribution.yaml', distribution)):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text(yaml.safe_dump(data))
    (source / 'COMMIT').write_text('abc Sat Aug 22 10:22:07 2026 -0700\n(a note)\n')
    keys = frozenset({'python3-numpy', 'std_msgs', 'sensor_msgs', 'rclpy', 'numpy'})
    files = refresh.rosdistro_files(source, keys)
    assert files['COMMIT'] == 'abc Sat Aug 22 10:22:07 2026 -0700\n(a note)\n'
    assert yaml.safe_load(files['rosdep/base.yaml']) == {'python3-numpy': rules['python3-numpy']}
    assert yaml.safe_load(files['rosdep/python.yaml']) == {}
    trimmed = yaml.safe_load(files['humble/distribution.yaml'])
    assert set(trimmed['repositories']) == {'common_interfaces', 'rclpy'}
    assert trimmed['repositories']['rclpy'] == {'release': _release()['release']}
    # What rosdep reads, through rosdistro's own parser: the kept packages and platforms.
    parsed = DistributionFile('humble', trimmed)
    assert set(parsed.release_packages) == {'std_msgs', 'sensor_msgs', 'rclpy'}
    assert parsed.release_platforms == {'ubuntu': ['jammy']}
    assert refresh.parse_keys(files['keys.txt']) == keys
    # The trimmed copy is a source again, but only for the keys it was trimmed to.
    refresh.write(tmp_path / 'trimmed', files)
    assert refresh.rosdistro_files(tmp_path / 'trimmed', keys) == files
    with pytest.raises(refresh.UsageError, match='full rosdistro checkout'):
        refresh.rosdistro_files(tmp_path / 'trimmed', keys | {'tf2_ros'})
    # A git checkout (no COMMIT file): its HEAD and date are recorded.
    (source / 'COMMIT').unlink()
    with pytest.raises(refresh.UsageError, match='neither a git checkout'):
        refresh.rosdistro_commit(source)
    _git(source, 'init', '-q')
    _git(source, 'add', '.')
    _git(source, 'commit', '-q', '-m', 'rosdistro')
    head = _git(source, 'log', '-1', '--format=%H %cd')
    assert refresh.rosdistro_files(source, keys)['COMMIT'] == head + '\n'


def test_a_key_missing_from_the_snapshot_says_to_refresh():
    require_keys(['rclpy', 'python3-numpy'])
    with pytest.raises(pytest.fail.Exception, match='refresh_test_data.py rosdistro'):
        require_keys(['rclpy', 'tf2_ros'])


def test_readme_names_the_commits_the_data_was_taken_at():
    readme = (DATA / 'README.md').read_text()
    commits = [(DATA / 'rosdistro' / 'COMMIT').read_text().split()[0]]
    commits += [json.loads(path.read_text())['commit']
                for path in sorted((DATA / 'rclpy_api').glob('*.json'))]
    assert len(commits) == 3
    missing = [commit for commit in commits if commit not in readme]
    assert not missing, f'test/data/README.md does not name the data commits {missing}'
