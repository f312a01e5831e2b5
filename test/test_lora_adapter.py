"""LoRA adapters as users have them (convert/lora.py: GGUF, PEFT) and their numpy form."""
import json

from lora_fixtures import random_pairs, write_lora_gguf, write_peft
import numpy as np
import pytest
from tiny_model import TinyDims

from edge_llm_ros.convert.lora import check_base, load_adapter, write_converted
from edge_llm_ros.errors import AdapterFileError, AdapterMismatchError
from edge_llm_ros.model_format import ModelInfo
from edge_llm_ros.runtime.lora_adapter import ADAPTER_MANIFEST, load_converted

DIMS = TinyDims(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)


def info(arch: str = 'llama', dims: TinyDims = DIMS, vocab: int = 289) -> ModelInfo:
    return ModelInfo(name='tiny', architecture=arch, num_layers=dims.layers,
                     num_heads=dims.heads, num_kv_heads=dims.kv_heads,
                     head_dim=dims.head_dim, hidden_size=dims.hidden, vocab_size=vocab,
                     max_position_embeddings=256, bos_token_id=1, eos_token_ids=(2,),
                     add_bos_token=True)


@pytest.mark.parametrize('arch', ['llama', 'qwen2'])
def test_gguf_pairs_come_back_in_the_engines_layout(tmp_path, arch):
    pairs = random_pairs(DIMS, rank=4)
    path = write_lora_gguf(tmp_path / 'a.gguf', arch, DIMS, pairs, alpha=8.0)
    adapter = check_base(load_adapter(str(path), 'skill'), info(arch))
    assert adapter.name == 'skill' and adapter.alpha == 8.0
    assert set(adapter.pairs) == set(pairs)
    for key, (a, b) in pairs.items():   # llama's permuted Q/K B rows read back as NEOX
        np.testing.assert_array_equal(adapter.pairs[key].a, a)
        np.testing.assert_array_equal(adapter.pairs[key].b, b)
    pair = adapter.pairs[(0, 'q')]
    assert adapter.effective_scale(0.5, pair) == 0.5 * 8.0 / 4


@pytest.mark.parametrize('wtype', ['F16', 'BF16', 'Q8_0'])
def test_gguf_types_convert_lora_to_gguf_writes(tmp_path, wtype):
    dims = TinyDims(hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128)
    pairs = random_pairs(dims, rank=32, roles=('v', 'down'))
    path = write_lora_gguf(tmp_path / 'a.gguf', 'qwen2', dims, pairs, wtype=wtype)
    adapter = check_base(load_adapter(str(path)), info('qwen2', dims))
    for key, (a, b) in pairs.items():
        np.testing.assert_allclose(adapter.pairs[key].a, a, atol=2e-3)
        np.testing.assert_allclose(adapter.pairs[key].b, b, atol=2e-3)


def test_peft_folder(tmp_path):
    pairs = random_pairs(DIMS, rank=4, roles=('q', 'k', 'up'))
    folder = write_peft(tmp_path / 'peft', 'llama', pairs, rank=4, alpha=16)
    adapter = check_base(load_adapter(str(folder), 'p'), info('llama'))
    assert adapter.alpha == 16.0 and set(adapter.pairs) == set(pairs)
    for key, (a, b) in pairs.items():
        np.testing.assert_array_equal(adapter.pairs[key].b, b)


def test_another_base_is_refused_naming_both(tmp_path):
    path = write_lora_gguf(tmp_path / 'a.gguf', 'qwen2', DIMS, random_pairs(DIMS))
    adapter = load_adapter(str(path), 'skill')
    with pytest.raises(AdapterMismatchError, match='architecture qwen2.*is llama'):
        check_base(adapter, info('llama'))
    wide = TinyDims(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=128)
    with pytest.raises(AdapterMismatchError,
                       match=r'layer 0 down maps 128 -> 64.*tiny \(qwen2.*maps 128 -> 128'):
        check_base(adapter, info('qwen2', wide))
    short = TinyDims(hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128)
    with pytest.raises(AdapterMismatchError, match='layer 1.*layers 0..0'):
        check_base(adapter, info('qwen2', short))


def test_corrupt_truncated_and_non_adapter_files(tmp_path):
    path = write_lora_gguf(tmp_path / 'a.gguf', 'llama', DIMS, random_pairs(DIMS))
    data = path.read_bytes()
    (tmp_path / 'cut.gguf').write_bytes(data[:len(data) // 2])
    with pytest.raises(AdapterFileError, match='truncated'):
        load_adapter(str(tmp_path / 'cut.gguf'))
    (tmp_path / 'junk.gguf').write_bytes(b'not a gguf at all' * 10)
    with pytest.raises(AdapterFileError):
        load_adapter(str(tmp_path / 'junk.gguf'))
    with pytest.raises(AdapterFileError, match='does not exist'):
        load_adapter(str(tmp_path / 'none.gguf'))
    peft = write_peft(tmp_path / 'p', 'llama', random_pairs(DIMS, roles=('q',)), rank=4)
    weights = peft / 'adapter_model.safetensors'
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(AdapterFileError, match='truncated or corrupt'):
        load_adapter(str(peft))


def test_numpy_form_gives_back_the_same_pairs(tmp_path):
    pairs = random_pairs(DIMS, rank=4)
    path = write_lora_gguf(tmp_path / 'a.gguf', 'llama', DIMS, pairs, alpha=8.0)
    adapter = check_base(load_adapter(str(path), 'skill'), info('llama'))
    folder = write_converted(adapter, info('llama'), str(tmp_path / 'np'), 'abc')
    back = load_converted(str(folder), info('llama'))
    assert back.name == 'skill' and back.alpha == 8.0 and set(back.pairs) == set(pairs)
    for key, pair in adapter.pairs.items():
        np.testing.assert_array_equal(back.pairs[key].a, pair.a)
        np.testing.assert_array_equal(back.pairs[key].b, pair.b)
    with pytest.raises(AdapterMismatchError, match='architecture llama.*is qwen2'):
        load_converted(str(folder), info('qwen2'))


@pytest.mark.parametrize('wtype, stored', [('F16', {'f16'}), ('BF16', {'bf16', 'f16'}),
                                           ('Q8_0', {'f32'})])
def test_numpy_form_keeps_half_files_in_two_bytes(tmp_path, wtype, stored):
    """F16 / BF16 pairs stay 2 bytes a value (exact); an older format's folder is refused.

    A BF16 file's values may all fit F16 too (either is exact).
    """
    dims = TinyDims(hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128)
    pairs = random_pairs(dims, rank=32, roles=('q', 'v', 'down'))
    path = write_lora_gguf(tmp_path / 'a.gguf', 'qwen2', dims, pairs, wtype=wtype)
    adapter = check_base(load_adapter(str(path)), info('qwen2', dims))
    folder = write_converted(adapter, info('qwen2', dims), str(tmp_path / 'np'), 'abc')
    back = load_converted(str(folder), info('qwen2', dims))
    for key, pair in adapter.pairs.items():
        assert back.pairs[key].dtype in stored
        wide = back.pairs[key].widened()
        assert np.array_equal(wide.a.view(np.uint32), pair.a.view(np.uint32))
        assert np.array_equal(wide.b.view(np.uint32), pair.b.view(np.uint32))
    assert back.nbytes == adapter.nbytes // (1 if stored == {'f32'} else 2)
    manifest = json.loads((folder / ADAPTER_MANIFEST).read_text())
    manifest['format_version'] = 1
    (folder / ADAPTER_MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(AdapterFileError, match='format version 1.*convert it again'):
        load_converted(str(folder), info('qwen2', dims))
