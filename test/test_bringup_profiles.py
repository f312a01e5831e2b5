"""Profiles: loading, resolution (auto and named), merge order, and every class of bad input."""
import pathlib
import textwrap

import pytest
import yaml

from edge_llm_ros.bringup import parameters, profiles
from edge_llm_ros.bringup.errors import (AffinityError, BringupError, ParameterRangeError,
                                         ParameterTypeError, ProfileFormatError, ThermalError,
                                         UnknownBoardError, UnknownParameterError)
from edge_llm_ros.runtime import model_config

BOARDS = pathlib.Path(__file__).parent / 'data' / 'boards'
SHIPPED = ('orin_agx', 'orin_nano', 'orin_nx', 'rk3588', 'rpi5', 'x86_64', 'x86_64_cuda')


def write(tmp_path, text, name='params.yaml'):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_all_seven_profiles_ship():
    assert profiles.available_boards() == SHIPPED


def test_every_model_family_recommends_a_shipped_board():
    for family in model_config.load_all().values():
        profiles.check_recommended_board(family.recommended_board, family.source)
    with pytest.raises(UnknownBoardError, match="fam.yaml: recommended.board: 'pdp11' is not "
                                                'one of orin_agx, '):
        profiles.check_recommended_board('pdp11', 'fam.yaml')


@pytest.mark.parametrize('board', SHIPPED)
def test_profile_loads_strictly_and_sets_board_essentials(board):
    profile = profiles.load_profile(board)
    llm = profile['llm_node']
    for key in ('engine.providers', 'engine.intra_op_threads', 'engine.cpu_affinity',
                'kv.max_context', 'kv.dtype', 'kv.prefix_reuse', 'model.default_size',
                'model.quantization', 'feedback.period_tokens', 'feedback.period_ms',
                'cpu.kernel', 'cuda.kernel_set', 'cuda.sm_arch', 'thermal.limit_c',
                'thermal.resume_c', 'thermal.zones', 'vision.max_image_tokens'):
        assert key in llm, '%s does not set %s' % (board, key)
    assert set(profile) == {'llm_node', 'perception'}
    values = dict(parameters.schema('llm_node').defaults(), **llm)
    parameters.check_consistency(values)
    gpu = 'CUDAExecutionProvider' in llm['engine.providers']
    assert (llm['cuda.kernel_set'] != 'none') == gpu
    if gpu:   # the GGUF-block kernels (kernels/kquant.cu) on every CUDA board
        assert llm['cuda.kernel_set'] == 'kquant'
    if board.startswith('orin'):
        assert llm['cuda.sm_arch'] == 'sm_87'
    # A 640x480 frame (391 Qwen2.5-VL tokens) fits on every board; none is left uncapped.
    assert 391 <= llm['vision.max_image_tokens'] < llm['kv.max_context']


def test_profiles_are_plain_ros_param_files():
    # rcl reads these files too: one node key with a ros__parameters mapping each.
    for board in SHIPPED:
        doc = yaml.safe_load((profiles.boards_dir() / ('%s.yaml' % board)).read_text())
        assert set(doc) == {'/**/llm_node', '/**/perception'}
        for section in doc.values():
            assert list(section) == ['ros__parameters']


def test_rk3588_pins_llm_to_a76_and_perception_to_a55():
    resolved = profiles.resolve('auto', root=str(BOARDS / 'rk3588'),
                                nodes=('llm_node', 'perception'))
    assert resolved.board == 'rk3588'
    assert resolved.nodes['llm_node']['engine.cpu_affinity'] == '4-7'
    assert resolved.nodes['perception']['engine.cpu_affinity'] == '0-3'
    fast = resolved.detected.fast_cores()
    assert fast == (4, 5, 6, 7)


@pytest.mark.parametrize('tree, board', [
    ('orin_agx', 'orin_agx'), ('orin_nx', 'orin_nx'), ('orin_nx_8gb', 'orin_nx'),
    ('orin_nano', 'orin_nano'), ('rpi5', 'rpi5'), ('rk3588', 'rk3588'),
    ('rk3588s_orangepi5', 'rk3588'), ('x86_64', 'x86_64'), ('x86_64_cuda', 'x86_64_cuda'),
])
def test_auto_resolves_every_recorded_board(tree, board):
    resolved = profiles.resolve('auto', root=str(BOARDS / tree), nodes=('llm_node', 'perception'))
    assert resolved.board == board
    llm = resolved.llm_params()
    assert llm['board.name'] == board
    assert set(llm) == set(parameters.schema('llm_node').names())
    assert resolved.origin['llm_node']['board.name'] == 'profile'
    assert resolved.origin['llm_node']['max_tokens'] == 'default'


def test_detected_gpu_arch_replaces_profile_default():
    resolved = profiles.resolve('auto', root=str(BOARDS / 'x86_64_cuda_rtx4090'))
    assert resolved.llm_params()['cuda.sm_arch'] == 'sm_89'
    assert resolved.origin['llm_node']['cuda.sm_arch'] == 'machine'
    assert any('RTX 4090' in note for note in resolved.notes)
    h100 = profiles.resolve('auto', root=str(BOARDS / 'x86_64_cuda'))
    assert h100.llm_params()['cuda.sm_arch'] == 'sm_90' and not h100.notes


def test_merge_order_profile_then_file_then_overrides(tmp_path):
    params = write(tmp_path, """\
        /**:
          ros__parameters:
            kv:
              max_context: 1024
            system_prompt: from file
        /**/llm_node:
          ros__parameters:
            max_tokens: 64
            kv.dtype: float32
    """)
    resolved = profiles.resolve('rpi5', params, {'llm_node': {'max_tokens': 32}},
                                root=str(BOARDS / 'rpi5'))
    llm, origin = resolved.llm_params(), resolved.origin['llm_node']
    assert (llm['kv.max_context'], origin['kv.max_context']) == (1024, 'params_file')
    assert (llm['kv.dtype'], origin['kv.dtype']) == ('float32', 'params_file')
    assert (llm['system_prompt'], origin['system_prompt']) == ('from file', 'params_file')
    assert (llm['max_tokens'], origin['max_tokens']) == (32, 'override')
    assert (llm['engine.cpu_affinity'], origin['engine.cpu_affinity']) == ('1-3', 'profile')
    assert (llm['queue.depth'], origin['queue.depth']) == (8, 'default')


def test_params_file_sections_follow_namespace_wildcards(tmp_path):
    params = write(tmp_path, """\
        /robot/llm_node:
          ros__parameters:
            max_tokens: 11
        /other/llm_node:
          ros__parameters:
            max_tokens: 22
        /robot:
          llm_node:
            ros__parameters:
              system_prompt: nested
    """)
    resolved = profiles.resolve('x86_64', params, namespace='/robot', root=str(BOARDS / 'x86_64'))
    assert resolved.llm_params()['max_tokens'] == 11
    assert resolved.llm_params()['system_prompt'] == 'nested'
    assert resolved.notes == ('%s: section(s) /other/llm_node match no node launched here '
                              "(llm_node in namespace '/robot'); ignored" % params,)


@pytest.mark.parametrize('key, name, namespace, matches', [
    ('/**', 'llm_node', '', True), ('/**', 'llm_node', '/a/b', True),
    ('/**/llm_node', 'llm_node', '/a/b', True), ('/**/llm_node', 'perception', '', False),
    ('llm_node', 'llm_node', '', True), ('llm_node', 'llm_node', '/robot', False),
    ('/*/llm_node', 'llm_node', '/robot', True), ('/*/llm_node', 'llm_node', '', False),
    ('/robot/**', 'llm_node', '/robot/arm', True), ('/robot/*', 'llm_node', '/robot', True),
])
def test_node_key_matching(key, name, namespace, matches):
    assert profiles.node_key_matches(key, name, namespace) is matches


# ---- bad input -------------------------------------------------------------------------

def test_unknown_board_lists_valid_boards():
    with pytest.raises(UnknownBoardError) as err:
        profiles.resolve('jetson_tx2', root=str(BOARDS / 'x86_64'))
    for board in ('auto',) + SHIPPED:
        assert board in str(err.value)


def test_auto_on_unsupported_machine_lists_valid_boards():
    with pytest.raises(UnknownBoardError) as err:
        profiles.resolve('auto', root=str(BOARDS / 'jetson_xavier_nx'))
    assert 'tegra194' in str(err.value) and 'orin_nx' in str(err.value)


def test_affinity_naming_missing_cores_lists_valid_cores():
    # The RK3588 profile pinned onto a 4-core Raspberry Pi tree.
    with pytest.raises(AffinityError) as err:
        profiles.resolve('rk3588', root=str(BOARDS / 'rpi5'))
    text = str(err.value)
    assert "'4-7'" in text and 'valid cores: 0-3' in text and 'profile' in text


def test_affinity_override_checked_against_machine():
    with pytest.raises(AffinityError, match='valid cores: 0-5'):
        profiles.resolve('orin_nx', None or '', {'llm_node': {'engine.cpu_affinity': '6-7'}},
                         root=str(BOARDS / 'orin_nx_8gb'))


@pytest.mark.parametrize('text, words', [
    ('/**/llm_node:\n  ros__parameters:\n    max_tokens: [1, 2\n', ('line', 'not valid YAML')),
    ('- just\n- a list\n', ('top level must be a mapping',)),
    ('/**/llm_node:\n  max_tokens: 3\n', ('neither a node name nor ros__parameters',)),
    ('/**/llm_node:\n  ros__parameters:\n    max_tokens:\n', ('max_tokens has no value',)),
    ('ros__parameters:\n  max_tokens: 3\n', ('must sit under a node name',)),
])
def test_malformed_params_file(tmp_path, text, words):
    path = write(tmp_path, text)
    with pytest.raises(BringupError) as err:
        profiles.resolve('x86_64', path, root=str(BOARDS / 'x86_64'))
    assert isinstance(err.value, (ProfileFormatError, ParameterTypeError))
    assert path in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_unknown_key_is_named_with_suggestion(tmp_path):
    path = write(tmp_path, '/**/llm_node:\n  ros__parameters:\n    kv.max_contxt: 512\n')
    with pytest.raises(UnknownParameterError) as err:
        profiles.resolve('x86_64', path, root=str(BOARDS / 'x86_64'))
    assert "'kv.max_contxt'" in str(err.value) and 'kv.max_context' in str(err.value)


@pytest.mark.parametrize('key, value, error, words', [
    ('thermal.limit_c', 85, ParameterTypeError, ('write 85.0',)),
    ('kv.max_context', '4096', ParameterTypeError, ('expected integer',)),
    ('kv.prefix_reuse', 'yes please', ParameterTypeError, ('expected bool',)),
    ('engine.providers', 'CPUExecutionProvider', ParameterTypeError, ('string array',)),
    ('kv.max_context', 10, ParameterRangeError, ('[64, 131072]',)),
    ('sampling.top_p', 0.0, ParameterRangeError, ('(0, 1]',)),
    ('sampling.min_p', 1.0, ParameterRangeError, ('[0, 1)',)),
    ('kv.dtype', 'float16', ParameterRangeError, ('float32, int8',)),
    ('engine.providers', ['CPUExecutionProvider', 'MagicProvider'], ParameterRangeError,
     ('MagicProvider',)),
    ('engine.providers', [], ParameterRangeError, ('at least 1',)),
    ('engine.cpu_affinity', '4-2', ParameterRangeError, ('backwards',)),
    ('engine.cpu_affinity', 'big cores', ParameterRangeError, ("'4-7'",)),
    ('engine.provider_options', ['CUDAExecutionProvider=1'], ParameterRangeError,
     ('Provider:key=value',)),
    ('cuda.sm_arch', 'orin', ParameterRangeError, ('sm_',)),
    ('model.default_size', 'big', ParameterRangeError, ('1.5B',)),
])
def test_bad_values_name_key_and_fix(tmp_path, key, value, error, words):
    path = write(tmp_path, yaml.safe_dump({'/**/llm_node': {'ros__parameters': {key: value}}}))
    with pytest.raises(error) as err:
        profiles.resolve('x86_64', path, root=str(BOARDS / 'x86_64'))
    assert key in str(err.value) and path in str(err.value)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize('overrides, error, words', [
    ({'thermal.resume_c': 95.0}, ThermalError, ('resume_c', 'below')),
    ({'engine.cpu_affinity': '0', 'engine.intra_op_threads': 2}, ParameterRangeError,
     ('exceeds the 1 core',)),
    ({'engine.provider_options': ['CUDAExecutionProvider:device_id=0']}, ParameterRangeError,
     ('not in engine.providers',)),
    ({'cuda.kernel_set': 'int4_decode'}, ParameterRangeError, ('needs cuda.sm_arch',)),
    ({'vision.max_image_tokens': 4096}, ParameterRangeError,
     ('vision.max_image_tokens = 4096 leaves no room in kv.max_context = 4096',)),
])
def test_inconsistent_settings_are_rejected(overrides, error, words):
    with pytest.raises(error) as err:
        profiles.resolve('x86_64', '', {'llm_node': overrides}, root=str(BOARDS / 'x86_64'))
    for word in words:
        assert word in str(err.value)


def test_params_file_section_for_no_launched_node_is_reported(tmp_path):
    path = write(tmp_path, '/**/llm_nod:\n  ros__parameters:\n    max_tokens: 3\n')
    resolved = profiles.resolve('x86_64', path, root=str(BOARDS / 'x86_64'))
    assert resolved.llm_params()['max_tokens'] == 256
    assert len(resolved.notes) == 1 and '/**/llm_nod' in resolved.notes[0]
    assert 'match no node launched here' in resolved.notes[0]


def test_missing_params_file(tmp_path):
    with pytest.raises(ProfileFormatError, match='cannot read parameters file'):
        profiles.resolve('x86_64', str(tmp_path / 'absent.yaml'), root=str(BOARDS / 'x86_64'))


def test_broken_profile_is_rejected_with_its_path(tmp_path):
    folder = tmp_path / 'boards'
    folder.mkdir()
    good = (profiles.boards_dir() / 'rpi5.yaml').read_text()
    (folder / 'rpi5.yaml').write_text(good.replace('kv.max_sessions: 4', 'kv.max_sesions: 4'))
    with pytest.raises(UnknownParameterError, match='kv.max_sesions'):
        profiles.load_profile('rpi5', folder)
    (folder / 'rpi5.yaml').write_text(good.replace('board.name: rpi5', 'board.name: rpi4'))
    with pytest.raises(ProfileFormatError, match="board.name must be 'rpi5'"):
        profiles.load_profile('rpi5', folder)
    (folder / 'rpi5.yaml').write_text(good.replace('/**/perception', '/**/camera'))
    with pytest.raises(ProfileFormatError, match="section '/\\*\\*/camera'"):
        profiles.load_profile('rpi5', folder)


def test_perception_section_passes_unknown_keys_through(tmp_path):
    path = write(tmp_path, """\
        /**/perception:
          ros__parameters:
            model.path: /models/siglip.onnx
            engine.intra_op_threads: 2
    """)
    resolved = profiles.resolve('rk3588', path, nodes=('llm_node', 'perception'),
                                root=str(BOARDS / 'rk3588'))
    perception = resolved.nodes['perception']
    assert perception['model.path'] == '/models/siglip.onnx'
    assert perception['engine.intra_op_threads'] == 2
    assert perception['engine.cpu_affinity'] == '0-3'


def test_flatten_overrides_types():
    out = profiles.flatten_overrides(['kv.max_context=4096', 'engine.cpu_affinity=1',
                                      'engine.providers=[CPUExecutionProvider]',
                                      'kv.prefix_reuse=false', 'system_prompt=Be brief: 2'])
    assert out == {'kv.max_context': 4096, 'engine.cpu_affinity': '1',
                   'engine.providers': ['CPUExecutionProvider'], 'kv.prefix_reuse': False,
                   'system_prompt': 'Be brief: 2'}
    with pytest.raises(ProfileFormatError):
        profiles.flatten_overrides(['kv.max_context'])
