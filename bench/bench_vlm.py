"""Image -> first token: this engine vs llama.cpp's libmtmd on the same VLM files and threads.

    .venv/bin/python bench/bench_vlm.py [--shapes smolvlm-256m,gemma3-siglip400m]
        [--sizes 640x480,1920x1080]
        [--threads 2] [--repeats 2] [--encoder-type F32|F16|Q8_0]
        [--max-image-tokens 1196] [--parity-tokens 8]
        [--json-out bench/results/bench_vlm.json] [--clip 4 [--clip-size 320x240]]

Per shape, a random-weight VLM pair at the real shape is written once into .cache/bench_vlm/
(the speed of a matmul does not depend on its values):
- smolvlm-256m: SmolVLM-256M's SigLIP-93M mmproj (idefics3, 512 px tiles of 16 px patches,
  12 layers 768 wide, pixel unshuffle 4, longest edge 2048) and a language model of
  SmolLM2-135M's shape (30 layers, 576 wide; its vocabulary is the tests' small one with the
  image tokens, so the head is cheaper than the real 49k one), Q8_0 layers, F32 encoder.
- gemma3-siglip400m: Gemma 3 4B's SigLIP-400M mmproj (gemma3, 896 px of 14 px patches, 27
  layers 1152 wide, 4x4 average pooling: 256 tokens, attended both ways) over a language model
  of gemma-3-1b's shape (26 layers, 1152 wide, sliding window 512; the tests' small
  vocabulary), Q8_0 layers, F32 encoder. (Gemma 3 4B's own 2560-wide text model only makes
  the prefill longer for both.)
- qwen2.5vl-3b: Qwen2.5-VL-3B's encoder (qwen2.5vl_merger: 32 layers 1280 wide, 16 heads,
  SwiGLU 3420, patch 14, windows of 112 px with layers 7, 15, 23, 31 full, merger to 2048)
  and its language model at its real shape (bench/make_random_gguf.py qwen2.5vl-3b: qwen2vl,
  36 layers 2048 wide, 16 / 2 heads, MLP 11008, the 151,936-token vocabulary, tied head,
  llama.cpp's Q4_K_M type mix).
- qwen3vl-2b: Qwen3-VL-2B's encoder (qwen3vl_merger: 24 layers 1024 wide, 16 heads, GELU
  4096, patch 16, 48 x 48 learned positions, DeepStack after layers 5, 11, 17, merger to
  2048) and its language model at its real shape (make_random_gguf.py qwen3vl-2b: qwen3vl,
  28 layers 2048 wide, 16 / 8 heads of 128, MLP 6144, 151,936 tokens, Q4_K_M mix).
  Run these two with --encoder-type F16 (the mmproj-F16 files people download). Their
  matrices' spread is the tiny fixtures' times sqrt(64 / width) (`gain`), so activations
  grow per layer as in the tests: at the fixtures' own spread, 1024 wide, the residual
  stream grows 4-5x a matrix and float32 noise with it (the rows' peak reached 127 and the
  parity meant nothing).
--encoder-type writes the mmproj's matrices as F16 or Q8_0 instead (as the files people
download come; the pair then lives in .cache/bench_vlm/SHAPE-TYPE/): Q8_0 matrices stay 8-bit
on both sides (llama.cpp's Q8_0 matmul, our MatMulNBits over the same blocks).

Per image size, both run the same raw prompt `<__media__>Describe the image.` on a random
RGB image with --threads threads, each best of --repeats:
- this engine (in this process): preprocessing (resize, tiles, normalization), the encoder,
  and the prefill of the image's rows and the text to the first token, each timed alone (the
  prefill from the encoded rows, as the perception node hands them over);
- llama.cpp (test/mtmd_runner.py --timings in the peer venv): mtmd_tokenize (its
  preprocessing), mtmd_encode_chunk over every chunk, and mtmd_helper_eval_chunks + the first
  pick (which encodes again: prefill = that - encode).
The target is >= 1.3x llama.cpp to the first token; the JSON and the table say met / missed.

--clip N times a clip of N random frames (--clip-size) instead, on a small random Qwen2.5-VL
pair (`qwen25vl-clip`: an 8-layer 256-wide encoder with its windows, a 4-layer 256-wide
qwen2vl language model; no released model's shape): ours through ImageEncoder.encode_clip
(preprocess + encode, each 2 frames one temporal chunk) then the prefill from the cached
rows; llama.cpp's mtmd with one marker per frame, every bitmap mergeable
(test/mtmd_runner.py --mergeable), the same prompt after the frames.

A Qwen-VL model (any resolution) takes frames, not pre-encoded rows: its image is encoded
once (timed, kept in the encoder's cache), then the prefill is timed from the goal with that
image to the first token event (the cached rows, no second encoding). An image over
--max-image-tokens (the x86_64 board profile's vision.max_image_tokens, 1196), which the
engine would refuse, is first scaled down (Pillow's BICUBIC, not timed on either side) to the
largest size of mtmd's smart resize within the cap, as a client honouring the cap does; both
sides get that image. The same run checks parity: the image rows against mtmd's embeddings
(max and mean difference over mtmd's peak, the tokens within 1e-4 of it) and the first
--parity-tokens greedy ids (mtmd_runner --tokens N; its first-token time is taken at the
first id).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import time
from typing import Dict, List

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / 'test'))

from gguf_fixtures import ParityCase, write_gguf  # noqa: E402
from llama_cpp_parity import peer_python  # noqa: E402
from make_random_gguf import write_random_gguf  # noqa: E402
from mmproj_fixtures import (write_mmproj, write_qwen25vl_mmproj,  # noqa: E402
                             write_qwen3vl_mmproj)
import numpy as np  # noqa: E402
import psutil  # noqa: E402
from tiny_model import TinyDims  # noqa: E402

from edge_llm_ros.convert.converter import convert  # noqa: E402
from edge_llm_ros.model_format import is_current  # noqa: E402
from edge_llm_ros.runtime.media import VideoClip  # noqa: E402
from edge_llm_ros.runtime.mmproj_qwen import MIN_TOKENS, smart_size, token_grid  # noqa: E402
from edge_llm_ros.runtime.types import GenerationRequest  # noqa: E402
from edge_llm_ros.serving.engine import Engine, EngineConfig  # noqa: E402

RUNNER = ROOT / 'test' / 'mtmd_runner.py'
CACHE = ROOT / '.cache' / 'bench_vlm'
PROMPT = '<__media__>Describe the image.'
TARGET = 1.3
SHAPES = {
    'smolvlm-256m': {
        'mmproj': {'projector': 'idefics3', 'n_embd': 768, 'n_ff': 3072, 'n_layer': 12,
                   'n_head': 12, 'image_size': 512, 'patch': 16, 'scale': 4,
                   'longest_edge': 2048},
        'text': TinyDims(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536,
                         context=2048),
    },
    'gemma3-siglip400m': {
        'mmproj': {'projector': 'gemma3', 'n_embd': 1152, 'n_ff': 4304, 'n_layer': 27,
                   'n_head': 16, 'image_size': 896, 'patch': 14, 'scale': 4},
        'text': TinyDims(hidden=1152, layers=26, heads=4, kv_heads=1, intermediate=6912,
                         context=2048, rope_theta=1e6, rms_eps=1e-6, key_length=256),
        'arch': 'gemma3', 'window': 512,
    },
    'qwen2.5vl-3b': {
        'writer': write_qwen25vl_mmproj,
        'mmproj': {'n_embd': 1280, 'n_ff': 3420, 'n_layer': 32, 'n_head': 16,
                   'image_size': 560, 'patch': 14, 'wa_pattern': 8, 'gain': (64 / 1280) ** 0.5},
        'text_shape': 'qwen2.5vl-3b', 'n_text': 2048,
    },
    'qwen3vl-2b': {
        'writer': write_qwen3vl_mmproj,
        'mmproj': {'n_embd': 1024, 'n_ff': 4096, 'n_layer': 24, 'n_head': 16,
                   'image_size': 768, 'patch': 16, 'deepstack': (5, 11, 17),
                   'gain': (64 / 1024) ** 0.5},
        'text_shape': 'qwen3vl-2b', 'n_text': 2048,
    },
}
BOARD_CAP = 1196   # config/boards/x86_64.yaml's vision.max_image_tokens
CLIP_SHAPE = 'qwen25vl-clip'
CLIP_TEXT = TinyDims(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=768, context=2048)


def files(shape: str, encoder_type: str = 'F32') -> Dict[str, pathlib.Path]:
    """Write (once) the shape's mmproj and text GGUFs and convert them; return the paths."""
    clip = shape == CLIP_SHAPE
    spec = {'text': CLIP_TEXT} if clip else SHAPES[shape]
    work = CACHE / (shape if encoder_type == 'F32' else f'{shape}-{encoder_type}')
    work.mkdir(parents=True, exist_ok=True)
    text, mmproj, folder = work / 'text.gguf', work / 'mmproj.gguf', work / 'model'
    if 'text_shape' in spec:   # a real-shape language model, shared by the encoder types
        text = CACHE / shape / 'text.gguf'
        if not text.exists():
            write_random_gguf(text, spec['text_shape'])
        if not mmproj.exists():
            if encoder_type not in ('F32', 'F16'):
                raise SystemExit(f'{shape}: the mmproj writer has F32 or F16 matrices, not '
                                 f'{encoder_type}')
            spec['writer'](mmproj, n_text=spec['n_text'], seed=1, weight_type=encoder_type,
                           **spec['mmproj'])
    elif not text.exists():
        write_gguf(text, ParityCase(arch='qwen2vl', wtype='Q8_0', vision='qwen', dims=CLIP_TEXT)
                   if clip else
                   ParityCase(arch=spec.get('arch', 'llama'), wtype='Q8_0', vision=True,
                              dims=spec['text'], window=spec.get('window', 0)))
    if not mmproj.exists() and clip:
        write_qwen25vl_mmproj(mmproj, n_text=CLIP_TEXT.hidden, n_embd=256, n_ff=512,
                              n_layer=8, n_head=4, seed=1)
    elif not mmproj.exists():  # (the SigLIP shapes)
        write_mmproj(mmproj, n_text=spec['text'].hidden, seed=1, weight_type=encoder_type,
                     **spec['mmproj'])
    # Reconverted when missing or written by another converter version (model_format).
    if not (folder / 'vision.onnx').exists() or not is_current(folder):
        t0 = time.perf_counter()
        convert(str(text), str(folder), mmproj=str(mmproj), progress=False, overwrite=True)
        print(f'bench_vlm: converted {shape} in {time.perf_counter() - t0:.0f} s',
              file=sys.stderr)
    return {'text': text, 'mmproj': mmproj, 'folder': folder}


def ours(engine: Engine, image: np.ndarray, repeats: int) -> dict:
    """Preprocess + encode the image, then prefill its rows and the text to the first token.

    The prefill runs on the image's encoded rows (their wire form, as the perception node
    hands them over), so each part is timed alone; the first token is their sum (the engine
    does them one after the other).
    """
    best = None
    for _ in range(repeats):
        engine.vision.clear()
        wire = np.zeros(engine.vision.encoded_shape(*image.shape[:2]), np.float32)
        enc = engine.vision.encode_into(image, wire)   # as the perception node does it
        t0 = time.perf_counter()
        result = engine.generate(GenerationRequest(prompt=PROMPT, use_chat_template=False,
                                                   images=[wire], max_tokens=1)).run_to_end()
        prefill = time.perf_counter() - t0
        assert result.error == '', result.error
        total = enc.preprocess_s + enc.encode_s + prefill
        row = {'first_token_s': total, 'preprocess_s': enc.preprocess_s,
               'encode_s': enc.encode_s, 'prefill_s': prefill,
               'prompt_tokens': result.prompt_tokens}
        best = row if best is None or total < best['first_token_s'] else best
    return best


def ours_clip(engine: Engine, clip: VideoClip, repeats: int) -> dict:
    """Preprocess + encode the clip's chunks, then prefill from their cached rows."""
    best = None
    prompt = PROMPT.replace('Describe the image', 'Describe the clip')
    for _ in range(repeats):
        engine.vision.clear()
        enc = engine.vision.encode_clip(clip)   # each chunk's rows now cached by content
        t0 = time.perf_counter()
        result = engine.generate(GenerationRequest(prompt=prompt, use_chat_template=False,
                                                   images=[clip], max_tokens=1)).run_to_end()
        prefill = time.perf_counter() - t0
        assert result.error == '', result.error
        total = enc.preprocess_s + enc.encode_s + prefill
        row = {'first_token_s': total, 'preprocess_s': enc.preprocess_s,
               'encode_s': enc.encode_s, 'prefill_s': prefill,
               'prompt_tokens': result.prompt_tokens}
        best = row if best is None or total < best['first_token_s'] else best
    return best


def ours_frames(engine: Engine, image: np.ndarray, repeats: int, tokens: int) -> dict:
    """Encode a Qwen-VL frame (timed), then time its goal to the first token event.

    The goal finds the image's rows in the encoder's cache (by content digest), so the
    prefill is timed alone. Returns the timings, the rows and the greedy ids.
    """
    best = None
    for _ in range(repeats):
        engine.vision.clear()
        enc = engine.vision.encode(image)
        t0 = time.perf_counter()
        handle = engine.generate(GenerationRequest(prompt=PROMPT, use_chat_template=False,
                                                   images=[image], max_tokens=tokens))
        next(iter(handle))
        prefill = time.perf_counter() - t0
        result = handle.run_to_end()
        assert result.error == '', result.error
        total = enc.preprocess_s + enc.encode_s + prefill
        row = {'first_token_s': total, 'preprocess_s': enc.preprocess_s,
               'encode_s': enc.encode_s, 'prefill_s': prefill,
               'prompt_tokens': result.prompt_tokens,
               'rows': enc.rows, 'ids': list(result.token_ids)}
        best = row if best is None or total < best['first_token_s'] else best
    return best


def capped(image: np.ndarray, vision: dict, cap: int) -> np.ndarray:
    """Scale a Qwen-VL frame over `cap` tokens down to mtmd's smart size within it."""
    cols, rows = token_grid(image.shape[0], image.shape[1], vision)
    if not cap or cols * rows <= cap:
        return image
    from PIL import Image
    h, w = smart_size(image.shape[0], image.shape[1], int(vision['patch_size']),
                      int(vision.get('min_tokens') or MIN_TOKENS), cap)
    return np.asarray(Image.fromarray(image).resize((w, h), Image.BICUBIC))


def parity(ours_row: dict, theirs_row: dict) -> dict:
    """Image rows vs mtmd's embeddings (over mtmd's peak) and the greedy ids."""
    a, b = ours_row.pop('rows'), theirs_row.pop('embeds')
    ids_a, ids_b = ours_row.pop('ids'), theirs_row.pop('ids')
    if a.shape != b.shape:
        return {'shape_ours': list(a.shape), 'shape_mtmd': list(b.shape)}
    peak = float(np.abs(b).max())
    diff = np.abs(a - b)
    same = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y),
                min(len(ids_a), len(ids_b)))
    return {'rows': int(a.shape[0]), 'width': int(a.shape[1]), 'peak': peak,
            'max_over_peak': float(diff.max()) / peak,
            'mean_over_peak': float(diff.mean()) / peak,
            'tokens_within_1e-4': float(np.mean(diff.max(-1) <= 1e-4 * peak)),
            'ids_ours': ids_a, 'ids_mtmd': ids_b, 'ids_equal_prefix': same}


def theirs(paths: Dict[str, pathlib.Path], image, threads: int,
           repeats: int, work: pathlib.Path, tokens: int = 1) -> dict:
    """Return mtmd's times for one image, or a clip's frames (a list: mergeable markers)."""
    frames = image if isinstance(image, list) else [image]
    names = [str(work / f'image{i}.npy') for i in range(len(frames))]
    for name, frame in zip(names, frames):
        np.save(name, frame)
    prompt = PROMPT if not isinstance(image, list) else (
        '<__media__>' * len(frames) + 'Describe the clip.')
    extra = ['--mergeable'] if isinstance(image, list) else []
    best = None
    for _ in range(repeats):
        out = work / 'mtmd.npz'
        proc = subprocess.run([peer_python(), str(RUNNER), str(paths['text']),
                               str(paths['mmproj']), ','.join(names), str(out),
                               '--prompt', prompt, '--tokens', str(tokens),
                               '--threads', str(threads), '--timings', '--add-special', *extra],
                              capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f'mtmd failed: {proc.stderr[-2000:]}')
        d = np.load(out)
        first = float(d['preprocess_s']) + float(d['first_token_s'])
        row = {'first_token_s': first, 'preprocess_s': float(d['preprocess_s']),
               'encode_s': float(d['encode_s']),
               'prefill_s': max(float(d['first_token_s']) - float(d['encode_s']), 0.0),
               'prompt_tokens': sum(len(d[f'chunk_{i}']) if t == 0 else int(d[f'chunk_{i}'][0])
                                    for i, t in enumerate(d['chunk_types'])),
               'embeds': d['embeds_0'], 'ids': [int(t) for t in d['tokens']]}
        best = row if best is None or first < best['first_token_s'] else best
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--shapes', default=','.join(SHAPES))
    p.add_argument('--sizes', default='640x480,1920x1080')
    p.add_argument('--threads', type=int, default=2)
    p.add_argument('--repeats', type=int, default=2)
    p.add_argument('--encoder-type', default='F32', choices=('F32', 'F16', 'Q8_0'),
                   help="the mmproj matrices' type (default F32)")
    p.add_argument('--max-image-tokens', type=int, default=BOARD_CAP,
                   help='a Qwen-VL frame over this many tokens is scaled down to fit first '
                        '(the x86_64 board profile: 1196; 0: no cap)')
    p.add_argument('--parity-tokens', type=int, default=8,
                   help='greedy ids compared with mtmd (Qwen-VL shapes)')
    p.add_argument('--json-out', default='',
                   help='default bench/results/bench_vlm.json (bench_vlm_clip.json with --clip)')
    p.add_argument('--clip', type=int, default=0, metavar='N',
                   help=f'time a clip of N frames on {CLIP_SHAPE} instead of the shapes')
    p.add_argument('--clip-size', default='320x240', help="the clip frames' WxH")
    args = p.parse_args(argv)
    rows: List[dict] = []
    for shape in ([CLIP_SHAPE] if args.clip else args.shapes.split(',')):
        paths = files(shape, args.encoder_type)
        rss0 = psutil.Process().memory_info().rss
        engine = Engine(EngineConfig(model_dir=str(paths['folder']), max_context=2048,
                                     intra_op_threads=args.threads, prefix_reuse=False))
        rss = psutil.Process().memory_info().rss - rss0
        try:
            for size in ([args.clip_size] if args.clip else args.sizes.split(',')):
                w, h = (int(v) for v in size.split('x'))
                image = np.random.default_rng(w).integers(0, 256, (h, w, 3), np.uint8)
                qwen = engine.vision.vision.get('positions') == 'mrope'
                extra = {}
                if args.clip:
                    image = [np.random.default_rng(w + j).integers(0, 256, (h, w, 3), np.uint8)
                             for j in range(args.clip)]
                    size, qwen = f'{size} x {args.clip} frames', False
                    a = ours_clip(engine, VideoClip(tuple(image), tuple(
                        0.5 * j for j in range(args.clip)), 2.0), args.repeats)
                elif qwen:
                    image = capped(image, engine.vision.vision, args.max_image_tokens)
                    a = ours_frames(engine, image, args.repeats, args.parity_tokens)
                else:
                    a = ours(engine, image, args.repeats)
                # This process's growth since before the engine loaded (model, encoder, the
                # image's activations kept by onnxruntime's arena).
                grown = psutil.Process().memory_info().rss - rss0
                print(json.dumps({'shape': shape, 'size': size, 'engine_only': {
                    k: v for k, v in a.items() if k not in ('rows', 'ids')}}), file=sys.stderr)
                b = theirs(paths, image, args.threads, args.repeats, paths['folder'].parent,
                           args.parity_tokens if qwen else 1)
                if qwen:
                    extra = {'sent_size': f'{image.shape[1]}x{image.shape[0]}',
                             'max_image_tokens': args.max_image_tokens,
                             'parity': parity(a, b)}
                else:
                    b.pop('embeds'), b.pop('ids')
                ratio = b['first_token_s'] / a['first_token_s']
                rows.append({'shape': shape, 'size': size, **extra, 'threads': args.threads,
                             'encoder_type': args.encoder_type,
                             'engine': a, 'llama_cpp': b, 'speedup': ratio,
                             'encoder_share': a['encode_s'] / a['first_token_s'],
                             'engine_rss_mb': rss / 2**20, 'engine_rss_after_mb': grown / 2**20,
                             # the largest peak of any llama.cpp run so far (whole process)
                             'llama_cpp_peak_rss_mb': resource.getrusage(
                                 resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
                             'target': f'>= {TARGET}x', 'met': ratio >= TARGET})
                print(json.dumps(rows[-1]), file=sys.stderr)
        finally:
            engine.close()
    out = pathlib.Path(args.json_out or ROOT / 'bench' / 'results' / (
        'bench_vlm_clip.json' if args.clip else 'bench_vlm.json'))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({'bench': 'vlm', 'cpus': os.cpu_count(), 'rows': rows},
                              indent=1))
    print('| shape | image | tokens | engine: preprocess / encode / prefill = first token (s) '
          '| llama.cpp mtmd: same (s) | speedup | target 1.3x | RSS engine / llama.cpp (MiB) |')
    print('|---|---|---|---|---|---|---|---|')
    for r in rows:
        a, b = r['engine'], r['llama_cpp']
        print(f'| {r["shape"]} | {r["size"]} | {a["prompt_tokens"]} | '
              f'{a["preprocess_s"]:.2f} / {a["encode_s"]:.2f} / {a["prefill_s"]:.2f} = '
              f'{a["first_token_s"]:.2f} | {b["preprocess_s"]:.2f} / {b["encode_s"]:.2f} / '
              f'{b["prefill_s"]:.2f} = {b["first_token_s"]:.2f} | {r["speedup"]:.2f}x | '
              f'{"met" if r["met"] else "missed"} | {r["engine_rss_after_mb"]:.0f} / '
              f'{r["llama_cpp_peak_rss_mb"]:.0f} |')
    return 0


if __name__ == '__main__':
    sys.exit(main())
