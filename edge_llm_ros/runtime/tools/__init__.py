"""Tool calls, without rclpy.

spec: tool specs, calls and tool_choice; formats: the families' call syntaxes; render: tools
into the prompt; parser: calls out of the output, streaming; grammar: the constraint that
forces valid calls.
"""
