"""Shared test setup: ROS environment kept on loopback with a per-run domain id."""
import os
import pathlib
import random

ROOT = pathlib.Path(__file__).resolve().parents[1]

# ROS 2 must never discover beyond this machine, and parallel runs must not see each other.
os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
os.environ.setdefault('ROS_DOMAIN_ID', str(random.SystemRandom().randint(1, 101)))
# CI may run without HOME: rclpy.init() needs somewhere to write logs.
_ros_home = ROOT / '.cache' / 'ros_home'
_ros_home.mkdir(parents=True, exist_ok=True)
os.environ.setdefault('ROS_HOME', str(_ros_home))
os.environ.setdefault('ROS_LOG_DIR', str(_ros_home / 'log'))
