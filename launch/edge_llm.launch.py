"""Start llm_node with a board profile.

    ros2 launch edge_llm_ros edge_llm.launch.py board:=orin_nx
    ros2 launch edge_llm_ros edge_llm.launch.py board:=auto model:=/models/qwen2.5-1.5b \
        params_file:=my_robot.yaml namespace:=robot log_level:=debug

Thin on purpose: edge_llm_ros.bringup.launch_logic resolves the board, merges
profile < params_file < launch arguments, validates everything and returns plain data;
this file only turns that data into launch actions.
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, LogInfo, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode, Node

from edge_llm_ros.bringup import launch_logic


def _launch_nodes(context, *args, **kwargs):
    values = {arg.name: LaunchConfiguration(arg.name).perform(context)
              for arg in launch_logic.llm_arguments()}
    plan = launch_logic.edge_llm_launch(**values)
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
                 for arg in launch_logic.llm_arguments()]
    return LaunchDescription(arguments + [OpaqueFunction(function=_launch_nodes)])
