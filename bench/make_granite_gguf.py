"""Write a random-weight Granite 4.0-H-Micro GGUF at its real shape (issue 41's 40 layers).

    .venv/bin/python bench/make_granite_gguf.py OUT.gguf [--type Q4_K] [--layers 40]
    .venv/bin/edge-llm-convert OUT.gguf OUT_DIR --weights kquant
    .venv/bin/python bench/bench_models.py --model OUT_DIR --gguf OUT.gguf --threads 1

Granite 4.0-H-Micro (granitehybrid, dense): hidden 2048, 40 layers of which 5, 15, 25 and 35
are attention (32 heads of 64, 8 KV heads, no RoPE), the rest Mamba-2 (d_inner 4096 in 64
heads of 64, 1 group, state 128, conv kernel 4), FFN 8192. Written by the parity tests' own
writer (test/gguf_fixtures.write_granite_gguf: its tiny vocabulary and its scales), so the
file is laid out as llama.cpp's converter writes it and llama.cpp loads it as is. The
matrices are random blocks of --type (K types: random valid blocks, the embedding and head
Q8_0).
"""
from __future__ import annotations

import argparse
import pathlib
import sys
from typing import List, Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'test'))

MICRO_ATTENTION = (5, 15, 25, 35)   # layer_types' "attention" entries in Micro's config


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('out', help='the .gguf to write')
    p.add_argument('--type', default='Q4_K', choices=['Q4_K', 'Q5_K', 'Q6_K', 'Q8_0', 'F16'],
                   help='the type of the matrices (default Q4_K)')
    p.add_argument('--layers', type=int, default=40, help='fewer layers (same layer shape)')
    args = p.parse_args(argv)
    if not 1 <= args.layers <= 40:
        p.error(f'--layers {args.layers}: Micro has 40 layers, pick 1 to 40')
    from gguf_fixtures import ParityCase, write_granite_gguf
    from tiny_model import TinyDims
    dims = TinyDims(hidden=2048, layers=args.layers, heads=32, kv_heads=8, intermediate=8192,
                    context=1024, rms_eps=1e-5, key_length=64)
    ssm = {'kernel': 4, 'heads': 64, 'groups': 1, 'state': 128,
           'attention': tuple(i for i in MICRO_ATTENTION if i < args.layers)}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_granite_gguf(out, ParityCase('granitehybrid', args.type, 0, dims=dims), ssm=ssm)
    print(f'{out}: {out.stat().st_size / 2 ** 30:.2f} GiB, {args.layers} layers, {args.type}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
