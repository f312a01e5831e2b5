"""ament_python package definition of edge_llm_ros."""
from glob import glob
import os

from setuptools import find_packages, setup

PACKAGE = 'edge_llm_ros'


def share(subdir: str, pattern: str = '*') -> tuple:
    """Install files of a source folder under share/edge_llm_ros/<subdir>."""
    files = [f for f in glob(os.path.join(subdir, pattern)) if os.path.isfile(f)]
    return (os.path.join('share', PACKAGE, subdir), files)


setup(
    name=PACKAGE,
    version='0.1.0',
    packages=find_packages(include=[PACKAGE, PACKAGE + '.*']),
    data_files=[
        ('share/ament_index/resource_index/packages', ['resource/' + PACKAGE]),
        ('share/' + PACKAGE, ['package.xml']),
        share('launch', '*.launch.py'),
        share('config/boards', '*.yaml'),
        share('config/models', '*.yaml'),
        share('config', '*.yaml'),
        share('kernels', '*.cu'),
    ],
    install_requires=['setuptools'],
    zip_safe=True,
    maintainer='edge_llm_ros developers',
    maintainer_email='edge-llm-ros@example.com',
    description='On-device language model for ROS 2 (ONNX Runtime INT4 engine, zero-copy IPC).',
    license='Apache-2.0',
    entry_points={
        'console_scripts': [
            'llm_node = edge_llm_ros.nodes.llm_node:main',
            'openai_bridge = edge_llm_ros.nodes.openai_bridge:main',
            'ask = edge_llm_ros.nodes.ask:main',
            'frame_source = edge_llm_ros.nodes.frame_source:main',
            'perception = edge_llm_ros.nodes.perception:main',
            'memory = edge_llm_ros.nodes.memory:main',
            'edge-llm-memory-reembed = edge_llm_ros.nodes.memory_reembed:main',
            'edge-llm = edge_llm_ros.cli:main',
            'edge-llm-convert = edge_llm_ros.convert.converter:main',
            'edge-llm-update = edge_llm_ros.update.cli:main',
            'edge-llm-record = edge_llm_ros.regression.record:main',
            'edge-llm-replay = edge_llm_ros.regression.replay:main',
            'edge-llm-report = edge_llm_ros.regression.report:main',
            'edge-llm-bringup = edge_llm_ros.bringup.__main__:main',
            'edge-llm-kernel-check = edge_llm_ros.bringup.cuda_runner:main',
        ],
    },
)
