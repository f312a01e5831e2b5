"""/v1/embeddings and /v1/rerank through the bridge over HTTP, and LangChain's OpenAIEmbeddings.

The backend is an EmbeddingEngine on tiny random bert GGUFs (test/bert_fixture.py); the
bridge must hand back its vectors unchanged (float and base64), rank as it scores, and answer
bad input with OpenAI-shaped 400s.
"""
import base64

from bert_fixture import BertCase, TEXTS, write_bert_gguf
import httpx
import numpy as np
import pytest

from edge_llm_ros.bridge.config import BridgeConfig
from edge_llm_ros.bridge.server import run_bridge
from edge_llm_ros.convert.converter import convert
from edge_llm_ros.serving.embedding import EmbeddingConfig, EmbeddingEngine

MODEL = 'tiny-bert'


class EngineBackend:
    """The bridge's backend for an EmbeddingEngine (no chat: generate is never called)."""

    def __init__(self, engine: EmbeddingEngine) -> None:
        self.engine = engine

    def models(self):
        return [MODEL]

    def generate(self, request):
        return self.engine.generate(request)

    def cancel(self, request_id: str) -> None:
        pass

    def embed(self, texts, dimensions):
        return self.engine.embed(texts, dimensions=dimensions)

    def rerank(self, query, documents, top_n):
        return self.engine.rerank(query, documents, top_n)


@pytest.fixture(scope='module')
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('bridge_embed')
    out = {}
    for pooling in ('mean', 'rank'):
        gguf = write_bert_gguf(tmp / f'{pooling}.gguf', BertCase('F32', pooling, context=64))
        out[pooling] = EmbeddingEngine(EmbeddingConfig(
            str(convert(str(gguf), str(tmp / pooling), progress=False))))
    return out


@pytest.fixture(scope='module')
def bridge(engines):
    with run_bridge(EngineBackend(engines['mean']), BridgeConfig(port=0)) as running:
        yield running


@pytest.fixture(scope='module')
def rank_bridge(engines):
    with run_bridge(EngineBackend(engines['rank']), BridgeConfig(port=0)) as running:
        yield running


def test_float_and_base64_are_the_engine_vectors(bridge, engines):
    want = engines['mean'].embed(list(TEXTS[:3])).vectors
    r = httpx.post(f'{bridge.base_url}/embeddings',
                   json={'model': MODEL, 'input': list(TEXTS[:3])})
    assert r.status_code == 200, r.text
    body = r.json()
    got = np.array([d['embedding'] for d in body['data']], np.float32)
    assert np.array_equal(got, want) and body['usage']['prompt_tokens'] > 0
    r = httpx.post(f'{bridge.base_url}/embeddings',
                   json={'model': MODEL, 'input': TEXTS[0], 'encoding_format': 'base64',
                         'dimensions': 16})
    raw = np.frombuffer(base64.b64decode(r.json()['data'][0]['embedding']), '<f4')
    assert raw.shape == (16,) and abs(np.linalg.norm(raw) - 1) < 1e-5


@pytest.mark.parametrize('body, param', [
    ({'model': MODEL, 'input': []}, 'input'),
    ({'model': MODEL, 'input': [1, 2, 3]}, 'input'),
    ({'model': MODEL, 'input': 'door ' * 70}, 'input'),
    ({'model': MODEL, 'input': 'a', 'dimensions': 65}, 'input'),
    ({'model': MODEL, 'input': 'a', 'encoding_format': 'int8'}, 'encoding_format'),
])
def test_bad_input_is_an_openai_400(bridge, body, param):
    r = httpx.post(f'{bridge.base_url}/embeddings', json=body)
    assert r.status_code == 400, r.text
    error = r.json()['error']
    assert error['type'] == 'invalid_request_error' and error['param'] == param
    assert httpx.post(f'{bridge.base_url}/embeddings',
                      json={'model': MODEL, 'input': 'ok'}).status_code == 200


def test_rerank_is_best_first(rank_bridge, engines):
    docs = list(TEXTS[:4])
    want = engines['rank'].rerank(TEXTS[1], docs)
    r = httpx.post(f'{rank_bridge.base_url}/rerank',
                   json={'model': MODEL, 'query': TEXTS[1], 'documents': docs, 'top_n': 2})
    assert r.status_code == 200, r.text
    results = r.json()['results']
    assert [x['index'] for x in results] == list(want.order[:2])
    assert np.allclose([x['relevance_score'] for x in results],
                       want.scores[list(want.order[:2])])
    r = httpx.post(f'{rank_bridge.base_url}/rerank',
                   json={'model': MODEL, 'query': 'q', 'documents': []})
    assert r.status_code == 400 and r.json()['error']['param'] == 'documents'


def test_langchain_openai_embeddings(bridge, engines):
    langchain_openai = pytest.importorskip('langchain_openai')
    lc = langchain_openai.OpenAIEmbeddings(model=MODEL, base_url=bridge.base_url,
                                           api_key='unused', check_embedding_ctx_length=False)
    docs = lc.embed_documents(list(TEXTS[:2]))
    query = lc.embed_query(TEXTS[2])
    want = engines['mean'].embed(list(TEXTS[:3])).vectors
    assert np.allclose(np.array(docs), want[:2], atol=1e-6)
    assert np.allclose(query, want[2], atol=1e-6)
