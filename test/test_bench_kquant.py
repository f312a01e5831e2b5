"""bench/bench_kquant.py's own logic: bytes accounting, targets, figures, table, conversions.

Fast and untimed: tiny GGUFs converted both ways (the op library is built once), synthetic
rows for the ratios and the table. No llama.cpp, no node, no speed asserted.
"""
import importlib
import json
import pathlib
import sys

from gguf_fixtures import ParityCase, write_gguf
import pytest
import yaml

from edge_llm_ros.convert.converter import convert, source_sha256
from edge_llm_ros.model_format import CONVERTER_VERSION

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'bench'))
# bench/ is a script folder, not a package.
bench_kquant = importlib.import_module('bench_kquant')
make_random_gguf = importlib.import_module('make_random_gguf')


@pytest.fixture(scope='module', params=[False, True], ids=['untied', 'tied'])
def converted_pair(request, native_library, tmp_path_factory):
    tmp = tmp_path_factory.mktemp('bench_kquant')
    src = write_gguf(tmp / 'q4k.gguf', ParityCase('llama', 'Q4_K', tied=request.param))
    kq = convert(str(src), str(tmp / 'kquant'), weights='kquant', progress=False)
    mnb = convert(str(src), str(tmp / 'matmulnbits'), weights='matmulnbits', progress=False)
    return src, kq, mnb, request.param


def test_kquant_bytes_per_token_are_the_gguf_tensors(converted_pair):
    src, kq, mnb, tied = converted_pair
    got = bench_kquant.bytes_summary(str(kq), str(mnb), str(src))
    assert got['tied_head'] is tied
    # The kernels read exactly the GGUF's matrices (a tied table whole, else not at all) ...
    assert got['kquant_gguf_blocks'] == got['gguf_matrices'] == got['converter_reported']
    assert got['kernel_vs_gguf_matrices'] == 1.0
    # ... and the step's other initializers are the norms llama.cpp reads too (the rotary
    # caches are read a row per position, not whole).
    assert got['kquant_vs_gguf'] == pytest.approx(1.0, abs=0.005)
    assert bench_kquant.mark_targets({'bytes_vs_gguf': got['kquant_vs_gguf']}) == {
        'bytes_vs_gguf': True}
    # MatMulNBits holds Q4_K as 4-bit codes + float scales: more bytes, no GGUF blocks.
    assert got['matmulnbits'] > got['gguf']
    assert bench_kquant.bench_models.onnx_bytes_per_token(str(mnb))['gguf_blocks'] == 0


def test_gguf_matrix_bytes_count_the_table_only_when_it_is_the_head(converted_pair):
    src, _, _, tied = converted_pair
    import gguf
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(src)).tensors
             if len(t.shape) == 2}
    expected = sum(sizes.values()) - (0 if tied else sizes['token_embd.weight'])
    assert bench_kquant.gguf_matrix_bytes(str(src)) == expected


def test_targets_at_least_at_most_and_within():
    met = bench_kquant.mark_targets({
        'decode_vs_llama_cpp': 1.3, 'bandwidth_fraction': 0.84, 'prefill_vs_llama_cpp': 1.0,
        'bytes_vs_gguf': 0.969, 'node_rss_vs_llama_cpp': 1.05, 'convert_rss_vs_gguf': 1.31})
    assert met == {'decode_vs_llama_cpp': True, 'bandwidth_fraction': False,
                   'prefill_vs_llama_cpp': True, 'bytes_vs_gguf': False,
                   'node_rss_vs_llama_cpp': True, 'convert_rss_vs_gguf': False}
    assert bench_kquant.mark_targets({'bytes_vs_gguf': 1.03})['bytes_vs_gguf'] is True
    # What was not measured (no bandwidth tool) is neither met nor missed.
    assert bench_kquant.mark_targets({'bandwidth_fraction': None}) == {}


def _row(decode, prefill, llama_decode, llama_prefill, rss=300.0, kl=1e-3):
    return {'model': 'm', 'architecture': 'qwen2', 'gguf': 'x.gguf', 'gguf_bytes': 10 ** 9,
            'kernel': 'kquant (avx2)', 'max_kl': kl, 'greedy_prefix_equal': 4,
            'ours': {'decode_tok_s': decode, 'prefill_tok_s': prefill, 'rss_mb': rss},
            'llama_cpp': {'decode_tok_s': llama_decode, 'prefill_tok_s': llama_prefill,
                          'rss_mb': 400.0},
            'loadavg': {'start': [2.0, 2.0, 2.0]}}


def _measured(node=True):
    llama = ([10.0, 20.0], [100.0, 100.0])
    return {'rows': {'kquant': _row([15.0, 26.0], [90.0, 110.0], *llama),
                     'matmulnbits': _row([10.0, 13.0], [150.0, 150.0], *llama, rss=500.0)},
            'node': {'node_rss_mb': 420.0, 'llama_cpp_rss_mb': 400.0,
                     'ratios': {'decode_vs_llama_cpp': 1.2, 'prefill_vs_llama_cpp': 0.9}}
            if node else None,
            'node_error': None if node else 'llm_node on m exited with 1'}


BYTES = {'gguf': 1.0e9, 'kquant': 1.01e9, 'matmulnbits': 1.4e9, 'kquant_vs_gguf': 1.01,
         'gguf_matrices': 0.99e9, 'kquant_gguf_blocks': 0.99e9}
CONVERSIONS = {'kquant': {'rss_over_gguf': 0.5, 'gguf_bytes': 10 ** 9,
                          'peak_rss_bytes': 5 * 10 ** 8},
               'matmulnbits': {'rss_over_gguf': 0.7}}


def test_summary_ratios_bandwidth_and_rss():
    s = bench_kquant.summarize('qwen2-1.5b', _measured(), BYTES, 25.0, CONVERSIONS)
    x = s['ratios']
    # medians: kquant decode 20.5, matmulnbits 11.5, llama.cpp 15; paired 1.5 and 1.3 -> 1.4
    assert x['decode_vs_llama_cpp'] == pytest.approx(20.5 / 15.0)
    assert x['decode_vs_llama_cpp_paired'] == pytest.approx(1.4)
    assert x['decode_vs_matmulnbits'] == pytest.approx(20.5 / 11.5)
    assert x['prefill_vs_llama_cpp'] == pytest.approx(1.0)
    assert x['prefill_vs_matmulnbits'] == pytest.approx(100.0 / 150.0)
    bw = s['bandwidth']
    assert bw['achieved_gb_s']['kquant'] == pytest.approx(1.01 * 20.5)
    assert bw['achieved_gb_s']['llama_cpp'] == pytest.approx(1.0 * 15.0)
    assert x['bandwidth_fraction'] == pytest.approx(1.01 * 20.5 / 25.0)
    assert s['rss']['kind'].startswith('llm_node') and x['node_rss_vs_llama_cpp'] == 1.05
    assert s['targets_met'] == {'decode_vs_llama_cpp': True, 'bandwidth_fraction': False,
                                'prefill_vs_llama_cpp': True, 'bytes_vs_gguf': True,
                                'node_rss_vs_llama_cpp': True}


def test_summary_without_node_or_bandwidth_says_so():
    s = bench_kquant.summarize('qwen2-1.5b', _measured(node=False), BYTES, None, CONVERSIONS)
    assert s['rss']['kind'].startswith('decoder growth')
    assert s['rss']['node_error'] and s['ratios']['node_rss_vs_llama_cpp'] == 300.0 / 400.0
    assert s['bandwidth']['fraction'] is None
    assert 'bandwidth_fraction' not in s['targets_met']


def test_table_marks_every_target_and_says_what_was_not_measured():
    small = _measured(node=False)
    small['rows']['kquant']['gguf_bytes'] = 10 ** 8
    shapes = [bench_kquant.summarize('qwen2-1.5b', _measured(), BYTES, None, CONVERSIONS),
              bench_kquant.summarize('smollm2', small, {**BYTES, 'kquant_vs_gguf': 1.2}, None,
                                     {**CONVERSIONS, 'kquant': {
                                         'rss_over_gguf': 2.0, 'gguf_bytes': 10 ** 8,
                                         'peak_rss_bytes': 2 * 10 ** 8}})]
    shapes.reverse()  # the largest is found, not taken first
    result = {'config': {'threads': 2}, 'shapes': shapes,
              'bandwidth': [{'status': 'not built', 'binary': 'build/native/bandwidth'}],
              'conversion': bench_kquant.judge_conversion(shapes)}
    lines = bench_kquant.table(result).splitlines()
    smol, qwen = lines[2], lines[3]
    assert qwen.startswith('| qwen2-1.5b | 20.5 / 11.5 / 15.0 | 1.37× met | 1.78× |')
    assert '| 1.00× met |' in qwen                      # prefill
    assert '1010.0 / 1000.0 = 1.010× met' in qwen
    assert 'triad not measured' in qwen
    assert '420 / 400 = 1.05× met' in qwen
    assert smol.startswith('| smollm2 (real) |')
    assert '= 1.200× **missed**' in smol and '300 / 400 (decoder) = 0.75× met' in smol
    text = '\n'.join(lines)
    assert 'Streaming bandwidth: not built (build/native/bandwidth)' in text
    # judged on the largest GGUF of the run: qwen2-1.5b's 1 GB, not smollm2's 0.1 GB
    assert 'Conversion peak RSS, qwen2-1.5b (largest shape run): 0.50 GB for a 1.00 GB ' \
        'GGUF = 0.50× (≤ 1.3×) met; matmulnbits 0.70×.' in text


def test_table_with_a_measured_triad():
    shapes = [bench_kquant.summarize('llama3-1b', _measured(), BYTES, 30.0, CONVERSIONS)]
    bw = [{'status': 'measured', 'triad_gb_s': 28.0, 'read_gb_s': 31.0},
          {'status': 'measured', 'triad_gb_s': 30.0, 'read_gb_s': 33.0}]
    text = bench_kquant.table({'config': {'threads': 2}, 'shapes': shapes, 'bandwidth': bw})
    assert '| 20.7, 69% **missed** |' in text
    assert 'triad 30.0 GB/s (read-only 33.0 GB/s), best of 2 runs' in text


def test_bandwidth_tool_absent_or_present(tmp_path):
    got = bench_kquant.stream_bandwidth(2, tmp_path / 'bandwidth')
    assert got['status'] == 'not built' and 'triad_gb_s' not in got
    assert bench_kquant.best_bandwidth([got]) is None
    tool = tmp_path / 'fake_bandwidth'
    tool.write_text('#!/bin/sh\necho "{\\"threads\\": $1, \\"mb_per_array\\": $2, '
                    '\\"read_gb_s\\": 20.5, \\"triad_gb_s\\": 18.25}"\n')
    tool.chmod(0o755)
    got = bench_kquant.stream_bandwidth(3, tool, mb=64)
    assert got['status'] == 'measured' and (got['threads'], got['mb_per_array']) == (3, 64)
    assert bench_kquant.best_bandwidth([got, {'status': 'not built'}]) == 18.25


def test_a_cached_conversion_is_reused_only_while_current(tmp_path):
    gguf = tmp_path / 'm.gguf'
    gguf.write_bytes(b'GGUF' + bytes(60))
    ident = bench_kquant.gguf_identity(gguf, cache=tmp_path / 'cache')
    assert ident['sha256'] == source_sha256(gguf) and ident['bytes'] == 64
    memo = json.loads((tmp_path / 'cache' / 'sha256.json').read_text())
    assert memo[str(gguf)]['sha256'] == ident['sha256']
    folder = tmp_path / 'm-kquant'
    assert not bench_kquant.conversion_current(folder, ident, 'kquant')
    folder.mkdir()
    meta = {'converter_version': CONVERTER_VERSION, 'source': {'sha256': ident['sha256']},
            'quantization': {'weights': 'kquant'}}
    (folder / 'model.yaml').write_text(yaml.safe_dump(meta))
    assert bench_kquant.conversion_current(folder, ident, 'kquant')
    assert not bench_kquant.conversion_current(folder, ident, 'matmulnbits')
    assert not bench_kquant.conversion_current(folder, {**ident, 'sha256': '0' * 64}, 'kquant')
    (folder / 'model.yaml').write_text(yaml.safe_dump({**meta, 'converter_version': '0'}))
    assert not bench_kquant.conversion_current(folder, ident, 'kquant')


def test_random_gguf_mix_falls_back_like_llama_quantize():
    def types(name):
        return {n: t for n, sh, t in make_random_gguf.gguf_plan(make_random_gguf.SHAPES[name])
                if len(sh) == 2}

    # 896 = 3.5 x 256: Q4_K -> Q5_0 and Q6_K -> Q8_0 where the row is 896 wide; ffn_down's
    # 4864-wide rows (19 x 256) keep their K types.
    small = types('qwen2-0.5b')
    assert small['token_embd.weight'] == 'Q8_0' and small['blk.0.attn_q.weight'] == 'Q5_0'
    assert small['blk.0.attn_v.weight'] == 'Q8_0' and small['blk.3.attn_v.weight'] == 'Q5_0'
    assert small['blk.0.ffn_down.weight'] == 'Q6_K' and small['blk.3.ffn_down.weight'] == 'Q4_K'
    # 1536 = 6 x 256: no fallback at all.
    assert set(types('qwen2-1.5b').values()) == {'Q4_K', 'Q6_K'}
    assert make_random_gguf.SHAPES['qwen2-1.5b'].tied
    # Q4_K_M gives phi3's fused attn_qkv Q5_K in every layer.
    assert {t for n, t in types('phi4-mini').items() if 'attn_qkv' in n} == {'Q5_K'}
    assert make_random_gguf.fallback_type('Q5_K', 896) == 'Q5_1'
    assert make_random_gguf.fallback_type('Q6_K', 272) == 'F16'   # not even 32-wide blocks
    assert make_random_gguf.fallback_type('Q4_K', 2048) == 'Q4_K'


def test_the_qwen35_shape_is_a_file_the_converter_reads(tmp_path, monkeypatch):
    """Qwen3.5-2B's layers (4 of them, a small vocabulary): llama.cpp's qwen35 layout."""
    from edge_llm_ros.convert.checkpoint import load_checkpoint
    shape = make_random_gguf.SHAPES['qwen35-2b']
    monkeypatch.setitem(make_random_gguf.SHAPES, 'qwen35-small',
                        make_random_gguf.Shape(**{**shape.__dict__, 'vocab': 512}))
    path = make_random_gguf.write_random_gguf(tmp_path / 'q35.gguf', 'qwen35-small', layers=4)
    spec = load_checkpoint(str(path)).spec
    assert spec.layer_kinds == ('recurrent',) * 3 + ('attention',)
    assert (spec.ssm_k_heads, spec.ssm_v_heads, spec.ssm_head_dim, spec.conv_kernel) == \
        (16, 16, 128, 4)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rotary_dims) == \
        (8, 2, 256, 64)
    types = {n: t for n, sh, t in make_random_gguf.gguf_plan(make_random_gguf.SHAPES[
        'qwen35-small']) if len(sh) == 2}
    assert types['blk.0.attn_qkv.weight'] == 'Q5_K' and types['blk.0.ssm_conv1d.weight'] == 'F32'


def test_the_gemma4_e2b_shape_is_a_file_the_converter_reads(tmp_path, monkeypatch):
    """Gemma 4 E2B's layers (7 of them, a small vocabulary): llama.cpp's gemma4 layout."""
    from edge_llm_ros.convert.checkpoint import load_checkpoint
    shape = make_random_gguf.SHAPES['gemma4-e2b']
    monkeypatch.setitem(make_random_gguf.SHAPES, 'gemma4-small',
                        make_random_gguf.Shape(**{**shape.__dict__, 'vocab': 512, 'layers': 7}))
    path = make_random_gguf.write_random_gguf(tmp_path / 'g4.gguf', 'gemma4-small')
    spec = load_checkpoint(str(path)).spec
    # 4 sliding-window layers and a global one keep KV; the last two read layers 3 and 4.
    assert spec.local_layers == (True,) * 4 + (False,) + (True,) * 2
    assert spec.kv_shared_from == 5 and spec.layer_intermediate == (6144,) * 5 + (12288,) * 2
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.local_head_dim) == \
        (8, 1, 512, 256)
    assert (spec.per_layer_embed, spec.final_logit_softcap) == (256, 30.0)
    assert sum(f == 1.0 for f in spec.rope_freq_factors) == 64   # a quarter of 256 pairs
    plan = make_random_gguf.gguf_plan(make_random_gguf.SHAPES['gemma4-small'])
    types = {n: t for n, sh, t in plan}
    assert types['per_layer_token_embd.weight'] == 'Q6_K'   # a tied token embedding's type
    assert types['per_layer_model_proj.weight'] == 'F16'    # never quantized
    assert 'blk.5.attn_k.weight' not in types and 'blk.4.attn_v.weight' in types
    # The full shape: 35 layers, 15 owners, per-layer table [262144, 35 x 256].
    assert make_random_gguf.gemma4_layout(shape)[1] == 15
    assert {n: sh for n, sh, _ in make_random_gguf.gguf_plan(shape)}[
        'per_layer_token_embd.weight'] == (262144, 8960)


def test_the_gemma4_e4b_shape_has_its_own_layout():
    """E4B: 42 layers, each 6th global, 24 KV owners, two KV heads, single-width MLPs."""
    shape = make_random_gguf.SHAPES['gemma4-e4b']
    pattern, owners = make_random_gguf.gemma4_layout(shape)
    assert [i for i, local in enumerate(pattern) if not local] == [5, 11, 17, 23, 29, 35, 41]
    assert owners == 24 and not pattern[owners - 1] and pattern[owners - 2]
    plan = {n: sh for n, sh, _ in make_random_gguf.gguf_plan(shape)}
    assert plan['blk.41.ffn_up.weight'] == (10240, 2560) == plan['blk.0.ffn_up.weight']
    assert plan['blk.23.attn_k.weight'] == (2 * 512, 2560) and 'blk.24.attn_k.weight' not in plan
    assert plan['blk.0.attn_q.weight'] == (8 * 256, 2560)
    assert plan['per_layer_token_embd.weight'] == (262144, 42 * 256)
