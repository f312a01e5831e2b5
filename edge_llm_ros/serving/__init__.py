"""edge_llm_ros.serving."""
