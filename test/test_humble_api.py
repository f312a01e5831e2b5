"""No rclpy API newer than Humble (JetPack 6) is used without a fallback that a test runs.

test/rclpy_api_checker.py walks the package's code with `ast` and checks every rclpy module,
class, function and member it uses against rclpy's humble branch, as extracted into
test/data/rclpy_api/humble.json (jazzy.json gives the types of what the code runs here).
scripts/refresh_test_data.py writes both from rclpy's source (test/data/README.md).
"""
import pathlib
import re
from typing import Dict, List, Set, Tuple

import pytest
from rclpy_api_checker import check, KNOWN_MEMBERS, PROPERTIES, RclpyApi, RETURNS

ROOT = pathlib.Path(__file__).resolve().parents[1]
API_DIR = ROOT / 'test' / 'data' / 'rclpy_api'


@pytest.fixture(scope='module')
def apis() -> Tuple[RclpyApi, RclpyApi]:
    missing = [name for name in ('humble.json', 'jazzy.json') if not (API_DIR / name).is_file()]
    if missing:
        pytest.fail(f'{API_DIR} lacks {", ".join(missing)}: the Humble API test needs the '
                    'rclpy API extracts the repository keeps: restore them (git checkout) or '
                    'write them with scripts/refresh_test_data.py rclpy (test/data/README.md)')
    return RclpyApi.load(API_DIR / 'jazzy.json'), RclpyApi.load(API_DIR / 'humble.json')


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix('').parts)
    if parts[-1] == '__init__':
        parts.pop()
    if parts[0] != 'edge_llm_ros':   # launch files, benchmarks and scripts are not importable
        return '<file>.' + '.'.join(parts).replace('.', '_')
    return '.'.join(parts)


def _package_sources() -> Dict[str, Tuple[str, str]]:
    files = [*(ROOT / 'edge_llm_ros').rglob('*.py'), *(ROOT / 'launch').rglob('*.py')]
    files += [path for folder in ('bench', 'scripts') for path in (ROOT / folder).rglob('*.py')
              if 'rclpy' in path.read_text()]
    return {_module_name(path): (str(path.relative_to(ROOT)), path.read_text())
            for path in files}


def _test_sources() -> List[str]:
    return [path.read_text() for path in sorted((ROOT / 'test').glob('*.py'))]


def test_package_uses_only_humble_api(apis):
    findings, _ = check(_package_sources(), _test_sources(), *apis)
    assert not findings, 'rclpy API that Humble lacks:\n' + '\n'.join(map(str, findings))


def test_checker_follows_the_package_rclpy_use(apis):
    # Not vacuous: the walk resolves imports, members through the package's LifecycleNode
    # subclass, and objects returned by rclpy calls.
    _, project = check(_package_sources(), [], *apis)
    owners = {(use.owner.kind, use.owner.name) for use in project.uses}
    assert ('import', '') in owners and ('module', 'rclpy.lifecycle') in owners
    assert ('instance', 'rclpy.publisher.Publisher') in owners   # from create_publisher
    through_bases = {use.attr for use in project.uses if use.owner.kind == 'pinstance' and
                     'rclpy.lifecycle.node.LifecycleNode' in project.class_chain(
                         use.owner.name)[1]}
    # Node's members (create_timer, get_logger) through LifecycleNode, and the mixin's own.
    assert {'create_timer', 'get_logger', 'trigger_configure'} <= through_bases


def test_tables_name_humble_api(apis):
    _, humble = apis
    for name in [*RETURNS, *PROPERTIES]:
        owner, _, attr = name.rpartition('.')
        assert humble.has_function(name) or (
            humble.has_class(owner) and humble.defining_class(owner, attr)[0]), name
    for name in [*RETURNS.values(), *PROPERTIES.values(), *KNOWN_MEMBERS]:
        assert humble.has_class(name), name


# ---- the checker itself ----------------------------------------------------------------------
JAZZY_ONLY = """
import rclpy
from rclpy.executors import Executor
from rclpy.node import Node
from rclpy.lifecycle import LifecycleNode
from rclpy.parameter_client import AsyncParameterClient  # jazzy
from rclpy.qos import DurabilityPolicy, QoSProfile, qos_profile_best_available  # jazzy
import rclpy.type_hash  # jazzy


class N(Node):
    def __init__(self):
        super().__init__('n')
        self.add_on_set_parameters_callback(print)
        self.add_post_set_parameters_callback(print)  # jazzy

    def count_services(self, name):  # jazzy
        return 0


class M(N):
    def run(self):
        self.count_clients('x')  # jazzy
        self.get_logger().warn('x')


class L(LifecycleNode):
    def on_configure(self, state):
        self.trigger_activate()
        self.wait_for_node('x', 1.0)  # jazzy
        return super().on_configure(state)


def main(node: Node, executor: Executor):
    getattr(executor, '_executor', None)  # MultiThreadedExecutor's, on Humble too
    made = rclpy.create_node('m')
    made.count_clients('x')  # jazzy
    made.create_subscription(int, 't', print, 1).get_publisher_count()  # jazzy
    made.get_clock().now().to_msg()
    node.get_fully_qualified_node_names()  # jazzy
    getattr(node, 'count_services')('x')  # jazzy
    profile = QoSProfile(depth=1, durability=DurabilityPolicy.BEST_AVAILABLE)  # jazzy
    profile.depth = 2
    rclpy.logging.get_logger_level('x')  # jazzy
"""

COMPAT = """
from rclpy.node import Node

HAS_POST_SET = hasattr(Node, 'add_post_set_parameters_callback')


def register(node: Node, apply, supported: bool = HAS_POST_SET):
    if supported:
        node.add_post_set_parameters_callback(apply)
        return
    node.add_on_set_parameters_callback(apply)


def register_early_return(node: Node, apply, supported: bool = HAS_POST_SET):
    if not supported:
        node.add_on_set_parameters_callback(apply)
        return
    node.add_post_set_parameters_callback(apply)


def wrong_branch(node: Node, apply, supported: bool = HAS_POST_SET):
    if supported:
        node.add_on_set_parameters_callback(apply)
    else:
        node.add_post_set_parameters_callback(apply)  # unguarded


def inline(node: Node):
    if hasattr(node, 'count_clients'):
        return node.count_clients('x')  # untested
    return getattr(node, 'count_services', lambda name: 0)('x')  # untested


def constant(node: Node, apply):
    if HAS_POST_SET:
        node.add_post_set_parameters_callback(apply)  # untested
"""

COMPAT_TEST = """
def test_humble(node):
    register(node, print, supported=False)
    compat.register_early_return(node, print, supported=False)
"""


def _marked_lines(source: str, marker: str) -> Set[int]:
    return {number for number, line in enumerate(source.splitlines(), 1)
            if re.search(rf'# {marker}\b', line)}


def test_checker_reports_jazzy_only_use(apis):
    findings, _ = check({'snippet': ('snippet.py', JAZZY_ONLY)}, [], *apis)
    assert {f.line for f in findings} == _marked_lines(JAZZY_ONLY, 'jazzy'), \
        '\n'.join(map(str, findings))
    whats = {f.what for f in findings}
    assert {'rclpy.parameter_client', 'rclpy.qos.qos_profile_best_available',
            'rclpy.node.Node.count_clients', 'rclpy.qos.DurabilityPolicy.BEST_AVAILABLE',
            'rclpy.subscription.Subscription.get_publisher_count',
            'rclpy.logging.get_logger_level'} <= whats, whats
    assert all('only in jazzy' in f.why or 'module not in' in f.why or 'overrides' in f.why
               for f in findings), '\n'.join(map(str, findings))


def test_checker_reports_what_neither_extract_lists(apis):
    source = 'from rclpy.node import Node\n\n\ndef f(node: Node):\n    node.get_nmae()\n'
    findings, _ = check({'typo': ('typo.py', source)}, [], *apis)
    assert [(f.line, f.what) for f in findings] == [(5, 'rclpy.node.Node.get_nmae')]
    assert 'KNOWN_MEMBERS' in findings[0].why


def test_checker_accepts_a_fallback_that_a_test_runs(apis):
    findings, _ = check({'compat': ('compat.py', COMPAT)}, [COMPAT_TEST], *apis)
    expected = _marked_lines(COMPAT, 'unguarded') | _marked_lines(COMPAT, 'untested')
    assert {f.line for f in findings} == expected, '\n'.join(map(str, findings))
    by_line = {f.line: f.why for f in findings}
    for line in _marked_lines(COMPAT, 'untested'):
        assert 'not run by any test' in by_line[line]


def test_checker_wants_the_fallback_run(apis):
    # The same guarded calls, but no test switches the guard off: each is reported.
    findings, _ = check({'compat': ('compat.py', COMPAT)}, [], *apis)
    guarded = [f for f in findings if 'not run by any test' in f.why]
    post_set_lines = {number for number, line in enumerate(COMPAT.splitlines(), 1)
                      if line.strip().startswith('node.add_post_set_parameters_callback')}
    assert post_set_lines - _marked_lines(COMPAT, 'unguarded') <= {f.line for f in guarded}


def test_checker_resolves_reexports_and_bases(apis):
    current, humble = apis
    assert humble.lookup('rclpy.action', 'ActionClient').name == \
        'rclpy.action.client.ActionClient'
    assert humble.defining_class('rclpy.lifecycle.node.LifecycleNode', 'create_timer') == \
        ('rclpy.node.Node', True)
    assert humble.defining_class('rclpy.lifecycle.node.LifecycleNode',
                                 'add_post_set_parameters_callback') == (None, True)
    assert current.defining_class('rclpy.lifecycle.node.LifecycleNode',
                                  'add_post_set_parameters_callback')[0] == 'rclpy.node.Node'
