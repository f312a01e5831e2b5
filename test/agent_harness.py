"""Set-up shared by the agent-interface tests: an llm_node process with a ROS client.

`serving_llm` runs llm_node on the medium random model (feedback every token, no prefix
reuse: a reused prefix may decode other greedy tokens than a full prefill, and these tests
compare greedy results across paths), and yields an LLMClient whose feedback provably
arrives plus every ~/transcript record of the node.
"""
import contextlib
import os
from typing import Dict, Iterator, List, NamedTuple

from llm_node_harness import (medium_model_dir, NodeProcess, RosClient,
                              wait_feedback_delivered, wait_for)
import pytest
import rclpy

from edge_llm_msgs.msg import Transcript
from edge_llm_ros import client as client_module
from edge_llm_ros.client import LLMClient

# How long a stream waits for feedback still in flight after the result: a loaded CI machine.
STREAM_GRACE_S = 30.0


class Served(NamedTuple):
    proc: NodeProcess
    ros: RosClient
    llm: LLMClient
    transcripts: List[Transcript]


@contextlib.contextmanager
def serving_llm(tmp_path_factory, name: str, params: Dict[str, object]) -> Iterator[Served]:
    """Run llm_node `name` (extra `params`) until the block ends; it must exit 0."""
    patch = pytest.MonkeyPatch()
    patch.setattr(client_module, 'FEEDBACK_GRACE_S', STREAM_GRACE_S)
    model = medium_model_dir(tmp_path_factory.mktemp(f'{name}_models'))
    proc = NodeProcess(name, {'autostart': True, 'model.path': str(model),
                              'feedback.period_tokens': 1, 'kv.prefix_reuse': False,
                              **params})
    rclpy.init()
    ros = RosClient(f'{name}_client_{os.getpid()}')
    try:
        ros.wait_state('/' + name, 'active', timeout=120)
        transcripts = ros.record(Transcript, f'/{name}/transcript')
        llm = ros.llm('/' + name)
        wait_feedback_delivered(llm)
        yield Served(proc, ros, llm, transcripts)
    finally:
        ros.close()
        rclpy.shutdown()
        patch.undo()
        assert proc.stop() == 0, proc.log()


def transcript_of(transcripts: List[Transcript], text: str,
                  timeout: float = 60.0) -> Transcript:
    """Return the last transcript whose last message (or prompt) is `text`."""
    def find() -> List[Transcript]:
        return [t for t in list(transcripts)
                if (t.messages[-1].content if t.messages else t.prompt) == text]
    wait_for(lambda: find(), timeout, f'the transcript of {text!r}')
    return find()[-1]
