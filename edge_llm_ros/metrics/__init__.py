"""llm_node's figures: one recorder that /diagnostics and the Prometheus exporter both read.

No rclpy here (figures.py, exporter.py): the node feeds the recorder where it already knows
a figure (a goal's end, a refusal) and supplies the scrape-time gauges as a callable.
"""
