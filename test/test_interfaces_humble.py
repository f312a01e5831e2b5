"""edge_llm_msgs builds on Humble: its .msg/.srv/.action use only what Humble's rosidl has.

Each file is parsed with rosidl_adapter's parser (the .msg grammar Humble's rosidl_adapter
shares: names, constants, default values, bounds). Every field type must be a ROS 2 primitive
or a message of a package that Humble releases (its distribution.yaml) and that
edge_llm_msgs declares, in package.xml and in rosidl_generate_interfaces' DEPENDENCIES.
Nothing in these files asks for a newer rosidl feature: type descriptions and type hashes
(Iron+) are generated, not written.
"""
import re
from typing import Iterator, List, Tuple

import pytest
from rosdistro_snapshot import dependencies, distribution_packages, require_keys, ROOT
from rosidl_adapter import parser

PACKAGE = 'edge_llm_msgs'
PKG_DIR = ROOT / PACKAGE
# ROS 2 primitives (rosidl_adapter also accepts ROS 1's 'time'/'duration': not on ROS 2).
PRIMITIVES = {'bool', 'byte', 'char', 'float32', 'float64', 'int8', 'uint8', 'int16', 'uint16',
              'int32', 'uint32', 'int64', 'uint64', 'string', 'wstring'}


def _interface_files() -> List[str]:
    return sorted(str(path.relative_to(PKG_DIR)) for kind in ('msg', 'srv', 'action')
                  for path in (PKG_DIR / kind).glob(f'*.{kind}'))


def _messages(relative: str):
    """Each message specification of one interface file (a srv/action has several)."""
    path = PKG_DIR / relative
    if relative.endswith('.msg'):
        return [parser.parse_message_file(PACKAGE, str(path))]
    if relative.endswith('.srv'):
        spec = parser.parse_service_file(PACKAGE, str(path))
        return [spec.request, spec.response]
    spec = parser.parse_action_file(PACKAGE, str(path))
    return [spec.goal, spec.result, spec.feedback]


def _field_types(relative: str) -> Iterator[Tuple[str, object]]:
    for message in _messages(relative):
        for item in message.fields:
            yield item.name, item.type
        for constant in message.constants:   # a constant's type is a primitive's name
            yield constant.name, parser.Type(constant.type)


def _cmake_dependencies() -> set:
    text = (PKG_DIR / 'CMakeLists.txt').read_text()
    match = re.search(r'rosidl_generate_interfaces\((.*?)\)', text, re.S)
    assert match, 'CMakeLists.txt has no rosidl_generate_interfaces(...)'
    words = match.group(1).split()
    return set(words[words.index('DEPENDENCIES') + 1:]) if 'DEPENDENCIES' in words else set()


def test_every_interface_file_is_generated():
    listed = set(re.findall(r'"((?:msg|srv|action)/[^"]+)"',
                            (PKG_DIR / 'CMakeLists.txt').read_text()))
    assert listed == set(_interface_files())


@pytest.mark.parametrize('relative', _interface_files())
def test_types_exist_in_humble(relative):
    humble = distribution_packages('humble')
    declared = {key for _, key in dependencies(PKG_DIR / 'package.xml')}
    cmake = _cmake_dependencies()
    own = {path.stem for path in (PKG_DIR / 'msg').glob('*.msg')}
    for name, field_type in _field_types(relative):
        where = f'{relative}: {name}'
        if field_type.is_primitive_type():
            assert field_type.type in PRIMITIVES, f'{where}: {field_type.type} is no ROS 2 type'
            continue
        package, message = field_type.pkg_name, field_type.type
        if package == PACKAGE:
            assert message in own, f'{where}: {PACKAGE}/{message} does not exist'
            continue
        assert package in declared, f'{where}: add <depend>{package}</depend> to package.xml'
        assert package in cmake, f'{where}: add {package} to DEPENDENCIES in CMakeLists.txt'
        require_keys([package])   # the snapshot (test/data/rosdistro) has the declared ones
        assert package in humble, f'{where}: {package} is not released for Humble'


def test_actions_depend_on_action_msgs():
    # rosidl_generate_interfaces refuses .action files without action_msgs (GoalInfo, ...).
    if list((PKG_DIR / 'action').glob('*.action')):
        assert 'action_msgs' in _cmake_dependencies()
        assert 'action_msgs' in {key for _, key in dependencies(PKG_DIR / 'package.xml')}


def test_version_3_queue_fields_parse_with_humble_types():
    """Issue 14's fields: plain primitives Humble has, constants inside their type's range."""
    goal, _, feedback = _messages('action/Generate.action')
    fields = {item.name: item.type.type for item in goal.fields}
    assert fields['priority'] == 'int16' and fields['preempt'] == 'bool'
    assert {item.name: item.type.type for item in feedback.fields}['paused'] == 'bool'
    constants = {c.name: (c.type, c.value) for c in goal.constants}
    assert constants['PRIORITY_MIN'] == ('int16', -100)
    assert constants['PRIORITY_MAX'] == ('int16', 100)
    assert constants['INTERFACE_VERSION'] == ('uint16', 9)
    transcript = {item.name: item.type.type
                  for item in _messages('msg/Transcript.msg')[0].fields}
    assert transcript['priority'] == 'int16' and transcript['preempt'] == 'bool'


def test_version_4_conversation_fields_parse_with_humble_types():
    """Issue 20's fields and services: primitives and our own ChatMessage, nothing newer."""
    goal, result, _ = _messages('action/Generate.action')
    assert {i.name: i.type.type for i in goal.fields}['history_mode'] == 'uint8'
    assert {i.name: i.type.type for i in result.fields}['dropped_turns'] == 'uint32'
    constants = {c.name: (c.type, c.value) for c in goal.constants}
    assert [constants[f'HISTORY_{m}'] for m in ('AUTO', 'APPEND', 'REPLACE')] == [
        ('uint8', 0), ('uint8', 1), ('uint8', 2)]
    transcript = {i.name: i.type for i in _messages('msg/Transcript.msg')[0].fields}
    assert transcript['history_mode'].type == 'uint8'
    assert transcript['session_turns'].type == 'ChatMessage'
    assert transcript['session_turns'].is_array
    request, response = _messages('srv/GetSession.srv')
    assert [i.name for i in request.fields] == ['session_id']
    assert {i.name: i.type.type for i in response.fields}['kv_bytes'] == 'uint64'
    _, listed = _messages('srv/ListSessions.srv')
    assert {i.name for i in listed.fields} >= {
        'session_ids', 'turn_counts', 'token_counts', 'kv_bytes'}


def test_version_6_image_fields_parse_with_humble_types():
    """Issue 22's fields: our own TensorHandle array and a bool, nothing newer."""
    goal, _, _ = _messages('action/Generate.action')
    fields = {i.name: i.type for i in goal.fields}
    assert fields['images'].pkg_name == PACKAGE and fields['images'].type == 'TensorHandle'
    assert fields['images'].is_array and not fields['images'].is_upper_bound
    assert fields['raw_prompt'].type == 'bool'
    transcript = {i.name: i.type for i in _messages('msg/Transcript.msg')[0].fields}
    assert transcript['images'].type == 'TensorHandle' and transcript['images'].is_array
    assert transcript['raw_prompt'].type == 'bool'
