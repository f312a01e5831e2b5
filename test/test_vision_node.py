"""Images through llm_node: a Generate goal's image handles against the engine run directly.

A tiny VLM (a random LLaVA-style `mlp` mmproj: one 32x32 tile, 64 rows per image, and a
256-wide text GGUF with the image wrapper tokens) is converted with --mmproj and served by a
real llm_node process. This process publishes frames into its own pool (memfd, sockets in
EDGE_LLM_IPC_DIR) and sends only their handles: the node must map them and give the token
ids Engine.generate gives for the same arrays. Stale, closed and foreign handles are refused
with invalid_request and the node keeps serving; `edge-llm ask --image` does the same from
a PNG file, and the openai_bridge from an image_url data URL (openai SDK, langchain-openai).
"""
import base64
import io
import os
import subprocess
import sys

from gguf_fixtures import ParityCase, write_gguf
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI
from llm_node_harness import NodeProcess, RosClient
from mmproj_fixtures import write_mmproj
import numpy as np
import openai
from PIL import Image
import pytest
import rclpy

from edge_llm_msgs.action import Generate
from edge_llm_msgs.msg import Transcript
from edge_llm_ros.convert.converter import convert
from edge_llm_ros.ipc.pool import PoolConfig, TensorPool
from edge_llm_ros.node_process import NodeProcess as AnyNodeProcess
from edge_llm_ros.nodes.handles import to_handle
from edge_llm_ros.nodes.openai_bridge import wait_serving
from edge_llm_ros.runtime.media import MEDIA_MARKER
from edge_llm_ros.runtime.types import ChatMessage, GenerationRequest, SamplingConfig
from edge_llm_ros.serving.engine import Engine, EngineConfig

pytestmark = pytest.mark.timeout(600)
TAG = f'vn{os.getpid()}'
LLM = f'{TAG}_llm'
TOKENS = 12
TOP = 8                        # top log probabilities compared per step
ROWS = 64                      # mlp: one 32x32 tile of 4x4 patches
RAW = f'Hello {MEDIA_MARKER}\nthe color'
GREEDY = {'max_tokens': TOKENS, 'temperature': 0.0}
INVALID = Generate.Result.ERROR_INVALID_REQUEST


def image(seed: int, height: int = 32, width: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)


@pytest.fixture(scope='module')
def vlm(tmp_path_factory):
    work = tmp_path_factory.mktemp('vision_node')
    text = write_gguf(work / 'text.gguf', ParityCase(arch='llama', wtype='F32', vision=True))
    mmproj = write_mmproj(work / 'mmproj.gguf', 'mlp', n_text=256, scale=None,
                          longest_edge=64, seed=11)
    return convert(str(text), str(work / 'vlm'), mmproj=str(mmproj), progress=False)


@pytest.fixture(scope='module')
def engine(vlm):
    """Run the same model in this process: what the node must reproduce."""
    made = Engine(EngineConfig(model_dir=str(vlm), max_context=256, intra_op_threads=1,
                               prefix_reuse=False))
    yield made
    made.close()


def direct(engine, prompt: str, images, raw: bool = True, messages=()):
    result = engine.generate(GenerationRequest(
        prompt=prompt, images=list(images), use_chat_template=not raw, messages=messages,
        max_tokens=TOKENS, sampling=SamplingConfig(logprobs=True, top_logprobs=TOP))).run_to_end()
    assert result.error == '', result.error
    return result


def logprob_gap(outcome, result) -> float:
    """Largest log prob difference of a top token, over the steps both runs share."""
    gap = 0.0
    for ours, theirs in zip(outcome.logprobs, result.logprobs):
        if ours.token_id != theirs.token_id:
            break
        mine = dict(zip(ours.top_token_ids, ours.top_logprobs))
        gap = max([gap] + [abs(mine[t] - lp) for t, lp in theirs.top if t in mine])
    return gap


@pytest.fixture(scope='module')
def ipc_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp('vision_node_ipc') / 'sockets')


@pytest.fixture(scope='module')
def node(vlm, ipc_dir):
    proc = NodeProcess(LLM, {'autostart': True, 'model.path': str(vlm),
                             'kv.max_context': 256}, env={'EDGE_LLM_IPC_DIR': ipc_dir})
    rclpy.init()
    client = RosClient(f'{TAG}_client')
    try:
        client.wait_state('/' + LLM, 'active', timeout=120)
        yield client
    finally:
        client.close()
        rclpy.try_shutdown()
        assert proc.stop() == 0, proc.log()


@pytest.fixture
def pool(ipc_dir):
    config = PoolConfig(pool_id=f'{TAG}_cam', slot_nbytes=32 * 32 * 3, slots=4,
                        socket_dir=ipc_dir)
    with TensorPool(config) as made:
        yield made


def test_an_image_handle_gives_the_engines_tokens(node, engine, pool):
    llm = node.llm('/' + LLM)
    transcripts = node.record(Transcript, f'/{LLM}/transcript')
    frame = image(7)
    expected = direct(engine, RAW, [frame])
    assert expected.prompt_tokens > ROWS
    handle = to_handle(pool.publish_array(frame))
    seen = llm.generate(RAW, images=[handle], raw_prompt=True, top_logprobs=TOP,
                        **GREEDY).result(timeout=300)
    assert seen.ok, seen
    assert seen.token_ids == expected.token_ids
    assert seen.prompt_tokens == expected.prompt_tokens
    # The node fed exactly these pixels: the same log probabilities as the engine's run,
    # while another image (same length, other rows) moves them.
    assert logprob_gap(seen, expected) < 1e-3
    other = llm.generate(RAW, images=[to_handle(pool.publish_array(image(99)))],
                         raw_prompt=True, top_logprobs=TOP, **GREEDY).result(timeout=300)
    assert other.ok and other.prompt_tokens == seen.prompt_tokens
    moved = direct(engine, RAW, [image(99)])
    assert other.token_ids == moved.token_ids and logprob_gap(other, moved) < 1e-3
    assert logprob_gap(seen, moved) > 1e-2
    # The transcript records the handle and the raw flag, not the pixels.
    record = next(r for r in list(transcripts)
                  if list(r.token_ids) == seen.token_ids and r.images)
    assert record.raw_prompt and record.images[0].pool_id == pool.pool_id
    assert list(record.images[0].shape) == [32, 32, 3]


def test_chat_template_goal_and_a_mono_frame(node, engine, pool):
    llm = node.llm('/' + LLM)
    frame = image(5)
    mono = frame[:, :, 0].copy()
    chat = f'{MEDIA_MARKER}\nWhat is it?'
    seen = llm.generate(chat, images=[to_handle(pool.publish_array(frame))],
                        **GREEDY).result(timeout=300)
    assert seen.ok and seen.token_ids == direct(engine, chat, [frame], raw=False).token_ids
    grey = llm.generate(RAW, images=[to_handle(pool.publish_array(mono))], raw_prompt=True,
                        **GREEDY).result(timeout=300)
    spread = np.repeat(mono[:, :, None], 3, axis=2)
    assert grey.ok and grey.token_ids == direct(engine, RAW, [spread]).token_ids


def test_a_session_remembers_an_image_handle_across_turns(node, engine, pool):
    """The frame is released after its turn: the next turn reads the session's stored rows."""
    llm = node.llm('/' + LLM)
    frame = image(8)
    look = f'{MEDIA_MARKER}\nWhat is it?'
    first = llm.generate(look, images=[to_handle(pool.publish_array(frame))],
                         session_id='seen', **GREEDY).result(timeout=300)
    assert first.ok, first
    second = llm.generate('And the color?', session_id='seen', top_logprobs=TOP,
                          **GREEDY).result(timeout=300)
    assert second.ok, second
    turns = [ChatMessage('user', look), ChatMessage('assistant', first.text),
             ChatMessage('user', 'And the color?')]
    expected = direct(engine, '', [frame], raw=False, messages=turns)
    assert second.token_ids == expected.token_ids and logprob_gap(second, expected) < 1e-3


def test_raw_prompt_without_images(node, engine):
    llm = node.llm('/' + LLM)
    raw = llm.generate('Hello the color', raw_prompt=True, **GREEDY).result(timeout=300)
    assert raw.ok and raw.token_ids == direct(engine, 'Hello the color', []).token_ids
    templated = llm.generate('Hello the color', **GREEDY).result(timeout=300)
    assert templated.ok and templated.prompt_tokens > raw.prompt_tokens
    refused = llm.generate('Hello', raw_prompt=True, system_prompt='Be brief.',
                           **GREEDY).result(timeout=300)
    assert refused.error_kind == INVALID and 'chat template' in refused.error_message


def test_stale_closed_and_foreign_handles_are_refused_and_the_node_keeps_serving(
        node, engine, pool, ipc_dir):
    llm = node.llm('/' + LLM)
    frame = image(7)
    stale = to_handle(pool.publish_array(frame))
    for _ in range(pool.slot_count):   # the ring comes round: that slot holds another frame
        pool.publish_array(image(1))
    outcome = llm.generate(RAW, images=[stale], raw_prompt=True, **GREEDY).result(timeout=300)
    assert outcome.error_kind == INVALID, outcome
    assert 'images[0]' in outcome.error_message and 'cannot be mapped' in outcome.error_message
    foreign = to_handle(pool.publish_array(frame))
    foreign.pool_id = f'{TAG}_nobody'
    outcome = llm.generate(RAW, images=[foreign], raw_prompt=True, **GREEDY).result(timeout=300)
    assert outcome.error_kind == INVALID and 'no producer serves pool' in outcome.error_message
    gone = TensorPool(PoolConfig(pool_id=f'{TAG}_gone', slot_nbytes=4096, slots=4,
                                 socket_dir=ipc_dir))
    closed = to_handle(gone.publish_array(frame))
    gone.close()
    outcome = llm.generate(RAW, images=[closed], raw_prompt=True, **GREEDY).result(timeout=300)
    assert outcome.error_kind == INVALID, outcome
    wrong = to_handle(pool.publish_array(np.zeros((8, 8, 4), np.uint8)))
    outcome = llm.generate(f'{MEDIA_MARKER} x', images=[wrong], raw_prompt=True,
                           **GREEDY).result(timeout=300)
    assert outcome.error_kind == INVALID and 'RGB [height, width, 3]' in outcome.error_message
    missing = llm.generate('no marker', images=[to_handle(pool.publish_array(frame))],
                           raw_prompt=True, **GREEDY).result(timeout=300)
    assert missing.error_kind == INVALID and MEDIA_MARKER in missing.error_message
    # After every refusal the next goal is served as before.
    fine = llm.generate(RAW, images=[to_handle(pool.publish_array(frame))], raw_prompt=True,
                        **GREEDY).result(timeout=300)
    assert fine.ok and fine.token_ids == direct(engine, RAW, [frame]).token_ids


def ask(ipc_dir, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `edge-llm ask` against the node; stdout comes as bytes.

    The random vocabulary's answers hold control characters that text mode would translate.
    """
    env = dict(os.environ, EDGE_LLM_IPC_DIR=ipc_dir, PYTHONIOENCODING='utf-8')
    return subprocess.run([sys.executable, '-m', 'edge_llm_ros.cli', 'ask', *args, '--server',
                           '/' + LLM, '--max-tokens', str(TOKENS), '--temperature', '0'],
                          capture_output=True, timeout=timeout, env=env)


def test_ask_sends_an_image_file(node, engine, ipc_dir, tmp_path):
    frame = image(11)
    path = tmp_path / 'frame.png'
    Image.fromarray(frame).save(path)
    proc = ask(ipc_dir, 'What is it?', '--image', str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = direct(engine, f'{MEDIA_MARKER}\nWhat is it?', [frame], raw=False)
    assert proc.stdout == (expected.text + '\n').encode()
    assert f'{expected.prompt_tokens} prompt tokens'.encode() in proc.stderr
    raw = ask(ipc_dir, RAW, '--raw', '--image', str(path))
    assert raw.returncode == 0, raw.stdout + raw.stderr
    assert raw.stdout == (direct(engine, RAW, [frame]).text + '\n').encode()
    bad = tmp_path / 'bad.png'
    bad.write_bytes(b'not a png')
    proc = ask(ipc_dir, 'x', '--image', str(bad), timeout=120)
    assert proc.returncode == 1 and b'bad.png' in proc.stderr, proc.stderr


@pytest.fixture(scope='module')
def bridge(node, ipc_dir):
    proc = AnyNodeProcess('openai_bridge', name=f'{TAG}_bridge', stop_timeout=30.0,
                          params={'port': 0, 'llm_node': '/' + LLM, 'model_id': 'vlm'},
                          env={'EDGE_LLM_IPC_DIR': ipc_dir})
    url = wait_serving(proc, timeout=60)
    yield url
    assert proc.stop() == 0, proc.log()
    assert 'Traceback' not in proc.log(), proc.log()


def data_url(pixels: np.ndarray) -> str:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format='PNG')
    return 'data:image/png;base64,' + base64.b64encode(out.getvalue()).decode()


def test_bridge_image_url_parts_and_raw_completions(bridge, engine):
    frame = image(13)
    parts = [{'type': 'text', 'text': 'What is it?'},
             {'type': 'image_url', 'image_url': {'url': data_url(frame)}}]
    content = f'What is it?\n{MEDIA_MARKER}'
    expected = direct(engine, '', [frame], raw=False,
                      messages=(ChatMessage('user', content),))
    with openai.OpenAI(base_url=bridge, api_key='unused', max_retries=0, timeout=120) as api:
        reply = api.chat.completions.create(model='vlm', messages=[
            {'role': 'user', 'content': parts}], max_tokens=TOKENS, temperature=0)
        assert reply.choices[0].message.content == expected.text
        assert reply.usage.prompt_tokens == expected.prompt_tokens
        completion = api.completions.create(model='vlm', prompt='Hello the color',
                                            max_tokens=TOKENS, temperature=0)
        assert completion.choices[0].text == direct(engine, 'Hello the color', []).text
        with pytest.raises(openai.BadRequestError, match='not fetched'):
            api.chat.completions.create(model='vlm', messages=[{'role': 'user', 'content': [
                {'type': 'image_url', 'image_url': {'url': 'https://example.com/a.png'}}]}])
        # Images the model cannot take (4 x 64 rows leave no room in 256 positions) are the
        # node's 400; the bridge keeps serving.
        with pytest.raises(openai.BadRequestError, match='images take'):
            api.chat.completions.create(model='vlm', max_tokens=TOKENS, messages=[
                {'role': 'user', 'content': [parts[1]] * 4}])
    llm = ChatOpenAI(model='vlm', base_url=bridge, api_key='unused', max_retries=0,
                     timeout=120, temperature=0, max_tokens=TOKENS)
    message = HumanMessage(content=parts)
    assert llm.invoke([message]).content == expected.text
