"""A running llm_node on a converted model never loads the converter's libraries.

test/test_layers.py checks the imports written in the source; this checks what a real node
process imports, including names computed at run time and whatever a goal pulls in lazily.
The node runs as NodeProcess starts it (`python -m edge_llm_ros.nodes.llm_node`) with
PYTHONPROFILEIMPORTTIME=1, the environment form of `-X importtime`: the interpreter writes
one `import time:` line to stderr for every module it imports, when it imports it. The node
serves the embedded SmolLM2 (converted by scripts/setup.sh, or here first), answers real
~/generate goals through LLMClient (plain text, a JSON schema, a forced tool call), and is
stopped with SIGINT; only then is its whole log read.
"""
import json
import os
import re
import subprocess
import sys
from typing import List

import pytest

from edge_llm_ros.client import LLMClient
from edge_llm_ros.node_process import NodeProcess

NAME = f'layers_node_{os.getpid()}'
# The converter's libraries. onnxruntime is another top-level name: it does not count.
CONVERTER_MODULES = ('gguf', 'onnx', 'safetensors')
# `import time: <self us> | <cumulative us> | <module, indented by nesting>`
IMPORT_LINE = re.compile(r'^import time:\s+\d+\s+\|\s+\d+\s+\|\s*(\S+)\s*$')
MOVE = {'name': 'move_to', 'description': 'Drive to a named place', 'parameters': {
    'type': 'object', 'properties': {'place': {'enum': ['dock', 'kitchen']}},
    'required': ['place']}}


def imported_modules(log: str) -> List[str]:
    """Return the modules an `-X importtime` log shows as imported, in order."""
    return [m.group(1) for m in map(IMPORT_LINE.match, log.splitlines()) if m]


def test_import_lines_are_parsed():
    log = ('import time: self [us] | cumulative | imported package\n'
           'import time:       312 |        312 |   onnxruntime.capi\n'
           '[INFO] [llm_node]: import time: not a line of the interpreter\n'
           'import time:      1022 |       5120 | gguf\n')
    assert imported_modules(log) == ['onnxruntime.capi', 'gguf']


@pytest.mark.parametrize('statement, converter', [
    ('import onnx', ['onnx']), ('import onnxruntime', []), ('import gguf', ['gguf'])])
def test_the_interpreter_log_names_what_a_process_imported(statement, converter):
    """The same environment variable on a plain interpreter: the check can fail."""
    proc = subprocess.run([sys.executable, '-c', statement], capture_output=True, text=True,
                          env={**os.environ, 'PYTHONPROFILEIMPORTTIME': '1'}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tops = {_top(m) for m in imported_modules(proc.stderr)}
    assert statement.split()[1] in tops
    assert sorted(tops & set(CONVERTER_MODULES)) == converter


def _top(module: str) -> str:
    return module.split('.')[0]


@pytest.mark.slow
def test_served_node_never_imports_the_converter(ros):
    # The test process may convert (it is the build step); the node must not need to.
    from edge_llm_ros.convert.default_model import ensure_default_model
    model = ensure_default_model()
    params = {'autostart': True, 'model.path': str(model), 'kv.max_context': 512,
              'max_tokens': 16, 'sampling.temperature': 0.0}
    with NodeProcess('llm_node', name=NAME, params=params, keep_lines=200_000,
                     env={'PYTHONPROFILEIMPORTTIME': '1'}, stop_timeout=60.0) as node:
        client = LLMClient(ros(f'{NAME}_client'), node.fqn)
        node.wait_until_active(client, timeout=300)
        plain = client.generate('Say hello.', max_tokens=8).result(timeout=120)
        assert plain.status == 'succeeded' and plain.completion_tokens > 0, plain
        schema = {'type': 'object', 'properties': {'go': {'type': 'boolean'}},
                  'required': ['go'], 'additionalProperties': False}
        shaped = client.generate('Should the robot go?', json_schema=json.dumps(schema),
                                 max_tokens=16).result(timeout=120)
        assert shaped.status == 'succeeded', shaped
        assert isinstance(json.loads(shaped.text)['go'], bool), shaped.text
        called = client.generate('Go to the dock.', tools=[MOVE], tool_choice='move_to',
                                 parallel_tool_calls=False, max_tokens=32).result(timeout=120)
        assert called.status == 'succeeded', called
        assert [c.name for c in called.tool_calls] == ['move_to'], called
        client.destroy()
    assert node.returncode == 0, node.tail()
    modules = imported_modules(node.log())
    tops = {_top(m) for m in modules}
    # The log is the interpreter's and complete: the node's own stack is in it.
    assert {'rclpy', 'onnxruntime', 'tokenizers', 'llguidance'} <= tops, sorted(tops)
    assert 'edge_llm_ros.serving.engine' in modules, sorted(tops)
    loaded = sorted(m for m in modules if _top(m) in CONVERTER_MODULES)
    assert not loaded, f'llm_node imported the converter libraries: {loaded}'
    # Nor the converter package itself: it is what imports them.
    converter = [m for m in modules if m == 'edge_llm_ros.convert'
                 or m.startswith('edge_llm_ros.convert.')]
    assert not converter, f'llm_node imported the converter: {converter}'
