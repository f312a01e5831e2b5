"""image_url content parts through the bridge: the openai SDK and langchain-openai, no node.

The bridge decodes data: URLs into RGB arrays (the backend gets them with a `<__media__>`
marker where each part was), refuses http(s) URLs (or fetches them, bounded, where
fetch_image_urls allows it) and corrupt images with OpenAI-shaped 400s, and
LLMClientBackend turns the arrays into pool handles (build_goal never carries pixels).
test_vision_node.py runs the same through a real llm_node serving a tiny VLM.
"""
import base64
import http.server
import io
import threading

from bridge_fakes import BACKEND_KINDS, FakeBackend, KIND_IDS, MODEL, served, serving, \
    text_script
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI
import numpy as np
import openai
from PIL import Image
import pytest

from edge_llm_ros.bridge.backend import BackendRequest, Message
from edge_llm_ros.bridge.config import BridgeConfig
from edge_llm_ros.bridge.errors import QueueFullError
from edge_llm_ros.ipc.resolver import TensorResolver
from edge_llm_ros.nodes.handles import image_pool
from edge_llm_ros.nodes.llm_client_backend import build_goal, IMAGE_POOLS, LLMClientBackend
from edge_llm_ros.runtime.media import MEDIA_MARKER

pytestmark = pytest.mark.timeout(120)
KEY = 'image-key'
PIXELS = np.random.default_rng(5).integers(0, 256, (9, 12, 3), dtype=np.uint8)


def data_url(pixels: np.ndarray = PIXELS, kind: str = 'png') -> str:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format='PNG' if kind == 'png' else 'JPEG')
    return f'data:image/{kind};base64,' + base64.b64encode(out.getvalue()).decode()


def truncated_png() -> str:
    """Return a data URL of a PNG cut in half (the header reads, the pixels do not)."""
    data = base64.b64decode(data_url(np.random.default_rng(1).integers(
        0, 256, (64, 64, 3), dtype=np.uint8)).split(',', 1)[1])
    return 'data:image/png;base64,' + base64.b64encode(data[:len(data) // 2]).decode()


def huge_png() -> str:
    """Return a data URL of a PNG whose header says 12000 x 9000 (108 megapixels).

    Only the header is real: the size must be refused before any pixel is decoded.
    """
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack('>I', len(body)) + kind + body +
                struct.pack('>I', zlib.crc32(kind + body) & 0xffffffff))
    header = struct.pack('>IIBBBBB', 12000, 9000, 8, 2, 0, 0, 0)
    png = (b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', header) +
           chunk(b'IDAT', zlib.compress(b'\0' * 64)) + chunk(b'IEND', b''))
    return 'data:image/png;base64,' + base64.b64encode(png).decode()


def responder(request):
    return text_script(f'{len(request.images)} images')


@pytest.fixture(scope='module', params=BACKEND_KINDS, ids=KIND_IDS)
def server(request):
    yield from serving(request.param(responder), KEY)


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server[1].base_url, api_key=KEY, max_retries=0,
                       timeout=20) as made:
        yield made


def ask(client, *parts):
    return client.chat.completions.create(model=MODEL, messages=[
        {'role': 'user', 'content': list(parts)}], max_tokens=8)


def text(value):
    return {'type': 'text', 'text': value}


def image(url):
    return {'type': 'image_url', 'image_url': {'url': url, 'detail': 'low'}}


def test_data_urls_reach_the_backend_as_pixels_with_markers(client, server):
    backend = server[0]
    reply = ask(client, text('What is this?'), image(data_url()), text('And this?'),
                image(data_url(PIXELS[::-1].copy())))
    assert reply.choices[0].message.content == '2 images'
    request = backend.requests[-1]
    assert request.messages[-1].content == (
        f'What is this?\n{MEDIA_MARKER}\nAnd this?\n{MEDIA_MARKER}')
    assert [im.shape for im in request.images] == [(9, 12, 3)] * 2
    assert np.array_equal(request.images[0], PIXELS)
    assert np.array_equal(request.images[1], PIXELS[::-1])
    # JPEG too (lossy: only the size is checked), and plain-text requests carry none.
    ask(client, image(data_url(kind='jpeg')))
    assert backend.requests[-1].images[0].shape == (9, 12, 3)
    client.chat.completions.create(model=MODEL, messages=[{'role': 'user', 'content': 'hi'}])
    assert backend.requests[-1].images == ()


@pytest.mark.parametrize('url, message, code', [
    ('https://example.com/cat.png', 'not fetched by this server', 'image_url_not_supported'),
    ('http://10.0.0.5/cam.jpg', 'not fetched by this server', 'image_url_not_supported'),
    ('file:///etc/passwd', 'not an image data URL', None),
    ('data:text/plain;base64,aGk=', 'not an image data URL', None),
    ('data:image/png;base64,@@@not-base64@@@', 'not valid base64', None),
    (truncated_png(), 'cannot be decoded', None),
    (huge_png(), 'megapixels', None),
    ('data:image/png;base64,' + base64.b64encode(b'just text').decode(), 'not an image',
     None),
])
def test_bad_image_urls_are_openai_400s(client, server, url, message, code):
    count = len(server[0].requests)
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, text('look'), image(url))
    body = err.value.body
    assert message in body['message'], body
    assert body['param'] == 'messages[0].content[1].image_url.url'
    assert body['type'] == 'invalid_request_error' and body['code'] == code
    assert len(server[0].requests) == count   # refused before the backend saw it


def test_other_part_types_are_still_refused(client):
    with pytest.raises(openai.BadRequestError, match='only text and image_url'):
        ask(client, {'type': 'input_audio', 'input_audio': {'data': 'AAAA', 'format': 'wav'}})


def test_langchain_human_message_with_an_image_part(server):
    llm = ChatOpenAI(model=MODEL, base_url=server[1].base_url, api_key=KEY, max_retries=0,
                     timeout=20)
    message = HumanMessage(content=[{'type': 'text', 'text': 'Describe the scene.'},
                                    {'type': 'image_url', 'image_url': {'url': data_url()}}])
    assert llm.invoke([message]).content == '1 images'
    request = server[0].requests[-1]
    assert request.messages[-1].content == f'Describe the scene.\n{MEDIA_MARKER}'
    assert np.array_equal(request.images[0], PIXELS)


def test_goals_carry_handles_and_completions_are_raw(tmp_path, monkeypatch):
    chat = BackendRequest(request_id='r', model=MODEL, images=(PIXELS,),
                          messages=(Message('user', f'{MEDIA_MARKER} what?'),))
    monkeypatch.setenv('EDGE_LLM_IPC_DIR', str(tmp_path / 'sockets'))
    with image_pool(chat.images, 'bridge_test') as handles:
        goal = build_goal(chat, handles)
        assert not goal.raw_prompt and goal.messages[0].content == f'{MEDIA_MARKER} what?'
        assert [h.pool_id for h in goal.images] == ['bridge_test']
        with TensorResolver() as consumer:
            assert np.array_equal(consumer.resolve(goal.images[0]), PIXELS)
    completion = build_goal(BackendRequest(request_id='c', model=MODEL, prompt='<s>Once'))
    assert completion.raw_prompt and completion.prompt == '<s>Once'
    assert list(completion.images) == []


def test_image_pools_are_a_fixed_set_of_names(tmp_path, monkeypatch):
    monkeypatch.setenv('EDGE_LLM_IPC_DIR', str(tmp_path / 'sockets'))
    backend = LLMClientBackend(client=None)
    names = set(backend._pool_ids)
    assert len(names) == IMAGE_POOLS
    held = []
    for _ in range(IMAGE_POOLS):   # every request with images holds one pool while it runs
        context = backend._shared_images([PIXELS])
        held.append((context, context.__enter__()))
    assert {handles[0].pool_id for _, handles in held} == names
    with pytest.raises(QueueFullError, match=f'{IMAGE_POOLS} requests with images'):
        with backend._shared_images([PIXELS]):
            pass
    for context, _ in held:
        context.__exit__(None, None, None)
    with backend._shared_images([PIXELS]) as handles:   # a name is free again, and reused
        assert handles[0].pool_id in names
    with backend._shared_images([]) as handles:
        assert handles == []


class _Images(http.server.BaseHTTPRequestHandler):
    """/cat.png: a PNG; /slow.png: answers after the client's timeout; others: 404."""

    png = base64.b64decode(data_url().split(',', 1)[1])
    release = threading.Event()

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == '/slow.png':
            self.release.wait(10)
        if self.path not in ('/cat.png', '/slow.png'):
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header('Content-Type', 'image/png')
        self.send_header('Content-Length', str(len(self.png)))
        self.end_headers()
        self.wfile.write(self.png)

    def log_message(self, *args):
        pass


@pytest.fixture(scope='module')
def image_server():
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f'http://127.0.0.1:{server.server_address[1]}'
    _Images.release.set()
    server.shutdown()
    server.server_close()


def test_http_image_urls_are_fetched_only_where_the_bridge_allows_it(image_server):
    backend = FakeBackend(responder)
    config = BridgeConfig(port=0, fetch_image_urls=True, image_fetch_timeout_s=1.0,
                          image_fetch_max_bytes=1 << 20)
    with served(backend, config) as bridge, openai.OpenAI(
            base_url=bridge.base_url, api_key='x', max_retries=0, timeout=20) as client:
        reply = ask(client, text('What is this?'), image(f'{image_server}/cat.png'))
        assert reply.choices[0].message.content == '1 images'
        np.testing.assert_array_equal(backend.requests[-1].images[0], PIXELS)
        for path, message, code in [('/missing.png', 'HTTP 404', 'image_url_unreachable'),
                                    ('/slow.png', 'timed out', 'image_url_unreachable')]:
            with pytest.raises(openai.BadRequestError) as err:
                ask(client, image(f'{image_server}{path}'))
            assert message in err.value.body['message'] and err.value.body['code'] == code
            assert err.value.body['param'] == 'messages[0].content[0].image_url.url'
    small = BridgeConfig(port=0, fetch_image_urls=True, image_fetch_max_bytes=16)
    with served(FakeBackend(responder), small) as bridge, openai.OpenAI(
            base_url=bridge.base_url, api_key='x', max_retries=0, timeout=20) as client:
        with pytest.raises(openai.BadRequestError) as err:
            ask(client, image(f'{image_server}/cat.png'))
        assert err.value.body['code'] == 'image_too_large'
    # The default bridge fetches nothing (test_bad_image_urls_are_openai_400s).
    assert not BridgeConfig().fetch_image_urls


def test_the_bridge_node_parameters_reach_the_fetch_settings():
    from edge_llm_ros.nodes.openai_bridge import bridge_config, SCHEMA
    values = {spec.name: spec.default for spec in SCHEMA.specs}
    assert not bridge_config(values).fetch_image_urls
    values.update({'images.fetch_urls': True, 'images.fetch_timeout_s': 2.5,
                   'images.fetch_max_bytes': 1000})
    config = bridge_config(values)
    assert (config.fetch_image_urls, config.image_fetch_timeout_s,
            config.image_fetch_max_bytes) == (True, 2.5, 1000)
