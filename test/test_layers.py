"""The import contract between the layers of edge_llm_ros, checked on the source (ast).

Every import in a file counts, wherever it is (module level, inside a function, under
TYPE_CHECKING): `import a.b`, `from a import b`, relative `from . import b` / `from ..x import
y`, and `importlib.import_module('a.b')` / `__import__('a.b')` with a literal name (a name
computed at run time cannot be checked here; test/test_layers_node.py checks a running
llm_node instead).

Rules (RULES below, each with the fix its message names):

- runtime/, serving/, ipc/, bringup/ and vision/ never load the converter (edge_llm_ros.convert,
  gguf, onnx, safetensors; onnxruntime is fine): not directly, and not through another
  edge_llm_ros module outside those folders (the message names the chain).
- runtime/, serving/, convert/, ipc/, bringup/, vision/ and bridge/ never load ROS (rclpy,
  launch, launch_ros, edge_llm_msgs, any *_msgs / *_interfaces package), directly or through.
- runtime/ (one sequence) never imports serving/ or nodes/, directly or through another
  module.
- runtime/ and serving/ (the engine) never import bringup/ or vision/: they take typed configs
  and plain values; boards, parameters and cameras build on them.
- bringup/ never imports serving/, nodes/ or vision/; its parameter table
  (bringup/parameters.py) reads the runtime and ipc only through their choices leaves
  (runtime/choices.py, ipc/choices.py).
- convert/ never imports serving/ or nodes/ (it runs on a build machine).
- Outside convert/, nothing imports gguf, onnx or safetensors itself (a node that needs a
  graph written, like perception's stand-in encoder, calls the converter's module).
- Outside the folders above, only the ROS-facing modules of RCLPY_ALLOWED import rclpy.
- The leaves (model_format.py and errors.py, the contract every layer reads; safe_yaml.py; the
  choices leaves) import no edge_llm_ros module but errors.

And no two packages (the folders and top-level modules of edge_llm_ros) import each other,
directly or around a longer loop (test_no_cycle_between_packages names the imports).
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
    'memory_client.py': 'MemoryClient, the rclpy service client of the memory node',
}
# Modules outside convert/ that read a file format with the converter's libraries (gguf, onnx,
# safetensors), and why: they convert nothing, and edge_llm_ros.convert stays forbidden to them.
CONVERTER_LIBRARIES_ALLOWED: Dict[str, str] = {}
CONVERTER_LIBRARIES = ('gguf', 'onnx', 'safetensors')
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


def _package(*folders: str) -> Callable[[str], bool]:
    return lambda m: _under(m, *(f'{PACKAGE}.{f}' for f in folders))


# Folders that load no converter, and no ROS (the nodes translate messages for them).
NO_CONVERTER = ('runtime', 'serving', 'ipc', 'bringup', 'vision')
NO_ROS = ('runtime', 'serving', 'convert', 'ipc', 'bringup', 'vision', 'bridge')
# Modules that import no edge_llm_ros module but errors, so any layer may read them.
LEAVES = ('model_format.py', 'errors.py', 'safe_yaml.py', 'runtime/choices.py', 'ipc/choices.py')


def _runtime_or_ipc_internal(module: str) -> bool:
    """Say whether bringup/parameters.py must not load it: runtime/ipc but their choices."""
    return _package('runtime', 'ipc')(module) and \
        module not in (f'{PACKAGE}.runtime', f'{PACKAGE}.ipc') and \
        not _package('runtime.choices', 'ipc.choices')(module)


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
    Rule('no-converter', _in(*NO_CONVERTER), _converter,
         'runtime/, serving/, ipc/, bringup/ and vision/ never load the offline converter: '
         'they read converted model folders (edge_llm_ros.model_format, onnxruntime); gguf, '
         "onnx, safetensors and edge_llm_ros.convert are the converter's, in "
         'edge_llm_ros/convert/ only (a node that needs a graph written calls it)',
         through=True),
    Rule('no-ros', _in(*NO_ROS), _ros,
         'runtime/, serving/, convert/, ipc/, bringup/, vision/ and bridge/ know no ROS: '
         'rclpy and ROS messages belong in edge_llm_ros/nodes/, which translates messages to '
         'and from their plain types', through=True),
    Rule('runtime-below-serving', _in('runtime'), _package('serving', 'nodes'),
         'runtime/ is the lower layer (one sequence): serving/ and nodes/ build on it, '
         'never the other way', through=True),
    Rule('engine-below-bringup-and-vision', _in('runtime', 'serving'),
         _package('bringup', 'vision'),
         'runtime/ and serving/ take typed configs and plain values: boards, parameters and '
         'launch logic (bringup/) and the camera side (vision/) build on them. Let the node '
         'or bringup translate parameters once; a choice the engine owns goes in '
         'runtime/choices.py', through=True),
    Rule('bringup-below-serving-and-vision', _in('bringup'),
         _package('serving', 'nodes', 'vision'),
         'bringup/ decides boards, parameters and launches from plain data: it reads the '
         'runtime (model families, the native library) and ipc, and never loads the engine '
         '(serving/), the nodes or the camera side (vision/)', through=True),
    Rule('parameter-table-reads-leaves', lambda rel: rel == 'bringup/parameters.py',
         _runtime_or_ipc_internal,
         'the parameter table loads none of the runtime or ipc: read the choices they own '
         'from runtime/choices.py or ipc/choices.py (plain tuples), and build typed configs '
         'from its *_kwargs in the node (nodes/llm_config.py)', through=True),
    Rule('convert-stands-alone', _in('convert'), _package('serving', 'nodes'),
         'convert/ runs offline on a build machine: it may use model_format, errors and '
         'runtime, never serving/ or nodes/', through=True),
    Rule('converter-libraries-in-convert-only',
         lambda rel: not _in('convert', *NO_CONVERTER)(rel),
         lambda m: _converter(m) and not _under(m, f'{PACKAGE}.convert'),
         "gguf, onnx and safetensors are the converter's libraries: import them in "
         'edge_llm_ros/convert/ only (and call that module from here)'),
    Rule('rclpy-in-node-layer',
         lambda rel: not _rclpy_allowed(rel) and not _in(*NO_ROS)(rel),
         lambda m: _under(m, 'rclpy'),
         'rclpy belongs in edge_llm_ros/nodes/ (node entry points) or one of the ROS-facing '
         'modules listed in RCLPY_ALLOWED (test/test_layers.py), each with its reason'),
    Rule('leaves-import-only-errors', lambda rel: rel in LEAVES,
         lambda m: _under(m, PACKAGE) and m != PACKAGE and not _under(m, f'{PACKAGE}.errors'),
         'model_format.py and errors.py (what every layer reads), safe_yaml.py and the '
         'choices leaves (runtime/choices.py, ipc/choices.py: what bringup reads of the '
         'runtime and ipc) import no edge_llm_ros module but errors'),
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


@dataclasses.dataclass(frozen=True)
class Cycle:
    """Packages that import each other around a loop, and one import of each step."""

    packages: Tuple[str, ...]          # a -> b -> ... -> (back to a)
    imports: Tuple[str, ...]           # 'path:line imports module', one per step

    def __str__(self) -> str:
        loop = ' -> '.join(self.packages + self.packages[:1])
        return f'{loop}: ' + '; '.join(self.imports) + \
            '. A package cycle ties both ends together: move what the lower one needs into ' \
            'it (a leaf such as runtime/choices.py or safe_yaml.py) or pass it plain values'


def _package_of(module: str) -> Optional[str]:
    """Return the package of a module: its folder or top-level module under edge_llm_ros."""
    parts = module.split('.')
    return parts[1] if len(parts) > 1 and parts[0] == PACKAGE else None


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
        found = [v for v in found if not _library_exempt(v)]
        return sorted(found, key=lambda v: (v.path, v.line, v.rule.name))

    def package_imports(self) -> Dict[Tuple[str, str], str]:
        """(package, package it imports) -> its first import ('path:line imports module')."""
        edges: Dict[Tuple[str, str], str] = {}
        for module in self.files:
            source = _package_of(module)
            for statement in self.imports[module]:
                # The deepest module the statement loads in each package it reaches.
                reached: Dict[str, str] = {}
                for loaded in (m for n in statement.names for m in self.loaded(n)):
                    target = _package_of(loaded)
                    if target and len(loaded) > len(reached.get(target, '')):
                        reached[target] = loaded
                for target, loaded in reached.items():
                    if source and target != source:
                        edges.setdefault((source, target), f'{PACKAGE}/{self.rel(module)}:'
                                         f'{statement.line} imports {loaded}')
        return edges

    def package_cycles(self) -> List[Cycle]:
        """Each loop of packages importing each other, once, by its shortest way round."""
        edges = self.package_imports()
        graph: Dict[str, List[str]] = collections.defaultdict(list)
        for source, target in sorted(edges):
            graph[source].append(target)
        found: List[Cycle] = []
        for start in sorted(graph):
            loop = _shortest_loop(graph, start)
            if loop and not any(set(loop) == set(c.packages) for c in found):
                steps = zip(loop, loop[1:] + loop[:1])
                found.append(Cycle(loop, tuple(edges[step] for step in steps)))
        return found

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


def _shortest_loop(graph: Dict[str, List[str]], start: str) -> Optional[Tuple[str, ...]]:
    """Return the shortest path start -> ... -> x with an edge x -> start, or None."""
    queue = collections.deque([(start,)])
    seen: Set[str] = {start}
    while queue:
        path = queue.popleft()
        for step in graph.get(path[-1], ()):
            if step == start:
                return path
            if step not in seen:
                seen.add(step)
                queue.append(path + (step,))
    return None


def _library_exempt(violation: Violation) -> bool:
    """Say whether a listed module (CONVERTER_LIBRARIES_ALLOWED) reads one of those libraries."""
    rel = violation.path[len(PACKAGE) + 1:]
    return rel in CONVERTER_LIBRARIES_ALLOWED and _under(violation.module, *CONVERTER_LIBRARIES)


def test_the_package_keeps_its_import_contract():
    violations = Tree(ROOT / PACKAGE).violations()
    assert not violations, 'forbidden imports:\n' + '\n'.join(map(str, violations))


def test_no_cycle_between_packages():
    cycles = Tree(ROOT / PACKAGE).package_cycles()
    assert not cycles, 'packages that import each other:\n' + '\n'.join(map(str, cycles))


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


def test_every_converter_library_entry_is_needed():
    """A listed file that no longer imports gguf, onnx or safetensors: take it off the list."""
    tree = Tree(ROOT / PACKAGE)
    by_rel = {tree.rel(m): m for m in tree.files}
    for entry in CONVERTER_LIBRARIES_ALLOWED:
        assert entry in by_rel, f'{entry} is listed in CONVERTER_LIBRARIES_ALLOWED but missing'
        names = [n for s in tree.imports[by_rel[entry]] for n in s.names]
        assert any(_under(n, *CONVERTER_LIBRARIES) for n in names), \
            f'{entry} is in CONVERTER_LIBRARIES_ALLOWED but imports none of them: remove it'
        assert not any(_under(n, f'{PACKAGE}.convert') for n in names), entry


# --- the checker fails where it should ------------------------------------------------------

PROBE = 'update/_layers_probe.py'    # a module outside the rules' folders, added by the probe

# (file, lines appended to it, rule expected at the first appended line, or None: allowed)
INJECTED = [
    ('runtime/sampling.py', ['import gguf'], 'no-converter'),
    ('runtime/decoder.py', ['import onnx.helper'], 'no-converter'),
    ('runtime/decoder.py', ['import onnxruntime'], None),
    ('serving/engine.py', ['from onnx import numpy_helper'], 'no-converter'),
    ('serving/scheduler.py', ['def _late():', '    from safetensors import safe_open'],
     'no-converter'),
    ('runtime/kv_cache.py', ["importlib.import_module('gguf.constants')"], 'no-converter'),
    ('runtime/tools/parser.py', ['from ...convert import converter'], 'no-converter'),
    ('runtime/sampling.py', ['from edge_llm_ros.update import _layers_probe'], 'no-converter'),
    ('vision/runner.py', ['import onnx'], 'no-converter'),
    ('vision/default_model.py', ['from edge_llm_ros.convert import standin_encoder'],
     'no-converter'),
    ('bringup/profiles.py', ['from ..update import _layers_probe'], 'no-converter'),
    ('ipc/mapping.py', ['import safetensors'], 'no-converter'),
    ('serving/scheduler.py', ['import rclpy'], 'no-ros'),
    ('runtime/types.py', ['from edge_llm_msgs.msg import Transcript'], 'no-ros'),
    ('serving/worker.py', ['from std_msgs.msg import String'], 'no-ros'),
    ('serving/remote.py', ['from edge_llm_ros.client import LLMClient'], 'no-ros'),
    ('ipc/pool.py', ['import rclpy.node'], 'no-ros'),
    ('vision/sources.py', ['from sensor_msgs.msg import Image'], 'no-ros'),
    ('vision/params.py', ['from edge_llm_ros.client import LLMClient'], 'no-ros'),
    ('bringup/launch_logic.py', ['import launch_ros.actions'], 'no-ros'),
    ('bringup/thermal.py', ['from edge_llm_ros import qos'], 'no-ros'),
    ('bridge/app.py', ['import rclpy'], 'no-ros'),
    ('convert/quant.py', ['import rclpy'], 'no-ros'),
    ('runtime/request.py', ['from edge_llm_ros.serving import engine'],
     'runtime-below-serving'),
    ('runtime/output.py', ['from ..serving.queue import GoalQueue'], 'runtime-below-serving'),
    ('runtime/model_config.py', ['from edge_llm_ros.bringup.profiles import available_boards'],
     'engine-below-bringup-and-vision'),
    ('serving/backends.py', ['from edge_llm_ros.bringup import parameters'],
     'engine-below-bringup-and-vision'),
    ('serving/engine.py', ['from edge_llm_ros.vision.vlm_frames import vlm_folder'],
     'engine-below-bringup-and-vision'),
    ('runtime/media.py', ['from edge_llm_ros.safe_yaml import safe_load_bounded'], None),
    ('bringup/preflight.py', ['from edge_llm_ros.serving.engine import EngineConfig'],
     'bringup-below-serving-and-vision'),
    ('bringup/profiles.py', ['from edge_llm_ros.vision import synthetic'],
     'bringup-below-serving-and-vision'),
    ('bringup/kernels.py', ['import edge_llm_ros.nodes'],
     'bringup-below-serving-and-vision'),
    ('bringup/preflight.py', ['from edge_llm_ros.runtime.model_config import load_family'],
     None),
    ('bringup/parameters.py', ['from edge_llm_ros.runtime.native_ops import KERNEL_CHOICES'],
     'parameter-table-reads-leaves'),
    ('bringup/parameters.py', ['from edge_llm_ros.ipc.allocators import allocator_names'],
     'parameter-table-reads-leaves'),
    ('bringup/parameters.py', ['from edge_llm_ros.runtime import speculative_config'],
     'parameter-table-reads-leaves'),
    ('bringup/parameters.py', ['from edge_llm_ros.runtime import choices'], None),
    ('bringup/parameters.py', ['from ..ipc.choices import ALLOCATORS'], None),
    ('convert/quant.py', ['from edge_llm_ros.serving import engine'], 'convert-stands-alone'),
    ('convert/converter.py', ['from .. import nodes'], 'convert-stands-alone'),
    ('metrics/figures.py', ['import onnx'], 'converter-libraries-in-convert-only'),
    ('nodes/perception.py', ['from edge_llm_ros.convert import standin_encoder'], None),
    ('regression/compare.py', ['def _spin():', '    import rclpy'], 'rclpy-in-node-layer'),
    ('cli.py', ["__import__('rclpy')"], 'rclpy-in-node-layer'),
    ('nodes/messages.py', ['import rclpy'], None),
    ('regression/record.py', ['import rclpy.node'], None),
    ('model_format.py', ['from edge_llm_ros.runtime import types'],
     'leaves-import-only-errors'),
    ('errors.py', ['from . import model_format'], 'leaves-import-only-errors'),
    ('safe_yaml.py', ['from edge_llm_ros import model_format'], 'leaves-import-only-errors'),
    ('ipc/choices.py', ['from edge_llm_ros.errors import EngineError'], None),
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
    target.write_text(target.read_text() + 'from edge_llm_ros.update import _layers_probe\n')
    (violation,) = Tree(copy).violations()
    assert violation.module.startswith('edge_llm_ros.convert')
    assert violation.chain == ('edge_llm_ros.update._layers_probe',)
    assert '(through edge_llm_ros.update._layers_probe)' in str(violation)


def _append(path: pathlib.Path, line: str) -> int:
    """Append one line to a file; return its line number."""
    text = path.read_text()
    text += '' if text.endswith('\n') else '\n'
    path.write_text(text + line + '\n')
    return text.count('\n') + 1


def _line_of(path: pathlib.Path, needle: str) -> int:
    return next(i for i, text in enumerate(path.read_text().splitlines(), 1) if needle in text)


def test_a_leaf_that_grows_an_import_is_reported_where_it_is_read(tmp_path):
    copy = _copy_package(tmp_path)
    line = _append(copy / 'runtime' / 'choices.py', 'from edge_llm_ros.runtime import native_ops')
    table = copy / 'bringup' / 'parameters.py'
    found = {(v.path, v.line, v.rule.name, v.chain) for v in Tree(copy).violations()}
    assert found == {
        (f'{PACKAGE}/runtime/choices.py', line, 'leaves-import-only-errors', ()),
        (f'{PACKAGE}/bringup/parameters.py', _line_of(table, 'runtime.choices import'),
         'parameter-table-reads-leaves', (f'{PACKAGE}.runtime.choices',))}


def test_a_cycle_between_two_packages_is_reported_with_its_imports(tmp_path):
    copy = _copy_package(tmp_path)
    line = _append(copy / 'runtime' / 'sampling.py', 'from edge_llm_ros.metrics import figures')
    (cycle,) = Tree(copy).package_cycles()
    assert cycle.packages == ('metrics', 'runtime')
    assert cycle.imports[1] == (f'{PACKAGE}/runtime/sampling.py:{line} imports '
                                f'{PACKAGE}.metrics.figures')
    assert cycle.imports[0].startswith(f'{PACKAGE}/metrics/')
    assert str(cycle).startswith('metrics -> runtime -> metrics: edge_llm_ros/metrics/')


def test_a_longer_cycle_is_reported_once(tmp_path):
    # ipc -> vision (the added line) -> bringup (vision's frame sides) -> ipc (allocator names)
    copy = _copy_package(tmp_path)
    line = _append(copy / 'ipc' / 'pool.py', 'from edge_llm_ros.vision import synthetic')
    (cycle,) = Tree(copy).package_cycles()
    assert cycle.packages == ('bringup', 'ipc', 'vision')
    assert cycle.imports[1] == f'{PACKAGE}/ipc/pool.py:{line} imports {PACKAGE}.vision.synthetic'
    assert str(cycle).startswith('bringup -> ipc -> vision -> bringup: ')
