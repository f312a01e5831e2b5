"""The private rclpy members edge_llm_ros relies on still exist, as rclpy_internals records.

For every entry of rclpy_internals.PRIVATE_MEMBERS:
- the class (and, for a method, the member) is in both test/data/rclpy_api extracts, whose
  commits are the ones the entry was checked at (a new extract means: re-check, update);
- a method's inspect.signature on the installed (Jazzy) rclpy is the recorded one;
- an instance attribute exists, with the recorded shape, on a real rclpy object made here.
  The extracts list class members only, not what __init__ assigns, and no Humble rclpy runs
  here: on Humble only the class is checked (the attribute itself was read in Humble's source
  at the recorded commit, see the entry).
And no module of edge_llm_ros but rclpy_internals touches a private rclpy member.
"""
import ast
from concurrent.futures import ThreadPoolExecutor
import dataclasses
import importlib
import inspect
import json
import pathlib
import re
from typing import Callable, Dict, Iterable, List, Optional, Set, Tuple
import uuid

from lifecycle_msgs.msg import State
import pytest
import rclpy
from rclpy.action import ActionClient
from rclpy.executors import Executor, MultiThreadedExecutor, SingleThreadedExecutor
from rclpy.lifecycle import LifecycleNode
from rclpy.parameter import Parameter
from rclpy.task import Future
from rclpy_api_checker import check, Finding, private_uses, RclpyApi
from unique_identifier_msgs.msg import UUID

from edge_llm_msgs.action import Generate
from edge_llm_ros import rclpy_internals
from edge_llm_ros.rclpy_internals import ATTRIBUTE, METHOD, PRIVATE_MEMBERS, PrivateMember

ROOT = pathlib.Path(__file__).resolve().parents[1]
API_DIR = ROOT / 'test' / 'data' / 'rclpy_api'
INTERNALS = 'edge_llm_ros/rclpy_internals.py'
# Private rclpy uses outside rclpy_internals still to be moved there, (path, member name).
# Each must still occur (test_not_yet_moved_uses_still_exist): delete an entry once moved.
ENTRIES = {entry.where: entry for entry in PRIVATE_MEMBERS}


def _ids(entries: Iterable[PrivateMember]) -> List[str]:
    return [entry.where for entry in entries]


@pytest.fixture(scope='module')
def apis() -> Tuple[RclpyApi, RclpyApi]:
    missing = [name for name in ('humble.json', 'jazzy.json') if not (API_DIR / name).is_file()]
    if missing:
        pytest.fail(f'{API_DIR} lacks {", ".join(missing)}: restore them (git checkout) or '
                    'write them with scripts/refresh_test_data.py rclpy (test/data/README.md)')
    return RclpyApi.load(API_DIR / 'jazzy.json'), RclpyApi.load(API_DIR / 'humble.json')


# ---- the extracts (Humble and Jazzy) ---------------------------------------------------------
def json_problems(path: pathlib.Path, entries: Iterable[PrivateMember]) -> List[str]:
    """Say what the extract at `path` contradicts of the entries ([] when nothing)."""
    data = json.loads(pathlib.Path(path).read_text())
    branch, commit = data['branch'], data['commit']
    problems = []
    for entry in entries:
        checked = {c.branch: c.commit for c in entry.checked}
        if checked.get(branch) != commit:
            problems.append(f'{entry.where}: checked at {branch} {checked.get(branch)}, the '
                            f'extract is at {commit}: re-read the member there and update '
                            'rclpy_internals')
        module, _, cls = entry.owner.rpartition('.')
        found = data['modules'].get(module, {}).get('classes', {}).get(cls)
        if found is None:
            problems.append(f'{entry.where}: rclpy {branch} has no class {entry.owner}')
        elif entry.kind == METHOD and entry.name not in found['members']:
            problems.append(f"{entry.where}: rclpy {branch}'s {cls} has no member "
                            f'{entry.name}')
    return problems


@pytest.mark.parametrize('branch', ['humble', 'jazzy'])
def test_entries_hold_in_the_extract(apis, branch):
    problems = json_problems(API_DIR / f'{branch}.json', PRIVATE_MEMBERS)
    assert not problems, '\n'.join(problems)


def _edited_extract(tmp_path: pathlib.Path, edit: Callable[[dict], None]) -> pathlib.Path:
    data = json.loads((API_DIR / 'humble.json').read_text())
    edit(data)
    path = tmp_path / 'humble.json'
    path.write_text(json.dumps(data))
    return path


def test_json_check_reports_a_member_gone(apis, tmp_path):
    entry = rclpy_internals.GET_RESULT_ASYNC

    def drop(data: dict) -> None:
        data['modules']['rclpy.action.client']['classes']['ActionClient']['members'].remove(
            entry.name)
    problems = json_problems(_edited_extract(tmp_path, drop), PRIVATE_MEMBERS)
    assert len(problems) == 1 and entry.where in problems[0] and 'no member' in problems[0]


def test_json_check_reports_a_class_gone_and_a_new_commit(apis, tmp_path):
    def edit(data: dict) -> None:
        del data['modules']['rclpy.lifecycle.node']['classes']['LifecycleNodeMixin']
        data['commit'] = '0' * 40
    problems = json_problems(_edited_extract(tmp_path, edit), PRIVATE_MEMBERS)
    assert any(rclpy_internals.STATE_MACHINE.where in p and 'no class' in p
               for p in problems), problems
    assert sum('re-read' in p for p in problems) == len(PRIVATE_MEMBERS)


# ---- the installed rclpy (Jazzy): signatures -------------------------------------------------
def _installed_class(qualname: str) -> type:
    module, _, name = qualname.rpartition('.')
    return getattr(importlib.import_module(module), name)


def signature_problem(entry: PrivateMember) -> Optional[str]:
    """Say how the installed rclpy differs from a method entry (None when it does not)."""
    cls = _installed_class(entry.owner)
    function = cls.__dict__.get(entry.name)   # defined by that class itself, as recorded
    if function is None:
        return f'{entry.where}: the installed {cls.__name__} does not define {entry.name}'
    found = str(inspect.signature(function))
    if found != entry.signature:
        return (f'{entry.where}: the installed rclpy has the signature {found}, rclpy_internals '
                f'records {entry.signature}: re-check the override and update the entry')
    return None


@pytest.mark.parametrize('entry', [e for e in PRIVATE_MEMBERS if e.kind == METHOD],
                         ids=_ids([e for e in PRIVATE_MEMBERS if e.kind == METHOD]))
def test_method_signature_is_the_recorded_one(entry):
    assert entry.signature, f'{entry.where}: record its signature'
    problem = signature_problem(entry)
    assert problem is None, problem


def test_signature_check_reports_a_change():
    entry = dataclasses.replace(rclpy_internals.REMOVE_PENDING_GOAL_REQUEST,
                                signature='(self, future, pending_requests)')
    assert 'records (self, future, pending_requests)' in signature_problem(entry)
    gone = dataclasses.replace(entry, where=f'{entry.owner}._remove_pending_goal')
    assert 'does not define' in signature_problem(gone)


# ---- the installed rclpy: instance attributes and shapes, on real objects --------------------
@pytest.fixture
def node():
    context = rclpy.Context()
    rclpy.init(context=context)
    made = rclpy.create_node(f'rclpy_internals_probe_{uuid.uuid4().hex[:8]}', context=context)
    yield made
    made.destroy_node()
    rclpy.try_shutdown(context=context)


def _goal_id() -> UUID:
    return UUID(uuid=list(uuid.uuid4().bytes))


def _check_feedback_callbacks(node) -> None:
    client = ActionClient(node, Generate, 'probe_feedback')
    assert isinstance(client._feedback_callbacks, dict)
    goal_id = _goal_id()

    def callback(message) -> None:
        pass
    # No server: the request goes nowhere, but the callback is stored by goal id bytes.
    client.send_goal_async(Generate.Goal(), feedback_callback=callback, goal_uuid=goal_id)
    assert client._feedback_callbacks == {bytes(goal_id.uuid): callback}
    client.destroy()


def _check_futures(node) -> None:
    client = ActionClient(node, Generate, 'probe_futures')
    assert client._futures == []
    future = client.send_goal_async(Generate.Goal(), goal_uuid=_goal_id())
    assert client._futures == [future]   # send_goal_async -> add_future
    client.destroy()
    # The executor hands its reference to each of a waitable's futures from that list.
    assert 'waitable._futures' in inspect.getsource(Executor), \
        'the executor no longer walks waitable._futures: re-check LockedActionClient'
    locked = rclpy_internals.LockedActionClient(node, Generate, 'probe_locked')
    before = locked._futures
    extra = Future()
    locked.add_future(extra)
    assert locked._futures is not before and locked._futures[-1] is extra and before == []
    locked.remove_future(extra)
    assert locked._futures == []
    locked.destroy()


def _check_state_machine(node) -> None:
    lifecycle = LifecycleNode(f'{node.get_name()}_lifecycle', context=node.context)
    state = lifecycle._state_machine.current_state
    assert isinstance(state, tuple) and len(state) == 2
    assert state == (State.PRIMARY_STATE_UNCONFIGURED, 'unconfigured')
    assert rclpy_internals.lifecycle_state(lifecycle) == 'unconfigured'
    lifecycle.trigger_configure()
    assert rclpy_internals.lifecycle_state(lifecycle) == 'inactive'
    lifecycle.destroy_node()


def _check_thread_pool(node) -> None:
    executor = MultiThreadedExecutor(num_threads=2, context=node.context)
    assert isinstance(executor._executor, ThreadPoolExecutor)
    assert rclpy_internals.executor_thread_pool(executor) is executor._executor
    executor.shutdown(timeout_sec=1)
    single = SingleThreadedExecutor(context=node.context)
    assert rclpy_internals.executor_thread_pool(single) is None
    single.shutdown(timeout_sec=1)


def _check_execute(node) -> None:
    # take_data builds the dict execute gets; the overrides read its 'feedback' and 'status'.
    source = inspect.getsource(ActionClient.take_data)
    for key in ('goal', 'cancel', 'result', 'feedback', 'status'):
        assert f"data['{key}']" in source, f'ActionClient.take_data no longer sets {key!r}'


def _check_parameter_overrides(node) -> None:
    # Every override is kept by name, the undeclared ones too (what the nodes check).
    probe = rclpy.create_node(f'{node.get_name()}_overrides', context=node.context,
                              cli_args=['--ros-args', '-p', 'not_declared:=1'],
                              parameter_overrides=[Parameter('given', value=2)])
    try:
        assert isinstance(probe._parameter_overrides, dict)
        assert {'not_declared', 'given'} <= set(probe._parameter_overrides)
        assert isinstance(probe._parameter_overrides['given'], Parameter)
        assert not probe.has_parameter('not_declared')
        assert {'not_declared', 'given'} <= set(
            rclpy_internals.parameter_override_names(probe))
    finally:
        probe.destroy_node()


RUNTIME_CHECKS: Dict[str, Callable] = {
    rclpy_internals.PARAMETER_OVERRIDES.where: _check_parameter_overrides,
    rclpy_internals.FEEDBACK_CALLBACKS.where: _check_feedback_callbacks,
    rclpy_internals.FUTURES.where: _check_futures,
    rclpy_internals.STATE_MACHINE.where: _check_state_machine,
    rclpy_internals.THREAD_POOL.where: _check_thread_pool,
    rclpy_internals.EXECUTE.where: _check_execute,
}
SHAPED = [e for e in PRIVATE_MEMBERS if e.kind == ATTRIBUTE or e.shape]


def test_every_attribute_and_shape_has_a_runtime_check():
    for entry in PRIVATE_MEMBERS:
        assert entry.kind in (METHOD, ATTRIBUTE), entry
        if entry.kind == ATTRIBUTE:
            assert entry.shape and not entry.signature, entry.where
    assert set(RUNTIME_CHECKS) == {e.where for e in SHAPED}


@pytest.mark.parametrize('entry', SHAPED, ids=_ids(SHAPED))
def test_attribute_has_the_recorded_shape(node, entry):
    _installed_class(entry.owner)   # the class is where recorded
    RUNTIME_CHECKS[entry.where](node)


def test_accepted_goal_handle_replaces_the_lost_response(node):
    client = rclpy_internals.LockedActionClient(node, Generate, 'probe_recover')
    goal_id = _goal_id()
    future = client.send_goal_async(Generate.Goal(), goal_uuid=goal_id)
    assert len(client._pending_goal_requests) == 1
    handle = rclpy_internals.accepted_goal_handle(client, future, goal_id, Generate)
    assert handle.accepted and handle.goal_id == goal_id
    # A response arriving after all is ignored: the request is no longer pending.
    assert client._pending_goal_requests == {} and future not in client._futures
    assert not future.done()
    assert isinstance(handle.get_result_async(), Future)   # through _get_result_async
    client.destroy()


# ---- rclpy_internals names each entry where it is used ---------------------------------------
def _entry_refs(node: ast.AST, in_class: bool) -> Set[str]:
    """Entries a function touches: private names, overrides, ClientGoalHandle(...) calls."""
    refs = set()
    for entry in PRIVATE_MEMBERS:
        short = entry.owner.rpartition('.')[2]
        if in_class and node.name == entry.name and not entry.name.startswith('__'):
            refs.add(entry.where)
        for sub in ast.walk(node):
            if entry.name.startswith('__'):
                if isinstance(sub, ast.Call) and _called_name(sub) == short:
                    refs.add(entry.where)
            elif entry.name.startswith('_') and entry.name in _attr_names(sub):
                refs.add(entry.where)
    return refs


def _called_name(call: ast.Call) -> Optional[str]:
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, 'attr', None)


def _attr_names(node: ast.AST) -> Set[str]:
    """Names node reads or writes as attributes: x.name, getattr(x, 'name'), ..."""
    if isinstance(node, ast.Attribute):
        return {node.attr}
    if isinstance(node, ast.Call) and _called_name(node) in (
            'getattr', 'hasattr', 'setattr', 'delattr') and len(node.args) >= 2 and \
            isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
        return {node.args[1].value}
    return set()


def _described(source_lines: List[str], node: ast.AST) -> str:
    """Return the docstring of a def, with the comment lines right above it."""
    above = []
    line = node.lineno - 2 - len(node.decorator_list)
    while line >= 0 and source_lines[line].strip().startswith('#'):
        above.append(source_lines[line])
        line -= 1
    return (ast.get_docstring(node) or '') + '\n'.join(above)


def test_each_use_in_rclpy_internals_names_its_entry():
    source = (ROOT / INTERNALS).read_text()
    tree = ast.parse(source)
    lines = source.splitlines()
    used: Set[str] = set()
    unnamed = []
    for top in tree.body:
        members: List[Tuple[ast.AST, bool]] = []
        if isinstance(top, ast.ClassDef):
            members = [(m, True) for m in top.body
                       if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
        elif isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members = [(top, False)]
        for function, in_class in members:
            refs = _entry_refs(function, in_class)
            used |= refs
            text = _described(lines, function)
            unnamed += [f'{function.name} (line {function.lineno}) touches {where}'
                        for where in sorted(refs) if where not in text]
    assert not unnamed, 'name the entry in the docstring:\n' + '\n'.join(unnamed)
    assert used == set(ENTRIES), f'entries no code uses: {sorted(set(ENTRIES) - used)}'


def _self_assigned(nodes: Iterable[ast.AST]) -> Set[str]:
    """Return the attributes that `self.x = ...` (or `self.x: T = ...`) sets under nodes."""
    return {target.attr for node in nodes for sub in ast.walk(node)
            if isinstance(sub, (ast.Assign, ast.AnnAssign))
            for target in (sub.targets if isinstance(sub, ast.Assign) else [sub.target])
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and
            target.value.id == 'self'}


def test_rclpy_internals_touches_no_unregistered_private_member(apis):
    source = (ROOT / INTERNALS).read_text()
    tree = ast.parse(source)
    # Its own attributes are those its classes' __init__ set (the others are rclpy's).
    own = _self_assigned(node for node in ast.walk(tree)
                         if isinstance(node, ast.FunctionDef) and node.name == '__init__')
    names = {entry.name for entry in PRIVATE_MEMBERS}
    stray = sorted({(name, sub.lineno) for sub in ast.walk(tree) for name in _attr_names(sub)
                    if name.startswith('_') and not name.startswith('__') and
                    name not in names and name not in own})
    assert not stray, f'private members not in PRIVATE_MEMBERS: {stray}'
    _, project = check({'edge_llm_ros.rclpy_internals': (INTERNALS, source)}, [], *apis)
    resolved = {f.what.rpartition('.')[2] for f in private_uses(project)}
    assert resolved and resolved <= names, resolved - names


# ---- no other module touches a private rclpy member ------------------------------------------
def _banned_names() -> Set[str]:
    return {e.name for e in PRIVATE_MEMBERS if e.name.startswith('_') and
            not e.name.startswith('__')}


def _constructors() -> Set[str]:
    return {e.owner.rpartition('.')[2] for e in PRIVATE_MEMBERS if e.name == '__init__'}


class _NameScan(ast.NodeVisitor):
    """Uses, by name, of the registry's members and super()._x in rclpy-derived classes."""

    def __init__(self, module: str, path: str, project) -> None:
        self.module, self.path, self.project = module, path, project
        self.banned = _banned_names()
        self.constructors = _constructors()
        self.classes: List[Tuple[str, bool, Set[str]]] = []   # qualname, rclpy super, own
        self.found: List[Finding] = []

    def _report(self, node: ast.AST, what: str, why: str) -> None:
        self.found.append(Finding(self.path, node.lineno, what, why))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        prefix = self.classes[-1][0] if self.classes else self.module
        qualname = f'{prefix}.{node.name}'
        rclpy_base = bool(self.project.class_chain(qualname)[1])
        # super() of a mixin (no bases) is whatever follows it in the MRO: rclpy's, maybe.
        rclpy_super = rclpy_base or not node.bases
        # Own attributes: those its (or its package bases') __init__ set, in a class no rclpy
        # base could set them in.
        inits = [item for info in self.project.class_chain(qualname)[0]
                 for item in info.node.body
                 if isinstance(item, ast.FunctionDef) and item.name == '__init__']
        own = set() if rclpy_base else _self_assigned(inits)
        self.classes.append((qualname, rclpy_super, own))
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    item.name in self.banned:
                self._report(item, item.name, 'overrides a private rclpy member')
        self.generic_visit(node)
        self.classes.pop()

    def _own(self, holder: ast.AST, name: str) -> bool:
        """self.name of the enclosing class's own attribute (not one an rclpy base sets)."""
        if not self.classes or not isinstance(holder, ast.Name) or holder.id != 'self':
            return False
        return name in self.classes[-1][2]

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in self.banned and not self._own(node.value, node.attr):
            self._report(node, node.attr, 'private rclpy member (PRIVATE_MEMBERS)')
        if node.attr.startswith('_') and not node.attr.startswith('__') and \
                isinstance(node.value, ast.Call) and _called_name(node.value) == 'super' and \
                self.classes and self.classes[-1][1]:
            self._report(node, node.attr, 'super() of an rclpy subclass or mixin: private')
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = _called_name(node)
        if name in self.constructors:
            self._report(node, name, 'only rclpy builds it (PRIVATE_MEMBERS __init__)')
        for attr in _attr_names(node):   # getattr(x, '_name') and the like
            if attr in self.banned and not self._own(node.args[0], attr):
                self._report(node, attr, f'private rclpy member by {name}()')
        self.generic_visit(node)


def outside_uses(sources: Dict[str, Tuple[str, str]],
                 apis: Tuple[RclpyApi, RclpyApi]) -> List[Finding]:
    """Private rclpy uses in `sources` ({module: (path, source)}) outside rclpy_internals."""
    _, project = check(sources, [], *apis)
    found = [f for f in private_uses(project) if f.path != INTERNALS]
    for module, (path, source) in sources.items():
        if path != INTERNALS:
            scan = _NameScan(module, path, project)
            scan.visit(ast.parse(source, path))
            found += scan.found
    return sorted(set(found), key=lambda f: (f.path, f.line, f.what))


def _member(finding: Finding) -> str:
    return finding.what.rpartition('.')[2]


def _package_sources() -> Dict[str, Tuple[str, str]]:
    out = {}
    for path in sorted((ROOT / 'edge_llm_ros').rglob('*.py')):
        parts = list(path.relative_to(ROOT).with_suffix('').parts)
        if parts[-1] == '__init__':
            parts.pop()
        out['.'.join(parts)] = (str(path.relative_to(ROOT)), path.read_text())
    return out


@pytest.fixture(scope='module')
def package_findings(apis) -> List[Finding]:
    return outside_uses(_package_sources(), apis)


def test_only_rclpy_internals_touches_private_rclpy_members(package_findings):
    left = list(package_findings)
    assert not left, ('private rclpy members used outside edge_llm_ros/rclpy_internals.py: '
                      'move the use there, with a PRIVATE_MEMBERS entry:\n' +
                      '\n'.join(map(str, left)))


SNIPPET = """
from rclpy.action import ActionClient
from rclpy.action.client import ClientGoalHandle
from rclpy.executors import Executor


class Locked(ActionClient):
    def _get_result_async(self, goal_handle):  # flagged
        return super()._get_result_async(goal_handle)  # flagged

    def fine(self):
        return super().send_goal_async(None)


class Mixin:
    def execute(self, data):
        return self._feedback_callbacks.get(data)  # flagged

    def later(self):
        return super()._cancel_goal_async(None)  # flagged


class Own:
    def __init__(self, executor: Executor):
        self._executor = executor
        self._futures = []

    def pool(self):
        return getattr(self._executor, '_executor', None)  # flagged


class Renderer(Own):
    def more(self):
        return super()._finish()


def recover(client: ActionClient, future, goal_id, response, node):
    client._remove_pending_goal_request(future)  # flagged
    node._state_machine.current_state  # flagged
    return ClientGoalHandle(client, goal_id, response)  # flagged
"""


def test_outside_check_reports_private_uses(apis):
    found = outside_uses({'edge_llm_ros.snippet': ('edge_llm_ros/snippet.py', SNIPPET)}, apis)
    marked = {n for n, line in enumerate(SNIPPET.splitlines(), 1) if re.search('# flagged', line)}
    assert {f.line for f in found} == marked, '\n'.join(map(str, found))
    # The same code inside rclpy_internals is allowed.
    assert not outside_uses({'edge_llm_ros.rclpy_internals': (INTERNALS, SNIPPET)}, apis)
