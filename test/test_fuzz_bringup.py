"""Property tests: random and hostile board profiles, params files and launch overrides.

Contract (edge_llm_ros/bringup): whatever YAML a profile, a user params file or a launch
override holds, resolution returns validated parameters or raises a BringupError subclass
whose message names the file and the value, within a time bound (no alias bombs, no
unbounded CPU lists, no recursion limit).
"""
import pathlib
import shutil

from fuzz_support import accepted_or_typed, fuzz, JUNK
from hypothesis import example, given, strategies as st
import pytest
import yaml

from edge_llm_ros.bringup import parameters
from edge_llm_ros.bringup.affinity import parse_cpu_list
from edge_llm_ros.bringup.errors import BringupError
from edge_llm_ros.bringup.profiles import (boards_dir, flatten_overrides, load_profile,
                                           parse_param_text, resolve)

TIMEOUT_S = 10.0
BOARD = 'x86_64'
NAMES = tuple(s.name for s in parameters.schema('llm_node').specs)


def _typed(fn, what):
    return accepted_or_typed(fn, (BringupError,), TIMEOUT_S, what, isolate=True)


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                    st.text(max_size=12), st.sampled_from(['0-3', '0-999999999', '1,1,1',
                                                           'CPUExecutionProvider', '']))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=10)
node_keys = st.sampled_from(['/**/llm_node', '/**/perception', 'llm_node', '/robot/llm_node',
                             '/**', '*', '', 'ros__parameters', '/**/other'])


@st.composite
def params_documents(draw):
    """Documents shaped like ROS params files, with random names and values."""
    doc = {}
    for key in draw(st.lists(node_keys, max_size=3)):
        params = draw(st.dictionaries(st.one_of(st.sampled_from(NAMES), st.text(max_size=8)),
                                      values, max_size=6))
        doc[key] = draw(st.sampled_from([{'ros__parameters': params}, params,
                                         {'ros__parameters': draw(scalars)}]))
    return doc


@fuzz(150)
@given(text=st.one_of(st.text(max_size=300), params_documents().map(yaml.safe_dump)))
@example(text='a: !!python/object/apply:os.system ["id"]')
@example(text='/**/llm_node: {ros__parameters: {kv: &a {x: *a}}}')
def test_any_text_parses_or_raises_a_bringup_error(text):
    _typed(lambda: parse_param_text(text, 'fuzz.yaml'), 'parse_param_text')


def _profile_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    out = tmp_path / 'boards'
    if not out.is_dir():
        shutil.copytree(boards_dir(), out)
    return out


@fuzz(60)
@given(doc=params_documents())
def test_random_profiles_load_or_raise(tmp_path, doc):
    folder = _profile_dir(tmp_path)
    (folder / f'{BOARD}.yaml').write_text(yaml.safe_dump(doc))
    _typed(lambda: load_profile(BOARD, folder), 'load_profile')


REAL = yaml.safe_load((boards_dir() / f'{BOARD}.yaml').read_text())


@fuzz(100)
@given(name=st.one_of(st.sampled_from(NAMES), st.text(max_size=10)), value=values,
       drop=st.booleans(), section=st.sampled_from(['/**/llm_node', '/**/perception']))
@example(name='engine.cpu_affinity', value='0-4000000000', drop=False,
         section='/**/llm_node')
@example(name='engine.cpu_affinity', value='0-3,' * 5000 + '0', drop=False,
         section='/**/llm_node')
def test_one_mutated_value_of_a_real_profile(tmp_path, name, value, drop, section):
    folder = _profile_dir(tmp_path)
    doc = yaml.safe_load(yaml.safe_dump(REAL))
    params = doc[section]['ros__parameters']
    if drop:
        params.pop(name, None)
    else:
        params[name] = value
    (folder / f'{BOARD}.yaml').write_text(yaml.safe_dump(doc))
    ok, resolved = _typed(lambda: resolve(BOARD, config_dir=folder, root='/'), 'resolve')
    if ok:
        # Whatever resolves is what the schema allows, value by value.
        llm = parameters.schema('llm_node')
        for key, val in resolved.llm_params().items():
            llm.get(key).validate(val)


@fuzz(80)
@given(doc=params_documents(), pairs=st.lists(st.one_of(
    st.tuples(st.sampled_from(NAMES), st.text(max_size=12)).map('='.join),
    st.text(max_size=20)), max_size=4))
def test_random_params_files_and_overrides_resolve_or_raise(tmp_path, doc, pairs):
    params_file = tmp_path / 'user.yaml'
    params_file.write_text(yaml.safe_dump(doc))
    ok, overrides = _typed(lambda: flatten_overrides(pairs), 'flatten_overrides')
    _typed(lambda: resolve(BOARD, params_file=str(params_file),
                           overrides={'llm_node': overrides} if ok else None, root='/'),
           'resolve')


def _laughs(levels: int) -> str:
    """Build an alias bomb: each level refers twice to the one below (2**levels leaves)."""
    lines = ['/**/llm_node:', '  ros__parameters:', '    l0: &l0 {a: 1, b: 1}']
    lines += [f'    l{i}: &l{i} {{a: *l{i - 1}, b: *l{i - 1}}}' for i in range(1, levels)]
    return '\n'.join(lines) + '\n'


HOSTILE = {
    'alias bomb 2**30': _laughs(30),
    'nested lists 5000 deep': 'a: ' + '[' * 5000 + ']' * 5000,
    'nested mappings 3000 deep': '/**/n:\n  ros__parameters:\n    ' + 'a: {' * 3000 + 'b: 1' +
                                 '}' * 3000,
    'nested namespaces 2000 deep': ''.join('  ' * i + f'/n{i}:\n' for i in range(2000)) +
                                   '  ' * 2000 + 'ros__parameters: {a: 1}\n',
    'python tag': 'a: !!python/object/apply:os.system ["touch /tmp/pwned"]',
    'huge CPU list': '/**/llm_node:\n  ros__parameters:\n    engine.cpu_affinity: '
                     '"0-4000000000"\n',
}


@pytest.mark.parametrize('name', sorted(HOSTILE))
def test_hostile_params_files_are_refused_in_bounded_time(tmp_path, name):
    path = tmp_path / 'hostile.yaml'
    path.write_text(HOSTILE[name])
    ok, _ = _typed(lambda: resolve(BOARD, params_file=str(path), root='/'), 'resolve')
    assert not ok, f'{name} was accepted'
    assert not pathlib.Path('/tmp/pwned').exists()


@fuzz(100)
@given(text=st.one_of(st.text(max_size=30), st.from_regex(r'[0-9]{1,12}(-[0-9]{1,12})?(,[0-9]'
                                                          r'{1,12}(-[0-9]{1,12})?){0,3}',
                                                          fullmatch=True)), junk=JUNK)
def test_cpu_lists_parse_or_raise_in_bounded_time(text, junk):
    ok, cpus = _typed(lambda: parse_cpu_list(text), 'parse_cpu_list')
    if ok:
        assert len(cpus) <= 65536 and list(cpus) == sorted(set(cpus))
    _typed(lambda: parameters.schema('llm_node').get('engine.cpu_affinity').validate(junk),
           'validate')
