"""Find the rclpy API some Python code uses (with `ast`), and what an rclpy branch lacks of it.

Used are rclpy modules, classes, functions and members.
The API of a branch comes from test/data/rclpy_api/<branch>.json (every public module, class
with its bases and members, and function, extracted from rclpy's source by
scripts/refresh_test_data.py). Types are followed far enough to know what an attribute
belongs to: names bound by imports, instances built from rclpy classes, `self` in classes
deriving (also through the package's own classes) from rclpy classes, parameters and
functions with annotations, and the return values of the rclpy calls in RETURNS. Class
members are looked up through the bases listed in the JSON.

A use that the older branch lacks is accepted only behind a fallback that a test runs: inside
`if <guard>:` (or after `if not <guard>: ...; return`), where the guard is a function parameter
defaulting to a module constant `NAME = hasattr(X, 'member')`, and some test calls that
function with the parameter set to False (or monkeypatches a constant guard to False).
"""
import ast
from dataclasses import dataclass, field
import enum
import json
import pathlib
from typing import Dict, FrozenSet, Iterable, List, Optional, Set, Tuple

# What rclpy calls return, by the qualified name of the function or method.
RETURNS = {
    'rclpy.create_node': 'rclpy.node.Node',
    'rclpy.get_global_executor': 'rclpy.executors.Executor',
    'rclpy.logging.get_logger': 'rclpy.impl.rcutils_logger.RcutilsLogger',
    'rclpy.node.Node.create_publisher': 'rclpy.publisher.Publisher',
    'rclpy.node.Node.create_subscription': 'rclpy.subscription.Subscription',
    'rclpy.node.Node.create_client': 'rclpy.client.Client',
    'rclpy.node.Node.create_service': 'rclpy.service.Service',
    'rclpy.node.Node.create_timer': 'rclpy.timer.Timer',
    'rclpy.node.Node.create_rate': 'rclpy.timer.Rate',
    'rclpy.node.Node.create_guard_condition': 'rclpy.guard_condition.GuardCondition',
    'rclpy.node.Node.get_clock': 'rclpy.clock.Clock',
    'rclpy.node.Node.get_logger': 'rclpy.impl.rcutils_logger.RcutilsLogger',
    'rclpy.node.Node.get_parameter': 'rclpy.parameter.Parameter',
    'rclpy.node.Node.get_parameter_or': 'rclpy.parameter.Parameter',
    'rclpy.node.Node.declare_parameter': 'rclpy.parameter.Parameter',
    'rclpy.lifecycle.node.LifecycleNodeMixin.create_lifecycle_publisher':
        'rclpy.lifecycle.publisher.LifecyclePublisher',
    'rclpy.clock.Clock.now': 'rclpy.time.Time',
    'rclpy.executors.Executor.create_task': 'rclpy.task.Task',
    'rclpy.client.Client.call_async': 'rclpy.task.Future',
    'rclpy.action.client.ActionClient.send_goal_async': 'rclpy.task.Future',
    'rclpy.action.client.ClientGoalHandle.cancel_goal_async': 'rclpy.task.Future',
    'rclpy.action.client.ClientGoalHandle.get_result_async': 'rclpy.task.Future',
}
# What rclpy properties hold.
PROPERTIES = {
    'rclpy.node.Node.executor': 'rclpy.executors.Executor',
    'rclpy.node.Node.context': 'rclpy.context.Context',
    'rclpy.executors.Executor.context': 'rclpy.context.Context',
}
# Members the extract misses (nested classes, attributes set in __init__), each checked in
# humble's source.
KNOWN_MEMBERS = {
    'rclpy.parameter.Parameter': {'Type'},   # rclpy/parameter.py: class Parameter: class Type
    # rclpy/executors.py, MultiThreadedExecutor.__init__: self._executor = ThreadPoolExecutor()
    'rclpy.executors.MultiThreadedExecutor': {'_executor'},
}

# Bases the JSON names that are not rclpy classes, with the members they bring.
_EXTERNAL_BASES = {
    'object': set(dir(object)),
    'Exception': set(dir(Exception)),
    'Enum': set(dir(enum.Enum)) | {'name', 'value'},
    'IntEnum': set(dir(enum.IntEnum)) | {'name', 'value'},
    'NamedTuple': set(dir(tuple)) | {'_fields', '_replace', '_asdict', '_make'},
}
_TUPLE_FACTORY = 'namedtuple('


@dataclass(frozen=True)
class Sym:
    """What an expression may be.

    kind: module, class, function, value, instance, member (an rclpy method or property: name
    is its defining class + name), pmodule, pclass, pinstance, pfunction (modules, classes and
    functions of the checked code itself).
    """

    kind: str
    name: str


@dataclass(frozen=True)
class Guard:
    """A check that the member `attr` exists.

    how: param (name = function.param), constant (name = module.CONSTANT) or inline (a
    hasattr/getattr that no test can switch).
    """

    attr: str
    how: str
    name: str

    @property
    def key(self) -> str:
        """How a test switches it off: 'function.param' or '.CONSTANT' (see _switched_guards)."""
        if self.how == 'param':
            return '.'.join(self.name.split('.')[-2:])
        return '.' + self.name.rpartition('.')[2]


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str
    why: str

    def __str__(self) -> str:
        return f'{self.path}:{self.line}: {self.what}: {self.why}'


class RclpyApi:
    """One rclpy branch's public API as extracted into test/data/rclpy_api/<branch>.json."""

    def __init__(self, data: dict):
        self.branch = data['branch']
        self.modules: Dict[str, dict] = data['modules']
        self._class_module = {name: module for module, entry in self.modules.items()
                              for name in entry['classes']}
        self._function_module: Dict[str, List[str]] = {}
        for module, entry in self.modules.items():
            for name in entry['functions']:
                self._function_module.setdefault(name, []).append(module)

    @classmethod
    def load(cls, path: pathlib.Path) -> 'RclpyApi':
        return cls(json.loads(pathlib.Path(path).read_text()))

    def has_module(self, name: str) -> bool:
        return name in self.modules

    def has_class(self, qualname: str) -> bool:
        module, _, name = qualname.rpartition('.')
        return name in self.modules.get(module, {}).get('classes', {})

    def has_function(self, qualname: str) -> bool:
        module, _, name = qualname.rpartition('.')
        return name in self.modules.get(module, {}).get('functions', [])

    def lookup(self, module: str, name: str) -> Optional[Sym]:
        """`module.name`: a submodule, class, function or other module-level name."""
        if f'{module}.{name}' in self.modules:
            return Sym('module', f'{module}.{name}')
        entry = self.modules.get(module)
        if entry is None:
            return None
        if name in entry['classes']:
            return Sym('class', f'{module}.{name}')
        if name in entry['functions']:
            return Sym('function', f'{module}.{name}')
        if name in entry['names']:
            # Re-exported (rclpy.action.ActionClient) or imported: find where it is defined.
            if name in self._class_module:
                return Sym('class', f'{self._class_module[name]}.{name}')
            homes = self._function_module.get(name, [])
            if len(homes) == 1:
                return Sym('function', f'{homes[0]}.{name}')
            return Sym('value', f'{module}.{name}')
        return None

    def _base_qualname(self, module: str, base: str) -> Optional[str]:
        if base in self.modules[module]['classes']:
            return f'{module}.{base}'
        if base in self._class_module:
            return f'{self._class_module[base]}.{base}'
        return None

    def subclass_defining(self, qualname: str, attr: str) -> Optional[str]:
        """Find a class deriving from qualname that has attr (the object may be one)."""
        for module, entry in self.modules.items():
            for name in entry['classes']:
                candidate = f'{module}.{name}'
                if candidate != qualname and self._derives(candidate, qualname) and \
                        self.defining_class(candidate, attr)[0]:
                    return candidate
        return None

    def _derives(self, qualname: str, base: str) -> bool:
        module, _, name = qualname.rpartition('.')
        for parent in self.modules[module]['classes'][name]['bases']:
            resolved = self._base_qualname(module, parent)
            if resolved == base or (resolved and self._derives(resolved, base)):
                return True
        return False

    def defining_class(self, qualname: str, attr: str) -> Tuple[Optional[str], bool]:
        """(rclpy class defining attr, whether the answer is certain) along the bases.

        Not certain when a base outside rclpy and the known builtins could bring the member.
        """
        certain = True
        seen: Set[str] = set()
        stack = [qualname]
        while stack:
            current = stack.pop(0)
            if current in seen:
                continue
            seen.add(current)
            module, _, name = current.rpartition('.')
            entry = self.modules.get(module, {}).get('classes', {}).get(name)
            if entry is None:
                certain = False
                continue
            if attr in entry['members'] or attr in KNOWN_MEMBERS.get(current, ()):
                return current, True
            for base in entry['bases']:
                resolved = self._base_qualname(module, base)
                if resolved is not None:
                    stack.append(resolved)
                elif base.startswith(_TUPLE_FACTORY):
                    if attr in _EXTERNAL_BASES['NamedTuple']:
                        return current, True
                elif base in _EXTERNAL_BASES:
                    if attr in _EXTERNAL_BASES[base]:
                        return current, True
                else:
                    certain = False
        return None, certain or attr in _EXTERNAL_BASES['object']


@dataclass
class _ClassInfo:
    qualname: str
    module: str
    node: ast.ClassDef
    bases: Set[Sym] = field(default_factory=set)
    attrs: Dict[str, Set[Sym]] = field(default_factory=dict)   # self.x and class-body names
    methods: Dict[str, ast.AST] = field(default_factory=dict)


@dataclass
class _Use:
    path: str
    line: int
    owner: Sym            # module, class or instance whose member is used; 'import' for imports
    attr: str
    guards: FrozenSet[Guard]
    override: bool = False


class _Scope:
    def __init__(self, parent: Optional['_Scope'], module: str, cls: Optional[str] = None,
                 function: Optional[str] = None):
        self.parent = parent
        self.module = module
        self.cls = cls
        self.function = function
        self.vars: Dict[str, Set[Sym]] = {}
        self.guards: Dict[str, Guard] = {}

    def _find(self, table: str, name: str):
        """Look name up in this scope's table ('vars' or 'guards'), then the enclosing ones."""
        scope: Optional[_Scope] = self
        while scope is not None:
            if name in getattr(scope, table):
                return getattr(scope, table)[name]
            scope = scope.parent
        return None

    def get(self, name: str) -> Set[Sym]:
        return self._find('vars', name) or set()

    def guard(self, name: str) -> Optional[Guard]:
        return self._find('guards', name)

    def bind(self, name: str, types: Iterable[Sym]) -> None:
        self.vars.setdefault(name, set()).update(types)


def _is_rclpy(module: str) -> bool:
    return module == 'rclpy' or module.startswith('rclpy.')


def _const_str(node: Optional[ast.AST]) -> Optional[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _call_name(node: ast.AST) -> Optional[str]:
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Name):
            return node.func.id
        if isinstance(node.func, ast.Attribute):
            return node.func.attr
    return None


def _hasattr_member(node: ast.AST) -> Optional[str]:
    """'m' for hasattr(x, 'm') and getattr(x, 'm', None) is not None."""
    if _call_name(node) == 'hasattr' and len(node.args) == 2:
        return _const_str(node.args[1])
    if (isinstance(node, ast.Compare) and len(node.ops) == 1 and
            isinstance(node.ops[0], ast.IsNot) and _call_name(node.left) == 'getattr'):
        return _const_str(node.left.args[1]) if len(node.left.args) >= 2 else None
    return None


_TERMINAL = (ast.Return, ast.Raise, ast.Continue, ast.Break)
_BLOCKS = ('body', 'orelse', 'finalbody')


class Project:
    """The checked code: modules by dotted name, their classes, functions and rclpy uses."""

    def __init__(self, current: RclpyApi, older: RclpyApi):
        self.current = current     # the branch the code is written and run against (types)
        self.older = older         # the branch every use must exist in
        self.trees: Dict[str, Tuple[str, ast.Module]] = {}
        self.classes: Dict[str, _ClassInfo] = {}
        self.functions: Dict[str, ast.AST] = {}
        self._namespaces: Dict[str, _Scope] = {}
        self._building: Set[str] = set()
        self.uses: List[_Use] = []

    # ---- loading --------------------------------------------------------------------------
    def add_source(self, module: str, path: str, source: str) -> None:
        self.trees[module] = (path, ast.parse(source, path))

    def analyse(self) -> None:
        for module, (_, tree) in self.trees.items():
            self._register(module, tree, module)
        for info in self.classes.values():
            scope = self.scope_of(info.qualname.rpartition('.')[0])
            for base in info.node.bases:
                info.bases |= self._class_types(self.infer(base, scope))
        for _ in range(2):   # self attributes may depend on each other: settle them
            for info in self.classes.values():
                self._collect_attrs(info)
        for module, (path, tree) in self.trees.items():
            _UseVisitor(self, module, path).run(tree)

    def _register(self, module: str, tree: ast.AST, prefix: str) -> None:
        for node in ast.iter_child_nodes(tree):
            if isinstance(node, ast.ClassDef):
                qualname = f'{prefix}.{node.name}'
                info = _ClassInfo(qualname, module, node)
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        info.methods[item.name] = item
                self.classes[qualname] = info
                self._register(module, node, qualname)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[f'{prefix}.{node.name}'] = node
                self._register(module, node, f'{prefix}.{node.name}')
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                self._register(module, node, prefix)

    # ---- namespaces -----------------------------------------------------------------------
    def namespace(self, module: str) -> _Scope:
        if module in self._namespaces:
            return self._namespaces[module]
        scope = _Scope(None, module)
        if module in self._building or module not in self.trees:
            return scope
        self._building.add(module)
        self.bind_block(self.trees[module][1].body, scope, prefix=module)
        self._building.discard(module)
        self._namespaces[module] = scope
        return scope

    def module_attr(self, module: str, name: str) -> Set[Sym]:
        """Types of `name` imported from a module: rclpy's, or one of the checked code."""
        if _is_rclpy(module):
            found = self.current.lookup(module, name) or self.older.lookup(module, name)
            return {found} if found else set()
        if f'{module}.{name}' in self.trees:
            return {Sym('pmodule', f'{module}.{name}')}
        if module in self.trees:
            return set(self.namespace(module).get(name))
        return set()

    def bind_import(self, node: ast.AST, scope: _Scope) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    scope.bind(alias.asname, self._module_sym(alias.name))
                else:
                    top = alias.name.split('.')[0]
                    scope.bind(top, self._module_sym(top))
            return
        module = self._absolute(node, scope.module)
        for alias in node.names:
            if alias.name != '*':
                scope.bind(alias.asname or alias.name, self.module_attr(module, alias.name))

    def _module_sym(self, name: str) -> Set[Sym]:
        if _is_rclpy(name):
            return {Sym('module', name)}
        if name in self.trees:
            return {Sym('pmodule', name)}
        return set()

    def _absolute(self, node: ast.ImportFrom, module: str) -> str:
        if not node.level:
            return node.module or ''
        package = module.split('.')
        is_package = self.trees.get(module, ('',))[0].endswith('__init__.py')
        base = package if is_package else package[:-1]
        base = base[:len(base) - (node.level - 1)]
        return '.'.join(base + ([node.module] if node.module else []))

    def bind_block(self, body: List[ast.stmt], scope: _Scope, prefix: str) -> None:
        """Bind the names a block of statements assigns (flow-insensitive: union)."""
        for stmt in body:
            self.bind_statement(stmt, scope, prefix)

    def bind_statement(self, stmt: ast.stmt, scope: _Scope, prefix: str) -> None:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            self.bind_import(stmt, scope)
        elif isinstance(stmt, ast.ClassDef):
            scope.bind(stmt.name, {Sym('pclass', f'{prefix}.{stmt.name}')})
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scope.bind(stmt.name, {Sym('pfunction', f'{prefix}.{stmt.name}')})
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            types = self.infer(stmt.value, scope) if stmt.value is not None else set()
            if isinstance(stmt, ast.AnnAssign):
                types |= self.annotation(stmt.annotation, scope)
            member = _hasattr_member(stmt.value) if stmt.value is not None else None
            for target in targets:
                if isinstance(target, ast.Name):
                    scope.bind(target.id, types)
                    if member is not None and scope.function is None:
                        scope.guards[target.id] = Guard(member, 'constant',
                                                        f'{scope.module}.{target.id}')
                    elif isinstance(stmt.value, ast.Name) and scope.guard(stmt.value.id):
                        scope.guards[target.id] = scope.guard(stmt.value.id)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                if isinstance(item.optional_vars, ast.Name):
                    scope.bind(item.optional_vars.id, self.infer(item.context_expr, scope))
        for name in _BLOCKS:
            block = getattr(stmt, name, None)
            if isinstance(block, list) and not isinstance(
                    stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.bind_block(block, scope, prefix)
        for handler in getattr(stmt, 'handlers', []):
            self.bind_block(handler.body, scope, prefix)

    def scope_of(self, prefix: str) -> _Scope:
        """Give the scope that a body under prefix (a module, class or function) sees."""
        if prefix in self.trees:
            return self.namespace(prefix)
        parent = prefix.rpartition('.')[0]
        if prefix in self.classes or prefix not in self.functions:
            return self.scope_of(parent)   # class bodies make no closure
        method_of = parent if parent in self.classes else None
        return self.function_scope(self.functions[prefix], self.scope_of(parent), method_of,
                                   prefix)

    def function_scope(self, func: ast.AST, parent: _Scope, method_of: Optional[str],
                       qualname: str) -> _Scope:
        """Names inside a function: parameters (annotations, self) and assignments."""
        cls = method_of or parent.cls
        scope = _Scope(parent, parent.module, cls, qualname)
        args = func.args
        positional = args.posonlyargs + args.args
        decorators = {getattr(d, 'id', getattr(d, 'attr', None)) for d in func.decorator_list}
        for index, arg in enumerate(positional + args.kwonlyargs):
            if arg.annotation is not None:
                scope.bind(arg.arg, self.annotation(arg.annotation, parent))
            if method_of is not None and index == 0 and 'staticmethod' not in decorators:
                kind = 'pclass' if 'classmethod' in decorators else 'pinstance'
                scope.bind(arg.arg, {Sym(kind, method_of)})
        defaults = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
        defaults += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
        for arg, default in defaults:
            guard = self._guard_of(default, parent)
            if guard is not None:
                scope.guards[arg.arg] = Guard(guard.attr, 'param', f'{qualname}.{arg.arg}')
        for _ in range(2):
            self.bind_block(func.body, scope, qualname)
        return scope

    def _guard_of(self, node: ast.AST, scope: _Scope) -> Optional[Guard]:
        if isinstance(node, ast.Name):
            return scope.guard(node.id)
        if isinstance(node, ast.Attribute):
            for owner in self.infer(node.value, scope):
                if owner.kind == 'pmodule':
                    found = self.namespace(owner.name).guard(node.attr)
                    if found is not None:
                        return found
        return None

    def _collect_attrs(self, info: _ClassInfo) -> None:
        outer = self.scope_of(info.qualname.rpartition('.')[0])
        for item in info.node.body:
            if isinstance(item, (ast.Assign, ast.AnnAssign)):
                class_scope = _Scope(outer, info.module)
                self.bind_statement(item, class_scope, info.qualname)
                for name, types in class_scope.vars.items():
                    info.attrs.setdefault(name, set()).update(types)
        for name, method in info.methods.items():
            scope = self.function_scope(method, outer, info.qualname, f'{info.qualname}.{name}')
            if not method.args.args:
                continue
            me = method.args.args[0].arg
            for node in ast.walk(method):
                targets: List[ast.AST] = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, ast.AnnAssign):
                    targets = [node.target]
                for target in targets:
                    if (isinstance(target, ast.Attribute) and
                            isinstance(target.value, ast.Name) and target.value.id == me):
                        types = self.infer(node.value, scope) if node.value else set()
                        if isinstance(node, ast.AnnAssign):
                            types |= self.annotation(node.annotation, scope)
                        info.attrs.setdefault(target.attr, set()).update(types)

    # ---- types ----------------------------------------------------------------------------
    def _class_types(self, types: Iterable[Sym]) -> Set[Sym]:
        return {t for t in types if t.kind in ('class', 'pclass')}

    def annotation(self, node: ast.AST, scope: _Scope) -> Set[Sym]:
        """Instances an annotation allows: X, Optional[X], Union[X, Y], X | None, 'X'."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                node = ast.parse(node.value, mode='eval').body
            except SyntaxError:
                return set()
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return self.annotation(node.left, scope) | self.annotation(node.right, scope)
        if isinstance(node, ast.Subscript):
            wrapper = getattr(node.value, 'id', getattr(node.value, 'attr', ''))
            if wrapper in ('Optional', 'Union'):
                inner = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                return set().union(*(self.annotation(e, scope) for e in inner))
            return set()
        return self._instances(self.infer(node, scope))

    def _instances(self, types: Iterable[Sym]) -> Set[Sym]:
        out = set()
        for t in types:
            if t.kind == 'class':
                out.add(Sym('instance', t.name))
            elif t.kind == 'pclass':
                out.add(Sym('pinstance', t.name))
        return out

    def class_chain(self, qualname: str) -> Tuple[List[_ClassInfo], Set[str]]:
        """List the checked code's classes from qualname up, and the rclpy classes above."""
        local: List[_ClassInfo] = []
        rclpy_bases: Set[str] = set()
        stack = [qualname]
        while stack:
            current = stack.pop(0)
            info = self.classes.get(current)
            if info is None or info in local:
                continue
            local.append(info)
            for base in info.bases:
                if base.kind == 'pclass':
                    stack.append(base.name)
                else:
                    rclpy_bases.add(base.name)
        return local, rclpy_bases

    def local_member(self, qualname: str, attr: str) -> Optional[Set[Sym]]:
        """Types of attr when the checked code's class chain defines it, else None."""
        for info in self.class_chain(qualname)[0]:
            if attr in info.methods:
                return {Sym('pfunction', f'{info.qualname}.{attr}')}
            if attr in info.attrs:
                return info.attrs[attr]
        return None

    def member(self, owner: Sym, attr: str) -> Set[Sym]:
        """Types of owner.attr."""
        if owner.kind == 'module':
            found = self.current.lookup(owner.name, attr) or self.older.lookup(owner.name, attr)
            return {found} if found else set()
        if owner.kind == 'pmodule':
            return self.module_attr(owner.name, attr)
        if owner.kind in ('pclass', 'pinstance'):
            local = self.local_member(owner.name, attr)
            if local is not None:
                return local
            return set().union(*(self.member(Sym(owner.kind.lstrip('p'), base), attr)
                                 for base in self.class_chain(owner.name)[1]))
        if owner.kind in ('class', 'instance'):
            defining, _ = self.current.defining_class(owner.name, attr)
            if defining is None:
                defining, _ = self.older.defining_class(owner.name, attr)
            if defining is None:
                return set()
            qualname = f'{defining}.{attr}'
            if owner.kind == 'instance' and qualname in PROPERTIES:
                return {Sym('instance', PROPERTIES[qualname])}
            return {Sym('member', qualname)}
        return set()

    def infer(self, node: Optional[ast.AST], scope: _Scope) -> Set[Sym]:
        if node is None:
            return set()
        if isinstance(node, ast.Name):
            return set(scope.get(node.id))
        if isinstance(node, ast.Attribute):
            return set().union(*(self.member(owner, node.attr)
                                 for owner in self.infer(node.value, scope)))
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id == 'super':
                return {Sym('pinstance', scope.cls)} if scope.cls else set()
            return self._call_result(self.infer(node.func, scope))
        if isinstance(node, ast.IfExp):
            return self.infer(node.body, scope) | self.infer(node.orelse, scope)
        if isinstance(node, ast.BoolOp):
            return set().union(*(self.infer(value, scope) for value in node.values))
        if isinstance(node, ast.NamedExpr):
            return self.infer(node.value, scope)
        return set()

    def _call_result(self, callees: Set[Sym]) -> Set[Sym]:
        out = self._instances(callees)
        for callee in callees:
            if callee.kind in ('function', 'member') and callee.name in RETURNS:
                out.add(Sym('instance', RETURNS[callee.name]))
            elif callee.kind == 'pfunction' and callee.name in self.functions:
                func = self.functions[callee.name]
                if func.returns is not None:
                    module = self._module_of(callee.name)
                    out |= self.annotation(func.returns, self.namespace(module))
        return out

    def _module_of(self, qualname: str) -> str:
        parts = qualname.split('.')
        for end in range(len(parts), 0, -1):
            if '.'.join(parts[:end]) in self.trees:
                return '.'.join(parts[:end])
        return ''

    # ---- findings -------------------------------------------------------------------------
    def findings(self, test_trees: Iterable[ast.AST]) -> List[Finding]:
        switched = _switched_guards(test_trees)
        out = []
        for use in self.uses:
            problem = self._missing(use)
            if problem is None:
                continue
            what, why = problem
            guards = [g for g in use.guards if g.attr == use.attr]
            if use.override:
                out.append(Finding(use.path, use.line, what, why + (
                    ': do not rely on it; put the behaviour where both branches call it')))
            elif not guards:
                out.append(Finding(use.path, use.line, what, why + (
                    ': call it behind a fallback (edge_llm_ros/rclpy_compat.py) whose '
                    f'{self.older.branch} branch a test runs')))
            elif not any(g.how in ('param', 'constant') and g.key in switched for g in guards):
                names = ', '.join(sorted(f'{g.how} {g.name}' for g in guards))
                out.append(Finding(use.path, use.line, what, (
                    f'{why}; its fallback ({names}) is not run by any test: make the check a '
                    'parameter defaulting to a module constant NAME = hasattr(...) and call '
                    'the function with it set to False in a test (or monkeypatch a constant '
                    'guard to False with setattr)')))
        return out

    def _missing(self, use: _Use) -> Optional[Tuple[str, str]]:
        """Say (what, why) when the older branch lacks what this use needs."""
        older, current = self.older, self.current
        owner, attr = use.owner, use.attr
        if owner.kind == 'import':
            if not older.has_module(attr):
                return attr, f'module not in rclpy {older.branch}'
            return None
        if owner.kind in ('pclass', 'pinstance'):
            if use.override:
                bases = self.class_chain(owner.name)[1]
                if bases and not any(older.defining_class(b, attr)[0] for b in bases) and any(
                        current.defining_class(b, attr)[0] for b in bases):
                    return (f'{owner.name}.{attr}',
                            f'overrides a member rclpy {older.branch} lacks (never called there)')
                return None
            if self.local_member(owner.name, attr) is not None:
                return None
            bases = self.class_chain(owner.name)[1]
            kind = owner.kind.lstrip('p')
            problems = [self._missing(_Use(use.path, use.line, Sym(kind, base), attr, use.guards))
                        for base in bases if older.has_class(base)]
            if problems and all(problems):
                return problems[0]
            return None
        what = f'{owner.name}.{attr}'
        if owner.kind == 'module':
            if not _is_rclpy(owner.name) or not older.has_module(owner.name):
                return None
            if older.lookup(owner.name, attr) is None:
                where = 'only in ' + current.branch if current.lookup(owner.name, attr) else \
                    f'in neither {older.branch} nor {current.branch}'
                return what, f'not in rclpy {older.branch} ({where})'
            return None
        if owner.kind in ('class', 'instance') and older.has_class(owner.name):
            if attr.startswith('__') and attr.endswith('__'):
                return None
            defining, certain = older.defining_class(owner.name, attr)
            if defining is not None or not certain or older.subclass_defining(owner.name, attr):
                return None
            where = 'only in ' + current.branch if current.defining_class(owner.name, attr)[0] \
                else (f'in neither extract: if it is an instance attribute or nested class of '
                      f'both, add it to KNOWN_MEMBERS in {pathlib.Path(__file__).name}')
            return what, f'not a member in rclpy {older.branch} ({where})'
        return None


def _private(attr: str) -> bool:
    return attr.startswith('_') and not (attr.startswith('__') and attr.endswith('__'))


def private_uses(project: Project) -> List[Finding]:
    """Private rclpy members (`_name`) the walk sees used (test_rclpy_internals: only there).

    Attributes of rclpy modules, classes and instances, private rclpy modules imported, and
    in the checked code's subclasses of rclpy classes, overrides of a private member an rclpy
    base defines, and uses of one the subclass does not define itself (self._x, super()._x).
    Instance attributes (absent from the extracts) are found only by name: see the test.
    """
    out = []
    for use in project.uses:
        owner, attr = use.owner, use.attr
        if owner.kind == 'import':
            if any(_private(part) for part in attr.split('.')):
                out.append(Finding(use.path, use.line, attr, 'private rclpy module'))
            continue
        if not _private(attr):
            continue
        if owner.kind in ('class', 'instance', 'member') or (
                owner.kind == 'module' and _is_rclpy(owner.name)):
            out.append(Finding(use.path, use.line, f'{owner.name}.{attr}',
                               'private member of an rclpy object'))
        elif owner.kind in ('pclass', 'pinstance'):
            if not use.override and project.local_member(owner.name, attr) is not None:
                continue   # the subclass's own member
            defining = sorted({found for base in project.class_chain(owner.name)[1]
                               for api in (project.current, project.older)
                               for found in [api.defining_class(base, attr)[0]] if found})
            if defining:
                how = 'overrides' if use.override else 'uses'
                out.append(Finding(use.path, use.line, f'{defining[0]}.{attr}',
                                   f'{owner.name} {how} a private member of its rclpy base'))
    return out


def _switched_guards(trees: Iterable[ast.AST]) -> Set[str]:
    """Guards some test turns off: f(..., param=False) and setattr(module, 'CONST', False)."""
    switched = set()
    for tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = _call_name(node)
            for keyword in node.keywords:
                if (keyword.arg and isinstance(keyword.value, ast.Constant) and
                        keyword.value.value is False):
                    switched.add(f'{name}.{keyword.arg}')
            if (name == 'setattr' and len(node.args) == 3 and
                    isinstance(node.args[2], ast.Constant) and node.args[2].value is False):
                constant = _const_str(node.args[1])
                if constant:
                    switched.add(f'.{constant}')
    return switched


class _UseVisitor:
    """Walks one module, recording each rclpy use with the guards around it."""

    def __init__(self, project: Project, module: str, path: str):
        self.project = project
        self.module = module
        self.path = path
        self.guards: List[FrozenSet[Guard]] = []

    def run(self, tree: ast.Module) -> None:
        self.block(tree.body, self.project.namespace(self.module), self.module)

    def _record(self, node: ast.AST, owner: Sym, attr: str, override: bool = False) -> None:
        active = frozenset().union(*self.guards) if self.guards else frozenset()
        self.project.uses.append(_Use(self.path, getattr(node, 'lineno', 0), owner, attr,
                                      active, override))

    def block(self, body: List[ast.stmt], scope: _Scope, prefix: str) -> None:
        pushed = 0
        for stmt in body:
            self.statement(stmt, scope, prefix)
            if (isinstance(stmt, ast.If) and not stmt.orelse and stmt.body and
                    isinstance(stmt.body[-1], _TERMINAL)):
                # `if not guard: fallback; return`: the rest of the block runs only when true.
                self.guards.append(self._guard_terms(stmt.test, scope)[1])
                pushed += 1
        del self.guards[len(self.guards) - pushed:]

    def statement(self, stmt: ast.stmt, scope: _Scope, prefix: str) -> None:
        project = self.project
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for expr in [*stmt.decorator_list, *stmt.args.defaults,
                         *[d for d in stmt.args.kw_defaults if d is not None]]:
                self.expression(expr, scope)
            qualname = f'{prefix}.{stmt.name}'
            cls = prefix if prefix in project.classes else None
            if cls is not None:
                self._record(stmt, Sym('pclass', cls), stmt.name, override=True)
            inner = project.function_scope(stmt, scope, cls, qualname)
            self.block(stmt.body, inner, qualname)
            return
        if isinstance(stmt, ast.ClassDef):
            for expr in [*stmt.bases, *stmt.decorator_list]:
                self.expression(expr, scope)
            class_scope = _Scope(scope, scope.module, scope.cls, scope.function)
            self.block(stmt.body, class_scope, f'{prefix}.{stmt.name}')
            return
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if _is_rclpy(alias.name):
                    self._record(stmt, Sym('import', ''), alias.name)
            return
        if isinstance(stmt, ast.ImportFrom):
            module = project._absolute(stmt, self.module)
            if _is_rclpy(module):
                self._record(stmt, Sym('import', ''), module)
                for alias in stmt.names:
                    if alias.name != '*':
                        self._record(stmt, Sym('module', module), alias.name)
            return
        if isinstance(stmt, (ast.If, ast.While)):
            self.expression(stmt.test, scope)
            positive, negative = self._guard_terms(stmt.test, scope)
            self.guards.append(positive)
            self.block(stmt.body, scope, prefix)
            self.guards[-1] = negative
            self.block(stmt.orelse, scope, prefix)
            self.guards.pop()
            return
        for name, value in ast.iter_fields(stmt):
            if name in _BLOCKS or name == 'handlers':
                continue
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.AST):
                    self.expression(child, scope)
        for name in _BLOCKS:
            if isinstance(getattr(stmt, name, None), list):
                self.block(getattr(stmt, name), scope, prefix)
        for handler in getattr(stmt, 'handlers', []):
            if handler.type is not None:
                self.expression(handler.type, scope)
            self.block(handler.body, scope, prefix)

    def expression(self, node: ast.AST, scope: _Scope) -> None:
        project = self.project
        if isinstance(node, ast.Attribute):
            for owner in project.infer(node.value, scope):
                self._record(node, owner, node.attr)
        elif isinstance(node, ast.Call) and _call_name(node) == 'getattr' and \
                isinstance(node.func, ast.Name) and len(node.args) >= 2:
            attr = _const_str(node.args[1])
            if attr is not None:
                extra = [frozenset({Guard(attr, 'inline', f'{self.path}:{node.lineno}')})] \
                    if len(node.args) == 3 else []
                self.guards.extend(extra)
                for owner in project.infer(node.args[0], scope):
                    self._record(node, owner, attr)
                del self.guards[len(self.guards) - len(extra):]
        elif isinstance(node, ast.IfExp):
            self.expression(node.test, scope)
            positive, negative = self._guard_terms(node.test, scope)
            for guard, branch in ((positive, node.body), (negative, node.orelse)):
                self.guards.append(guard)
                self.expression(branch, scope)
                self.guards.pop()
            return
        elif isinstance(node, ast.Lambda):
            inner = _Scope(scope, scope.module, scope.cls, scope.function)
            self.expression(node.body, inner)
            return
        for child in ast.iter_child_nodes(node):
            self.expression(child, scope)

    def _guard_terms(self, test: ast.AST,
                     scope: _Scope) -> Tuple[FrozenSet[Guard], FrozenSet[Guard]]:
        """Guards known true when the test is true, and when it is false."""
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            positive, negative = self._guard_terms(test.operand, scope)
            return negative, positive
        if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
            return frozenset().union(*(self._guard_terms(v, scope)[0] for v in test.values)), \
                frozenset()
        if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
            return frozenset(), \
                frozenset().union(*(self._guard_terms(v, scope)[1] for v in test.values))
        member = _hasattr_member(test)
        if member is not None:
            return frozenset({Guard(member, 'inline', f'{self.path}:{test.lineno}')}), \
                frozenset()
        guard = self.project._guard_of(test, scope)
        return (frozenset({guard}) if guard else frozenset()), frozenset()


def check(sources: Dict[str, Tuple[str, str]], tests: Iterable[str], current: RclpyApi,
          older: RclpyApi) -> Tuple[List[Finding], Project]:
    """Check {module: (path, source)} against `older`; `tests` are test sources (fallbacks)."""
    project = Project(current, older)
    for module, (path, source) in sources.items():
        project.add_source(module, path, source)
    project.analyse()
    return project.findings(ast.parse(source) for source in tests), project
