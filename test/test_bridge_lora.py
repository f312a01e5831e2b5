"""The OpenAI bridge's LoRA adapters: llama-server's per-request `lora`, and base+adapter."""
from bridge_fakes import FakeBackend, MODEL, text_script
from fastapi.testclient import TestClient
import pytest

from edge_llm_ros.bridge import BridgeConfig, create_app

pytestmark = pytest.mark.timeout(60)


def post(backend, path='/v1/chat/completions', **body):
    client = TestClient(create_app(backend, BridgeConfig()))
    base = ({'messages': [{'role': 'user', 'content': 'hi'}]} if 'chat' in path
            else {'prompt': 'hi'})
    return client.post(path, json={'model': MODEL, **base, **body})


@pytest.mark.parametrize('path', ['/v1/chat/completions', '/v1/completions'])
def test_lora_field_and_model_suffix_reach_the_backend(path):
    backend = FakeBackend(lambda r: text_script('ok'))
    reply = post(backend, path, model=f'{MODEL}+skill',
                 lora=[{'name': 'site', 'scale': 0.5}])
    assert reply.status_code == 200, reply.text
    request = backend.requests[0]
    assert request.model == MODEL
    assert request.lora == (('site', 0.5), ('skill', 1.0))
    post(backend, path)
    assert backend.requests[1].lora == ()


def test_bad_lora_input_is_a_400_or_404():
    backend = FakeBackend(lambda r: text_script('ok'))
    by_id = post(backend, lora=[{'id': 0, 'scale': 1.0}])
    assert by_id.status_code == 400 and 'name' in by_id.json()['error']['message']
    assert post(backend, model=f'{MODEL}+').status_code == 400
    assert post(backend, model='other+skill').status_code == 404
    assert post(backend, lora=[{'name': 'x', 'scale': 'big'}]).status_code == 400
    assert not backend.requests
