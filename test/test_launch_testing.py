"""`ros2 launch edge_llm_ros edge_llm.launch.py` for real, with launch_testing.

Runs only where ROS 2's launch_ros / launch_testing are installed (a robot or a ROS
workstation with this package built in the workspace); they are not installable from PyPI,
so elsewhere this module is skipped and test_bringup_launch.py covers the launch logic.
The node must reach the lifecycle state `active` (autostart) with the detected board.
"""
import pathlib
import time
import unittest

import pytest

pytest.importorskip('launch_ros', reason='launch_ros is not installable from PyPI; this test '
                    'runs where ROS 2 (launch_ros, launch_testing) is installed')
launch_testing = pytest.importorskip('launch_testing', reason='launch_testing is not installed')

from launch import LaunchDescription  # noqa: E402, I100
from launch.actions import IncludeLaunchDescription  # noqa: E402
from launch.launch_description_sources import PythonLaunchDescriptionSource  # noqa: E402
import launch_testing.actions  # noqa: E402
import launch_testing.asserts  # noqa: E402

LAUNCH = pathlib.Path(__file__).resolve().parents[1] / 'launch' / 'edge_llm.launch.py'
NAMESPACE = 'launch_test'


@pytest.mark.launch_test
def generate_test_description():
    """Start llm_node through the real launch file with board auto-detection."""
    return LaunchDescription([
        IncludeLaunchDescription(PythonLaunchDescriptionSource(str(LAUNCH)), launch_arguments={
            'board': 'auto', 'namespace': NAMESPACE, 'autostart': 'true',
            'log_level': 'info'}.items()),
        launch_testing.actions.ReadyToTest(),
    ])


class TestLlmNodeComesUp(unittest.TestCase):
    """While the launch runs."""

    def test_reaches_active(self):
        import rclpy
        from lifecycle_msgs.msg import State
        from lifecycle_msgs.srv import GetState
        rclpy.init()
        node = rclpy.create_node('launch_test_probe')
        try:
            client = node.create_client(GetState, '/%s/llm_node/get_state' % NAMESPACE)
            self.assertTrue(client.wait_for_service(timeout_sec=60.0))
            deadline = time.monotonic() + 180.0
            state = None
            while time.monotonic() < deadline:
                future = client.call_async(GetState.Request())
                rclpy.spin_until_future_complete(node, future, timeout_sec=10.0)
                state = future.result().current_state.id if future.result() else None
                if state == State.PRIMARY_STATE_ACTIVE:
                    break
                time.sleep(1.0)
            self.assertEqual(state, State.PRIMARY_STATE_ACTIVE)
        finally:
            node.destroy_node()
            rclpy.shutdown()


@launch_testing.post_shutdown_test()
class TestShutdown(unittest.TestCase):
    """After the launch ends (SIGINT)."""

    def test_exit_codes(self, proc_info):
        launch_testing.asserts.assertExitCodes(proc_info, allowable_exit_codes=[0, -2, 130])
