"""edge_llm_ros: an on-device language model for ROS 2."""

__version__ = '0.1.0'
