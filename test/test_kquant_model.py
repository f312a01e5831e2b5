"""Model folders with weights='kquant': GGUF blocks in the graph, the op library at load.

The converter keeps every matrix of a type the op holds in its GGUF bytes (the bytes read per
token equal the GGUF tensors'), records the op domain in model.yaml, and the runtime loads
the library for it: without the library that is a typed error naming how to build it, never
a fallback. Every kernel path gives the same logits bit for bit (the library's kernels share
one float expression), so a pinned kernel changes speed only; a pin this CPU lacks is an
error naming its features. Greedy parity with llama.cpp per family and type is in
test_llama_cpp_parity.py (test_kquant_weights_match_llama_cpp).
"""
import pathlib
import platform

import gguf
from gguf_fixtures import ParityCase, write_gguf
import numpy as np
import onnx
import pytest
import yaml

from edge_llm_ros.convert.converter import convert
from edge_llm_ros.errors import ConversionError
from edge_llm_ros.model_format import load_model_info
from edge_llm_ros.runtime import native_ops
from edge_llm_ros.runtime.decoder import OnnxDecoder, SessionConfig
from edge_llm_ros.runtime.rows import decode_row, Row

PROMPT = np.array([3, 17, 42, 9, 100, 7], dtype=np.int64)


@pytest.fixture(scope='module')
def q4k_gguf(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp('kquant') / 'llama-q4k.gguf'
    write_gguf(path, ParityCase('llama', 'Q4_K'))
    return path


@pytest.fixture(scope='module')
def q4k_model(native_library, q4k_gguf) -> pathlib.Path:
    return convert(str(q4k_gguf), str(q4k_gguf.with_suffix('')), progress=False)


def logits(model: pathlib.Path, kernel: str = 'auto', steps: int = 4) -> np.ndarray:
    dec = OnnxDecoder(str(model), load_model_info(str(model)),
                      SessionConfig(intra_op_threads=2, max_context=64, kernel=kernel))
    rows = [dec.run([Row(0, 0, PROMPT)])[0].copy()]
    for i in range(steps):
        rows.append(dec.run([decode_row(0, int(rows[-1].argmax()), len(PROMPT) + i)])[0].copy())
    return np.stack(rows)


def test_default_conversion_keeps_gguf_blocks(q4k_model, q4k_gguf):
    meta = yaml.safe_load((q4k_model / 'model.yaml').read_text())
    quant = meta['quantization']
    assert quant['weights'] == 'kquant' and meta['op_domains'] == ['edge_llm_ros']
    graph = onnx.load(str(q4k_model / 'model.onnx'), load_external_data=False)
    ops = [n.op_type for n in graph.graph.node]
    assert 'MatMulNBits' not in ops and 'GatherBlockQuantized' not in ops
    layers = meta['num_layers']
    # fused q|k|v, o, fused gate|up, down per layer, and the head; the table is gathered
    assert quant['ops'] == {'KQuantGather': 1, 'KQuantMatMul': 4 * layers + 1}
    # Each gate|up op applies the MLP's activation itself: no Split/Sigmoid/Mul after it.
    gated = [n for n in graph.graph.node if n.name.endswith('.mlp.gate_up_proj')]
    assert len(gated) == layers
    for node in gated:
        assert {a.name: a.s for a in node.attribute if a.name == 'glu'} == {'glu': b'silu'}
    assert not {'Split', 'Sigmoid', 'Gelu'} & set(ops)
    # Bytes per token: exactly the GGUF matrices' bytes (the table is read a row per token).
    reader = gguf.GGUFReader(str(q4k_gguf))
    matrices = [t for t in reader.tensors if len(t.shape) == 2 and 'token_embd' not in t.name]
    assert quant['weight_bytes_per_token'] == sum(int(t.n_bytes) for t in matrices)


def test_a_qwen3_layer_is_its_matmuls_norms_and_one_attention_op(native_library, tmp_path):
    """qwen3's per-head q/k norms run inside CausalAttention, the SiLU inside gate|up."""
    path = tmp_path / 'qwen3-q4k.gguf'
    write_gguf(path, ParityCase('qwen3', 'Q4_K'))
    model = convert(str(path), str(tmp_path / 'qwen3'), progress=False)
    graph = onnx.load(str(model / 'model.onnx'), load_external_data=False).graph
    layers = yaml.safe_load((model / 'model.yaml').read_text())['num_layers']
    attention = [n for n in graph.node if n.op_type == 'CausalAttention']
    assert len(attention) == layers
    for node in attention:
        attrs = {a.name for a in node.attribute}
        assert {'q_norm', 'k_norm', 'norm_epsilon'} <= attrs
    ops = {n.op_type for n in graph.node}
    assert not {'Split', 'Sigmoid'} & ops
    # Two Reshapes place the embeddings among the packed tokens (varlen); none per layer.
    assert [n.op_type for n in graph.node].count('Reshape') == 2
    # The layer-norm ops left are the per-layer attn/ffn norms and the final one.
    norms = [n for n in graph.node if 'LayerNormalization' in n.op_type]
    assert len(norms) == 2 * layers + 1


def test_every_kernel_gives_the_same_logits(q4k_model):
    auto = logits(q4k_model)
    assert np.array_equal(logits(q4k_model, kernel='scalar'), auto)
    assert native_ops.kernel_name() == 'scalar'  # the pin reached the library ORT runs
    native_ops.pin_kernel('auto')


def test_decoder_names_the_kernel(q4k_model):
    dec = OnnxDecoder(str(q4k_model), load_model_info(str(q4k_model)),
                      SessionConfig(max_context=32))
    assert dec.kernel == f'kquant ({native_ops.kernel_name()})'
    assert native_ops.kernel_name() in native_ops.KERNEL_CHOICES[1:]


def test_a_pin_this_cpu_lacks_names_its_features(native_library, q4k_model):
    missing = 'neon' if platform.machine() in ('x86_64', 'AMD64') else 'avx2'
    with pytest.raises(native_ops.KernelPinError, match='this CPU has') as err:
        OnnxDecoder(str(q4k_model), load_model_info(str(q4k_model)),
                    SessionConfig(max_context=32, kernel=missing))
    assert native_ops.cpu_features() in str(err.value)
    with pytest.raises(native_ops.KernelPinError, match='not one of'):
        native_ops.pin_kernel('avx9000')


def test_loading_without_the_library_says_how_to_build_it(q4k_model, monkeypatch):
    monkeypatch.setattr(native_ops, 'library_path', lambda: None)
    with pytest.raises(native_ops.NativeLibraryMissingError,
                       match='scripts/setup.sh') as err:
        OnnxDecoder(str(q4k_model), load_model_info(str(q4k_model)),
                    SessionConfig(max_context=32))
    assert 'weights: kquant' in str(err.value)


def test_a_missing_library_override_is_an_error(q4k_model, monkeypatch, tmp_path):
    monkeypatch.setenv(native_ops.ENV_LIBRARY, str(tmp_path / 'nothing.so'))
    with pytest.raises(native_ops.NativeLibraryMissingError, match='is not a file'):
        OnnxDecoder(str(q4k_model), load_model_info(str(q4k_model)),
                    SessionConfig(max_context=32))


@pytest.mark.parametrize('options, named', [
    ({'accuracy_level': 0}, 'accuracy level 0'),
    ({'activation_dtype': 'float16'}, '--dtype float16'),
    ({'precision': 'int4'}, '--precision int4')])
def test_kquant_refuses_options_it_does_not_compute(native_library, q4k_gguf, tmp_path,
                                                    options, named):
    with pytest.raises(ConversionError, match=named):
        convert(str(q4k_gguf), str(tmp_path / 'out'), weights='kquant', progress=False,
                **options)
    assert not (tmp_path / 'out').exists()


def test_kquant_without_the_library_is_a_conversion_error(q4k_gguf, tmp_path, monkeypatch):
    monkeypatch.setattr(native_ops, 'library_path', lambda: None)
    with pytest.raises(ConversionError, match='not built'):
        convert(str(q4k_gguf), str(tmp_path / 'out'), weights='kquant', progress=False)
    # The default then is MatMulNBits (said in model.yaml), as the option's help states.
    out = convert(str(q4k_gguf), str(tmp_path / 'mnb'), progress=False)
    assert yaml.safe_load((out / 'model.yaml').read_text())['quantization']['weights'] == \
        'matmulnbits'


def test_matmulnbits_folder_agrees_with_kquant(native_library, q4k_gguf, q4k_model, tmp_path):
    """Both formats compute the same model: logits close, both near llama.cpp (parity test)."""
    other = convert(str(q4k_gguf), str(tmp_path / 'mnb'), weights='matmulnbits',
                    progress=False)
    a, b = logits(q4k_model, steps=0), logits(other, steps=0)
    assert np.abs(a - b).max() <= 0.1 * np.abs(a).max()
