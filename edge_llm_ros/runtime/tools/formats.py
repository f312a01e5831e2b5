"""The tool-call formats families are tuned on (config/models/*.yaml `tool_call_format`).

One table, read by the parser (where calls are in the output), the grammar (what to force)
and the renderer (how to describe tools when a template has no tools section).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from edge_llm_ros.runtime.tools.spec import InvalidToolsError


@dataclass(frozen=True)
class ToolFormat:
    name: str
    # Markers that open a run of calls anywhere in the output (special tokens or text).
    open_markers: Tuple[str, ...]
    # Text that closes the run ('' = the calls run to the end of the output).
    close: str
    # Prefixes that open a run only at the very start of the output (after whitespace): a
    # bare JSON answer, e.g. when the tokenizer dropped a special marker.
    start_markers: Tuple[str, ...]
    # The key holding the arguments (parsers also accept the other common one).
    args_key: str
    # How several calls are written: inside one JSON array, or one after another.
    array: bool
    separator: str        # between calls when not in an array
    id_style: str         # see spec.new_call_id
    # Text that leads each forced call and follows it (grammar and examples).
    call_prefix: str
    call_suffix: str
    # The parser also reads a Python call list between the open and close markers
    # ([move_to(x=1), stop()]); needs a close marker, since the list is read whole there.
    python_calls: bool = False
    # Likewise Gemma 4's call:name{key:value,...} (tools/gemma4_calls.py) between the markers.
    gemma4_calls: bool = False
    # Likewise Qwen3.5 / Qwen3-Coder's <function=NAME><parameter=KEY>... (tools/xml_calls.py).
    xml_calls: bool = False


FORMATS: Dict[str, ToolFormat] = {
    # Qwen2.5/Qwen3/Hermes: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
    'hermes': ToolFormat('hermes', ('<tool_call>',), '</tool_call>', (), 'arguments', False,
                         '\n', 'openai', '<tool_call>\n', '\n</tool_call>'),
    # Llama 3.x custom tools: {"name": ..., "parameters": {...}}, maybe after <|python_tag|>.
    'llama3_json': ToolFormat('llama3_json', ('<|python_tag|>',), '', ('{',), 'parameters',
                              False, '; ', 'openai', '', ''),
    # Mistral v0.3+: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
    'mistral': ToolFormat('mistral', ('[TOOL_CALLS]',), '', ('[{',), 'arguments', True, ', ',
                          'mistral', '', ''),
    # LFM2 / LFM2.5: <|tool_call_start|>[...]<|tool_call_end|>. Parsed inside the markers:
    # its default Python call list ([move_to(x=1.5, frame="map"), stop()]; keyword arguments
    # with literal values only) or a JSON list ([{"name": ..., "arguments": {...}}]). The tool
    # constraint forces only the JSON list: from the open marker under tool_choice auto, from
    # the first token under required or a named tool.
    'lfm2': ToolFormat('lfm2', ('<|tool_call_start|>',), '<|tool_call_end|>', (), 'arguments',
                       False, '\n', 'openai', '<|tool_call_start|>[', ']<|tool_call_end|>',
                       python_calls=True),
    # Gemma 4: <|tool_call>call:name{key:<|"|>text<|"|>,n:1}<tool_call|>, one call a marker
    # pair, read at the close marker (gemma4_calls). The tool constraint forces a JSON object
    # between the markers, which the parser reads as well.
    'gemma4': ToolFormat('gemma4', ('<|tool_call>',), '<tool_call|>', (), 'arguments', False,
                         '', 'openai', '<|tool_call>', '<tool_call|>', gemma4_calls=True),
    # Qwen3.5 / Qwen3-Coder: <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>
    # \n</function>\n</tool_call>, values typed by the tool's schema as llama.cpp does
    # (xml_calls), read at the close marker. The tool constraint forces a Hermes JSON object
    # between the markers, which the parser reads as well.
    'qwen3_xml': ToolFormat('qwen3_xml', ('<tool_call>',), '</tool_call>', (), 'arguments',
                            False, '\n', 'openai', '<tool_call>\n', '\n</tool_call>',
                            xml_calls=True),
    # Families with no trained format: the whole answer is the call(s) as JSON.
    'generic_json': ToolFormat('generic_json', (), '', ('```json', '```', '{', '['),
                               'arguments', False, '\n', 'openai', '', ''),
}
ARG_KEYS = ('arguments', 'parameters')


def tool_format(name: str) -> ToolFormat:
    """Look up config/models `tool_call_format` (InvalidToolsError for 'none')."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise InvalidToolsError(f'this model has no tool-call format ({name!r}); pick a model '
                                f'whose config sets one of {", ".join(FORMATS)}')
    return fmt
