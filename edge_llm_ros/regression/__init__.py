"""Bag record / replay / compare / report of llm_node sessions (see docs/regression.md).

bagio, records, compare, thresholds and report need no rclpy; live, record, replay and
make_fixture talk to a running ROS graph.
"""
