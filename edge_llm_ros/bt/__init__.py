"""py_trees behaviours that drive llm_node from a behaviour tree (see bt/generate.py)."""
from edge_llm_ros.bt.generate import BlackboardKeys, Generate

__all__ = ['BlackboardKeys', 'Generate']
