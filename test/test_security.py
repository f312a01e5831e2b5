"""Security checks of the package source and of model loading (docs/security.md).

The ipc layer's own tests cover the transport (0700 socket dir, SO_PEERCRED on both ends,
read-only share fds, stale generations, sealed memfds); this module covers what no other
test does: the code never hands input to an interpreter, a deserializer or a shell, and a
model folder cannot make onnxruntime read files outside it.
"""
import ast
import pathlib
import shutil
from typing import Iterator, List, Tuple

import onnx
import pytest
from tiny_model import tiny_model_dir

from edge_llm_ros.errors import ModelLoadError
from edge_llm_ros.serving.engine import Engine, EngineConfig

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / 'edge_llm_ros'

# name -> why it is banned (each would execute or deserialize whatever reaches it).
BANNED_CALLS = {
    'eval': 'evaluates text as Python', 'exec': 'executes text as Python',
    'compile': 'compiles text as Python', '__import__': 'imports a module named by data',
    'os.system': 'runs a shell', 'os.popen': 'runs a shell',
    'os.execl': 'replaces the process', 'os.execlp': 'replaces the process',
    'os.execv': 'replaces the process', 'os.execvp': 'replaces the process',
    'os.spawnl': 'spawns a process', 'os.spawnv': 'spawns a process',
    'pickle.load': 'unpickling runs code', 'pickle.loads': 'unpickling runs code',
    'marshal.load': 'loads code objects', 'marshal.loads': 'loads code objects',
    'yaml.load': 'can construct Python objects (use yaml.safe_load)',
    'yaml.unsafe_load': 'constructs Python objects', 'yaml.full_load': 'constructs objects',
    'torch.load': 'unpickles', 'shelve.open': 'unpickles',
}
BANNED_IMPORTS = ('pickle', 'cPickle', 'marshal', 'shelve', 'dill', 'cloudpickle')
SUBPROCESS_CALLS = ('subprocess.run', 'subprocess.Popen', 'subprocess.call',
                    'subprocess.check_call', 'subprocess.check_output')


def _sources() -> Iterator[Tuple[pathlib.Path, ast.AST]]:
    for path in sorted(PACKAGE.rglob('*.py')):
        yield path, ast.parse(path.read_text(), str(path))


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f'{base}.{node.attr}' if base else ''
    return ''


def _where(path: pathlib.Path, node: ast.AST) -> str:
    return f'{path.relative_to(PACKAGE.parent)}:{node.lineno}'


def test_scanner_finds_what_it_bans():
    """The checks below would see a banned call (guards against a scanner that sees none)."""
    tree = ast.parse('import pickle\neval(x)\nos.system("a")\nsubprocess.run("ls", shell=True)\n'
                     'yaml.load(f)\nnp.load(f, allow_pickle=True)\n')
    assert _banned(pathlib.Path('x.py'), tree, relative=False) == [
        'x.py:1 imports pickle', 'x.py:2 eval(): evaluates text as Python',
        'x.py:3 os.system(): runs a shell', 'x.py:4 subprocess.run with shell=True',
        'x.py:4 subprocess.run with a command string, not an argv list',
        'x.py:5 yaml.load(): can construct Python objects (use yaml.safe_load)',
        'x.py:6 np.load with allow_pickle=True']


def _banned(path: pathlib.Path, tree: ast.AST, relative: bool = True) -> List[str]:
    where = (lambda n: _where(path, n)) if relative else (lambda n: f'{path}:{n.lineno}')
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) \
                else [node.module or '']
            for name in names:
                if name.split('.')[0] in BANNED_IMPORTS:
                    found.append(f'{where(node)} imports {name}')
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name in BANNED_CALLS:
            found.append(f'{where(node)} {name}(): {BANNED_CALLS[name]}')
        keywords = {k.arg: k.value for k in node.keywords}
        if name in SUBPROCESS_CALLS:
            shell = keywords.get('shell')
            if shell is not None and not (isinstance(shell, ast.Constant) and not shell.value):
                found.append(f'{where(node)} {name} with shell=True')
            if node.args and isinstance(node.args[0], (ast.Constant, ast.JoinedStr, ast.BinOp)):
                found.append(f'{where(node)} {name} with a command string, not an argv list')
        if name.endswith('load') and name.split('.')[0] in ('np', 'numpy'):
            pickle = keywords.get('allow_pickle')
            if pickle is not None and not (isinstance(pickle, ast.Constant) and
                                           not pickle.value):
                found.append(f'{where(node)} {name} with allow_pickle=True')
    return found


def test_package_never_evaluates_deserializes_or_shells_out():
    found = [line for path, tree in _sources() for line in _banned(path, tree)]
    assert not found, 'banned calls in edge_llm_ros/:\n' + '\n'.join(found)


# Modules that see prompt text, chat content, schemas or handles (the request path).
REQUEST_PATH = ('runtime/', 'serving/', 'nodes/llm_', 'nodes/messages.py',
                'nodes/embeddings.py', 'nodes/handles.py', 'nodes/ask.py', 'client.py',
                'ipc/')


def test_request_path_starts_no_processes():
    """Prompt text cannot reach a shell or argv: the request path spawns nothing at all."""
    offenders = []
    for path, tree in _sources():
        rel = path.relative_to(PACKAGE).as_posix()
        if not rel.startswith(REQUEST_PATH):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _dotted(node.func).startswith(
                    ('subprocess.', 'os.fork', 'os.exec', 'os.spawn', 'os.posix_spawn')):
                offenders.append(f'{_where(path, node)} {_dotted(node.func)}')
    assert not offenders, '\n'.join(offenders)


# --- model folders -------------------------------------------------------------------------
@pytest.fixture(scope='module')
def model_dir(tmp_path_factory) -> pathlib.Path:
    return tiny_model_dir(tmp_path_factory.mktemp('security_model'))


def test_external_data_outside_the_model_folder_is_refused(model_dir, tmp_path):
    """A model.onnx naming '../x' as external data cannot make onnxruntime read outside."""
    folder = tmp_path / 'evil'
    shutil.copytree(model_dir, folder)
    shutil.move(folder / 'model.onnx.data', tmp_path / 'outside.data')
    model = onnx.load(str(folder / 'model.onnx'), load_external_data=False)
    moved = 0
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == 'location':
                entry.value = '../outside.data'
                moved += 1
    assert moved, 'the converted model has no external data to redirect'
    onnx.save(model, str(folder / 'model.onnx'))
    with pytest.raises(ModelLoadError) as err:
        Engine(EngineConfig(model_dir=str(folder), max_context=256)).close()
    assert 'escapes' in str(err.value) or 'outside' in str(err.value)


@pytest.mark.parametrize('name', ['not a folder', 'a file', 'missing yaml'])
def test_bad_model_paths_are_refused_with_the_path(model_dir, tmp_path, name):
    target = {'not a folder': tmp_path / 'nope', 'a file': model_dir / 'model.yaml',
              'missing yaml': tmp_path / 'empty'}[name]
    if name == 'missing yaml':
        target.mkdir()
    with pytest.raises(ModelLoadError) as err:
        Engine(EngineConfig(model_dir=str(target), max_context=256))
    assert str(target) in str(err.value)
