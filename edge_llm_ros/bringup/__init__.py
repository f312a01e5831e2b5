"""edge_llm_ros.bringup."""
