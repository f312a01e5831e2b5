"""A warm prompt's tokens are what the chat template renders first, for every model family.

Each config/models family's chat template (the system-message handling of the model's own
template, shortened) is rendered with SmolLM2's real tokenizer: every conversation that
starts with the warm system prompt, whatever follows it, must tokenize to the warm prompt's
tokens first (serving/warm_prompts.prompt_ids), and those must cover the system text.
"""
import shutil

import pytest
from smollm2_files import write_text_model_dir

from edge_llm_ros.runtime import model_config as mc
from edge_llm_ros.runtime.structured import plan_request
from edge_llm_ros.runtime.tokenizer import TextTokenizer
from edge_llm_ros.runtime.types import ChatMessage
from edge_llm_ros.serving.warm_prompts import prompt_ids

SYSTEM = ('You are a delivery robot in a hospital. You know the map: the lift is left of '
          'the pharmacy, room 4 is on floor 2. Answer in one short sentence.')
CHATML = ('{%- for m in messages %}{{- "<|im_start|>" + m["role"] + "\\n" + m["content"] + '
          '"<|im_end|>\\n" }}{%- endfor %}'
          '{%- if add_generation_prompt %}{{- "<|im_start|>assistant\\n" }}{%- endif %}')
R1 = ('{%- set ns = namespace(system="") %}{%- for m in messages %}'
      '{%- if m["role"] == "system" %}{%- set ns.system = m["content"] %}{%- endif %}'
      '{%- endfor %}{{- bos_token + ns.system }}{%- for m in messages %}'
      '{%- if m["role"] == "user" %}{{- "<\uff5cUser\uff5c>" + m["content"] }}'
      '{%- elif m["role"] == "assistant" %}{{- "<\uff5cAssistant\uff5c>" + m["content"] + '
      '"<\uff5cend\u2581of\u2581sentence\uff5c>" }}{%- endif %}{%- endfor %}'
      '{%- if add_generation_prompt %}{{- "<\uff5cAssistant\uff5c><think>\\n" }}{%- endif %}')
# Per family, the template's system-message handling (the models' own templates, shortened).
TEMPLATES = {
    'smollm2': ('{%- if messages[0]["role"] != "system" %}{{- "<|im_start|>system\\nYou are '
                'a helpful AI assistant named SmolLM<|im_end|>\\n" }}{%- endif %}' + CHATML),
    'qwen2': ('{%- if messages[0]["role"] != "system" %}{{- "<|im_start|>system\\nYou are '
              'Qwen, created by Alibaba Cloud.<|im_end|>\\n" }}{%- endif %}' + CHATML),
    'qwen3': CHATML[:-len('{%- endif %}')] + (
        '{%- if enable_thinking is defined and not enable_thinking %}'
        '{{- "<think>\\n\\n</think>\\n\\n" }}{%- endif %}{%- endif %}'),
    'lfm2': '{{- bos_token }}' + CHATML,
    'granite4': ('{%- for m in messages %}{{- "<|start_of_role|>" + m["role"] + '
                 '"<|end_of_role|>" + m["content"] + "<|end_of_text|>\\n" }}{%- endfor %}'
                 '{%- if add_generation_prompt %}'
                 '{{- "<|start_of_role|>assistant<|end_of_role|>" }}{%- endif %}'),
    'qwen35': CHATML[:-len('{%- endif %}')] + (
        '{%- if enable_thinking is defined and not enable_thinking %}'
        '{{- "<think>\\n\\n</think>\\n\\n" }}{%- else %}{{- "<think>\\n" }}{%- endif %}'
        '{%- endif %}'),
    'deepseek_r1_distill_qwen': R1,
    'deepseek_r1_distill_llama': R1,
    'llama3': ('{{- bos_token }}{%- if messages[0]["role"] == "system" %}'
               '{%- set system = messages[0]["content"] | trim %}'
               '{%- set messages = messages[1:] %}{%- else %}{%- set system = "" %}'
               '{%- endif %}{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}'
               '{{- "Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n" }}'
               '{{- system + "<|eot_id|>" }}{%- for m in messages %}'
               '{{- "<|start_header_id|>" + m["role"] + "<|end_header_id|>\\n\\n" + '
               'm["content"] | trim + "<|eot_id|>" }}{%- endfor %}'
               '{%- if add_generation_prompt %}'
               '{{- "<|start_header_id|>assistant<|end_header_id|>\\n\\n" }}{%- endif %}'),
    # The system message goes into the last user turn: a first turn starts with it.
    'mistral': ('{%- if messages[0]["role"] == "system" %}'
                '{%- set system = messages[0]["content"] %}{%- set loop_messages = messages[1:] %}'
                '{%- else %}{%- set loop_messages = messages %}{%- endif %}{{- bos_token }}'
                '{%- for m in loop_messages %}{%- if m["role"] == "user" %}'
                '{%- if loop.last and system is defined %}'
                '{{- "[INST] " + system + "\\n\\n" + m["content"] + "[/INST]" }}'
                '{%- else %}{{- "[INST] " + m["content"] + "[/INST]" }}{%- endif %}'
                '{%- else %}{{- " " + m["content"] + eos_token }}{%- endif %}{%- endfor %}'),
    # The system message opens the first user turn.
    'gemma3': ('{{- bos_token }}{%- if messages[0]["role"] == "system" %}'
               '{%- set prefix = messages[0]["content"] + "\\n\\n" %}'
               '{%- set loop_messages = messages[1:] %}{%- else %}{%- set prefix = "" %}'
               '{%- set loop_messages = messages %}{%- endif %}{%- for m in loop_messages %}'
               '{%- set role = "model" if m["role"] == "assistant" else m["role"] %}'
               '{{- "<start_of_turn>" + role + "\\n" + (prefix if loop.first else "") + '
               'm["content"] | trim + "<end_of_turn>\\n" }}{%- endfor %}'
               '{%- if add_generation_prompt %}{{- "<start_of_turn>model\\n" }}{%- endif %}'),
    # A system turn of its own, opened by <|think|> when reasoning is on.
    'gemma4': ('{{- bos_token }}{%- set think = enable_thinking is defined and enable_thinking %}'
               '{%- set loop_messages = messages %}'
               '{%- if think or messages[0]["role"] == "system" %}{{- "<|turn>system\\n" }}'
               '{%- if think %}{{- "<|think|>\\n" }}{%- endif %}'
               '{%- if messages[0]["role"] == "system" %}{{- messages[0]["content"] | trim }}'
               '{%- set loop_messages = messages[1:] %}{%- endif %}{{- "<turn|>\\n" }}'
               '{%- endif %}{%- for m in loop_messages %}'
               '{%- set role = "model" if m["role"] == "assistant" else m["role"] %}'
               '{{- "<|turn>" + role + "\\n" + m["content"] | trim + "<turn|>\\n" }}'
               '{%- endfor %}{%- if add_generation_prompt %}{{- "<|turn>model\\n" }}'
               '{%- if not think %}{{- "<|channel>thought\\n<channel|>" }}{%- endif %}'
               '{%- endif %}'),
    # The reasoning switch in the system turn's header, the system text in its custom
    # instructions; with reasoning off the generation prompt holds the empty think block.
    'smollm3': ('{%- set think = enable_thinking is not defined or enable_thinking %}'
                '{{- "<|im_start|>system\\n## Metadata\\n\\nReasoning Mode: " + '
                '("/think" if think else "/no_think") + "\\n\\n## Custom Instructions\\n\\n" }}'
                '{%- if messages[0]["role"] == "system" %}'
                '{{- messages[0]["content"] + "\\n\\n" }}{%- set loop_messages = messages[1:] %}'
                '{%- else %}{{- "You are a helpful AI assistant named SmolLM.\\n\\n" }}'
                '{%- set loop_messages = messages %}{%- endif %}{{- "<|im_end|>\\n" }}'
                '{%- for m in loop_messages %}{{- "<|im_start|>" + m["role"] + "\\n" + '
                'm["content"] + "<|im_end|>\\n" }}{%- endfor %}{%- if add_generation_prompt %}'
                '{{- "<|im_start|>assistant\\n" }}{%- if not think %}'
                '{{- "<think>\\n\\n</think>\\n" }}{%- endif %}{%- endif %}'),
    'phi3': ('{%- for m in messages %}{{- "<|" + m["role"] + "|>" + m["content"] + "<|end|>" }}'
             '{%- endfor %}{%- if add_generation_prompt %}{{- "<|assistant|>" }}'
             '{%- else %}{{- eos_token }}{%- endif %}'),
}
# Families whose template moves the system message (mistral: into the last user turn).
FIRST_TURN_ONLY = {'mistral'}
# Families whose reasoning switch is in the system turn (gemma4's <|think|>, smollm3's
# Reasoning Mode line): a warm prompt (rendered with reasoning on, the default) serves the
# requests that keep it on.
SWITCH_IN_SYSTEM_TURN = {'gemma4', 'smollm3'}
QUESTIONS = ('Where is room 4?', 'go', '12 steps', '"quoted"', '  spaces', 'Ünïcode ✓')


@pytest.fixture(scope='module')
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp('warm_families')
    write_text_model_dir(out)
    return out


def test_every_family_has_a_template_here():
    # Embedding families (their config holds query / document prefixes) do not chat.
    chat = {name for name, cfg in mc.load_all().items()
            if not (cfg.query_prefix or cfg.document_prefix)}
    assert set(TEMPLATES) == chat


@pytest.mark.parametrize('family', sorted(TEMPLATES))
def test_conversations_start_with_the_warm_prompt_tokens(family, model_dir, tmp_path):
    folder = tmp_path / family
    shutil.copytree(model_dir, folder)
    (folder / 'chat_template.jinja').write_text(TEMPLATES[family])
    tok = TextTokenizer.from_dir(folder)
    config = mc.load_family(family)
    warm = prompt_ids(tok, config, SYSTEM)
    # The warm tokens hold the whole system text but for where it meets the next turn.
    assert SYSTEM[:-12] in tok.decode(list(warm)), tok.decode(list(warm))
    system = ChatMessage('system', SYSTEM)
    conversations = [[system, ChatMessage('user', q)] for q in QUESTIONS]
    if family not in FIRST_TURN_ONLY:
        conversations.append([system, ChatMessage('user', 'Go to room 4.'),
                              ChatMessage('assistant', 'On my way.'),
                              ChatMessage('user', 'Now the lift.')])
    for messages in conversations:
        both = config.can_disable_reasoning and family not in SWITCH_IN_SYSTEM_TURN
        for reasoning in (True, False) if both else (True,):
            ids = plan_request(tok, config, messages, reasoning=reasoning).prompt_ids
            assert ids[:len(warm)] == warm, (family, messages, tok.decode(list(ids)))
            assert len(ids) > len(warm)
        if family in SWITCH_IN_SYSTEM_TURN:
            off = plan_request(tok, config, messages, reasoning=False).prompt_ids
            assert off[:len(warm)] != warm
    # Another system prompt shares at most the template's opening with it.
    other = plan_request(tok, config, [ChatMessage('system', 'Be brief.'),
                                       ChatMessage('user', 'go')]).prompt_ids
    assert other[:len(warm)] != warm
