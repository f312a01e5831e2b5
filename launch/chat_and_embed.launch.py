"""Start a chat llm_node and an embedding llm_node side by side, on one board profile.

    ros2 launch edge_llm_ros chat_and_embed.launch.py board:=rk3588 \
        model:=/models/qwen2.5-1.5b embed_model:=/models/bge-small

The embedder serves ~/embed and ~/rerank (e.g. for the memory node) on the board's helper
cores (the profile's perception cores: the RK3588's A55s, the Pi 5's core 0), the chat node
keeps its own. Every decision lives in edge_llm_ros.bringup.launch_logic.chat_embed_launch.
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, LogInfo, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode

from edge_llm_ros.bringup import launch_logic


def _launch_nodes(context, *args, **kwargs):
    values = {arg.name: LaunchConfiguration(arg.name).perform(context)
              for arg in launch_logic.chat_embed_arguments()}
    plan = launch_logic.chat_embed_launch(**values)
    return ([LogInfo(msg=message) for message in plan.messages] +
            [LifecycleNode(**node.node_kwargs()) for node in plan.nodes])


def generate_launch_description():
    """Declare the arguments; the nodes are built once their values are known."""
    arguments = [DeclareLaunchArgument(arg.name, default_value=arg.default,
                                       description=arg.description,
                                       choices=list(arg.choices) or None)
                 for arg in launch_logic.chat_embed_arguments()]
    return LaunchDescription(arguments + [OpaqueFunction(function=_launch_nodes)])
