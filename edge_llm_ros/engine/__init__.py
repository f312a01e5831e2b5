"""edge_llm_ros.engine."""
