"""Processes test_update_faults.py runs: an install stopped at a chosen step, or file-limited.

python test/update_children.py pause STEP SOURCE ROOT PUBLIC BASE
  installs SOURCE under ROOT and switches `current` to it, as `edge-llm-update apply
  --switch` does, printing `step N what` before each filesystem step; at step STEP it prints
  `paused N what` and sleeps (the parent SIGKILLs it there). STEP -1 runs through and
  prints `done`. Half of every file is written before a `mid-write` step.
python test/update_children.py fsize LIMIT SOURCE ROOT PUBLIC BASE
  the same install under RLIMIT_FSIZE=LIMIT bytes (SIGXFSZ ignored), so a write past the
  limit fails with EFBIG like a full disk; prints the exit status and the error.
"""
import contextlib
import io
import pathlib
import resource
import signal
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from edge_llm_ros.update import cli, files, install  # noqa: E402

_count = [0]


def step(what: str, pause_at: int) -> None:
    index = _count[0]
    _count[0] += 1
    word = 'paused' if index == pause_at else 'step'
    sys.stdout.write(f'{word} {index} {what}\n')
    sys.stdout.flush()
    if index == pause_at:
        time.sleep(600)


def hooked(pause_at: int) -> None:
    """Wrap the filesystem steps the install makes (in this child process only)."""
    real_write = files.write_chunks

    def write_chunks(path, chunks, needed):
        def halves():
            for chunk in chunks:
                half = len(chunk) // 2
                yield chunk[:half]
                step(f'mid-write {path.name}', pause_at)
                yield chunk[half:]
        step(f'write {path.name}', pause_at)
        return real_write(path, halves(), needed)
    install.write_chunks = write_chunks
    for module, name in ((install.os, 'rename'), (install.os, 'replace'),
                         (install.os, 'symlink'), (install, 'fsync_dir')):
        real = getattr(module, name)

        def wrapper(*args, _real=real, _name=name):
            step(f'{_name} {" ".join(str(a) for a in args)}', pause_at)
            return _real(*args)
        setattr(module, name, wrapper)


def apply_args(source: str, root: str, public: str, base: str) -> list:
    return ['apply', source, '--root', root, '--public-key', public, '--base', base, '--switch']


def main() -> int:
    mode, value, source, root, public, base = sys.argv[1:7]
    if mode == 'pause':
        hooked(int(value))
        code = cli.main(apply_args(source, root, public, base))
        print('done' if code == 0 else f'failed {code}', flush=True)
        return code
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(value), int(value)))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = cli.main(apply_args(source, root, public, base))
    print(f'exit {code}\n{err.getvalue()}', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())
