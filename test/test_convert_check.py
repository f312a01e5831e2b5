"""`edge-llm-convert --check`: how a source would convert and what would be refused, unwritten.

The check runs the converter's own refusals (load_checkpoint, then converter.preflight), so a
file it passes converts and a file it refuses is refused by `convert` with the same message.
"""
from gguf_fixtures import ParityCase, write_gguf
import numpy as np
import pytest

from edge_llm_ros.convert.check import _unreadable, check_source
from edge_llm_ros.convert.checkpoint import SourceTensor
from edge_llm_ros.convert.converter import convert, ConvertOptions, main
from edge_llm_ros.errors import EngineError


@pytest.fixture(scope='module')
def q4k_file(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp('check') / 'q4k.gguf', ParityCase('qwen2', 'Q4_K'))


def test_a_convertible_file_says_how_each_type_is_stored(q4k_file, native_library, tmp_path):
    report = check_source(str(q4k_file))
    assert report.ok and report.architecture == 'qwen2'
    # 2 layers x 7 matrices in Q4_K; the fixture keeps embedding and head in Q8_0.
    assert [(g.qtype, g.count, g.storage) for g in report.groups] == [
        ('Q4_K', 14, 'kept in its GGUF blocks (op library)'),
        ('Q8_0', 2, 'kept in its GGUF blocks (op library)')]
    assert list(tmp_path.iterdir()) == []     # nothing written anywhere it was pointed
    assert 'will convert' in report.render()
    convert(str(q4k_file), str(tmp_path / 'out'), progress=False)   # and it does


def test_matmulnbits_storage_names_exact_repacks_and_lossy_requantization(q4k_file):
    exact = check_source(str(q4k_file), options=ConvertOptions(weights='matmulnbits'))
    assert [g.storage for g in exact.groups] == ['repacked exactly at 4 bits (MatMulNBits)',
                                                 'repacked exactly at 8 bits (MatMulNBits)']
    lossy = check_source(str(q4k_file), options=ConvertOptions(weights='matmulnbits',
                                                               block_size=64))
    assert [g.storage for g in lossy.groups] == [
        'dequantized and requantized to 4 bits (lossy) (MatMulNBits)',
        'dequantized and requantized to 8 bits (lossy) (MatMulNBits)']


def test_a_refused_option_is_listed_with_the_converters_own_message(q4k_file, tmp_path):
    opts = ConvertOptions(block_size=24)
    report = check_source(str(q4k_file), options=opts)
    assert not report.ok and report.groups       # the tensors are still described
    with pytest.raises(EngineError) as refused:
        convert(str(q4k_file), str(tmp_path / 'out'), block_size=24, progress=False)
    assert report.refusals == [str(refused.value)]
    assert 'would refuse' in report.render() and 'block size 24' in report.render()


def test_an_unsupported_architecture_is_refused_before_anything_else(tmp_path, capsys):
    path = _gpt2(tmp_path)
    assert main([str(path), '--check']) == 1
    out = capsys.readouterr().out
    assert "architecture 'gpt2' is not supported" in out and 'would refuse' in out
    assert list(tmp_path.iterdir()) == [path]


def test_the_cli_checks_without_an_output_folder_and_needs_one_otherwise(q4k_file, capsys):
    assert main([str(q4k_file), '--check', '--weights', 'matmulnbits']) == 0
    assert 'Q4_K: 14 -> repacked exactly at 4 bits' in capsys.readouterr().out
    with pytest.raises(SystemExit) as usage:
        main([str(q4k_file)])
    assert usage.value.code == 2
    assert 'out_dir' in capsys.readouterr().err


def test_a_type_gguf_cannot_read_is_named():
    # Q8_K is llama.cpp's activation type: no file stores weights in it, and gguf-py cannot
    # dequantize it, so a matrix of it would stop the conversion half-way.
    raw = np.zeros((1, 292), np.uint8)
    why = _unreadable(SourceTensor('w', 'Q8_K', (1, 256), raw))
    assert why.startswith('NotImplementedError') and 'Q8_K' in why
    assert _unreadable(SourceTensor('w', 'F32', (1, 4), np.zeros((1, 4), np.float32))) == ''


def _gpt2(tmp_path):
    import gguf
    path = tmp_path / 'gpt2.gguf'
    w = gguf.GGUFWriter(str(path), 'gpt2')
    w.add_block_count(1)
    w.add_tensor('token_embd.weight', np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
