"""Parameters of frame_source and perception: specs (bringup's ParamSpec) and typed configs.

No rclpy here, so bringup can validate profiles against these specs; the nodes declare
them through edge_llm_ros.nodes.node_params and read them once into the dataclasses below.
"""
import dataclasses
from typing import Any, Mapping, Optional, Tuple

from edge_llm_ros.bringup.affinity import parse_cpu_list, plan_affinity
from edge_llm_ros.bringup.parameters import (
    engine_specs, ParamSpec, ParamType, parse_provider_options, Range, resolved_threads)
from edge_llm_ros.ipc.allocators import allocator_names
from edge_llm_ros.vision.default_model import PatchEmbedSpec, SMOLLM2_HIDDEN
from edge_llm_ros.vision.runner import RunnerConfig
from edge_llm_ros.vision.synthetic import MAX_SIDE, MIN_SIDE

POOL_ID_PATTERN = r'[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}'
COPY_MODES = ('auto', 'always', 'never')
TRANSPORTS = ('auto', 'zero_copy', 'copy')
_SIDE = Range(MIN_SIDE, MAX_SIDE)


def pool_specs(pool_id: str, slots: int, lease_s: float, what: str) -> Tuple[ParamSpec, ...]:
    """Specs of the output pool and its copying fallback (shared by both nodes)."""
    return (
        ParamSpec('pool.id', ParamType.STRING, pool_id,
                  f'Pool id of the {what} (names the socket consumers connect to)',
                  pattern=POOL_ID_PATTERN),
        ParamSpec('pool.slots', ParamType.INTEGER, slots,
                  f'Buffers in the {what} ring; the producer keeps one, consumers share the '
                  'rest (sum of their max_inflight)', range=Range(2, 256)),
        ParamSpec('pool.allocator', ParamType.STRING, 'auto',
                  "Buffer allocator; 'auto' = best available (dma_heap, udmabuf, memfd)",
                  choices=('auto',) + tuple(allocator_names())),
        ParamSpec('pool.lease_s', ParamType.DOUBLE, lease_s,
                  'A consumer holding a buffer longer than this loses it (fresh buffer, new '
                  'generation; its view stays intact)', range=Range(0.0, 3600.0, low_open=True)),
        ParamSpec('socket_dir', ParamType.STRING, '',
                  "Private folder of the pool sockets; '' = $EDGE_LLM_IPC_DIR, "
                  '$XDG_RUNTIME_DIR/edge_llm_ros or /tmp/edge_llm_ros-<uid>'),
        ParamSpec('copy_fallback', ParamType.STRING, 'auto',
                  'Also publish copies on <topic>_copy for consumers that cannot map the pool '
                  "(another host): 'auto' = while someone subscribes, 'always', 'never'",
                  choices=COPY_MODES),
    )


FRAME_SOURCE_SPECS: Tuple[ParamSpec, ...] = (
    ParamSpec('source', ParamType.STRING, 'synthetic',
              "'synthetic', 'topic:<sensor_msgs/Image topic>', a V4L2 device (/dev/videoN), "
              'a folder of PNG/JPEG images, an image file or a video file'),
    ParamSpec('width', ParamType.INTEGER, 640, 'Frame width in pixels', range=_SIDE),
    ParamSpec('height', ParamType.INTEGER, 480, 'Frame height in pixels', range=_SIDE),
    ParamSpec('rate_hz', ParamType.DOUBLE, 30.0,
              'Frames per second (a topic source publishes as its images arrive)',
              range=Range(0.0, 1000.0, low_open=True)),
    ParamSpec('loop', ParamType.BOOL, True,
              'Start a video or image folder again at its end (else stop publishing)'),
    ParamSpec('frame_id', ParamType.STRING, 'camera',
              'header.frame_id of the frames (a topic source keeps the camera header)'),
) + pool_specs('frames', 6, 2.0, 'frames')

PERCEPTION_SPECS: Tuple[ParamSpec, ...] = (
    ParamSpec('input.topic', ParamType.STRING, 'frame_source/frames',
              'TensorHandle topic of the frames (its copies are on <topic>_copy)'),
    ParamSpec('input.pool_id', ParamType.STRING, '',
              "Accept frames of this pool only; '' = any", pattern='|' + POOL_ID_PATTERN),
    ParamSpec('input.transport', ParamType.STRING, 'auto',
              "'auto' = map frames, or receive copies when their pool is unreachable; "
              "'zero_copy' = map only; 'copy' = copies only", choices=TRANSPORTS),
    ParamSpec('rate_hz', ParamType.DOUBLE, 0.0,
              'At most this many inferences per second (the latest frame wins); 0 = as fast '
              'as frames arrive', range=Range(0.0, 1000.0)),
    ParamSpec('model.path', ParamType.STRING, '',
              "ONNX image model (one input taking the frame); '' = the built-in random "
              'patch-embedding stand-in (not a trained encoder)'),
    ParamSpec('model.input', ParamType.STRING, '', "Input name; '' = the model's only input"),
    ParamSpec('model.output', ParamType.STRING, '', "Output name; '' = the first output"),
    ParamSpec('model.hidden_size', ParamType.INTEGER, SMOLLM2_HIDDEN,
              "Stand-in: embedding width (the LLM's hidden size)", range=Range(1, 65536)),
    ParamSpec('model.llm_path', ParamType.STRING, '',
              "Stand-in: take hidden_size from this converted LLM folder's model.yaml "
              "instead; '' = use model.hidden_size"),
    ParamSpec('model.image_size', ParamType.INTEGER, 224,
              'Stand-in: side of the resized image', range=Range(1, 4096)),
    ParamSpec('model.patch_size', ParamType.INTEGER, 16,
              'Stand-in: patch side (divides model.image_size)', range=Range(1, 1024)),
    ParamSpec('model.seed', ParamType.INTEGER, 0, 'Stand-in: seed of its random weights',
              range=Range(0, 2 ** 63 - 1)),
    *engine_specs('perception model'),
) + pool_specs('embeddings', 8, 30.0, 'embeddings')


@dataclasses.dataclass(frozen=True)
class PoolSettings:
    """Output pool and copy fallback of a node."""

    pool_id: str
    slots: int
    allocator: str
    lease_s: float
    socket_dir: Optional[str]
    copy_fallback: str


@dataclasses.dataclass(frozen=True)
class FrameSourceConfig:
    """frame_source's parameters, read once."""

    source: str
    width: int
    height: int
    rate_hz: float
    loop: bool
    frame_id: str
    pool: PoolSettings


@dataclasses.dataclass(frozen=True)
class PerceptionConfig:
    """perception's parameters, read once."""

    input_topic: str
    input_pool_id: str
    transport: str
    rate_hz: float
    model_path: str
    stand_in: PatchEmbedSpec
    runner: RunnerConfig
    process_cpus: Tuple[int, ...]     # '' affinity: () = no pinning
    pool: PoolSettings


def pool_settings(values: Mapping[str, Any]) -> PoolSettings:
    """Build PoolSettings from validated values."""
    return PoolSettings(pool_id=values['pool.id'], slots=values['pool.slots'],
                        allocator=values['pool.allocator'], lease_s=values['pool.lease_s'],
                        socket_dir=values['socket_dir'] or None,
                        copy_fallback=values['copy_fallback'])


def frame_source_config(values: Mapping[str, Any]) -> FrameSourceConfig:
    """Build FrameSourceConfig from validated values."""
    return FrameSourceConfig(source=values['source'], width=values['width'],
                             height=values['height'], rate_hz=values['rate_hz'],
                             loop=values['loop'], frame_id=values['frame_id'],
                             pool=pool_settings(values))


def _hidden_size(values: Mapping[str, Any]) -> int:
    if not values['model.llm_path']:
        return values['model.hidden_size']
    from edge_llm_ros.engine.model import load_model_info
    return load_model_info(values['model.llm_path']).hidden_size


def perception_config(values: Mapping[str, Any]) -> PerceptionConfig:
    """Build PerceptionConfig from validated values (reads model.llm_path's model.yaml)."""
    providers = tuple(values['engine.providers'])
    threads = resolved_threads(values)
    plan = plan_affinity(parse_cpu_list(values['engine.cpu_affinity']), threads)
    runner = RunnerConfig(providers=providers,
                          provider_options=parse_provider_options(
                              values['engine.provider_options']),
                          intra_op_threads=threads, intra_op_affinity=plan.intra_op_affinity,
                          input_name=values['model.input'], output_name=values['model.output'])
    stand_in = PatchEmbedSpec(hidden_size=_hidden_size(values),
                              image_size=values['model.image_size'],
                              patch_size=values['model.patch_size'], seed=values['model.seed'])
    return PerceptionConfig(input_topic=values['input.topic'],
                            input_pool_id=values['input.pool_id'],
                            transport=values['input.transport'], rate_hz=values['rate_hz'],
                            model_path=values['model.path'], stand_in=stand_in, runner=runner,
                            process_cpus=plan.process_cpus, pool=pool_settings(values))
