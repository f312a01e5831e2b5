"""Launch logic (plain data) and the two launch files.

The launch files run against a recording stand-in of the launch / launch_ros API: the real
packages are not installable from PyPI; test_launch_testing.py runs where they are.
"""
import importlib.util
import pathlib
import py_compile
import sys
import types

import pytest

from edge_llm_ros.bringup import launch_logic, parameters
from edge_llm_ros.bringup.errors import AffinityError, BringupError, ParameterRangeError

ROOT = pathlib.Path(__file__).resolve().parents[1]
BOARDS = ROOT / 'test' / 'data' / 'boards'
LAUNCH_FILES = sorted((ROOT / 'launch').glob('*.launch.py'))


def test_arguments_declared():
    names = [a.name for a in launch_logic.llm_arguments()]
    assert names == ['board', 'model', 'params_file', 'namespace', 'log_level', 'autostart']
    board = launch_logic.llm_arguments()[0]
    assert board.default == 'auto' and 'orin_nx' in board.choices and 'rk3588' in board.choices
    assert [a.name for a in launch_logic.pipeline_arguments()][-1] == 'frame_source'
    for arg in launch_logic.pipeline_arguments():
        assert not arg.choices or arg.default in arg.choices


@pytest.mark.parametrize('tree, board, affinity', [
    ('orin_agx', 'orin_agx', '4-5'), ('orin_nano', 'orin_nano', '4-5'),
    ('rpi5', 'rpi5', '1-3'), ('rk3588', 'rk3588', '4-7'), ('x86_64_cuda', 'x86_64_cuda', ''),
])
def test_edge_llm_plan_per_board(tree, board, affinity):
    plan = launch_logic.edge_llm_launch(root=str(BOARDS / tree))
    assert plan.board == board
    node, = plan.nodes
    kwargs = node.node_kwargs()
    assert node.lifecycle and kwargs['executable'] == 'llm_node'
    assert kwargs['name'] == 'llm_node' and kwargs['package'] == 'edge_llm_ros'
    params = kwargs['parameters'][0]
    assert params['board.name'] == board and params['autostart'] is True
    assert params['engine.cpu_affinity'] == affinity
    assert kwargs['ros_arguments'] == ['--log-level', 'info']
    assert kwargs['additional_env']['OPENBLAS_NUM_THREADS'] == '1'
    # Every parameter is one llm_node declares, with a value its schema accepts.
    schema = parameters.schema('llm_node')
    assert set(params) <= set(schema.names())
    schema.validate(params)
    assert 'board %s' % board in plan.messages[0]


def test_empty_lists_are_left_to_node_defaults():
    plan = launch_logic.edge_llm_launch(root=str(BOARDS / 'rpi5'))
    params = plan.nodes[0].parameters
    assert 'engine.provider_options' not in params          # [] cannot go through rcl YAML
    cuda = launch_logic.edge_llm_launch(root=str(BOARDS / 'orin_nx')).nodes[0].parameters
    assert cuda['engine.provider_options'][0] == 'CUDAExecutionProvider:device_id=0'


def _model_folder(path: pathlib.Path, name: str = 'SmolLM2-135M-Instruct',
                  architecture: str = 'llama') -> str:
    """Make a folder shaped like a converted model as far as launch looks (model.yaml)."""
    path.mkdir(parents=True)
    (path / 'model.yaml').write_text(f'name: {name}\narchitecture: {architecture}\n')
    return str(path)


def test_launch_arguments_override_params_file(tmp_path):
    params = tmp_path / 'robot.yaml'
    params.write_text('/**/llm_node:\n  ros__parameters:\n    model.path: /from/file\n'
                      '    autostart: false\n    max_tokens: 99\n')
    launched = _model_folder(tmp_path / 'from_launch')
    plan = launch_logic.edge_llm_launch('rpi5', model=launched, params_file=str(params),
                                        namespace='robot', log_level='debug', autostart='true',
                                        root=str(BOARDS / 'rpi5'))
    kwargs = plan.nodes[0].node_kwargs()
    assert kwargs['namespace'] == 'robot'
    assert kwargs['ros_arguments'] == ['--log-level', 'debug']
    p = kwargs['parameters'][0]
    assert (p['model.path'], p['autostart'], p['max_tokens']) == (launched, True, 99)
    keep = launch_logic.edge_llm_launch('rpi5', params_file=str(params),
                                        root=str(BOARDS / 'rpi5'))
    assert keep.nodes[0].parameters['model.path'] == '/from/file'


def test_model_argument_takes_a_folder_and_matches_its_family(tmp_path):
    folder = _model_folder(tmp_path / 'qwen3-0.6b', name='Qwen3-0.6B', architecture='qwen3')
    plan = launch_logic.edge_llm_launch('x86_64', model=folder, root=str(BOARDS / 'x86_64'))
    params = plan.nodes[0].parameters
    assert params['model.path'] == folder and params.get('model.family', '') == ''
    assert any(f'model {folder}: family qwen3' in m for m in plan.messages)
    parameters.schema('llm_node').validate(params)


def test_model_argument_takes_a_family_name_or_file(tmp_path):
    plan = launch_logic.edge_llm_launch('x86_64', model='qwen3', root=str(BOARDS / 'x86_64'))
    params = plan.nodes[0].parameters
    assert params['model.family'] == 'qwen3' and params.get('model.path', '') == ''
    assert any('model family qwen3' in m for m in plan.messages)
    parameters.schema('llm_node').validate(params)
    family_file = ROOT / 'config' / 'models' / 'smollm2.yaml'
    plan = launch_logic.pipeline_launch('x86_64', model=str(family_file),
                                        root=str(BOARDS / 'x86_64'))
    assert plan.nodes[-1].parameters['model.family'] == str(family_file)
    # The engine reads the same value: model.family goes to EngineConfig.model_family.
    assert parameters.engine_kwargs(dict(parameters.schema('llm_node').defaults(),
                                         **{'model.family': 'qwen3'}))['model_family'] == 'qwen3'


def test_model_argument_folder_without_family_runs_generic(tmp_path):
    folder = _model_folder(tmp_path / 'odd', name='OddModel', architecture='gemma9')
    plan = launch_logic.edge_llm_launch('x86_64', model=folder, root=str(BOARDS / 'x86_64'))
    assert plan.nodes[0].parameters['model.path'] == folder
    assert any('generic defaults' in m for m in plan.messages)


@pytest.mark.parametrize('make, words', [
    (lambda tmp: 'qwen9', ('model:=qwen9', 'unknown model family', 'smollm2')),
    (lambda tmp: str(tmp / 'missing'), ('no such folder',)),
    (lambda tmp: str(tmp), ('without model.yaml', 'edge-llm-convert')),
])
def test_bad_model_argument_fails_at_launch(tmp_path, make, words):
    with pytest.raises(launch_logic.ModelArgumentError) as err:
        launch_logic.edge_llm_launch('x86_64', model=make(tmp_path),
                                     root=str(BOARDS / 'x86_64'))
    assert isinstance(err.value, BringupError)
    for word in words:
        assert word in str(err.value)


def test_a_family_recommending_an_unknown_board_fails_at_launch(tmp_path):
    text = (ROOT / 'config' / 'models' / 'smollm2.yaml').read_text()
    assert 'board: x86_64' in text
    family = tmp_path / 'smollm2.yaml'
    family.write_text(text.replace('board: x86_64', 'board: pdp11'))
    with pytest.raises(launch_logic.ModelArgumentError) as err:
        launch_logic.edge_llm_launch('x86_64', model=str(family), root=str(BOARDS / 'x86_64'))
    assert "recommended.board: 'pdp11' is not one of" in str(err.value)
    assert str(family) in str(err.value)


@pytest.mark.parametrize('kwargs, words', [
    ({'autostart': 'yes'}, ('autostart', 'true or false')),
    ({'log_level': 'loud'}, ('log_level', 'debug, info')),
])
def test_bad_launch_arguments(kwargs, words):
    with pytest.raises(ParameterRangeError) as err:
        launch_logic.edge_llm_launch(root=str(BOARDS / 'x86_64'), **kwargs)
    for word in words:
        assert word in str(err.value)


def test_pipeline_plan_wires_pools_and_splits_cores():
    plan = launch_logic.pipeline_launch('auto', frame_source='/dev/video0', namespace='bot',
                                        root=str(BOARDS / 'rk3588'))
    names = [n.name for n in plan.nodes]
    assert names == ['frame_source', 'perception', 'llm_node']
    source, perception, llm = plan.nodes
    assert not source.lifecycle and not perception.lifecycle and llm.lifecycle
    assert source.parameters == {'pool.id': 'frames', 'source': '/dev/video0'}
    assert perception.parameters['input.pool_id'] == source.parameters['pool.id']
    assert perception.parameters['pool.id'] == 'embeddings'
    assert perception.parameters['engine.cpu_affinity'] == '0-3'     # A55 cluster
    assert llm.parameters['engine.cpu_affinity'] == '4-7'            # A76 clusters
    assert {n.namespace for n in plan.nodes} == {'bot'}
    default = launch_logic.pipeline_launch(root=str(BOARDS / 'rk3588'))
    assert 'source' not in default.nodes[0].parameters


def test_wrong_board_for_machine_fails_at_launch():
    with pytest.raises(AffinityError, match='valid cores: 0-3'):
        launch_logic.edge_llm_launch('rk3588', root=str(BOARDS / 'rpi5'))


@pytest.mark.parametrize('path', LAUNCH_FILES, ids=lambda p: p.name)
def test_launch_file_compiles(path, tmp_path):
    py_compile.compile(str(path), cfile=str(tmp_path / 'out.pyc'), doraise=True)


# ---- the launch files against a recording stand-in of the launch API ----------------------

class _Action:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


def _fake_launch_api():
    """Modules with the constructor signatures of launch / launch_ros (Humble..Jazzy)."""
    launch = types.ModuleType('launch')
    actions = types.ModuleType('launch.actions')
    substitutions = types.ModuleType('launch.substitutions')
    launch_ros = types.ModuleType('launch_ros')
    ros_actions = types.ModuleType('launch_ros.actions')

    class LaunchDescription:
        def __init__(self, initial_entities=None, *, deprecated_reason=None):
            self.entities = list(initial_entities or [])

    class DeclareLaunchArgument(_Action):
        def __init__(self, name, *, default_value=None, description=None, choices=None):
            super().__init__(name=name, default_value=default_value, description=description,
                             choices=choices)

    class LogInfo(_Action):
        def __init__(self, *, msg):
            super().__init__(msg=msg)

    class OpaqueFunction(_Action):
        def __init__(self, *, function, args=None, kwargs=None):
            super().__init__(function=function, args=args, kwargs=kwargs)

    class LaunchConfiguration:
        def __init__(self, variable_name, *, default=None):
            self.name = variable_name

        def perform(self, context):
            return context.launch_configurations[self.name]

    execute_process = {'additional_env', 'output', 'emulate_tty', 'respawn', 'cwd'}

    class Node(_Action):
        def __init__(self, *, executable, package=None, name=None, namespace=None,
                     exec_name=None, parameters=None, remappings=None, ros_arguments=None,
                     arguments=None, **kwargs):
            unknown = set(kwargs) - execute_process
            assert not unknown, 'not a launch_ros Node/ExecuteProcess argument: %s' % unknown
            super().__init__(executable=executable, package=package, name=name,
                             namespace=namespace, parameters=parameters,
                             ros_arguments=ros_arguments, **kwargs)

    class LifecycleNode(Node):
        def __init__(self, *, name, namespace, **kwargs):
            super().__init__(name=name, namespace=namespace, **kwargs)

    launch.LaunchDescription = LaunchDescription
    actions.DeclareLaunchArgument, actions.LogInfo = DeclareLaunchArgument, LogInfo
    actions.OpaqueFunction = OpaqueFunction
    substitutions.LaunchConfiguration = LaunchConfiguration
    ros_actions.Node, ros_actions.LifecycleNode = Node, LifecycleNode
    launch.actions, launch.substitutions, launch_ros.actions = actions, substitutions, ros_actions
    return {'launch': launch, 'launch.actions': actions, 'launch.substitutions': substitutions,
            'launch_ros': launch_ros, 'launch_ros.actions': ros_actions}


def _run_launch_file(monkeypatch, path, **arguments):
    for name, module in _fake_launch_api().items():
        monkeypatch.setitem(sys.modules, name, module)
    spec = importlib.util.spec_from_file_location(path.stem.replace('.', '_'), str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    description = module.generate_launch_description()
    declared = {e.kwargs['name']: e.kwargs for e in description.entities
                if type(e).__name__ == 'DeclareLaunchArgument'}
    opaque, = [e for e in description.entities if type(e).__name__ == 'OpaqueFunction']
    values = {name: spec['default_value'] for name, spec in declared.items()}
    values.update(arguments)
    context = types.SimpleNamespace(launch_configurations=values)
    return declared, opaque.kwargs['function'](context)


def test_edge_llm_launch_file_builds_lifecycle_node(monkeypatch, tmp_path):
    folder = _model_folder(tmp_path / 'm')
    declared, actions = _run_launch_file(monkeypatch, ROOT / 'launch' / 'edge_llm.launch.py',
                                         board='x86_64', namespace='lt', model=folder)
    assert list(declared) == [a.name for a in launch_logic.llm_arguments()]
    assert declared['log_level']['choices'] == list(launch_logic.LOG_LEVELS)
    assert declared['model']['choices'] is None
    kinds = [type(a).__name__ for a in actions]
    assert kinds == ['LogInfo', 'LogInfo', 'LifecycleNode']   # board, model family
    node = actions[2].kwargs
    assert (node['name'], node['namespace'], node['executable']) == ('llm_node', 'lt', 'llm_node')
    assert node['parameters'][0]['model.path'] == folder
    assert node['parameters'][0]['board.name'] == 'x86_64'


def test_pipeline_launch_file_builds_three_nodes(monkeypatch):
    _, actions = _run_launch_file(monkeypatch, ROOT / 'launch' / 'perception_pipeline.launch.py',
                                  board='x86_64')
    nodes = [a for a in actions if type(a).__name__ in ('Node', 'LifecycleNode')]
    assert [(type(a).__name__, a.kwargs['name']) for a in nodes] == [
        ('Node', 'frame_source'), ('Node', 'perception'), ('LifecycleNode', 'llm_node')]


def test_launch_file_reports_bringup_errors(monkeypatch):
    with pytest.raises(BringupError, match='unknown board'):
        _run_launch_file(monkeypatch, ROOT / 'launch' / 'edge_llm.launch.py', board='tx2')


def _embedding_folder(path: pathlib.Path) -> str:
    """Make a folder shaped like a converted embedding model as far as launch looks."""
    path.mkdir(parents=True)
    (path / 'model.yaml').write_text('name: bge-small\narchitecture: bert\nkind: embedding\n')
    return str(path)


def test_chat_and_embed_plan_puts_the_embedder_on_the_helper_cores(tmp_path):
    chat_model, embed_model = _model_folder(tmp_path / 'chat'), _embedding_folder(tmp_path / 'e')
    plan = launch_logic.chat_embed_launch('auto', model=chat_model, embed_model=embed_model,
                                          namespace='bot', root=str(BOARDS / 'rk3588'))
    chat, embedder = plan.nodes
    assert (chat.name, embedder.name) == ('llm_node', 'embedder')
    assert chat.lifecycle and embedder.lifecycle
    assert {chat.namespace, embedder.namespace} == {'bot'}
    assert chat.parameters['model.path'] == chat_model
    assert embedder.parameters['model.path'] == embed_model
    # RK3588: chat keeps the A76 clusters, the embedder takes the A55 cluster (perception's).
    assert (chat.parameters['engine.cpu_affinity'], chat.parameters['engine.intra_op_threads']
            ) == ('4-7', 4)
    assert (embedder.parameters['engine.cpu_affinity'],
            embedder.parameters['engine.intra_op_threads']) == ('0-3', 3)
    assert embedder.parameters['board.name'] == chat.parameters['board.name'] == 'rk3588'
    assert 'embedder on 0-3' in plan.messages[-1]


def test_chat_and_embed_plan_splits_an_unpinned_machine(tmp_path):
    plan = launch_logic.chat_embed_launch('x86_64', embed_model=_embedding_folder(tmp_path / 'e'),
                                          root=str(BOARDS / 'x86_64'))
    chat, embedder = plan.nodes
    assert (chat.parameters['engine.cpu_affinity'], chat.parameters['engine.intra_op_threads']
            ) == ('0-11', 12)
    assert (embedder.parameters['engine.cpu_affinity'],
            embedder.parameters['engine.intra_op_threads']) == ('12-15', 4)


@pytest.mark.parametrize('make, name, match', [
    (None, 'embedder', 'embed_model'),
    ('chat', 'embedder', 'not a converted embedding'),
    ('embedding', 'llm_node', 'embed_name'),
])
def test_chat_and_embed_plan_refuses_a_bad_embed_argument(tmp_path, make, name, match):
    folder = ''
    if make == 'chat':
        folder = _model_folder(tmp_path / 'c')
    elif make == 'embedding':
        folder = _embedding_folder(tmp_path / 'e')
    with pytest.raises(BringupError, match=match):
        launch_logic.chat_embed_launch('x86_64', embed_model=folder, embed_name=name,
                                       root=str(BOARDS / 'x86_64'))


def test_chat_and_embed_launch_file_builds_two_lifecycle_nodes(monkeypatch, tmp_path):
    folder = _embedding_folder(tmp_path / 'e')
    declared, actions = _run_launch_file(monkeypatch, ROOT / 'launch' / 'chat_and_embed.launch.py',
                                         board='x86_64', embed_model=folder)
    assert list(declared) == [a.name for a in launch_logic.chat_embed_arguments()]
    nodes = [a for a in actions if type(a).__name__ == 'LifecycleNode']
    assert [a.kwargs['name'] for a in nodes] == ['llm_node', 'embedder']
    assert nodes[1].kwargs['parameters'][0]['model.path'] == folder
