"""Fixed-budget fuzz campaign on tensor-handle decoding (issue 8).

    .venv/bin/python bench/fuzz_campaign.py [--budget-s 60] [--targets all] [--engine auto]
                                            [--json bench/results/fuzz.json]

Each target is one way untrusted bytes become a TensorDescriptor or reach a producer:

  descriptor_unpack   TensorDescriptor.unpack of raw bytes (the pool socket's FRAME payload)
  descriptor_fields   TensorDescriptor(...) from fuzzed field values (ints, text, lists)
  handle_msg          a real edge_llm_msgs/TensorHandle -> from_msg -> check_fits
  producer_socket     raw datagrams sent to a live TensorPool by a connected consumer
  consumer_frames     FRAME messages from a lying producer decoded by a TensorResolver

A finding is any exception other than the typed errors the code documents (DescriptorError,
IpcError...), or a broken invariant of an accepted descriptor (pack round trip, bounds).
Findings are recorded and the campaign continues; each target runs in its own process under
libFuzzer (atheris, coverage-guided) when importable, else under hypothesis for the same
budget. Prints one JSON object and a table: executions, executions/s, coverage, findings.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
TARGETS = ('descriptor_unpack', 'descriptor_fields', 'handle_msg', 'producer_socket',
           'consumer_frames')


# --- a FuzzedDataProvider that needs no atheris (both engines feed targets raw bytes) -----
class Bytes:
    """Consume typed values from a byte string, deterministically; zeros once exhausted."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk.ljust(n, b'\0')

    def uint(self, nbytes: int) -> int:
        return int.from_bytes(self.take(nbytes), 'little')

    def pick(self, options):
        return options[self.uint(1) % len(options)]

    def integer(self) -> int:
        """Mostly small, sometimes huge or negative: where validation bugs hide."""
        mode = self.uint(1) % 8
        if mode < 4:
            return self.uint(1) - 2
        if mode < 6:
            return self.uint(8)
        if mode == 6:
            return -self.uint(8) - 1
        return self.uint(16)

    def text(self, limit: int = 16) -> str:
        return self.take(self.uint(1) % (limit + 1)).decode('utf-8', 'replace')

    def value(self):
        """Return a field value of any type a duck-typed message might carry."""
        kind = self.uint(1) % 10
        if kind < 5:
            return self.integer()
        return [None, True, 1.5, self.text(), [self.integer() for _ in range(self.uint(1) % 4)]
                ][kind - 5]


# --- targets ---------------------------------------------------------------------------
class Finding(Exception):
    """A broken invariant (raised by the harness, recorded like an untyped exception)."""


def _check(desc) -> None:
    from edge_llm_ros.ipc.descriptor import DTYPES, TensorDescriptor
    from edge_llm_ros.ipc.errors import DescriptorError
    if desc.dtype not in DTYPES or desc.nbytes != desc.span():
        raise Finding(f'accepted an inconsistent descriptor {desc}')
    if TensorDescriptor.unpack(desc.pool_id, desc.pack()) != desc:
        raise Finding(f'pack/unpack round trip changed {desc}')
    end = desc.byte_offset + desc.nbytes
    desc.check_fits(end, desc.slot + 1)
    if desc.nbytes:
        try:
            desc.check_fits(end - 1, desc.slot + 1)
        except DescriptorError:
            pass
        else:
            raise Finding(f'{desc} fits a buffer one byte too small')


def target_descriptor_unpack(data: bytes) -> None:
    from edge_llm_ros.ipc.descriptor import TensorDescriptor
    from edge_llm_ros.ipc.errors import DescriptorError
    try:
        desc = TensorDescriptor.unpack('cam', data)
    except DescriptorError:
        return
    _check(desc)


def target_descriptor_fields(data: bytes) -> None:
    from edge_llm_ros.ipc.descriptor import DTYPES, TensorDescriptor
    from edge_llm_ros.ipc.errors import DescriptorError
    b = Bytes(data)
    dims = [b.pick([0, 1, 2, 3, 7, 64]) if b.uint(1) % 4 else b.integer()
            for _ in range(b.uint(1) % 6)]
    fields = {'pool_id': b.pick(['cam', '', '../x', 'a' * 65, b.text()]),
              'slot': b.integer(), 'generation': b.integer(), 'sequence': b.integer(),
              'buffer_kind': b.integer() if b.uint(1) % 2 else b.value(),
              'dtype': b.pick(list(DTYPES) + ['object', b.text()]), 'shape': dims,
              'strides': [b.integer() * 4 for _ in range(b.uint(1) % 5)] if b.uint(1) % 2
              else (), 'byte_offset': b.integer(), 'nbytes': b.pick([-1, b.integer()])}
    if b.uint(1) % 4 == 0:
        fields[b.pick(sorted(fields))] = b.value()
    try:
        desc = TensorDescriptor(**fields)
    except DescriptorError:
        return
    _check(desc)


def target_handle_msg(data: bytes) -> None:
    from edge_llm_msgs.msg import TensorHandle
    from edge_llm_ros.ipc.descriptor import TensorDescriptor
    from edge_llm_ros.ipc.errors import InvalidHandleError
    b = Bytes(data)
    msg = TensorHandle(pool_id=b.text(70), slot=b.uint(4), generation=b.uint(8),
                       sequence=b.uint(8), buffer_kind=b.uint(1),
                       dtype=b.pick(['float32', 'uint8', 'int64', 'float16', b.text(8)]),
                       shape=[b.uint(b.pick([1, 2, 8])) for _ in range(b.uint(1) % 5)],
                       strides=[b.uint(8) - 2**63 for _ in range(b.uint(1) % 3)],
                       byte_offset=b.uint(b.pick([1, 8])), nbytes=b.uint(b.pick([2, 8])))
    try:
        desc = TensorDescriptor.from_msg(msg)
        desc.check_fits(b.uint(4), b.uint(1))
    except InvalidHandleError:
        return
    _check(desc)


class _LivePool:
    """One producer and one well-behaved resolver, kept across executions."""

    def __init__(self) -> None:
        from edge_llm_ros.ipc.pool import PoolConfig, TensorPool
        from edge_llm_ros.ipc.resolver import TensorResolver
        self.dir = tempfile.mkdtemp(prefix='fc')
        self.pool = TensorPool(PoolConfig(pool_id='fc', slot_nbytes=4096, slots=4,
                                          allocator='memfd', socket_dir=self.dir))
        loan = self.pool.loan()
        loan.ndarray('uint8', (4096,))[...] = 7
        self.good = loan.publish()
        self.resolver = TensorResolver(socket_dir=self.dir, name='probe')
        self.runs = 0

    def still_serves(self) -> None:
        view = self.resolver.resolve(self.good)
        try:
            if int(view[0]) != 7:
                raise Finding('the good frame changed under a consumer')
        finally:
            del view
            self.resolver.release(self.good)


_live: Optional[_LivePool] = None


def target_producer_socket(data: bytes) -> None:
    from edge_llm_ros.ipc import channel, protocol as proto
    global _live
    if _live is None:
        _live = _LivePool()
    b = Bytes(data)
    sock = channel.connect('fc', _live.dir)
    sock.settimeout(1.0)
    try:
        if b.uint(1) % 4:
            sock.send(proto.HELLO.pack(proto.Msg.HELLO, proto.VERSION, 1, b.uint(1) % 2) +
                      b'fz')
            sock.recv(4096)
        for _ in range(1 + b.uint(1) % 4):
            kind = b.pick(list(proto.Msg) + [0, 255])
            try:
                sock.send(bytes([kind]) + b.take(b.uint(1) % 48))
            except OSError:
                break
    finally:
        sock.close()
    _live.runs += 1
    if _live.runs % 16 == 0:
        _live.still_serves()


class _Liar:
    """A fake producer socket that pushes the fuzzer's FRAME to each new consumer."""

    def __init__(self) -> None:
        from edge_llm_ros.ipc import channel
        from edge_llm_ros.ipc.allocators import select_allocator
        self.dir = tempfile.mkdtemp(prefix='fl')
        self.listener = channel.listen('liar', self.dir)
        self.allocator = select_allocator('memfd')
        self.buffer = self.allocator.allocate(4096, 'liar')
        self.fds = len(os.listdir('/proc/self/fd'))


_liar: Optional[_Liar] = None


def target_consumer_frames(data: bytes) -> None:
    import threading

    from edge_llm_ros.ipc import protocol as proto
    from edge_llm_ros.ipc.errors import IpcError
    from edge_llm_ros.ipc.resolver import TensorResolver
    global _liar
    if _liar is None:
        _liar = _Liar()
    b = Bytes(data)
    size, with_fd, payload = b.pick([0, 4096, 8192]), b.uint(1) % 2, data[3:]

    def serve() -> None:
        conn, _ = _liar.listener.accept()
        try:
            conn.recv(4096)
            conn.send(proto.WELCOME.pack(proto.Msg.WELCOME, proto.VERSION, 4, 4096, 0, 2.0) +
                      b'liar')
            proto.send(conn, proto.FRAME.pack(proto.Msg.FRAME, size) + payload,
                       [_liar.buffer.share_fd] if with_fd else [])
            conn.recv(4096)   # wait for the consumer to hang up or release
        except OSError:
            pass
        finally:
            conn.close()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    resolver = TensorResolver(socket_dir=_liar.dir, name='victim')
    try:
        sub = resolver.subscribe('liar')
        frame = sub.receive(1.0)
        if frame is not None:
            desc = frame.descriptor
            if desc.slot >= 4 or desc.byte_offset + desc.nbytes > 4096:
                raise Finding(f'consumer accepted a frame outside the pool: {desc}')
            frame.release()
            del frame
        sub.close()
    except IpcError:
        pass
    finally:
        resolver.close()
        server.join(5)
    fds = len(os.listdir('/proc/self/fd'))
    if fds > _liar.fds:
        _liar.fds = fds   # report each leak once, then watch for more
        raise Finding(f'a lying FRAME leaked a file descriptor ({fds} open)')


TARGET_FUNCS: Dict[str, Callable[[bytes], None]] = {
    name: globals()[f'target_{name}'] for name in TARGETS}


# --- worker: one target in this process ------------------------------------------------
class Recorder:
    """Wraps a target: untyped exceptions and Findings become JSON lines, not crashes."""

    def __init__(self, name: str, findings_path: str) -> None:
        self.target = TARGET_FUNCS[name]
        self.name = name
        self.path = findings_path
        self.seen: set = set()
        self.executions = 0

    def __call__(self, data: bytes) -> None:
        self.executions += 1
        try:
            self.target(data)
        except Exception as exc:  # noqa: B902 - every untyped exception is a finding
            tb = traceback.extract_tb(exc.__traceback__)
            where = next((f'{pathlib.Path(f.filename).name}:{f.lineno}' for f in reversed(tb)
                          if 'edge_llm_ros' in f.filename), f'{tb[-1].name}' if tb else '?')
            key = (type(exc).__name__, where)
            if key not in self.seen:
                self.seen.add(key)
                with open(self.path, 'a') as out:
                    out.write(json.dumps({'target': self.name, 'error': type(exc).__name__,
                                          'message': str(exc)[:300], 'where': where,
                                          'input_hex': data[:96].hex()}) + '\n')
        if self.executions % 1000 == 0:
            with open(self.path + '.count', 'w') as out:
                out.write(str(self.executions))


def run_worker(name: str, budget_s: float, findings: str, engine: str, seed: int) -> None:
    recorder = Recorder(name, findings)
    if engine == 'atheris':
        import atheris
        import edge_llm_msgs.msg  # noqa: F401 - not ours: left uninstrumented
        # Coverage feedback from our own modules only (instrumenting numpy costs minutes).
        with atheris.instrument_imports(include=['edge_llm_ros']):
            import edge_llm_ros.ipc.descriptor  # noqa: F401
            import edge_llm_ros.ipc.pool  # noqa: F401
            import edge_llm_ros.ipc.resolver  # noqa: F401
        atheris.Setup([sys.argv[0], f'-max_total_time={int(budget_s)}', '-rss_limit_mb=2048',
                       '-print_final_stats=1', f'-seed={seed}', '-max_len=512'], recorder)
        atheris.Fuzz()
        return
    from hypothesis import given, HealthCheck, settings, strategies as st
    deadline = time.monotonic() + budget_s
    batch = 0
    while time.monotonic() < deadline:
        @settings(max_examples=500, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(data=st.binary(max_size=512))
        def one(data: bytes) -> None:
            if time.monotonic() < deadline:
                recorder(data)
        one()
        batch += 1
    with open(findings + '.count', 'w') as out:
        out.write(str(recorder.executions))


# --- orchestrator ----------------------------------------------------------------------
def pick_engine(wanted: str) -> str:
    if wanted != 'auto':
        return wanted
    try:
        import atheris  # noqa: F401
        return 'atheris'
    except ImportError:
        return 'hypothesis'


def campaign(name: str, budget_s: float, engine: str, seed: int, workdir: str) -> Dict:
    findings = os.path.join(workdir, f'{name}.jsonl')
    cmd = [sys.executable, __file__, '--worker', name, '--budget-s', str(budget_s),
           '--engine', engine, '--findings', findings, '--seed', str(seed)]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True,
                          timeout=budget_s + 120)
    wall = time.monotonic() - start
    log = proc.stdout + proc.stderr
    runs = re.findall(r'Done (\d+) runs in', log)
    cov = re.findall(r'cov: (\d+)', log)
    count_file = pathlib.Path(findings + '.count')
    executions = int(runs[-1]) if runs else int(count_file.read_text()) \
        if count_file.exists() else 0
    found = [json.loads(line) for line in pathlib.Path(findings).read_text().splitlines()] \
        if os.path.exists(findings) else []
    crashed = proc.returncode != 0
    if crashed:   # the worker itself died: a hard crash (segfault, OOM) is a finding too
        found.append({'target': name, 'error': f'worker exit {proc.returncode}',
                      'message': log[-600:], 'where': '', 'input_hex': ''})
    return {'target': name, 'engine': engine, 'budget_s': budget_s, 'wall_s': round(wall, 1),
            'executions': executions, 'executions_per_s': round(executions / budget_s),
            'coverage_edges': int(cov[-1]) if cov else None, 'findings': found}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--budget-s', type=float, default=60.0, help='seconds per target')
    parser.add_argument('--targets', default='all', help=f'comma list of {", ".join(TARGETS)}')
    parser.add_argument('--engine', default='auto', choices=('auto', 'atheris', 'hypothesis'))
    parser.add_argument('--seed', type=int, default=1)
    parser.add_argument('--json', default='', help='also write the JSON report here')
    parser.add_argument('--worker', default='', help=argparse.SUPPRESS)
    parser.add_argument('--findings', default='', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.worker:
        run_worker(args.worker, args.budget_s, args.findings, args.engine, args.seed)
        return 0
    names = TARGETS if args.targets == 'all' else tuple(args.targets.split(','))
    unknown = set(names) - set(TARGETS)
    if unknown:
        parser.error(f'unknown target(s) {sorted(unknown)}')
    engine = pick_engine(args.engine)
    workdir = tempfile.mkdtemp(prefix='fuzz_campaign')
    try:
        results = [campaign(n, args.budget_s, engine, args.seed, workdir) for n in names]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = {'engine': engine, 'budget_s_per_target': args.budget_s, 'host_cpus':
              os.cpu_count(), 'targets': results,
              'total_executions': sum(r['executions'] for r in results),
              'total_findings': sum(len(r['findings']) for r in results)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(text + '\n')
    print(f'\n{"target":<20} {"execs":>10} {"execs/s":>9} {"edges":>7} {"findings":>9}')
    for r in results:
        print(f'{r["target"]:<20} {r["executions"]:>10} {r["executions_per_s"]:>9} '
              f'{r["coverage_edges"] or "-":>7} {len(r["findings"]):>9}')
        for f in r['findings']:
            print(f'    {f["error"]} at {f["where"]}: {f["message"][:100]}')
    return 1 if report['total_findings'] else 0


if __name__ == '__main__':
    sys.exit(main())
