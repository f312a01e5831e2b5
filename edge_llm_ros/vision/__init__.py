"""edge_llm_ros.vision: frame sources, the stand-in patch-embedding model, ONNX runner.

Nothing here imports rclpy: the nodes in edge_llm_ros.nodes (frame_source, perception)
are thin adapters around these modules.
"""
