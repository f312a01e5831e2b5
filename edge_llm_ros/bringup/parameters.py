"""Single source of truth for the nodes' ROS parameters: names, types, defaults, ranges.

Board profiles (config/boards/*.yaml), user parameter files and launch overrides are all
validated against these schemas before a node starts, and the nodes declare their
parameters from them (type, default, range and read_only go into the descriptor), so a
name can only be spelled one way. No rclpy here: `ParamType` member names equal
`rclpy.Parameter.Type` member names so the node maps them with `Parameter.Type[t.name]`.

The choices of settings the runtime and ipc carry out (CPU kernels, speculative modes,
buffer allocators) are theirs: this table reads them as plain tuples from their leaf modules
(runtime/choices.py, ipc/choices.py), which import nothing, and imports nothing else of them.
The *_kwargs functions turn values into plain keyword arguments; the node builds the typed
configs from them (nodes/llm_config.py).

Names are flat and dotted (`kv.max_context`), which is how rclpy stores nested YAML keys.
An empty list default (engine.provider_options) must be declared by type, not by value:
rclpy would infer BYTE_ARRAY from `[]`.
"""
from __future__ import annotations

from dataclasses import dataclass
import difflib
import enum
import math
import re
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple

from edge_llm_ros.bringup.errors import (ParameterRangeError, ParameterTypeError,
                                         UnknownParameterError)
from edge_llm_ros.ipc.choices import ALLOCATORS
from edge_llm_ros.runtime.choices import KERNEL_CHOICES as CPU_KERNELS, SPECULATIVE_MODES


class ParamType(enum.Enum):
    """Parameter value types; member names match rclpy.Parameter.Type."""

    BOOL = 'bool'
    INTEGER = 'integer'
    DOUBLE = 'double'
    STRING = 'string'
    STRING_ARRAY = 'string array'


@dataclass(frozen=True)
class Range:
    """A numeric interval; ROS descriptors only know closed ones, so openness is ours."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False

    def contains(self, value: float) -> bool:
        """Whether `value` lies in the interval."""
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        return '%s%s, %s%s' % ('(' if self.low_open else '[', _num(self.low),
                               _num(self.high), ')' if self.high_open else ']')


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else repr(value)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: what it is, what values it takes, whether it can change at run time."""

    name: str
    type: ParamType  # noqa: A003 (the natural name; rclpy calls it type too)
    default: Any
    description: str
    read_only: bool = True           # load-time settings: changing them needs a re-configure
    range: Optional[Range] = None    # noqa: A003 (numbers)
    choices: Tuple[str, ...] = ()    # strings, or each element of a string array
    pattern: str = ''                # strings: a regex the whole value must match
    min_items: int = 0               # string arrays
    check: Optional[Callable[[Any], None]] = None   # extra syntax check; raises ValueError

    @property
    def constraints(self) -> str:
        """Describe the constraints in words (ParameterDescriptor.additional_constraints)."""
        parts = []
        if self.range is not None:
            parts.append('range %s' % self.range)
        if self.choices:
            parts.append('one of: %s' % ', '.join(self.choices))
        if self.pattern:
            parts.append('matches %s' % self.pattern)
        if self.min_items:
            parts.append('at least %d item(s)' % self.min_items)
        return '; '.join(parts)

    def validate(self, value: Any, source: str = '') -> Any:
        """Return `value` (arrays as lists) if it fits this spec, else raise a typed error."""
        where = '%s: %s' % (source, self.name) if source else self.name
        value = _check_type(self, value, where)
        if self.range is not None and not self.range.contains(value):
            raise ParameterRangeError('%s = %r is outside %s (%s)' % (
                where, value, self.range, self.description))
        items = value if self.type is ParamType.STRING_ARRAY else (
            [value] if self.type is ParamType.STRING else [])
        for item in items:
            if self.choices and item not in self.choices:
                raise ParameterRangeError('%s = %r: %r is not one of %s' % (
                    where, value, item, ', '.join(self.choices)))
            if self.pattern and not re.fullmatch(self.pattern, item):
                raise ParameterRangeError('%s = %r does not match %s (%s)' % (
                    where, value, self.pattern, self.description))
        if self.type is ParamType.STRING_ARRAY and len(value) < self.min_items:
            raise ParameterRangeError('%s needs at least %d item(s), got %r' % (
                where, self.min_items, value))
        if self.check is not None:
            try:
                self.check(value)
            except ValueError as exc:
                raise ParameterRangeError('%s = %r: %s' % (where, value, exc)) from None
        return value


def _check_type(spec: ParamSpec, value: Any, where: str) -> Any:
    expected = spec.type
    if expected is ParamType.BOOL:
        ok = isinstance(value, bool)
    elif expected is ParamType.INTEGER:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif expected is ParamType.DOUBLE:
        ok = isinstance(value, float) and math.isfinite(value)
        if isinstance(value, int) and not isinstance(value, bool):
            # ROS refuses an integer for a double parameter at declare time: say so now.
            raise ParameterTypeError('%s = %r: expected a double; ROS rejects integers here, '
                                     'write %r' % (where, value, float(value)))
    elif expected is ParamType.STRING:
        ok = isinstance(value, str)
    else:
        ok = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
        if ok:
            value = list(value)
    if not ok:
        raise ParameterTypeError('%s = %r: expected %s, got %s' % (
            where, value, expected.value, type(value).__name__))
    return value


def _check_cpu_list(text: str) -> None:
    from edge_llm_ros.bringup.affinity import parse_cpu_list   # affinity imports nothing of ours
    if text:
        parse_cpu_list(text)


def _check_provider_options(items: list) -> None:
    parse_provider_options(items)


def parse_lora_adapters(items: Sequence[str]) -> Tuple[Tuple[str, str, float], ...]:
    """Parse lora.adapters items 'name=path' or 'name=path@scale' (ValueError says which)."""
    out = []
    for item in items:
        name, eq, rest = item.partition('=')
        path, at, scale_text = rest.rpartition('@')
        if not at:
            path, scale_text = rest, '1.0'
        try:
            scale = float(scale_text)
        except ValueError:
            path, scale = rest, 1.0   # an '@' inside the path
        if not eq or not name.strip() or not path.strip():
            raise ValueError(f"{item!r} is no adapter: give 'name=path' or 'name=path@scale' "
                             '(a LoRA GGUF or a PEFT folder)')
        out.append((name.strip(), path.strip(), scale))
    return tuple(out)


def _check_lora_adapters(items: list) -> None:
    parse_lora_adapters(items)


def _check_warm_prompts(items: list) -> None:
    """Refuse an empty warm prompt, or 'file:' without a path (the engine reads the files)."""
    for item in items:
        if not item.strip() or item.startswith('file:') and not item[5:].strip():
            raise ValueError(f"{item!r} is no warm prompt: give its text or 'file:<path>'")


PROVIDERS = ('CPUExecutionProvider', 'CUDAExecutionProvider', 'TensorrtExecutionProvider',
             'XnnpackExecutionProvider')
KERNEL_SETS = ('none', 'int4_decode', 'kquant')
_THREADS = Range(0, 256)
_TEMPERATURE_C = Range(20.0, 125.0)


def engine_specs(role: str) -> Tuple[ParamSpec, ...]:
    """ONNX Runtime settings shared by every node that runs a model (`role` words the help)."""
    return (
        ParamSpec('engine.providers', ParamType.STRING_ARRAY, ['CPUExecutionProvider'],
                  'ONNX Runtime execution providers for the %s, in priority order' % role,
                  choices=PROVIDERS, min_items=1),
        ParamSpec('engine.provider_options', ParamType.STRING_ARRAY, [],
                  "Provider options as 'Provider:key=value' items, e.g. "
                  "'CUDAExecutionProvider:device_id=0'", check=_check_provider_options),
        ParamSpec('engine.intra_op_threads', ParamType.INTEGER, 0,
                  'ONNX Runtime intra-op threads of the %s; 0 = one per core of '
                  'engine.cpu_affinity (or the ORT default without affinity)' % role,
                  range=_THREADS),
        ParamSpec('engine.cpu_affinity', ParamType.STRING, '',
                  "Cores the %s process is pinned to, as a CPU list like '4-7' or '0,2'; "
                  "'' = no pinning" % role, check=_check_cpu_list),
    )


ENGINE_BACKENDS = ('local', 'remote')
_URL_PATTERN = r'(https?://\S+)?'
_ENV_NAME_PATTERN = r'([A-Za-z_][A-Za-z0-9_]*)?'

# engine.backend: remote forwards llm_node's goals to an OpenAI-compatible server.
REMOTE_SPECS: Tuple[ParamSpec, ...] = (
    ParamSpec('engine.backend', ParamType.STRING, 'local',
              "'local' = run model.path here; 'remote' = forward every goal to the "
              'OpenAI-compatible server at remote.url (vLLM, llama-server, another '
              "robot's openai_bridge)", choices=ENGINE_BACKENDS),
    ParamSpec('remote.url', ParamType.STRING, '',
              "Base URL of the remote server's OpenAI API, e.g. http://10.0.0.2:8000/v1 "
              '(engine.backend remote)', pattern=_URL_PATTERN),
    ParamSpec('remote.model', ParamType.STRING, '',
              "Model id sent to the remote server; '' = the first one its /v1/models lists"),
    ParamSpec('remote.api_key_env', ParamType.STRING, '',
              "Environment variable holding the remote server's API key (never the key "
              "itself in a parameter); '' = no key", pattern=_ENV_NAME_PATTERN),
    ParamSpec('remote.timeout_s', ParamType.DOUBLE, 30.0,
              'Connect and between-chunks read timeout of the remote server',
              range=Range(0.0, 3600.0, low_open=True)),
    ParamSpec('remote.context_length', ParamType.INTEGER, 4096,
              'Context length reported for the remote model (checks max_tokens; the '
              'server checks the prompt)', range=Range(64, 1048576)),
)

OPENAI_BRIDGE_SPECS: Tuple[ParamSpec, ...] = (
    ParamSpec('host', ParamType.STRING, '127.0.0.1',
              'Address the HTTP server listens on; 127.0.0.1 = this machine only (another '
              'address exposes the model to the network: set an API key)'),
    ParamSpec('port', ParamType.INTEGER, 8000, 'TCP port; 0 = any free port (logged)',
              range=Range(0, 65535)),
    ParamSpec('api_key', ParamType.STRING, '',
              "Bearer token clients must send; '' = none (see api_key_env)"),
    ParamSpec('api_key_env', ParamType.STRING, '',
              'Environment variable holding the bearer token (kept out of parameter dumps); '
              "used when api_key is ''", pattern=_ENV_NAME_PATTERN),
    ParamSpec('max_body_bytes', ParamType.INTEGER, 1 << 20,
              'Largest request body accepted; larger ones get 413', range=Range(1, 1 << 30)),
    ParamSpec('llm_node', ParamType.STRING, '/llm_node',
              'Fully qualified name of the llm_node whose ~/generate action serves requests',
              pattern=r'(/[A-Za-z_][A-Za-z0-9_]*)+'),
    ParamSpec('model_id', ParamType.STRING, 'edge-llm',
              'Model id the bridge serves (/v1/models; requests must name it)',
              pattern=r'[^\s]{1,256}'),
    ParamSpec('images.fetch_urls', ParamType.BOOL, False,
              'Fetch http(s) image_url parts (false: refused with a 400; data: URLs are '
              'always taken). The bridge then reaches any address a client names'),
    ParamSpec('images.fetch_timeout_s', ParamType.DOUBLE, 5.0,
              'Socket timeout of one image fetch (images.fetch_urls)', range=Range(0.1, 120.0)),
    ParamSpec('images.fetch_max_bytes', ParamType.INTEGER, 20 << 20,
              'Largest image fetched (images.fetch_urls); larger ones get a 400',
              range=Range(1, 1 << 30)),
)


_SERVICE_PATTERN = r'(/?[A-Za-z_][A-Za-z0-9_]*)(/[A-Za-z_][A-Za-z0-9_]*)*'
MEMORY_SPECS: Tuple[ParamSpec, ...] = (
    ParamSpec('store', ParamType.STRING, '',
              "SQLite file of the memories (created if missing); '' = "
              '$ROS_HOME/edge_llm/memory.db (ROS_HOME defaults to ~/.ros)'),
    ParamSpec('max_rows', ParamType.INTEGER, 100_000,
              'Most memories kept; the oldest are evicted (logged)', range=Range(1, 1 << 40)),
    ParamSpec('max_bytes', ParamType.INTEGER, 512 << 20,
              'Most bytes of text, tags and vectors kept; the oldest are evicted (logged)',
              range=Range(1024, 1 << 50)),
    ParamSpec('max_k', ParamType.INTEGER, 50, 'Largest k a recall may ask for',
              range=Range(1, 10_000)),
    ParamSpec('max_text_bytes', ParamType.INTEGER, 16384,
              'Longest text or query accepted (UTF-8 bytes)', range=Range(1, 1 << 24)),
    ParamSpec('embed.service', ParamType.STRING, '/llm_node/embed',
              "The embedding node's ~/embed service (edge_llm_msgs/srv/Embed)",
              pattern=_SERVICE_PATTERN),
    ParamSpec('embed.timeout_s', ParamType.DOUBLE, 10.0,
              'Longest wait for the embedding service (its discovery included)',
              range=Range(0.1, 600.0)),
    ParamSpec('rerank.service', ParamType.STRING, '',
              "A reranker's ~/rerank service (edge_llm_msgs/srv/Rerank) for recalls that ask "
              "to rerank; '' = none (such a recall is refused)",
              pattern='|' + _SERVICE_PATTERN),
    ParamSpec('diagnostics.period_s', ParamType.DOUBLE, 1.0,
              'Period of the /diagnostics status', range=Range(0.05, 3600.0)),
    ParamSpec('autostart', ParamType.BOOL, True,
              'Configure and activate at start (else wait for lifecycle transitions)'),
)

LLM_NODE_SPECS: Tuple[ParamSpec, ...] = (
    ParamSpec('board.name', ParamType.STRING, '',
              'Board profile these settings came from (reported in diagnostics)'),
    ParamSpec('model.path', ParamType.STRING, '',
              "Converted model folder (model.onnx + model.yaml); '' = embedded SmolLM2-135M"),
    ParamSpec('model.default_size', ParamType.STRING, '135M',
              'Largest model this board serves comfortably (parameters, e.g. 1.5B); '
              'a bigger model.path logs a warning at configure', pattern=r'\d+(\.\d+)?[MB]'),
    ParamSpec('model.quantization', ParamType.STRING, 'int4',
              'Weight format the board profile expects (MatMulNBits 4-bit blocks)',
              choices=('int4',)),
    ParamSpec('model.family', ParamType.STRING, '',
              'Model family config: a config/models/<family>.yaml name or a .yaml path '
              "(template quirks, stop tokens, reasoning tags, tool-call format); '' = matched "
              "from the model's model.yaml"),
    *engine_specs('language model'),
    ParamSpec('engine.prefill_chunk', ParamType.INTEGER, 256,
              'Prompt positions a step adds to its one model call beside the decode rows '
              '(bounds memory, how long a cancel waits and how much a long prompt slows '
              'the goals decoding meanwhile: docs/batching.md)', range=Range(1, 8192)),
    ParamSpec('engine.parallel_sequences', ParamType.INTEGER, 1,
              'Goals decoded together in one batch (continuous batching); each has its own '
              'kv.max_context KV slot, reserved at configure (docs/batching.md)',
              range=Range(1, 16)),
    ParamSpec('vision.max_image_tokens', ParamType.INTEGER, 0,
              "Tokens one image may take when a goal's max_image_tokens is 0 (any-resolution "
              'VLMs: a 1080p frame is 2,691 Qwen2.5-VL tokens); a larger image is refused as '
              "invalid_request before any model work; 0 = no cap but the context's; board "
              'profiles set one (docs/vision.md)', range=Range(0, 131072)),
    ParamSpec('vision.window_timeout_s', ParamType.DOUBLE, 2.0,
              "How long a goal naming a perception node's time window (video_window_source) "
              "waits for that node's ~/window to be found and to answer; past it the goal "
              'ends invalid_request before any model work (docs/vision.md)',
              range=Range(0.1, 60.0)),
    ParamSpec('detections.publish', ParamType.STRING, 'auto',
              'Grounded answers on ~/detections (vision_msgs or edge_llm_msgs '
              "Detection2DArray): 'auto' = when the model's family grounds (config/models "
              "`grounding`), 'on' = required (configure fails for a model that does not "
              "ground), 'off' = never (results still carry their detections)",
              choices=('auto', 'on', 'off')),
    ParamSpec('kv.max_context', ParamType.INTEGER, 2048,
              "KV-cache capacity in tokens (must not exceed the model's context length)",
              range=Range(64, 131072)),
    ParamSpec('kv.memory_limit', ParamType.INTEGER, 0,
              'Bytes the KV slots (and saved session prefixes) may take; configure fails with '
              'the bytes needed above it; 0 = 80 % of the memory available at configure',
              range=Range(0, 1 << 42)),
    ParamSpec('kv.dtype', ParamType.STRING, 'float32',
              'KV precision: int8 keeps the live KV cache in int8 rows with a float32 scale '
              'each (attention reads them directly; models with model_kv_int8.onnx) and saves '
              'prefixes as plain copies of them; float32 keeps both at full precision',
              choices=('float32', 'int8')),
    ParamSpec('kv.prefix_reuse', ParamType.BOOL, True,
              'Reuse the KV of a shared prompt prefix (system prompt, earlier turns)'),
    ParamSpec('kv.max_sessions', ParamType.INTEGER, 8,
              'Saved per-session KV prefixes kept (least recently used dropped first)',
              range=Range(0, 1024)),
    ParamSpec('kv.warm_prompts', ParamType.STRING_ARRAY, [],
              'System prompts prefilled at configure and pinned in the prefix cache, each its '
              "text or 'file:<path>'; goals whose messages start with one as system message "
              'reuse its KV; counted in kv.memory_limit, kept in sessions.store '
              '(docs/sessions.md)', check=_check_warm_prompts),
    ParamSpec('lora.adapters', ParamType.STRING_ARRAY, [],
              "LoRA adapters loaded at configure, each 'name=path' or 'name=path@scale' (a "
              'llama.cpp LoRA GGUF or a PEFT folder, and its default scale); goals name them '
              'in their lora field (docs/interfaces.md)', check=_check_lora_adapters),
    ParamSpec('lora.max_per_goal', ParamType.INTEGER, 4,
              'LoRA adapters one goal may use at most', range=Range(1, 16)),
    ParamSpec('lora.max_scale', ParamType.DOUBLE, 4.0,
              'Largest |scale| a goal may give an adapter', range=Range(0.0, 100.0)),
    ParamSpec('sessions.max_bytes', ParamType.INTEGER, 256 << 20,
              'Byte bound of the saved session KV prefixes, in memory and in sessions.store '
              '(least recently used dropped first; a larger prefix is not kept)',
              range=Range(0, 1 << 40)),
    ParamSpec('sessions.store', ParamType.STRING, '',
              "SQLite file the saved sessions persist in across restarts; '' = memory only "
              '(docs/sessions.md)'),
    ParamSpec('sampling.temperature', ParamType.DOUBLE, 0.0,
              'Default temperature; 0 = greedy', read_only=False, range=Range(0.0, 2.0)),
    ParamSpec('sampling.top_k', ParamType.INTEGER, 0,
              'Default top-k; 0 = disabled', read_only=False, range=Range(0, 1000)),
    ParamSpec('sampling.top_p', ParamType.DOUBLE, 1.0,
              'Default nucleus mass; 1 = disabled', read_only=False,
              range=Range(0.0, 1.0, low_open=True)),
    ParamSpec('sampling.min_p', ParamType.DOUBLE, 0.0,
              'Default min-p; 0 = disabled', read_only=False,
              range=Range(0.0, 1.0, high_open=True)),
    ParamSpec('sampling.repetition_penalty', ParamType.DOUBLE, 1.0,
              'Default repetition penalty; 1 = disabled', read_only=False,
              range=Range(0.0, 10.0, low_open=True)),
    ParamSpec('sampling.presence_penalty', ParamType.DOUBLE, 0.0,
              'Default presence penalty; 0 = disabled', read_only=False,
              range=Range(-2.0, 2.0)),
    ParamSpec('sampling.frequency_penalty', ParamType.DOUBLE, 0.0,
              'Default frequency penalty; 0 = disabled', read_only=False,
              range=Range(-2.0, 2.0)),
    ParamSpec('sampling.seed', ParamType.INTEGER, -1,
              'Default seed; -1 = a random seed per request', read_only=False,
              range=Range(-1, 2 ** 63 - 1)),
    ParamSpec('system_prompt', ParamType.STRING, '',
              "System prompt used when a goal gives none; '' = none", read_only=False),
    ParamSpec('max_tokens', ParamType.INTEGER, 256,
              'Completion tokens when a goal asks for 0', read_only=False,
              range=Range(1, 131072)),
    ParamSpec('queue.depth', ParamType.INTEGER, 8,
              'Goals waiting beyond the running one; more are rejected', range=Range(1, 1024)),
    ParamSpec('feedback.period_tokens', ParamType.INTEGER, 1,
              'Send feedback after this many new tokens', read_only=False,
              range=Range(1, 1024)),
    ParamSpec('feedback.period_ms', ParamType.INTEGER, 0,
              'Also send feedback when this long passed since the last one (and a token '
              'is pending); 0 = token count only', read_only=False, range=Range(0, 60000)),
    ParamSpec('autostart', ParamType.BOOL, False,
              'Configure and activate on start-up (no lifecycle manager needed). False for '
              '`ros2 run`, so a lifecycle manager (or `ros2 lifecycle set`) decides when the '
              'model loads, as for any lifecycle node; the edge_llm launch files default it '
              'to true because they start llm_node alone, with no manager to drive it'),
    ParamSpec('diagnostics.period_s', ParamType.DOUBLE, 1.0,
              'Period of /diagnostics and thermal polling', range=Range(0.1, 60.0)),
    ParamSpec('metrics.port', ParamType.INTEGER, 0,
              'TCP port of the Prometheus /metrics endpoint, served from configure to '
              'cleanup; 0 = off (docs/metrics.md)', range=Range(0, 65535)),
    ParamSpec('metrics.host', ParamType.STRING, '127.0.0.1',
              "Address the /metrics endpoint binds; '0.0.0.0' exposes it to the network",
              pattern=r'\S+'),
    ParamSpec('update.public_key', ParamType.STRING, '',
              'ed25519 public key that must sign model updates (~/update_model): a key file '
              "(edge-llm-update keygen's .pub, or PEM) or its base64; '' = updates refused "
              '(docs/model_updates.md)'),
    ParamSpec('update.models_root', ParamType.STRING, '',
              'Folder the updates are installed in (versions/<name> and the `current` '
              "symlink; point model.path at <root>/current); '' = updates refused"),
    ParamSpec('update.drain_timeout_s', ParamType.DOUBLE, 60.0,
              'How long ~/update_model lets the running goals finish before the swap (new '
              'goals wait in the queue meanwhile); the goals still running then are '
              'cancelled with reason model_update', read_only=False,
              range=Range(0.0, 3600.0)),
    ParamSpec('thermal.enabled', ParamType.BOOL, True,
              'Throttle generation when the SoC runs hot'),
    ParamSpec('thermal.zones', ParamType.STRING_ARRAY, ['*'],
              "thermal_zone types watched, shell patterns ('*' = every zone); the hottest "
              'counts', min_items=1),
    ParamSpec('thermal.limit_c', ParamType.DOUBLE, 85.0,
              'Throttle at or above this temperature (deg C)', range=_TEMPERATURE_C),
    ParamSpec('thermal.resume_c', ParamType.DOUBLE, 75.0,
              'Stop throttling at or below this temperature (deg C; below limit_c)',
              range=_TEMPERATURE_C),
    ParamSpec('thermal.throttle_threads', ParamType.INTEGER, 0,
              'Cores kept busy while throttled; 0 = half of them', range=_THREADS),
    ParamSpec('thermal.token_pause_ms', ParamType.DOUBLE, 20.0,
              'Pause between generated tokens while throttled', range=Range(0.0, 1000.0)),
    ParamSpec('cpu.kernel', ParamType.STRING, 'auto',
              'CPU kernels of the GGUF-block ops (kquant models): auto = the best this CPU '
              'has; a pin this CPU lacks is a configure error naming its features',
              choices=CPU_KERNELS),
    ParamSpec('speculative.mode', ParamType.STRING, 'off',
              'Speculative decoding (docs/speculative.md): off; prompt_lookup (n-grams of the '
              'context); draft (speculative.draft_model); auto (prompt lookup, or the draft '
              'model when given, off per sequence below break-even). Exact: the output is '
              "plain decoding's; needs a kquant folder", choices=SPECULATIVE_MODES),
    ParamSpec('speculative.max_draft', ParamType.INTEGER, 6,
              'Most tokens drafted per verify pass (the length adapts below it)',
              range=Range(1, 32)),
    ParamSpec('speculative.draft_model', ParamType.STRING, '',
              "A converted model folder with the model's tokenizer that drafts for it "
              "(mode draft or auto); '' = none"),
    ParamSpec('cuda.kernel_set', ParamType.STRING, 'none',
              'CUDA kernel set built and checked at configure (kernels/*.cu)',
              choices=KERNEL_SETS),
    ParamSpec('cuda.sm_arch', ParamType.STRING, '',
              "GPU architecture the kernels are built for, e.g. sm_87 (Orin); '' = no GPU",
              pattern=r'(sm_\d{2,3})?'),
    *REMOTE_SPECS,
)

# Frame sides the vision nodes accept (frame_source width/height, vision.synthetic checks).
MIN_FRAME_SIDE = 16
MAX_FRAME_SIDE = 8192
# Default width of the perception stand-in's embeddings: SmolLM2-135M, the embedded LLM.
SMOLLM2_HIDDEN = 576
POOL_ID_PATTERN = r'[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}'
COPY_MODES = ('auto', 'always', 'never')
TRANSPORTS = ('auto', 'zero_copy', 'copy')
_FRAME_SIDE = Range(MIN_FRAME_SIDE, MAX_FRAME_SIDE)


def pool_specs(pool_id: str, slots: int, lease_s: float, what: str) -> Tuple[ParamSpec, ...]:
    """Specs of a vision node's output pool and its copying fallback."""
    return (
        ParamSpec('pool.id', ParamType.STRING, pool_id,
                  'Pool id of the %s (names the socket consumers connect to)' % what,
                  pattern=POOL_ID_PATTERN),
        ParamSpec('pool.slots', ParamType.INTEGER, slots,
                  'Buffers in the %s ring; the producer keeps one, consumers share the '
                  'rest (sum of their max_inflight)' % what, range=Range(2, 256)),
        ParamSpec('pool.allocator', ParamType.STRING, 'auto',
                  "Buffer allocator; 'auto' = best available (dma_heap, udmabuf, memfd)",
                  choices=('auto',) + ALLOCATORS),
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
    ParamSpec('width', ParamType.INTEGER, 640, 'Frame width in pixels', range=_FRAME_SIDE),
    ParamSpec('height', ParamType.INTEGER, 480, 'Frame height in pixels', range=_FRAME_SIDE),
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
              'ONNX image model (one input taking the frame), or a converted VLM folder (its '
              "vision encoder; goals take the handles in images); '' = the built-in random "
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
    ParamSpec('window.seconds', ParamType.DOUBLE, 0.0,
              'Hold the last N seconds of frames (one copy each into the window pool) for '
              '~/window, so a goal can name a time window instead of handles; 0 = off',
              range=Range(0.0, 3600.0)),
    ParamSpec('window.max_frames', ParamType.INTEGER, 150,
              'Most frames the window holds (its pool slots), whatever window.seconds says',
              range=Range(1, 4096)),
    ParamSpec('window.max_mb', ParamType.INTEGER, 512,
              'Memory budget of the window pool in MiB: fewer frames are held where '
              'window.max_frames of this camera would not fit', range=Range(1, 1 << 20)),
    ParamSpec('window.pool_id', ParamType.STRING, '',
              "Pool id of the window's frames; '' = <pool.id>_window",
              pattern='|' + POOL_ID_PATTERN),
) + pool_specs('embeddings', 8, 30.0, 'embeddings')


@dataclass(frozen=True)
class NodeSchema:
    """The parameters of one node.

    `complete`: resolution passes every default explicitly and refuses unknown keys even in
    params files. Otherwise only the values set reach the node (which declares the same
    defaults from these specs) and unknown keys of params files pass through.
    """

    node: str
    specs: Tuple[ParamSpec, ...]
    complete: bool

    def get(self, name: str) -> ParamSpec:
        """Spec of `name`, or UnknownParameterError naming close matches."""
        for spec in self.specs:
            if spec.name == name:
                return spec
        raise UnknownParameterError(_unknown_message(name, self.node, self.names()))

    def names(self) -> Tuple[str, ...]:
        """All parameter names, in declaration order."""
        return tuple(spec.name for spec in self.specs)

    def defaults(self) -> Dict[str, Any]:
        """Name -> default value (fresh lists)."""
        return {s.name: list(s.default) if isinstance(s.default, list) else s.default
                for s in self.specs}

    def validate(self, params: Mapping[str, Any], source: str = '',
                 strict: bool = True) -> Dict[str, Any]:
        """Check every key and value; unknown keys are errors when strict or complete."""
        out: Dict[str, Any] = {}
        known = set(self.names())
        for name, value in params.items():
            if name in known:
                out[name] = self.get(name).validate(value, source)
            elif strict or self.complete:
                prefix = '%s: ' % source if source else ''
                raise UnknownParameterError(prefix + _unknown_message(
                    name, self.node, self.names()))
            else:
                out[name] = value   # owned by the node itself; it validates its own
        return out


def _unknown_message(name: str, node: str, names: Iterable[str]) -> str:
    names = list(names)
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    hint = ('did you mean %s?' % ' or '.join(close)) if close else (
        'known: %s' % ', '.join(names))
    return 'unknown parameter %r for %s; %s' % (name, node, hint)


SCHEMAS: Dict[str, NodeSchema] = {
    'llm_node': NodeSchema('llm_node', LLM_NODE_SPECS, complete=True),
    # The pipeline launch passes the vision nodes only what profiles and users set.
    'frame_source': NodeSchema('frame_source', FRAME_SOURCE_SPECS, complete=False),
    'perception': NodeSchema('perception', PERCEPTION_SPECS, complete=False),
    'openai_bridge': NodeSchema('openai_bridge', OPENAI_BRIDGE_SPECS, complete=False),
    'memory': NodeSchema('memory', MEMORY_SPECS, complete=False),
}


# Overrides ROS itself reads on any node (QoS of its publishers and subscriptions): a shared
# params file may set them for topics this node never opens.
ROS_OVERRIDE_PREFIXES = ('qos_overrides.',)


def check_overrides(node: str, overrides: Iterable[str],
                    declared: Callable[[str], bool]) -> Tuple[str, ...]:
    """Refuse overrides (command line, params files, launch) that name no parameter of `node`.

    rclpy keeps an override of an undeclared name and says nothing, so a typo would pass
    silently. `declared(name)` says whether the node declared the name (its schema and
    rclpy's own, such as use_sim_time). A name another node of this package declares passes
    through: a shared params file's `/**` section sets it for every node, and only that node
    reads it. Returns the names that passed through (sorted, for a log line); raises
    UnknownParameterError naming every unknown override and its closest declared names.
    """
    own = SCHEMAS[node].names() if node in SCHEMAS else ()
    others = {name for key, other in SCHEMAS.items() if key != node for name in other.names()}
    unknown, passed = [], []
    for name in sorted(overrides):
        if declared(name) or name.startswith(ROS_OVERRIDE_PREFIXES):
            continue
        if name in others:
            passed.append(name)
        else:
            unknown.append(name)
    if unknown:
        raise UnknownParameterError(
            '%s: %d parameter override(s) name no parameter of %s: %s. They came from the '
            'command line (-p), a params file or a launch file: fix the name, or address it '
            'to the node that declares it' % (node, len(unknown), node, '; '.join(
                _override_hint(name, own) for name in unknown)))
    return tuple(passed)


def _override_hint(name: str, names: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(names), n=3, cutoff=0.6)
    return '%r (did you mean %s?)' % (name, ' or '.join(close)) if close else (
        '%r (nothing close; `ros2 param list` on the node lists its parameters)' % name)


def schema(node: str) -> NodeSchema:
    """Return the schema of `node` ('llm_node', 'frame_source', 'perception', ...)."""
    try:
        return SCHEMAS[node]
    except KeyError:
        raise UnknownParameterError('no parameter schema for node %r; known: %s' % (
            node, ', '.join(SCHEMAS))) from None


def parse_provider_options(items: Iterable[str]) -> Dict[str, Dict[str, str]]:
    """'Provider:key=value' items -> {provider: {key: value}}; ValueError on bad syntax."""
    out: Dict[str, Dict[str, str]] = {}
    for item in items:
        provider, sep, pair = item.partition(':')
        key, eq, value = pair.partition('=')
        if not sep or not eq or not key.strip():
            raise ValueError("%r is not 'Provider:key=value'" % item)
        if provider not in PROVIDERS:
            raise ValueError('%r names provider %r; known: %s' % (
                item, provider, ', '.join(PROVIDERS)))
        out.setdefault(provider, {})[key.strip()] = value.strip()
    return out


def check_consistency(values: Mapping[str, Any], source: str = '') -> None:
    """Cross-parameter rules of llm_node (after merging all layers)."""
    from edge_llm_ros.bringup.affinity import parse_cpu_list
    from edge_llm_ros.bringup.errors import ThermalError
    where = '%s: ' % source if source else ''
    limit, resume = values['thermal.limit_c'], values['thermal.resume_c']
    if resume >= limit:
        raise ThermalError('%sthermal.resume_c (%s) must be below thermal.limit_c (%s) '
                           'for hysteresis' % (where, resume, limit))
    cpus = parse_cpu_list(values['engine.cpu_affinity'])
    threads = values['engine.intra_op_threads']
    if cpus and threads > len(cpus):
        raise ParameterRangeError(
            '%sengine.intra_op_threads = %d exceeds the %d core(s) of engine.cpu_affinity %r: '
            'lower the threads or widen the affinity' % (
                where, threads, len(cpus), values['engine.cpu_affinity']))
    options = parse_provider_options(values['engine.provider_options'])
    unused = sorted(set(options) - set(values['engine.providers']))
    if unused:
        raise ParameterRangeError('%sengine.provider_options name %s, which is not in '
                                  'engine.providers %r' % (where, ', '.join(unused),
                                                           values['engine.providers']))
    if values.get('engine.backend') == 'remote' and not values.get('remote.url'):
        raise ParameterRangeError('%sengine.backend remote needs remote.url (the OpenAI base '
                                  'URL of the server, e.g. http://host:8000/v1)' % where)
    if values['cuda.kernel_set'] != 'none' and not values['cuda.sm_arch']:
        raise ParameterRangeError('%scuda.kernel_set %r needs cuda.sm_arch (e.g. sm_87)' % (
            where, values['cuda.kernel_set']))
    cap = values.get('vision.max_image_tokens', 0)
    if cap >= values['kv.max_context']:
        raise ParameterRangeError(
            '%svision.max_image_tokens = %d leaves no room in kv.max_context = %d: lower the '
            'cap (or 0: the context bounds images)' % (where, cap, values['kv.max_context']))


def resolved_threads(values: Mapping[str, Any]) -> int:
    """Intra-op threads to use: 0 with an affinity means one thread per pinned core."""
    from edge_llm_ros.bringup.affinity import parse_cpu_list
    threads = values['engine.intra_op_threads']
    cpus = parse_cpu_list(values['engine.cpu_affinity'])
    return len(cpus) if threads == 0 and cpus else threads


def engine_kwargs(values: Mapping[str, Any]) -> Dict[str, Any]:
    """Keyword arguments of serving.engine.EngineConfig from llm_node parameter values.

    All but `speculative`, a SpeculativeConfig of speculative_kwargs: values in, plain values
    out, so this table loads none of the engine.
    """
    from edge_llm_ros.bringup.affinity import ort_intra_op_affinity, parse_cpu_list
    providers = tuple(values['engine.providers'])
    options = parse_provider_options(values['engine.provider_options'])
    threads = resolved_threads(values)
    return {
        'model_dir': values['model.path'],
        'model_family': values['model.family'],
        'providers': providers,
        'provider_options': tuple(options.get(p, {}) for p in providers),
        'intra_op_threads': threads,
        'intra_op_affinity': ort_intra_op_affinity(
            parse_cpu_list(values['engine.cpu_affinity']), threads),
        'max_context': values['kv.max_context'],
        'kv_dtype': values['kv.dtype'],
        'prefix_reuse': values['kv.prefix_reuse'],
        'max_sessions': values['kv.max_sessions'],
        'session_max_bytes': values['sessions.max_bytes'],
        'session_store': values['sessions.store'],
        'prefill_chunk': values['engine.prefill_chunk'],
        'parallel_sequences': values['engine.parallel_sequences'],
        'kv_memory_limit': values['kv.memory_limit'],
        'warm_prompts': tuple(values['kv.warm_prompts']),
        'kernel': values['cpu.kernel'],
        'lora_adapters': parse_lora_adapters(values['lora.adapters']),
        'lora_max_per_goal': values['lora.max_per_goal'],
        'lora_max_scale': values['lora.max_scale'],
        'max_image_tokens': values['vision.max_image_tokens'],
    }


def speculative_kwargs(values: Mapping[str, Any]) -> Dict[str, Any]:
    """Keyword arguments of runtime.speculative_config.SpeculativeConfig (the node's)."""
    return {
        'mode': values['speculative.mode'],
        'max_draft': values['speculative.max_draft'],
        'draft_model': values['speculative.draft_model'],
    }


def sampling_kwargs(values: Mapping[str, Any]) -> Dict[str, Any]:
    """Keyword arguments of engine.types.SamplingConfig (the node's defaults)."""
    seed = values['sampling.seed']
    return {
        'temperature': values['sampling.temperature'],
        'top_k': values['sampling.top_k'],
        'top_p': values['sampling.top_p'],
        'min_p': values['sampling.min_p'],
        'repetition_penalty': values['sampling.repetition_penalty'],
        'presence_penalty': values['sampling.presence_penalty'],
        'frequency_penalty': values['sampling.frequency_penalty'],
        'seed': None if seed < 0 else seed,
        # Per request only (SamplingParams): no node-wide default but "off".
        'logit_bias': None,
        'logprobs': False,
        'top_logprobs': 0,
    }


def remote_kwargs(values: Mapping[str, Any]) -> Dict[str, Any]:
    """Keyword arguments of engine.remote.RemoteConfig (engine.backend remote)."""
    return {
        'url': values['remote.url'],
        'model': values['remote.model'],
        'api_key_env': values['remote.api_key_env'],
        'timeout_s': values['remote.timeout_s'],
        'context_length': values['remote.context_length'],
    }
