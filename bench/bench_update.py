"""Signed model updates of SmolLM2: a bsdiff4 delta against a full copy (time and size).

    python bench/bench_update.py [--layers 4] [--flip 0.25] [--repeat 3] [--json-out FILE]

The "new" model is the embedded SmolLM2-135M (INT4) after a simulated fine-tune of its last
--layers decoder layers, written as the converter would: in those layers every 4-bit weight
code moves by +-1 with probability --flip (re-quantization after small weight changes), the
block scales are scaled by 1 + N(0, 0.01) and the RMSNorm weights by 1 + N(0, 0.001); every
other tensor is untouched. Both folders are signed (edge-llm-update sign); the delta package
is made with make-delta (publisher side, timed once).
Timed, --repeat times each into a fresh models root holding the old version as `current`
(median reported), everything an update does on the robot: the full folder's install
(signature, copy + sha256 of every file, fsync, rename) and the delta's (signatures, patch
hash, base hash, bsdiff4 patch, write + sha256, fsync, rename), each followed by the switch
of `current`. The result of the delta must be byte-identical to the full install, and the
new model must load and generate.
"""
import argparse
import json
import os
import pathlib
import resource
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import onnx

from edge_llm_ros.convert.default_model import ensure_default_model
from edge_llm_ros.update import delta as delta_mod, manifest, signing
from edge_llm_ros.update.install import ModelsRoot


def _extent(tensor):
    info = {e.key: e.value for e in tensor.external_data}
    return int(info['offset']), int(info['length'])


def perturb(folder: pathlib.Path, layers: int, flip: float, seed: int = 0) -> dict:
    """Fine-tune-like change of the last `layers` layers, in place; return what changed."""
    model = onnx.load(str(folder / 'model.onnx'), load_external_data=False)
    names = [t.name for t in model.graph.initializer if t.name.startswith('layers.')]
    count = 1 + max(int(n.split('.')[1]) for n in names)
    chosen = {f'layers.{i}.' for i in range(count - layers, count)}
    rng = np.random.default_rng(seed)
    data = np.fromfile(folder / 'model.onnx.data', dtype=np.uint8)
    changed = 0
    for tensor in model.graph.initializer:
        if not tensor.external_data or not any(tensor.name.startswith(c) for c in chosen):
            continue
        start, length = _extent(tensor)
        view = data[start:start + length]
        if tensor.name.endswith('.qweight'):
            low, high = view & 0x0F, view >> 4
            for codes in (low, high):
                step = rng.choice(np.array([-1, 1], dtype=np.int16), size=codes.shape)
                move = rng.random(codes.shape) < flip
                codes[:] = np.clip(codes.astype(np.int16) + step * move, 0, 15).astype(np.uint8)
            view[:] = low | (high << 4)
        elif tensor.name.endswith('.scales') or tensor.name.endswith('_norm'):
            values = view.view(np.float32)
            sigma = 0.01 if tensor.name.endswith('.scales') else 0.001
            values *= (1.0 + rng.normal(0.0, sigma, values.shape)).astype(np.float32)
        else:
            continue
        changed += length
    data.tofile(folder / 'model.onnx.data')
    return {'layers': sorted(c.rstrip('.') for c in chosen), 'tensor_bytes_changed': changed,
            'layers_total': count}


def folder_bytes(folder: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def timed_install(source, base, trusted, work: pathlib.Path, old: pathlib.Path) -> tuple:
    root = ModelsRoot(work)
    root.switch(root.install(old, trusted).path)
    start = time.perf_counter()
    installed = root.install(source, trusted, base=base)
    root.switch(installed.path)
    elapsed = time.perf_counter() - start
    return elapsed, installed.path


def generates(folder: pathlib.Path) -> str:
    from edge_llm_ros.serving.engine import Engine, EngineConfig
    from edge_llm_ros.runtime.types import GenerationRequest
    engine = Engine(EngineConfig(model_dir=str(folder), max_context=256))
    try:
        generation = engine.generate(engine.prepare(GenerationRequest(
            messages=(), prompt='What is a robot?', max_tokens=12,
            use_chat_template=True)))
        for _ in generation:
            pass
        return generation.result.text
    finally:
        engine.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--layers', type=int, default=4, help='last decoder layers changed')
    p.add_argument('--flip', type=float, default=0.25,
                   help='share of 4-bit codes moved by one step in those layers')
    p.add_argument('--repeat', type=int, default=3)
    p.add_argument('--work', default='', help='work folder (default: a temporary one)')
    p.add_argument('--json-out', default='')
    args = p.parse_args(argv)
    base = ensure_default_model()
    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix='bench_update-'))
    work.mkdir(parents=True, exist_ok=True)
    try:
        private_path, public_path = work / 'fleet.key', work / 'fleet.pub'
        signing.generate(private_path, public_path)
        private, trusted = signing.load_private(private_path), signing.load_public(
            str(public_path))
        old = pathlib.Path(shutil.copytree(base, work / 'old'))
        new = pathlib.Path(shutil.copytree(base, work / 'new'))
        for folder in (old, new):
            for name in ('manifest.json', 'manifest.sig'):
                (folder / name).unlink(missing_ok=True)
        change = perturb(new, args.layers, args.flip)
        text = (new / 'model.yaml').read_text().splitlines()
        (new / 'model.yaml').write_text('\n'.join(
            'name: smollm2-135m-finetuned' if line.startswith('name:') else line
            for line in text) + '\n')
        manifest.sign_folder(old, private)
        manifest.sign_folder(new, private)
        start = time.perf_counter()
        delta_mod.make_delta(old, new, work / 'delta', private)
        make_s = time.perf_counter() - start
        make_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        full_s, delta_s = [], []
        for i in range(args.repeat):
            seconds, full_path = timed_install(new, None, trusted, work / f'full{i}', old)
            full_s.append(seconds)
            seconds, delta_path = timed_install(work / 'delta', old, trusted,
                                                work / f'delta{i}', old)
            delta_s.append(seconds)
            for name in os.listdir(full_path):
                assert (full_path / name).read_bytes() == (delta_path / name).read_bytes(), name
            shutil.rmtree(work / f'full{i}')
            if i < args.repeat - 1:
                shutil.rmtree(work / f'delta{i}')
        sample = generates(delta_path)
        full_size, delta_size = folder_bytes(new), folder_bytes(work / 'delta')
        data_size = (new / 'model.onnx.data').stat().st_size
        patch_size = (work / 'delta' / delta_mod.PATCH_FILE).stat().st_size
        report = {
            'model': 'SmolLM2-135M-Instruct int4 (embedded)', 'change': change,
            'flip': args.flip, 'repeat': args.repeat, 'cpus': os.cpu_count(),
            'full_update_s': statistics.median(full_s), 'delta_update_s':
            statistics.median(delta_s), 'full_update_runs_s': full_s,
            'delta_update_runs_s': delta_s, 'make_delta_s': make_s,
            'make_delta_peak_rss_bytes': make_rss, 'full_bytes': full_size,
            'delta_package_bytes': delta_size, 'data_bytes': data_size,
            'patch_bytes': patch_size, 'delta_share_of_full': delta_size / full_size,
            'delta_result_identical': True, 'new_model_generates': sample}
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    mib = 1 << 20
    print(f'SmolLM2 update, last {args.layers}/{change["layers_total"]} layers changed '
          f'({change["tensor_bytes_changed"] / mib:.1f} MiB of tensors)')
    print(f'{"":24}{"time (s)":>10}{"size (MiB)":>12}')
    print(f'{"full folder":24}{report["full_update_s"]:>10.2f}{full_size / mib:>12.1f}')
    print(f'{"delta package":24}{report["delta_update_s"]:>10.2f}{delta_size / mib:>12.1f}')
    print(f'delta/full size {report["delta_share_of_full"]:.3f}; patch {patch_size / mib:.1f} '
          f'MiB for a {data_size / mib:.1f} MiB model.onnx.data; make-delta {make_s:.1f} s '
          f'(peak RSS {make_rss / mib / 1024:.1f} GiB)')
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(report, indent=2) + '\n')
    return 0


if __name__ == '__main__':
    sys.exit(main())
