"""edge_llm_ros.nodes."""
