"""Tools, reasoning, grammars, logprobs and logit_bias through Engine.prepare / generate.

SmolLM2 tests run the embedded model under its family config (Hermes tool calls, no reasoning
tags). Reasoning runs SmolLM2 under the deepseek_r1_distill_llama family (named by
EngineConfig.model_family), whose output starts inside <think>, and the tiny model with an
R1-style template that opens the block itself. Tool arguments are checked with jsonschema
against the tools' own schemas, never by the engine's parser alone.
"""
import json
import math
import re
import shutil

from compat_matrix import SMOLLM2_TYPES
import jsonschema
import pytest
from tiny_model import tiny_model_dir
import yaml

from edge_llm_ros.errors import InvalidRequestError, InvalidSamplingError
from edge_llm_ros.runtime.structured import OutputPlan
from edge_llm_ros.runtime.tools.spec import ToolCall
from edge_llm_ros.runtime.types import ChatMessage, GenerationRequest, SamplingConfig, StopReason
from edge_llm_ros.serving.engine import Engine, EngineConfig

MOVE = {'type': 'function', 'function': {
    'name': 'move_to', 'description': 'Drive the robot to a named place',
    'parameters': {'type': 'object', 'properties': {
        'place': {'type': 'string', 'enum': ['kitchen', 'dock', 'office']},
        'speed': {'type': 'number', 'minimum': 0, 'maximum': 1}},
        'required': ['place', 'speed']}}}
SAY = {'type': 'function', 'function': {
    'name': 'say', 'description': 'Speak a sentence',
    'parameters': {'type': 'object', 'properties': {'text': {'type': 'string'}},
                   'required': ['text']}}}
TOOLS = [MOVE, SAY]
SCHEMAS = {t['function']['name']: t['function']['parameters'] for t in TOOLS}
R1_TEMPLATE = ('{% for m in messages %}<|im_start|>{{ m.role }}{{ "\\n" }}{{ m.content }}'
               '<|im_end|>{% endfor %}<|im_start|>assistant{{ "\\n" }}<think>{{ "\\n" }}')


@pytest.fixture(scope='module')
def smol():
    eng = Engine(EngineConfig(intra_op_threads=2, max_context=1024))  # '' = embedded model
    yield eng
    eng.close()


@pytest.fixture(scope='module')
def r1(smol):
    """SmolLM2 read as an R1 distill: its output starts inside the reasoning block."""
    eng = Engine(EngineConfig(model_dir=smol.model_dir, intra_op_threads=2, max_context=1024,
                              model_family='deepseek_r1_distill_llama'))
    yield eng
    eng.close()


@pytest.fixture(scope='module')
def tiny_r1(tmp_path_factory):
    """Load the tiny model with a template that opens <think>, its family in model.yaml."""
    src = tiny_model_dir(tmp_path_factory.mktemp('tiny'), accuracy_level=0)
    model = tmp_path_factory.mktemp('tiny_r1') / 'model'
    shutil.copytree(src, model)
    (model / 'chat_template.jinja').write_text(R1_TEMPLATE)
    meta = yaml.safe_load((model / 'model.yaml').read_text())
    meta['family'] = 'deepseek_r1_distill_qwen'
    (model / 'model.yaml').write_text(yaml.safe_dump(meta))
    eng = Engine(EngineConfig(model_dir=str(model), max_context=256, intra_op_threads=1))
    yield eng
    eng.close()


def generate(engine, **kw):
    """Events and result of one request (max_tokens 64 unless given)."""
    kw.setdefault('max_tokens', 64)
    gen = engine.generate(GenerationRequest(**kw))
    events = list(gen)
    return events, gen.result


def check_calls(result, events):
    """Every call names an offered tool and validates against its schema; deltas rebuild it."""
    assert result.tool_calls and not result.invalid_tool_calls
    for call in result.tool_calls:
        assert call.name in SCHEMAS, f'{call.name!r} is not one of the offered tools'
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    deltas = [d for e in events for d in e.tool_call_deltas]
    for index, call in enumerate(result.tool_calls):
        mine = [d for d in deltas if d.index == index]
        assert (mine[0].id, mine[0].name) == (call.id, call.name)
        assert ''.join(d.arguments for d in mine) == call.arguments


def split_at_close(engine, result, budget):
    """Check the forced close tag sits right after `budget` tokens; return the raw text."""
    probe = GenerationRequest(prompt='x', reasoning_budget=budget, max_tokens=1)
    close = engine.prepare(probe).output.close_ids
    assert tuple(result.token_ids[budget:budget + len(close)]) == close
    return engine.detokenize(result.token_ids, skip_special_tokens=True)


# --- tool calls on SmolLM2 ------------------------------------------------------------------


@pytest.mark.slow
def test_required_call_parses_and_validates(smol, compat):
    compat('llama', SMOLLM2_TYPES, 'tools')
    events, result = generate(smol, prompt='Go to the kitchen slowly.', tools=TOOLS,
                              tool_choice='required', max_tokens=200)
    assert result.stop_reason == StopReason.TOOL_CALLS, result
    assert result.text == '' and all(e.text_delta == '' for e in events)
    check_calls(result, events)
    assert '<tool_call>' in smol.detokenize(result.token_ids)  # the family's own format


@pytest.mark.slow
def test_named_choice_makes_one_call_of_that_tool(smol):
    events, result = generate(smol, prompt='Tell the people in the kitchen that lunch is '
                              'ready.', tools=TOOLS, tool_choice='say',
                              parallel_tool_calls=False, max_tokens=200)
    assert result.stop_reason == StopReason.TOOL_CALLS, result
    assert [c.name for c in result.tool_calls] == ['say'] and result.text == ''
    check_calls(result, events)


# A conversation whose last user turn asks for what an earlier call did.
LEADS_TO_A_CALL = [
    ChatMessage('user', 'Go to the dock.'),
    ChatMessage('assistant', '', tool_calls=(
        ToolCall('call_1', 'move_to', '{"place": "dock", "speed": 0.5}'),)),
    ChatMessage('tool', '{"ok": true}', tool_call_id='call_1', name='move_to'),
    ChatMessage('assistant', 'I am at the dock.'),
    ChatMessage('user', 'Go to the office.')]
# One call is at most a few dozen tokens of markers plus MAX_FREE_STRING characters of a free
# string (runtime/tools/grammar.py): 200 tokens fit whichever tool the model picks.
ONE_CALL_TOKENS = 200


@pytest.mark.slow
def test_auto_calls_when_the_conversation_leads_there(smol):
    # Which tool and which arguments the model picks is its free choice (it changes with
    # float rounding): only check that it is a call, of an offered tool, valid by its schema.
    events, result = generate(smol, messages=LEADS_TO_A_CALL, tools=TOOLS,
                              parallel_tool_calls=False, max_tokens=ONE_CALL_TOKENS)
    assert result.stop_reason == StopReason.TOOL_CALLS, result
    assert len(result.tool_calls) == 1 and result.text == '', result
    check_calls(result, events)


@pytest.mark.slow
def test_named_choice_in_that_conversation_calls_move_to(smol):
    events, result = generate(smol, messages=LEADS_TO_A_CALL, tools=TOOLS,
                              tool_choice='move_to', parallel_tool_calls=False,
                              max_tokens=ONE_CALL_TOKENS)
    assert result.stop_reason == StopReason.TOOL_CALLS, result
    assert [c.name for c in result.tool_calls] == ['move_to'] and result.text == ''
    check_calls(result, events)   # place is one of the enum, 0 <= speed <= 1


@pytest.mark.slow
def test_auto_answers_in_text_when_no_call_is_needed(smol):
    # What the answer says is the model's free choice: check that text stays text.
    events, result = generate(smol, prompt='What color is the sky?', tools=TOOLS,
                              tool_choice='auto', max_tokens=40)
    assert result.tool_calls == [] and result.invalid_tool_calls == []
    assert result.text.strip() and '<tool_call>' not in result.text
    assert result.text == ''.join(e.text_delta for e in events)
    assert result.stop_reason in (StopReason.STOP, StopReason.LENGTH)


def test_tool_choice_none_renders_no_tools(smol):
    plain = smol.prepare(GenerationRequest(prompt='Go to the dock.'))
    none = smol.prepare(GenerationRequest(prompt='Go to the dock.', tools=TOOLS,
                                          tool_choice='none'))
    assert none.prompt_ids == plain.prompt_ids and none.output == OutputPlan()
    assert none.constraint is None


# --- reasoning ------------------------------------------------------------------------------
@pytest.mark.slow
def test_reasoning_budget_forces_the_close_tag(r1, compat):
    compat('llama', SMOLLM2_TYPES, 'reasoning')
    budget = 6
    events, result = generate(r1, prompt='Should the robot go to the dock?',
                              reasoning_budget=budget, max_tokens=40)
    raw = split_at_close(r1, result, budget)
    before, after = raw.split('</think>', 1)
    assert result.reasoning == before and result.text == after.lstrip()
    assert result.reasoning.strip() and result.text
    assert ''.join(e.reasoning_delta for e in events) == result.reasoning
    assert ''.join(e.text_delta for e in events) == result.text


@pytest.mark.slow
def test_stop_strings_apply_to_the_answer_only(r1):
    _, first = generate(r1, prompt='Should the robot go to the dock?', reasoning_budget=6,
                        max_tokens=40)
    stop = max(re.findall(r'\w{4,}', first.reasoning), key=len)
    _, result = generate(r1, prompt='Should the robot go to the dock?', reasoning_budget=6,
                         max_tokens=40, stop=(stop,))
    assert result.reasoning == first.reasoning  # the stop string in the reasoning is ignored
    if stop in first.text:
        assert result.text == first.text[:first.text.index(stop)]
        assert result.stop_reason == StopReason.STOP
    else:
        assert result.text == first.text


@pytest.mark.slow
def test_json_answer_after_budgeted_reasoning(r1):
    schema = {'type': 'object', 'properties': {'go': {'type': 'boolean'}}, 'required': ['go'],
              'additionalProperties': False}
    _, result = generate(r1, prompt='Should the robot go to the dock?', reasoning_budget=6,
                         json_schema=json.dumps(schema), max_tokens=60)
    assert result.stop_reason == StopReason.STOP and result.reasoning.strip()
    jsonschema.validate(json.loads(result.text), schema)


@pytest.mark.slow
def test_required_call_after_budgeted_reasoning(r1):
    events, result = generate(r1, prompt='Go to the kitchen.', tools=TOOLS,
                              tool_choice='move_to', parallel_tool_calls=False,
                              reasoning_budget=6, max_tokens=80)
    assert result.stop_reason == StopReason.TOOL_CALLS and result.text == ''
    assert result.reasoning.strip() and '</think>' not in result.reasoning
    check_calls(result, events)


def test_reasoning_cannot_be_turned_off_without_a_template_switch(r1, smol):
    with pytest.raises(InvalidRequestError, match='cannot turn reasoning off'):
        r1.prepare(GenerationRequest(prompt='hi', reasoning=False))
    with pytest.raises(InvalidRequestError, match='no reasoning tags'):
        smol.prepare(GenerationRequest(prompt='hi', reasoning_budget=4))
    assert r1.model_info()['capabilities']['reasoning']
    assert not smol.model_info()['capabilities']['reasoning']


def test_template_opened_reasoning_on_the_tiny_model(tiny_r1):
    assert tiny_r1.family.family == 'deepseek_r1_distill_qwen'
    prepared = tiny_r1.prepare(GenerationRequest(prompt='robot arm', reasoning_budget=3,
                                                 max_tokens=40))
    assert prepared.output.starts_in_reasoning
    events, result = generate(tiny_r1, prompt='robot arm', reasoning_budget=3, max_tokens=40)
    raw = split_at_close(tiny_r1, result, 3)
    before, after = raw.split('</think>', 1)
    assert (result.reasoning, result.text) == (before, after.lstrip())
    assert ''.join(e.reasoning_delta for e in events) == result.reasoning


# --- grammars -------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize('kw, pattern', [
    ({'prompt': 'Is the sky blue? Answer yes or no.', 'choices': ['yes', 'no']}, 'yes|no'),
    ({'prompt': 'What is 2+2? Answer with a number.', 'regex': '[0-9]{1,3}'}, '[0-9]{1,3}'),
    ({'prompt': 'Which way to the door?',
      'grammar': 'start: "go " DIR " " NUM\nDIR: "left" | "right"\nNUM: /[0-9]/'},
     'go (left|right) [0-9]'),
    ({'prompt': 'The answer to 2+2 is', 'use_chat_template': False, 'regex': ' ?[0-9]{1,2}'},
     ' ?[0-9]{1,2}'),
])
def test_constraints_shape_the_output(smol, kw, pattern):
    _, result = generate(smol, max_tokens=20, **kw)
    assert result.stop_reason == StopReason.STOP, result
    assert re.fullmatch(pattern, result.text), result.text


# --- logprobs and logit_bias ----------------------------------------------------------------
@pytest.mark.slow
def test_logprobs_are_consistent_and_change_no_token(smol):
    _, plain = generate(smol, prompt='Name a color.', max_tokens=12)
    events, result = generate(smol, prompt='Name a color.', max_tokens=12,
                              sampling=SamplingConfig(logprobs=True, top_logprobs=5))
    assert result.token_ids == plain.token_ids and result.text == plain.text
    assert result.logprobs == [e.logprobs for e in events]
    for event in events:
        lp = event.logprobs
        assert lp.token_id == event.token_id and lp.logprob <= 0
        assert len(lp.top) == 5 and [v for _, v in lp.top] == sorted(
            (v for _, v in lp.top), reverse=True)
        assert lp.top[0] == (lp.token_id, lp.logprob)  # greedy takes the most likely
        assert sum(math.exp(v) for _, v in lp.top) <= 1 + 1e-6


@pytest.mark.slow
def test_sampled_and_constrained_logprobs(smol):
    cfg = SamplingConfig(temperature=0.8, seed=5, logprobs=True, top_logprobs=20)
    _, sampled = generate(smol, prompt='Name a color.', max_tokens=12, sampling=cfg)
    for lp in sampled.logprobs:
        top = dict(lp.top)
        assert lp.token_id not in top or math.isclose(top[lp.token_id], lp.logprob)
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-6
    _, chosen = generate(smol, prompt='Is the sky blue?', choices=['yes', 'no'],
                         max_tokens=8, sampling=cfg)
    first = chosen.logprobs[0]
    allowed = {smol.detokenize([t]) for t, _ in first.top}
    assert allowed <= {'y', 'ye', 'yes', 'n', 'no'}  # the mask applies before the logprobs
    assert math.isclose(sum(math.exp(v) for _, v in first.top), 1.0, abs_tol=1e-4)


@pytest.mark.slow
def test_logit_bias_forces_and_forbids_tokens(smol):
    robot = smol.tokenize(' robot')
    assert len(robot) == 1
    _, forced = generate(smol, prompt='Name a color.', max_tokens=6,
                         sampling=SamplingConfig(logit_bias={robot[0]: 100.0}))
    assert forced.token_ids == robot * 6
    _, plain = generate(smol, prompt='Name a color.', max_tokens=6)
    banned = plain.token_ids[0]
    _, result = generate(smol, prompt='Name a color.', max_tokens=6,
                         sampling=SamplingConfig(logit_bias={str(banned): -100}))
    assert banned not in result.token_ids
    with pytest.raises(InvalidSamplingError, match='outside the vocabulary'):
        smol.prepare(GenerationRequest(prompt='hi', sampling=SamplingConfig(
            logit_bias={smol.vocab_size: 1.0})))
