"""Tools into the prompt: through the model's own template, or described in text.

Templates that know tools (Qwen, Llama 3.1+, Mistral, Hermes) get them as Hugging Face passes
them and write the tool section the model was tuned on. Templates that do not (SmolLM2 135M,
Gemma 3, the R1 distills) would drop them silently, so the tools are described in the system
message instead, with the call syntax of the family's format; earlier assistant calls are then
written into the message content in that syntax, since such templates drop `tool_calls` too.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from edge_llm_ros.runtime.tokenizer import message_dict, MessageLike, TextTokenizer
from edge_llm_ros.runtime.tools.formats import ToolFormat
from edge_llm_ros.runtime.tools.spec import ToolSpec


def call_example(fmt: ToolFormat) -> str:
    """How one call is written in `fmt`, with placeholders."""
    body = f'{{"name": <function-name>, "{fmt.args_key}": <arguments-json-object>}}'
    if fmt.name == 'mistral':
        return f'[TOOL_CALLS][{body}]'
    return f'{fmt.call_prefix}{body}{fmt.call_suffix}'


def tools_system_text(tools: Sequence[ToolSpec], fmt: ToolFormat) -> str:
    """Write the tool section for templates without one (Hermes-style wording)."""
    listed = '\n'.join(json.dumps(t.to_hf(), ensure_ascii=False) for t in tools)
    return ('# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'
            'You are provided with function signatures within <tools></tools> XML tags:\n'
            f'<tools>\n{listed}\n</tools>\n\n'
            'To call a function, reply with a JSON object with the function name and its '
            f'arguments, exactly like this:\n{call_example(fmt)}')


def calls_text(calls: Sequence[Mapping[str, Any]], fmt: ToolFormat) -> str:
    """Earlier calls (HF dicts) written as the model would have written them."""
    bodies = [json.dumps({'name': c['function']['name'],
                          fmt.args_key: c['function']['arguments']}, ensure_ascii=False)
              for c in calls]
    if fmt.name == 'mistral':
        return '[TOOL_CALLS][' + ', '.join(bodies) + ']'
    return fmt.separator.join(f'{fmt.call_prefix}{b}{fmt.call_suffix}' for b in bodies)


def chat_inputs(tokenizer: TextTokenizer, messages: Sequence[MessageLike],
                tools: Sequence[ToolSpec] = (), fmt: Optional[ToolFormat] = None
                ) -> Tuple[List[Dict[str, Any]], Tuple[ToolSpec, ...]]:
    """(messages, tools) to give tokenizer.encode_chat / apply_chat_template.

    Where the template lacks a tools section, the tools are described in the system message
    and none are passed; where it does not write tool_calls, earlier calls become content.
    """
    dicts: List[Dict[str, Any]] = [message_dict(m, i) for i, m in enumerate(messages)]
    if fmt is not None and not tokenizer.template_uses_tool_calls:
        for d in dicts:
            if d.get('tool_calls'):
                text = calls_text(d.pop('tool_calls'), fmt)
                d['content'] = (d['content'] + '\n' + text) if d['content'] else text
    if not tools or fmt is None or tokenizer.template_uses_tools:
        return dicts, tuple(tools)
    section = tools_system_text(tools, fmt)
    if dicts and dicts[0]['role'] == 'system':
        dicts[0] = dict(dicts[0], content=dicts[0]['content'] + '\n\n' + section)
    else:
        dicts.insert(0, {'role': 'system', 'content': section})
    return dicts, ()
