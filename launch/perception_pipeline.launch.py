"""Start frame_source, perception and llm_node sharing tensor pools, with a board profile.

    ros2 launch edge_llm_ros perception_pipeline.launch.py board:=rk3588 frame_source:=/dev/video0

frame_source writes frames into the 'frames' pool, perception maps them without copying and
writes embeddings into the 'embeddings' pool, and Generate goals carry those handles to
llm_node. The wiring, the profile resolution (perception gets its own cores, e.g. the
RK3588's A55s) and all validation live in edge_llm_ros.bringup.launch_logic.
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, LogInfo, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode, Node

from edge_llm_ros.bringup import launch_logic


def _launch_nodes(context, *args, **kwargs):
    values = {arg.name: LaunchConfiguration(arg.name).perform(context)
              for arg in launch_logic.pipeline_arguments()}
    plan = launch_logic.pipeline_launch(**values)
    actions = [LogInfo(msg=message) for message in plan.messages]
    for node in plan.nodes:
        action = LifecycleNode if node.lifecycle else Node
        actions.append(action(**node.node_kwargs()))
    return actions


def generate_launch_description():
    """Declare the arguments; the nodes are built once their values are known."""
    arguments = [DeclareLaunchArgument(arg.name, default_value=arg.default,
                                       description=arg.description,
                                       choices=list(arg.choices) or None)
                 for arg in launch_logic.pipeline_arguments()]
    return LaunchDescription(arguments + [OpaqueFunction(function=_launch_nodes)])
