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
from edge_llm_ros.bringup.affinity import format_cpu_list, parse_cpu_list, usable_cpus
from edge_llm_ros.bringup.errors import BringupError, ParameterRangeError, UnknownBoardError
from edge_llm_ros.runtime.encoder import is_encoder_folder
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

# chat_and_embed.launch.py's second llm_node (serves ~/embed and ~/rerank).
EMBEDDER = 'embedder'


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


def chat_embed_arguments() -> Tuple[LaunchArgument, ...]:
    """Arguments of chat_and_embed.launch.py (the llm ones plus the embedding model)."""
    return llm_arguments() + (
        LaunchArgument('embed_model', '', 'A converted embedding or rerank folder '
                       '(edge-llm-convert of a bert / rerank GGUF), served by the second '
                       'llm_node'),
        LaunchArgument('embed_name', EMBEDDER, 'Node name of the embedding llm_node'),
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


@dataclass(frozen=True)
class CoreSplit:
    """The cores of the chat and the embedding node (cpu lists and thread counts)."""

    chat_cpus: str
    chat_threads: int
    embed_cpus: str
    embed_threads: int
    reason: str


def split_cores(chat: Mapping[str, Any], helper: Mapping[str, Any], root: str = '/'
                ) -> CoreSplit:
    """Give the embedder the board's helper cores (its perception section), chat the rest.

    A profile that pins perception (RK3588's A55s, the Pi 5's core 0, Orin's 2-3) already
    says where secondary inference runs: the embedder runs there, the chat node keeps its
    cores. An unpinned profile (x86) splits this machine's usable cores: the last quarter
    (at least one) for the embedder, the rest for chat; one core is shared.
    """
    pinned = str(helper.get('engine.cpu_affinity', '') or '')
    if pinned:
        return CoreSplit(str(chat.get('engine.cpu_affinity', '') or ''),
                         int(chat.get('engine.intra_op_threads', 0)), pinned,
                         int(helper.get('engine.intra_op_threads', 0)) or
                         len(parse_cpu_list(pinned)), "the profile's perception cores")
    cpus = usable_cpus(root)
    if len(cpus) < 2:
        listed = format_cpu_list(cpus)
        return CoreSplit(listed, 1, listed, 1, 'one usable core: shared')
    take = max(1, len(cpus) // 4)
    chat_cpus, embed_cpus = cpus[:-take], cpus[-take:]
    return CoreSplit(format_cpu_list(chat_cpus), len(chat_cpus), format_cpu_list(embed_cpus),
                     len(embed_cpus), f'the last {take} of {len(cpus)} usable cores')


def chat_embed_launch(board: str = 'auto', model: str = '', params_file: str = '',
                      namespace: str = '', log_level: str = 'info', autostart: str = 'true',
                      embed_model: str = '', embed_name: str = EMBEDDER, *,
                      root: str = '/') -> LaunchPlan:
    """Plan chat_and_embed.launch.py: a chat llm_node and an embedding llm_node side by side.

    Both take llm_node's resolved profile; the embedder gets embed_model and its own cores
    (split_cores), so retrieval never competes with decode for a core.
    """
    if not embed_model or not is_encoder_folder(embed_model):
        raise ModelArgumentError(
            f'launch argument embed_model:={embed_model!r} is not a converted embedding or '
            'rerank folder (its model.yaml has no kind: embedding/rerank): convert one with '
            'edge-llm-convert (e.g. a bge-small GGUF) and give its output folder')
    if not embed_name or embed_name == 'llm_node':
        raise ParameterRangeError(f'launch argument embed_name:={embed_name!r} must name a '
                                  'node other than llm_node')
    resolved, chat, messages = llm_plan(board, model, params_file, namespace, log_level,
                                        autostart, root=root, extra={'perception': {}})
    split = split_cores(resolved.nodes['llm_node'], resolved.nodes['perception'], root)
    chat_params = dict(chat.parameters, **{'engine.cpu_affinity': split.chat_cpus,
                                           'engine.intra_op_threads': split.chat_threads})
    embed_params = dict(chat.parameters, **{'model.path': embed_model,
                                            'engine.cpu_affinity': split.embed_cpus,
                                            'engine.intra_op_threads': split.embed_threads})
    chat = NodeLaunch(chat.executable, chat.name, namespace, chat_params, chat.log_level,
                      lifecycle=True, env=dict(NODE_ENV))
    embedder = NodeLaunch('llm_node', embed_name, namespace, embed_params, chat.log_level,
                          lifecycle=True, env=dict(NODE_ENV))
    note = (f'edge_llm_ros: chat on cores {split.chat_cpus or "all"} '
            f'({split.chat_threads or "auto"} threads), {embed_name} on '
            f'{split.embed_cpus or "all"} ({split.embed_threads} threads): {split.reason}')
    return LaunchPlan(resolved.board, (chat, embedder), messages + (note,))
