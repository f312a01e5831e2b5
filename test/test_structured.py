"""plan_request + OutputPipeline: what Engine.prepare and the generator call, end to end."""
import json
import shutil

import pytest
from smollm2_files import write_text_model_dir

from edge_llm_ros.errors import InvalidRequestError
from edge_llm_ros.runtime.model_config import load_family
from edge_llm_ros.runtime.structured import OutputPlan, plan_request
from edge_llm_ros.runtime.tokenizer import TextTokenizer
from edge_llm_ros.runtime.tools.formats import FORMATS
from edge_llm_ros.runtime.tools.spec import ConstraintConflictError, InvalidToolsError

TOOLS = [{'type': 'function', 'function': {
    'name': 'dock', 'parameters': {'type': 'object', 'properties': {
        'station': {'enum': ['a', 'b']}}, 'required': ['station']}}}]
USER = [{'role': 'user', 'content': 'Go charge.'}]
# R1-distill-like: the generation prompt opens the reasoning block.
R1_TEMPLATE = ('{% for m in messages %}<|im_start|>{{ m.role }}{{ "\\n" }}{{ m.content }}'
               '<|im_end|>{% endfor %}<|im_start|>assistant{{ "\\n" }}<think>{{ "\\n" }}')
# Qwen3-like switch.
QWEN3_TEMPLATE = ('{% for m in messages %}{{ m.role }}: {{ m.content }}{{ "\\n" }}{% endfor %}'
                  '{% if tools %}TOOLS {{ tools | tojson }}{{ "\\n" }}{% endif %}assistant: '
                  '{% if enable_thinking is defined and not enable_thinking %}'
                  '<think>{{ "\\n\\n" }}</think>{{ "\\n\\n" }}{% endif %}')


@pytest.fixture(scope='module')
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp('structured_model')
    write_text_model_dir(out)
    return out


def tokenizer_with(model_dir, tmp_path, template=None):
    if template is None:
        return TextTokenizer.from_dir(model_dir)
    dst = tmp_path / 'model'
    shutil.copytree(model_dir, dst)
    (dst / 'chat_template.jinja').write_text(template)
    return TextTokenizer.from_dir(dst)


def feed_all(pipeline, text, step=3):
    outs = [pipeline.feed(text[i:i + step]) for i in range(0, len(text), step)]
    outs.append(pipeline.finish())
    return (''.join(o.text for o in outs), ''.join(o.reasoning for o in outs),
            [d for o in outs for d in o.tool_calls])


def test_smollm2_tools_in_text_and_forced_call(model_dir, tmp_path):
    tok = tokenizer_with(model_dir, tmp_path)
    plan = plan_request(tok, load_family('smollm2'), USER, tools=TOOLS, tool_choice='required')
    assert '"name": "dock"' in plan.prompt_text and '<tool_call>' in plan.prompt_text
    assert plan.prompt_ids == tuple(tok.encode(plan.prompt_text))
    assert plan.constraint.kind == 'tools' and plan.output.tool_format is FORMATS['hermes']
    # What a constrained model writes, through the pipeline.
    pipeline = plan.output.start()
    text, reasoning, deltas = feed_all(
        pipeline, '<tool_call>\n{"name": "dock", "arguments": {"station": "b"}}\n</tool_call>')
    assert text == '' and reasoning == ''
    assert [(c.name, json.loads(c.arguments)) for c in pipeline.tool_calls] == \
        [('dock', {'station': 'b'})]
    assert ''.join(d.arguments for d in deltas) == pipeline.tool_calls[0].arguments


def test_reasoning_opened_by_the_template(model_dir, tmp_path):
    tok = tokenizer_with(model_dir, tmp_path, R1_TEMPLATE)
    family = load_family('deepseek_r1_distill_qwen')
    plan = plan_request(tok, family, USER, reasoning_budget=4)
    assert plan.output.starts_in_reasoning and plan.constraint is None
    pipeline = plan.output.start()
    assert pipeline.forced_tokens() == ()
    text, reasoning, _ = feed_all(pipeline, 'I should dock.\n</think>\n\nDocking now.')
    assert (text, reasoning) == ('Docking now.', 'I should dock.\n')
    assert pipeline.text == text and pipeline.reasoning == reasoning
    with pytest.raises(InvalidRequestError, match='cannot turn reasoning off'):
        plan_request(tok, family, USER, reasoning=False)


def test_budget_forces_close_through_the_pipeline(model_dir, tmp_path):
    tok = tokenizer_with(model_dir, tmp_path, R1_TEMPLATE)
    plan = plan_request(tok, load_family('deepseek_r1_distill_qwen'), USER, reasoning_budget=2)
    pipeline = plan.output.start()
    forced = [pipeline.forced_tokens() for _ in range(3)]
    assert forced == [(), (), plan.output.close_ids]
    assert tok.decode(list(plan.output.close_ids)) == '\n</think>\n\n'


def test_qwen3_switch_and_tools_through_its_template(model_dir, tmp_path):
    tok = tokenizer_with(model_dir, tmp_path, QWEN3_TEMPLATE)
    family = load_family('qwen3')
    off = plan_request(tok, family, USER, reasoning=False)
    assert off.prompt_text.endswith('<think>\n\n</think>\n\n')
    assert not off.output.starts_in_reasoning
    on = plan_request(tok, family, USER, tools=TOOLS)
    assert 'TOOLS [{"type": "function", "function": {"name": "dock"' in on.prompt_text
    assert on.tool_choice.mode == 'auto' and on.constraint.kind == 'tools'
    pipeline = on.output.start()
    text, reasoning, _ = feed_all(pipeline, '<think>\nuser wants b\n</think>\n\nOk. <tool_call>\n'
                                  '{"name": "dock", "arguments": {"station": "a"}}\n</tool_call>')
    assert (text, reasoning) == ('Ok. ', '\nuser wants b\n')
    assert [c.name for c in pipeline.tool_calls] == ['dock']


def test_none_choice_leaves_output_alone(model_dir, tmp_path):
    tok = tokenizer_with(model_dir, tmp_path)
    plan = plan_request(tok, load_family('smollm2'), USER, tools=TOOLS, tool_choice='none',
                        json_schema='{"type": "integer"}')
    assert plan.constraint.kind == 'json_schema' and plan.output == OutputPlan()
    assert 'dock' not in plan.prompt_text
    text, _, deltas = feed_all(plan.output.start(), '<tool_call>{"name": "dock"}</tool_call>')
    assert text == '<tool_call>{"name": "dock"}</tool_call>' and not deltas


def test_schema_compiles_through_the_engine_cache(model_dir, tmp_path):
    tok = tokenizer_with(model_dir, tmp_path)
    seen = []
    plan_request(tok, None, USER, json_schema='{"type": "string"}',
                 compile_schema=lambda text: seen.append(text) or 'compiled')
    assert seen == ['{"type": "string"}']


def test_unknown_family_uses_generic_json(model_dir, tmp_path):
    tok = tokenizer_with(model_dir, tmp_path)
    plan = plan_request(tok, None, USER, tools=TOOLS, tool_choice='dock')
    assert plan.output.tool_format is FORMATS['generic_json']
    assert plan.output.reasoning is None


@pytest.mark.parametrize('kwargs, error, words', [
    ({'tools': TOOLS, 'json_schema': '{}'}, ConstraintConflictError, 'tools and json_schema'),
    ({'regex': 'a', 'choices': ['a']}, ConstraintConflictError, 'regex and choices'),
    ({'tools': TOOLS, 'tool_choice': 'fly'}, InvalidToolsError, "unknown tool 'fly'"),
    ({'reasoning_budget': 10}, InvalidRequestError, 'no reasoning tags'),
    ({'tools': [{'name': 'f', 'parameters': {'type': 'x'}}]}, InvalidToolsError, 'invalid'),
])
def test_bad_requests(model_dir, tmp_path, kwargs, error, words):
    tok = tokenizer_with(model_dir, tmp_path)
    with pytest.raises(error, match=words):
        plan_request(tok, load_family('smollm2'), USER, **kwargs)


def test_bad_budget_value(model_dir, tmp_path):
    tok = tokenizer_with(model_dir, tmp_path, R1_TEMPLATE)
    with pytest.raises(InvalidRequestError, match='reasoning_budget must be an integer >= 0'):
        plan_request(tok, load_family('deepseek_r1_distill_llama'), USER, reasoning_budget=-3)


def generate(tok, plan, seed, max_tokens=400):
    """Run the generator's loop in miniature: forced ids, mask, sample, accept, split."""
    import numpy as np

    from edge_llm_ros.runtime.sampling import build_sampler
    from edge_llm_ros.runtime.types import SamplingConfig
    rng = np.random.default_rng(seed)
    sampler = build_sampler(SamplingConfig(temperature=1.0, seed=seed), tok.vocab_size)
    sampler.reset(list(plan.prompt_ids))
    state = plan.constraint.start() if plan.constraint is not None else None
    pipeline = plan.output.start()
    stream = tok.new_stream()
    mask = np.empty(tok.vocab_size, dtype=bool)
    queue = []
    for _ in range(max_tokens):
        queue = queue or list(pipeline.forced_tokens())
        if queue:
            token = queue.pop(0)
        else:
            if state is not None:
                state.fill_mask(mask)
            logits = rng.standard_normal(tok.vocab_size).astype(np.float32) * 3
            token = sampler.sample(logits, mask if state is not None else None)
        sampler.accept(token)
        if state is not None:
            state.accept(token)
        if token in tok.eos_token_ids:
            break
        pipeline.feed(stream.push(token))
        if state is not None and state.is_finished():
            break
    pipeline.feed(stream.flush())
    pipeline.finish()
    return pipeline


@pytest.mark.parametrize('seed', range(4))
def test_json_schema_after_budgeted_reasoning(model_dir, tmp_path, seed):
    """R1-style prompt + response format: the reasoning stays free, then the JSON is forced."""
    tok = tokenizer_with(model_dir, tmp_path, R1_TEMPLATE)
    schema = {'type': 'object', 'properties': {'go': {'type': 'boolean'}}, 'required': ['go'],
              'additionalProperties': False}
    plan = plan_request(tok, load_family('deepseek_r1_distill_qwen'), USER,
                        json_schema=json.dumps(schema), reasoning_budget=5)
    pipeline = generate(tok, plan, seed)
    assert pipeline.reasoning.strip() and '</think>' not in pipeline.reasoning
    assert json.loads(pipeline.text) in ({'go': True}, {'go': False})


@pytest.mark.parametrize('seed', range(4))
def test_required_tool_after_budgeted_reasoning(model_dir, tmp_path, seed):
    tok = tokenizer_with(model_dir, tmp_path, R1_TEMPLATE)
    plan = plan_request(tok, load_family('deepseek_r1_distill_llama'), USER, tools=TOOLS,
                        tool_choice='required', parallel_tool_calls=False, reasoning_budget=5)
    pipeline = generate(tok, plan, seed)
    assert pipeline.text == '' and not pipeline.invalid_tool_calls
    assert [c.name for c in pipeline.tool_calls] == ['dock']
    assert json.loads(pipeline.tool_calls[0].arguments)['station'] in ('a', 'b')


def test_constraint_on_optional_reasoning_allows_a_block(model_dir, tmp_path):
    tok = tokenizer_with(model_dir, tmp_path, QWEN3_TEMPLATE)
    plan = plan_request(tok, load_family('qwen3'), USER, choices=['left', 'right'])
    state = plan.constraint.start()
    for token in tok.encode('<think>\nhmm\n</think>\n\nright'):
        state.accept(token)
    assert state.is_accepting()
    plain = plan_request(tok, load_family('qwen3'), USER, choices=['left', 'right'],
                         reasoning=False).constraint.start()
    for token in tok.encode('left'):
        plain.accept(token)
    assert plain.is_finished()


def accepts(state, tok, text):
    """Whether the constraint takes `text` (token by token) from where it is."""
    try:
        for token in tok.encode(text):
            state.accept(token)
    except Exception:  # noqa: B902 - EngineError: the token violates the constraint
        return False
    return True


def test_forced_calls_are_bounded_where_the_schema_is_not(model_dir, tmp_path):
    """A looping model still closes its call: free strings, arrays and runs of calls end."""
    from edge_llm_ros.runtime.tools.grammar import (MAX_FREE_ITEMS, MAX_FREE_STRING,
                                                    MAX_PARALLEL_CALLS)
    tok = tokenizer_with(model_dir, tmp_path)
    say = [{'type': 'function', 'function': {'name': 'say', 'parameters': {
        'type': 'object', 'properties': {'text': {'type': 'string'},
                                         'ids': {'type': 'array', 'items': {'type': 'integer'}},
                                         'code': {'type': 'string', 'maxLength': 2}},
        'required': ['text']}}}]
    plan = plan_request(tok, load_family('smollm2'), USER, tools=say, tool_choice='required')
    head = '<tool_call>\n{"name": "say", "arguments": {"text": "'
    assert accepts(plan.constraint.start(), tok, head + 'a' * MAX_FREE_STRING + '"')
    assert not accepts(plan.constraint.start(), tok, head + 'a' * (MAX_FREE_STRING + 1))
    items = '", "ids": [' + ', '.join(['1'] * MAX_FREE_ITEMS)
    assert accepts(plan.constraint.start(), tok, head + items + ']')
    assert not accepts(plan.constraint.start(), tok, head + items + ', 1')
    assert not accepts(plan.constraint.start(), tok, head + '", "code": "abc')  # its own bound
    call = '<tool_call>\n{"name": "say", "arguments": {"text": "hi"}}\n</tool_call>'
    assert accepts(plan.constraint.start(), tok, '\n'.join([call] * MAX_PARALLEL_CALLS))
    assert not accepts(plan.constraint.start(), tok, '\n'.join([call] * MAX_PARALLEL_CALLS)
                       + '\n<tool_call>')
    # What is written still validates against the tool's own (unbounded) schema.
    pipeline = plan.output.start()
    feed_all(pipeline, head + 'a' * MAX_FREE_STRING + '"}}\n</tool_call>')
    assert json.loads(pipeline.tool_calls[0].arguments) == {'text': 'a' * MAX_FREE_STRING}
