"""bench/bench_models.py's own logic: bytes per token, targets, ratios, pairing, failures.

Fast: tiny GGUFs written with the gguf package, no engine run and no llama.cpp build.
"""
import importlib
import pathlib
import sys

import gguf
import numpy as np
import onnx
from onnx import helper, numpy_helper, TensorProto
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'bench'))
# bench/ is a script folder, not a package.
bench_engine = importlib.import_module('bench_engine')
bench_models = importlib.import_module('bench_models')


def write_gguf(path: pathlib.Path, tied: bool, per_layer: bool = False) -> None:
    w = gguf.GGUFWriter(str(path), 'llama')
    w.add_block_count(1)
    w.add_tensor('token_embd.weight', np.zeros((8, 32), np.float32))      # 1024 bytes
    if per_layer:   # Gemma 4's per-layer table: 8 rows of 64 bytes, gathered
        w.add_tensor('per_layer_token_embd.weight', np.zeros((8, 32), np.float16))
    w.add_tensor('blk.0.attn_q.weight', np.zeros((32, 32), np.float16))    # 2048 bytes
    w.add_tensor('output_norm.weight', np.zeros(32, np.float32))           # 128 bytes
    if not tied:
        w.add_tensor('output.weight', np.zeros((8, 32), np.float32))       # 1024 bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_bytes_leave_out_the_gathered_embedding(tmp_path):
    write_gguf(tmp_path / 'untied.gguf', tied=False)
    got = bench_models.gguf_bytes_per_token(str(tmp_path / 'untied.gguf'))
    assert got == {'per_token': 2048 + 128 + 1024, 'total': 1024 + 2048 + 128 + 1024,
                   'tied_head': False, 'gathered_row_bytes': 128}


def test_gguf_bytes_count_a_tied_embedding_whole(tmp_path):
    write_gguf(tmp_path / 'tied.gguf', tied=True)
    got = bench_models.gguf_bytes_per_token(str(tmp_path / 'tied.gguf'))
    assert got == {'per_token': 1024 + 2048 + 128, 'total': 1024 + 2048 + 128,
                   'tied_head': True, 'gathered_row_bytes': 0}


def test_gguf_bytes_leave_out_a_per_layer_table(tmp_path):
    """Gemma 4's per-layer embeddings are gathered a row per token, tied head or not."""
    write_gguf(tmp_path / 'ple.gguf', tied=True, per_layer=True)
    got = bench_models.gguf_bytes_per_token(str(tmp_path / 'ple.gguf'))
    assert got == {'per_token': 1024 + 2048 + 128, 'total': 1024 + 512 + 2048 + 128,
                   'tied_head': True, 'gathered_row_bytes': 64}


def test_targets_speed_at_least_bytes_and_kl_at_most():
    met = bench_models.targets_met({'decode_vs_llama_cpp': 1.3, 'prefill_vs_llama_cpp': 1.49,
                                    'bytes_vs_llama_cpp': 1.2, 'max_kl': 0.005})
    assert met == {'decode_vs_llama_cpp': True, 'prefill_vs_llama_cpp': False,
                   'bytes_vs_llama_cpp': False, 'max_kl': True}
    # What was not measured is not reported as met or missed.
    assert bench_models.targets_met({'decode_vs_llama_cpp': 2.0, 'max_kl': None}) == {
        'decode_vs_llama_cpp': True}


def test_ratios_of_medians_and_of_pairs():
    ours = [{'prefill_tok_s': 100.0, 'decode_tok_s': 10.0},
            {'prefill_tok_s': 300.0, 'decode_tok_s': 30.0}]
    peer = [{'prefill_tok_s': 50.0, 'decode_tok_s': 10.0},
            {'prefill_tok_s': 300.0, 'decode_tok_s': 10.0}]
    got = bench_models.ratios(ours, peer)
    assert got['prefill_vs_llama_cpp'] == pytest.approx(200.0 / 175.0)
    assert got['prefill_vs_llama_cpp_paired'] == pytest.approx((2.0 + 1.0) / 2)
    assert got['decode_vs_llama_cpp'] == pytest.approx(2.0)
    assert got['decode_vs_llama_cpp_paired'] == pytest.approx(2.0)


def test_cpu_rates_count_the_process_cpu_seconds():
    # 64 prompt ids in 2 CPU seconds, then 15 steps in 3: the rates a loaded machine keeps.
    assert bench_models.cpu_rates(64, 15, 10.0, 12.0, 15.0) == {
        'prefill_cpu_tok_s': pytest.approx(32.0), 'decode_cpu_tok_s': pytest.approx(5.0)}


def test_resolve_pairs_models_with_ggufs(tmp_path):
    model = tmp_path / 'm'
    model.mkdir()
    src = tmp_path / 'src.gguf'
    write_gguf(src, tied=True)
    (model / 'model.yaml').write_text(f'source:\n  path: {src}\n')
    assert bench_models.resolve([str(model)], []) == [(str(model), str(src))]
    assert bench_models.resolve([str(model)], ['other.gguf']) == [(str(model), 'other.gguf')]
    with pytest.raises(SystemExit, match='2 --gguf for 1 --model'):
        bench_models.resolve([str(model)], ['a.gguf', 'b.gguf'])
    (model / 'model.yaml').write_text('source:\n  path: gone.gguf\n')
    with pytest.raises(SystemExit, match='no GGUF for'):
        bench_models.resolve([str(model)], [])


def test_a_peer_that_dies_fails_the_row(tmp_path):
    # This interpreter has no llama_cpp: the peer process exits with an ImportError.
    config = bench_models.RowConfig(new_tokens=2, kl_steps=1)
    with pytest.raises(bench_models.PeerFailed, match='llama_cpp'):
        bench_models.run_peer(sys.executable, str(tmp_path / 'x.gguf'), [1, 2, 3], config)


def test_table_names_the_missed_targets():
    row = {'model': 'm', 'architecture': 'qwen3', 'max_kl': 1e-3,
           'ours': {'prefill_tok_s_median': 30.0, 'decode_tok_s_median': 5.0, 'rss_mb': 900},
           'llama_cpp': {'prefill_tok_s_median': 10.0, 'decode_tok_s_median': 5.0,
                         'rss_mb': 800},
           'ratios': {'prefill_vs_llama_cpp': 3.0, 'decode_vs_llama_cpp': 1.0,
                      'bytes_vs_llama_cpp': 1.05},
           'bytes_per_token': {'ours': 105e6, 'llama_cpp': 100e6},
           'targets_met': {'decode_vs_llama_cpp': False, 'prefill_vs_llama_cpp': True},
           'loadavg': {'start': [2.5, 2, 2]}}
    line = bench_models.table([row]).splitlines()[-1]
    assert '| 30.0 / 10.0 (3.00) | 5.0 / 5.0 (1.00) | 105 / 100 (1.05) |' in line
    assert '| decode_vs_llama_cpp |' in line


def test_onnx_bytes_follow_a_reshaped_gathered_table(tmp_path):
    def graph(tied: bool):
        inits = [numpy_helper.from_array(np.zeros((16, 4), np.float32), 'emb'),  # 256 bytes
                 numpy_helper.from_array(np.array([-1, 4], np.int64), 'shape'),
                 numpy_helper.from_array(np.zeros((4, 4), np.float32), 'w')]     # 64 bytes
        nodes = [helper.make_node('Reshape', ['emb', 'shape'], ['emb_view']),
                 helper.make_node('Gather', ['emb_view', 'ids'], ['x']),
                 helper.make_node('MatMul', ['x', 'w'], ['h']),
                 helper.make_node('MatMul', ['h', 'emb_t' if tied else 'w'], ['y'])]
        if tied:
            nodes.insert(0, helper.make_node('Transpose', ['emb_view'], ['emb_t']))
        g = helper.make_graph(nodes, 'g', [helper.make_tensor_value_info(
            'ids', TensorProto.INT64, [1])], [helper.make_tensor_value_info(
                'y', TensorProto.FLOAT, None)], inits)
        path = tmp_path / f'tied{tied}.onnx'
        onnx.save(helper.make_model(g), str(path))
        return bench_engine.weight_bytes_per_token(str(path))

    untied = graph(tied=False)
    assert (untied['per_token'], untied['gather_only']) == (64, 256)
    tied = graph(tied=True)  # a table that is also the head is read whole
    assert (tied['per_token'], tied['gather_only']) == (64 + 256, 0)
