"""edge_llm_ros.regression."""
