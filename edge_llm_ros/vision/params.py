"""Typed configs of frame_source and perception, built from their validated parameters.

The parameters themselves (names, types, defaults, ranges) are bringup.parameters'
'frame_source' and 'perception' schemas; the nodes declare and read them through
edge_llm_ros.nodes.node_params and turn the values into the frozen dataclasses below.
No rclpy here.
"""
import dataclasses
from typing import Any, Mapping, Optional, Tuple

from edge_llm_ros.bringup.affinity import parse_cpu_list, plan_affinity
from edge_llm_ros.bringup.parameters import parse_provider_options, resolved_threads
from edge_llm_ros.vision.default_model import PatchEmbedSpec
from edge_llm_ros.vision.runner import RunnerConfig


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
class WindowSettings:
    """perception's time window (vision/window.py): bounds and its own pool's id."""

    seconds: float
    max_frames: int
    max_bytes: int
    pool_id: str


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
    window: WindowSettings            # window.* (seconds 0 = no window)


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
    from edge_llm_ros.model_format import load_model_info
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
                            process_cpus=plan.process_cpus, pool=pool_settings(values),
                            window=WindowSettings(
                                seconds=values['window.seconds'],
                                max_frames=values['window.max_frames'],
                                max_bytes=values['window.max_mb'] << 20,
                                pool_id=values['window.pool_id'] or
                                f"{values['pool.id']}_window"))
