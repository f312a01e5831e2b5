"""The README's main job end to end, on the embedded SmolLM2-135M.

`python -m edge_llm_ros.nodes.demo` starts llm_node as a real process, sends the prompt
through the action, streams the answer with timings and stops the node with SIGINT. The
embedded model is served by the op library's kernels (the demo prints them from
~/get_model_info).
"""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_answers_through_the_action_and_stops_cleanly():
    proc = subprocess.run(
        [sys.executable, '-m', 'edge_llm_ros.nodes.demo',
         'What color is the sky?', '--max-tokens', '48'],
        capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert 'blue' in proc.stdout.lower(), proc.stdout
    assert 'TTFT' in proc.stderr and 'decode' in proc.stderr
    assert 'stopped (exit code 0)' in proc.stderr
    # The model by family and size, not the GGUF's 'Smollm2 135M 8k Lc100K Mix1 Ep2'.
    assert 'demo: SmolLM2 135M (llama, Q4_1 + Q8_0): ' in proc.stderr, proc.stderr
    # setup.sh built the op library, so the embedded model runs on GGUF blocks.
    assert 'kquant (GGUF blocks)' in proc.stderr and 'kernel kquant (' in proc.stderr, \
        proc.stderr
