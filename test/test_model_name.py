"""The model's display name (issue 37 item 3): family and size, not the GGUF's raw name.

The converter writes model.yaml `name` = '<family> <size> (<architecture>, <weight types>)',
keeps the GGUF's general.name as `gguf_name` and the parameter count as `parameters`
(docs/architectures.md, "The model's name"). Checked on the embedded SmolLM2, on tiny GGUFs
(gguf_fixtures, tiny_model) and through Engine.model_info and `edge-llm generate`; the node's
~/get_model_info is checked in test_llm_node_services.py.
"""
import pathlib
import shutil

import gguf
from gguf_fixtures import ParityCase, write_gguf
import numpy as np
import pytest
from tiny_model import build_tiny_hf, tiny_model_dir
import yaml

from edge_llm_ros.convert.converter import convert
from edge_llm_ros.model_format import (CONVERTER_VERSION, display_name, embedded_model,
                                       load_model_info, size_label)
from edge_llm_ros.runtime import model_config as mc
from edge_llm_ros.serving.engine import Engine, EngineConfig

SMOLLM2_NAME = 'SmolLM2 135M (llama, Q4_1 + Q8_0)'
SMOLLM2_GGUF_NAME = 'Smollm2 135M 8k Lc100K Mix1 Ep2'
SMOLLM2_PARAMETERS = 134515008


def _meta(folder: pathlib.Path) -> dict:
    return yaml.safe_load((folder / 'model.yaml').read_text())


def _gguf_parameters(path: pathlib.Path) -> int:
    """Count the parameters as llama.cpp prints them: every tensor of the file."""
    return sum(int(np.prod(t.shape)) for t in gguf.GGUFReader(str(path)).tensors)


@pytest.mark.parametrize('count, label', [
    (SMOLLM2_PARAMETERS, '135M'), (361_821_120, '362M'), (1_543_714_304, '1.5B'),
    (1_711_376_384, '1.7B'), (8_030_261_248, '8.0B'), (14_770_033_664, '15B'),
    (92_544, '93K'), (1_328_896, '1.3M'), (999, '1.0K')])
def test_size_label_rounds_as_gguf_size_label(count, label):
    assert size_label(count) == label


def test_display_name_format():
    assert display_name('SmolLM2', 'llama', SMOLLM2_PARAMETERS, 'Q4_1 + Q8_0') == SMOLLM2_NAME
    assert display_name('Qwen3', 'qwen3', 0, '') == 'Qwen3 (qwen3)'  # no count: no size


@pytest.mark.parametrize('meta, label', [
    ({'gguf_name': SMOLLM2_GGUF_NAME, 'architecture': 'llama'}, 'SmolLM2'),
    ({'name': SMOLLM2_GGUF_NAME, 'architecture': 'llama'}, 'SmolLM2'),  # before converter 8
    ({'gguf_name': 'Qwen2.5 1.5B Instruct', 'architecture': 'qwen2'}, 'Qwen2.5'),
    ({'gguf_name': 'Qwen2 0.5B Instruct', 'architecture': 'qwen2'}, 'Qwen2'),
    ({'gguf_name': 'DeepSeek R1 Distill Qwen 1.5B', 'architecture': 'qwen2'},
     'DeepSeek-R1-Distill-Qwen'),
    ({'gguf_name': 'Llama 3.2 1B Instruct', 'architecture': 'llama'}, 'Llama 3'),
    ({'gguf_name': 'Phi 4 Mini Instruct', 'architecture': 'phi3'}, 'Phi-4'),
    ({'gguf_name': 'Phi 3.5 Mini Instruct', 'architecture': 'phi3'}, 'Phi-3'),
    ({'gguf_name': 'gemma-3-1b-it', 'architecture': 'gemma3'}, 'Gemma 3'),
    ({'gguf_name': 'Ministral 8B', 'architecture': 'llama'}, 'Ministral'),
    # Only the architecture's fallback family answers: named by the architecture.
    ({'gguf_name': 'TinyLlama 1.1B Chat', 'architecture': 'llama'}, 'Llama'),
    ({'gguf_name': 'some finetune', 'architecture': 'qwen3'}, 'Qwen3'),
    ({'gguf_name': 'whatever', 'architecture': 'llama', 'family': 'mistral'}, 'Mistral'),
    ({'gguf_name': 'x', 'architecture': 'mamba'}, 'mamba'),
])
def test_family_label(meta, label):
    assert mc.family_label(meta) == label


def test_family_is_matched_on_the_gguf_name_not_the_display_name():
    meta = {'name': 'Qwen3 1.7B (llama, Q8_0)', 'gguf_name': 'SmolLM2 1.7B Instruct',
            'architecture': 'llama'}
    assert mc.family_for_model(meta).family == 'smollm2'


def test_every_shipped_family_has_a_display_name():
    for cfg in mc.load_all().values():
        assert cfg.display_name, cfg.source
        assert set(cfg.display_names) <= set(cfg.match_names), cfg.source


def test_display_names_key_must_be_a_match_name(tmp_path):
    text = ('family: fam\narchitectures: [llama]\nmatch_names: [fam]\n'
            'display_names: {famm: Fam}\n')
    (tmp_path / 'fam.yaml').write_text(text)
    with pytest.raises(mc.ModelConfigError, match=r"fam.yaml: display_names: 'famm' is not one "
                                                  r'of match_names \(fam\)'):
        mc.load_family('fam', tmp_path)
    (tmp_path / 'fam.yaml').write_text(text.replace('{famm: Fam}', '{fam: ""}'))
    with pytest.raises(mc.ModelConfigError, match='display_names.fam must be a non-empty'):
        mc.load_family('fam', tmp_path)


# --- the embedded SmolLM2 ------------------------------------------------------------------

def test_embedded_smollm2_is_shown_by_family_and_size():
    folder = embedded_model()
    meta = _meta(folder)
    assert meta['converter_version'] == CONVERTER_VERSION
    assert meta['name'] == SMOLLM2_NAME
    assert meta['gguf_name'] == SMOLLM2_GGUF_NAME      # kept raw
    assert meta['parameters'] == SMOLLM2_PARAMETERS == _gguf_parameters(
        pathlib.Path(meta['source']['path']))
    info = load_model_info(str(folder))
    assert (info.name, info.gguf_name, info.parameters) == (
        SMOLLM2_NAME, SMOLLM2_GGUF_NAME, SMOLLM2_PARAMETERS)
    assert mc.family_for_model_dir(folder).family == 'smollm2'


# --- tiny GGUFs ------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def root(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp('model_name')


@pytest.mark.parametrize('case, name', [
    # 'tiny-qwen2-...' matches the qwen2 family's name; 'tiny-llama-...' no family's name.
    (ParityCase(arch='qwen2', wtype='Q4_K'), 'Qwen2 1.3M (qwen2, Q4_K + Q8_0)'),
    (ParityCase(arch='llama', wtype='Q8_0'), 'Llama 1.3M (llama, Q8_0)'),
    (ParityCase(arch='gemma3', wtype='Q4_0', tied=True), 'Gemma 3 1.3M (gemma3, Q4_0)'),
])
def test_tiny_gguf_display_name_and_raw_name(root, case, name):
    src = write_gguf(root / f'{case.tag}.gguf', case)
    out = convert(str(src), str(root / case.tag), progress=False, verify=False)
    meta = _meta(out)
    assert meta['name'] == name
    assert meta['gguf_name'] == f'tiny-{case.tag}'
    assert meta['parameters'] == _gguf_parameters(src)
    info = load_model_info(str(out))
    assert (info.name, info.gguf_name) == (name, f'tiny-{case.tag}')


def test_int4_precision_and_hf_folder_names(root):
    out = tiny_model_dir(root / 'int4', precision='int4', weights='matmulnbits')
    assert _meta(out)['name'] == 'Llama 93K (llama, int4)'
    hf = build_tiny_hf(root / 'Tiny-HF-Qwen2', arch='qwen2')
    meta = _meta(convert(str(hf), str(root / 'hf_out'), progress=False, verify=False))
    assert meta['gguf_name'] == 'Tiny-HF-Qwen2'        # an HF folder: its folder name
    from safetensors.numpy import load_file
    weights = load_file(str(hf / 'model.safetensors'))
    assert meta['parameters'] == sum(w.size for w in weights.values()) == 111296
    assert meta['name'] == 'Qwen2 111K (qwen2, F32)'


def test_engine_model_info_has_both_names(root):
    tiny = tiny_model_dir(root / 'tiny')
    engine = Engine(EngineConfig(model_dir=str(tiny), max_context=64))
    info = engine.model_info()
    assert engine.model_name == info['model_name'] == 'Llama 93K (llama, Q4_0 + Q4_1 + Q8_0)'
    assert info['gguf_name'] == 'tiny-llama' and info['parameters'] == 92544


def test_folder_before_converter_8_keeps_its_raw_name(root):
    old = root / 'old'
    shutil.copytree(tiny_model_dir(root / 'tiny'), old)
    meta = _meta(old)
    meta.update(name='tiny-llama', converter_version='7')
    del meta['gguf_name'], meta['parameters']
    (old / 'model.yaml').write_text(yaml.safe_dump(meta, sort_keys=False))
    info = load_model_info(str(old))
    assert (info.name, info.gguf_name, info.parameters) == ('tiny-llama', 'tiny-llama', 0)
    assert Engine(EngineConfig(model_dir=str(old), max_context=64)).model_name == 'tiny-llama'
