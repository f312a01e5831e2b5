"""Model family configs: config/models/<family>.yaml read into ModelFamilyConfig.

A family config holds what the GGUF does not say but the engine must know to serve a model
well: stop tokens, the reasoning tags and how to turn reasoning off, the tool-call format its
fine-tune emits, an optional chat-template override, and the recommended board, context and
converter flags. Files are checked strictly (an unknown key is a typo that would silently
change nothing), and every error names the file and the key.

A converted model folder is matched to its family by model.yaml: an explicit `family` key
wins, then the longest `match_names` entry found in its `gguf_name` (the source's own name;
`name` in a folder converted before it was kept apart), then the family marked `fallback` for
its `architecture`. `family_label` gives the family part of a model's display name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import os
import pathlib
import re
import sys
from typing import Any, Dict, Mapping, Optional, Tuple

from edge_llm_ros.errors import InvalidRequestError, ModelLoadError
from edge_llm_ros.model_format import ARCHITECTURES as MODEL_ARCHITECTURES, PRECISIONS
from edge_llm_ros.runtime.choices import GROUNDING_FRAMES
from edge_llm_ros.safe_yaml import safe_load_bounded, YamlFormatError

TOOL_CALL_FORMATS = ('hermes', 'llama3_json', 'mistral', 'lfm2', 'gemma4', 'qwen3_xml',
                     'generic_json', 'none')
ARCHITECTURES = MODEL_ARCHITECTURES   # the families a model folder may hold
# The family part of a display name when no family's name matches the model's (see
# family_label): the architecture as its makers write it.
ARCHITECTURE_LABELS = {'llama': 'Llama', 'qwen2': 'Qwen2', 'qwen3': 'Qwen3',
                       'gemma3': 'Gemma 3', 'phi3': 'Phi-3', 'lfm2': 'LFM2',
                       'qwen2vl': 'Qwen2.5-VL', 'qwen35': 'Qwen3.5', 'qwen3vl': 'Qwen3-VL',
                       'gemma4': 'Gemma 4', 'smollm3': 'SmolLM3',
                       'granitehybrid': 'Granite 4.0-H'}
# Converter flags a family may preset (edge-llm-convert's options of the same names).
CONVERSION_FLAGS = {'precision': str, 'block_size': int, 'dtype': str, 'accuracy_level': int,
                    'max_context': int}
_SUBDIR = ('config', 'models')


class ModelConfigError(ModelLoadError):
    """A config/models file is missing, malformed, or names no known family."""


@dataclass(frozen=True)
class ReasoningConfig:
    """How a family marks its reasoning ("thinking") text."""

    open_tag: str = '<think>'
    close_tag: str = '</think>'
    # The chat template itself opens the block at the generation prompt (DeepSeek-R1
    # distills), so the output starts inside the reasoning.
    starts_open: bool = False
    # Template kwarg that turns reasoning off when set to False (Qwen3: enable_thinking);
    # None: this family cannot skip reasoning.
    disable_kwarg: Optional[str] = None
    # Text forced when a reasoning budget is spent (tokenized with the model's tokenizer).
    force_close_text: str = '\n</think>\n\n'
    # Template kwarg that turns reasoning on when True and off when False (Gemma 4:
    # enable_thinking; its template does not reason when the kwarg is left out). Set, it is
    # always passed: True unless the request turns reasoning off.
    enable_kwarg: Optional[str] = None


@dataclass(frozen=True)
class ModelFamilyConfig:
    """One config/models/<family>.yaml (see the module docstring)."""

    family: str
    architectures: Tuple[str, ...]
    match_names: Tuple[str, ...] = ()
    # The family answers for its architectures when no name matches.
    fallback: bool = False
    # A template file in config/models/templates/ replacing the model's own; None keeps it.
    chat_template: Optional[str] = None
    stop_tokens: Tuple[str, ...] = ()
    reasoning: Optional[ReasoningConfig] = None
    tool_call_format: str = 'generic_json'
    recommended_board: str = 'x86_64'
    recommended_context: int = 2048
    conversion: Mapping[str, Any] = field(default_factory=dict)
    description: str = ''
    # How people write the family, for display names ('SmolLM2'); '' = the family's name.
    display_name: str = ''
    # A generation's own label, by the match_names entry that matched ({'qwen2.5': 'Qwen2.5'}).
    display_names: Mapping[str, str] = field(default_factory=dict)
    source: str = ''  # the file it was read from
    # Grounding VLMs (Qwen-VL): the coordinate frame of the boxes and points their JSON answers
    # hold (runtime/choices.GROUNDING_FRAMES); '' = the family does not ground.
    grounding: str = ''

    @property
    def can_disable_reasoning(self) -> bool:
        return self.reasoning is not None and (self.reasoning.disable_kwarg is not None or
                                               self.reasoning.enable_kwarg is not None)

    def template_kwargs(self, reasoning: bool = True) -> Dict[str, Any]:
        """Extra chat-template variables: how to ask for no reasoning (see ReasoningConfig).

        Raises InvalidRequestError when reasoning=False and the family cannot turn it off.
        """
        if self.reasoning is not None and self.reasoning.enable_kwarg is not None:
            return {self.reasoning.enable_kwarg: bool(reasoning)}
        if reasoning or self.reasoning is None:
            return {}
        if self.reasoning.disable_kwarg is None:
            raise InvalidRequestError(f'the {self.family} family cannot turn reasoning off (its '
                                      'template has no switch); leave reasoning on and set a '
                                      'reasoning_budget instead')
        return {self.reasoning.disable_kwarg: False}

    def template_path(self) -> Optional[pathlib.Path]:
        """Return the chat-template override file, or None to use the model's own."""
        if self.chat_template is None:
            return None
        return pathlib.Path(self.source).parent / 'templates' / self.chat_template


def models_dir() -> pathlib.Path:
    """config/models of a source checkout, else of the installed package's share folder."""
    here = pathlib.Path(__file__).resolve()
    candidates = [here.parents[2].joinpath(*_SUBDIR),
                  pathlib.Path(sys.prefix, 'share', 'edge_llm_ros', *_SUBDIR)]
    found = next((c for c in candidates if c.is_dir()), None)
    if found is None:
        raise ModelConfigError('no config/models folder found (looked in '
                               f'{", ".join(map(str, candidates))}); reinstall edge_llm_ros')
    return found


def available_families(config_dir: Optional[os.PathLike] = None) -> Tuple[str, ...]:
    folder = pathlib.Path(config_dir) if config_dir else models_dir()
    return tuple(sorted(p.stem for p in folder.glob('*.yaml')))


def load_family(name: str, config_dir: Optional[os.PathLike] = None) -> ModelFamilyConfig:
    """Read config/models/<name>.yaml (a family name, or the path of a .yaml file)."""
    if str(name).endswith('.yaml') and pathlib.Path(name).is_file():
        return parse_family_file(pathlib.Path(name))
    folder = pathlib.Path(config_dir) if config_dir else models_dir()
    families = available_families(folder)
    if name not in families:
        raise ModelConfigError(f'unknown model family {name!r}; known families: '
                               f'{", ".join(families)}')
    return parse_family_file(folder / f'{name}.yaml')


def load_all(config_dir: Optional[os.PathLike] = None) -> Dict[str, ModelFamilyConfig]:
    """Every family of the folder, checked together (one fallback per architecture)."""
    folder = pathlib.Path(config_dir) if config_dir else models_dir()
    configs = {n: parse_family_file(folder / f'{n}.yaml') for n in available_families(folder)}
    fallbacks: Dict[str, str] = {}
    for cfg in configs.values():
        for arch in cfg.architectures if cfg.fallback else ():
            if arch in fallbacks:
                raise ModelConfigError(f'{cfg.source}: fallback: both {fallbacks[arch]} and '
                                       f'{cfg.family} claim architecture {arch}; keep one')
            fallbacks[arch] = cfg.family
    return configs


def family_for_model(meta: Mapping[str, Any],
                     config_dir: Optional[os.PathLike] = None) -> ModelFamilyConfig:
    """Find the family of a converted model from its model.yaml (see module docstring)."""
    return _match_family(meta, load_all(config_dir))[0]


def family_label(meta: Mapping[str, Any], config_dir: Optional[os.PathLike] = None) -> str:
    """Return the family part of a model's display name ('SmolLM2', 'Qwen3', 'Llama').

    The family config's display_name (or its display_names entry for the match_names entry
    that matched) when model.yaml names the family or the model's name matches one; else (a
    family that only answers as its architecture's fallback, or none) the architecture's
    label: a llama-architecture fine-tune is not called "Llama 3".
    """
    arch = str(meta.get('architecture') or '')
    try:
        cfg, how = _match_family(meta, load_all(config_dir))
    except ModelConfigError:
        cfg, how = None, None
    if cfg is None or how is None:
        return ARCHITECTURE_LABELS.get(arch, arch or 'model')
    return cfg.display_names.get(how) or cfg.display_name or cfg.family


def _match_family(meta: Mapping[str, Any], configs: Mapping[str, ModelFamilyConfig]
                  ) -> Tuple[ModelFamilyConfig, Optional[str]]:
    """Return the family and how: the match_names entry, '' (named), None (a fallback)."""
    explicit = meta.get('family')
    if explicit:
        if explicit not in configs:
            raise ModelConfigError(f'model.yaml names family {explicit!r}, which has no config; '
                                   f'known families: {", ".join(sorted(configs))}')
        return configs[explicit], ''
    arch = meta.get('architecture')
    raw_name = meta['gguf_name'] if meta.get('gguf_name') else meta.get('name')
    name = _normalized(str(raw_name or ''))
    best, best_len, matched = None, 0, ''
    for cfg in configs.values():
        if arch is not None and arch not in cfg.architectures:
            continue
        for pattern in cfg.match_names:
            p = _normalized(pattern)
            if p and p in name and len(p) > best_len:
                best, best_len, matched = cfg, len(p), pattern
    if best is not None:
        return best, matched
    for cfg in configs.values():
        if cfg.fallback and arch in cfg.architectures:
            return cfg, None
    raise ModelConfigError(f'no model family matches name {raw_name!r} with '
                           f'architecture {arch!r}; add `family: <name>` to model.yaml or a '
                           'config/models/<family>.yaml for it')


def family_for_model_dir(model_dir: os.PathLike,
                         config_dir: Optional[os.PathLike] = None) -> ModelFamilyConfig:
    """Find the family of a converted model folder (reads its model.yaml)."""
    path = pathlib.Path(model_dir) / 'model.yaml'
    if not path.is_file():
        raise ModelConfigError(f'{path} does not exist: give a converted model folder')
    meta = _load_yaml(path)
    if not isinstance(meta, dict):
        raise ModelConfigError(f'{path} must be a mapping')
    return family_for_model(meta, config_dir)


def resolve_model(spec: str, config_dir: Optional[os.PathLike] = None) -> ModelFamilyConfig:
    """Resolve `model:=`: a family name, a family .yaml file, or a converted model folder."""
    if spec and pathlib.Path(spec).is_dir():
        return family_for_model_dir(spec, config_dir)
    return load_family(spec, config_dir)


# --- parsing ------------------------------------------------------------------------------

_TOP_KEYS = {'family', 'description', 'display_name', 'display_names', 'architectures',
             'match_names', 'fallback', 'chat_template', 'stop_tokens', 'reasoning',
             'tool_call_format', 'recommended', 'conversion', 'grounding'}
_REASONING_KEYS = {'open_tag', 'close_tag', 'starts_open', 'disable_kwarg', 'force_close_text',
                   'enable_kwarg'}
_RECOMMENDED_KEYS = {'board', 'context'}


def parse_family_file(path: pathlib.Path) -> ModelFamilyConfig:
    """Read and check one family file; ModelConfigError names the file and the key."""
    doc = _load_yaml(path)
    src = str(path)
    if not isinstance(doc, dict):
        raise ModelConfigError(f'{src}: must be a mapping of keys to values')
    _no_unknown(doc, _TOP_KEYS, src, '')
    family = _get(doc, 'family', str, src)
    if family != path.stem:
        raise ModelConfigError(f'{src}: family: {family!r} must equal the file name '
                               f'{path.stem!r}')
    archs = _str_tuple(doc, 'architectures', src, required=True)
    for arch in archs:
        if arch not in ARCHITECTURES:
            raise ModelConfigError(f'{src}: architectures: {arch!r} is not one of '
                                   f'{", ".join(ARCHITECTURES)}')
    fmt = _get(doc, 'tool_call_format', str, src, 'generic_json')
    if fmt not in TOOL_CALL_FORMATS:
        raise ModelConfigError(f'{src}: tool_call_format: {fmt!r} is not one of '
                               f'{", ".join(TOOL_CALL_FORMATS)}')
    template = _get(doc, 'chat_template', str, src, None)
    if template is not None and not (path.parent / 'templates' / template).is_file():
        raise ModelConfigError(f'{src}: chat_template: {path.parent / "templates" / template} '
                               'does not exist')
    grounding = _get(doc, 'grounding', str, src, '')
    if grounding and grounding not in GROUNDING_FRAMES:
        raise ModelConfigError(f'{src}: grounding: {grounding!r} is not one of '
                               f'{", ".join(GROUNDING_FRAMES)} (or leave it out: no grounding)')
    rec = _section(doc, 'recommended', _RECOMMENDED_KEYS, src)
    # A board profile's name; bringup, which owns the boards, checks it names one
    # (profiles.check_recommended_board, at launch).
    board = _get(rec, 'board', str, src + ': recommended', 'x86_64')
    context = _get(rec, 'context', int, src + ': recommended', 2048)
    if context < 1:
        raise ModelConfigError(f'{src}: recommended.context must be >= 1, got {context}')
    return ModelFamilyConfig(
        family=family, architectures=archs, match_names=_str_tuple(doc, 'match_names', src),
        fallback=_get(doc, 'fallback', bool, src, False), chat_template=template,
        stop_tokens=_str_tuple(doc, 'stop_tokens', src), reasoning=_reasoning(doc, src),
        tool_call_format=fmt, recommended_board=board, recommended_context=context,
        conversion=_conversion(doc, src), description=_get(doc, 'description', str, src, ''),
        display_name=_get(doc, 'display_name', str, src, ''),
        display_names=_display_names(doc, src), source=src, grounding=grounding)


def _display_names(doc: Mapping[str, Any], src: str) -> Dict[str, str]:
    """display_names: {a match_names entry: its label}; a key that matches nothing is a typo."""
    sec = doc.get('display_names')
    if sec is None:
        return {}
    if not isinstance(sec, dict):
        raise ModelConfigError(f'{src}: display_names must be a mapping of match_names entries '
                               'to labels')
    patterns = set(doc.get('match_names') or ())
    for key, label in sec.items():
        if key not in patterns:
            raise ModelConfigError(f'{src}: display_names: {key!r} is not one of match_names '
                                   f'({", ".join(sorted(map(str, patterns)))})')
        if not isinstance(label, str) or not label:
            raise ModelConfigError(f'{src}: display_names.{key} must be a non-empty string')
    return dict(sec)


def _reasoning(doc: Mapping[str, Any], src: str) -> Optional[ReasoningConfig]:
    if doc.get('reasoning') is None:
        return None
    sec = _section(doc, 'reasoning', _REASONING_KEYS, src)
    where = src + ': reasoning'
    cfg = ReasoningConfig(open_tag=_get(sec, 'open_tag', str, where, '<think>'),
                          close_tag=_get(sec, 'close_tag', str, where, '</think>'),
                          starts_open=_get(sec, 'starts_open', bool, where, False),
                          disable_kwarg=_get(sec, 'disable_kwarg', str, where, None),
                          force_close_text=_get(sec, 'force_close_text', str, where,
                                                '\n</think>\n\n'),
                          enable_kwarg=_get(sec, 'enable_kwarg', str, where, None))
    if not cfg.open_tag or not cfg.close_tag or cfg.open_tag == cfg.close_tag:
        raise ModelConfigError(f'{where}: open_tag and close_tag must be two different '
                               'non-empty strings')
    if cfg.close_tag not in cfg.force_close_text:
        raise ModelConfigError(f'{where}: force_close_text must contain close_tag '
                               f'{cfg.close_tag!r}')
    return cfg


def _conversion(doc: Mapping[str, Any], src: str) -> Dict[str, Any]:
    sec = _section(doc, 'conversion', set(CONVERSION_FLAGS), src)
    out = {k: _get(sec, k, t, src + ': conversion') for k, t in CONVERSION_FLAGS.items()
           if k in sec}
    if 'precision' in out and out['precision'] not in PRECISIONS:
        raise ModelConfigError(f'{src}: conversion.precision: {out["precision"]!r} is not one '
                               f'of {", ".join(PRECISIONS)}')
    return out


def _load_yaml(path: pathlib.Path) -> Any:
    try:
        text = path.read_text(encoding='utf-8')
    except OSError as exc:
        raise ModelConfigError(f'{path}: cannot be read ({exc.strerror})') from None
    try:
        return safe_load_bounded(text, str(path))
    except YamlFormatError as exc:
        raise ModelConfigError(str(exc)) from None


def _no_unknown(sec: Mapping[str, Any], known: set, src: str, prefix: str) -> None:
    for key in sec:
        if key not in known:
            raise ModelConfigError(f'{src}: unknown key {prefix + str(key)!r}; valid keys: '
                                   f'{", ".join(sorted(known))}')


def _section(doc: Mapping[str, Any], key: str, known: set, src: str) -> Mapping[str, Any]:
    sec = doc.get(key)
    if sec is None:
        return {}
    if not isinstance(sec, dict):
        raise ModelConfigError(f'{src}: {key} must be a mapping')
    _no_unknown(sec, known, src, key + '.')
    return sec


_MISSING = object()


def _get(sec: Mapping[str, Any], key: str, typ: type, src: str, default: Any = _MISSING) -> Any:
    if key not in sec or sec[key] is None:
        if default is _MISSING:
            raise ModelConfigError(f'{src}: {key} is required')
        return default
    value = sec[key]
    # bool is an int in Python: `context: true` must not pass as 1.
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ModelConfigError(f'{src}: {key} must be {typ.__name__}, not '
                               f'{type(value).__name__} ({value!r})')
    return value


def _str_tuple(doc: Mapping[str, Any], key: str, src: str,
               required: bool = False) -> Tuple[str, ...]:
    value = doc.get(key)
    if value is None and not required:
        return ()
    if not isinstance(value, list) or not value and required or \
            not all(isinstance(v, str) and v for v in value):
        raise ModelConfigError(f'{src}: {key} must be a list of non-empty strings'
                               + (' with at least one entry' if required else ''))
    return tuple(value)


def _normalized(text: str) -> str:
    return re.sub(r'[^0-9a-z]', '', text.lower())
