"""edge_llm_ros.convert.mmproj on tiny mmproj GGUFs of every family, and on bad ones."""
import gguf
from mmproj_fixtures import FAMILIES, write_mmproj
import numpy as np
import pytest

from edge_llm_ros.convert.mmproj import check_pair, MmprojError, PROJECTORS, read_mmproj
from edge_llm_ros.errors import ModelLoadError


@pytest.mark.parametrize('projector', FAMILIES)
def test_every_family_reads_with_llamacpps_keys_and_widths(tmp_path, projector):
    path = write_mmproj(tmp_path / f'{projector}.gguf', projector, n_text=64)
    mm = read_mmproj(path)
    cfg = mm.config
    assert cfg.projector == projector and projector in PROJECTORS
    assert (cfg.image_size, cfg.patch_size, cfg.n_embd, cfg.n_ff) == (32, 4, 32, 48)
    assert (cfg.n_layer, cfg.n_head, cfg.eps) == (2, 4, pytest.approx(1e-6))
    assert cfg.image_mean == cfg.image_std == (0.5, 0.5, 0.5)
    assert cfg.n_out == 64  # the projector's output width, from its tensor as llama.cpp does
    # 8 x 8 patches: merged 2 x 2 by idefics3/internvl/gemma3 (scale 2 written), none for mlp.
    assert cfg.tokens_per_tile == (64 if projector == 'mlp' else 16)
    assert cfg.activation == ('quick_gelu' if projector == 'mlp' else 'gelu_tanh')
    assert cfg.longest_edge == (64 if projector == 'idefics3' else 0)
    patch = mm.array('v.patch_embd.weight')
    assert patch.shape == (32, 3, 4, 4) and patch.dtype == np.float32
    check_pair(mm, 64, 'tiny.gguf')  # a matching language model passes


def test_gemma3_pools_by_four_when_the_key_is_absent(tmp_path):
    cfg = read_mmproj(write_mmproj(tmp_path / 'g.gguf', 'gemma3', scale=None)).config
    assert cfg.scale_factor == 4 and cfg.tokens_per_tile == 4  # 8 x 8 patches, 4 x 4 pools


def test_legacy_fc1_fc2_names_are_swapped_back_as_llamacpp_does(tmp_path):
    normal = read_mmproj(write_mmproj(tmp_path / 'a.gguf', 'mlp', seed=3))
    legacy = read_mmproj(write_mmproj(tmp_path / 'b.gguf', 'mlp', seed=3,
                                      legacy_ffn_names=True))
    for name in ('v.blk.1.ffn_up.weight', 'v.blk.1.ffn_down.weight', 'v.blk.0.ffn_up.bias'):
        assert np.array_equal(normal.array(name), legacy.array(name)), name
    assert legacy.array('v.blk.0.ffn_up.weight').shape == (48, 32)


def test_a_projector_narrower_than_the_language_model_is_refused_naming_both(tmp_path):
    mm = read_mmproj(write_mmproj(tmp_path / 'm.gguf', 'idefics3', n_text=64))
    with pytest.raises(MmprojError, match=r'64-wide .* SmolLM2\.gguf is 576 wide'):
        check_pair(mm, 576, 'SmolLM2.gguf')


def test_an_unknown_projector_type_is_refused_naming_the_supported_ones(tmp_path):
    path = write_mmproj(tmp_path / 'q.gguf', 'idefics3')
    data = path.read_bytes().replace(b'idefics3', b'qwen2vlx')  # same length: a valid file
    path.write_bytes(data)
    with pytest.raises(MmprojError, match=r"'qwen2vlx' is not supported .*idefics3, gemma3"):
        read_mmproj(path)


def test_missing_tensors_and_wrong_shapes_are_refused(tmp_path):
    with pytest.raises(MmprojError, match='lacks mm.model.fc.weight'):
        read_mmproj(write_mmproj(tmp_path / 'a.gguf', 'idefics3', skip=('mm.model.fc.weight',)))
    with pytest.raises(MmprojError, match='lacks v.blk.1.attn_out.weight'):
        read_mmproj(write_mmproj(tmp_path / 'b.gguf', 'gemma3',
                                 skip=('v.blk.1.attn_out.weight',)))
    # The keys say merge by 2 (fc 32 * 2 * 2 = 128 wide), the projector was made for 1 (32).
    with pytest.raises(MmprojError, match=r'fc.weight is \(64, 32\), .* needs \(\*, 128\)'):
        read_mmproj(write_mmproj(tmp_path / 'c.gguf', 'idefics3', scale=2, tensor_scale=1))
    with pytest.raises(MmprojError, match='do not merge by scale_factor 3'):
        read_mmproj(write_mmproj(tmp_path / 'd.gguf', 'internvl', scale=3))


def test_not_an_mmproj_and_broken_files_are_refused(tmp_path):
    with pytest.raises(MmprojError, match='no such mmproj file'):
        read_mmproj(tmp_path / 'absent.gguf')
    path = write_mmproj(tmp_path / 't.gguf', 'mlp')
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ModelLoadError, match='not a readable GGUF file'):
        read_mmproj(path)


_WRITE_HEADER = gguf.GGUFWriter.write_header_to_file


def with_keys(monkeypatch, **keys) -> None:
    """Make write_mmproj also write clip.vision.<key> (an int as uint32, a list as an array).

    A later call replaces the keys of an earlier one.
    """
    def patched(self, *args, **kwargs):
        for key, value in keys.items():
            if isinstance(value, list):
                self.add_array(f'clip.vision.{key}', value)
            else:
                self.add_uint32(f'clip.vision.{key}', value)
        return _WRITE_HEADER(self, *args, **kwargs)
    monkeypatch.setattr(gguf.GGUFWriter, 'write_header_to_file', patched)


def test_internvl_tile_limits_are_read_as_llamacpp_does(tmp_path, monkeypatch):
    cfg = read_mmproj(write_mmproj(tmp_path / 'a.gguf', 'internvl')).config
    assert (cfg.min_tiles, cfg.max_tiles) == (1, 12)  # clip.cpp's defaults when absent
    with_keys(monkeypatch, preproc_min_tiles=2, preproc_max_tiles=6)
    cfg = read_mmproj(write_mmproj(tmp_path / 'b.gguf', 'internvl')).config
    assert (cfg.min_tiles, cfg.max_tiles) == (2, 6)
    for i, (lo, hi) in enumerate([(0, 6), (7, 6)]):  # clip.cpp would abort on these
        with_keys(monkeypatch, preproc_min_tiles=lo, preproc_max_tiles=hi)
        with pytest.raises(MmprojError, match=f'preproc_min_tiles {lo} and preproc_max_tiles '
                                              f'{hi} need 1 <= min <= max'):
            read_mmproj(write_mmproj(tmp_path / f'c{i}.gguf', 'internvl'))


@pytest.mark.parametrize('projector', ['mlp', 'internvl'])
def test_anyres_pinpoints_are_refused(tmp_path, monkeypatch, projector):
    with_keys(monkeypatch, image_grid_pinpoints=[64, 32, 32, 64])
    with pytest.raises(MmprojError, match=r'image_grid_pinpoints is set: .*LLaVA-1\.6 anyres'):
        read_mmproj(write_mmproj(tmp_path / 'p.gguf', projector))
