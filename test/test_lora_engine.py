"""LoRA adapters per goal in the engine (serving/adapters.py): goals, limits, unloads, reuse.

A tiny llama (Q8_0, weights='kquant') with two random adapters: a goal's ids equal a decoder
run with the same adapter; bad adapter input is an AdapterRequestError before model work (the
engine serves on); KV written under one adapter set is not reused by another; an adapter
in use is unloaded when its goal ends. The adapters reach the engine in its numpy form
(convert/lora.py ensure_converted: converted once, cached beside the model folder).
"""
from dataclasses import replace
import json
import math
import pathlib
import shutil
import subprocess
import sys

from gguf_fixtures import ParityCase, write_gguf
from llama_cpp_parity import converted
from lora_fixtures import random_pairs, write_lora_gguf
import pytest
import yaml

from edge_llm_ros.convert.lora import convert_adapters, default_cache_dir, ensure_converted
from edge_llm_ros.errors import (AdapterFileError, AdapterMismatchError, AdapterRequestError,
                                 LoraTargetsMissingError)
from edge_llm_ros.runtime.conversation import Conversation
from edge_llm_ros.runtime.lora_adapter import (ADAPTER_FORMAT_VERSION, ADAPTER_MANIFEST,
                                               ADAPTER_PAIRS)
from edge_llm_ros.runtime.speculative_config import SpeculativeConfig
from edge_llm_ros.runtime.types import GenerationRequest, SamplingConfig
from edge_llm_ros.serving.engine import Engine, EngineConfig

CASE = ParityCase('llama', 'Q8_0', chain=0.0)   # no next-token chain: adapters move ids
PROMPT = 'hello robot, fetch the red cup'


@pytest.fixture(scope='module')
def files(tmp_path_factory, native_library):
    work = tmp_path_factory.mktemp('lora_engine')
    base = write_gguf(work / 'base.gguf', CASE)
    adapters = [write_lora_gguf(work / f'a{s}.gguf', 'llama', CASE.dims,
                                random_pairs(CASE.dims, 8, seed=s, std=0.1), alpha=16.0)
                for s in (1, 2)]
    return converted(base, work, accuracy_level=4, weights='kquant'), adapters


def engine(files, **kw) -> Engine:
    model, (a1, a2) = files
    return Engine(EngineConfig(model_dir=str(model), max_context=128, parallel_sequences=3,
                               lora_adapters=convert_adapters(
                                   (('one', str(a1), 1.0), ('two', str(a2), 0.5)), str(model)),
                               lora_max_per_goal=2, lora_max_scale=4.0, **kw))


def ask(eng: Engine, lora=None, tokens: int = 12):
    request = GenerationRequest(prompt=PROMPT, use_chat_template=False, max_tokens=tokens,
                                sampling=SamplingConfig(temperature=0.0), lora=lora or {})
    return eng.generate(request).run_to_end().token_ids


def test_goals_with_adapters(files):
    eng = engine(files)
    try:
        base = ask(eng)
        one = ask(eng, {'one': 1.0})
        assert one != base
        assert ask(eng, {'one': 0.0}) == base           # scale 0: the base model
        assert ask(eng, {'two': None}) == ask(eng, {'two': 0.5})   # the default scale
        both = ask(eng, {'one': 1.0, 'two': 0.5})
        assert both not in (one, base)
        # After those goals (their KV under other sets in the slots): a fresh engine agrees.
        fresh = engine(files)
        try:
            assert ask(fresh, {'one': 1.0, 'two': 0.5}) == both
            assert ask(fresh, {'one': 1.0}) == one
            assert ask(fresh) == base
        finally:
            fresh.close()
    finally:
        eng.close()


def test_bad_adapter_input_is_refused_before_model_work(files):
    eng = engine(files)
    try:
        for lora, match in [({'nope': 1.0}, 'unknown adapter'), ({'one': math.nan}, 'scale'),
                            ({'one': 9.0}, r'\[-4, 4\]'), ({'one': True}, 'scale'),
                            ({'one': 1.0, 'two': 1.0, 'x': 1.0}, 'at most 2')]:
            with pytest.raises(AdapterRequestError, match=match):
                eng.prepare(GenerationRequest(prompt=PROMPT, lora=lora))
        assert len(ask(eng, {'one': 1.0})) == 12      # serving on
    finally:
        eng.close()


def test_unload_waits_for_the_running_goal(files):
    eng = engine(files)
    try:
        gen = eng.generate(GenerationRequest(prompt=PROMPT, use_chat_template=False,
                                             max_tokens=6, lora={'one': 1.0}))
        next(iter(gen))                                 # running
        assert eng.adapters.unload('one') is False      # after its goal
        assert [a.name for a in eng.adapters.loaded() if a.unloading] == ['one']
        with pytest.raises(AdapterRequestError, match='unknown adapter'):
            eng.prepare(GenerationRequest(prompt=PROMPT, lora={'one': 1.0}))
        assert len(gen.run_to_end().token_ids) == 6
        assert [a.name for a in eng.adapters.loaded()] == ['two']
        assert eng.adapters.unload('two') is True
        reloaded = eng.adapters.load('one', ensure_converted(str(files[1][0]), str(files[0])),
                                     1.0)
        assert reloaded.rank == 8 and reloaded.nbytes > 0
    finally:
        eng.close()


def test_another_base_is_refused_at_load(files, tmp_path):
    model = str(files[0])
    eng = engine(files)
    try:
        other = write_lora_gguf(tmp_path / 'q.gguf', 'qwen2', CASE.dims,
                                random_pairs(CASE.dims, 4, roles=('q',)))
        with pytest.raises(AdapterMismatchError, match='qwen2.*llama'):
            ensure_converted(str(other), model)
        pathlib.Path(tmp_path / 'cut.gguf').write_bytes(other.read_bytes()[:200])
        with pytest.raises(AdapterFileError):
            ensure_converted(str(tmp_path / 'cut.gguf'), model)
        # The engine reads the numpy form only: a GGUF given to it says how to convert it.
        with pytest.raises(AdapterFileError, match='no converted LoRA adapter'):
            eng.adapters.load('raw', str(files[1][0]))
        # A numpy form converted for another base (its manifest's source sha256) is refused.
        moved = pathlib.Path(ensure_converted(str(files[1][0]), model, str(tmp_path / 'c')))
        manifest = json.loads((moved / ADAPTER_MANIFEST).read_text())
        manifest['base']['sha256'] = '0' * 64
        (moved / ADAPTER_MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(AdapterMismatchError, match='converted for .*source sha256 000000'):
            eng.adapters.load('moved', str(moved))
        (moved / ADAPTER_PAIRS).write_bytes(b'PK not a zip')
        manifest['base']['sha256'] = eng.info.extra['source']['sha256']
        (moved / ADAPTER_MANIFEST).write_text(json.dumps(manifest))
        with pytest.raises(AdapterFileError, match='truncated or corrupt'):
            eng.adapters.load('moved', str(moved))
        assert len(ask(eng, {'one': 1.0})) == 12
    finally:
        eng.close()


def test_conversion_is_cached_beside_the_model(files):
    model, (a1, _) = files
    first = ensure_converted(str(a1), str(model))
    assert pathlib.Path(first).parent == default_cache_dir(str(model))
    stamp = (pathlib.Path(first) / ADAPTER_PAIRS).stat().st_mtime_ns
    assert ensure_converted(str(a1), str(model)) == first       # found, not written again
    assert (pathlib.Path(first) / ADAPTER_PAIRS).stat().st_mtime_ns == stamp
    assert ensure_converted(first, str(model)) == first         # the numpy form as it is
    manifest_path = pathlib.Path(first) / ADAPTER_MANIFEST      # an older format's cache entry
    manifest = json.loads(manifest_path.read_text())
    manifest['format_version'] = ADAPTER_FORMAT_VERSION - 1
    manifest_path.write_text(json.dumps(manifest))
    assert ensure_converted(str(a1), str(model)) == first       # converted again by itself
    assert json.loads(manifest_path.read_text())['format_version'] == ADAPTER_FORMAT_VERSION


def test_a_folder_converted_before_lora_targets_asks_for_reconversion(files, tmp_path):
    model, (a1, _) = files
    old = tmp_path / 'old_model'
    shutil.copytree(model, old)
    meta = yaml.safe_load((old / 'model.yaml').read_text())
    del meta['lora_targets']
    (old / 'model.yaml').write_text(yaml.safe_dump(meta, sort_keys=False))
    eng = Engine(EngineConfig(model_dir=str(old), max_context=64))
    try:
        with pytest.raises(LoraTargetsMissingError, match='convert it again'):
            eng.adapters.load('one', ensure_converted(str(a1), str(old)))
        assert len(ask(eng)) == 12                      # it still runs without adapters
    finally:
        eng.close()


def test_cli_generate_with_adapters(files):
    model, (a1, _) = files
    cmd = [sys.executable, '-c', 'import sys; from edge_llm_ros.cli import main; sys.exit(main())',
           'generate', PROMPT, '--raw', '--model', str(model), '--max-tokens', '12',
           '--max-context', '128', '--json', '--lora', f'{a1}@1.0']
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    eng = engine(files)
    try:
        assert json.loads(proc.stdout)['token_ids'] == ask(eng, {'one': 1.0})
    finally:
        eng.close()
    bad = subprocess.run(cmd[:-1] + [f'{a1}@nan'], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and 'scale' in bad.stderr


def test_a_goal_failing_at_its_start_releases_its_adapters(files):
    eng = engine(files)
    try:
        def broken(prompt_ids):
            raise RuntimeError('forced failure between acquire and the first step')
        real, eng.speculation.start = eng.speculation.start, broken
        result = eng.generate(GenerationRequest(prompt=PROMPT, use_chat_template=False,
                                                max_tokens=6, lora={'one': 1.0})).run_to_end()
        assert 'forced failure' in result.error
        eng.speculation.start = real
        assert {a.name: a.in_use for a in eng.adapters.loaded()} == {'one': 0, 'two': 0}
        assert eng.adapters.unload('one') is True       # not held by the failed goal
        assert len(ask(eng, {'two': 0.5})) == 12
    finally:
        eng.close()


def test_a_draft_model_does_not_draft_for_adapter_goals(files):
    model, _ = files
    eng = engine(files, speculative=SpeculativeConfig(mode='draft', draft_model=str(model)))
    try:
        assert eng.speculation.draft_model is not None
        request = GenerationRequest(prompt=PROMPT, use_chat_template=False, max_tokens=12,
                                    sampling=SamplingConfig(temperature=0.0),
                                    lora={'one': 1.0})
        result = eng.generate(request).run_to_end()
        assert result.timings.draft_passes == 0          # decoded plainly
        assert eng.generate(replace(request, lora={})).run_to_end().timings.draft_passes > 0
        plain = engine(files)
        try:
            assert result.token_ids == ask(plain, {'one': 1.0})
        finally:
            plain.close()
    finally:
        eng.close()


def test_a_session_lists_the_adapters_its_turns_used(files):
    eng = engine(files)
    try:
        digest = {a.name: a.digest for a in eng.adapters.loaded()}
        for lora in ({'one': 1.0}, {'two': 0.5}, {'one': 1.0}):
            result = eng.generate(GenerationRequest(prompt=PROMPT, session_id='s', max_tokens=4,
                                                    lora=lora)).run_to_end()
            assert not result.error, result.error
        used = eng.session('s').conversation.lora
        assert used == ((f'one@{digest["one"]}', 1.0), (f'two@{digest["two"]}', 0.5))
        stored = eng.session('s').conversation      # a session store keeps them too
        assert Conversation.from_json(stored.to_json(), stored.media_bytes()).lora == used
    finally:
        eng.close()
