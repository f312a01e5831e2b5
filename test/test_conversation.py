"""Conversations: which turns are new, the model's own ids continued, the context policy.

Unit tests on SmolLM2's real tokenizer and chat template (no model), then through a real
Engine on the tiny model: a session remembers its turns, reuses the KV of all of them, and
keeps them across a restart with sessions.store.
"""
import pytest
from smollm2_files import write_text_model_dir
from tiny_model import tiny_model_dir

from edge_llm_msgs.action import Generate
from edge_llm_ros.errors import ContextOverflowError, InvalidRequestError
from edge_llm_ros.runtime import conversation as conv
from edge_llm_ros.runtime.conversation import ChatTurns, Conversation
from edge_llm_ros.runtime.sequence import RECOMPUTE
from edge_llm_ros.runtime.tokenizer import TextTokenizer
from edge_llm_ros.runtime.tools.spec import ToolCall
from edge_llm_ros.runtime.types import ChatMessage, GenerationRequest, StopReason
from edge_llm_ros.serving.engine import Engine, EngineConfig

U1 = ChatMessage('user', 'My name is Ada and my robot is called Bolt.')
A1 = ChatMessage('assistant', 'Nice to meet you, Ada! Bolt is a great name.')
U2 = ChatMessage('user', 'What is the name of my robot?')


@pytest.fixture(scope='module')
def tok(tmp_path_factory):
    out = tmp_path_factory.mktemp('smol_text')
    write_text_model_dir(out)
    return TextTokenizer.from_dir(str(out))


def render_with(tok):
    return lambda turns: tok.apply_chat_template(list(turns), True)


def chat(tok, messages, mode=conv.HISTORY_AUTO, system=''):
    return ChatTurns(system=system, messages=tuple(messages), mode=mode, render=render_with(tok))


def test_history_modes_agree_with_the_interface():
    assert (conv.HISTORY_AUTO, conv.HISTORY_APPEND, conv.HISTORY_REPLACE) == (
        Generate.Goal.HISTORY_AUTO, Generate.Goal.HISTORY_APPEND,
        Generate.Goal.HISTORY_REPLACE)
    for bad in (3, -1, True, 'auto'):
        with pytest.raises(InvalidRequestError, match='history_mode'):
            conv.check_mode(bad)


def test_which_turns_are_new():
    stored = Conversation(system='Be brief.', turns=(U1, A1), ids=(1, 2, 3))
    for mode in (conv.HISTORY_AUTO, conv.HISTORY_APPEND):
        assert conv.split_turns(stored, ChatTurns('', (U2,), mode)) == ('Be brief.', (U1, A1),
                                                                        (U2,))
    # OpenAI style: the whole history, even with the stored system prompt in front.
    full = (ChatMessage('system', 'Be brief.'), U1, A1, U2)
    assert conv.split_turns(stored, ChatTurns('', full, conv.HISTORY_AUTO))[2] == (U2,)
    # APPEND takes the messages as they are: the history would be stored twice.
    assert conv.split_turns(stored, ChatTurns('', (U1, A1, U2), conv.HISTORY_APPEND))[2] == (
        U1, A1, U2)
    # A different history is not the stored one: all of it is new.
    other = ChatMessage('assistant', 'Hello.')
    assert conv.split_turns(stored, ChatTurns('', (U1, other, U2), conv.HISTORY_AUTO))[2] == (
        U1, other, U2)
    # REPLACE starts again, from the goal's own system prompt.
    assert conv.split_turns(stored, ChatTurns('New.', (U2,), conv.HISTORY_REPLACE)) == (
        'New.', (), (U2,))
    # Nothing stored yet: the goal's system prompt starts the conversation.
    assert conv.split_turns(Conversation(), ChatTurns('S', (U1,), conv.HISTORY_AUTO)) == (
        'S', (), (U1,))


def test_the_next_turn_continues_the_ids_the_model_produced(tok):
    render = render_with(tok)
    prompt = tok.encode_prompt(render([U1]))
    reply = tok.encode(A1.content) + [tok.eos_token_ids[0]]
    stored = Conversation(turns=(U1, A1), ids=tuple(prompt + reply))
    bound = conv.bind(tok, stored, chat(tok, [U2]), 1000, render)
    assert bound.continued and bound.dropped == 0 and bound.new == (U2,)
    assert bound.ids[:len(stored.ids)] == stored.ids
    # The same text as a fresh rendering of the three turns.
    assert tok.decode(bound.ids) == render([U1, A1, U2])


def test_generated_ids_that_tokenize_otherwise_are_kept_as_generated(tok):
    """The model may produce a tokenization its tokenizer would not: it is kept."""
    render = render_with(tok)
    prompt = tok.encode_prompt(render([U1]))
    text_ids = tok.encode(A1.content)
    # Spell the first word one character per token: the same text, other ids.
    first = A1.content.split(' ')[0]
    odd = [i for ch in first for i in tok.encode(ch)] + tok.encode(A1.content[len(first):])
    assert odd != text_ids and tok.decode(odd) == A1.content
    stored = Conversation(turns=(U1, A1), ids=tuple(prompt + odd + [tok.eos_token_ids[0]]))
    bound = conv.bind(tok, stored, chat(tok, [U2]), 1000, render)
    assert bound.continued and bound.ids[:len(stored.ids)] == stored.ids
    fresh = tok.encode_prompt(render([U1, A1, U2]))
    assert bound.ids != tuple(fresh) and tok.decode(bound.ids) == tok.decode(fresh)


def test_a_template_that_rewrites_the_past_gets_a_fresh_rendering(tok):
    render = render_with(tok)
    prompt = tok.encode_prompt(render([U1]))
    # The model said more than the stored turn keeps (a stop string cut it): no continuation.
    said = tok.encode(A1.content + ' STOP and more') + [tok.eos_token_ids[0]]
    stored = Conversation(turns=(U1, A1), ids=tuple(prompt + said))
    bound = conv.bind(tok, stored, chat(tok, [U2]), 1000, render)
    assert not bound.continued
    assert bound.ids == tuple(tok.encode_prompt(render([U1, A1, U2])))


def test_a_full_context_drops_the_oldest_exchanges_keeping_the_system_prompt(tok):
    render = render_with(tok)
    turns = []
    for i in range(6):
        turns += [ChatMessage('user', f'Fact {i}: the box {i} is on shelf {i}.'),
                  ChatMessage('assistant', f'Noted: box {i} on shelf {i}.')]
    stored = Conversation(system='You are a robot.', turns=tuple(turns))
    new = ChatMessage('user', 'Where is box 5?')
    head = (ChatMessage('system', 'You are a robot.'),)
    whole = len(tok.encode_prompt(render(head + tuple(turns) + (new,))))
    last_two = len(tok.encode_prompt(render(head + tuple(turns[-4:]) + (new,))))
    room = (whole + last_two) // 2 - 1   # fits the last exchanges, not everything
    bound = conv.bind(tok, stored, chat(tok, [new]), room, render)
    assert 0 < bound.dropped < len(turns) and bound.dropped % 2 == 0
    assert bound.history == tuple(turns[bound.dropped:]) and bound.history[0].role == 'user'
    assert len(bound.ids) <= room and bound.system == 'You are a robot.'
    assert tok.decode(bound.ids) == render(head + bound.history + (new,))
    # Not even the new turn fits: prepare() refuses that earlier; bind says so too.
    with pytest.raises(InvalidRequestError, match='prompt positions'):
        conv.bind(tok, stored, chat(tok, [new]), 5, render)


def test_resent_turns_may_go_too_but_not_the_latest_user_turn(tok):
    render = render_with(tok)
    stored = Conversation(turns=(U1, A1), ids=tuple(tok.encode_prompt(render([U1, A1]))))
    older = (ChatMessage('user', 'The dock is in room 4.'), ChatMessage('assistant', 'Noted.'))
    latest = (U2,)
    only_latest = len(tok.encode_prompt(render(latest)))
    # APPEND with two exchanges of its own: only the last user turn must fit.
    bound = conv.bind(tok, stored, chat(tok, older + latest, conv.HISTORY_APPEND),
                      only_latest, render)
    assert bound.dropped == 4 and bound.history == () and bound.new == latest
    assert tok.decode(bound.ids) == render(latest)
    # The conversation's system prompt is kept from its start; when it leaves no room for
    # the latest turn the goal is refused with the numbers (a ContextOverflowError).
    long_system = Conversation(system='You are a careful robot. ' * 20, turns=(U1, A1))
    with pytest.raises(ContextOverflowError, match='HISTORY_REPLACE'):
        conv.bind(tok, long_system, chat(tok, latest), only_latest + 5, render)


def test_a_goal_that_adds_nothing_is_refused(tok):
    stored = Conversation(turns=(U1, A1), ids=(1, 2))
    with pytest.raises(InvalidRequestError, match='adds no turn'):
        conv.bind(tok, stored, chat(tok, [U1, A1]), 1000, render_with(tok))


def test_the_conversation_json_round_trips():
    call = ToolCall('c1', 'move_to', '{"place": "dock"}')
    conversation = Conversation(
        system='S', turns=(U1, ChatMessage('assistant', '', tool_calls=(call,)),
                           ChatMessage('tool', '{"ok": true}', tool_call_id='c1',
                                       name='move_to')), ids=(5, 6, 7))
    assert Conversation.from_json(conversation.to_json()) == conversation
    for bad in ('', '[]', '{"system": 1}', '{"system": "", "turns": [{}], "ids": []}'):
        with pytest.raises(ValueError):
            Conversation.from_json(bad)


# --- through an Engine ------------------------------------------------------------------------
@pytest.fixture(scope='module')
def tiny_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp('tiny'), accuracy_level=0)


def engine(tiny_dir, store='', **kw):
    kw.setdefault('max_context', 256)
    return Engine(EngineConfig(model_dir=str(tiny_dir), session_store=str(store),
                               intra_op_threads=1, **kw))


def ask(eng, text, session='s', mode=conv.HISTORY_APPEND, max_tokens=6, **kw):
    return eng.generate(GenerationRequest(prompt=text, session_id=session, history_mode=mode,
                                          max_tokens=max_tokens, **kw)).run_to_end()


def test_a_session_remembers_and_reuses_the_kv_of_every_turn(tiny_dir):
    eng = engine(tiny_dir)
    try:
        first = ask(eng, 'Hello the sky is blue.')
        second = ask(eng, 'What color is the sky?')
        info = eng.session('s')
        assert [t.role for t in info.conversation.turns] == ['user', 'assistant'] * 2
        assert info.conversation.turns[1].content == first.text
        assert info.conversation.turns[3].content == second.text
        # The whole first turn (prompt and answer) came from the KV: only the new turn and
        # the recomputed positions were prefilled.
        first_ids = first.prompt_tokens + first.completion_tokens
        assert second.timings.cached_prompt_tokens >= first_ids - 1 - RECOMPUTE
        assert len(info.conversation.ids) == second.prompt_tokens + second.completion_tokens
        # The same turns sent in one goal without a session: the same answer.
        plain = eng.generate(GenerationRequest(messages=[
            ChatMessage('user', 'Hello the sky is blue.'), ChatMessage('assistant', first.text),
            ChatMessage('user', 'What color is the sky?')], max_tokens=6)).run_to_end()
        assert plain.text == second.text
        assert eng.session('nobody') is None
        assert [i.session_id for i in eng.sessions()] == ['s']
    finally:
        eng.close()


def test_a_cancelled_turn_leaves_the_conversation_as_it_was(tiny_dir):
    eng = engine(tiny_dir)
    try:
        ask(eng, 'Hello the sky is blue.')
        before = eng.session('s').conversation
        gen = eng.generate(GenerationRequest(prompt='And the robot?', session_id='s',
                                             history_mode=conv.HISTORY_APPEND, max_tokens=40))
        next(gen)
        gen.cancel()
        assert gen.run_to_end().stop_reason is StopReason.CANCELLED
        assert eng.session('s').conversation == before
        again = ask(eng, 'And the robot?')
        assert again.stop_reason in (StopReason.STOP, StopReason.LENGTH)
        assert len(eng.session('s').conversation.turns) == 4
    finally:
        eng.close()


def test_replace_starts_again_and_reset_forgets(tiny_dir):
    eng = engine(tiny_dir)
    try:
        ask(eng, 'Hello the sky is blue.')
        ask(eng, 'robot arm', mode=conv.HISTORY_REPLACE)
        assert [t.content for t in eng.session('s').conversation.turns][:1] == ['robot arm']
        assert len(eng.session('s').conversation.turns) == 2
        assert eng.reset_sessions('s') == 1 and eng.session('s') is None
    finally:
        eng.close()


def test_session_goals_refuse_what_cannot_join_a_conversation(tiny_dir):
    import numpy as np
    eng = engine(tiny_dir)
    try:
        with pytest.raises(InvalidRequestError, match='chat template'):
            eng.prepare(GenerationRequest(prompt='x', session_id='s', use_chat_template=False))
        with pytest.raises(InvalidRequestError, match='prefix_embeddings'):
            eng.prepare(GenerationRequest(prompt='x', session_id='s', prefix_embeddings=np.zeros(
                (2, eng.info.hidden_size), np.float32)))
        with pytest.raises(InvalidRequestError, match='history_mode'):
            eng.prepare(GenerationRequest(prompt='x', session_id='s', history_mode=7))
    finally:
        eng.close()
    off = engine(tiny_dir, max_sessions=0)
    try:
        with pytest.raises(InvalidRequestError, match='keeps no sessions'):
            off.prepare(GenerationRequest(prompt='x', session_id='s'))
    finally:
        off.close()


def test_a_long_conversation_drops_its_oldest_turns(tiny_dir):
    eng = engine(tiny_dir, max_context=96)
    try:
        results = [ask(eng, f'the sky is blue number {i}', max_tokens=8) for i in range(12)]
        dropped = [r.dropped_turns for r in results]
        assert dropped[0] == 0 and sum(dropped) > 0 and all(d % 2 == 0 for d in dropped)
        turns = eng.session('s').conversation.turns
        assert turns[0].role == 'user' and turns[-1].role == 'assistant'
        assert turns[-2].content == 'the sky is blue number 11'
        assert all(r.prompt_tokens + 8 <= 96 for r in results)
    finally:
        eng.close()


def test_the_conversation_survives_a_restart_with_its_kv(tiny_dir, tmp_path):
    store = tmp_path / 'sessions.db'
    first_engine = engine(tiny_dir, store)
    first = ask(first_engine, 'Hello the sky is blue.')
    first_engine.close()
    restarted = engine(tiny_dir, store)
    try:
        info = restarted.session('s')
        assert info is not None and info.kv_bytes > 0
        turns = [t.content for t in info.conversation.turns]
        assert turns == ['Hello the sky is blue.', first.text]
        second = ask(restarted, 'What color is the sky?')
        assert second.timings.cached_prompt_tokens >= (
            first.prompt_tokens + first.completion_tokens - 1 - RECOMPUTE)
    finally:
        restarted.close()
    plain = engine(tiny_dir)   # no store, no restart: the same two turns
    try:
        ask(plain, 'Hello the sky is blue.')
        assert ask(plain, 'What color is the sky?').token_ids == second.token_ids
    finally:
        plain.close()


def test_a_session_goal_ends_for_the_worker_once_its_turn_is_on_disk(tiny_dir, tmp_path):
    """What llm_node relies on: the result a client sees means the turn survives kill -9."""
    import functools
    import sqlite3
    import threading
    from edge_llm_ros.serving.goal import Goal
    from edge_llm_ros.serving.worker import EngineWorker
    store = tmp_path / 'sessions.db'
    config = EngineConfig(model_dir=str(tiny_dir), session_store=str(store), max_context=256,
                          intra_op_threads=1)
    worker = EngineWorker(functools.partial(Engine, config), queue_depth=4)
    worker.start()
    worker.set_accepting(True)
    seen, ended = {}, threading.Event()

    def on_done(goal):
        db = sqlite3.connect(f'file:{store}?mode=ro', uri=True)
        try:
            seen[goal.request.session_id] = db.execute(
                'SELECT conversation FROM sessions WHERE session_id = ?',
                (goal.request.session_id,)).fetchall()
        finally:
            db.close()
        if len(seen) == 2:
            ended.set()

    try:
        for session in ('a', ''):   # a session goal, and one without a session
            goal = Goal(worker.engine.prepare(GenerationRequest(
                prompt='Hello the sky is blue.', session_id=session, max_tokens=4)))
            goal.on_done = on_done
            worker.submit(goal)
        assert ended.wait(120)
        (text,), = seen['a']
        assert [t.content for t in Conversation.from_json(text).turns][0] == \
            'Hello the sky is blue.'
        assert seen[''] == []
    finally:
        worker.stop()


# --- the client, the bridge and bags ---------------------------------------------------------
def test_the_conversation_helper_sends_one_new_turn_at_a_time():
    from edge_llm_ros.client import Conversation as ClientConversation, make_goal
    sent = []

    class Client:
        def generate(self, prompt, **kwargs):
            sent.append(make_goal(prompt, **kwargs))
            raise RuntimeError('stop here')

    chat = ClientConversation(Client(), 'kitchen', {'temperature': 0.0})
    with pytest.raises(RuntimeError):
        chat.send('Hello')
    goal = sent[0]
    assert (goal.prompt, goal.session_id, goal.history_mode) == (
        'Hello', 'kitchen', Generate.Goal.HISTORY_APPEND)
    assert goal.sampling.temperature == 0.0
    with pytest.raises(ValueError):
        ClientConversation(Client(), '')


def test_the_bridge_names_a_session_and_sends_the_history_as_auto():
    from edge_llm_ros.bridge.backend import BackendRequest, Message
    from edge_llm_ros.nodes.llm_client_backend import build_goal
    request = BackendRequest(request_id='r', model='m', session_id='k',
                             messages=(Message('user', 'hi'),))
    goal = build_goal(request)
    assert goal.session_id == 'k' and goal.history_mode == Generate.Goal.HISTORY_AUTO
    assert build_goal(BackendRequest(request_id='r', model='m')).session_id == ''


def test_replay_resends_a_session_goal_with_the_turns_it_continued():
    from edge_llm_ros.regression.records import TranscriptRecord
    from edge_llm_ros.regression.replay import session_messages
    stored = [U1, A1]
    auto = TranscriptRecord(goal_id='g', session_id='s', history_mode=conv.HISTORY_AUTO,
                            messages=[U1, A1, U2], session_turns=stored)
    messages, mode = session_messages(auto)
    assert mode == Generate.Goal.HISTORY_REPLACE
    assert [(m.role, m.content) for m in messages] == [
        (t.role, t.content) for t in (U1, A1, U2)]
    append = TranscriptRecord(goal_id='g', session_id='s', history_mode=conv.HISTORY_APPEND,
                              prompt='What is the name of my robot?', session_turns=stored)
    messages, mode = session_messages(append)
    assert [m.content for m in messages] == [U1.content, A1.content]   # + the prompt turn
    replace = TranscriptRecord(goal_id='g', session_id='s', history_mode=conv.HISTORY_REPLACE,
                               messages=[U2], session_turns=stored)
    assert [m.content for m in session_messages(replace)[0]] == [U2.content]
    plain = TranscriptRecord(goal_id='g', messages=[U1])
    assert session_messages(plain)[1] == conv.HISTORY_AUTO


def test_records_before_version_4_replay_without_their_session():
    from edge_llm_ros.regression.legacy import upgrade
    from edge_llm_ros.regression.records import TranscriptRecord
    old = upgrade(TranscriptRecord(goal_id='g', interface_version=3, session_id='robot_1',
                                   messages=[U1, A1, U2]))
    assert old.session_id == '' and old.messages == [U1, A1, U2]
    new = upgrade(TranscriptRecord(goal_id='g', interface_version=4, session_id='robot_1'))
    assert new.session_id == 'robot_1'
