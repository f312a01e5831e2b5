"""Shared test setup: ROS environment kept on loopback with a per-run domain id."""
import os
import pathlib
import random
import threading

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# ROS 2 must never discover beyond this machine, and parallel runs must not see each other.
os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
os.environ.setdefault('ROS_DOMAIN_ID', str(random.SystemRandom().randint(1, 101)))
# CI may run without HOME: rclpy.init() needs somewhere to write logs.
_ros_home = ROOT / '.cache' / 'ros_home'
_ros_home.mkdir(parents=True, exist_ok=True)
os.environ.setdefault('ROS_HOME', str(_ros_home))
os.environ.setdefault('ROS_LOG_DIR', str(_ros_home / 'log'))


@pytest.fixture
def ros():
    """Give a node factory over a private rclpy context spun by a 4-thread executor."""
    import rclpy   # here, not at import: most tests never need rclpy in the pytest process
    from rclpy.executors import MultiThreadedExecutor
    context = rclpy.Context()
    rclpy.init(context=context)
    executor = MultiThreadedExecutor(num_threads=4, context=context)
    spin = threading.Thread(target=executor.spin, daemon=True)
    nodes = []

    def node(name):
        made = rclpy.create_node(f'{name}_{id(context)}', context=context)
        executor.add_node(made)
        nodes.append(made)
        return made
    node.executor = executor
    spin.start()
    yield node
    executor.shutdown(timeout_sec=2)
    spin.join(timeout=5)   # before the nodes and context go: nothing spins on a dead context
    for made in nodes:
        made.destroy_node()
    rclpy.try_shutdown(context=context)


@pytest.fixture
def destroyed_after():
    """Give keep(node) -> node: every node kept is destroyed when the test ends."""
    nodes = []

    def keep(node):
        nodes.append(node)
        return node
    yield keep
    for node in nodes:
        node.destroy_node()


@pytest.fixture(scope='session')
def native_library() -> pathlib.Path:
    """Build native/ (cmake, once; setup.sh has usually built it) and give the op library.

    The converter and runtime find it at build/native, so kquant is then the default.
    """
    from native_build import native_build
    return native_build() / 'libedge_llm_ort_ops.so'


# --- the compatibility matrix (test/compat_matrix.py writes docs/models.md) ---------------------
_PENDING_CELLS: dict = {}
_PASSED_CELLS: list = []


@pytest.fixture
def compat(request):
    """Give record(family, gguf_type, capability): counted only if this test passes."""
    import compat_matrix
    return compat_matrix.Recorder(request.node.nodeid, _PENDING_CELLS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep a test's matrix cells when its call passed; drop them otherwise."""
    import compat_matrix
    outcome = yield
    report = outcome.get_result()
    if report.when == 'call':
        compat_matrix.settle(_PENDING_CELLS, _PASSED_CELLS, item.nodeid, report.passed)


def _whole_suite(config) -> bool:
    """Whether this run collected all of test/ with no selection."""
    opt = config.option
    if opt.keyword or opt.markexpr or getattr(opt, 'deselect', None) or \
            getattr(opt, 'lf', False) or getattr(opt, 'failedfirst', False):
        return False
    return {pathlib.Path(a).resolve() for a in config.args} == {ROOT / 'test'}


def pytest_sessionfinish(session, exitstatus):
    """Save the run's matrix cells; a whole passing suite rewrites docs/models.md from them."""
    import compat_matrix
    if os.environ.get('EDGE_LLM_IN_DMABUF_VM'):
        return   # the DMA-BUF VM (test_ipc_dmabuf_vm.py) mounts this checkout read-only
    compat_matrix.save(_PASSED_CELLS)
    if exitstatus == 0 and session.testsfailed == 0 and _whole_suite(session.config):
        compat_matrix.write_doc(_PASSED_CELLS)
