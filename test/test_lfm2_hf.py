"""LFM2 from an HF safetensors folder: the same model as its GGUF.

One set of random tiny LFM2 weights (gguf_fixtures' lfm2 case at F32, which
test_llama_cpp_parity checks against llama.cpp; conv, attention, conv layers) is written as an
HF folder (transformers' Lfm2 tensor names and config keys: layer_types, conv_L_cache,
block_ff_dim, norm_eps, the conv kernel as Conv1d's [hidden, 1, kernel]) and as a GGUF. Both
read into the same ModelSpec and tensors, and their converted folders give equal logits over
a prompt and 32 greedy steps, with an untied and a tied head: HF = GGUF = llama.cpp. Older
and newer config forms read alike, and bad LFM2 configs are refused with what to do before
anything is written.
"""
import dataclasses
import json
import pathlib
import shutil

from gguf_fixtures import LFM2_CONV_KERNEL, LFM2_DIMS, ParityCase, write_gguf, write_hf
import numpy as np
from ort_driver import OrtDriver
import pytest
import yaml

from edge_llm_ros.convert.checkpoint import load_checkpoint
from edge_llm_ros.convert.converter import convert
from edge_llm_ros.errors import ModelLoadError, UnsupportedModelError

# The lfm2 case of test_llama_cpp_parity at F32: the GGUF holds the HF folder's floats.
CASES = [ParityCase('lfm2', 'F32', dims=LFM2_DIMS, seed=6, chain=0.3),
         ParityCase('lfm2', 'F32', dims=LFM2_DIMS, seed=6, chain=0.3, tied=True)]
PROMPT = [5, 17, 99, 120, 3, 250, 44, 61, 7, 12, 31]
STEPS = 32


@pytest.fixture(scope='module')
def written(tmp_path_factory):
    """Give source(case) -> (HF folder, GGUF) of the case, each written once."""
    root, done = tmp_path_factory.mktemp('lfm2-hf'), {}

    def source(case: ParityCase) -> tuple:
        if case not in done:
            done[case] = (write_hf(root / f'{case.tag}-hf', case),
                          write_gguf(root / f'{case.tag}.gguf', case))
        return done[case]
    return source


@pytest.fixture(scope='module', params=CASES, ids=lambda c: c.tag)
def sources(request, written) -> tuple:
    """Return (HF folder, GGUF) of each case."""
    return written(request.param)


@pytest.fixture(scope='module')
def untied(written) -> tuple:
    """Return (HF folder, GGUF) of the untied case (the one the edits start from)."""
    return written(CASES[0])


def edited(tmp_path: pathlib.Path, hf: pathlib.Path, **config) -> pathlib.Path:
    """Copy the HF folder with config.json keys set (None: removed); return the copy."""
    out = shutil.copytree(hf, tmp_path / hf.name)   # its name is the spec's name
    cfg = json.loads((out / 'config.json').read_text())
    cfg.update(config)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (out / 'config.json').write_text(json.dumps(cfg))
    return out


def test_the_hf_folder_reads_as_its_gguf(sources):
    hf, gg = (load_checkpoint(str(s)) for s in sources)
    assert hf.spec == dataclasses.replace(gg.spec, name=hf.spec.name)
    assert hf.spec.layer_kinds == ('conv', 'attention', 'conv')
    assert hf.spec.conv_kernel == LFM2_CONV_KERNEL and hf.spec.qk_norm
    assert hf.spec.intermediate_size == LFM2_DIMS.intermediate   # 2/3 of block_ff_dim
    assert hf.tensors.keys() == gg.tensors.keys()
    for key in gg.tensors:
        a, b = hf.tensor(key), gg.tensor(key)
        assert a.shape == b.shape, key
        np.testing.assert_array_equal(a.dequantize(), b.dequantize(), err_msg=key)


def decode(model_dir: pathlib.Path) -> tuple:
    """Return greedy ids after PROMPT and the logits of every step (prompt's last first)."""
    drv = OrtDriver(model_dir, max_ctx=64)
    logits, ids = [drv.step(PROMPT)], []
    for _ in range(STEPS):
        ids.append(int(np.argmax(logits[-1])))
        logits.append(drv.step([ids[-1]]))
    return ids, np.stack(logits)


def test_the_hf_folder_converts_to_the_model_of_its_gguf(sources, tmp_path, native_library):
    hf, gg = (convert(str(s), str(tmp_path / name), progress=False)
              for s, name in zip(sources, ('from-hf', 'from-gguf')))
    ids, logits = decode(hf)
    assert len(set(ids)) > 3, ids   # a real decode, not one token repeated
    want_ids, want_logits = decode(gg)
    assert ids == want_ids
    np.testing.assert_array_equal(logits, want_logits)
    meta, want = (yaml.safe_load((m / 'model.yaml').read_text()) for m in (hf, gg))
    for key in ('architecture', 'layer_states', 'parameters', 'quantization', 'num_kv_heads',
                'rope_theta', 'rms_norm_eps', 'qk_norm'):
        assert meta[key] == want[key], key


@pytest.mark.parametrize('form, changed', [
    ({'layer_types': None, 'full_attn_idxs': [1]}, {}),   # configs before layer_types
    ({'rope_theta': None, 'rope_parameters': {'rope_type': 'default', 'rope_theta': 1e4}},
     {'rope_theta': 1e4}),                                # transformers 5
    ({'block_ff_dim': None}, {}),                         # intermediate_size alone
], ids=['full_attn_idxs', 'rope_parameters', 'intermediate_size'])
def test_other_config_forms_read_alike(untied, tmp_path, form, changed):
    want = load_checkpoint(str(untied[0])).spec
    got = load_checkpoint(str(edited(tmp_path, untied[0], **form))).spec
    assert got == dataclasses.replace(want, **changed)


def test_a_final_norm_named_model_norm_is_read(untied, tmp_path):
    from safetensors.numpy import load_file, save_file
    hf = edited(tmp_path, untied[0])
    tensors = load_file(str(hf / 'model.safetensors'))
    tensors['model.norm.weight'] = tensors.pop('model.embedding_norm.weight')
    save_file(tensors, str(hf / 'model.safetensors'))
    norm = load_checkpoint(str(hf)).tensor('final_norm')
    assert norm.name == 'model.norm.weight'
    np.testing.assert_array_equal(
        norm.dequantize(), load_checkpoint(str(untied[1])).tensor('final_norm').dequantize())


@pytest.mark.parametrize('config, error, match', [
    ({'layer_types': ['conv', 'full_attention']}, ModelLoadError,
     'layer_types has 2 entries for num_hidden_layers 3: the config contradicts itself; '
     'download config.json again'),
    ({'layer_types': ['conv', 'sliding_attention', 'conv']}, UnsupportedModelError,
     r"layer_types \['sliding_attention'\] are not LFM2 layers \(conv, full_attention\).*"
     'convert an LFM2 / LFM2.5 text model'),
    ({'layer_types': 'conv'}, ModelLoadError, "layer_types is 'conv', not a list"),
    ({'layer_types': None, 'full_attn_idxs': [1, 3]}, ModelLoadError,
     r'full_attn_idxs \[1, 3\] name layers beyond num_hidden_layers 3'),
    ({'layer_types': ['conv'] * 3}, UnsupportedModelError, 'no full_attention layer'),
    ({'conv_L_cache': 17}, UnsupportedModelError, 'conv_L_cache 17 is not a conv kernel'),
    ({'conv_bias': True}, UnsupportedModelError,
     'no conv biases: convert an LFM2 checkpoint without them'),
    ({'architectures': ['Lfm2BidirectionalModel']}, UnsupportedModelError,
     'embedding model .*convert a generative LFM2 checkpoint'),
], ids=['length', 'unknown-type', 'not-a-list', 'attn-index', 'no-attention', 'kernel',
        'conv-bias', 'embedding'])
def test_a_bad_lfm2_config_is_refused_with_what_to_do(untied, tmp_path, config, error,
                                                      match):
    hf = edited(tmp_path, untied[0], **config)
    with pytest.raises(error, match=match):
        convert(str(hf), str(tmp_path / 'out'), progress=False)
    assert not (tmp_path / 'out').exists()
