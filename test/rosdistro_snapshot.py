"""The rosdistro snapshot beside the checkout (../shared/rosdistro) and package.xml reading."""
import functools
import pathlib
from typing import FrozenSet, List, Tuple
import xml.etree.ElementTree as ET

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A required input (CI copies shared/ beside the fresh clone): its absence is a failure.
ROSDISTRO = ROOT.parent / 'shared' / 'rosdistro'
PACKAGE_XMLS = (ROOT / 'package.xml', ROOT / 'edge_llm_msgs' / 'package.xml')
_NEEDED = ('rosdep/base.yaml', 'rosdep/python.yaml', 'humble/distribution.yaml',
           'jazzy/distribution.yaml')


def require_rosdistro() -> pathlib.Path:
    """Give the snapshot's folder; fail the test (never skip) when it is not there."""
    missing = [name for name in _NEEDED if not (ROSDISTRO / name).is_file()]
    if missing:
        pytest.fail(f'{ROSDISTRO} lacks {", ".join(missing)}: this test needs the rosdistro '
                    'snapshot beside the checkout (../shared/rosdistro, see '
                    'shared/ENVIRONMENT.md); copy shared/ next to the repository')
    return ROSDISTRO.resolve()


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
