"""A robot's semantic memory: texts with optional poses, recalled by meaning (issue 42).

store.py keeps the rows and vectors in SQLite (WAL) with sqlite-vec; memory.py embeds through
a callable (the memory node passes the embedding node's ~/embed service) and applies the
filters. Nothing here imports rclpy: nodes/memory.py is the ROS side.
"""
