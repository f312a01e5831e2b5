"""Everything the launch files decide, as plain data (launch/launch_ros are not needed here).

launch/edge_llm.launch.py and launch/perception_pipeline.launch.py declare the arguments
listed here and wrap each `NodeLaunch` into a launch_ros Node / LifecycleNode, nothing
more, so every decision (board resolution, parameter merging, validation, environment) is
tested without ROS installed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import pathlib
from typing import Any, Dict, List, Mapping, Optional, Tuple

from edge_llm_ros.bringup import profiles
from edge_llm_ros.bringup.errors import BringupError, ParameterRangeError, UnknownBoardError
from edge_llm_ros.runtime.model_config import (available_families, ModelConfigError,
                                               ModelFamilyConfig, resolve_model)

PACKAGE = 'edge_llm_ros'
LOG_LEVELS = ('debug', 'info', 'warn', 'error', 'fatal')

# Pool wiring of the perception pipeline: frame_source writes frames into pool FRAMES_POOL,
# perception maps them and writes embeddings into EMBEDDINGS_POOL, whose handles travel in
# Generate goals to llm_node (a handle names its pool, so llm_node needs no setting). All
# three find each other's sockets in the ipc default socket folder of this host.
FRAMES_POOL = 'frames'
EMBEDDINGS_POOL = 'embeddings'
PIPELINE_WIRING: Dict[str, Dict[str, Any]] = {
    'frame_source': {'pool.id': FRAMES_POOL},
    'perception': {'input.pool_id': FRAMES_POOL, 'pool.id': EMBEDDINGS_POOL},
}

# numpy's BLAS and OpenMP pools would start one thread per core beside ORT's own pool and
# compete with it on the pinned cores; the nodes use NumPy only for small per-token work.
NODE_ENV = {'OMP_NUM_THREADS': '1', 'OPENBLAS_NUM_THREADS': '1'}


@dataclass(frozen=True)
class LaunchArgument:
    """One DeclareLaunchArgument."""

    name: str
    default: str
    description: str
    choices: Tuple[str, ...] = ()


def llm_arguments() -> Tuple[LaunchArgument, ...]:
    """Arguments of edge_llm.launch.py."""
    boards = profiles.available_boards()
    return (
        LaunchArgument('board', 'auto', 'Board profile (config/boards): auto detects this '
                       'machine', ('auto',) + boards),
        LaunchArgument('model', '', 'A converted model folder (sets model.path; its family '
                       'config is matched from model.yaml), or a model family config name '
                       '(config/models: ' + ', '.join(_families()) + ') or .yaml file (sets '
                       "model.family for the configured model.path); '' keeps the "
                       'profile/params-file values (the embedded SmolLM2 by default)'),
        LaunchArgument('params_file', '', 'ROS parameters YAML merged over the board profile'),
        LaunchArgument('namespace', '', 'Namespace of the launched nodes'),
        LaunchArgument('log_level', 'info', 'Log level of the launched nodes', LOG_LEVELS),
        LaunchArgument('autostart', 'true', 'Configure and activate llm_node on start-up',
                       ('true', 'false')),
    )


def pipeline_arguments() -> Tuple[LaunchArgument, ...]:
    """Arguments of perception_pipeline.launch.py (the llm ones plus the frame source)."""
    return llm_arguments() + (
        LaunchArgument('frame_source', '', "frame_source's input ('synthetic', a video file, "
                       "an image folder or a V4L2 device); '' keeps the params-file value"),
    )


class ModelArgumentError(BringupError, ValueError):
    """`model:=` names neither a converted model folder nor a model family config."""


def _families() -> Tuple[str, ...]:
    try:
        return available_families()
    except ModelConfigError:   # no config/models installed: the description just says less
        return ()


@dataclass(frozen=True)
class ModelChoice:
    """What `model:=` resolved to: llm_node parameters to set and a line for the log."""

    parameters: Dict[str, Any]
    message: str


def resolve_model_argument(spec: str) -> ModelChoice:
    """Resolve `model:=` with engine.model_config.resolve_model (at launch, not at configure).

    A folder becomes model.path; the engine matches its family from model.yaml (a model no
    family matches runs with generic defaults: said in the message, not an error). A family
    name or a family .yaml file becomes model.family for the model.path the profile or
    params file gives. Anything else raises ModelArgumentError listing the families, and so
    does a family whose recommended.board names no board profile (bringup owns the boards).
    """
    if not spec:
        return ModelChoice({}, '')
    folder = pathlib.Path(spec)
    if folder.is_dir():
        if not (folder / 'model.yaml').is_file():
            raise ModelArgumentError(
                f'launch argument model:={spec} is a folder without model.yaml, so not a '
                'converted model: convert the model first (edge-llm-convert) or give its '
                'output folder')
        try:
            family = _family(spec)
        except ModelConfigError as exc:
            return ModelChoice({'model.path': spec},
                               f'model {spec}: {exc}; served with generic defaults')
        return ModelChoice({'model.path': spec}, f'model {spec}: family {family.family}')
    try:
        family = _family(spec)
    except ModelConfigError as exc:
        raise ModelArgumentError(
            f'launch argument model:={spec} is neither a converted model folder (no such '
            f'folder) nor a model family config: {exc}') from None
    return ModelChoice({'model.family': spec}, f'model family {family.family} '
                       f'({family.description}) for the configured model.path')


def _family(spec: str) -> ModelFamilyConfig:
    """resolve_model; a family recommending a board with no profile is a ModelArgumentError."""
    family = resolve_model(spec)
    try:
        profiles.check_recommended_board(family.recommended_board, family.source)
    except UnknownBoardError as exc:
        raise ModelArgumentError(f'launch argument model:={spec}: {exc}: fix the family '
                                 'config') from None
    return family


@dataclass(frozen=True)
class NodeLaunch:
    """One node to start, in the terms of launch_ros.actions.Node."""

    executable: str
    name: str
    namespace: str
    parameters: Dict[str, Any]
    log_level: str
    lifecycle: bool = False
    env: Dict[str, str] = field(default_factory=dict)
    package: str = PACKAGE

    def node_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments for launch_ros.actions.Node / LifecycleNode."""
        return {
            'package': self.package, 'executable': self.executable, 'name': self.name,
            'namespace': self.namespace, 'parameters': [dict(self.parameters)],
            'ros_arguments': ['--log-level', self.log_level],
            'additional_env': dict(self.env), 'output': 'screen',
        }


@dataclass(frozen=True)
class LaunchPlan:
    """The resolved board and the nodes to start; `messages` are logged by the launch file."""

    board: str
    nodes: Tuple[NodeLaunch, ...]
    messages: Tuple[str, ...]


def _parse_bool(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value not in ('true', 'false'):
        raise ParameterRangeError('launch argument %s:=%r must be true or false' % (name, text))
    return value == 'true'


def _check_choice(name: str, text: str, choices: Tuple[str, ...]) -> str:
    if text not in choices:
        raise ParameterRangeError('launch argument %s:=%r must be one of %s' % (
            name, text, ', '.join(choices)))
    return text


def node_parameters(values: Mapping[str, Any]) -> Dict[str, Any]:
    """Parameters as launch_ros should pass them: empty lists left out.

    launch_ros writes them to a YAML file that rcl reads back, and rcl cannot type an
    empty YAML list; every list parameter that may be empty has an empty default.
    """
    return {k: v for k, v in values.items() if not (isinstance(v, list) and not v)}


def llm_plan(board: str = 'auto', model: str = '', params_file: str = '', namespace: str = '',
             log_level: str = 'info', autostart: str = 'true', *, root: str = '/',
             extra: Optional[Mapping[str, Mapping[str, Any]]] = None
             ) -> Tuple[profiles.Resolved, NodeLaunch, Tuple[str, ...]]:
    """Resolve the board and build llm_node's launch description.

    Returns the resolution, the node and the log lines. `extra` maps further launched nodes
    to their launch overrides (the top layer).
    """
    level = _check_choice('log_level', log_level, LOG_LEVELS)
    overrides: Dict[str, Any] = {'autostart': _parse_bool('autostart', autostart)}
    choice = resolve_model_argument(model)
    overrides.update(choice.parameters)
    layers = {'llm_node': overrides, **{k: dict(v) for k, v in (extra or {}).items()}}
    resolved = profiles.resolve(board, params_file, layers, nodes=tuple(layers),
                                namespace=namespace, root=root)
    node = NodeLaunch(executable='llm_node', name='llm_node', namespace=namespace,
                      parameters=node_parameters(resolved.nodes['llm_node']), log_level=level,
                      lifecycle=True, env=dict(NODE_ENV))
    return resolved, node, _messages(resolved, choice.message)


def _messages(resolved: profiles.Resolved, model_note: str) -> Tuple[str, ...]:
    detected = resolved.detected
    head = 'edge_llm_ros: board %s (detected %s: %s)' % (
        resolved.board, detected.board or 'none', detected.reason)
    notes = resolved.notes + ((model_note,) if model_note else ())
    return (head,) + tuple('edge_llm_ros: %s' % note for note in notes)


def edge_llm_launch(board: str = 'auto', model: str = '', params_file: str = '',
                    namespace: str = '', log_level: str = 'info', autostart: str = 'true',
                    *, root: str = '/') -> LaunchPlan:
    """Plan edge_llm.launch.py: llm_node with the resolved profile."""
    resolved, node, messages = llm_plan(board, model, params_file, namespace, log_level,
                                        autostart, root=root)
    return LaunchPlan(resolved.board, (node,), messages)


def pipeline_launch(board: str = 'auto', model: str = '', params_file: str = '',
                    namespace: str = '', log_level: str = 'info', autostart: str = 'true',
                    frame_source: str = '', *, root: str = '/',
                    wiring: Optional[Mapping[str, Mapping[str, Any]]] = None) -> LaunchPlan:
    """Plan perception_pipeline.launch.py: frame_source, perception and llm_node."""
    extra = {node: dict(params) for node, params in (
        PIPELINE_WIRING if wiring is None else wiring).items()}
    extra.setdefault('perception', {})
    extra.setdefault('frame_source', {})
    if frame_source:
        extra['frame_source']['source'] = frame_source
    resolved, llm, messages = llm_plan(board, model, params_file, namespace, log_level,
                                       autostart, root=root, extra=extra)
    nodes: List[NodeLaunch] = [
        NodeLaunch(name, name, namespace, node_parameters(resolved.nodes[name]),
                   llm.log_level, env=dict(NODE_ENV))
        for name in ('frame_source', 'perception')] + [llm]
    return LaunchPlan(resolved.board, tuple(nodes), messages)
