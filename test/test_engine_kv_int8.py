"""kv.dtype int8 end to end on the embedded SmolLM2-135M: the live KV itself in int8 (issue 39).

The engine loads model_kv_int8.onnx (convert/kv_int8_graph.py, written here into a folder of
links to the embedded model's files), its KV buffers hold int8 rows with float32 scales and the
attention reads them directly. Greedy answers stay coherent, and since a snapshot is now a plain
copy of the live rows, a session restored after a restart (sessions.store) continues with the
uninterrupted int8 run's tokens and log probabilities, bit for bit.
"""
import pathlib

import numpy as np
import pytest

from edge_llm_ros.convert.kv_int8_graph import linked_folder
from edge_llm_ros.errors import ModelLoadError
from edge_llm_ros.model_format import KV_INT8_MODEL_FILE, load_model_info
from edge_llm_ros.runtime.decoder import OnnxDecoder, SessionConfig
from edge_llm_ros.runtime.types import ChatMessage, GenerationRequest, SamplingConfig
from edge_llm_ros.serving.engine import Engine, EngineConfig, kv_budget_bytes

pytestmark = pytest.mark.slow

USER1 = ChatMessage('user', 'Name three colors of the rainbow.')
USER2 = ChatMessage('user', 'Which of them is the color of grass?')


def without_int8_graph(source: pathlib.Path, folder: pathlib.Path) -> pathlib.Path:
    """Make a linked copy of source (linked_folder) less its int8-KV graph."""
    linked_folder(source, folder)
    (folder / KV_INT8_MODEL_FILE).unlink()
    return folder


@pytest.fixture(scope='module')
def int8_dir(tmp_path_factory):
    from edge_llm_ros.convert.default_model import ensure_default_model
    return linked_folder(ensure_default_model(), tmp_path_factory.mktemp('smol') / 'model')


def config(folder, **kw):
    return EngineConfig(model_dir=str(folder), intra_op_threads=2, max_context=512,
                        kv_dtype='int8', **kw)


def answer(engine, prompt):
    return engine.generate(GenerationRequest(prompt=prompt, max_tokens=48)).run_to_end()


def test_int8_kv_greedy_answers_are_coherent(int8_dir):
    eng = Engine(config(int8_dir))
    try:
        assert eng.live_kv_dtype == 'int8'
        assert eng.kv_bytes == kv_budget_bytes(eng.info, 512, 1, 'int8')
        assert eng.kv_bytes < kv_budget_bytes(eng.info, 512, 1) / 3
        assert 'blue' in answer(eng, 'What color is the sky?').text.lower()
        assert '4' in answer(eng, 'What is 2+2?').text
    finally:
        eng.close()


def turn(engine, messages, session='chat'):
    return engine.generate(GenerationRequest(
        messages=list(messages), session_id=session, max_tokens=16,
        sampling=SamplingConfig(top_logprobs=3))).run_to_end()


def logprobs(result):
    return np.array([[t.logprob] + [p for _, p in t.top] for t in result.logprobs])


def test_a_restored_int8_session_continues_bit_equal(int8_dir, tmp_path):
    store = tmp_path / 'sessions.db'
    e1 = Engine(config(int8_dir, session_store=str(store)))
    first = turn(e1, [USER1])
    e1.close()
    e2 = Engine(config(int8_dir, session_store=str(store)))
    assert e2.saved_sessions() == ['chat']
    second = turn(e2, [USER1, ChatMessage('assistant', first.text), USER2])
    e2.close()

    plain = Engine(config(int8_dir))   # the same two turns, no store, no restart
    want_first = turn(plain, [USER1])
    want_second = turn(plain, [USER1, ChatMessage('assistant', want_first.text), USER2])
    plain.close()
    assert first.token_ids == want_first.token_ids
    assert second.timings.cached_prompt_tokens > 0
    assert second.timings.cached_prompt_tokens == want_second.timings.cached_prompt_tokens
    assert second.token_ids == want_second.token_ids
    assert logprobs(second).tobytes() == logprobs(want_second).tobytes()


def test_without_the_int8_graph_the_live_kv_stays_float(int8_dir, tmp_path, caplog):
    folder = without_int8_graph(int8_dir, tmp_path / 'model')
    eng = Engine(config(folder))
    try:
        assert eng.live_kv_dtype == 'float32'
        assert eng.kv_bytes == kv_budget_bytes(eng.info, 512, 1)
        assert 'kv_int8_graph' in caplog.text
    finally:
        eng.close()
    with pytest.raises(ModelLoadError, match='kv_int8_graph'):   # the decoder alone refuses
        OnnxDecoder(str(folder), load_model_info(str(folder)), SessionConfig(kv_dtype='int8'))


def test_rows_saved_beside_float_live_kv_restore_into_int8_live_kv(int8_dir, tmp_path):
    """An int8 snapshot of float32 buffers is the same BLOB and layout: it stays readable."""
    store = str(tmp_path / 'sessions.db')
    before = Engine(config(without_int8_graph(int8_dir, tmp_path / 'model'),
                           session_store=store))
    try:
        assert before.live_kv_dtype == 'float32'
        first = turn(before, [USER1])
    finally:
        before.close()
    after = Engine(config(int8_dir, session_store=store))
    try:
        assert after.live_kv_dtype == 'int8' and after.saved_sessions() == ['chat']
        second = turn(after, [USER1, ChatMessage('assistant', first.text), USER2])
    finally:
        after.close()
    assert second.timings.cached_prompt_tokens > 0   # restored, not dropped
