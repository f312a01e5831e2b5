"""Embedding throughput and one query's latency, this package vs llama.cpp on the same GGUF.

    .venv/bin/python bench/bench_embed.py [--threads 2] [--type F16] [--shape bge-small]
        [--texts 256] [--out bench/results/...]

A random GGUF of bge-small's shape (bert: hidden 384, 12 layers, 12 heads, FFN 1536, context
512; test/bert_fixture.py's small WPM vocabulary) embeds 256 sentences of 8-128 tokens: here
through runtime/encoder.py (length-bucket batches), and through llama.cpp (the llama-cpp-python
peer of bench/llama_peer.py, Llama.embed over the list: its own batching, 512-token ubatches
as llama-server's default), the same threads.
Then one short query alone (median of 5). Model load is not timed. Writes one JSON file.
--shape qwen3-0.6b: a random Qwen3-Embedding-0.6B-shape GGUF instead (qwen3: hidden 1024, 28
layers, 16 query / 8 KV heads of 128, FFN 3072, last-token pooling; the tiny byte-level
vocabulary of test/gguf_fixtures.py, so sentences are 2-30 words).
"""
import argparse
import json
import pathlib
import platform
import random
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'test'))
sys.path.insert(0, str(ROOT / 'bench'))

QUERY = 'where is the red cup?'


def sentences(n: int, seed: int = 0, words: tuple = (6, 126)) -> list:
    """Return n sentences of the fixture's words (6-126: 8-128 bert tokens with [CLS], [SEP])."""
    from bert_fixture import WORDS
    rng = random.Random(seed)
    return [' '.join(rng.choice(WORDS) for _ in range(rng.randint(*words))) for _ in range(n)]


def write_model(shape: str, wtype: str, path: pathlib.Path) -> pathlib.Path:
    """Write the random GGUF of `shape` in `wtype`."""
    if shape == 'qwen3-0.6b':
        import gguf
        from gguf_fixtures import ParityCase, write_gguf
        from tiny_model import TinyDims
        dims = TinyDims(hidden=1024, layers=28, heads=16, kv_heads=8, intermediate=3072,
                        context=4096, rope_theta=1e6, rms_eps=1e-6, key_length=128)
        return write_gguf(path, ParityCase('qwen3', wtype, dims=dims),
                          header={'pooling_type': gguf.PoolingType.LAST, 'add_eos_token': True})
    from bert_fixture import BertCase, write_bert_gguf
    return write_bert_gguf(path, BertCase(wtype, 'mean', hidden=384, heads=12, layers=12,
                                          ff=1536, context=512))


def main(argv=None) -> int:
    import llama_peer
    import numpy as np
    from edge_llm_ros.convert.converter import convert
    from edge_llm_ros.runtime.encoder import EncoderConfig, TextEncoder
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--type', default='F16', choices=('F32', 'F16', 'Q8_0'))
    p.add_argument('--shape', default='bge-small', choices=('bge-small', 'qwen3-0.6b'))
    p.add_argument('--texts', type=int, default=256)
    p.add_argument('--out', default='')
    args = p.parse_args(argv)
    texts = sentences(args.texts, words=(2, 30) if args.shape == 'qwen3-0.6b' else (6, 126))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        gguf = write_model(args.shape, args.type, tmp / f'{args.shape}-shape.gguf')
        folder = convert(str(gguf), str(tmp / 'model'), progress=False)
        enc = TextEncoder(str(folder), EncoderConfig(threads=args.threads))
        tokens = [len(i) for i in enc.tokenize(texts, truncate=False)]
        print(f'{len(texts)} texts, {sum(tokens)} tokens', flush=True)
        enc.embed(texts[:4])   # warm-up
        t0 = time.perf_counter()
        ours = enc.embed(texts).vectors
        batch_s = time.perf_counter() - t0
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            enc.embed([QUERY])
            runs.append(time.perf_counter() - t0)
        query_s = sorted(runs)[2]
        print(f'ours: {batch_s:.1f} s, query {query_s * 1e3:.1f} ms', flush=True)
        src = tmp / 'texts.json'
        src.write_text(json.dumps(texts))
        peer = llama_peer.ensure_peer(True)['python']
        runner = str(ROOT / 'test' / 'llama_cpp_embed_runner.py')
        done = subprocess.run([peer, runner, str(gguf), str(tmp / 'x.npz'), str(src),
                               '--threads', str(args.threads), '--ctx', '4096', '--ubatch', '512',
                               '--time', QUERY], check=True, capture_output=True, text=True)
        theirs = json.loads(done.stdout.strip().splitlines()[-1])
        # Parity on a sample (every text: test_embed_parity.py's job).
        (tmp / 'some.json').write_text(json.dumps(texts[:16]))
        subprocess.run([peer, runner, str(gguf), str(tmp / 'v.npz'), str(tmp / 'some.json'),
                        '--ctx', '512', '--threads', str(args.threads)], check=True,
                       capture_output=True)
        ref = np.load(tmp / 'v.npz')['vectors']
        ref = ref / np.linalg.norm(ref, axis=1, keepdims=True)
        cos = (ours[:16] * ref).sum(axis=1)
    result = {
        'bench': 'bench_embed', 'model': f'random {args.shape} shape, {args.type}',
        'texts': len(texts), 'tokens': int(sum(tokens)),
        'tokens_min_max': [min(tokens), max(tokens)], 'threads': args.threads,
        'ours': {'batch_s': batch_s, 'texts_per_s': len(texts) / batch_s,
                 'query_ms': query_s * 1e3},
        'llama_cpp': {'batch_s': theirs['batch_s'],
                      'texts_per_s': len(texts) / theirs['batch_s'],
                      'query_ms': theirs['query_s'] * 1e3},
        'speedup': theirs['batch_s'] / batch_s, 'query_ratio': query_s / theirs['query_s'],
        'cosine_min_first16': float(cos.min()), 'machine': platform.machine(),
        'when': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()),
    }
    tag = '' if args.shape == 'bge-small' else f'{args.shape}_'
    out = pathlib.Path(args.out or ROOT / 'bench' / 'results' /
                       f'bench_embed_{tag}{args.type}_{args.threads}t.json')
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + '\n')
    print(json.dumps(result, indent=2))
    return 0


if __name__ == '__main__':
    sys.exit(main())
