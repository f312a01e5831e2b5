"""Engine benchmark: prefill / decode / TTFT with prefix reuse / RSS / bandwidth, and peers.

    .venv/bin/python bench/bench_engine.py [--threads 2] [--repeats 3] [--with-peers]
    .venv/bin/python bench/bench_engine.py --rows --model DIR [--gguf FILE] [--model DIR2 ...]

On the embedded SmolLM2-135M (or --model DIR + --gguf FILE): a ~120-token chat prompt, 128
greedy tokens, the same thread count for every engine, all in one run so the ratios compare
like with like (this machine's speed drifts by up to 2x over minutes). Peers run in their own
processes, interleaved with our cold runs, fed the same prompt token ids, 128 greedy tokens:
- llama-cpp-python on the same GGUF, built portably once by bench/llama_peer.py into
  .cache/llama_cpp_peer with --with-peers (~6 min of compiling on 2 cores): GGML_NATIVE off,
  SIMD flags from /proc/cpuinfo, AMX off (the default build segfaults on AMX CPUs). Its build
  flags, version and system_info go into the JSON;
- onnxruntime-genai on its own INT4 build of the same GGUF (built once by bench/ortgenai_build.py
  into .cache/bench_genai_venv + .cache/bench_models with --with-peers: ~3 min), or on the
  folder given by --ortgenai-model.
A peer that is not built is listed with the reason, in the JSON and the table. A peer that
crashes (non-zero exit, killed by a signal, no result) fails the whole run: exit 3 with the
peer's stderr tail, never a silently dropped row.
Prints one JSON object and a short table; timing targets live here, never in tests.

With --rows, or more than one --model: one row per model (prefill, decode, bytes read per
token, KL vs llama.cpp on the same GGUF, met / missed against issue 12's targets), measured by
bench/bench_models.py with --prompt-tokens / --new-tokens ('default' names SmolLM2).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'bench'))
import bench_models  # noqa: E402  (bench/ helper modules sit next to this script)
import llama_peer  # noqa: E402
import ortgenai_build  # noqa: E402

NEW_TOKENS = 128
# decode / prefill vs llama.cpp: issue 12's targets (bench_models.TARGETS has the same).
TARGETS = {'decode_vs_llama_cpp': 1.3, 'prefill_vs_llama_cpp': 1.5, 'decode_vs_ortgenai': 1.0,
           'ttft_reuse_gain': 5.0, 'rss_mb': 400.0}
FIRST_IDS = 16  # greedy ids each engine reports, to show they decode the same prompt alike
STDERR_TAIL = 25  # lines of a crashed peer's stderr to show
PEER_CRASHED = 3  # exit status of a run whose peer crashed


class PeerCrashed(RuntimeError):
    """A peer process died or returned no result: the run must fail, not lose a row."""


# ~120 tokens of user prompt, and a ~200-token system prompt for the reuse measurement.
PROMPT = (
    'A warehouse robot with a camera, a lidar and a gripper must move ten boxes from the '
    'loading dock to shelf B7 today, avoid the forklift that crosses aisle four every few '
    'minutes, and report damaged boxes. Its battery is at sixty percent. Write a detailed '
    'step-by-step plan for the shift: for each step say what the robot checks, what could go '
    'wrong and how it recovers.')
SYSTEM = (
    'You are the planning assistant of an autonomous warehouse robot. Always answer in plain '
    'English with short numbered steps. Safety comes first: never plan a path through an aisle '
    'where people are working, keep at least one meter away from forklifts, and stop '
    'immediately when the emergency button is pressed. The robot reports its battery level, its '
    'position on the warehouse map, the state of its gripper and the list of boxes it carries. '
    'Shelves are named by a letter for the row and a number for the column, from A1 near the '
    'loading dock to H12 near the offices. The loading dock opens at six in the morning and '
    'closes at ten in the evening. Damaged boxes go to the inspection area next to shelf A1 and '
    'must be photographed before they are moved. When you are unsure, ask the supervisor '
    'instead of guessing, and explain why you are asking. Keep answers under two hundred words '
    'unless the supervisor asks for more detail, and never invent sensor readings.')
QUESTIONS = ('Which shelf is closest to the loading dock?',
             'Where do damaged boxes go?',
             'What should the robot do when the emergency button is pressed?')


# --- system measurements ---------------------------------------------------------------------
def copy_bandwidth(threads: int, mib: int = 256, repeats: int = 5) -> float:
    """Memory-copy bandwidth in bytes/s (read + write traffic), `threads` numpy copies at once."""
    import numpy as np
    n = mib * 2 ** 20 // 8 // threads
    srcs = [np.random.default_rng(i).random(n) for i in range(threads)]
    dsts = [np.empty_like(s) for s in srcs]
    best = 0.0
    for _ in range(repeats):
        workers = [threading.Thread(target=np.copyto, args=(d, s)) for d, s in zip(dsts, srcs)]
        t = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        dt = time.perf_counter() - t
        best = max(best, 2 * sum(s.nbytes for s in srcs) / dt)
    return best


# Inputs an op reads a row of (by id or position), not whole: the token table, and the rotary
# caches GroupQueryAttention / RotaryEmbedding index by position.
GATHERED_INPUTS = {'Gather': (0,), 'GatherBlockQuantized': (0, 2, 3), 'KQuantGather': (0,),
                   'GroupQueryAttention': (7, 8), 'CausalAttention': (7, 8),
                   'RotaryEmbedding': (2, 3)}
KQUANT_SUFFIX = '.gguf_blocks'  # the converter's name of a matrix kept in its GGUF blocks


def weight_bytes_per_token(model_path: str) -> Dict[str, int]:
    """Bytes of initializers one decode step reads: everything but gathered tables (one row).

    `gguf_blocks`: of those, the bytes of matrices kept in their GGUF blocks (weights: kquant),
    which KQuantMatMul reads whole; the KQuantGather table counts only when a tied lm_head
    reads it too.
    """
    import onnx
    model = onnx.load(model_path, load_external_data=False)
    sizes = {}
    for init in model.graph.initializer:
        ext = {e.key: e.value for e in init.external_data}
        sizes[init.name] = int(ext['length']) if 'length' in ext else len(init.raw_data)
    # A Reshape of an initializer is a view: what consumes its output reads the initializer.
    source = {node.output[0]: node.input[0] for node in model.graph.node
              if node.op_type == 'Reshape' and node.input[0] in sizes}
    gathered, read = set(), set()
    for node in model.graph.node:
        if node.op_type == 'Reshape' and node.input[0] in sizes:
            continue
        inputs = [source.get(i, i) for i in node.input]
        rows = GATHERED_INPUTS.get(node.op_type, ())
        if node.op_type in ('Gather', 'GatherBlockQuantized', 'KQuantGather') and \
                inputs[0] not in sizes:
            rows = ()  # a gather of a computed tensor: its initializer inputs are read
        gathered.update(i for j, i in enumerate(inputs) if j in rows and i in sizes)
        read.update(i for j, i in enumerate(inputs) if j not in rows and i in sizes)
    # A table both gathered and used by a MatMul (tied lm_head) is read in full.
    per_token = sum(sizes[n] for n in read)
    return {'per_token': per_token, 'total': sum(sizes.values()),
            'gather_only': sum(sizes[n] for n in gathered - read),
            'gguf_blocks': sum(sizes[n] for n in read if n.endswith(KQUANT_SUFFIX))}


def peak_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# --- our engine --------------------------------------------------------------------------------
def bench_engine(args, between_runs: Callable[[], None]) -> Dict:
    """Measure our engine; between_runs() runs once after each cold run (peers, interleaved)."""
    import psutil

    from edge_llm_ros.serving.engine import Engine, EngineConfig
    from edge_llm_ros.runtime.types import GenerationRequest

    proc = psutil.Process()
    rss_start = proc.memory_info().rss
    t = time.perf_counter()
    engine = Engine(EngineConfig(model_dir=args.model, intra_op_threads=args.threads,
                                 max_context=args.max_context))
    load_s = time.perf_counter() - t
    rss_loaded = proc.memory_info().rss

    def run(req):
        return engine.generate(req).run_to_end()

    main = GenerationRequest(prompt=PROMPT, max_tokens=NEW_TOKENS)
    prompt_ids = engine.tokenize(messages=main_messages(main))
    run(GenerationRequest(prompt='Hello', max_tokens=8))  # warm-up
    prefill, decode, completions, ttft_cold = [], [], [], []
    for _ in range(args.repeats):
        engine.reset_cache()
        r = run(main)
        first_ids = r.token_ids[:FIRST_IDS]
        prefill.append(r.timings.prefill_tokens_per_second)
        decode.append(r.timings.decode_tokens_per_second)
        completions.append(r.completion_tokens)
        ttft_cold.append(r.timings.time_to_first_token_s)
        between_runs()
    no_reuse, reuse, cached = [], [], []
    for i in range(args.repeats):
        for q in QUESTIONS:
            engine.reset_cache()
            req = GenerationRequest(prompt=q, system_prompt=SYSTEM, max_tokens=1)
            no_reuse.append(run(req).timings.time_to_first_token_s)
        engine.reset_cache()
        run(GenerationRequest(prompt='Hello', system_prompt=SYSTEM, max_tokens=1))
        for q in QUESTIONS:
            r = run(GenerationRequest(prompt=q, system_prompt=SYSTEM, max_tokens=1))
            reuse.append(r.timings.time_to_first_token_s)
            cached.append(r.timings.cached_prompt_tokens)
    system_tokens = len(engine.tokenize(messages=[_msg('system', SYSTEM)],
                                        add_generation_prompt=False))
    out = {
        'engine': 'edge_llm_ros (onnxruntime ' + _ort_version() + ')',
        'model': engine.model_name, 'model_dir': engine.model_dir,
        'providers': list(engine.providers), 'threads': args.threads,
        'load_s': load_s, 'prompt_tokens': len(prompt_ids),
        'completion_tokens': completions, 'first_ids': first_ids,
        'prefill_tok_s': statistics.median(prefill), 'prefill_tok_s_all': prefill,
        'decode_tok_s': statistics.median(decode), 'decode_tok_s_all': decode,
        'ttft_s': statistics.median(ttft_cold),
        'system_prompt_tokens': system_tokens,
        'ttft_no_reuse_s': statistics.median(no_reuse),
        'ttft_reuse_s': statistics.median(reuse),
        'reuse_cached_tokens': statistics.median(cached),
        'rss_before_load_mb': rss_start / 2 ** 20,
        'rss_loaded_mb': rss_loaded / 2 ** 20,
        'rss_mb': proc.memory_info().rss / 2 ** 20,
        'peak_rss_mb': peak_rss_mb(),
    }
    out['ttft_reuse_gain'] = out['ttft_no_reuse_s'] / max(out['ttft_reuse_s'], 1e-9)
    wb = weight_bytes_per_token(os.path.join(engine.model_dir, 'model.onnx'))
    out['weight_bytes_per_token'] = wb['per_token']
    out['weight_bytes_total'] = wb['total']
    engine.close()
    return out


def main_messages(req):
    from edge_llm_ros.runtime.request import conversation
    return conversation(req)


def _msg(role, content):
    from edge_llm_ros.runtime.types import ChatMessage
    return ChatMessage(role, content)


def _ort_version() -> str:
    import onnxruntime
    return onnxruntime.__version__


# --- peers (each in its own process) ------------------------------------------------------
def peer_llama_cpp(args) -> Dict:
    """Run llama-cpp-python: same prompt ids, greedy, NEW_TOKENS tokens, args.threads."""
    import llama_cpp
    import numpy as np
    ids = json.loads(args.prompt_ids)
    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=args.max_context, n_threads=args.threads,
                          n_threads_batch=args.threads, n_batch=512, verbose=False)
    llm.eval(ids[:8])  # warm-up
    n_vocab = llm.n_vocab()

    def next_token() -> int:
        # eval() keeps no scores unless logits_all (0.3.x): read the last row from the context.
        row = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.ctypeslib.as_array(row, shape=(n_vocab,)).argmax())

    prefill, decode, ttft = [], [], []
    for _ in range(args.repeats):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        prefill.append(len(ids) / (t1 - t0))
        tok = next_token()
        ttft.append(time.perf_counter() - t0)
        out = [tok]
        t2 = time.perf_counter()
        for _ in range(NEW_TOKENS - 1):
            llm.eval([tok])
            tok = next_token()
            out.append(tok)
        decode.append((NEW_TOKENS - 1) / (time.perf_counter() - t2))
    own_ids = llm.tokenize(args.prompt_text.encode(), add_bos=False, special=True)
    info = llama_cpp.llama_print_system_info().decode(errors='replace').strip()
    return _peer_result({'engine': f'llama-cpp-python {llama_cpp.__version__}',
                         'gguf': args.gguf, 'system_info': info},
                        own_ids == ids, ids, out, prefill, decode, ttft)


def _peer_result(head: Dict, same_ids: bool, ids, out: List[int], prefill: List[float],
                 decode: List[float], ttft: List[float]) -> Dict:
    """Return the fields every peer reports (medians plus the raw runs)."""
    import psutil
    return {**head, 'prompt_tokens': len(ids), 'own_tokenizer_same_ids': same_ids,
            'completion_tokens': len(out), 'first_ids': out[:FIRST_IDS],
            'prefill_tok_s': statistics.median(prefill), 'prefill_tok_s_all': prefill,
            'decode_tok_s': statistics.median(decode), 'decode_tok_s_all': decode,
            'ttft_s': statistics.median(ttft),
            'rss_mb': psutil.Process().memory_info().rss / 2 ** 20}


def peer_ortgenai(args) -> Dict:
    """Run onnxruntime-genai on its own INT4 build: same prompt ids, NEW_TOKENS greedy tokens.

    The ids go in as ids (append_tokens), never through genai's tokenizer. append_tokens runs
    the prefill; the first generate_next_token only picks from those logits, each later one
    runs one decode step, like our engine and the llama peer (NEW_TOKENS - 1 decode steps).
    min_length = max_length keeps EOS from ending the run early, so every run decodes as many
    tokens as the others; the ids before any EOS are plain greedy.
    """
    import numpy as np
    import onnxruntime_genai as og
    ids = np.array(json.loads(args.prompt_ids), dtype=np.int32)
    config_path = pathlib.Path(args.ortgenai_model, 'genai_config.json')
    options = json.loads(config_path.read_text())['model']['decoder'].get('session_options', {})
    model = og.Model(og.Config(args.ortgenai_model))
    prefill, decode, ttft = [], [], []
    for _ in range(args.repeats + 1):  # the first run warms up
        params = og.GeneratorParams(model)
        length = len(ids) + NEW_TOKENS
        params.set_search_options(max_length=length, min_length=length, do_sample=False)
        gen = og.Generator(model, params)
        t0 = time.perf_counter()
        gen.append_tokens(ids)
        gen.generate_next_token()
        t1 = time.perf_counter()
        n = 1
        while not gen.is_done() and n < NEW_TOKENS:
            gen.generate_next_token()
            n += 1
        t2 = time.perf_counter()
        prefill.append(len(ids) / (t1 - t0))
        ttft.append(t1 - t0)
        decode.append((n - 1) / (t2 - t1))
        out = [int(t) for t in gen.get_sequence(0)[len(ids):]]
    prefill, decode, ttft = prefill[1:], decode[1:], ttft[1:]
    own_ids = [int(t) for t in og.Tokenizer(model).encode(args.prompt_text)]
    return _peer_result({'engine': f'onnxruntime-genai {og.__version__}',
                         'model': args.ortgenai_model,
                         'intra_op_num_threads': options.get('intra_op_num_threads')},
                        own_ids == ids.tolist(), ids, out, prefill, decode, ttft)


def ensure_llama_cpp(args) -> Dict:
    """Python + build record of the llama.cpp peer: {'python', 'build'} or {'error'}.

    --llama-cpp-python runs a given interpreter's llama_cpp as is; otherwise the portable build
    of bench/llama_peer.py (compiled with --with-peers). Raises llama_peer.PeerBuildError when
    that compile was asked for and failed: a peer asked for must run.
    """
    if args.llama_cpp_python:
        return {'python': args.llama_cpp_python,
                'build': {'python': args.llama_cpp_python,
                          'cmake_args': 'unknown (given with --llama-cpp-python)'}}
    if not args.gguf:
        return {'error': 'no GGUF for this model (give --gguf)'}
    try:
        stamp = llama_peer.ensure_peer(args.with_peers)
    except llama_peer.PeerBuildError as exc:
        if args.with_peers:
            raise
        return {'error': str(exc)}
    build = {k: stamp[k] for k in ('version', 'cmake_args', 'cpu_has_amx', 'key', 'python')}
    return {'python': stamp['python'], 'build': build}


def ensure_ortgenai(args) -> Dict[str, str]:
    """Python + model folder for the onnxruntime-genai peer (built once with --with-peers).

    Returns {'python', 'model'}, or {'error'} saying why the peer cannot run.
    """
    if args.ortgenai_model:  # a folder built elsewhere: run it with whichever python has genai
        for python in (ortgenai_build.venv_python(), sys.executable):
            if _imports(python, 'onnxruntime_genai'):
                return {'python': python, 'model': args.ortgenai_model}
        return {'error': 'onnxruntime_genai not importable (run with --with-peers once)'}
    if not args.gguf:
        return {'error': 'no GGUF to build its model from (give --gguf or --ortgenai-model)'}
    try:
        return ortgenai_build.ensure_peer(args.with_peers, pathlib.Path(args.gguf), args.threads)
    except ortgenai_build.PeerBuildError as exc:
        return {'error': f'onnxruntime-genai peer unavailable: {exc}'}


def _imports(python: str, module: str) -> bool:
    return os.path.exists(python) and subprocess.run(
        [python, '-c', f'import {module}'], capture_output=True).returncode == 0


def run_peer(python: str, name: str, args, prompt_ids: List[int],
             ortgenai_model: str = '') -> Dict:
    """Run one peer measurement in its own process; raise PeerCrashed when it gives none."""
    cmd = [python, __file__, '--peer', name, '--threads', str(args.threads),
           '--repeats', '1', '--max-context', str(args.max_context),
           '--gguf', args.gguf or '', '--ortgenai-model', ortgenai_model,
           '--prompt-ids', json.dumps(prompt_ids), '--prompt-text', args.prompt_text]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:
        raise PeerCrashed(f'{name} peer could not start ({python}): {exc}') from exc
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        try:
            return json.loads(lines[-1])
        except ValueError:
            pass
    raise PeerCrashed(f'{name} peer ({python}) {_how_it_ended(proc.returncode)}; '
                      f'last lines of its stderr:\n' + _tail(proc.stderr or proc.stdout))


def _how_it_ended(returncode: int) -> str:
    if returncode < 0:
        try:
            return f'was killed by {signal.Signals(-returncode).name}'
        except ValueError:
            return f'was killed by signal {-returncode}'
    if returncode:
        return f'exited with status {returncode}'
    return 'exited 0 without a JSON result'


def _tail(text: str) -> str:
    lines = text.strip().splitlines()[-STDERR_TAIL:] or ['(no output)']
    return '\n'.join('  | ' + line for line in lines)


# --- report ------------------------------------------------------------------------------------
def report(ours: Dict, peers: Dict[str, Dict], bandwidth: float) -> Dict:
    out = {'ours': ours, 'peers': peers, 'copy_bandwidth_gb_s': bandwidth / 1e9}
    limit = bandwidth / ours['weight_bytes_per_token']
    out['decode_bandwidth_limit_tok_s'] = limit
    out['decode_fraction_of_bandwidth_limit'] = ours['decode_tok_s'] / limit
    ratios = {'ttft_reuse_gain': ours['ttft_reuse_gain'], 'rss_mb': ours['rss_mb']}
    llama = peers.get('llama_cpp', {})
    if 'decode_tok_s' in llama:
        ratios['decode_vs_llama_cpp'] = ours['decode_tok_s'] / llama['decode_tok_s']
        ratios['prefill_vs_llama_cpp'] = ours['prefill_tok_s'] / llama['prefill_tok_s']
    og = peers.get('ortgenai', {})
    if 'decode_tok_s' in og:
        ratios['decode_vs_ortgenai'] = ours['decode_tok_s'] / og['decode_tok_s']
        ratios['prefill_vs_ortgenai'] = ours['prefill_tok_s'] / og['prefill_tok_s']
    out['ratios'] = ratios
    out['ratios_paired'] = paired_ratios(ours, peers)
    # A ratio that could not be measured says why, instead of just being absent.
    out['ratios_missing'] = {
        f'{kind}_vs_{name}': peer.get('error') or peer.get('skipped')
        for name, peer in peers.items() if 'decode_tok_s' not in peer
        for kind in ('decode', 'prefill')}
    out['greedy_ids_agree'] = {name: _common_prefix(ours['first_ids'], peer['first_ids'])
                               for name, peer in peers.items() if 'first_ids' in peer}
    out['targets_met'] = {k: (ratios[k] <= v if k == 'rss_mb' else ratios[k] >= v)
                          for k, v in TARGETS.items() if k in ratios}
    return out


def print_table(res: Dict) -> None:
    ours = res['ours']
    rows = [('edge_llm_ros', ours)] + [(k, v) for k, v in res['peers'].items()]
    print(f'\n{"engine":<16}{"prefill tok/s":>15}{"decode tok/s":>14}{"TTFT ms":>10}'
          f'{"RSS MB":>9}', file=sys.stderr)
    for name, r in rows:
        if 'error' in r or 'skipped' in r:
            print(f'{name:<16}  {r.get("error") or r.get("skipped")}', file=sys.stderr)
            continue
        print(f'{name:<16}{r["prefill_tok_s"]:>15.0f}{r["decode_tok_s"]:>14.1f}'
              f'{r.get("ttft_s", 0) * 1000:>10.0f}{r.get("rss_mb", 0):>9.0f}', file=sys.stderr)
    print(f'\nTTFT with {ours["system_prompt_tokens"]}-token system prompt: '
          f'{ours["ttft_no_reuse_s"] * 1000:.1f} ms fresh, {ours["ttft_reuse_s"] * 1000:.1f} ms '
          f'reused ({ours["reuse_cached_tokens"]:.0f} cached) -> '
          f'{ours["ttft_reuse_gain"]:.1f}x', file=sys.stderr)
    print(f'load average {res["loadavg"]["start"][0]:.1f} at start, '
          f'{res["loadavg"]["end"][0]:.1f} at end ({res["loadavg"]["cores"]} cores)',
          file=sys.stderr)
    print(f'weights read per token {ours["weight_bytes_per_token"] / 1e6:.1f} MB, copy '
          f'bandwidth {res["copy_bandwidth_gb_s"]:.1f} GB/s -> limit '
          f'{res["decode_bandwidth_limit_tok_s"]:.0f} tok/s, decode at '
          f'{res["decode_fraction_of_bandwidth_limit"] * 100:.0f}% of it', file=sys.stderr)
    for k, v in res['ratios'].items():
        target = TARGETS.get(k)
        met = res['targets_met'].get(k)
        mark = '' if target is None else f'  (target {"<=" if k == "rss_mb" else ">="} '\
            f'{target}: {"met" if met else "MISSED"})'
        paired = res['ratios_paired'].get(k)
        pair = '' if paired is None else f'  [paired runs: {paired:.2f}]'
        print(f'  {k:<24}{v:8.2f}{mark}{pair}', file=sys.stderr)
    for k, why in res['ratios_missing'].items():
        print(f'  {k:<24}{"n/a":>8}  (NOT compared: {why})', file=sys.stderr)
    for name, n in res['greedy_ids_agree'].items():
        peer = res['peers'][name]
        same = peer.get('own_tokenizer_same_ids')
        print(f'  {name}: fed our {peer["prompt_tokens"]} prompt ids (its own tokenizer gives '
              f'{"the same" if same else "DIFFERENT"} ids), {peer["completion_tokens"]} greedy '
              f'tokens; first {n}/{FIRST_IDS} equal to ours', file=sys.stderr)


def paired_ratios(ours: Dict, peers: Dict[str, Dict]) -> Dict[str, float]:
    """Median over the interleaved pairs of ours / peer: less hit by drift than medians alone.

    Peer run i follows our cold run i within seconds, so each pair saw about the same load.
    """
    out = {}
    for name, peer in peers.items():
        for kind in ('decode', 'prefill'):
            a, b = ours.get(f'{kind}_tok_s_all', []), peer.get(f'{kind}_tok_s_all', [])
            if a and len(a) == len(b):
                out[f'{kind}_vs_{name}'] = statistics.median(x / y for x, y in zip(a, b))
    return out


def _common_prefix(a: List[int], b: List[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--model', action='append', default=[],
                   help='converted model folder (default: embedded); repeatable with --rows')
    p.add_argument('--gguf', action='append', default=[],
                   help='GGUF for llama-cpp-python, one per --model in order (default: the '
                        'one model.yaml records)')
    p.add_argument('--rows', action='store_true',
                   help='one row per --model (bench/bench_models.py) instead of the full '
                        'single-model report')
    bench_models.add_row_arguments(p)
    p.add_argument('--ortgenai-model', default='',
                   help='onnxruntime-genai model folder (default: its own INT4 build of --gguf, '
                        'made once with --with-peers)')
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--repeats', type=int, default=3)
    p.add_argument('--max-context', type=int, default=2048)
    p.add_argument('--with-peers', action='store_true',
                   help='build the peers into .cache/ if needed (llama-cpp-python, '
                        'onnxruntime-genai + its INT4 model)')
    p.add_argument('--llama-cpp-python', default='',
                   help='run the llama.cpp peer with this python (its own llama_cpp build) '
                        'instead of the portable build in .cache/llama_cpp_peer')
    p.add_argument('--peer', choices=('llama_cpp', 'ortgenai'), help=argparse.SUPPRESS)
    p.add_argument('--prompt-ids', default='[]', help=argparse.SUPPRESS)
    p.add_argument('--prompt-text', default='', help=argparse.SUPPRESS)
    p.add_argument('--json-out', default='', help='also write the JSON here')
    args = p.parse_args(argv)
    if args.peer:
        args.gguf = args.gguf[0] if args.gguf else ''
        fn = peer_llama_cpp if args.peer == 'llama_cpp' else peer_ortgenai
        print(json.dumps(fn(args)))
        return 0

    sys.path.insert(0, str(ROOT))
    if args.rows or len(args.model) > 1:
        config = bench_models.RowConfig(
            threads=args.threads, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
            repeats=args.repeats, kl_steps=args.kl_steps, max_context=args.max_context,
            kl_kv=args.kl_kv)
        return bench_models.run_rows(args.model or ['default'], args.gguf, config,
                                     args.json_out)
    if len(args.gguf) > 1:
        p.error('several --gguf need --rows (one per --model)')
    args.model = args.model[0] if args.model else ''
    args.gguf = args.gguf[0] if args.gguf else ''
    try:
        return _compare(args)
    except (PeerCrashed, llama_peer.PeerBuildError) as exc:
        print(f'bench: FAILED, no results: {exc}', file=sys.stderr)
        return PEER_CRASHED


def _compare(args) -> int:
    """Measure our engine and the peers, interleaved; print the JSON and the table."""
    load_start = os.getloadavg()
    model_dir = args.model or _default_model_dir()
    args.model = model_dir
    prompt_ids, args.prompt_text = _prompt(model_dir)
    args.gguf = args.gguf or source_gguf(model_dir)
    llama = ensure_llama_cpp(args)
    genai = ensure_ortgenai(args)
    for name, why in (('llama_cpp', llama.get('error')), ('ortgenai', genai.get('error'))):
        if why:
            print(f'bench: peer {name} NOT compared: {why}', file=sys.stderr)
    runs: Dict[str, List[Dict]] = {'llama_cpp': [], 'ortgenai': []}

    def peers_once() -> None:
        """One measurement of each available peer, between two of ours (same load drift)."""
        if 'python' in llama:
            runs['llama_cpp'].append(run_peer(llama['python'], 'llama_cpp', args, prompt_ids))
        if 'model' in genai:
            runs['ortgenai'].append(run_peer(genai['python'], 'ortgenai', args, prompt_ids,
                                             genai['model']))

    ours = bench_engine(args, peers_once)
    peers: Dict[str, Dict] = {
        'llama_cpp': ({'error': llama['error']} if 'error' in llama
                      else {**merge_runs(runs['llama_cpp']), 'build': llama['build']}),
        'ortgenai': ({'error': genai['error']} if 'error' in genai
                     else merge_runs(runs['ortgenai'])),
    }
    res = report(ours, peers, copy_bandwidth(args.threads))
    # Other processes share the cores: the 1/5/15-min load averages say how noisy the run was.
    res['loadavg'] = {'start': load_start, 'end': os.getloadavg(), 'cores': os.cpu_count()}
    print(json.dumps(res, indent=1))
    print_table(res)
    if args.json_out:
        pathlib.Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json_out).write_text(json.dumps(res, indent=1))
    return 0


def merge_runs(runs: List[Dict]) -> Dict:
    """Median of each peer measurement over the interleaved runs (a failed one raised)."""
    if not runs:
        return {'error': 'no run (--repeats 0)'}
    out = dict(runs[0])
    for key in ('prefill_tok_s', 'decode_tok_s', 'ttft_s', 'rss_mb'):
        values = [r[key] for r in runs if key in r]
        if values:
            out[key] = statistics.median(values)
            out[key + '_all'] = values
    return out


def _default_model_dir() -> str:
    from edge_llm_ros.convert.default_model import ensure_default_model
    return str(ensure_default_model())


def source_gguf(model_dir: str) -> str:
    """Find the GGUF the model folder was converted from (model.yaml records it)."""
    import yaml
    meta = yaml.safe_load(pathlib.Path(model_dir, 'model.yaml').read_text())
    path = pathlib.Path(meta['source']['path'])
    for candidate in (path, ROOT / path):
        if candidate.is_file() and candidate.suffix == '.gguf':
            return str(candidate)
    return ''


def _prompt(model_dir: str) -> Tuple[List[int], str]:
    """Return the chat prompt's ids and their text (special tokens kept) for the peers' check."""
    from edge_llm_ros.runtime.request import conversation
    from edge_llm_ros.runtime.tokenizer import TextTokenizer
    from edge_llm_ros.runtime.types import GenerationRequest
    tok = TextTokenizer.from_dir(model_dir)
    ids = tok.encode_chat(conversation(GenerationRequest(prompt=PROMPT)))
    return ids, tok.decode(ids)


if __name__ == '__main__':
    sys.exit(main())
