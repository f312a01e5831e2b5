"""Misspelled parameter overrides are refused, on every node, with the closest names.

rclpy keeps an override of an undeclared name and says nothing (kv.max_contxt:=4096 would
leave the context at its default). bringup.parameters.check_overrides decides; the nodes'
one parameter path (node_params.read) asks it with the overrides rclpy holds. Names of
another edge_llm_ros node (a shared params file's /** section) and ROS's own qos_overrides
pass through; a section addressed to another node never reaches this one (rcl filters it).
"""
import os
import pathlib
import select
import signal
import subprocess
import sys
import time

import pytest
import rclpy
from rclpy.node import Node
import yaml

from edge_llm_ros.bringup.errors import UnknownParameterError
from edge_llm_ros.bringup.parameters import check_overrides, schema, SCHEMAS
from edge_llm_ros.nodes import llm_config, node_params
from edge_llm_ros.nodes.llm_node import LLMNode
from edge_llm_ros.nodes.node_params import ConfigError


# ---- the decision, without ROS ------------------------------------------------------------
def _declared(node: str):
    names = set(schema(node).names()) | {'use_sim_time'}
    return names.__contains__


def test_a_typo_names_itself_and_the_closest_declared_names():
    with pytest.raises(UnknownParameterError) as err:
        check_overrides('llm_node', ['kv.max_contxt', 'max_tokens'], _declared('llm_node'))
    text = str(err.value)
    assert "'kv.max_contxt' (did you mean kv.max_context" in text
    assert 'max_tokens' not in text.replace('kv.max_contxt', '')
    assert text.startswith('llm_node: 1 parameter override(s)')


def test_every_unknown_override_is_named_at_once():
    with pytest.raises(UnknownParameterError) as err:
        check_overrides('frame_source', ['widht', 'zzzz_nothing_like_it'],
                        _declared('frame_source'))
    text = str(err.value)
    assert '2 parameter override(s)' in text
    assert "'widht' (did you mean width" in text
    assert "'zzzz_nothing_like_it' (nothing close" in text


def test_declared_ros_and_sibling_names_pass():
    # frame_source's width in a shared /** section, ROS's own QoS overrides, use_sim_time.
    passed = check_overrides('llm_node', ['width', 'qos_overrides./chatter.publisher.depth',
                                          'use_sim_time', 'kv.max_context'],
                             _declared('llm_node'))
    assert passed == ('width',)


def test_each_schema_refuses_a_misspelling_of_its_own_names():
    for node, node_schema in SCHEMAS.items():
        name = node_schema.names()[0]
        typo = name[:-1] + ('x' if name[-1] != 'x' else 'y')
        with pytest.raises(UnknownParameterError, match=f'did you mean {name}'):
            check_overrides(node, [typo], _declared(node))


# ---- real rclpy nodes: -p arguments and params files -------------------------------------------
@pytest.fixture(scope='module', autouse=True)
def ros():
    rclpy.init()
    yield
    rclpy.try_shutdown()


@pytest.fixture
def make_node(destroyed_after):
    def make(cls, name: str, args) -> Node:
        return destroyed_after(cls(name, cli_args=['--ros-args', *args]) if cls is Node else
                               cls(cli_args=['--ros-args', '-r', f'__node:={name}', *args]))
    return make


@pytest.mark.parametrize('node_name, typo, right', [
    ('frame_source', 'widht', 'width'),
    ('perception', 'model.hiden_size', 'model.hidden_size'),
    ('openai_bridge', 'prot', 'port'),
])
def test_vision_and_bridge_nodes_refuse_a_typo_on_the_command_line(make_node, node_name, typo,
                                                                   right):
    assert right in schema(node_name).names()
    node = make_node(Node, node_name, ['-p', f'{typo}:=1'])
    with pytest.raises(ConfigError) as err:
        node_params.declare_and_read(node, schema(node_name))
    assert f"'{typo}' (did you mean {right}" in str(err.value)


def test_llm_node_configure_refuses_kv_max_contxt(make_node):
    node = make_node(LLMNode, f'llm_typo_{os.getpid()}',
                     ['-p', 'kv.max_context:=1024', '-p', 'kv.max_contxt:=4096'])
    with pytest.raises(ConfigError, match=r"'kv.max_contxt' \(did you mean kv.max_context"):
        llm_config.read_config(node)


def _params_file(tmp_path: pathlib.Path, llm_section: dict) -> str:
    path = tmp_path / 'shared.yaml'
    path.write_text(yaml.safe_dump({
        '/**': {'ros__parameters': {'width': 320, 'use_sim_time': False}},
        'llm_params_probe': {'ros__parameters': llm_section},
        # Addressed to another node: rcl never hands it to llm_node.
        'perception': {'ros__parameters': {'anything_at_all': 1}},
    }))
    return str(path)


def test_a_shared_params_file_passes_other_nodes_names(make_node, tmp_path):
    node = make_node(LLMNode, 'llm_params_probe',
                     ['--params-file', _params_file(tmp_path, {'kv.max_context': 512})])
    config = llm_config.read_config(node)
    assert config.engine.max_context == 512


def test_a_typo_in_the_nodes_own_section_of_a_params_file_is_refused(make_node, tmp_path):
    path = _params_file(tmp_path, {'kv.max_context': 512, 'sampling.temprature': 0.2})
    node = make_node(LLMNode, 'llm_params_probe', ['--params-file', path])
    with pytest.raises(ConfigError, match=r"'sampling.temprature' \(did you mean "
                                          r'sampling.temperature'):
        llm_config.read_config(node)


# ---- a real llm_node process ------------------------------------------------------------------
def test_llm_node_process_says_which_override_is_misspelled_and_stays_unconfigured():
    proc = subprocess.Popen(
        [sys.executable, '-m', 'edge_llm_ros.nodes.llm_node', '--ros-args',
         '-r', f'__node:=llm_typo_process_{os.getpid()}', '-p', 'autostart:=true',
         '-p', 'kv.max_contxt:=4096'],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = ''
    try:
        deadline = time.monotonic() + 120
        while 'did you mean' not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                # Raw reads: communicate() below reads the pipe itself, so nothing may sit in
                # a Python-side buffer between the two.
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                seen += chunk.decode(errors='replace')
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        seen += rest
    assert 'configure failed, staying unconfigured' in seen, seen
    assert "'kv.max_contxt' (did you mean kv.max_context" in seen, seen
    assert 'loaded ' not in seen, seen   # no model was loaded with the wrong context
    assert proc.returncode == 0, seen
