"""Signed model updates: manifests, ed25519 signatures, bsdiff4 deltas, atomic installs.

ROS-free (llm_node's ~/update_model is nodes/model_update.py); see docs/model_updates.md.
"""
