"""Board profiles: load, validate and resolve them into per-node parameters.

A profile is a ROS 2 parameters file (config/boards/<board>.yaml) with one section per
node, keyed `/**/llm_node` and `/**/perception` so they apply in any namespace. Resolution
merges, later winning:

    schema defaults < profile < machine facts < user params file < launch overrides

"Machine facts" are what detection knows better than a profile (the SM arch of the GPU
actually installed). Every layer is validated on its own so an error names the file it
came from; the merged llm_node values are then checked for consistency and the CPU lists
against the cores this machine has.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import pathlib
import sys
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from edge_llm_ros import safe_yaml
from edge_llm_ros.bringup import parameters
from edge_llm_ros.bringup.affinity import check_cpus, parse_cpu_list, usable_cpus
from edge_llm_ros.bringup.detect import BoardInfo, detect_board
from edge_llm_ros.bringup.errors import ParameterTypeError, ProfileFormatError, UnknownBoardError

PROFILE_SECTIONS = {'/**/llm_node': 'llm_node', '/**/perception': 'perception'}
LAYERS = ('default', 'profile', 'machine', 'params_file', 'override')


def boards_dir() -> pathlib.Path:
    """config/boards of a source checkout, else of the installed package's share folder."""
    here = pathlib.Path(__file__).resolve()
    candidates = [here.parents[2] / 'config' / 'boards',
                  pathlib.Path(sys.prefix) / 'share' / 'edge_llm_ros' / 'config' / 'boards']
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    raise UnknownBoardError('no config/boards folder found (looked in %s)' % ', '.join(
        map(str, candidates)))


def available_boards(config_dir: Optional[pathlib.Path] = None) -> Tuple[str, ...]:
    """Names of the profiles shipped (file stems), sorted."""
    folder = pathlib.Path(config_dir) if config_dir else boards_dir()
    return tuple(sorted(p.stem for p in folder.glob('*.yaml')))


def check_recommended_board(board: str, source: str,
                            config_dir: Optional[pathlib.Path] = None) -> None:
    """Refuse a model family config whose recommended.board names no board profile.

    The runtime reads config/models files without knowing boards; bringup, which owns them,
    checks the family a launch resolves (UnknownBoardError names the file and the boards).
    """
    boards = available_boards(config_dir)
    if board not in boards:
        raise UnknownBoardError('%s: recommended.board: %r is not one of %s' % (
            source, board, ', '.join(boards)))


# ---------------------------------------------------------------------------------------
# ROS parameter files


def _flatten(prefix: str, value: Any, out: Dict[str, Any], source: str) -> None:
    # rclpy stores nested keys as dotted names; a YAML `kv: {max_context: 1}` is kv.max_context.
    if isinstance(value, dict):
        for key, sub in value.items():
            if not isinstance(key, str):
                raise ProfileFormatError('%s: parameter key %r under %r is not a string' % (
                    source, key, prefix))
            _flatten('%s.%s' % (prefix, key) if prefix else key, sub, out, source)
    elif value is None:
        raise ParameterTypeError('%s: %s has no value (YAML `key:` with nothing after it)' % (
            source, prefix))
    else:
        out[prefix] = value


def parse_param_text(text: str, source: str) -> Dict[str, Dict[str, Any]]:
    """ROS params YAML text -> {node key: {flat name: value}}, in file order."""
    doc = _load_yaml(text, source)
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ProfileFormatError('%s: top level must be a mapping of node names to '
                                 '{ros__parameters: ...}, got %s' % (source, type(doc).__name__))
    sections: Dict[str, Dict[str, Any]] = {}
    try:
        _collect_sections('', doc, sections, source)
    except RecursionError:
        raise ProfileFormatError('%s: namespaces or parameters nested too deeply' % source) \
            from None
    return sections


def _load_yaml(text: str, source: str) -> Any:
    """safe_yaml.safe_load_bounded, its refusals as ProfileFormatError."""
    try:
        return safe_yaml.safe_load_bounded(text, source)
    except safe_yaml.YamlFormatError as exc:
        raise ProfileFormatError(str(exc)) from None


def _collect_sections(path: str, node: Dict[Any, Any], out: Dict[str, Dict[str, Any]],
                      source: str) -> None:
    for key, value in node.items():
        key = str(key)
        if key == 'ros__parameters':
            if not path:
                raise ProfileFormatError('%s: ros__parameters must sit under a node name such as '
                                         '/**/llm_node' % source)
            if not isinstance(value, dict):
                raise ProfileFormatError('%s: %s: ros__parameters must be a mapping' % (
                    source, path))
            flat: Dict[str, Any] = {}
            _flatten('', value, flat, '%s: %s' % (source, path))
            out.setdefault(path, {}).update(flat)
        elif isinstance(value, dict):
            # Namespaces may nest: `/robot: {llm_node: {ros__parameters: ...}}`.
            joined = key if not path else '%s/%s' % (path.rstrip('/'), key.lstrip('/'))
            _collect_sections(joined, value, out, source)
        else:
            raise ProfileFormatError('%s: %r under %r is neither a node name nor ros__parameters '
                                     '(parameters go under <node>: ros__parameters:)' % (
                                         source, key, path or '(top level)'))


def read_param_file(path: str) -> Dict[str, Dict[str, Any]]:
    """Read a ROS params file; errors name the file."""
    try:
        text = pathlib.Path(path).read_text()
    except OSError as exc:
        raise ProfileFormatError('cannot read parameters file %s: %s' % (
            path, exc.strerror or exc)) from None
    return parse_param_text(text, str(path))


def node_key_matches(key: str, name: str, namespace: str = '') -> bool:
    """Whether a params-file node key applies to node `name` in `namespace` (rcl wildcards).

    `/**` matches any number of namespace levels, `*` one name; keys without a leading
    slash are relative to the root namespace.
    """
    pattern = [t for t in key.strip('/').split('/') if t]
    target = [t for t in namespace.strip('/').split('/') if t] + [name]
    return _match(pattern, target)


def _match(pattern: List[str], target: List[str]) -> bool:
    if not pattern:
        return not target
    head, rest = pattern[0], pattern[1:]
    if head == '**':
        return any(_match(rest, target[i:]) for i in range(len(target) + 1))
    if not target:
        return False
    return (head == '*' or head == target[0]) and _match(rest, target[1:])


def params_for_node(sections: Mapping[str, Mapping[str, Any]], name: str,
                    namespace: str = '') -> Dict[str, Any]:
    """Merge the sections that apply to one node, in file order."""
    out: Dict[str, Any] = {}
    for key, params in sections.items():
        if node_key_matches(key, name, namespace):
            out.update(params)
    return out


# ---------------------------------------------------------------------------------------
# Profiles


def load_profile(board: str, config_dir: Optional[pathlib.Path] = None
                 ) -> Dict[str, Dict[str, Any]]:
    """Load one shipped profile as validated {node: params} (strict: profiles are ours)."""
    boards = available_boards(config_dir)
    if board not in boards:
        raise UnknownBoardError('unknown board %r; valid boards: auto, %s' % (
            board, ', '.join(boards)))
    folder = pathlib.Path(config_dir) if config_dir else boards_dir()
    path = folder / ('%s.yaml' % board)
    sections = read_param_file(str(path))
    out: Dict[str, Dict[str, Any]] = {}
    for key, params in sections.items():
        node = PROFILE_SECTIONS.get(key)
        if node is None:
            raise ProfileFormatError('%s: section %r is not one of %s' % (
                path, key, ', '.join(PROFILE_SECTIONS)))
        out[node] = parameters.schema(node).validate(params, source=str(path), strict=True)
    llm = out.get('llm_node', {})
    if llm.get('board.name') != board:
        raise ProfileFormatError('%s: /**/llm_node board.name must be %r, got %r' % (
            path, board, llm.get('board.name')))
    return out


@dataclass(frozen=True)
class Resolved:
    """Final parameters per node, and where each value came from."""

    board: str
    detected: BoardInfo
    nodes: Dict[str, Dict[str, Any]]
    origin: Dict[str, Dict[str, str]]
    notes: Tuple[str, ...] = field(default=())

    def llm_params(self) -> Dict[str, Any]:
        """Return the complete llm_node parameter values."""
        return self.nodes['llm_node']


def machine_layer(board: str, profile: Mapping[str, Mapping[str, Any]],
                  detected: BoardInfo) -> Tuple[Dict[str, Dict[str, Any]], Tuple[str, ...]]:
    """Values the detected machine knows better than the profile, with a note for each."""
    llm = profile.get('llm_node', {})
    if detected.board != board or llm.get('cuda.kernel_set', 'none') == 'none':
        return {}, ()
    archs = [g.sm_arch for g in detected.gpus if g.sm_arch]
    if not archs or archs[0] == llm.get('cuda.sm_arch'):
        return {}, ()
    note = "cuda.sm_arch %s from the detected GPU (%s) replaces the profile's %s" % (
        archs[0], detected.gpus[0].name, llm.get('cuda.sm_arch'))
    return {'llm_node': {'cuda.sm_arch': archs[0]}}, (note,)


def resolve(board: str = 'auto', params_file: str = '',
            overrides: Optional[Mapping[str, Mapping[str, Any]]] = None, *,
            nodes: Sequence[str] = ('llm_node',), namespace: str = '', root: str = '/',
            config_dir: Optional[pathlib.Path] = None) -> Resolved:
    """Resolve a board name (or 'auto') into validated parameters for `nodes`.

    `overrides` maps node name -> {parameter: value} (launch arguments). Raises
    UnknownBoardError, ProfileFormatError, UnknownParameterError, ParameterTypeError,
    ParameterRangeError, ThermalError or AffinityError, each naming the value to fix.
    """
    detected = detect_board(root)
    boards = available_boards(config_dir)
    if board == 'auto':
        if not detected.board:
            raise UnknownBoardError('board:=auto found no profile for this machine (%s); pick one '
                                    'of: %s' % (detected.reason, ', '.join(boards)))
        board = detected.board
    profile = load_profile(board, config_dir)
    machine, notes = machine_layer(board, profile, detected)
    user, file_notes = _user_layer(params_file, nodes, namespace)
    extra = {node: parameters.SCHEMAS[node].validate(
        dict(values), source='launch overrides', strict=False)
        if node in parameters.SCHEMAS else dict(values)
        for node, values in (overrides or {}).items()}
    unknown = sorted(set(extra) - set(nodes))
    if unknown:
        raise ProfileFormatError('launch overrides name node(s) %s not launched here (%s)' % (
            ', '.join(unknown), ', '.join(nodes)))
    merged: Dict[str, Dict[str, Any]] = {}
    origin: Dict[str, Dict[str, str]] = {}
    for node in nodes:
        schema = parameters.SCHEMAS.get(node)
        values: Dict[str, Any] = {}
        where: Dict[str, str] = {}
        layers = [('default', schema.defaults() if schema and schema.complete else {}),
                  ('profile', profile.get(node, {})), ('machine', machine.get(node, {})),
                  ('params_file', user.get(node, {})), ('override', extra.get(node, {}))]
        for layer, params in layers:
            for key, value in params.items():
                values[key] = value
                where[key] = layer
        merged[node], origin[node] = values, where
    if 'llm_node' in merged:
        parameters.check_consistency(merged['llm_node'], source='resolved %s profile' % board)
    cpus = usable_cpus(root)
    for node, values in merged.items():
        text = values.get('engine.cpu_affinity', '')
        if isinstance(text, str) and text:
            check_cpus(parse_cpu_list(text), cpus, what='%s engine.cpu_affinity %r (from %s)' % (
                node, text, origin[node]['engine.cpu_affinity']))
    return Resolved(board=board, detected=detected, nodes=merged, origin=origin,
                    notes=notes + file_notes)


def _user_layer(params_file: str, nodes: Sequence[str], namespace: str
                ) -> Tuple[Dict[str, Dict[str, Any]], Tuple[str, ...]]:
    if not params_file:
        return {}, ()
    sections = read_param_file(params_file)
    # A robot-wide file may hold sections for other nodes: say so (a typo shows up here).
    unmatched = [key for key in sections
                 if not any(node_key_matches(key, n, namespace) for n in nodes)]
    notes = ('%s: section(s) %s match no node launched here (%s in namespace %r); ignored' % (
        params_file, ', '.join(unmatched), ', '.join(nodes), namespace or '/'),) \
        if unmatched else ()
    out = {}
    for node in nodes:
        params = params_for_node(sections, node, namespace)
        schema = parameters.SCHEMAS.get(node)
        out[node] = schema.validate(params, source=params_file, strict=False) if schema \
            else params
    return out, notes


def describe(resolved: Resolved) -> List[str]:
    """Human-readable lines: board, detection, each value with its origin."""
    lines = ['board: %s (detected: %s; %s)' % (resolved.board, resolved.detected.board or 'none',
                                               resolved.detected.reason)]
    lines += ['note: %s' % n for n in resolved.notes]
    for node, values in resolved.nodes.items():
        lines.append('%s:' % node)
        for key in sorted(values):
            lines.append('  %s: %r  [%s]' % (key, values[key], resolved.origin[node][key]))
    return lines


def flatten_overrides(pairs: Iterable[str], node: str = 'llm_node') -> Dict[str, Any]:
    """['kv.max_context=4096', ...] -> {'kv.max_context': 4096}.

    Values are read as YAML (numbers, booleans, lists), except for string parameters of
    `node`, which keep their text (so engine.cpu_affinity=1 stays the CPU list '1').
    """
    schema = parameters.SCHEMAS.get(node)
    strings = {s.name for s in schema.specs if s.type is parameters.ParamType.STRING} \
        if schema else set()
    out: Dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition('=')
        key = key.strip()
        if not sep or not key:
            raise ProfileFormatError('override %r is not name=value' % pair)
        if key in strings:
            out[key] = text
            continue
        out[key] = _load_yaml(text, 'override %r' % pair) if text.strip() else ''
    return out
