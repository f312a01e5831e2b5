"""edge_llm_ros.runtime."""
