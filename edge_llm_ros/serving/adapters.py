"""LoRA adapters of a loaded engine: loaded by name, chosen per goal with a scale.

`Adapters` loads an adapter in the engine's numpy form (runtime/lora_adapter.py; a LoRA GGUF
or PEFT folder is converted into it once by the caller: convert/lora.py ensure_converted, which
llm_node and the CLI call), checks it against the base model and registers it on the decoder's
op nodes (runtime/lora_ops.py). A goal names
adapters with scales (GenerationRequest.lora, name -> scale; an empty scale-less entry takes
the adapter's default): `resolve` checks them before any model work (AdapterRequestError for
an unknown name, a NaN scale or one outside +-max_scale, more than max_per_goal adapters) and
returns the rows' (id, scale) uses and the set's key. The key holds each adapter's content
digest, so KV written under one adapter set is reused only under the same set (the prefix
keys carry it: PreparedRequest.cache_keys), across restarts too.

An adapter in use by a running goal is unloaded when its last goal ends (acquire / release).
"""
from __future__ import annotations

from dataclasses import dataclass
import hashlib
import math
import threading
import time
from typing import Dict, List, Mapping, Tuple

from edge_llm_ros.errors import AdapterRequestError
from edge_llm_ros.model_format import ModelInfo
from edge_llm_ros.runtime.lora_adapter import load_converted, LoraAdapter
from edge_llm_ros.runtime.lora_ops import LoraOps

Uses = Tuple[Tuple[int, float], ...]
SetKey = Tuple[Tuple[str, float], ...]


@dataclass(frozen=True)
class AdapterLimits:
    """What a goal may ask (node parameters lora.max_per_goal, lora.max_scale)."""

    max_per_goal: int = 4
    max_scale: float = 4.0   # |scale| at most this


@dataclass
class LoadedAdapter:
    """One adapter the engine holds."""

    name: str
    path: str
    adapter_id: int
    digest: str             # sha256 of its pairs (12 hex): the prefix keys carry it
    default_scale: float
    rank: int
    alpha: float
    nbytes: int
    load_seconds: float
    in_use: int = 0         # running goals that use it
    unloading: bool = False  # unload asked while in use: dropped when its last goal ends


def digest_of(adapter: LoraAdapter) -> str:
    """Return a short content digest of an adapter's pairs and alpha."""
    h = hashlib.sha256(repr(adapter.alpha).encode())
    for key, pair in sorted(adapter.pairs.items()):
        h.update(repr(key).encode())
        h.update(pair.a.tobytes())
        h.update(pair.b.tobytes())
    return h.hexdigest()[:12]


class Adapters:
    """The engine's adapters by name (thread-safe: services and the engine thread use it)."""

    def __init__(self, ops_of, info: ModelInfo, limits: AdapterLimits = AdapterLimits()) -> None:
        """ops_of: returns the decoder's LoraOps (OnnxDecoder.enable_lora), on the first load."""
        self._ops_of = ops_of
        self._ops: LoraOps = None
        self.info = info
        self.limits = limits
        self._lock = threading.Lock()
        self._by_name: Dict[str, LoadedAdapter] = {}

    def load(self, name: str, path: str, default_scale: float = 1.0) -> LoadedAdapter:
        """Load, check and register an adapter under `name` (typed errors say what is wrong)."""
        if not name or '+' in name or ',' in name:
            raise AdapterRequestError(f'adapter name {name!r} is empty or holds "+" or ",": '
                                      'give a plain name (the bridge reads base+name)')
        self.check_scale(name, default_scale)
        with self._lock:
            if name in self._by_name:
                raise AdapterRequestError(f'an adapter named {name!r} is loaded already: '
                                          'unload it first or pick another name')
        t0 = time.perf_counter()
        if self._ops is None:
            self._ops = self._ops_of()
        adapter = load_converted(path, self.info, name)
        adapter_id = self._ops.add(adapter)
        ranks = sorted({p.rank for p in adapter.pairs.values()})
        loaded = LoadedAdapter(name, path, adapter_id, digest_of(adapter), float(default_scale),
                               ranks[-1], adapter.alpha, adapter.nbytes,
                               time.perf_counter() - t0)
        with self._lock:
            self._by_name[name] = loaded
        return loaded

    def unload(self, name: str) -> bool:
        """Unload `name`; True when done now, False when it goes after its running goals."""
        with self._lock:
            loaded = self._by_name.get(name)
            if loaded is None or loaded.unloading:
                raise AdapterRequestError(f'no adapter named {name!r} is loaded; loaded: '
                                          f'{", ".join(self.names()) or "none"}')
            if loaded.in_use:
                loaded.unloading = True
                return False
            del self._by_name[name]
        self._ops.remove(loaded.adapter_id)
        return True

    def names(self) -> List[str]:
        """Return the names a goal may use (not those being unloaded)."""
        return sorted(n for n, a in self._by_name.items() if not a.unloading)

    def loaded(self) -> List[LoadedAdapter]:
        """Return every loaded adapter (including those waiting to unload)."""
        with self._lock:
            return [self._by_name[n] for n in sorted(self._by_name)]

    def check_scale(self, name: str, scale: float) -> float:
        """Return the scale as a float, or AdapterRequestError for NaN / out of range."""
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
                or not math.isfinite(scale) or abs(scale) > self.limits.max_scale:
            raise AdapterRequestError(
                f'adapter {name!r}: scale {scale!r} is not a number within '
                f'[-{self.limits.max_scale:g}, {self.limits.max_scale:g}] (lora.max_scale)')
        return float(scale)

    def resolve(self, lora: Mapping[str, float]) -> Tuple[Uses, SetKey]:
        """Check a goal's adapters; return its rows' (id, scale) uses and its set key.

        A scale of None takes the adapter's default; scale 0 keeps the adapter in the set
        (its rows run the base product: the same bits) but not in the uses.
        """
        if not lora:
            return (), ()
        if len(lora) > self.limits.max_per_goal:
            raise AdapterRequestError(f'{len(lora)} adapters asked, at most '
                                      f'{self.limits.max_per_goal} per goal (lora.max_per_goal)')
        uses, key = [], []
        with self._lock:
            for name in sorted(lora):
                loaded = self._by_name.get(name)
                if loaded is None or loaded.unloading:
                    raise AdapterRequestError(
                        f'unknown adapter {name!r}: loaded adapters are '
                        f'{", ".join(self.names()) or "none"} (~/load_adapter loads one)')
                scale = lora[name]
                scale = loaded.default_scale if scale is None else self.check_scale(name, scale)
                if scale != 0.0:
                    uses.append((loaded.adapter_id, scale))
                    key.append((f'{name}@{loaded.digest}', scale))
        return tuple(uses), tuple(key)

    def acquire(self, uses: Uses) -> None:
        """Mark a starting goal's adapters in use (AdapterRequestError: one went meanwhile)."""
        with self._lock:
            by_id = {a.adapter_id: a for a in self._by_name.values()}
            gone = [i for i, _ in uses if i not in by_id or by_id[i].unloading]
            if gone:
                raise AdapterRequestError('an adapter of this goal was unloaded before it '
                                          'started: send the goal again')
            for i, _ in uses:
                by_id[i].in_use += 1

    def release(self, uses: Uses) -> None:
        """Mark an ended goal's adapters free; drop those whose unload waited for it."""
        drop = []
        with self._lock:
            by_id = {a.adapter_id: a for a in self._by_name.values()}
            for i, _ in uses:
                loaded = by_id.get(i)
                if loaded is None:
                    continue
                loaded.in_use -= 1
                if loaded.unloading and loaded.in_use == 0:
                    del self._by_name[loaded.name]
                    drop.append(i)
        for i in drop:
            self._ops.remove(i)
