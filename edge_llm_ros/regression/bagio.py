"""rosbag2 folders (mcap or sqlite3) of llm_node sessions, through the `rosbags` package.

No rclpy here: types are registered from the edge_llm_msgs .msg/.action texts, so type
hashes (RIHS01) match what rosidl generated, and bags can be read and checked anywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import functools
import os
from pathlib import Path
import re
import sys
import threading
from typing import Optional, Sequence

from rosbags.interfaces import Nodetype, Qos
from rosbags.rosbag2 import Reader, StoragePlugin, Writer
from rosbags.serde import SerdeError
from rosbags.typesys import get_types_from_msg, get_typestore, Stores, TypesysError
from rosbags.typesys.store import Typestore
import yaml

from edge_llm_ros.regression.cpu_class import (current_cpu_class, is_known, parse_cpu_class,
                                               UNKNOWN)
from edge_llm_ros.regression.errors import (BagContentError, BagCorruptError, BagNotFoundError,
                                            BagTypeMismatchError, CpuClassError,
                                            InterfaceDefinitionError, RegressionToolError)
from edge_llm_ros.regression.records import (feedback_from_msg, FeedbackRecord,
                                             tensor_handle_from_msg, TensorHandleRecord,
                                             transcript_from_msg, TranscriptRecord)

PKG = 'edge_llm_msgs'
TRANSCRIPT_TYPE = f'{PKG}/msg/Transcript'
TENSOR_HANDLE_TYPE = f'{PKG}/msg/TensorHandle'
FEEDBACK_TYPE = f'{PKG}/action/Generate_FeedbackMessage'
GOAL_TYPE = f'{PKG}/action/Generate_Goal'
RESULT_TYPE = f'{PKG}/action/Generate_Result'
STATUS_TYPE = 'action_msgs/msg/GoalStatusArray'
DIAGNOSTICS_TYPE = 'diagnostic_msgs/msg/DiagnosticArray'
DIAGNOSTICS_TOPIC = '/diagnostics'
STORAGES = ('mcap', 'sqlite3')
# metadata.yaml custom_data key of the recording machine's CPU class (regression.cpu_class).
CPU_CLASS_KEY = 'edge_llm_ros.cpu_class'

# The action's implicit feedback wrapper (rosidl generates it; no file holds it).
_FEEDBACK_MESSAGE_TEXT = (
    'unique_identifier_msgs/UUID goal_id\n'
    f'{PKG}/action/Generate_Feedback feedback\n')
_SEPARATOR = '=' * 80


@dataclass(frozen=True)
class LlmTopics:
    """Topic names of one llm_node (full node name, e.g. '/llm_node' or '/robot/llm_node')."""

    node: str = '/llm_node'

    def __post_init__(self) -> None:
        if not self.node.startswith('/') or self.node.endswith('/') or '//' in self.node:
            raise ValueError(
                f"node name '{self.node}' must be a full name like /llm_node or /ns/llm_node")

    @property
    def action(self) -> str:
        return f'{self.node}/generate'

    @property
    def transcript(self) -> str:
        return f'{self.node}/transcript'

    @property
    def feedback(self) -> str:
        return f'{self.action}/_action/feedback'

    @property
    def status(self) -> str:
        return f'{self.action}/_action/status'

    def core(self) -> dict:
        """Topics a regression bag needs, name -> type."""
        return {self.transcript: TRANSCRIPT_TYPE, self.feedback: FEEDBACK_TYPE,
                self.status: STATUS_TYPE}


# ---------------------------------------------------------------- interface types

def find_interface_dir(explicit: str = '') -> Path:
    """Folder holding msg/ and action/ of edge_llm_msgs.

    Order: `explicit`, then the installed package share (ament index, then this
    interpreter's prefix), then the source tree next to this package. The installed
    share wins because it is what the running nodes were built from.
    """
    candidates = []
    if explicit:
        candidates.append(Path(explicit))
    else:
        try:
            from ament_index_python.packages import get_package_share_directory
            candidates.append(Path(get_package_share_directory(PKG)))
        except (ImportError, LookupError, ValueError, OSError):
            pass  # no ament index in this environment: the next candidates still apply
        # A venv install (scripts/setup.sh) without AMENT_PREFIX_PATH set.
        candidates.append(Path(sys.prefix) / 'share' / PKG)
        candidates.append(Path(__file__).resolve().parents[2] / PKG)
    for folder in candidates:
        if (folder / 'msg' / 'Transcript.msg').is_file() and \
                (folder / 'action' / 'Generate.action').is_file():
            return folder
    raise InterfaceDefinitionError(
        f'cannot find the {PKG} interface files (msg/Transcript.msg, action/Generate.action) '
        f'in {", ".join(str(c) for c in candidates)}: build and install {PKG} '
        '(scripts/setup.sh) or pass the folder explicitly')


@dataclass
class Interfaces:
    """A rosbags typestore with edge_llm_msgs registered, plus raw definition texts."""

    typestore: Typestore
    folder: Path
    texts: dict = field(default_factory=dict)   # type name -> raw .msg text

    def rihs01(self, msgtype: str) -> str:
        return self.typestore.hash_rihs01(msgtype)

    def knows(self, msgtype: str) -> bool:
        return msgtype in self.typestore.fielddefs

    def msgdef(self, msgtype: str) -> str:
        """rosbag2 'ros2msg' definition: the type's text, then every dependency's.

        Own types keep their file text (comments included, as `ros2 bag record` stores
        them); other types come from rosbags' generated text.
        """
        order: list = []
        self._collect_deps(msgtype, order)
        parts = [self._own_text(msgtype)]
        for dep in order:
            parts.append(f'{_SEPARATOR}\nMSG: {_short_name(dep)}\n{self._own_text(dep)}')
        return ''.join(p if p.endswith('\n') else p + '\n' for p in parts)

    def _own_text(self, msgtype: str) -> str:
        if msgtype in self.texts:
            return self.texts[msgtype]
        text, _ = self.typestore.gendefhash(msgtype, {}, 2)
        return text

    def _collect_deps(self, msgtype: str, order: list) -> None:
        for _, desc in self.typestore.fielddefs[msgtype][1]:
            names = []
            if desc[0] == Nodetype.NAME:
                names.append(desc[1])
            elif desc[0] in (Nodetype.ARRAY, Nodetype.SEQUENCE) and \
                    desc[1][0][0] == Nodetype.NAME:
                names.append(desc[1][0][1])
            for name in names:
                if name not in order:
                    order.append(name)
                    self._collect_deps(name, order)


def _short_name(msgtype: str) -> str:
    """'pkg/msg/T' -> 'pkg/T' as in rosbag2 definitions; action types keep '/action/'."""
    pkg, kind, name = msgtype.split('/')
    return f'{pkg}/{name}' if kind == 'msg' else msgtype


def _split_action(text: str) -> list:
    parts = re.split(r'^---[ \t]*$', text, flags=re.MULTILINE)
    if len(parts) != 3:
        raise InterfaceDefinitionError(
            f'Generate.action must have goal, result and feedback sections separated by '
            f'"---" (found {len(parts)} sections)')
    return [p.lstrip('\n') for p in parts]


@functools.lru_cache(maxsize=8)
def load_interfaces(folder: str = '') -> Interfaces:
    """Register edge_llm_msgs (messages and the Generate action's parts) with rosbags."""
    root = find_interface_dir(folder)
    store = get_typestore(Stores.ROS2_JAZZY)
    texts = {}
    types = {}
    try:
        for path in sorted((root / 'msg').glob('*.msg')):
            name = f'{PKG}/msg/{path.stem}'
            texts[name] = path.read_text()
            types.update(get_types_from_msg(texts[name], name))
        goal, result, feedback = _split_action((root / 'action' / 'Generate.action').read_text())
        for suffix, text in (('Goal', goal), ('Result', result), ('Feedback', feedback)):
            texts[f'{PKG}/action/Generate_{suffix}'] = text
        texts[FEEDBACK_TYPE] = _FEEDBACK_MESSAGE_TEXT
        for name in (GOAL_TYPE, RESULT_TYPE, f'{PKG}/action/Generate_Feedback', FEEDBACK_TYPE):
            types.update(get_types_from_msg(texts[name], name))
        store.register(types)
    except (OSError, UnicodeDecodeError) as exc:
        raise InterfaceDefinitionError(f'cannot read the interface files in {root}: {exc}')
    except TypesysError as exc:
        raise InterfaceDefinitionError(
            f'cannot parse the interface files in {root}: {exc}') from exc
    return Interfaces(typestore=store, folder=root, texts=texts)


# ---------------------------------------------------------------- writing

def wire_cdr(msg, msgtype: str, store: Optional[Typestore] = None) -> bytes:
    """Return the CDR bytes of a message (rclpy's or any with its fields) as the wire has them.

    The bytes a subscription receives (and `ros2 bag record` stores) are what rosbags reads.
    rclpy's serialize_message differs from them for an empty float64 sequence at some
    offsets (a Transcript without clip timestamps after a 7-byte stop string): it pads the
    sequence to 8 where the wire does not, so rosbags could not read back the transcripts
    replay wrote. Messages written into bags go through rosbags' own types here instead.
    """
    store = store or load_interfaces().typestore
    return bytes(store.serialize_cdr(_as_rosbags(store, msg, msgtype), msgtype))


def _as_rosbags(store: Typestore, value, msgtype: str):
    """Copy a message's fields into the typestore's class of msgtype (nested, recursively)."""
    fields = {}
    for name, (kind, detail) in store.fielddefs[msgtype][1]:
        item = getattr(value, name)
        if kind == Nodetype.NAME:
            item = _as_rosbags(store, item, detail)
        elif kind in (Nodetype.ARRAY, Nodetype.SEQUENCE):
            (sub_kind, sub), _ = detail
            if sub_kind == Nodetype.NAME:
                item = [_as_rosbags(store, x, sub) for x in item]
            elif sub[0] == 'string':
                item = [str(x) for x in item]
            else:   # a numeric array: rosbags takes numpy arrays of the element type
                import numpy as np
                item = np.asarray(item, dtype=_NUMPY_TYPES.get(sub[0], sub[0]))
        fields[name] = item
    return store.types[msgtype](**fields)


# ROS primitive names numpy spells otherwise.
_NUMPY_TYPES = {'float32': 'float32', 'float64': 'float64', 'byte': 'uint8', 'char': 'uint8',
                'bool': 'bool', 'octet': 'uint8'}


class BagWriter:
    """Thread-safe rosbag2 writer of raw CDR messages for known interface types.

    The bag's custom_data records the CPU class of the machine that produced the answers
    (`cpu_class`; None: this machine's; UNKNOWN: not recorded), which decides how replays
    compare greedy outputs (docs/regression.md, "Replaying on another machine").
    """

    def __init__(self, path: str | os.PathLike, interfaces: Optional[Interfaces] = None,
                 storage: str = 'mcap', cpu_class: Optional[str] = None) -> None:
        if storage not in STORAGES:
            raise ValueError(f"storage '{storage}' is not one of {', '.join(STORAGES)}")
        # Checked before anything is created on disk.
        self.cpu_class = current_cpu_class() if cpu_class is None else parse_cpu_class(
            cpu_class)
        self.path = Path(path)
        if self.path.exists():
            raise RegressionToolError(
                f'{self.path} already exists: choose a new bag folder (bags are never '
                'overwritten)')
        self.interfaces = interfaces or load_interfaces()
        plugin = StoragePlugin.MCAP if storage == 'mcap' else StoragePlugin.SQLITE3
        self._writer = Writer(self.path, version=Writer.VERSION_LATEST, storage_plugin=plugin)
        self._writer.open()
        self._connections: dict = {}
        self._lock = threading.Lock()
        self.counts: dict = {}
        if is_known(self.cpu_class):
            self._writer.set_custom_data(CPU_CLASS_KEY, self.cpu_class)

    def add_topic(self, topic: str, msgtype: str, qos: Sequence[Qos] = ()) -> None:
        """Declare a topic (once); `qos` is the publishers' offered QoS, stored as metadata."""
        with self._lock:
            if topic in self._connections:
                return
            if not self.interfaces.knows(msgtype):
                raise RegressionToolError(
                    f"cannot record {topic}: type '{msgtype}' is not known to this build")
            self._connections[topic] = self._writer.add_connection(
                topic, msgtype, msgdef=self.interfaces.msgdef(msgtype),
                rihs01=self.interfaces.rihs01(msgtype), offered_qos_profiles=list(qos))
            self.counts[topic] = 0

    def write(self, topic: str, stamp_ns: int, data: bytes) -> None:
        """Append one serialized (CDR) message; `add_topic` must have been called."""
        with self._lock:
            if self._writer is None:
                raise RegressionToolError(f'bag {self.path} is closed: cannot write {topic}')
            self._writer.write(self._connections[topic], int(stamp_ns), bytes(data))
            self.counts[topic] += 1

    def set_custom_data(self, key: str, value: str) -> None:
        """Store a key/value in metadata.yaml's custom_data (before close)."""
        with self._lock:
            if self._writer is not None:
                self._writer.set_custom_data(key, value)

    def close(self) -> None:
        """Finish the bag (writes metadata.yaml); safe to call twice."""
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None

    def __enter__(self) -> 'BagWriter':
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------- reading

@dataclass
class TopicCheck:
    """One topic of a bag and whether its type matches this build's interfaces."""

    topic: str
    msgtype: str
    count: int
    digest: str
    expected: str = ''
    status: str = 'ok'      # ok | older (decoded with the bag's definition) | mismatch |
    #                         unverified | unknown


@dataclass
class BagContents:
    """What a regression bag holds, plus every problem met while reading it."""

    path: str
    storage: str = ''
    transcripts: list = field(default_factory=list)       # TranscriptRecord, bag order
    feedback: dict = field(default_factory=dict)          # goal id -> [FeedbackRecord]
    tensor_handles: list = field(default_factory=list)    # (topic, TensorHandleRecord)
    diagnostics_count: int = 0
    topics: list = field(default_factory=list)            # TopicCheck
    problems: list = field(default_factory=list)          # str, input problems
    warnings: list = field(default_factory=list)          # str, worth knowing only
    complete: bool = True
    custom: dict = field(default_factory=dict)            # metadata.yaml custom_data

    def problem(self, text: str) -> None:
        self.problems.append(text)
        self.complete = False

    @property
    def cpu_class(self) -> str:
        """Return the recording machine's CPU class; UNKNOWN when the bag does not say.

        Bags of a stock `ros2 bag record`, or written before the key existed (like
        test/data/bags/smollm2_greedy), do not say.
        """
        try:
            return parse_cpu_class(str(self.custom.get(CPU_CLASS_KEY, '')))
        except CpuClassError:
            return UNKNOWN


def _bag_metadata(path: Path) -> tuple:
    """(storage id, custom_data) of a bag folder or single storage file."""
    if not path.is_dir():
        return {'.mcap': 'mcap', '.db3': 'sqlite3'}.get(path.suffix, '?'), {}
    meta = yaml.safe_load((path / 'metadata.yaml').read_text(errors='replace'))
    info = meta.get('rosbag2_bagfile_information', {}) if isinstance(meta, dict) else {}
    custom = info.get('custom_data') or {}
    return str(info.get('storage_identifier', '?')), dict(custom)


def _check_cpu_class(contents: BagContents) -> None:
    """Warn about a malformed stored CPU class (it then counts as unknown)."""
    try:
        parse_cpu_class(str(contents.custom.get(CPU_CLASS_KEY, '')))
    except CpuClassError as exc:
        contents.warnings.append(f'metadata.yaml custom_data {CPU_CLASS_KEY}: {exc}; the '
                                 'recording CPU class counts as unknown')


def _check_topic(conn, interfaces: Interfaces) -> TopicCheck:
    check = TopicCheck(conn.topic, conn.msgtype, conn.msgcount, conn.digest or '')
    if not interfaces.knows(conn.msgtype):
        check.status = 'unknown'
        return check
    check.expected = interfaces.rihs01(conn.msgtype)
    if conn.digest:
        check.status = 'ok' if conn.digest == check.expected else 'mismatch'
        return check
    # Bags without a type hash (Humble, or definitions left empty): hash the stored text.
    if conn.msgdef.data:
        try:
            scratch = get_typestore(Stores.EMPTY)
            scratch.register(get_types_from_msg(conn.msgdef.data, conn.msgtype))
            check.digest = scratch.hash_rihs01(conn.msgtype)
        except (TypesysError, KeyError):  # unparsable, or a dependency's text is missing
            check.status = 'unverified'
            return check
        check.status = 'ok' if check.digest == check.expected else 'mismatch'
        return check
    check.status = 'unverified'
    return check


def _own_typestore(conn) -> Optional[Typestore]:
    """Return a typestore with the definitions the bag stored for `conn` (None: none usable).

    Bags of an older interface version (see regression.legacy) are decoded this way: rosbag2
    stores each topic's full definition (the type and every type it uses).
    """
    if not conn.msgdef.data:
        return None
    try:
        store = get_typestore(Stores.ROS2_JAZZY)
        store.register(get_types_from_msg(conn.msgdef.data, conn.msgtype))
    except (TypesysError, KeyError):
        return None
    return store


def read_bag(path: str | os.PathLike, interfaces: Optional[Interfaces] = None,
             tensor_topics: Sequence[str] = ()) -> BagContents:
    """Read transcripts, feedback and tensor handles of a regression bag.

    Topics recorded with another version of their type are decoded with the definitions the
    bag stored (older records are then upgraded by regression.legacy). Raises
    BagNotFoundError / BagCorruptError when nothing can be read and BagTypeMismatchError
    when the transcripts were recorded with another Transcript version and the bag holds
    no definition of it. Damage after the start (a truncated file, an undecodable message) and
    mismatches on optional topics are listed in `problems` and `complete` is False:
    the caller keeps what was read and reports it.
    """
    interfaces = interfaces or load_interfaces()
    bag = Path(path)
    if not bag.exists():
        raise BagNotFoundError(
            f'bag {bag} does not exist: pass a rosbag2 folder (with metadata.yaml) or a .mcap '
            'file recorded with edge-llm-record or ros2 bag record')
    if bag.is_dir() and not (bag / 'metadata.yaml').is_file():
        raise BagNotFoundError(
            f'{bag} is a folder without metadata.yaml, so not a rosbag2 bag: pass the bag '
            'folder itself (or its .mcap file directly if the recorder was killed before '
            'writing metadata.yaml)')
    contents = BagContents(path=str(bag))
    # The excepts around rosbags stay broad on purpose: a damaged file makes rosbags and its
    # storage libraries raise ReaderError, UnicodeDecodeError, OverflowError, MemoryError,
    # apsw.CorruptError, yaml errors... (found by truncating and corrupting bags).
    try:
        contents.storage, contents.custom = _bag_metadata(bag)
        reader = Reader(bag)
        reader.open()
    except Exception as exc:  # see above
        raise BagCorruptError(f'cannot open bag {bag}: {type(exc).__name__}: {exc}') from exc
    _check_cpu_class(contents)
    try:
        _read_messages(reader, contents, interfaces, set(tensor_topics))
    finally:
        try:
            reader.close()
        except Exception:  # closing a damaged file may fail again, in any of those ways
            pass
    if not contents.transcripts and contents.complete:
        raise BagContentError(
            f'bag {bag} holds no {TRANSCRIPT_TYPE} messages: record the transcript topic '
            'of llm_node (see docs/regression.md)')
    return contents


def _read_messages(reader: Reader, contents: BagContents, interfaces: Interfaces,
                   tensor_topics: set) -> None:
    wanted = []
    stores = {}   # connection id -> typestore of the bag's own definitions
    older = {}    # connection id -> (connection, why it is decoded with them)
    for conn in reader.connections:
        check = _check_topic(conn, interfaces)
        contents.topics.append(check)
        if check.status == 'mismatch':
            text = (f'topic {conn.topic} was recorded with another version of '
                    f'{conn.msgtype} (bag hash {check.digest}, this build {check.expected})')
            own = _own_typestore(conn)
            if own is not None:
                check.status = 'older'
                stores[conn.id] = own
                older[conn.id] = (conn, text)
                contents.warnings.append(f'{text}: decoded with the definition stored in the '
                                         'bag')
            elif conn.msgtype == TRANSCRIPT_TYPE:
                raise BagTypeMismatchError(
                    f'{text}, and the bag holds no definition of it: its goals cannot be '
                    'decoded. Replay it with the edge_llm_msgs version it was recorded with, '
                    'or re-record the session with this build')
            else:
                contents.problem(text + ': topic skipped')
                continue
        if check.status == 'unverified':
            contents.warnings.append(
                f'topic {conn.topic} has no type hash or definition: assumed to be the '
                f'{conn.msgtype} of this build')
        if conn.msgtype in (TRANSCRIPT_TYPE, FEEDBACK_TYPE, DIAGNOSTICS_TYPE) or (
                conn.msgtype == TENSOR_HANDLE_TYPE and
                (not tensor_topics or conn.topic in tensor_topics)):
            wanted.append(conn)
    if not wanted:
        return
    decode_errors = 0
    unusable = {}   # connection id -> why its (older) messages make no record
    try:
        for conn, stamp, data in reader.messages(connections=wanted):
            if conn.id in unusable:
                continue
            try:
                store = stores.get(conn.id, interfaces.typestore)
                msg = store.deserialize_cdr(data, conn.msgtype)
            except SerdeError as exc:  # a damaged message: keep going
                decode_errors += 1
                if decode_errors <= 3:
                    contents.problem(
                        f'undecodable {conn.msgtype} message on {conn.topic} at {stamp} ns: '
                        f'{type(exc).__name__}: {exc}')
                continue
            try:
                _store(contents, conn, stamp, msg)
            except (AttributeError, TypeError) as exc:
                if conn.id not in older:
                    raise
                unusable[conn.id] = (f'{older[conn.id][1]}, and the definition stored in the '
                                     f'bag lacks what this build reads ({exc})')
    except Exception as exc:  # damaged storage: any of the kinds listed in read_bag
        contents.problem(
            f'bag storage is damaged after {len(contents.transcripts)} transcripts: '
            f'{type(exc).__name__}: {exc}; the messages before the damage are used')
    if decode_errors > 3:
        contents.problem(f'{decode_errors} undecodable messages in total')
    for conn_id, why in unusable.items():
        if older[conn_id][0].msgtype == TRANSCRIPT_TYPE:
            raise BagTypeMismatchError(
                f'{why}: its goals cannot be decoded. Replay it with the edge_llm_msgs '
                'version it was recorded with, or re-record the session with this build')
        contents.problem(why + ': topic skipped')


def _store(contents: BagContents, conn, stamp: int, msg) -> None:
    if conn.msgtype == TRANSCRIPT_TYPE:
        contents.transcripts.append(transcript_from_msg(msg, stamp, conn.topic))
    elif conn.msgtype == FEEDBACK_TYPE:
        record: FeedbackRecord = feedback_from_msg(msg, stamp)
        contents.feedback.setdefault(record.goal_id, []).append(record)
    elif conn.msgtype == TENSOR_HANDLE_TYPE:
        handle: TensorHandleRecord = tensor_handle_from_msg(msg)
        contents.tensor_handles.append((conn.topic, handle))
    elif conn.msgtype == DIAGNOSTICS_TYPE:
        contents.diagnostics_count += 1


def goal_id_of_raw(data: bytes) -> str:
    """Goal id (hex) of a raw Transcript or Generate_FeedbackMessage.

    Both start with the 16-byte goal UUID right after the 4-byte CDR header, so live
    tools can filter by goal without deserializing.
    """
    return bytes(data[4:20]).hex()


__all__ = [
    'BagContents', 'BagWriter', 'CPU_CLASS_KEY', 'DIAGNOSTICS_TOPIC', 'DIAGNOSTICS_TYPE',
    'FEEDBACK_TYPE', 'Interfaces', 'LlmTopics', 'STATUS_TYPE', 'TENSOR_HANDLE_TYPE',
    'TRANSCRIPT_TYPE',
    'TopicCheck', 'TranscriptRecord', 'goal_id_of_raw', 'load_interfaces', 'read_bag']
