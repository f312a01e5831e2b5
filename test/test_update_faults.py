"""Model updates under faults: kill -9 at every step of an install + switch, a full disk.

The kill test runs the real install in a child process (test/update_children.py) that stops
before each filesystem step (and in the middle of each file) and is SIGKILLed there; then,
as on the next start, `current` must name a folder that verifies and loads, and the next
install must clean up and succeed. The full disk is a real one: a small tmpfs mounted for
the test (needs root), and, for any user, a child process under RLIMIT_FSIZE whose writes
past the limit fail with EFBIG.
"""
import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from update_support import keys, two_versions

from edge_llm_ros.serving.engine import Engine, EngineConfig
from edge_llm_ros.update import delta, manifest, signing
from edge_llm_ros.update.errors import DiskFullError
from edge_llm_ros.update.install import ModelsRoot

CHILD = pathlib.Path(__file__).with_name('update_children.py')


@pytest.fixture(scope='module')
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp('update_faults')
    private, public = keys(root / 'keys')
    v1, v2 = two_versions(root, private)
    package = root / 'delta'
    delta.make_delta(v1, v2, package, signing.load_private(private))
    return {'public': public, 'trusted': signing.load_public(str(public)), 'v1': v1, 'v2': v2,
            'delta': package}


def _root_with_v1(world, path: pathlib.Path) -> ModelsRoot:
    root = ModelsRoot(path)
    root.switch(root.install(world['v1'], world['trusted']).path)
    return root


def _child(world, mode: str, value: int, root: ModelsRoot, source: pathlib.Path):
    return subprocess.Popen(
        [sys.executable, str(CHILD), mode, str(value), str(source), str(root.path),
         str(world['public']), str(world['v1'])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _loads(folder: pathlib.Path) -> str:
    engine = Engine(EngineConfig(model_dir=str(folder), max_context=64))
    try:
        return engine.model_name
    finally:
        engine.close()


@pytest.mark.parametrize('source', ['delta', 'v2'])
def test_kill_9_at_every_step_leaves_a_current_model_that_verifies_and_loads(
        world, tmp_path, source):
    probe = _child(world, 'pause', -1, _root_with_v1(world, tmp_path / 'probe'), world[source])
    out, _ = probe.communicate(timeout=60)
    assert probe.returncode == 0 and out.rstrip().endswith('done'), out
    steps = [line for line in out.splitlines() if line.startswith('step ')]
    assert any('mid-write model.onnx.data' in s for s in steps), steps
    assert any(s.startswith(f'step {len(steps) - 2} replace ') for s in steps), steps
    loaded = {}
    seen = set()
    for index in range(len(steps)):
        root = _root_with_v1(world, tmp_path / f'k{index}')
        child = _child(world, 'pause', index, root, world[source])
        line = ''
        deadline = time.monotonic() + 30
        while not line.startswith('paused') and time.monotonic() < deadline:
            line = child.stdout.readline()
            assert line, f'child ended before step {index}'
        assert line.startswith(f'paused {index} '), line
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        child.stdout.close()
        # "Next start": current names a complete folder that verifies and loads.
        current = root.current()
        found = manifest.verify_folder(current, world['trusted'])
        seen.add(found.model_name)
        if current.name not in loaded:
            loaded[current.name] = _loads(root.current_link)
        assert loaded[current.name] == found.model_name
        # Killed before the replace: still v1; after it: v2.
        replaced = 'replace' in ' '.join(steps[:index])
        assert found.model_name == ('tiny-v2' if replaced else 'tiny-v1'), (index, line)
        for version in root.installed():
            manifest.verify_folder(version, world['trusted'])   # never a half folder there
        # The next install cleans up what the killed one left and succeeds.
        again = root.install(world[source], world['trusted'], base=world['v1'])
        root.switch(again.path)
        assert list(root.staging.iterdir()) == []
        assert manifest.verify_folder(root.current(), world['trusted']).model_name == 'tiny-v2'
    assert seen == {'tiny-v1', 'tiny-v2'}


@contextlib.contextmanager
def _tmpfs(path: pathlib.Path, size: str):
    path.mkdir()
    done = subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f'cannot mount a tmpfs here ({done.stderr.strip()}); '
                    'test_full_disk_by_file_size_limit covers the same path')
    try:
        yield path
    finally:
        subprocess.run(['umount', str(path)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason='mounting a tmpfs needs root; '
                    'test_full_disk_by_file_size_limit covers the same path')
def test_full_disk_during_delta_apply_leaves_nothing_half_written(world, tmp_path):
    v1_size = manifest.verify_folder(world['v1'], world['trusted']).total_size
    # Room for v1 and part of v2: the patched model.onnx.data does not fit.
    with _tmpfs(tmp_path / 'fs', f'{(v1_size * 3 // 2) // 4096 * 4096}') as fs:
        root = _root_with_v1(world, fs / 'models')
        before = sorted(p.name for p in root.installed())
        with pytest.raises(DiskFullError, match=r'no space left while writing .*No space left '
                                                r'on device.*nothing was installed'):
            root.install(world['delta'], world['trusted'], base=root.current())
        assert sorted(p.name for p in root.installed()) == before
        assert list(root.staging.iterdir()) == []
        assert manifest.verify_folder(root.current(), world['trusted']).model_name == 'tiny-v1'
        assert not any(p.name.startswith('.current') for p in root.path.iterdir())


def test_full_disk_by_file_size_limit(world, tmp_path):
    root = _root_with_v1(world, tmp_path / 'models')
    data_size = (world['v2'] / 'model.onnx.data').stat().st_size
    child = _child(world, 'fsize', data_size // 2, root, world['delta'])
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0, out
    assert out.startswith('exit 1\n'), out
    assert 'no space left while writing' in out and 'File too large' in out, out
    assert 'nothing was installed' in out
    assert [p.name for p in root.installed()] == [root.current().name]
    assert list(root.staging.iterdir()) == []
    assert manifest.verify_folder(root.current(), world['trusted']).model_name == 'tiny-v1'
