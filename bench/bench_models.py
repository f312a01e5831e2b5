"""One benchmark row per converted model: our engine vs llama.cpp on the same GGUF.

    .venv/bin/python bench/bench_models.py --model DIR [--gguf FILE] [--model DIR2 ...]
        [--threads 2] [--prompt-tokens 64] [--new-tokens 32] [--repeats 2] [--json-out F]
        [--interleave]   (the models are conversions of one GGUF: measured side by side)
    .venv/bin/python bench/bench_engine.py --rows --model DIR ...   (the same, from there)

`--model default` is the embedded SmolLM2-135M; a model without `--gguf` uses the GGUF its
model.yaml records. For each model, in one run so the ratios compare like with like on this
shared machine: our decoder (edge_llm_ros.runtime.decoder.OnnxDecoder, loaded as the Engine
loads it) measures a prefill of the prompt and greedy decode steps, then llama-cpp-python (the
portable build of bench/llama_peer.py, in its own process) does the same on the same ids with
the same threads; repeated `--repeats` times, alternating (with --interleave, each repeat runs
every folder, then llama.cpp once: their rows share llama.cpp's runs). The prompt is the
tokenized text of bench_engine's prompt (repeated as needed), cut to `--prompt-tokens`, after
BOS where the model adds one. Each row has:
- prefill and decode tok/s, both engines, and the ratio of medians and of interleaved pairs;
- weight bytes read per decode step: ours from the ONNX initializers a step reads (gathered
  tables and rotary caches excluded: a row per token; a kquant folder's `*.gguf_blocks`
  matrices whole, its KQuantGather table too when a tied head reads it), llama.cpp's from the
  GGUF tensor sizes, the token embedding excluded unless it is also the head;
- KL(llama.cpp || ours) on llama.cpp's greedy path: the prompt's last position and the next
  `--kl-steps` steps, ours teacher-forced with llama.cpp's ids. By default llama.cpp's KV cache
  is f32 for it (`--kl-kv f32`, one more llama.cpp run: the precision of our cache, as the
  parity tests run it); the timed runs' f16 cache alone moves llama.cpp by as much as the
  target at 16-24 random layers (docs/benchmarks.md), and their KL is kept beside it
  (`kl_f16_kv`); `--kl-kv f16` takes the KL from the timed runs only;
- resident memory of each engine, and met / missed against TARGETS.
llama.cpp runs with its defaults (f16 KV cache) and n_ctx = --max-context, as a llama_ros user
would run it.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The targets: ours / llama.cpp for speed, ours / llama.cpp for bytes, KL in nats.
TARGETS = {'decode_vs_llama_cpp': 1.3, 'prefill_vs_llama_cpp': 1.5,
           'bytes_vs_llama_cpp': 1.1, 'max_kl': 0.01}
UPPER_BOUND_TARGETS = ('bytes_vs_llama_cpp', 'max_kl')
NODE_RSS_TARGET = 1.2  # llm_node's RSS / llama.cpp's, on the same file
PEER_FAILED = 3


class PeerFailed(RuntimeError):
    """llama.cpp's process gave no result: the row must fail loudly, not go missing."""


@dataclass(frozen=True)
class RowConfig:
    """What every row of one run measures."""

    threads: int = 2
    prompt_tokens: int = 64
    new_tokens: int = 32
    repeats: int = 2
    kl_steps: int = 4
    max_context: int = 512
    kl_kv: str = 'f32'  # llama.cpp's KV cache type for the KL columns (timing: its default f16)


# --- bytes per token ---------------------------------------------------------------------------
def gguf_bytes_per_token(gguf_path: str) -> Dict[str, int]:
    """Bytes of GGUF tensors llama.cpp reads per decode step, and the file's tensor total.

    Every tensor is read whole except the token embedding, of which one row is gathered;
    with no `output.weight` the embedding is the head too and is read whole. Gemma 4's
    per-layer table (`per_layer_token_embd`, never a head) is gathered too: llama.cpp's
    get_rows reads one row of it per token. Gathered rows are left out, as on our side
    (`gathered_row_bytes`: what they add per token).
    """
    from gguf import GGUFReader
    tensors = GGUFReader(gguf_path).tensors
    sizes = {t.name: int(t.n_bytes) for t in tensors}
    rows = {t.name: int(t.shape[-1]) for t in tensors}   # ggml order: ne[1] last = rows
    total = sum(sizes.values())
    tied = 'output.weight' not in sizes
    gathered = ['per_layer_token_embd.weight'] + ([] if tied else ['token_embd.weight'])
    gathered = [n for n in gathered if n in sizes]
    row_bytes = sum(sizes[n] // rows[n] for n in gathered)
    return {'per_token': total - sum(sizes[n] for n in gathered), 'total': total,
            'tied_head': tied, 'gathered_row_bytes': row_bytes}


def onnx_bytes_per_token(model_dir: str) -> Dict[str, int]:
    """Bytes of ONNX initializers one decode step reads (bench_engine's count)."""
    sys.path.insert(0, str(ROOT / 'bench'))
    import bench_engine
    return bench_engine.weight_bytes_per_token(os.path.join(model_dir, 'model.onnx'))


# --- prompt ------------------------------------------------------------------------------------
def prompt_ids(model_dir: str, n: int) -> List[int]:
    """`n` ids: BOS (when the model adds one), then bench_engine's prompt text tokenized."""
    sys.path.insert(0, str(ROOT / 'bench'))
    import bench_engine
    from edge_llm_ros.runtime.tokenizer import TextTokenizer
    tok = TextTokenizer.from_dir(model_dir)
    head = [tok.bos_token_id] if tok.add_bos_token and tok.bos_token_id is not None else []
    text, body = bench_engine.PROMPT, []
    while len(head) + len(body) < n:
        body = tok.encode(text)
        text += ' ' + bench_engine.PROMPT
    return (head + body)[:n]


# --- our side ----------------------------------------------------------------------------------
class OursRunner:
    """The engine's decoder on one model folder, as Engine loads it (same session options)."""

    def __init__(self, model_dir: str, config: RowConfig) -> None:
        import psutil

        from edge_llm_ros.model_format import load_model_info
        from edge_llm_ros.runtime.decoder import OnnxDecoder, SessionConfig
        self._proc = psutil.Process()
        rss0 = self._proc.memory_info().rss
        t = time.perf_counter()
        self.info = load_model_info(model_dir)
        self.decoder = OnnxDecoder(model_dir, self.info, SessionConfig(
            intra_op_threads=config.threads, max_context=config.max_context))
        self.load_s = time.perf_counter() - t
        self.rss_loaded_mb = (self._proc.memory_info().rss - rss0) / 2 ** 20
        self._growth = 0  # bytes the runs added (this runner's own: others may run between)
        self.config = config

    def run(self, ids: Sequence[int]) -> Dict:
        """Prefill `ids`, then new_tokens - 1 greedy decode steps (as the peer does)."""
        import numpy as np

        from edge_llm_ros.runtime.rows import decode_row, Row
        rss_before = self._proc.memory_info().rss
        c0, t0 = time.process_time(), time.perf_counter()
        tok = int(self.decoder.run([Row(0, 0, np.asarray(ids, np.int64))])[0].argmax())
        c1, t1 = time.process_time(), time.perf_counter()
        out, pos = [tok], len(ids)
        for _ in range(self.config.new_tokens - 1):
            tok = int(self.decoder.run([decode_row(0, tok, pos)])[0].argmax())
            pos += 1
            out.append(tok)
        c2, t2 = time.process_time(), time.perf_counter()
        self._growth += max(0, self._proc.memory_info().rss - rss_before)
        return {'prefill_tok_s': len(ids) / (t1 - t0),
                'decode_tok_s': (len(out) - 1) / (t2 - t1), 'ids': out,
                **cpu_rates(len(ids), len(out) - 1, c0, c1, c2),
                'rss_mb': self.rss_loaded_mb + self._growth / 2 ** 20}

    def logits_on(self, ids: Sequence[int], follow: Sequence[int]):
        """Logits after the prompt, then after each id of `follow` (teacher-forced)."""
        import numpy as np

        from edge_llm_ros.runtime.rows import decode_row, Row
        rows = [self.decoder.run([Row(0, 0, np.asarray(ids, np.int64))])[0].copy()]
        for i, tok in enumerate(follow):
            rows.append(self.decoder.run([decode_row(0, int(tok), len(ids) + i)])[0].copy())
        return np.stack(rows)


# --- llama.cpp (runs in the peer venv: stdlib, llama_cpp, numpy, psutil only) ------------------
def open_peer(gguf: str, n_ctx: int, n_batch: int, threads: int, kv_type: str = 'f16'):
    """Load a GGUF into llama.cpp on the CPU; return (model, context, vocabulary size).

    One sequence, n_batch = n_ubatch, `threads` for decode and batches; SystemExit when
    llama.cpp cannot load it or make the context. kv_type 'q8_0': its KV cache in q8_0 (K and
    V, with flash attention on, which a quantized V needs); 'f32': in f32 with flash attention
    off (as test/llama_cpp_runner.py --kv f32); else llama.cpp's default f16.
    """
    import llama_cpp
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(gguf.encode(), mparams)
    if not model:
        raise SystemExit(f'llama.cpp could not load {gguf}')
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = cparams.n_ubatch = n_batch
    cparams.n_seq_max = 1
    cparams.n_threads = cparams.n_threads_batch = threads
    if kv_type == 'q8_0':
        cparams.type_k = cparams.type_v = llama_cpp.GGML_TYPE_Q8_0
        cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    elif kv_type == 'f32':
        cparams.type_k = cparams.type_v = llama_cpp.GGML_TYPE_F32
        cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    elif kv_type != 'f16':
        raise SystemExit(f'open_peer: kv_type {kv_type!r} is not f16, f32 or q8_0')
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        raise SystemExit('llama.cpp could not create a context')
    return model, ctx, llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))


def cpu_rates(prompt: int, steps: int, c0: float, c1: float, c2: float) -> Dict[str, float]:
    """Tokens per CPU second of the process (process_time marks c0..c2), prefill and decode.

    At 1 thread each side computes on its calling thread, so these rates leave out the time
    other processes held the cores: the ratio to read on a loaded machine. At more threads
    they count every thread's CPU time (llama.cpp's spinning included): not a speed then.
    """
    return {'prefill_cpu_tok_s': prompt / max(c1 - c0, 1e-9),
            'decode_cpu_tok_s': steps / max(c2 - c1, 1e-9)}


def peer_main(args) -> Dict:
    """Measure llama.cpp on the ids; save the first kl_steps + 1 logits rows if asked.

    The C API directly (as test/llama_cpp_runner.py), not llama_cpp.Llama: that class keeps a
    [n_batch, vocab] float array of scores whose touched rows would count in llama.cpp's RSS.
    """
    import llama_cpp
    import numpy as np
    import psutil
    ids = json.loads(args.prompt_ids)
    model, ctx, n_vocab = open_peer(args.gguf, args.max_context, 512, args.threads, args.kv)

    def step(batch: List[int]):
        arr = (llama_cpp.llama_token * len(batch))(*batch)
        rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(batch)))
        if rc != 0:
            raise SystemExit(f'llama_decode returned {rc}')
        row = llama_cpp.llama_get_logits_ith(ctx, -1)
        return np.ctypeslib.as_array(row, shape=(n_vocab,))

    step(ids[:8])  # warm-up, then a fresh KV cache
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    c0, t0 = time.process_time(), time.perf_counter()
    rows = [step(ids).copy()]
    c1, t1 = time.process_time(), time.perf_counter()
    out = [int(rows[0].argmax())]
    for _ in range(args.new_tokens - 1):
        row = step([out[-1]])
        if len(rows) <= args.kl_steps:
            rows.append(row.copy())
        out.append(int(row.argmax()))
    c2, t2 = time.process_time(), time.perf_counter()
    if args.logits_out:
        np.save(args.logits_out, np.stack(rows))
    result = {'engine': f'llama-cpp-python {llama_cpp.__version__} (C API)',
              'prefill_tok_s': len(ids) / (t1 - t0), 'decode_tok_s': (len(out) - 1) / (t2 - t1),
              'ids': out, 'rss_mb': psutil.Process().memory_info().rss / 2 ** 20,
              **cpu_rates(len(ids), len(out) - 1, c0, c1, c2)}
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return result


def run_peer(python: str, gguf: str, ids: Sequence[int], config: RowConfig,
             logits_out: str = '', kv: str = 'f16', new_tokens: int = 0) -> Dict:
    """One llama.cpp measurement in its own process; PeerFailed when it gives no result.

    kv: its KV cache type (open_peer); new_tokens: that many instead of config.new_tokens.
    """
    cmd = [python, __file__, '--peer', '--gguf', gguf, '--prompt-ids', json.dumps(list(ids)),
           '--threads', str(config.threads),
           '--new-tokens', str(new_tokens or config.new_tokens),
           '--max-context', str(config.max_context), '--kl-steps', str(config.kl_steps),
           '--logits-out', logits_out, '--kv', kv]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = '\n'.join((proc.stderr or proc.stdout).strip().splitlines()[-20:])
    raise PeerFailed(f'llama.cpp on {gguf} exited with {proc.returncode}:\n{tail}')


# --- one row -----------------------------------------------------------------------------------
def ratios(ours: List[Dict], peer: List[Dict]) -> Dict[str, float]:
    """Return ours / llama.cpp: of the medians, and the median of the interleaved pairs."""
    out = {}
    for kind in ('prefill', 'decode'):
        a = [r[f'{kind}_tok_s'] for r in ours]
        b = [r[f'{kind}_tok_s'] for r in peer]
        out[f'{kind}_vs_llama_cpp'] = statistics.median(a) / statistics.median(b)
        out[f'{kind}_vs_llama_cpp_paired'] = statistics.median(x / y for x, y in zip(a, b))
    return out


def targets_met(values: Dict[str, float]) -> Dict[str, bool]:
    """Met / missed for every target whose value was measured."""
    return {k: (values[k] <= v if k in UPPER_BOUND_TARGETS else values[k] >= v)
            for k, v in TARGETS.items() if values.get(k) is not None}


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def measure_row(model_dir: str, gguf: str, python: str, config: RowConfig) -> Dict:
    """Interleave our runs and llama.cpp's on one model; return its row."""
    return measure_rows([model_dir], gguf, python, config)[0]


def measure_rows(model_dirs: Sequence[str], gguf: str, python: str,
                 config: RowConfig) -> List[Dict]:
    """One row per folder converted from `gguf` (e.g. two weight formats), in one run.

    Each repeat runs every folder's decoder (in turn, the order reversed every other repeat)
    and then llama.cpp once, so the folders' rows share llama.cpp's runs and every ratio,
    ours / ours included, compares runs taken next to each other.
    """
    import numpy as np
    sys.path.insert(0, str(ROOT / 'test'))
    from llama_cpp_parity import kl_divergence
    load0 = os.getloadavg()
    ids = prompt_ids(model_dirs[0], config.prompt_tokens)
    runners = []
    for model_dir in model_dirs:
        runners.append(OursRunner(model_dir, config))
        runners[-1].run(ids[:8])  # warm-up
    ours: List[List[Dict]] = [[] for _ in runners]
    peer = []
    with tempfile.TemporaryDirectory() as tmp:
        logits_path = os.path.join(tmp, 'llama_logits.npy')
        for i in range(config.repeats):
            order = range(len(runners)) if i % 2 == 0 else reversed(range(len(runners)))
            for j in order:
                ours[j].append(runners[j].run(ids))
            peer.append(run_peer(python, gguf, ids, config, logits_path if i == 0 else ''))
        # The KL's reference: the timed run's logits (f16 KV cache), and with kl_kv f32 one
        # more run with an f32 cache (its own greedy ids), untimed.
        refs = {'f16': (np.load(logits_path), peer[0]['ids'])}
        if config.kl_kv != 'f16':
            kl_path = os.path.join(tmp, 'llama_logits_kl.npy')
            kl_peer = run_peer(python, gguf, ids, config, kl_path, kv=config.kl_kv,
                               new_tokens=config.kl_steps + 1)
            refs[config.kl_kv] = (np.load(kl_path), kl_peer['ids'])
    llama_bytes = gguf_bytes_per_token(gguf)
    rows = []
    for model_dir, runner, runs in zip(model_dirs, runners, ours):
        kls = {kv: kl_divergence(ref, runner.logits_on(ids, ref_ids[:len(ref) - 1]))
               for kv, (ref, ref_ids) in refs.items()}
        rows.append(_row(model_dir, gguf, config, ids, runner, runs, peer, kls,
                         onnx_bytes_per_token(model_dir), llama_bytes, load0))
    del runners
    return rows


def _row(model_dir: str, gguf: str, config: RowConfig, ids: Sequence[int], runner: OursRunner,
         ours: List[Dict], peer: List[Dict], kls: Dict, ours_bytes: Dict, llama_bytes: Dict,
         load0) -> Dict:
    """One row's JSON; kls: KL per llama.cpp KV cache type, config.kl_kv's the row's KL."""
    kl = kls[config.kl_kv]
    row = {
        'model': runner.info.name, 'architecture': runner.info.architecture,
        'model_dir': model_dir, 'gguf': gguf, 'gguf_bytes': os.path.getsize(gguf),
        'threads': config.threads, 'prompt_tokens': len(ids),
        'new_tokens': config.new_tokens, 'repeats': config.repeats,
        'kernel': runner.decoder.kernel,
        'ours': {'prefill_tok_s': [r['prefill_tok_s'] for r in ours],
                 'decode_tok_s': [r['decode_tok_s'] for r in ours],
                 'load_s': runner.load_s, 'rss_mb': ours[-1]['rss_mb']},
        'llama_cpp': {'engine': peer[0]['engine'],
                      'prefill_tok_s': [r['prefill_tok_s'] for r in peer],
                      'decode_tok_s': [r['decode_tok_s'] for r in peer],
                      'rss_mb': statistics.median(r['rss_mb'] for r in peer)},
        'bytes_per_token': {'ours': ours_bytes['per_token'], 'llama_cpp': llama_bytes['per_token'],
                            'ours_gguf_blocks': ours_bytes.get('gguf_blocks', 0),
                            'tied_head': llama_bytes['tied_head']},
        'greedy_prefix_equal': common_prefix(ours[0]['ids'], peer[0]['ids']),
        'kl_steps': len(kl), 'max_kl': float(kl.max()), 'mean_kl': float(kl.mean()),
        'kl_kv': config.kl_kv,
        'kl_f16_kv': {'max_kl': float(kls['f16'].max()), 'mean_kl': float(kls['f16'].mean())},
        'loadavg': {'start': load0, 'end': os.getloadavg(), 'cores': os.cpu_count()},
    }
    for side, runs in (('ours', ours), ('llama_cpp', peer)):
        for kind in ('prefill_cpu_tok_s', 'decode_cpu_tok_s'):
            row[side][kind] = [r[kind] for r in runs]
        for kind in ('prefill_tok_s', 'decode_tok_s', 'prefill_cpu_tok_s', 'decode_cpu_tok_s'):
            row[side][kind + '_median'] = statistics.median(row[side][kind])
    row['ratios'] = ratios(ours, peer)
    for kind in ('prefill', 'decode'):
        key = f'{kind}_cpu_tok_s_median'
        row['ratios'][f'{kind}_cpu_vs_llama_cpp'] = row['ours'][key] / row['llama_cpp'][key]
    row['ratios']['bytes_vs_llama_cpp'] = ours_bytes['per_token'] / llama_bytes['per_token']
    row['ratios']['rss_vs_llama_cpp'] = row['ours']['rss_mb'] / row['llama_cpp']['rss_mb']
    row['targets_met'] = targets_met({**row['ratios'], 'max_kl': row['max_kl']})
    return row


# --- through llm_node ---------------------------------------------------------------------------
def chat_prompt(model_dir: str, n: int) -> tuple:
    """Return (text, ids): a prompt whose chat-templated ids are at least n long."""
    from edge_llm_ros.runtime.request import conversation
    from edge_llm_ros.runtime.tokenizer import TextTokenizer
    from edge_llm_ros.runtime.types import GenerationRequest
    sys.path.insert(0, str(ROOT / 'bench'))
    import bench_engine
    tok = TextTokenizer.from_dir(model_dir)
    words, text, ids = bench_engine.PROMPT.split(), '', []
    for i in range(1, len(words) + 1):
        text = ' '.join(words[:i])
        ids = tok.encode_chat(conversation(GenerationRequest(prompt=text)))
        if len(ids) >= n:
            break
    return text, ids


def chat_template(model_dir: str) -> str:
    """Return the template the tokenizer applies (the GGUF's, saved by the converter)."""
    path = pathlib.Path(model_dir, 'chat_template.jinja')
    return path.read_text() if path.is_file() else ''


def node_goal(client, prompt: str, max_tokens: int) -> Dict:
    """One goal through the action; client-side times of the token feedback."""
    arrivals: List[tuple] = []   # (arrival time, completion tokens so far)
    t_send = time.perf_counter()
    handle = client.generate(prompt, max_tokens=max_tokens, temperature=0.0, on_feedback=(
        lambda fb: arrivals.append((time.perf_counter(), fb.completion_tokens))))
    outcome = handle.result(timeout=1800)
    list(handle.stream(timeout=10))   # drained: the last feedback has arrived
    arrivals = [a for a in arrivals if a[1]]
    if not outcome.ok or len(arrivals) < 2:
        raise RuntimeError(f'goal ended {outcome.status} ({outcome.error_message}) with '
                           f'{len(arrivals)} feedback messages')
    (t_first, n_first), (t_last, n_last) = arrivals[0], arrivals[-1]
    timings = outcome.timings
    return {'prompt_tokens': outcome.prompt_tokens, 'completion_tokens': outcome.completion_tokens,
            'first_feedback_s': t_first - t_send,
            'prefill_tok_s_client': outcome.prompt_tokens / (t_first - t_send),
            'prefill_tok_s_node': timings.prefill_tokens_per_second,
            'decode_tok_s': (n_last - n_first) / (t_last - t_first),
            'decode_tok_s_node': timings.decode_tokens_per_second,
            'text_start': outcome.text[:80]}


def node_row(model_dir: str, gguf: str, family: str, python: str, config: RowConfig) -> Dict:
    """Serve the model through llm_node and compare the action's rates with llama.cpp's.

    Goals and llama.cpp runs alternate. llama.cpp gets the chat-templated prompt ids our
    tokenizer gives (the node's, checked by count); the node decodes greedily. RSS: the node
    process's after the goals vs llama.cpp's at its end (the same context length).
    """
    import psutil
    import rclpy
    from rclpy.executors import MultiThreadedExecutor

    from edge_llm_ros.client import LLMClient
    from edge_llm_ros.node_process import NodeProcess
    load0 = os.getloadavg()
    text, ids = chat_prompt(model_dir, config.prompt_tokens)
    params = {'autostart': True, 'model.path': model_dir, 'model.family': family,
              'engine.intra_op_threads': config.threads, 'kv.prefix_reuse': False,
              'kv.max_context': config.max_context}
    t = time.perf_counter()
    node = NodeProcess('llm_node', name=f'llm_node_bench_models_{os.getpid()}', params=params)
    rclpy.init()
    client_node = rclpy.create_node(f'bench_models_client_{os.getpid()}')
    executor = MultiThreadedExecutor(num_threads=2)
    executor.add_node(client_node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    client = LLMClient(client_node, node.fqn)
    goals, peer = [], []
    try:
        node.wait_until_active(client, timeout=1800)
        load_s = time.perf_counter() - t
        if not client.wait_for_server(timeout=120):
            raise RuntimeError(f'{node.fqn}/generate did not appear')
        node_goal(client, text, 2)  # warm-up
        for _ in range(config.repeats):
            goals.append(node_goal(client, text, config.new_tokens))
            peer.append(run_peer(python, gguf, ids, config))
        node_rss = psutil.Process(node.pid).memory_info().rss / 2 ** 20
    finally:
        client.destroy()
        executor.shutdown(timeout_sec=5)
        spinner.join(timeout=10)
        client_node.destroy_node()
        rclpy.try_shutdown()
        node_exit = node.stop()
    med = statistics.median
    ours_decode = [g['decode_tok_s'] for g in goals]
    ours_prefill = [g['prefill_tok_s_client'] for g in goals]
    llama_decode = [r['decode_tok_s'] for r in peer]
    llama_prefill = [r['prefill_tok_s'] for r in peer]
    llama_rss = med(r['rss_mb'] for r in peer)
    values = {
        'decode_vs_llama_cpp': med(ours_decode) / med(llama_decode),
        'prefill_vs_llama_cpp': med(ours_prefill) / med(llama_prefill),
        'rss_vs_llama_cpp': node_rss / llama_rss,
    }
    met = targets_met(values)
    met['rss_vs_llama_cpp'] = values['rss_vs_llama_cpp'] <= NODE_RSS_TARGET
    return {'model_dir': model_dir, 'gguf': gguf, 'family': family, 'threads': config.threads,
            'prompt_text': text, 'prompt_ids': len(ids), 'new_tokens': config.new_tokens,
            'node_load_s': load_s, 'goals': goals, 'llama_cpp': peer,
            'node_rss_mb': node_rss, 'llama_cpp_rss_mb': llama_rss, 'ratios': values,
            'targets_met': met,
            'chat_template': chat_template(model_dir), 'node_exit_code': node_exit,
            'loadavg': {'start': load0, 'end': os.getloadavg(), 'cores': os.cpu_count()}}


# --- table -------------------------------------------------------------------------------------
def table(rows: Sequence[Dict]) -> str:
    """Markdown table of the rows (docs/benchmarks.md takes it as is)."""
    head = ('| model | arch | prefill tok/s ours / llama.cpp (x) | decode tok/s ours / llama.cpp '
            '(x) | MB read/token ours / llama.cpp (x) | max KL | RSS MB ours / llama.cpp | '
            'targets missed | load avg |')
    lines = [head, '|' + '---|' * 9]
    for r in rows:
        o, p, x = r['ours'], r['llama_cpp'], r['ratios']
        b = r['bytes_per_token']
        missed = [k for k, ok in r['targets_met'].items() if not ok]
        lines.append(
            f"| {r['model']} | {r['architecture']} | {o['prefill_tok_s_median']:.1f} / "
            f"{p['prefill_tok_s_median']:.1f} ({x['prefill_vs_llama_cpp']:.2f}) | "
            f"{o['decode_tok_s_median']:.1f} / {p['decode_tok_s_median']:.1f} "
            f"({x['decode_vs_llama_cpp']:.2f}) | {b['ours'] / 1e6:.0f} / "
            f"{b['llama_cpp'] / 1e6:.0f} ({x['bytes_vs_llama_cpp']:.2f}) | "
            f"{r['max_kl']:.1e} | {o['rss_mb']:.0f} / {p['rss_mb']:.0f} | "
            f"{', '.join(missed) or 'none'} | {r['loadavg']['start'][0]:.1f} |")
    return '\n'.join(lines)


def resolve(models: Sequence[str], ggufs: Sequence[str]) -> List[tuple]:
    """Pair each model folder with its GGUF (given in order, else from its model.yaml)."""
    if len(ggufs) > len(models):
        raise SystemExit(f'{len(ggufs)} --gguf for {len(models)} --model: give one per model')
    sys.path.insert(0, str(ROOT / 'bench'))
    import bench_engine
    pairs = []
    for i, model in enumerate(models):
        if model in ('', 'default'):
            model = bench_engine._default_model_dir()
        gguf = ggufs[i] if i < len(ggufs) and ggufs[i] else bench_engine.source_gguf(model)
        if not gguf:
            raise SystemExit(f'no GGUF for {model}: give --gguf after its --model')
        pairs.append((model, gguf))
    return pairs


def run_rows(models: Sequence[str], ggufs: Sequence[str], config: RowConfig,
             json_out: str = '', interleave: bool = False) -> int:
    """Measure every model; print the JSON rows and the table. Exit 3 when llama.cpp failed.

    interleave: the models are conversions of one GGUF, measured together (measure_rows).
    """
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / 'bench'))
    import llama_peer
    python = llama_peer.ensure_peer(install=True)['python']
    rows = []
    pairs = resolve(models, ggufs)
    if interleave and len({g for _, g in pairs}) > 1:
        raise SystemExit('--interleave measures conversions of one GGUF: '
                         f'got {sorted({g for _, g in pairs})}')
    groups = [pairs] if interleave else [[p] for p in pairs]
    for group in groups:
        try:
            got = measure_rows([m for m, _ in group], group[0][1], python, config)
        except PeerFailed as exc:
            print(f'bench_models: FAILED on {group[0][0]}: {exc}', file=sys.stderr)
            return PEER_FAILED
        rows.extend(got)
        for row in got:
            print(json.dumps(row), flush=True)
        if json_out:  # written after every row: a long run keeps what it measured
            pathlib.Path(json_out).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(json_out).write_text(json.dumps(
                {'config': asdict(config), 'targets': TARGETS, 'rows': rows}, indent=1))
    print(table(rows), file=sys.stderr)
    return 0


def run_node(models: Sequence[str], ggufs: Sequence[str], family: str, config: RowConfig,
             json_out: str = '') -> int:
    """node_row on the first model; print (and write) its JSON."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / 'bench'))
    import llama_peer
    python = llama_peer.ensure_peer(install=True)['python']
    model, gguf = resolve(models[:1], ggufs[:1])[0]
    try:
        row = node_row(model, gguf, family, python, config)
    except PeerFailed as exc:
        print(f'bench_models: FAILED on {model}: {exc}', file=sys.stderr)
        return PEER_FAILED
    text = json.dumps({'config': asdict(config), 'node': row}, indent=1)
    print(text)
    if json_out:
        pathlib.Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(json_out).write_text(text)
    return 0


def add_row_arguments(p: argparse.ArgumentParser) -> None:
    """Add the row options (shared with bench_engine.py --rows)."""
    p.add_argument('--prompt-tokens', type=int, default=RowConfig.prompt_tokens)
    p.add_argument('--new-tokens', type=int, default=RowConfig.new_tokens)
    p.add_argument('--kl-steps', type=int, default=RowConfig.kl_steps)
    p.add_argument('--kl-kv', choices=('f32', 'f16'), default=RowConfig.kl_kv,
                   help="llama.cpp's KV cache type for the KL columns (f32: an extra untimed "
                        'run with the precision of our cache; f16: the timed runs, its default)')


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--model', action='append', default=[],
                   help="converted model folder ('default' = SmolLM2); repeatable")
    p.add_argument('--gguf', action='append', default=[],
                   help='its GGUF, in the order of --model (default: from model.yaml)')
    p.add_argument('--threads', type=int, default=RowConfig.threads)
    p.add_argument('--repeats', type=int, default=RowConfig.repeats)
    p.add_argument('--max-context', type=int, default=RowConfig.max_context)
    p.add_argument('--json-out', default='')
    add_row_arguments(p)
    p.add_argument('--interleave', action='store_true',
                   help='the models are conversions of one GGUF: run them side by side '
                        "sharing llama.cpp's runs (one row each)")
    p.add_argument('--through-node', metavar='FAMILY', default='',
                   help='serve the (first) model through llm_node with this model.family '
                        "('auto': matched from its model.yaml) and time the action against "
                        'llama.cpp (prefill, decode, RSS)')
    p.add_argument('--peer', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--prompt-ids', default='[]', help=argparse.SUPPRESS)
    p.add_argument('--logits-out', default='', help=argparse.SUPPRESS)
    p.add_argument('--kv', default='f16', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peer:
        args.gguf = args.gguf[0]
        print(json.dumps(peer_main(args)))
        return 0
    config = RowConfig(threads=args.threads, prompt_tokens=args.prompt_tokens,
                       new_tokens=args.new_tokens, repeats=args.repeats,
                       kl_steps=args.kl_steps, max_context=args.max_context,
                       kl_kv=args.kl_kv)
    if args.through_node:
        family = '' if args.through_node == 'auto' else args.through_node
        return run_node(args.model or ['default'], args.gguf, family, config, args.json_out)
    return run_rows(args.model or ['default'], args.gguf, config, args.json_out,
                    args.interleave)


if __name__ == '__main__':
    sys.exit(main())
