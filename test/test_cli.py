"""`edge-llm` command line: subcommand dispatch, `generate` on the tiny model (real processes)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
from tiny_model import tiny_model_dir

from edge_llm_ros.runtime.types import GenerationRequest
from edge_llm_ros.serving.engine import Engine, EngineConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def tiny_dir(tmp_path_factory) -> pathlib.Path:
    return tiny_model_dir(tmp_path_factory.mktemp('tiny_cli'))


def edge_llm(*args, code=None):
    """Run the CLI in a fresh interpreter; `code` replaces the entry (for import checks)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, '-c', code or 'import sys; from edge_llm_ros.cli import main; '
           'sys.exit(main())', *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_generate_streams_text_and_prints_timings(tiny_dir):
    proc = edge_llm('generate', 'robot arm', '--model', str(tiny_dir), '--max-tokens', '7',
                    '--threads', '1', '--max-context', '64')
    assert proc.returncode == 0, proc.stderr
    expected = Engine(EngineConfig(model_dir=str(tiny_dir), max_context=64)).generate(
        GenerationRequest(prompt='robot arm', max_tokens=7)).run_to_end()
    assert proc.stdout == expected.text + '\n'
    assert '7 generated' in proc.stderr and 'TTFT' in proc.stderr
    # The display name (family, size, architecture, types), not the GGUF's 'tiny-llama'.
    assert '[Llama 93K (llama, Q4_0 + Q4_1 + Q8_0)] length: ' in proc.stderr, proc.stderr
    assert 'decode' in proc.stderr and 'tok/s' in proc.stderr


def test_generate_json_prints_one_object_whose_ids_are_its_text(tiny_dir):
    proc = edge_llm('generate', 'robot arm', '--model', str(tiny_dir), '--max-tokens', '7',
                    '--threads', '1', '--max-context', '64', '--json')
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)   # one object, nothing else on stdout
    assert set(out) == {'text', 'token_ids', 'stop_reason', 'error', 'prompt_tokens',
                        'completion_tokens', 'model', 'timings'}
    engine = Engine(EngineConfig(model_dir=str(tiny_dir), max_context=64))
    expected = engine.generate(GenerationRequest(prompt='robot arm', max_tokens=7)).run_to_end()
    assert out['token_ids'] == list(expected.token_ids) and len(out['token_ids']) == 7
    assert engine.detokenize(out['token_ids']) == out['text'] == expected.text
    assert out['stop_reason'] == 'length' and out['error'] == ''
    assert out['completion_tokens'] == 7 and out['prompt_tokens'] == expected.prompt_tokens
    assert out['model'] == engine.model_name
    assert out['timings']['time_to_first_token_s'] > 0 and out['timings']['decode_steps'] == 6
    assert 'Traceback' not in proc.stderr


def test_generate_with_json_schema_file(tiny_dir, tmp_path):
    schema = tmp_path / 'schema.json'
    schema.write_text(json.dumps({'enum': ['stop', 'go']}))
    proc = edge_llm('generate', 'robot arm', '--model', str(tiny_dir), '--max-context', '64',
                    '--max-tokens', '10', '--json-schema', str(schema))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) in ('stop', 'go')


def test_generate_reports_bad_input_without_traceback(tiny_dir, tmp_path):
    proc = edge_llm('generate', 'hi', '--model', str(tiny_dir), '--max-context', '64',
                    '--temperature', '-1')
    assert proc.returncode == 2
    assert 'temperature' in proc.stderr and 'Traceback' not in proc.stderr
    proc = edge_llm('generate', 'hi', '--model', str(tmp_path / 'missing'))
    assert proc.returncode == 1
    assert 'does not exist' in proc.stderr and 'Traceback' not in proc.stderr
    proc = edge_llm('generate', 'hi', '--model', str(tiny_dir), '--json-schema',
                    str(tmp_path / 'none.json'))
    assert proc.returncode == 2 and 'cannot read --json-schema' in proc.stderr


def test_generate_never_imports_rclpy(tiny_dir):
    code = ('import sys; from edge_llm_ros.cli import main; rc = main(); '
            'sys.exit(3 if "rclpy" in sys.modules else rc)')
    proc = edge_llm('generate', 'hi', '--model', str(tiny_dir), '--max-context', '64',
                    '--max-tokens', '2', code=code)
    assert proc.returncode == 0, proc.stderr


def test_dispatch_help_and_unknown_command():
    proc = edge_llm('--help')
    assert proc.returncode == 0
    assert 'generate' in proc.stdout and 'ask' in proc.stdout
    proc = edge_llm()
    assert proc.returncode == 2 and 'generate' in proc.stderr
    proc = edge_llm('fly')
    assert proc.returncode == 2 and "unknown command 'fly'" in proc.stderr
    proc = edge_llm('generate', '--help')
    assert proc.returncode == 0 and '--json-schema' in proc.stdout
    words = ' '.join(proc.stdout.split())   # whatever width argparse wrapped it to
    assert '--json ' in words and 'one JSON object instead of the stream' in words


def test_subcommands_are_registered_by_module_path():
    from edge_llm_ros import cli
    for name, sub in cli.SUBCOMMANDS.items():
        assert sub.module.startswith('edge_llm_ros.') and sub.description
    assert 'edge_llm_ros.cli_generate' == cli.SUBCOMMANDS['generate'].module
