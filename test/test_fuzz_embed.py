"""Property tests: random ~/embed and ~/rerank requests, then a hostile load on a real node.

Contract (issue 42 item 6): every request is answered with vectors / scores of the right
shape or refused with a typed error (EmbeddingInputError, WrongModelKindError) whose message
says what to change; nothing else escapes and each call returns in bounded time. The second
half sends the worst of them to a real llm_node process from several threads at once, while
good requests keep being answered, and the node must stay up without a traceback.
"""
import os
import threading

from bert_fixture import BertCase, TEXTS, write_bert_gguf
from fuzz_support import accepted_or_typed, fuzz, HOSTILE_TEXT
from hypothesis import given, strategies as st
from llm_node_harness import served_process
import numpy as np
import pytest

from edge_llm_ros.client import EmbedRefusedError
from edge_llm_ros.convert.converter import convert
from edge_llm_ros.errors import EmbeddingInputError, WrongModelKindError
from edge_llm_ros.serving.embedding import EmbeddingConfig, EmbeddingEngine

MAX_BATCH = 8
CONTEXT = 64
HIDDEN = 64
TYPED = (EmbeddingInputError, WrongModelKindError)


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('fuzz_embed')
    out = {}
    for pooling in ('mean', 'rank'):
        gguf = write_bert_gguf(tmp / f'{pooling}.gguf', BertCase('F32', pooling,
                                                                 context=CONTEXT))
        out[pooling] = str(convert(str(gguf), str(tmp / pooling), progress=False))
    return out


@pytest.fixture(scope='module')
def engines(folders):
    return {kind: EmbeddingEngine(EmbeddingConfig(folder, max_batch=MAX_BATCH))
            for kind, folder in folders.items()}


texts = st.lists(st.one_of(HOSTILE_TEXT, st.sampled_from(TEXTS), st.just('')),
                 max_size=MAX_BATCH + 3)
dimensions = st.one_of(st.integers(0, HIDDEN + 2), st.integers(0, 2**32 - 1))


@fuzz(60)
@given(texts=texts, is_query=st.booleans(), dims=dimensions, truncate=st.booleans(),
       kind=st.sampled_from(['mean', 'rank']))
def test_random_embed_requests_answer_or_refuse(engines, texts, is_query, dims, truncate, kind):
    ok, out = accepted_or_typed(
        lambda: engines[kind].embed(texts, is_query, dims, truncate), TYPED, timeout_s=30.0,
        what='embed')
    if ok:
        width = dims or HIDDEN
        assert out.vectors.shape == (len(texts), width) and np.isfinite(out.vectors).all()
        assert np.allclose(np.linalg.norm(out.vectors, axis=1), 1.0, atol=1e-4)
        assert len(out.token_counts) == len(texts)
        assert all(0 < n <= CONTEXT for n in out.token_counts)


@fuzz(40)
@given(query=st.one_of(HOSTILE_TEXT, st.just('')), documents=texts,
       top_n=st.integers(-3, MAX_BATCH + 3), truncate=st.booleans(),
       kind=st.sampled_from(['mean', 'rank']))
def test_random_rerank_requests_answer_or_refuse(engines, query, documents, top_n, truncate,
                                                 kind):
    ok, out = accepted_or_typed(
        lambda: engines[kind].rerank(query, documents, top_n, truncate), TYPED, timeout_s=30.0,
        what='rerank')
    if ok:
        assert out.scores.shape == (len(documents),) and np.isfinite(out.scores).all()
        assert len(out.order) == (min(top_n, len(documents)) if top_n else len(documents))
        assert list(out.order) == sorted(out.order, key=lambda i: -out.scores[i])


# --- hostile load on a real node process ----------------------------------------------------
HOSTILE_CALLS = [
    ({'texts': ['door ' * 5000]}, 'EmbeddingInputError'),          # over the context
    ({'texts': ['a'] * 10_000}, 'EmbeddingInputError'),            # over the batch limit
    ({'texts': ['a'], 'dimensions': 2**32 - 1}, 'EmbeddingInputError'),
    ({'texts': ['', '\x00']}, 'EmbeddingInputError'),
]


def test_hostile_load_is_refused_while_good_requests_are_answered(folders):
    name = f'llm_fuzz_embed_{os.getpid()}'
    with served_process(name, {'autostart': True, 'model.path': folders['mean']},
                        f'{name}_client') as (proc, _ros, llm):
        expected = llm.embed([TEXTS[0]], timeout=60.0).vectors
        failures: list = []

        def hostile(kwargs, kind):
            try:
                for _ in range(3):
                    args = dict(kwargs)
                    with pytest.raises(EmbedRefusedError) as err:
                        llm.embed(args.pop('texts'), timeout=120.0, **args)
                    assert err.value.kind == kind and str(err.value).strip()
                    with pytest.raises(EmbedRefusedError) as err:
                        llm.rerank('q', ['d'] * 3, timeout=120.0)   # an embedding folder
                    assert err.value.kind == 'WrongModelKindError'
            except BaseException as exc:  # noqa: B902 - reported by the main thread
                failures.append(exc)

        def good():
            try:
                for _ in range(5):
                    got = llm.embed([TEXTS[0]], timeout=120.0).vectors
                    np.testing.assert_array_equal(got, expected)
            except BaseException as exc:  # noqa: B902 - reported by the main thread
                failures.append(exc)

        threads = [threading.Thread(target=hostile, args=call) for call in HOSTILE_CALLS]
        threads.append(threading.Thread(target=good))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert not any(t.is_alive() for t in threads), 'a call did not return'
        assert not failures, failures
        assert llm.embed(['still here'], timeout=60.0).vectors.shape == (1, HIDDEN)
        assert proc.proc.poll() is None
    assert 'Traceback' not in proc.log(), proc.log()
