"""The import contract between the layers of edge_llm_ros, checked on the source (ast).

Every import in a file counts, wherever it is (module level, inside a function, under
TYPE_CHECKING): `import a.b`, `from a import b`, relative `from . import b` / `from ..x import
y`, and `importlib.import_module('a.b')` / `__import__('a.b')` with a literal name (a name
computed at run time cannot be checked here; test/test_layers_node.py checks a running
llm_node instead).

Rules (RULES below, each with the fix its message names):

- runtime/ and serving/ never load the converter (edge_llm_ros.convert, gguf, onnx,
  safetensors; onnxruntime is fine) nor ROS (rclpy, launch, launch_ros, edge_llm_msgs, any
  *_msgs / *_interfaces package): not directly, and not through another edge_llm_ros module
  outside those two folders (the message names the chain).
- runtime/ (one sequence) never imports serving/ or nodes/, directly or through another
  module.
- convert/ never imports serving/ or nodes/ (it runs on a build machine).
- Outside convert/, nothing imports gguf, onnx or safetensors itself (a node that needs a
  graph written, like perception's stand-in encoder, calls the converter's module).
- Outside runtime/ and serving/, only the ROS-facing modules of RCLPY_ALLOWED import rclpy.
- model_format.py and errors.py (the contract every layer reads) import no edge_llm_ros
  module but errors.
"""
from __future__ import annotations

import ast
import collections
import dataclasses
import pathlib
import shutil
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = 'edge_llm_ros'

# Where rclpy may be imported (paths under edge_llm_ros/; a trailing '/' is a folder), and why.
RCLPY_ALLOWED: Dict[str, str] = {
    'nodes/': 'the ROS nodes themselves: everything that creates nodes, topics, services',
    'bt/': 'py_trees behaviours that drive an LLMClient beside their ROS node',
    'client.py': 'LLMClient, the rclpy action/service client of llm_node',
    'lifecycle_state.py': "waits for a lifecycle node's state over rclpy services",
    'qos.py': 'the QoS profiles shared by the nodes and their clients',
    'rclpy_compat.py': 'Humble/Jazzy fallbacks of the rclpy API',
    'rclpy_internals.py': 'the private rclpy members the package relies on, in one place',
    # Node entry points of the regression tooling: they record and replay live ROS traffic.
    'regression/live.py': 'rclpy helpers of record and replay: message classes, QoS matching',
    'regression/record.py': 'records a running llm_node (rclpy node subscribing its topics)',
    'regression/replay.py': 'replays a bag into a running llm_node (rclpy action client)',
    'regression/make_fixture.py': 'records the regression fixture from a real llm_node',
}
# Not listed on purpose: node_process.py starts nodes as child processes and waits through
# an LLMClient its caller owns, so importing it never loads rclpy (its docstring says so).

ROS_PACKAGES = {'rclpy', 'launch', 'launch_ros', 'launch_testing', 'edge_llm_msgs',
                'rosidl_runtime_py', 'rosbag2_py'}


def _under(module: str, *prefixes: str) -> bool:
    return any(module == p or module.startswith(p + '.') for p in prefixes)


def _converter(module: str) -> bool:
    # `onnx` is the converter's graph library; onnxruntime (another top-level name) is not.
    return _under(module, f'{PACKAGE}.convert', 'gguf', 'onnx', 'safetensors')


def _ros(module: str) -> bool:
    top = module.split('.')[0]
    return top in ROS_PACKAGES or top.endswith(('_msgs', '_interfaces'))


def _in(*folders: str) -> Callable[[str], bool]:
    return lambda rel: rel.startswith(tuple(f'{f}/' for f in folders))


def _rclpy_allowed(rel: str) -> bool:
    return any(rel.startswith(entry) if entry.endswith('/') else rel == entry
               for entry in RCLPY_ALLOWED)


@dataclasses.dataclass(frozen=True)
class Rule:
    """`applies(path under edge_llm_ros/)` files must not import a module `forbids(name)`."""

    name: str
    applies: Callable[[str], bool]
    forbids: Callable[[str], bool]
    fix: str
    # Also an import of an edge_llm_ros module outside this rule's files that leads there.
    through: bool = False


RULES = [
    Rule('no-converter-in-runtime', _in('runtime', 'serving'), _converter,
         'runtime/ and serving/ read converted model folders (edge_llm_ros.model_format, '
         'onnxruntime); gguf, onnx, safetensors and edge_llm_ros.convert are the offline '
         "converter's, in edge_llm_ros/convert/ only", through=True),
    Rule('no-ros-in-runtime', _in('runtime', 'serving'), _ros,
         'runtime/ and serving/ know no ROS: rclpy and ROS messages belong in '
         'edge_llm_ros/nodes/, which translates messages to and from runtime.types',
         through=True),
    Rule('runtime-below-serving', _in('runtime'),
         lambda m: _under(m, f'{PACKAGE}.serving', f'{PACKAGE}.nodes'),
         'runtime/ is the lower layer (one sequence): serving/ and nodes/ build on it, '
         'never the other way', through=True),
    Rule('convert-stands-alone', _in('convert'),
         lambda m: _under(m, f'{PACKAGE}.serving', f'{PACKAGE}.nodes'),
         'convert/ runs offline on a build machine: it may use model_format, errors and '
         'runtime, never serving/ or nodes/', through=True),
    Rule('converter-libraries-in-convert-only',
         lambda rel: not _in('convert', 'runtime', 'serving')(rel),
         lambda m: _converter(m) and not _under(m, f'{PACKAGE}.convert'),
         "gguf, onnx and safetensors are the converter's libraries: import them in "
         'edge_llm_ros/convert/ only (and call that module from here)'),
    Rule('rclpy-in-node-layer',
         lambda rel: not _rclpy_allowed(rel) and not _in('runtime', 'serving')(rel),
         lambda m: _under(m, 'rclpy'),
         'rclpy belongs in edge_llm_ros/nodes/ (node entry points) or one of the ROS-facing '
         'modules listed in RCLPY_ALLOWED (test/test_layers.py), each with its reason'),
    Rule('contract-imports-only-errors', lambda rel: rel in ('model_format.py', 'errors.py'),
         lambda m: _under(m, PACKAGE) and m != PACKAGE and not _under(m, f'{PACKAGE}.errors'),
         'model_format.py and errors.py are what every layer reads: they import no '
         'edge_llm_ros module but errors'),
]


@dataclasses.dataclass(frozen=True)
class Import:
    """One import statement (or import_module call): the module names it may load."""

    line: int
    names: Tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Violation:
    path: str          # relative to the folder holding edge_llm_ros/
    line: int
    module: str
    rule: Rule
    chain: Tuple[str, ...] = ()   # the edge_llm_ros modules through which `module` loads

    def __str__(self) -> str:
        via = f' (through {" -> ".join(self.chain)})' if self.chain else ''
        return f'{self.path}:{self.line}: imports {self.module}{via} [{self.rule.name}]: ' \
               f'{self.rule.fix}'


def _literal(node: Optional[ast.expr]) -> Optional[str]:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) \
        else None


def _relative(package: str, level: int, name: str) -> str:
    """Resolve `from <level dots><name>` inside `package` (ValueError above the top)."""
    parts = package.split('.')
    if level - 1 >= len(parts):
        raise ValueError(f'relative import beyond the top package from {package}')
    base = parts[:len(parts) - (level - 1)]
    return '.'.join(base + ([name] if name else []))


def imports_of(tree: ast.AST, package: str) -> Iterator[Import]:
    """Every import of a parsed module whose own package is `package`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield Import(node.lineno, tuple(alias.name for alias in node.names))
        elif isinstance(node, ast.ImportFrom):
            base = (_relative(package, node.level, node.module or '') if node.level
                    else node.module or '')
            # `from a import b` loads a, and a.b when b is a submodule.
            yield Import(node.lineno, (base, *(f'{base}.{a.name}' for a in node.names
                                               if a.name != '*')))
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else \
                func.id if isinstance(func, ast.Name) else ''
            name = _literal(node.args[0]) if node.args else None
            if called not in ('import_module', '__import__') or name is None:
                continue
            if name.startswith('.'):
                anchor = _literal(node.args[1]) if len(node.args) > 1 else None
                anchor = anchor or next((_literal(k.value) for k in node.keywords
                                         if k.arg == 'package'), None) or package
                level = len(name) - len(name.lstrip('.'))
                name = _relative(anchor, level, name.lstrip('.'))
            yield Import(node.lineno, (name,))


_PARSED: Dict[Tuple[str, str], List[Import]] = {}


def _parsed(path: pathlib.Path, package: str) -> List[Import]:
    """Return the imports of a file, cached by its text (a copy re-parses one file)."""
    text = path.read_text()
    key = (package, text)
    if key not in _PARSED:
        _PARSED[key] = list(imports_of(ast.parse(text, str(path)), package))
    return _PARSED[key]


class Tree:
    """The modules of one copy of edge_llm_ros/ and what each imports."""

    def __init__(self, package_dir: pathlib.Path) -> None:
        self.base = package_dir.parent
        self.files: Dict[str, pathlib.Path] = {}     # module name -> file
        self.imports: Dict[str, List[Import]] = {}
        for path in sorted(package_dir.rglob('*.py')):
            parts = list(path.relative_to(self.base).with_suffix('').parts)
            is_package = parts[-1] == '__init__'
            module = '.'.join(parts[:-1] if is_package else parts)
            own_package = module if is_package else module.rpartition('.')[0]
            self.files[module] = path
            self.imports[module] = _parsed(path, own_package)

    def rel(self, module: str) -> str:
        """Path of a module under edge_llm_ros/ ('runtime/decoder.py')."""
        return self.files[module].relative_to(self.base / PACKAGE).as_posix()

    def loaded(self, name: str) -> List[str]:
        """Return the package modules that importing `name` runs: its parents, itself."""
        parts = name.split('.')
        return [m for m in ('.'.join(parts[:i]) for i in range(1, len(parts) + 1))
                if m in self.files]

    def leads_to(self, start: str, rule: Rule) -> Optional[Tuple[Tuple[str, ...], str]]:
        """Return the chain of package modules from `start` to one `rule` forbids, and it.

        The walk stops at modules `rule` applies to: those are checked on their own.
        """
        queue = collections.deque([(start,)])
        seen: Set[str] = {start}
        while queue:
            chain = queue.popleft()
            for statement in self.imports[chain[-1]]:
                for name in statement.names:
                    if rule.forbids(name):
                        return chain, name
                    for module in self.loaded(name):
                        if module not in seen and not rule.applies(self.rel(module)):
                            seen.add(module)
                            queue.append(chain + (module,))
        return None

    def violations(self, rules: List[Rule] = RULES) -> List[Violation]:
        found: List[Violation] = []
        for module in self.files:
            rel = self.rel(module)
            path = f'{PACKAGE}/{rel}'
            for rule in (r for r in rules if r.applies(rel)):
                for statement in self.imports[module]:
                    hit = next((n for n in statement.names if rule.forbids(n)), None)
                    if hit is not None:
                        found.append(Violation(path, statement.line, hit, rule))
                        continue
                    if rule.through:
                        found.extend(self._through(path, statement, rule))
        return sorted(found, key=lambda v: (v.path, v.line, v.rule.name))

    def _through(self, path: str, statement: Import, rule: Rule) -> Iterator[Violation]:
        # In import order, each module once: the first chain found is the one reported.
        modules = dict.fromkeys(m for n in statement.names for m in self.loaded(n))
        for module in modules:
            if rule.applies(self.rel(module)):
                continue
            reached = self.leads_to(module, rule)
            if reached is not None:
                yield Violation(path, statement.line, reached[1], rule, reached[0])
                return


def test_the_package_keeps_its_import_contract():
    violations = Tree(ROOT / PACKAGE).violations()
    assert not violations, 'forbidden imports:\n' + '\n'.join(map(str, violations))


def test_every_rclpy_entry_is_needed():
    """A listed file that no longer imports rclpy is a loophole: take it off the list."""
    tree = Tree(ROOT / PACKAGE)
    by_rel = {tree.rel(m): m for m in tree.files}
    for entry in RCLPY_ALLOWED:
        if entry.endswith('/'):
            assert (ROOT / PACKAGE / entry).is_dir(), f'{entry} is listed but missing'
            continue
        assert entry in by_rel, f'{entry} is listed in RCLPY_ALLOWED but missing'
        names = [n for s in tree.imports[by_rel[entry]] for n in s.names]
        assert any(_under(n, 'rclpy') for n in names), \
            f'{entry} is in RCLPY_ALLOWED but imports no rclpy: remove it'


# --- the checker fails where it should ------------------------------------------------------

PROBE = 'bringup/_layers_probe.py'    # a module outside runtime/ that the probe case adds

# (file, lines appended to it, rule expected at the first appended line, or None: allowed)
INJECTED = [
    ('runtime/sampling.py', ['import gguf'], 'no-converter-in-runtime'),
    ('runtime/decoder.py', ['import onnx.helper'], 'no-converter-in-runtime'),
    ('runtime/decoder.py', ['import onnxruntime'], None),
    ('serving/engine.py', ['from onnx import numpy_helper'], 'no-converter-in-runtime'),
    ('serving/scheduler.py', ['def _late():', '    from safetensors import safe_open'],
     'no-converter-in-runtime'),
    ('runtime/kv_cache.py', ["importlib.import_module('gguf.constants')"],
     'no-converter-in-runtime'),
    ('runtime/tools/parser.py', ['from ...convert import converter'],
     'no-converter-in-runtime'),
    ('runtime/sampling.py', ['from edge_llm_ros.bringup import _layers_probe'],
     'no-converter-in-runtime'),
    ('serving/scheduler.py', ['import rclpy'], 'no-ros-in-runtime'),
    ('runtime/types.py', ['from edge_llm_msgs.msg import Transcript'], 'no-ros-in-runtime'),
    ('serving/worker.py', ['from std_msgs.msg import String'], 'no-ros-in-runtime'),
    ('serving/remote.py', ['from edge_llm_ros.client import LLMClient'], 'no-ros-in-runtime'),
    ('runtime/request.py', ['from edge_llm_ros.serving import engine'],
     'runtime-below-serving'),
    ('runtime/output.py', ['from ..serving.queue import GoalQueue'], 'runtime-below-serving'),
    ('convert/quant.py', ['from edge_llm_ros.serving import engine'], 'convert-stands-alone'),
    ('convert/converter.py', ['from ..nodes import messages'], 'convert-stands-alone'),
    ('vision/runner.py', ['import onnx'], 'converter-libraries-in-convert-only'),
    ('nodes/perception.py', ['from edge_llm_ros.convert import standin_encoder'], None),
    ('ipc/pool.py', ['import rclpy.node'], 'rclpy-in-node-layer'),
    ('regression/compare.py', ['def _spin():', '    import rclpy'], 'rclpy-in-node-layer'),
    ('cli.py', ["__import__('rclpy')"], 'rclpy-in-node-layer'),
    ('nodes/messages.py', ['import rclpy'], None),
    ('regression/record.py', ['import rclpy.node'], None),
    ('model_format.py', ['from edge_llm_ros.runtime import types'],
     'contract-imports-only-errors'),
    ('errors.py', ['from . import model_format'], 'contract-imports-only-errors'),
    ('model_format.py', ['from edge_llm_ros import errors'], None),
]


def _copy_package(tmp_path: pathlib.Path) -> pathlib.Path:
    copy = tmp_path / PACKAGE
    shutil.copytree(ROOT / PACKAGE, copy, ignore=shutil.ignore_patterns('__pycache__'))
    # A module outside the runtime that pulls the converter in: only reached through.
    (copy / PROBE).write_text('from edge_llm_ros.convert import quant\n')
    return copy


@pytest.mark.parametrize('rel, lines, rule', INJECTED,
                         ids=[f'{r}:{ls[-1].strip()}' for r, ls, _ in INJECTED])
def test_an_added_import_is_reported_exactly(tmp_path, rel, lines, rule):
    copy = _copy_package(tmp_path)
    target = copy / rel
    text = target.read_text()
    text += '' if text.endswith('\n') else '\n'
    line = text.count('\n') + len(lines)          # the import is the last appended line
    target.write_text(text + '\n'.join(lines) + '\n')
    found = Tree(copy).violations()
    got = [(v.path, v.line, v.rule.name) for v in found]
    expected = [] if rule is None else [(f'{PACKAGE}/{rel}', line, rule)]
    assert got == expected, '\n'.join(map(str, found))
    for violation in found:
        assert str(violation).startswith(f'{PACKAGE}/{rel}:{line}: imports ')
        assert f'[{rule}]' in str(violation)


def test_a_chain_names_the_modules_it_goes_through(tmp_path):
    copy = _copy_package(tmp_path)
    target = copy / 'runtime' / 'sampling.py'
    target.write_text(target.read_text() + 'from edge_llm_ros.bringup import _layers_probe\n')
    (violation,) = Tree(copy).violations()
    assert violation.module.startswith('edge_llm_ros.convert')
    assert violation.chain == ('edge_llm_ros.bringup._layers_probe',)
    assert '(through edge_llm_ros.bringup._layers_probe)' in str(violation)
