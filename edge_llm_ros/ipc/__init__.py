"""edge_llm_ros.ipc."""
