"""Reasoning: tags kept out of the answer however the text is split.

The budget forces the close tag, and a simulated decode loop shows how the generator uses both.
"""
from hypothesis import given, settings, strategies as st
import pytest
from smollm2_files import write_text_model_dir

from edge_llm_ros.errors import InvalidRequestError
from edge_llm_ros.runtime.model_config import load_family, ReasoningConfig
from edge_llm_ros.runtime.reasoning import (close_ids, prompt_opens_reasoning, ReasoningBudget,
                                            ReasoningSplitter)
from edge_llm_ros.runtime.tokenizer import TextTokenizer

CFG = ReasoningConfig()


def split_run(text, cuts, starts_open=False, config=CFG):
    """Feed `text` cut at `cuts`; return (text, reasoning, splitter)."""
    splitter = ReasoningSplitter(config, starts_open)
    bounds = [0] + sorted({c for c in cuts if 0 < c < len(text)}) + [len(text)]
    out_text, out_reasoning = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        d = splitter.feed(text[a:b])
        out_text.append(d.text)
        out_reasoning.append(d.reasoning)
    d = splitter.finish()
    return ''.join(out_text) + d.text, ''.join(out_reasoning) + d.reasoning, splitter


CASES = [
    # (output, starts_open, answer, reasoning)
    ('<think>\nplan: go left\n</think>\n\nI went left.', False, 'I went left.',
     '\nplan: go left\n'),
    ('  \n<think>x</think>answer', False, 'answer', 'x'),
    ('plan: go left\n</think>\n\nDone.', True, 'Done.', 'plan: go left\n'),
    ('No reasoning here.', False, 'No reasoning here.', ''),
    ('Quote: <think> is a tag </think> ok', False, 'Quote: <think> is a tag </think> ok', ''),
    ('<think></think>', False, '', ''),
    ('<think>a < b </thin and </think> c </think> d', False, 'c </think> d', 'a < b </thin and '),
    ('<thi', False, '<thi', ''),
    ('', True, '', ''),
]


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, 60), max_size=12), case=st.sampled_from(CASES))
def test_split_is_the_same_however_the_text_is_cut(cuts, case):
    output, starts_open, answer, reasoning = case
    text, thought, _ = split_run(output, cuts, starts_open)
    assert (text, thought) == (answer, reasoning)


def test_every_single_character_feed():
    output = '<think>\nstep 1\nstep 2\n</think>\n\nThe answer is 4.'
    text, thought, splitter = split_run(output, range(len(output)))
    assert text == 'The answer is 4.' and thought == '\nstep 1\nstep 2\n'
    assert splitter.closed and not splitter.unterminated


def test_unterminated_reasoning_stays_reasoning():
    text, thought, splitter = split_run('<think>still thinking </thi', [9, 20])
    assert text == '' and thought == 'still thinking </thi'
    assert splitter.unterminated and not splitter.closed


def test_in_reasoning_tracks_the_block():
    s = ReasoningSplitter(CFG)
    assert not s.in_reasoning
    s.feed('<thi')
    assert not s.in_reasoning
    s.feed('nk>abc')
    assert s.in_reasoning
    s.feed('</think>')
    assert not s.in_reasoning
    assert ReasoningSplitter(CFG, starts_open=True).in_reasoning


def test_other_tags_from_config():
    cfg = ReasoningConfig(open_tag='<|thought|>', close_tag='<|/thought|>',
                          force_close_text='<|/thought|>')
    text, thought, _ = split_run('<|thought|>hmm<|/thought|>ok', [3, 14, 20], config=cfg)
    assert (text, thought) == ('ok', 'hmm')


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning('<|User|>hi<|Assistant|><think>\n', CFG)
    assert not prompt_opens_reasoning('<|im_start|>assistant\n', CFG)
    # Qwen3 with enable_thinking=False writes an empty block: the output starts outside.
    assert not prompt_opens_reasoning('<|im_start|>assistant\n<think>\n\n</think>\n\n', CFG)
    assert not prompt_opens_reasoning('<think>old</think> turn<|im_start|>assistant\n', CFG)


def test_budget_forces_close_once():
    budget = ReasoningBudget(3, [7, 8])
    assert budget.before_pick(False) == ()          # outside: never counts
    assert [budget.before_pick(True) for _ in range(3)] == [(), (), ()]
    assert budget.before_pick(True) == (7, 8)
    assert budget.before_pick(True) == ()           # forced once only
    assert budget.used == 3 and budget.forced


def test_zero_budget_closes_before_the_first_token():
    assert ReasoningBudget(0, [5]).before_pick(True) == (5,)


@pytest.mark.parametrize('budget, ids, words', [
    (-1, [1], 'reasoning_budget must be an integer >= 0'),
    (1.5, [1], 'reasoning_budget must be an integer'),
    (True, [1], 'reasoning_budget must be an integer'),
    (4, [], 'encodes to no tokens'),
])
def test_bad_budgets(budget, ids, words):
    with pytest.raises(InvalidRequestError, match=words):
        ReasoningBudget(budget, ids)


def test_budget_in_a_decode_loop(tmp_path):
    """The generator's use: before each pick ask the budget; forced ids replace sampling."""
    write_text_model_dir(tmp_path)
    tok = TextTokenizer.from_dir(tmp_path)
    family = load_family('deepseek_r1_distill_qwen')   # the template opened <think>
    ids = close_ids(tok, family.reasoning)
    assert tok.decode(list(ids)) == family.reasoning.force_close_text
    scripted = iter(tok.encode(' let me think about this for a very long time indeed') * 4
                    + tok.encode('The answer.'))
    splitter = ReasoningSplitter(family.reasoning, starts_open=True)
    budget = ReasoningBudget(6, ids)
    stream = tok.new_stream()
    queue, text, thought, reasoning_tokens = [], [], [], 0
    for _ in range(40):
        if not queue:
            queue = list(budget.before_pick(splitter.in_reasoning)) or [next(scripted)]
        token = queue.pop(0)
        reasoning_tokens += splitter.in_reasoning
        d = splitter.feed(stream.push(token))
        text.append(d.text)
        thought.append(d.reasoning)
        if budget.forced and not queue and not splitter.in_reasoning:
            break
    assert reasoning_tokens == 6 + len(ids) - 1  # the budget, then the forced close tag
    assert ''.join(thought).strip() == tok.decode(tok.encode(
        ' let me think about this for a very long time indeed')[:6]).strip()
    assert not splitter.in_reasoning and budget.forced
    rest = splitter.feed(stream.push(next(scripted)))
    assert ''.join(text) == '' and rest.reasoning == '' and rest.text.strip()
