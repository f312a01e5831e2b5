"""py_trees behaviours that drive llm_node and the memory node from a behaviour tree."""
from edge_llm_ros.bt.generate import BlackboardKeys, Generate
from edge_llm_ros.bt.recall import Recall, RecallKeys

__all__ = ['BlackboardKeys', 'Generate', 'Recall', 'RecallKeys']
