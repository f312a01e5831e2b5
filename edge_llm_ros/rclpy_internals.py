"""The private rclpy members this package relies on, in one place.

Each use names the rclpy branches it was checked against (Humble and Jazzy, the commits in
../shared/rclpy_api) and test/test_rclpy_internals.py fails when a member disappears or its
signature changes.
"""
from __future__ import annotations

from typing import Any


def lifecycle_state(node: Any) -> str:
    """Return a lifecycle node's current state label ('unconfigured', 'configuring', ...).

    rclpy has no public getter: LifecycleNodeMixin keeps the rcl state machine in
    `_state_machine` and reads `current_state` (an (id, label) pair) itself to answer
    ~/get_state. Checked: rclpy humble and jazzy (rclpy/lifecycle/node.py).
    """
    return node._state_machine.current_state[1]
