"""Reasoning through a real llm_node: model.family names a reasoning family for the model.

The embedded SmolLM2 is served with the DeepSeek-R1-Distill-Qwen family config (its template
opens a <think> block at the generation prompt, model.family set as `model:=` does), so the
output starts inside the reasoning; a reasoning_budget forces the closing tag. Reasoning
streams as reasoning_delta and ends in Result.reasoning, never in the answer text.
"""
import os

from llm_node_harness import served, wait_feedback_delivered, wait_for
import pytest

from edge_llm_ros.client import InvalidGoalError

NODE = f'llm_node_reasoning_{os.getpid()}'
FAMILY = 'deepseek_r1_distill_qwen'
BUDGET = 5


@pytest.fixture(scope='module')
def llm():
    with served(NODE, {'autostart': True, 'model.family': FAMILY,
                       'feedback.period_tokens': 1, 'feedback.period_ms': 0},
                f'llm_node_reasoning_client_{os.getpid()}') as ros:
        client = ros.llm('/' + NODE)
        wait_feedback_delivered(client)
        yield client


def test_model_info_reports_the_configured_family(llm):
    info = llm.model_info(timeout=30)
    assert info.success and info.family == FAMILY and info.supports_reasoning
    assert (info.reasoning_start, info.reasoning_end) == ('<think>', '</think>')


def test_reasoning_streams_apart_from_the_answer_within_its_budget(llm):
    chunks = []
    outcome = llm.generate('Why is the sky blue?', max_tokens=20, temperature=0.0,
                           reasoning_budget=BUDGET, on_feedback=chunks.append
                           ).result(timeout=120)
    assert outcome.ok, outcome
    assert outcome.reasoning.strip() and outcome.text.strip()
    for tag in ('<think>', '</think>'):
        assert tag not in outcome.text and tag not in outcome.reasoning
    wait_for(lambda: sum(len(c.token_ids) for c in list(chunks)) >= outcome.completion_tokens,
             30, 'every feedback chunk')
    assert ''.join(c.reasoning_delta for c in chunks) == outcome.reasoning
    assert ''.join(c.text_delta for c in chunks) == outcome.text
    # One token per chunk: BUDGET of them carry the model's reasoning, then the forced close
    # text, whose leading newline still belongs to the reasoning ("\n</think>\n\n").
    assert 1 <= sum(1 for c in chunks if c.reasoning_delta) <= BUDGET + 1


def test_turning_reasoning_off_where_the_template_cannot_is_an_invalid_goal(llm):
    outcome = llm.generate('Hi', max_tokens=4, reasoning=False).result(timeout=60)
    with pytest.raises(InvalidGoalError):
        outcome.raise_for_error()
    assert outcome.finish_reason == 'error' and outcome.error_message
