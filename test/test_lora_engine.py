"""LoRA adapters per goal in the engine (serving/adapters.py): goals, limits, unloads, reuse.

A tiny llama (Q8_0, weights='kquant') with two random adapters: a goal's ids equal a decoder
run with the same adapter; bad adapter input is an AdapterRequestError before model work (the
engine serves on); KV written under one adapter set is not reused by another; an adapter
in use is unloaded when its goal ends.
"""
import math
import pathlib

from gguf_fixtures import ParityCase, write_gguf
from llama_cpp_parity import converted
from lora_fixtures import random_pairs, write_lora_gguf
import pytest

from edge_llm_ros.errors import AdapterRequestError
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
                               lora_adapters=(('one', str(a1), 1.0), ('two', str(a2), 0.5)),
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
        reloaded = eng.adapters.load('one', str(files[1][0]), 1.0)
        assert reloaded.rank == 8 and reloaded.nbytes > 0
    finally:
        eng.close()


def test_another_base_is_refused_at_load(files, tmp_path):
    eng = engine(files)
    try:
        other = write_lora_gguf(tmp_path / 'q.gguf', 'qwen2', CASE.dims,
                                random_pairs(CASE.dims, 4, roles=('q',)))
        from edge_llm_ros.errors import AdapterMismatchError
        with pytest.raises(AdapterMismatchError, match='qwen2.*llama'):
            eng.adapters.load('q', str(other))
        pathlib.Path(tmp_path / 'cut.gguf').write_bytes(other.read_bytes()[:200])
        from edge_llm_ros.errors import AdapterFileError
        with pytest.raises(AdapterFileError):
            eng.adapters.load('cut', str(tmp_path / 'cut.gguf'))
        assert len(ask(eng, {'one': 1.0})) == 12
    finally:
        eng.close()


def test_cli_generate_with_adapters(files):
    import json
    import subprocess
    import sys
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
