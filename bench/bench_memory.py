"""The memory store's recall latency at 10k and 100k rows, and the process RSS (issue 42).

    python bench/bench_memory.py [--dims 384] [--queries 200] [--k 10]
                                 [--json-out bench/results/bench_memory.json]

Synthetic unit vectors (seeded normal draws, --dims wide) stand for embeddings: this times
the store's search (what ~/recall does after the query's one ~/embed call), not a model.
Rows get a text of ~70 bytes, one of 10 tags, a random stamp over one day and a pose in 'map'
within a 100 m square. The store is filled to 10k rows, measured, then to 100k, measured.
Per size and query kind, --queries searches of k rows from new random query vectors:
  * knn: no filter (sqlite-vec's vec0 KNN over every row);
  * tag: one tag (~10% of the rows, exact scan of those);
  * near: within 10 m of a random point (~3% of the rows);
  * window: the last 2.4 h (~10%).
RSS (psutil) is read after each fill; the file size is the database plus its WAL.
"""
import argparse
import json
import os
import pathlib
import platform
import tempfile
import time

import numpy as np
import psutil

from edge_llm_ros.memory.store import Filters, MemoryStore, Pose, StoreConfig

SIZES = (10_000, 100_000)
DAY_S = 86_400.0


def fill(store, rng, start, stop, dims, now):
    batch = 2_000
    for first in range(start, stop, batch):
        rows = []
        for i in range(first, min(first + batch, stop)):
            vec = rng.standard_normal(dims).astype(np.float32)
            rows.append((f'memory {i}: the pallet of blue boxes stands next to dock {i % 37}',
                         vec / np.linalg.norm(vec), now - DAY_S * float(rng.uniform()),
                         (f'tag{i % 10}',),
                         Pose('map', *(rng.uniform(0, 100, 2)), 0.0)))
        store.add_many(rows)


def times(store, rng, dims, k, queries, filters_of):
    out = []
    for _ in range(queries):
        vec = rng.standard_normal(dims).astype(np.float32)
        filters = filters_of(rng)
        t0 = time.perf_counter()
        hits = store.search(vec / np.linalg.norm(vec), k, filters)
        out.append(time.perf_counter() - t0)
        assert hits, 'a query found nothing'
    ms = np.array(out) * 1e3
    return {'p50_ms': round(float(np.percentile(ms, 50)), 3),
            'p99_ms': round(float(np.percentile(ms, 99)), 3),
            'mean_ms': round(float(ms.mean()), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--dims', type=int, default=384)
    ap.add_argument('--queries', type=int, default=200)
    ap.add_argument('--k', type=int, default=10)
    ap.add_argument('--json-out', default='bench/results/bench_memory.json')
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    proc = psutil.Process()
    now = time.time()
    kinds = {
        'knn': lambda r: Filters(),
        'tag': lambda r: Filters(tags=(f'tag{r.integers(10)}',)),
        'near': lambda r: Filters(near=Pose('map', *(r.uniform(10, 90, 2)), 0.0),
                                  radius_m=10.0),
        'window': lambda r: Filters(since=now - DAY_S / 10),
    }
    result = {'dims': args.dims, 'k': args.k, 'queries': args.queries,
              'machine': platform.processor() or platform.machine(), 'cpus': os.cpu_count(),
              'rss_mb_before': round(proc.memory_info().rss / 2**20, 1),
              'load_average_1m_at_start': os.getloadavg()[0], 'sizes': {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / 'memory.db'
        store = MemoryStore(StoreConfig(str(path), max_rows=SIZES[-1], max_bytes=1 << 40))
        store.check_model('synthetic', args.dims)
        done = 0
        for size in SIZES:
            t0 = time.perf_counter()
            fill(store, rng, done, size, args.dims, now)
            load_s = time.perf_counter() - t0
            done = size
            row = {'fill_rows_per_s': round((size - (0 if size == SIZES[0] else SIZES[0]))
                                            / load_s),
                   'rss_mb': round(proc.memory_info().rss / 2**20, 1),
                   'file_mb': round(sum(p.stat().st_size for p in path.parent.glob('memory.db*'))
                                    / 2**20, 1)}
            for kind, filters_of in kinds.items():
                times(store, rng, args.dims, args.k, 5, filters_of)   # warm the page cache
                row[kind] = times(store, rng, args.dims, args.k, args.queries, filters_of)
            row['rss_mb_after_queries'] = round(proc.memory_info().rss / 2**20, 1)
            result['sizes'][str(size)] = row
            print(json.dumps({size: row}))
        store.close()
    out = pathlib.Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + '\n')
    print(f'wrote {out}')


if __name__ == '__main__':
    main()
