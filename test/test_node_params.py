"""The one parameter path (nodes/node_params.py) on real rclpy nodes: declare, read, check."""
import pytest
import rclpy
from rclpy.exceptions import InvalidParameterTypeException
from rclpy.node import Node
from rclpy.parameter import Parameter

from edge_llm_ros.bringup.parameters import schema, SMOLLM2_HIDDEN
from edge_llm_ros.nodes import llm_config, node_params
from edge_llm_ros.nodes.node_params import ConfigError
from edge_llm_ros.vision.params import frame_source_config, perception_config


@pytest.fixture(scope='module', autouse=True)
def ros():
    rclpy.init()
    yield
    rclpy.try_shutdown()


@pytest.fixture
def make_node(destroyed_after):
    def make(name: str, **overrides) -> Node:
        return destroyed_after(Node(name, parameter_overrides=[
            Parameter(k, value=v) for k, v in overrides.items()]))
    return make


def test_defaults_build_the_vision_configs(make_node):
    source = frame_source_config(node_params.declare_and_read(
        make_node('frame_source'), schema('frame_source')))
    assert (source.width, source.height, source.pool.pool_id) == (640, 480, 'frames')
    perception = perception_config(node_params.declare_and_read(
        make_node('perception'), schema('perception')))
    assert perception.stand_in.hidden_size == SMOLLM2_HIDDEN
    assert perception.runner.provider_options == {}   # empty list, declared by type
    assert perception.pool.pool_id == 'embeddings' and perception.process_cpus == ()


def test_descriptors_carry_the_schema(make_node):
    node = make_node('frame_source')
    node_params.declare(node, schema('frame_source'))
    width = node.describe_parameter('width')
    assert width.read_only and width.description == 'Frame width in pixels'
    assert (width.integer_range[0].from_value, width.integer_range[0].to_value) == (16, 8192)
    rate = node.describe_parameter('rate_hz')
    assert rate.floating_point_range[0].to_value == 1000.0
    assert 'range (0, 1000]' in rate.additional_constraints


@pytest.mark.parametrize('overrides, words', [
    ({'width': 8}, ['width']),                              # outside the ROS range
    ({'height': 'tall'}, ['height', 'INTEGER']),            # wrong type
    ({'rate_hz': 0.0}, ['rate_hz', '(0, 1000]']),           # open end: the schema refuses it
    ({'pool.allocator': 'gpu'}, ["'gpu' is not one of auto"]),
])
def test_bad_overrides_raise_config_error_naming_the_parameter(make_node, overrides, words):
    node = make_node('frame_source', **overrides)
    with pytest.raises(ConfigError) as err:
        node_params.declare_and_read(node, schema('frame_source'))
    for word in words:
        assert word in str(err.value)


def test_llm_config_keeps_rclpy_errors_for_overrides_of_the_wrong_type(make_node):
    # llm_node.main reports these without a traceback (a number given for a CPU list).
    node = make_node('llm_node', **{'engine.cpu_affinity': 3})
    with pytest.raises(InvalidParameterTypeException, match='engine.cpu_affinity'):
        llm_config.declare_parameters(node)


def test_llm_runtime_values_and_checked_changes(make_node):
    node = make_node('llm_node', **{'sampling.top_k': 5})
    llm_config.declare_parameters(node)
    assert llm_config.runtime_config(
        llm_config.current_values(node)).defaults.sampling.top_k == 5
    node.add_on_set_parameters_callback(llm_config.check_changes)
    refused, accepted, own = node.set_parameters([
        Parameter('sampling.top_p', value=0.0), Parameter('sampling.top_k', value=7),
        Parameter('use_sim_time', value=False)])
    assert not refused.successful and 'sampling.top_p' in refused.reason
    assert accepted.successful and own.successful     # rclpy's own parameters pass
    assert node.get_parameter('sampling.top_k').value == 7


def test_read_refuses_an_open_end_the_descriptor_allows(make_node):
    node = make_node('llm_node', **{'sampling.top_p': 0.0})
    llm_config.declare_parameters(node)
    with pytest.raises(ConfigError, match='sampling.top_p'):
        node_params.read(node, schema('llm_node'))
