"""llm_node serving an embedding folder: ~/embed and ~/rerank through LLMClient, bad input.

A real node process on a tiny random bert GGUF converted to an embedding folder (values are
test_embed_parity.py's job): vectors come back in the response, each bad request is a typed
refusal (error_kind) and the node answers the next request; a generate goal is refused.
"""
import json
import os
import subprocess
import sys

from bert_fixture import BertCase, TEXTS, write_bert_gguf
from llm_node_harness import served_process
import numpy as np
import pytest

from edge_llm_msgs.srv import Embed
from edge_llm_ros.client import EmbedRefusedError
from edge_llm_ros.convert.converter import convert
from edge_llm_ros.nodes.llm_embed import HANDLE_MIN_BYTES

NODE = f'llm_node_embed_{os.getpid()}'


@pytest.fixture(scope='module')
def node(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('embed_node')
    gguf = write_bert_gguf(tmp / 'bert.gguf', BertCase('F32', 'mean', context=64))
    folder = convert(str(gguf), str(tmp / 'bert'), progress=False)
    with served_process(NODE, {'autostart': True, 'model.path': str(folder)},
                        f'{NODE}_client') as (proc, ros, llm):
        yield proc, llm, ros


def test_a_large_result_comes_back_as_a_handle_with_the_same_values(node):
    _, llm, ros = node
    texts = [f'{TEXTS[i % len(TEXTS)]} {i}' for i in range(HANDLE_MIN_BYTES // (64 * 4) + 8)]
    raw = ros.call(Embed, f'/{NODE}/embed', Embed.Request(texts=texts), timeout=60.0)
    assert raw.success, raw.message
    # Over HANDLE_MIN_BYTES: no float array on the wire, a float32 [n, 64] tensor in the pool.
    assert not len(raw.vectors) and raw.handle.pool_id
    assert raw.handle.dtype == 'float32' and list(raw.handle.shape) == [len(texts), 64]
    big = llm.embed(texts, timeout=60.0).vectors
    inline = np.concatenate([llm.embed(texts[i:i + 8], timeout=60.0).vectors
                             for i in range(0, len(texts), 8)])
    assert big.shape == (len(texts), 64)
    np.testing.assert_allclose(big, inline, rtol=0, atol=1e-6)


def test_embed_returns_normalized_vectors(node):
    _, llm, _ = node
    reply = llm.embed(list(TEXTS), timeout=60.0)
    assert reply.vectors.shape == (len(TEXTS), 64)
    assert np.allclose(np.linalg.norm(reply.vectors, axis=1), 1.0, atol=1e-5)
    assert reply.token_counts[4] == 3 and reply.model_id
    short = llm.embed([TEXTS[0]], dimensions=8, timeout=60.0).vectors
    assert short.shape == (1, 8)


@pytest.mark.parametrize('kwargs, kind', [
    ({'texts': []}, 'EmbeddingInputError'),
    ({'texts': ['ok', '']}, 'EmbeddingInputError'),
    ({'texts': ['door ' * 70]}, 'EmbeddingInputError'),
    ({'texts': ['a'], 'dimensions': 65}, 'EmbeddingInputError'),
])
def test_bad_input_is_refused_and_the_node_serves_on(node, kwargs, kind):
    _, llm, _ = node
    texts = kwargs.pop('texts')
    with pytest.raises(EmbedRefusedError) as err:
        llm.embed(texts, timeout=60.0, **kwargs)
    assert err.value.kind == kind
    assert llm.embed(['still here'], timeout=60.0).vectors.shape == (1, 64)


def test_rerank_on_an_embedding_model_and_generate_are_refused(node):
    _, llm, _ = node
    with pytest.raises(EmbedRefusedError) as err:
        llm.rerank('q', ['d'], timeout=60.0)
    assert err.value.kind == 'WrongModelKindError'
    outcome = llm.generate('Hello', max_tokens=2).result(timeout=60.0)
    assert outcome.status != 'succeeded'
    assert 'embedding/rerank model' in (outcome.error_message or str(outcome))
    assert llm.embed(['still here'], timeout=60.0).vectors.shape == (1, 64)


def _cli(*args):
    return subprocess.run([sys.executable, '-m', 'edge_llm_ros.cli', *args,
                           '--server', '/' + NODE, '--timeout', '60'],
                          capture_output=True, text=True, timeout=120)


def test_cli_embed_prints_json_lines_and_rerank_is_refused(node):
    done = _cli('embed', 'the door', 'a cup', '--dimensions', '8')
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [d['text'] for d in lines] == ['the door', 'a cup']
    assert all(len(d['embedding']) == 8 for d in lines)
    refused = _cli('rerank', 'q', 'd')
    assert refused.returncode == 1 and 'WrongModelKindError' in refused.stderr
