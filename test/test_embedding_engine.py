"""EmbeddingEngine: requests checked once with typed errors, length-bucket batching, Matryoshka.

Runs a tiny random bert GGUF (test/bert_fixture.py, F32) converted to a folder; what the
vectors are worth is test_embed_parity.py's job (llama.cpp as the reference).
"""
import shutil
from types import SimpleNamespace

from bert_fixture import BertCase, TEXTS, write_bert_gguf
import numpy as np
import pytest
import yaml

from edge_llm_ros.convert.converter import convert
from edge_llm_ros.errors import EmbeddingInputError, WrongModelKindError
from edge_llm_ros.runtime import encoder as encoder_mod
from edge_llm_ros.serving.embedding import (EmbeddingConfig, EmbeddingEngine,
                                            open_embedding_engine)
from edge_llm_ros.serving.engine import Engine, EngineConfig


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('embed')
    out = {}
    for pooling in ('mean', 'rank'):
        gguf = write_bert_gguf(tmp / f'{pooling}.gguf', BertCase('F32', pooling, context=64))
        out[pooling] = str(convert(str(gguf), str(tmp / pooling), progress=False))
    return out


@pytest.fixture(scope='module')
def engine(folders):
    return EmbeddingEngine(EmbeddingConfig(folders['mean'], max_batch=8,
                                           query_prefix='where ', document_prefix=''))


def test_embed_shapes_norms_and_token_counts(engine):
    out = engine.embed(list(TEXTS))
    assert out.vectors.shape == (len(TEXTS), 64) and out.vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(out.vectors, axis=1), 1.0, atol=1e-5)
    assert out.token_counts[4] == 3  # [CLS] a [SEP]


def test_batched_equals_alone_and_padding_is_by_plan(engine, monkeypatch):
    widths = []
    run = engine.encoder._session.run

    def spy(names, feeds):
        widths.append(feeds['input_ids'].shape)
        return run(names, feeds)

    monkeypatch.setattr(engine.encoder._session, 'run', spy, raising=False)
    together = engine.embed(list(TEXTS)).vectors
    calls = list(widths)
    alone = np.stack([engine.embed([t]).vectors[0] for t in TEXTS])
    assert np.abs(together - alone).max() < 1e-5
    # 7 texts of 3..29 tokens: each call padded to its own longest text, as plan_batches
    # cut them, not one call padded to 29.
    lengths = sorted(len(i) for i in engine.encoder.tokenize(list(TEXTS), truncate=False))
    cuts = encoder_mod.plan_batches(lengths, 4096)
    assert sorted(calls) == sorted((end - start, lengths[end - 1]) for start, end in cuts)
    assert len(calls) > 1 and sum(b * w for b, w in calls) < len(TEXTS) * lengths[-1]


def test_plan_batches_pads_the_fewest_tokens_a_call_costing_call_tokens():
    cost = encoder_mod.CALL_TOKENS
    # Three short texts share a call; the long one goes alone (padding the short ones to 29
    # would cost more than a call).
    assert encoder_mod.plan_batches([3, 4, 5, 29], 4096) == [(0, 3), (3, 4)]
    # Equal lengths always share a call, up to batch_tokens padded tokens a call.
    assert encoder_mod.plan_batches([8] * 6, 4096) == [(0, 6)]
    assert encoder_mod.plan_batches([8] * 6, 16) == [(0, 2), (2, 4), (4, 6)]
    # A text over batch_tokens still runs, alone.
    assert encoder_mod.plan_batches([5, 40], 16) == [(0, 1), (1, 2)]
    # Two lengths close enough: one call (padding 2 tokens beats a second call).
    assert encoder_mod.plan_batches([10, 11, 12], 4096) == [(0, 3)]
    assert cost > 3


def test_matryoshka_truncates_and_renormalizes(engine):
    full = engine.embed([TEXTS[0]]).vectors[0]
    short = engine.embed([TEXTS[0]], dimensions=16).vectors[0]
    assert short.shape == (16,)
    assert np.allclose(short, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)


def test_query_prefix_is_prepended(engine):
    assert engine.embed(['the door'], is_query=True).token_counts[0] == 5
    assert engine.embed(['the door']).token_counts[0] == 4


def test_a_served_folder_takes_its_familys_prefixes(folders, tmp_path):
    """An e5 model gets 'query: ' / 'passage: ' (config/models/e5.yaml); an unknown one none."""
    e5 = tmp_path / 'e5'
    shutil.copytree(folders['mean'], e5)
    meta = yaml.safe_load((e5 / 'model.yaml').read_text())
    meta['gguf_name'] = 'multilingual-e5-small'
    (e5 / 'model.yaml').write_text(yaml.safe_dump(meta))
    served = open_embedding_engine(str(e5))
    assert served.model_info()['query_prefix'] == 'query: '
    assert served.model_info()['document_prefix'] == 'passage: '
    count = {t: len(ids) for t, ids in zip(
        ('query: the door', 'passage: the door'),
        served.encoder.tokenize(['query: the door', 'passage: the door'], False))}
    assert served.embed(['the door'], is_query=True).token_counts[0] == count['query: the door']
    assert served.embed(['the door']).token_counts[0] == count['passage: the door'] > 4
    plain = open_embedding_engine(folders['mean'])
    assert plain.model_info()['query_prefix'] == '' and plain.config.document_prefix == ''
    assert plain.embed(['the door'], is_query=True).token_counts[0] == 4


@pytest.mark.parametrize('call, words', [
    (lambda e: e.embed([]), 'at least one'),
    (lambda e: e.embed(['ok', '  ']), 'text 1 is empty'),
    (lambda e: e.embed(['a'] * 9), 'over the limit of 8'),
    (lambda e: e.embed(['door ' * 70]), 'over the context of 64'),
    (lambda e: e.embed(['a'], dimensions=65), 'above the model'),
    (lambda e: e.embed('a plain string'), 'list of strings'),
])
def test_bad_input_is_a_typed_error_and_the_engine_serves_on(engine, call, words):
    with pytest.raises(EmbeddingInputError, match=words):
        call(engine)
    assert engine.embed(['still serving']).vectors.shape == (1, 64)


def test_truncate_cuts_to_the_context(engine):
    out = engine.embed(['door ' * 70], truncate=True)
    assert out.token_counts == (64,)


def test_rerank_truncate_cuts_the_document_not_the_query(folders):
    """A pair over the context keeps [CLS] query [SEP] whole and cuts the document's end."""
    ranker = EmbeddingEngine(EmbeddingConfig(folders['rank']))
    enc, query, long_doc = ranker.encoder, TEXTS[1], 'door ' * 70
    with pytest.raises(EmbeddingInputError, match='rerank pair 0 is .* over the context'):
        ranker.rerank(query, [long_doc])
    ids = enc.tokenize([query], truncate=True, pairs=[long_doc])[0]
    query_ids = enc.tokenizer.encode(query).ids          # [CLS] query [SEP]
    assert len(ids) == 64 and ids[:len(query_ids)] == query_ids
    kept = 64 - len(query_ids) - 1                       # the document's tokens, then [SEP]
    assert ids == enc.tokenizer.encode(query, ' '.join(['door'] * kept)).ids
    cut = ranker.rerank(query, [long_doc, TEXTS[2]], truncate=True).scores
    assert cut[0] == ranker.rerank(query, [' '.join(['door'] * kept)]).scores[0]
    with pytest.raises(EmbeddingInputError, match='the query .* fills the context'):
        ranker.rerank(long_doc, ['a door'], truncate=True)
    assert ranker.rerank(query, [TEXTS[2]]).scores.shape == (1,)   # serves on


def test_rerank_scores_order_and_top_n(folders):
    ranker = EmbeddingEngine(EmbeddingConfig(folders['rank']))
    docs = list(TEXTS[:5])
    out = ranker.rerank(TEXTS[1], docs)
    assert out.scores.shape == (5,) and sorted(out.order) == list(range(5))
    assert list(out.order) == sorted(range(5), key=lambda i: -out.scores[i])
    assert ranker.rerank(TEXTS[1], docs, top_n=2).order == out.order[:2]
    with pytest.raises(EmbeddingInputError, match='at least one document'):
        ranker.rerank('q', [])
    with pytest.raises(WrongModelKindError, match='reranker'):
        ranker.embed(['a'])


def test_wrong_model_kinds_are_typed_errors(folders, engine):
    with pytest.raises(WrongModelKindError, match='embedding/rerank model'):
        Engine(EngineConfig(model_dir=folders['mean']))
    with pytest.raises(WrongModelKindError, match='embedding/rerank model'):
        engine.generate(None)
    chat = SimpleNamespace(model_name='SmolLM2')
    with pytest.raises(WrongModelKindError, match='is a chat model'):
        Engine.embed(chat, ['a'])
    with pytest.raises(WrongModelKindError, match='is a chat model'):
        Engine.rerank(chat, 'q', ['d'])
    with pytest.raises(WrongModelKindError, match='no reranker'):
        engine.rerank('q', ['d'])
