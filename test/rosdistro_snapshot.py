"""The rosdistro snapshot the tests read (test/data/rosdistro) and package.xml reading.

test/data/rosdistro keeps, of one rosdistro commit (its COMMIT file), only the rosdep rules and
released packages named in its keys.txt: the package.xml dependency keys and the modules
edge_llm_ros/ and launch/ imported when scripts/refresh_test_data.py last wrote it. Any other
key is simply absent, so a test about a key first asks require_keys, which says to refresh.
"""
import functools
import importlib.util
import pathlib
from types import ModuleType
from typing import FrozenSet, Iterable, List, Tuple
import xml.etree.ElementTree as ET

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
ROSDISTRO = ROOT / 'test' / 'data' / 'rosdistro'
PACKAGE_XMLS = (ROOT / 'package.xml', ROOT / 'edge_llm_msgs' / 'package.xml')
_NEEDED = ('COMMIT', 'keys.txt', 'rosdep/base.yaml', 'rosdep/python.yaml',
           'humble/distribution.yaml', 'jazzy/distribution.yaml')
REFRESH = ('python3 scripts/refresh_test_data.py rosdistro PATH (PATH: a clone of '
           'the ros/rosdistro repository; test/data/README.md)')


@functools.lru_cache(maxsize=None)
def refresh_script() -> ModuleType:
    """Return scripts/refresh_test_data.py as a module (what it trims by, the tests check)."""
    spec = importlib.util.spec_from_file_location('refresh_test_data',
                                                  ROOT / 'scripts' / 'refresh_test_data.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def require_rosdistro() -> pathlib.Path:
    """Give the snapshot's folder; fail the test (never skip) when it is not there."""
    missing = [name for name in _NEEDED if not (ROSDISTRO / name).is_file()]
    if missing:
        pytest.fail(f'{ROSDISTRO} lacks {", ".join(missing)}: the repository keeps this '
                    f'rosdistro snapshot; restore it (git checkout) or write it: {REFRESH}')
    return ROSDISTRO


@functools.lru_cache(maxsize=None)
def snapshot_keys() -> FrozenSet[str]:
    """Return the keys test/data/rosdistro was trimmed to (keys.txt)."""
    text = (require_rosdistro() / 'keys.txt').read_text()
    return frozenset(line.strip() for line in text.splitlines()
                     if line.strip() and not line.startswith('#'))


def require_keys(keys: Iterable[str]) -> None:
    """Fail, saying to refresh the snapshot, when it was not trimmed with all these keys."""
    missing = sorted(set(keys) - snapshot_keys())
    if missing:
        pytest.fail(f'test/data/rosdistro holds only the rosdep rules and ROS packages of the '
                    f'keys in its keys.txt, and {missing} are new (a new dependency or import):'
                    f' refresh it: {REFRESH}')


@functools.lru_cache(maxsize=None)
def distribution_packages(distro: str) -> FrozenSet[str]:
    """Names of the packages a ROS distribution releases (its distribution.yaml)."""
    loader = getattr(yaml, 'CSafeLoader', yaml.SafeLoader)
    data = yaml.load((require_rosdistro() / distro / 'distribution.yaml').read_text(), loader)
    names = set()
    for repo_name, repo in data['repositories'].items():
        release = repo.get('release')
        if release:
            names.update(release.get('packages', [repo_name]))
    return frozenset(names)


def dependencies(xml_path: pathlib.Path) -> List[Tuple[str, str]]:
    """(tag, key) for every dependency tag: depend, exec_depend, build_depend, test_depend..."""
    root = ET.parse(xml_path).getroot()
    return [(child.tag, (child.text or '').strip()) for child in root
            if child.tag == 'depend' or
            (child.tag.endswith('_depend') and child.tag != 'group_depend')]


def package_name(xml_path: pathlib.Path) -> str:
    return ET.parse(xml_path).getroot().findtext('name').strip()
