"""Images in a session's conversation: remembered with their rows, persisted, resent, dropped.

A tiny VLM (test_vision_node's LLaVA-style `mlp` mmproj: 64 rows per image) runs in a real
Engine. A session turn with an image, then a text-only turn: the second turn must give what
the whole conversation sent in one goal gives, with the image's KV reused. The stored rows
come back from sessions.store after a restart even when the KV prefix is gone (the encoder
does not run again); an OpenAI-style client that resends its history resends its images,
which must be the stored ones; the context policy drops an old turn with its image.
"""
import sqlite3

import numpy as np
import pytest
from test_vision_node import image, vlm  # noqa: F401 - the tiny VLM folder fixture

from edge_llm_ros.runtime import conversation as conv
from edge_llm_ros.runtime.conversation import Conversation, StoredImage
from edge_llm_ros.runtime.media import ImageInputError, MEDIA_MARKER
from edge_llm_ros.runtime.sequence import RECOMPUTE
from edge_llm_ros.runtime.types import ChatMessage, GenerationRequest, SamplingConfig
from edge_llm_ros.serving.engine import Engine, EngineConfig

pytestmark = pytest.mark.timeout(600)
ROWS = 64
TOP = 8   # top log probabilities compared per step (the tiny model's top-1 is ~1.0)
LOOK = f'Look at this {MEDIA_MARKER} what is it?'
THEN = 'And the color?'


def engine(folder, store='', **kw):
    kw.setdefault('max_context', 256)
    return Engine(EngineConfig(model_dir=str(folder), session_store=str(store),
                               intra_op_threads=1, **kw))


def ask(eng, text, images=(), session='s', mode=conv.HISTORY_APPEND, max_tokens=4,
        messages=()):
    result = eng.generate(GenerationRequest(
        prompt=text, images=list(images), session_id=session, history_mode=mode,
        messages=list(messages), max_tokens=max_tokens,
        sampling=SamplingConfig(temperature=0.0, logprobs=True, top_logprobs=TOP))).run_to_end()
    assert result.error == '', result.error
    return result


def same_answer(got, want) -> None:
    """Assert equal greedy ids and top log probs (another prefill order: rounding only)."""
    assert got.token_ids == want.token_ids
    for ours, theirs in zip(got.logprobs, want.logprobs):
        mine = dict(ours.top)
        shared = [(mine[t], lp) for t, lp in theirs.top if t in mine]
        assert len(shared) >= TOP - 2, (ours.top, theirs.top)
        assert max(abs(a - b) for a, b in shared) < 1e-3, (ours.top, theirs.top)


@pytest.fixture(scope='module')
def reference(vlm):  # noqa: F811
    """Run an engine without prefix reuse: its answers owe nothing to a session's KV."""
    made = engine(vlm, prefix_reuse=False)
    yield made
    made.close()


def whole(eng, turns, images, max_tokens=4):
    """Send the same conversation in one goal, without a session."""
    return ask(eng, '', images, session='', messages=turns, max_tokens=max_tokens)


def test_the_conversation_json_keeps_its_images():
    rows = np.arange(3 * 4, dtype=np.float32).reshape(3, 4)
    stored = Conversation(system='S', turns=(ChatMessage('user', LOOK),), ids=(1, 2, 3),
                          images=(StoredImage(2, ((7,), 3, (8,)), 'ab', rows, True),))
    back = Conversation.from_json(stored.to_json(), stored.media_bytes())
    assert back == stored and back.images[0].rows == 3 and back.images[0].width == 2
    assert np.array_equal(back.images[0].embeds, rows)
    for media_bytes in (b'', stored.media_bytes()[:-4], stored.media_bytes() + b'1234'):
        with pytest.raises(ValueError):
            Conversation.from_json(stored.to_json(), media_bytes)


def test_a_later_turn_sees_the_image_of_an_earlier_one(vlm, reference):  # noqa: F811
    eng = engine(vlm)
    try:
        first = ask(eng, LOOK, [image(1)])
        second = ask(eng, THEN)
        info = eng.session('s')
        (kept,) = info.conversation.images
        assert kept.rows == ROWS and [t.content for t in info.conversation.turns] == [
            LOOK, first.text, THEN, second.text]
        # The first turn's prompt, image rows included, and answer came from the KV.
        assert second.timings.cached_prompt_tokens >= (
            first.prompt_tokens + first.completion_tokens - 1 - RECOMPUTE)
        turns = [ChatMessage('user', LOOK), ChatMessage('assistant', first.text),
                 ChatMessage('user', THEN)]
        plain = whole(reference, turns, [image(1)])
        same_answer(plain, second)
        assert plain.prompt_tokens == second.prompt_tokens
        # The image matters: the same turns about another image answer otherwise.
        other = whole(reference, turns, [image(2)], max_tokens=1)
        with pytest.raises(AssertionError):
            same_answer(other, plain)
    finally:
        eng.close()


def test_a_later_turn_brings_a_new_image_after_the_stored_one(vlm, reference):  # noqa: F811
    """The second image is laid out after the stored ids (the continued prompt), not anew."""
    eng = engine(vlm)
    try:
        first = ask(eng, LOOK, [image(1)])
        again = f'And {MEDIA_MARKER}?'
        second = ask(eng, again, [image(2)])
        assert second.dropped_turns == 0
        assert [im.rows for im in eng.session('s').conversation.images] == [ROWS, ROWS]
        assert second.timings.cached_prompt_tokens >= (
            first.prompt_tokens + first.completion_tokens - 1 - RECOMPUTE)
        turns = [ChatMessage('user', LOOK), ChatMessage('assistant', first.text),
                 ChatMessage('user', again)]
        plain = whole(reference, turns, [image(1), image(2)])
        same_answer(plain, second)
        assert plain.prompt_tokens == second.prompt_tokens
    finally:
        eng.close()


def test_rows_come_back_from_the_store_without_the_kv_or_the_encoder(vlm, tmp_path):  # noqa
    store = tmp_path / 'sessions.db'
    live = engine(vlm, store)
    try:
        ask(live, LOOK, [image(1)])
        ask(live, f'Now this one {MEDIA_MARKER} is it the same?', [image(3)])
        want = ask(live, THEN)
        stored = live.session('s').conversation
    finally:
        live.close()
    assert [im.rows for im in stored.images] == [ROWS, ROWS]
    # The same two turns again, then no KV prefix on disk: only the conversation remains.
    first_two = engine(vlm, tmp_path / 'two.db')
    try:
        ask(first_two, LOOK, [image(1)])
        ask(first_two, f'Now this one {MEDIA_MARKER} is it the same?', [image(3)])
    finally:
        first_two.close()
    db = sqlite3.connect(tmp_path / 'two.db')
    db.execute("UPDATE sessions SET keys = '[]', positions = 0, nbytes = 0, data = x''")
    db.commit()
    db.close()
    restarted = engine(vlm, tmp_path / 'two.db')
    try:
        assert restarted.session('s').kv_bytes == 0
        assert [im.digest for im in restarted.session('s').conversation.images] == [
            im.digest for im in stored.images]
        got = ask(restarted, THEN)
        assert got.timings.cached_prompt_tokens == 0
        assert restarted.vision._cache == {}, 'the stored rows were encoded again'
        same_answer(got, want)
        # The second frame again, in a new turn (the first turn, with the first frame, is
        # dropped for room): its session holds its rows.
        again = ask(restarted, f'Again {MEDIA_MARKER}?', [image(3)])
        images = restarted.session('s').conversation.images
        assert again.dropped_turns > 0 and [im.digest for im in images] == [
            stored.images[1].digest] * 2
        assert restarted.vision._cache == {}, 'a frame the session holds was encoded again'
    finally:
        restarted.close()


def test_a_resent_history_brings_the_stored_images_back(vlm, reference):  # noqa: F811
    eng = engine(vlm)
    try:
        first = ask(eng, LOOK, [image(1)], mode=conv.HISTORY_AUTO)
        history = [ChatMessage('user', LOOK), ChatMessage('assistant', first.text)]
        eng.vision.clear()
        second = ask(eng, THEN, [image(1)], mode=conv.HISTORY_AUTO, messages=history)
        assert eng.vision._cache == {}, 'a resent image was encoded again'
        assert len(eng.session('s').conversation.turns) == 4
        plain = whole(reference, history + [ChatMessage('user', THEN)], [image(1)])
        same_answer(plain, second)
        # The history's text with another image is not this conversation.
        history = [ChatMessage('user', LOOK), ChatMessage('assistant', first.text),
                   ChatMessage('user', THEN), ChatMessage('assistant', second.text)]
        refused = eng.generate(GenerationRequest(
            prompt='And now?', images=[image(2)], session_id='s', messages=history,
            history_mode=conv.HISTORY_AUTO, max_tokens=2)).run_to_end()
        assert 'not the image stored there' in refused.error
        assert len(eng.session('s').conversation.turns) == 4
    finally:
        eng.close()


def test_the_context_policy_drops_an_old_turn_with_its_image(vlm, reference):  # noqa: F811
    eng = engine(vlm, max_context=256)
    try:
        ask(eng, LOOK, [image(1)])
        ask(eng, f'And {MEDIA_MARKER}?', [image(2)])
        third = ask(eng, f'Last {MEDIA_MARKER}.', [image(3)])
        assert third.dropped_turns >= 2
        stored = eng.session('s').conversation
        markers = sum(t.content.count(MEDIA_MARKER) for t in stored.turns)
        assert markers == len(stored.images) and len(stored.images) < 3
        # The kept images are the newest, laid out where their turns now start.
        assert stored.images[-1].digest != stored.images[0].digest or len(stored.images) == 1
        kept = [image(4 - len(stored.images) + i) for i in range(len(stored.images))]
        plain = whole(reference, list(stored.turns[:-1]), kept)
        same_answer(plain, third)
    finally:
        eng.close()


def test_replace_starts_again_without_the_stored_images(vlm, reference):  # noqa: F811
    eng = engine(vlm)
    try:
        ask(eng, LOOK, [image(1)])
        again = ask(eng, f'New start {MEDIA_MARKER}.', [image(2)], mode=conv.HISTORY_REPLACE)
        (kept,) = eng.session('s').conversation.images
        same_answer(again, whole(reference, [ChatMessage('user', f'New start {MEDIA_MARKER}.')],
                                 [image(2)]))
        text_only = ask(eng, 'Only words.', mode=conv.HISTORY_REPLACE)
        assert eng.session('s').conversation.images == ()
        same_answer(text_only, whole(reference, [ChatMessage('user', 'Only words.')], []))
        assert kept.rows == ROWS
    finally:
        eng.close()


def test_a_marker_without_images_is_text_and_a_replys_marker_stays_text(vlm):  # noqa: F811
    eng = engine(vlm)
    try:
        literal = f'What does {MEDIA_MARKER} mean in llama.cpp?'
        ask(eng, literal)
        ask(eng, 'And in this engine?')
        assert eng.session('s').conversation.turns[0].content == literal
        # A marker the model writes has no image: kept as text, so later image turns count.
        reply = conv.reply_turn(f'It is {MEDIA_MARKER}.', ())
        assert MEDIA_MARKER not in reply.content and conv.LITERAL_MARKER in reply.content
    finally:
        eng.close()


def test_an_image_in_the_sessions_system_prompt_is_refused(vlm):  # noqa: F811
    eng = engine(vlm)
    try:
        with pytest.raises(ImageInputError, match='user turn'):
            eng.prepare(GenerationRequest(prompt='hi', system_prompt=f'See {MEDIA_MARKER}',
                                          images=[image(1)], session_id='s'))
    finally:
        eng.close()


def test_a_schema_2_store_is_upgraded_with_its_conversations(vlm, tmp_path):  # noqa: F811
    store = tmp_path / 'sessions.db'
    eng = engine(vlm, store)
    try:
        want = ask(eng, 'Hello there.')
    finally:
        eng.close()
    db = sqlite3.connect(store)   # as schema 2 wrote it
    db.execute('ALTER TABLE sessions DROP COLUMN state_ends')
    db.execute('ALTER TABLE sessions DROP COLUMN media')
    db.execute('PRAGMA user_version = 2')
    db.commit()
    db.close()
    eng = engine(vlm, store)
    try:
        turns = eng.session('s').conversation.turns
        assert [t.content for t in turns] == ['Hello there.', want.text]
        ask(eng, LOOK, [image(1)])
    finally:
        eng.close()
    eng = engine(vlm, store)
    try:
        assert len(eng.session('s').conversation.images) == 1
    finally:
        eng.close()
