"""The converter on tiny generated GGUF/HF checkpoints.

Covers the graph vs the NumPy reference, the model folder, RoPE layouts, bad inputs and
atomic output.

Tolerances (max |logit difference| against reference.py on the GGUF's dequantized weights):
accuracy_level 0 float32 <= 1e-4 (weights are repacked exactly, measured ~2e-5);
float16 activations <= 1% of the largest logit; accuracy_level 4 (int8 activations inside
MatMulNBits, the fast default) <= 10% of the largest logit (measured 4-7% on these random
weights, which have far larger activations than a trained model). The default folds Q4_1
offsets into the matmuls (offset_levels 2); at float32 compute that alone stays <= 5e-4 of
the largest logit (measured 1.2e-4), and <= 3e-5 with 3 levels (measured 4.7e-6).
"""
import errno
import os
import pathlib

import gguf
from gguf_fixtures import ParityCase, write_gguf, write_hf
import numpy as np
import onnx
from ort_driver import OrtDriver
import pytest
from reference_model import ReferenceModel
from tiny_model import build_tiny_gguf, build_tiny_hf, CHAT_TEMPLATE, tiny_model_dir, TinyDims
import yaml

from edge_llm_ros.convert import converter as convert_mod
from edge_llm_ros.convert.checkpoint import load_checkpoint
from edge_llm_ros.convert.converter import convert, main
from edge_llm_ros.errors import ConversionError, ModelLoadError, UnsupportedModelError

PROMPT = [5, 17, 99, 120, 3, 250, 44, 61]
YAML_KEYS = {'name', 'gguf_name', 'parameters', 'architecture', 'num_layers', 'num_heads',
             'num_kv_heads', 'head_dim', 'hidden_size', 'vocab_size',
             'max_position_embeddings', 'rope_theta', 'rms_norm_eps', 'activation_dtype',
             'bos_token_id', 'eos_token_ids',
             'add_bos_token', 'quantization', 'source', 'converter_version', 'opset',
             'kv_max_context', 'rope_scaling', 'qk_norm', 'post_norms', 'activation',
             'embed_scale', 'attention_scale', 'sliding_window', 'final_logit_softcap',
             'attention', 'op_domains', 'layer_states', 'lora_targets'}


@pytest.fixture(scope='module')
def root(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp('convert')


def source_of(model_dir) -> ReferenceModel:
    """Load the reference on the GGUF a model folder was converted from."""
    meta = yaml.safe_load((pathlib.Path(model_dir) / 'model.yaml').read_text())
    return ReferenceModel.from_gguf(meta['source']['path'])


def compare(model_dir, ref: ReferenceModel, steps: int = 8, chunk=(), embeds=None,
            max_ctx: int = 64):
    """Max |logit diff| over a prefill, an optional chunk, and greedy decode steps."""
    drv = OrtDriver(model_dir, max_ctx=max_ctx)
    cache = ref.new_cache()
    r = ref.forward(PROMPT, cache, embeds=embeds)[-1]
    o = drv.step(PROMPT, embeds=embeds)
    diffs, peak = [np.abs(r - o).max()], np.abs(r).max()
    if chunk:
        r, o = ref.forward(list(chunk), cache)[-1], drv.step(list(chunk))
        diffs.append(np.abs(r - o).max())
    for _ in range(steps):
        tok = int(np.argmax(r))
        r, o = ref.forward([tok], cache)[-1], drv.step([tok])
        diffs.append(np.abs(r - o).max())
        peak = max(peak, np.abs(r).max())
    return max(diffs), peak


@pytest.mark.parametrize('arch', ['llama', 'qwen2'])
def test_exact_graph_matches_reference_prefill_chunk_and_decode(root, arch):
    model = tiny_model_dir(root, arch=arch, accuracy_level=0)
    diff, _ = compare(model, source_of(model), steps=10, chunk=[7, 8, 9])
    assert diff <= 1e-4


def test_default_fast_graph_within_stated_tolerance(root):
    model = tiny_model_dir(root, arch='llama')
    diff, peak = compare(model, source_of(model))
    assert diff <= 0.1 * peak


@pytest.mark.parametrize('levels,tolerance', [(2, 5e-4), (3, 3e-5)])
def test_folded_offsets_graph_matches_reference(root, levels, tolerance):
    model = tiny_model_dir(root, arch='llama', accuracy_level=0, offset_levels=levels)
    diff, peak = compare(model, source_of(model), steps=10, chunk=[7, 8, 9])
    assert diff <= tolerance * peak
    graph = onnx.load(str(model / 'model.onnx'), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert 'MatMul' not in ops and 'Add' not in ops  # no separate offset term left


@pytest.mark.parametrize('accuracy_level,tolerance', [(0, 1e-4), (4, 0.1)])
def test_tied_q4_1_embedding_keeps_its_offsets(tmp_path, accuracy_level, tolerance):
    # The tied lm_head reads the embedding's blocks, so its offsets stay a separate term even
    # where the layers' offsets are folded (accuracy level 4).
    src = build_tiny_gguf(tmp_path / 'q41.gguf', tied=True, overrides={'embed': 'Q4_1'})
    model = convert(str(src), str(tmp_path / 'q41'), accuracy_level=accuracy_level,
                    progress=False, weights='matmulnbits')
    diff, peak = compare(model, source_of(model), steps=6)
    assert diff <= tolerance * (peak if accuracy_level else 1.0)
    graph = onnx.load(str(model / 'model.onnx'), load_external_data=False).graph
    assert 'lm_head/offsets' in {n.name for n in graph.node}


def test_inputs_embeds_go_ahead_of_the_ids(root):
    model = tiny_model_dir(root, arch='qwen2', accuracy_level=0)
    ref = source_of(model)
    embeds = np.random.default_rng(3).standard_normal((4, TinyDims().hidden)).astype(np.float32)
    diff, _ = compare(model, ref, steps=4, embeds=embeds)
    assert diff <= 1e-4
    # Only embeddings, no ids at all.
    drv = OrtDriver(model)
    got = drv.step([], embeds=embeds)
    want = ref.forward([], ref.new_cache(), embeds=embeds)[-1]
    assert np.abs(got - want).max() <= 1e-4


def test_float16_activations(root):
    src = build_tiny_gguf(root / 'fp16.gguf')
    model = convert(str(src), str(root / 'fp16'), activation_dtype='float16', accuracy_level=0,
                    progress=False)
    meta = yaml.safe_load((model / 'model.yaml').read_text())
    assert meta['activation_dtype'] == 'float16'
    diff, peak = compare(model, ReferenceModel.from_gguf(src), steps=4)
    assert diff <= 0.01 * peak


def test_static_kv_length_graph(root):
    src = build_tiny_gguf(root / 'static.gguf')
    model = convert(str(src), str(root / 'static'), max_context=48, accuracy_level=0,
                    progress=False)
    meta = yaml.safe_load((model / 'model.yaml').read_text())
    assert meta['kv_max_context'] == 48
    graph = onnx.load(str(model / 'model.onnx'), load_external_data=False).graph
    past = next(i for i in graph.input if i.name == 'past_key_values.0.key')
    dims = past.type.tensor_type.shape.dim
    # Batch is symbolic (one row per sequence slot); the KV length is static.
    assert dims[0].dim_param == 'batch' and [d.dim_value for d in dims[1:]] == [2, 48, 16]
    diff, _ = compare(model, ReferenceModel.from_gguf(src), steps=4, max_ctx=48)
    assert diff <= 1e-4


def test_hf_folder_and_llama_cpp_gguf_convert_to_the_same_model(root):
    """Prove the RoPE layouts: HF (NEOX) and llama.cpp's permuted GGUF give one model."""
    hf = build_tiny_hf(root / 'hf-llama')
    gg = build_tiny_gguf(root / 'f32-llama.gguf', quant='f32')
    m_hf = convert(str(hf), str(root / 'from-hf'), accuracy_level=0, progress=False)
    m_gg = convert(str(gg), str(root / 'from-gguf'), accuracy_level=0, progress=False)
    a, b = OrtDriver(m_hf), OrtDriver(m_gg)
    np.testing.assert_allclose(a.step(PROMPT), b.step(PROMPT), atol=1e-5)
    np.testing.assert_allclose(a.step([9]), b.step([9]), atol=1e-5)
    # The two references rope differently (NEOX vs interleaved pairs) on differently
    # ordered rows; they must agree with each other exactly.
    r_hf, r_gg = ReferenceModel.from_hf(hf), ReferenceModel.from_gguf(gg)
    assert not r_hf.cfg.rope_interleaved and r_gg.cfg.rope_interleaved
    np.testing.assert_allclose(r_hf.forward(PROMPT)[-1], r_gg.forward(PROMPT)[-1], atol=1e-4)
    # A wrong layout would be visible: rope the GGUF's permuted rows as NEOX instead.
    wrong = ReferenceModel(r_gg.w, r_gg.cfg.__class__(**{**r_gg.cfg.__dict__,
                                                         'rope_interleaved': False}))
    assert np.abs(wrong.forward(PROMPT)[-1] - r_gg.forward(PROMPT)[-1]).max() > 1e-2
    tok = (m_hf / 'tokenizer.json').read_text()
    assert '<|im_end|>' in tok
    assert (m_hf / 'chat_template.jinja').read_text() == CHAT_TEMPLATE


GEMMA_DIMS = TinyDims(hidden=256, intermediate=512, rms_eps=1e-6, key_length=64,
                      rope_theta=1e6)


@pytest.mark.parametrize('case', [ParityCase('qwen3', 'F32'),
                                  ParityCase('llama', 'F32', llama3_rope=True),
                                  ParityCase('llama', 'F32', linear_rope=2.0),
                                  ParityCase('gemma3', 'F32', dims=GEMMA_DIMS, window=6,
                                             swa_pattern=2, linear_rope=4.0),
                                  ParityCase('phi3', 'F32', longrope=True, rotary=0.75)],
                         ids=lambda c: c.tag)
def test_hf_folder_and_gguf_of_a_family_convert_alike(tmp_path, case):
    """q/k norms, RoPE scalings, gemma3's norms/window and phi3's fused weights read alike."""
    m_hf = convert(str(write_hf(tmp_path / 'hf', case)), str(tmp_path / 'from-hf'),
                   accuracy_level=0, progress=False)
    m_gg = convert(str(write_gguf(tmp_path / 'm.gguf', case)), str(tmp_path / 'from-gguf'),
                   accuracy_level=0, progress=False)
    a, b = OrtDriver(m_hf), OrtDriver(m_gg)
    np.testing.assert_allclose(a.step(PROMPT), b.step(PROMPT), atol=1e-4)
    np.testing.assert_allclose(a.step([9]), b.step([9]), atol=1e-4)
    meta = yaml.safe_load((m_hf / 'model.yaml').read_text())
    assert meta['qk_norm'] == (case.arch in ('qwen3', 'gemma3'))
    assert meta['rope_scaling'] == yaml.safe_load((m_gg / 'model.yaml').read_text())[
        'rope_scaling']
    assert meta['rope_scaling']['scale'] == (1 / case.linear_rope if case.linear_rope else 1.0)
    assert meta['rope_scaling']['freq_factors'] == (case.llama3_rope or case.longrope)


def test_hf_mistral_is_read_as_llama(tmp_path):
    """model_type mistral: the llama graph (as llama.cpp's converter writes it: arch llama)."""
    import json
    case = ParityCase('llama', 'F32')
    llama = write_hf(tmp_path / 'llama', case)
    mistral = write_hf(tmp_path / 'mistral', case)
    cfg = json.loads((mistral / 'config.json').read_text())
    cfg.update(model_type='mistral', architectures=['MistralForCausalLM'], sliding_window=None)
    (mistral / 'config.json').write_text(json.dumps(cfg))
    a = OrtDriver(convert(str(llama), str(tmp_path / 'a'), accuracy_level=0, progress=False))
    m = convert(str(mistral), str(tmp_path / 'b'), accuracy_level=0, progress=False)
    assert yaml.safe_load((m / 'model.yaml').read_text())['architecture'] == 'llama'
    np.testing.assert_array_equal(a.step(PROMPT), OrtDriver(m).step(PROMPT))


# DeepSeek-R1-Distill-Qwen's template (shortened): the assistant turn opens a <think> block.
R1_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
               "{% else %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}"
               '{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}')


@pytest.mark.parametrize('arch, pre, family_regex', [
    ('qwen2', 'deepseek-r1-qwen', r'\p{N}|'),      # DeepSeek-R1-Distill-Qwen: qwen2 digits
    ('llama', 'llama-bpe', r'\p{N}{1,3}')])        # DeepSeek-R1-Distill-Llama: Llama 3's
def test_deepseek_r1_distill_gguf_metadata(tmp_path, arch, pre, family_regex):
    """The distills are plain qwen2 / llama GGUFs with their own pre-tokenizer and template."""
    src = write_gguf(tmp_path / 'd.gguf', ParityCase(arch, 'Q4_K'),
                     tokenizer={'pre': pre, 'template': R1_TEMPLATE})
    out = convert(str(src), str(tmp_path / 'out'), progress=False)
    meta = yaml.safe_load((out / 'model.yaml').read_text())
    assert meta['architecture'] == arch
    assert (out / 'chat_template.jinja').read_text() == R1_TEMPLATE
    assert family_regex in (out / 'tokenizer.json').read_text()
    OrtDriver(out).greedy(PROMPT, 2)


def test_hf_multimodal_gemma3_is_refused_with_what_to_do(tmp_path):
    import json
    hf = write_hf(tmp_path / 'hf', ParityCase('gemma3', 'F32', dims=GEMMA_DIMS))
    cfg = json.loads((hf / 'config.json').read_text())
    (hf / 'config.json').write_text(json.dumps({'model_type': 'gemma3', 'text_config': cfg}))
    with pytest.raises(UnsupportedModelError, match='multimodal.*convert the text model'):
        convert(str(hf), str(tmp_path / 'out'), progress=False)
    assert_nothing_written(tmp_path / 'out')


def test_hf_unknown_rope_scaling_is_refused(tmp_path):
    import json
    hf = write_hf(tmp_path / 'hf', ParityCase('llama', 'F32'))
    cfg = json.loads((hf / 'config.json').read_text())
    cfg['rope_scaling'] = {'rope_type': 'yarn', 'factor': 4.0}
    (hf / 'config.json').write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="'yarn' is not supported"):
        convert(str(hf), str(tmp_path / 'out'), progress=False)


def test_hf_float16_and_qwen2_untied(root):
    hf = build_tiny_hf(root / 'hf-qwen2', arch='qwen2', dtype='float16')
    ck = load_checkpoint(str(hf))
    assert ck.spec.attention_bias and not ck.spec.tied_embeddings
    assert ck.tensor('0.q').qtype == 'F16'
    model = convert(str(hf), str(root / 'from-hf-qwen2'), accuracy_level=0, progress=False)
    meta = yaml.safe_load((model / 'model.yaml').read_text())
    assert meta['architecture'] == 'qwen2' and meta['eos_token_ids'] == [2]
    logits = OrtDriver(model).step(PROMPT)
    assert np.isfinite(logits).all() and logits.shape == (meta['vocab_size'],)


def test_bf16_safetensors_are_widened_exactly(tmp_path):
    from safetensors import serialize_file, TensorSpec
    hf = build_tiny_hf(tmp_path / 'hf')
    f32 = load_checkpoint(str(hf)).tensor('0.up').dequantize()
    bits = (f32.view(np.uint32) >> 16).astype(np.uint16)
    # Re-save one tensor as BF16 in a second shard; the reader widens the raw bits.
    serialize_file({'model.layers.0.mlp.up_proj.weight': TensorSpec(
        dtype='bfloat16', shape=list(f32.shape), data_ptr=bits.ctypes.data,
        data_len=bits.nbytes)}, str(hf / 'zz-bf16.safetensors'))
    t = load_checkpoint(str(hf)).tensor('0.up')
    assert t.qtype == 'BF16'
    np.testing.assert_array_equal(t.dequantize(), (bits.astype(np.uint32) << 16)
                                  .view(np.float32))


def test_model_folder_contents(root):
    model = tiny_model_dir(root, arch='llama', weights='matmulnbits')
    assert sorted(p.name for p in model.iterdir()) == [
        'chat_template.jinja', 'model.onnx', 'model.onnx.data', 'model.yaml', 'tokenizer.json']
    meta = yaml.safe_load((model / 'model.yaml').read_text())
    assert set(meta) == YAML_KEYS
    d = TinyDims()
    assert (meta['num_layers'], meta['num_heads'], meta['num_kv_heads'], meta['head_dim'],
            meta['hidden_size']) == (d.layers, d.heads, d.kv_heads, d.head_dim, d.hidden)
    assert meta['architecture'] == 'llama' and meta['bos_token_id'] == 1
    assert 2 in meta['eos_token_ids'] and meta['add_bos_token'] is False
    q = meta['quantization']
    assert q['bits'] == 4 and q['block_size'] == 32 and q['weights'] == 'matmulnbits'
    assert meta['op_domains'] == [] and q['ops']['MatMulNBits'] >= 7
    assert q['source_types'] == ['Q4_0', 'Q4_1', 'Q8_0']
    assert q['accuracy_level'] == 4 and q['offset_levels'] == 2
    exact = yaml.safe_load((tiny_model_dir(root, arch='llama', accuracy_level=0) /
                            'model.yaml').read_text())
    assert exact['quantization']['offset_levels'] == 0
    src = pathlib.Path(meta['source']['path'])
    assert src.is_absolute() and len(meta['source']['sha256']) == 64
    assert meta['opset'] == 21 and meta['kv_max_context'] is None
    # Every layer keeps attention KV (issue 38's per-layer state declaration).
    assert meta['layer_states'] == [{'kind': 'kv', 'window': 0}] * d.layers
    m = onnx.load(str(model / 'model.onnx'), load_external_data=False)
    assert m.ir_version <= 10
    ops = {n.op_type for n in m.graph.node}
    assert {'GroupQueryAttention', 'MatMulNBits', 'GatherBlockQuantized',
            'SkipSimplifiedLayerNormalization'} <= ops
    matmuls = {n.name: n for n in m.graph.node if n.op_type == 'MatMulNBits'}
    # lm_head is Q8_0: its zero points are all the default 128, so the input is left out.
    assert list(matmuls['lm_head'].input)[3:] == []
    assert matmuls['layers.0.attn.o_proj'].input[3]  # Q4_1: zero points per block
    names = [i.name for i in m.graph.input]
    assert names[:5] == ['input_ids', 'inputs_embeds', 'seqlens_k', 'total_sequence_length',
                         'logits_count']
    assert [o.name for o in m.graph.output][:3] == ['logits', 'present.0.key',
                                                    'present.0.value']
    # Weights live in the external data file, not in model.onnx.
    assert (model / 'model.onnx').stat().st_size < 200_000
    assert (model / 'model.onnx.data').stat().st_size > 50_000


# --- bad inputs: typed errors, nothing written --------------------------------------------

def assert_nothing_written(out: pathlib.Path) -> None:
    assert not out.exists()
    assert not list(out.parent.glob(f'.{out.name}.tmp-*'))


def test_missing_source(tmp_path):
    with pytest.raises(ModelLoadError, match='no such file'):
        convert(str(tmp_path / 'nope.gguf'), str(tmp_path / 'out'), progress=False)
    assert_nothing_written(tmp_path / 'out')


@pytest.mark.parametrize('keep', [0.9, 0.5, 0.01])
def test_truncated_gguf(tmp_path, keep):
    src = build_tiny_gguf(tmp_path / 'full.gguf')
    data = src.read_bytes()
    bad = tmp_path / 'cut.gguf'
    cut = int(len(data) * keep)
    bad.write_bytes(data[:cut])
    with pytest.raises(ModelLoadError, match=r'at byte (\d+).*file ends at byte (\d+)') as err:
        convert(str(bad), str(tmp_path / 'out'), progress=False)
    import re
    at, end = map(int, re.search(r'at byte (\d+).*file ends at byte (\d+)',
                                 str(err.value)).groups())
    assert end == cut and at <= cut  # the read that runs past the end is named
    assert_nothing_written(tmp_path / 'out')


def test_corrupt_tensor_type_names_its_byte(tmp_path):
    """A tensor-info type field holding no GGML type: the error gives where it was read."""
    src = build_tiny_gguf(tmp_path / 'full.gguf')
    reader = gguf.GGUFReader(str(src))
    field = reader.tensors[3].field
    type_at = field.offset + sum(int(p.nbytes) for p in field.parts[:4])
    data = bytearray(src.read_bytes())
    data[type_at:type_at + 4] = (250).to_bytes(4, 'little')
    bad = tmp_path / 'bad-type.gguf'
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=f'250.*reading at byte {type_at} of '):
        convert(str(bad), str(tmp_path / 'out'), progress=False)
    assert_nothing_written(tmp_path / 'out')


def test_unsupported_tokenizer_model_is_typed_and_writes_nothing(tmp_path):
    src = write_gguf(tmp_path / 'm.gguf', ParityCase('llama', 'Q8_0'))
    reader = gguf.GGUFReader(str(src))
    field = reader.fields['tokenizer.ggml.model']
    at = int(field.offset) + sum(int(p.nbytes) for p in field.parts[:-1])
    data = bytearray(src.read_bytes())
    assert bytes(data[at:at + 4]) == b'gpt2'
    data[at:at + 4] = b'rwkv'
    bad = tmp_path / 'rwkv-vocab.gguf'
    bad.write_bytes(bytes(data))
    with pytest.raises(UnsupportedModelError, match="tokenizer model 'rwkv' is not supported"):
        convert(str(bad), str(tmp_path / 'out'), progress=False)
    assert_nothing_written(tmp_path / 'out')


def test_not_a_gguf(tmp_path):
    bad = tmp_path / 'random.gguf'
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError, match='GGUF'):
        convert(str(bad), str(tmp_path / 'out'), progress=False)
    assert_nothing_written(tmp_path / 'out')


@pytest.mark.parametrize('arch', ['gpt2', 'gemma2'])
def test_unsupported_architecture(tmp_path, arch):
    path = tmp_path / f'{arch}.gguf'
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor('token_embd.weight', np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    listed = 'supported: llama .*qwen2 .*qwen3 .*gemma3 .*phi3'
    with pytest.raises(UnsupportedModelError, match=f"'{arch}'.*{listed}"):
        convert(str(path), str(tmp_path / 'out'), progress=False)
    assert_nothing_written(tmp_path / 'out')


def test_unsupported_tensor_type(tmp_path):
    # IQ2_XXS: a lattice codebook with no exact or near-exact MatMulNBits form.
    rng = np.random.default_rng(0)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ2_XXS]
    raw = rng.integers(0, 256, size=(512, 256 // block * size), dtype=np.uint8)
    src = write_gguf(tmp_path / 'iq.gguf', ParityCase('llama', 'Q8_0'))
    path = tmp_path / 'iq2.gguf'
    _copy_with_tensor(src, path, 'blk.1.ffn_up.weight', raw, 'IQ2_XXS')
    with pytest.raises(UnsupportedModelError, match='blk.1.ffn_up.weight has type IQ2_XXS'):
        convert(str(path), str(tmp_path / 'out'), progress=False)
    assert_nothing_written(tmp_path / 'out')


def _copy_with_tensor(src: pathlib.Path, dst: pathlib.Path, name: str, raw: np.ndarray,
                      qtype: str) -> None:
    """Rewrite a GGUF with one tensor replaced by raw blocks of another type."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields['general.architecture'].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith('GGUF.') or key == 'general.architecture':
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name == name:
            writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize('header,error,match', [
    ({'head_count': 8}, ModelLoadError, r'blk\.0\.attn_q\.weight has shape .*contradicts'),
    ({'feed_forward_length': 384}, ModelLoadError, 'ffn_gate.weight has shape'),
    ({'rope_scaling_type': 'yarn'}, UnsupportedModelError,
     "RoPE scaling type 'yarn' is not supported.*linear"),
    ({'rope_scaling_type': 'longrope'}, UnsupportedModelError, "'longrope'"),
])
def test_header_contradicting_tensors_or_unknown_rope(tmp_path, header, error, match):
    src = write_gguf(tmp_path / 'bad.gguf', ParityCase('llama', 'Q8_0'), header=header)
    with pytest.raises(error, match=match):
        convert(str(src), str(tmp_path / 'out'), progress=False)
    assert_nothing_written(tmp_path / 'out')


def test_rope_freqs_of_the_wrong_length(tmp_path):
    src = write_gguf(tmp_path / 'l3.gguf', ParityCase('llama', 'Q8_0', llama3_rope=True),
                     header={'rope_dimension_count': 64, 'key_length': 64})
    path = tmp_path / 'short.gguf'
    _copy_with_tensor(src, path, 'rope_freqs.weight', np.ones(16, np.float32), 'F32')
    with pytest.raises(ModelLoadError, match='rope_freqs.weight has 16 values, expected 32'):
        convert(str(path), str(tmp_path / 'out'), progress=False)


def test_phi3_fused_qkv_contradicting_the_heads(tmp_path):
    src = write_gguf(tmp_path / 'p.gguf', ParityCase('phi3', 'Q8_0'), header={'head_count_kv': 4})
    with pytest.raises(ModelLoadError, match=r'attn_qkv.weight has 512 rows.*need 768'):
        convert(str(src), str(tmp_path / 'out'), progress=False)
    assert_nothing_written(tmp_path / 'out')


def test_longrope_beyond_its_original_context_is_refused(tmp_path):
    src = write_gguf(tmp_path / 'p.gguf', ParityCase('phi3', 'Q8_0', longrope=True))
    with pytest.raises(ConversionError, match='max_context 512 exceeds 256'):
        convert(str(src), str(tmp_path / 'out'), max_context=512, progress=False)
    assert_nothing_written(tmp_path / 'out')
    meta = yaml.safe_load((convert(str(src), str(tmp_path / 'ok'), progress=False)
                           / 'model.yaml').read_text())
    assert meta['rope_scaling']['max_context'] == 256
    assert meta['rope_scaling']['attn_factor'] == pytest.approx(1.5 ** 0.5, rel=1e-6)


def test_gemma3_metadata_in_model_yaml(tmp_path):
    case = ParityCase('gemma3', 'Q8_0', dims=GEMMA_DIMS, window=6, swa_pattern=2)
    meta = yaml.safe_load((convert(str(write_gguf(tmp_path / 'g.gguf', case)),
                                   str(tmp_path / 'out'), progress=False)
                           / 'model.yaml').read_text())
    assert meta['sliding_window'] == {'window': 6, 'local_layers': [0],
                                      'local_rope_theta': 10000.0}
    assert meta['embed_scale'] == pytest.approx(16.0)
    assert meta['attention_scale'] == pytest.approx(1 / 8)
    assert (meta['activation'], meta['post_norms'], meta['qk_norm']) == ('gelu_tanh', True, True)


def test_gemma3_without_its_post_norms(tmp_path):
    case = ParityCase('gemma3', 'Q8_0', dims=GEMMA_DIMS, window=6)
    src = write_gguf(tmp_path / 'g.gguf', case, skip=('post_ffw_norm',))
    with pytest.raises(ModelLoadError, match="'0.post_ffn_norm' is missing"):
        convert(str(src), str(tmp_path / 'out'), progress=False)


def _rss_file_kib() -> int:
    for line in pathlib.Path('/proc/self/status').read_text().splitlines():
        if line.startswith('RssFile:'):
            return int(line.split()[1])
    raise AssertionError('no RssFile in /proc/self/status')


def test_release_gives_the_mapped_file_back(tmp_path):
    """Streaming: read pages of the mapped GGUF leave the RSS when the converter releases them.

    convert() releases after every layer, so the file never accumulates in memory (the 7B
    qwen2 shape converts at 0.52x its GGUF size in peak RSS, bench/make_random_gguf.py).
    """
    dims = TinyDims(hidden=1024, intermediate=4096, heads=4, kv_heads=2, layers=2)
    src = write_gguf(tmp_path / 'big.gguf', ParityCase('llama', 'F32', dims=dims))
    ckpt = load_checkpoint(str(src))
    before = _rss_file_kib()
    touched = sum(int(np.asarray(t.data).reshape(-1).view(np.uint8)[::4096].sum() >= 0)
                  for t in ckpt.tensors.values())
    read = _rss_file_kib() - before
    assert touched == len(ckpt.tensors) and read > 0.5 * src.stat().st_size / 1024
    ckpt.release()
    assert _rss_file_kib() - before < 0.1 * read


def test_qwen3_without_its_qk_norms(tmp_path):
    src = write_gguf(tmp_path / 'q3.gguf', ParityCase('qwen3', 'Q8_0'), skip=('attn_k_norm',))
    with pytest.raises(ModelLoadError, match="'0.k_norm' is missing"):
        convert(str(src), str(tmp_path / 'out'), progress=False)


def test_hf_folder_errors(tmp_path):
    hf = build_tiny_hf(tmp_path / 'hf')
    cfg = (hf / 'config.json').read_text()
    (hf / 'config.json').write_text(cfg.replace('"llama"', '"gpt_neox"'))
    with pytest.raises(UnsupportedModelError, match='gpt_neox'):
        convert(str(hf), str(tmp_path / 'out'), progress=False)
    (hf / 'config.json').unlink()
    with pytest.raises(ModelLoadError, match='config.json'):
        convert(str(hf), str(tmp_path / 'out'), progress=False)
    hf2 = build_tiny_hf(tmp_path / 'hf2')
    (hf2 / 'model.safetensors').write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a": 1}')
    with pytest.raises(ModelLoadError, match='safetensors'):
        convert(str(hf2), str(tmp_path / 'out'), progress=False)
    assert_nothing_written(tmp_path / 'out')


@pytest.mark.parametrize('kwargs,match', [({'block_size': 24}, 'block size'),
                                          ({'block_size': 128}, 'multiple'),
                                          ({'activation_dtype': 'int8'}, 'dtype'),
                                          ({'max_context': 100000}, 'max_context'),
                                          ({'precision': 'int2'}, 'precision'),
                                          ({'offset_levels': 4}, 'offset levels')])
def test_bad_options(tmp_path, kwargs, match):
    src = build_tiny_gguf(tmp_path / 'tiny.gguf')
    with pytest.raises(ConversionError, match=match):
        convert(str(src), str(tmp_path / 'out'), progress=False, **kwargs)
    assert_nothing_written(tmp_path / 'out')


def test_existing_output_needs_overwrite(tmp_path):
    src = build_tiny_gguf(tmp_path / 'tiny.gguf')
    out = convert(str(src), str(tmp_path / 'out'), progress=False, verify=False)
    with pytest.raises(ConversionError, match='already exists'):
        convert(str(src), str(out), progress=False)
    stamp = (out / 'model.onnx.data').stat().st_mtime_ns
    convert(str(src), str(out), progress=False, overwrite=True)
    assert (out / 'model.onnx.data').stat().st_mtime_ns != stamp
    assert not list(tmp_path.glob('.out.tmp-*'))


@pytest.mark.parametrize('failure', ['interrupt', 'disk_full'])
def test_failed_write_leaves_nothing_and_keeps_the_old_model(tmp_path, monkeypatch, failure):
    src = build_tiny_gguf(tmp_path / 'tiny.gguf')
    old = convert(str(src), str(tmp_path / 'old'), progress=False)
    before = sorted((p.name, p.stat().st_size) for p in old.iterdir())

    def broken_save(model, path, **kwargs):
        pathlib.Path(path).write_bytes(b'half')  # something partial is on disk already
        if failure == 'interrupt':
            raise KeyboardInterrupt
        raise OSError(errno.ENOSPC, 'No space left on device')

    monkeypatch.setattr(onnx, 'save_model', broken_save)
    expected = KeyboardInterrupt if failure == 'interrupt' else ConversionError
    with pytest.raises(expected) as info:
        convert(str(src), str(tmp_path / 'new'), progress=False)
    assert_nothing_written(tmp_path / 'new')
    if failure == 'disk_full':
        assert 'disk is full' in str(info.value)
    with pytest.raises(expected):
        convert(str(src), str(old), progress=False, overwrite=True)
    assert sorted((p.name, p.stat().st_size) for p in old.iterdir()) == before
    assert not list(tmp_path.glob('.old.tmp-*'))


def test_stale_temp_of_a_killed_conversion_is_removed(tmp_path):
    src = build_tiny_gguf(tmp_path / 'tiny.gguf')
    dead_pid = 2 ** 22 + 12345  # above pid_max's default: no such process
    stale = tmp_path / f'.out.tmp-{dead_pid}-abcd1234'
    stale.mkdir()
    (stale / 'model.onnx.data').write_bytes(b'partial')
    convert(str(src), str(tmp_path / 'out'), progress=False)
    assert not stale.exists()


def test_model_moved_aside_by_a_killed_conversion_is_restored(tmp_path):
    src = build_tiny_gguf(tmp_path / 'tiny.gguf')
    model = convert(str(src), str(tmp_path / 'out'), progress=False)
    dead_pid = 2 ** 22 + 12345
    aside = tmp_path / f'.out.tmp-old-{dead_pid}-abcd1234'
    os.rename(model, aside)  # as if killed between the two renames of an overwrite
    half = tmp_path / f'.out.tmp-{dead_pid}-abcd1234'
    half.mkdir()
    with pytest.raises(ConversionError, match='already exists'):
        convert(str(src), str(tmp_path / 'out'), progress=False, block_size=24)
    assert not half.exists() and not aside.exists()
    assert (tmp_path / 'out' / 'model.onnx.data').is_file()


def test_verify_rejects_a_graph_onnxruntime_cannot_load(tmp_path, monkeypatch):
    src = build_tiny_gguf(tmp_path / 'tiny.gguf')
    real_finish = convert_mod.DecoderGraph.finish

    def finish(self, *args):
        model = real_finish(self, *args)
        model.graph.node[-1].op_type = 'NoSuchOp'
        return model

    monkeypatch.setattr(convert_mod.DecoderGraph, 'finish', finish)
    with pytest.raises(ConversionError, match='onnxruntime rejected'):
        convert(str(src), str(tmp_path / 'out'), progress=False)
    assert_nothing_written(tmp_path / 'out')


# --- CLI ---------------------------------------------------------------------------------------

def test_cli_exit_codes(tmp_path, capsys):
    src = build_tiny_gguf(tmp_path / 'tiny.gguf')
    assert main([str(src), str(tmp_path / 'out'), '--quiet', '--block-size', '32']) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / 'out')
    assert main([str(tmp_path / 'missing.gguf'), str(tmp_path / 'o2'), '--quiet']) == 1
    err = capsys.readouterr().err
    assert err.startswith('edge-llm-convert: error:') and 'missing.gguf' in err
    assert main([str(src), str(tmp_path / 'out'), '--quiet']) == 1  # exists, no --force
    assert main([str(src), str(tmp_path / 'out'), '--quiet', '--force', '--dtype',
                 'float16']) == 0
    with pytest.raises(SystemExit) as info:
        main([str(src), str(tmp_path / 'o3'), '--dtype', 'int3'])
    assert info.value.code == 2
