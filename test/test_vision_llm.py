"""Camera to language model: perception's embedding handle goes into a Generate goal.

frame_source -> perception (stand-in sized from the LLM folder's model.yaml) -> the test
takes an embeddings handle -> llm_node maps perception's buffer and feeds it through
inputs_embeds. All processes find the pool sockets through EDGE_LLM_IPC_DIR.
"""
import os

from llm_node_harness import NodeProcess, RosClient
import numpy as np
import pytest
import rclpy
from tiny_model import tiny_model_dir, TinyDims
from vision_support import NodeProc

from edge_llm_ros.ipc.pool import PoolConfig, TensorPool
from edge_llm_ros.nodes.handles import to_handle
from edge_llm_ros.nodes.tensor_input import TensorInput
from edge_llm_ros.nodes.tensor_output import CopyKind

TAG = f'l{os.getpid()}'
LLM = f'{TAG}_llm'
N_PATCHES = 16          # image_size 64 / patch_size 16 -> 4 x 4 patches
GREEDY = {'max_tokens': 4, 'temperature': 0.0}


@pytest.fixture(scope='module')
def ipc_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp('vision_llm') / 'sockets')


@pytest.fixture(scope='module')
def nodes(tmp_path_factory, ipc_dir):
    model = tiny_model_dir(tmp_path_factory.mktemp('vision_llm_model'))
    env = {'EDGE_LLM_IPC_DIR': ipc_dir}
    procs = [
        NodeProc('frame_source', f'{TAG}_frames', {'width': 64, 'height': 48, 'rate_hz': 10.0,
                                                   'pool.id': f'{TAG}_frames'}, env),
        NodeProc('perception', f'{TAG}_perception', {
            'input.topic': f'/{TAG}_frames/frames', 'pool.id': f'{TAG}_emb',
            'model.llm_path': str(model), 'model.image_size': 64, 'model.patch_size': 16},
            env),
    ]
    llm = NodeProcess(LLM, {'autostart': True, 'model.path': str(model), 'kv.max_context': 256},
                      env=env)
    try:
        procs[1].wait_log('embeddings pool', 60)
        yield procs
    finally:
        codes = [p.stop() for p in procs] + [llm.stop()]
        assert codes == [0, 0, 0], '\n'.join([p.log() for p in procs] + [llm.log()])


def test_perception_handle_feeds_the_llm_through_inputs_embeds(nodes, ipc_dir):
    rclpy.init()
    client = RosClient(f'{TAG}_client')
    embeddings = TensorInput(client.node, f'/{TAG}_perception/embeddings', CopyKind.TENSOR,
                             socket_dir=ipc_dir)
    try:
        client.wait_state('/' + LLM, 'active', timeout=90)
        llm = client.llm('/' + LLM)
        sample = None
        for _ in range(300):
            sample = embeddings.take(0.2)
            if sample is not None:
                break
        assert sample is not None and sample.zero_copy, embeddings.stats
        with sample:   # held: perception cannot rewrite this buffer while the goals run
            assert sample.array.shape == (N_PATCHES, TinyDims().hidden)  # from model.yaml
            handle = to_handle(sample.descriptor, sample.header)
            plain = llm.generate('Hello sky', **GREEDY).result(timeout=120)
            seen = llm.generate('Hello sky', prefix_embeddings=[handle],
                                **GREEDY).result(timeout=120)
            assert plain.ok and seen.ok, (plain, seen)
            assert seen.prompt_tokens == plain.prompt_tokens + N_PATCHES
            # The same values from a pool of our own give the same greedy tokens: the node
            # fed exactly perception's embeddings (mapped, not re-derived).
            copy = np.array(sample.array)
            config = PoolConfig(pool_id=f'{TAG}_copy', slot_nbytes=copy.nbytes, slots=4,
                                socket_dir=ipc_dir)
            with TensorPool(config) as pool:
                own = to_handle(pool.publish_array(copy))
                again = llm.generate('Hello sky', prefix_embeddings=[own],
                                     **GREEDY).result(timeout=120)
                other = to_handle(pool.publish_array(
                    (copy * -3.0 + 0.05).astype(np.float32)))
                changed = llm.generate('Hello sky', prefix_embeddings=[other],
                                       **GREEDY).result(timeout=120)
            assert again.ok and again.token_ids == seen.token_ids
            assert changed.ok and changed.prompt_tokens == seen.prompt_tokens
    finally:
        embeddings.close()
        client.close()
        rclpy.try_shutdown()
