"""edge_llm_ros.convert."""
