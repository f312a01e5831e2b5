"""Run llama.cpp's own multimodal library on a prompt with images (runs in the peer venv).

    <peer python> test/mtmd_runner.py text.gguf mmproj.gguf a.npy[,b.npy...] out.npz
        [--prompt TEXT] [--tokens N] [--add-special] [--threads N] [--timings]
        [--layout-only] [--mergeable]

Run by the vision tests with the python of bench/llama_peer.py's venv (llama-cpp-python's
mtmd bindings over libmtmd), so it imports only llama_cpp and numpy. Each image is an
[H, W, 3] uint8 array; the prompt (default: one media marker per image) is split by mtmd at
its `<__media__>` markers, with special tokens parsed, and every image goes through mtmd's own
preprocessing and encoder (CPU, flash attention off). Saved:
- `n_chunks` and `embeds_<i>` [n_tokens, n_embd_inp]: every image chunk's embeddings, in
  order (Qwen3-VL's rows carry its DeepStack features after the main n_embd);
- `chunk_types` (0 text, 1 image), and per chunk `chunk_<j>`: a text chunk's token ids, or
  an image chunk's token count as a one-element array;
- with --tokens N: `tokens`, N greedy ids after mtmd_helper_eval_chunks evaluated the prompt
  (float32 KV cache, flash attention off, the whole prompt in one batch), and `logits`;
- with --timings (bench/bench_vlm.py): `preprocess_s` (mtmd_tokenize: decoding the
  bitmaps' layout, resizing and tiling), `encode_s` (every image chunk through the encoder)
  and `first_token_s` (a fresh mtmd_helper_eval_chunks, which encodes again and prefills,
  plus the first greedy pick), in seconds.
With --mergeable every bitmap is marked mergeable (mtmd_bitmap_set_mergeable, as a video's
frames): adjacent frames of one size with no text between are one temporal chunk (Qwen-VL).
With --layout-only the chunks are recorded but no image is encoded (token counts of large
images, test/test_vision_qwen.py).
With --dump PREFIX[,PREFIX...] the encoder's float32 tensors whose names start with a prefix
(clip.cpp's names, e.g. `ffn_up_b` for every GELU input) are saved as they are computed,
through mtmd's cb_eval: `dump_<k>_<name>`, in the order the graphs ran them (tile by tile).
"""
import argparse
import ctypes
import pathlib
import sys
import time

import llama_cpp
from llama_cpp import mtmd_cpp as mtmd
from llama_cpp_runner import GGML_TYPE_F32, load_model
import numpy as np

CTX = 1024


def _context(model, threads: int, ctx: int = CTX):
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = ctx
    cparams.n_seq_max = 1
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.type_k = cparams.type_v = GGML_TYPE_F32
    cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    return llama_cpp.llama_init_from_model(model, cparams)


def _dumper(prefixes, dumped: list):
    """Return a ggml eval callback that appends (name, array) of the named float32 tensors."""
    base = ctypes.CDLL(str(pathlib.Path(llama_cpp.__file__).parent / 'lib' / 'libggml-base.so'))
    base.ggml_get_name.restype = ctypes.c_char_p
    base.ggml_get_data.restype = ctypes.c_void_p
    base.ggml_is_contiguous.restype = ctypes.c_bool
    for f in (base.ggml_get_name, base.ggml_get_data, base.ggml_is_contiguous):
        f.argtypes = [ctypes.c_void_p]

    def callback(tensor, ask, _):
        name = base.ggml_get_name(tensor).decode()
        if ask or not name.startswith(prefixes) or not base.ggml_is_contiguous(tensor):
            return True
        # struct ggml_tensor (ggml.h) opens with: enum ggml_type type (F32 = 0), the buffer
        # pointer, int64_t ne[4]. On the CPU backend the data is host memory.
        if ctypes.c_int32.from_address(tensor).value != 0:
            return True
        ne = [ctypes.c_int64.from_address(tensor + 16 + 8 * k).value for k in range(4)]
        data = (ctypes.c_float * int(np.prod(ne))).from_address(base.ggml_get_data(tensor))
        dumped.append((name, np.ctypeslib.as_array(data).reshape(ne[::-1]).copy()))
        return True
    return llama_cpp.ggml_backend_sched_eval_callback(callback)  # params.cb_eval holds it


def _chunk_record(chunk) -> np.ndarray:
    if mtmd.mtmd_input_chunk_get_type(chunk) != 0:
        return np.array([mtmd.mtmd_input_chunk_get_n_tokens(chunk)], np.int64)
    n = ctypes.c_size_t(0)
    ptr = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
    return np.array([ptr[i] for i in range(n.value)], np.int64)


def _greedy(model, ctx, chunks, lctx, n_tokens: int, out: dict, batch: int = CTX) -> int:
    new_past = llama_cpp.llama_pos(0)
    t0 = time.perf_counter()
    rc = mtmd.mtmd_helper_eval_chunks(ctx, lctx, chunks, 0, 0, batch, True,
                                      ctypes.byref(new_past))
    if rc != 0:
        print(f'mtmd_helper_eval_chunks failed ({rc})', file=sys.stderr)
        return 3
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    rows, ids = [], []
    while True:
        ptr = llama_cpp.llama_get_logits_ith(lctx, -1)
        rows.append(np.ctypeslib.as_array(ptr, shape=(vocab,)).copy())
        if len(ids) == n_tokens:
            break
        ids.append(int(np.argmax(rows[-1])))
        if len(ids) == 1:
            out['first_token_s'] = time.perf_counter() - t0
        arr = (llama_cpp.llama_token * 1)(ids[-1])
        if llama_cpp.llama_decode(lctx, llama_cpp.llama_batch_get_one(arr, 1)) != 0:
            print('llama_decode failed', file=sys.stderr)
            return 3
    out['tokens'] = np.array(ids, np.int64)
    out['logits'] = np.stack(rows)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ('text_model', 'mmproj', 'images', 'out'):
        p.add_argument(name)
    p.add_argument('--prompt', default=None)
    p.add_argument('--tokens', type=int, default=0)
    p.add_argument('--add-special', action='store_true')
    p.add_argument('--threads', type=int, default=1)
    p.add_argument('--timings', action='store_true')
    p.add_argument('--layout-only', action='store_true')
    p.add_argument('--mergeable', action='store_true')
    p.add_argument('--dump', default='')
    args = p.parse_args(argv)
    model = load_model(args.text_model)  # the sibling runner's: quiet logs, CPU only
    if not model:
        print(f'llama.cpp could not load {args.text_model}', file=sys.stderr)
        return 2
    params = mtmd.mtmd_context_params_default()
    params.use_gpu = False
    params.n_threads = args.threads
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    params.warmup = False
    params.print_timings = False
    dumped = []
    if args.dump:
        params.cb_eval = _dumper(tuple(args.dump.split(',')), dumped)
        params.cb_eval_user_data = None
    ctx = mtmd.mtmd_init_from_file(args.mmproj.encode(), model, params)
    if not ctx:
        print(f'mtmd could not load {args.mmproj}', file=sys.stderr)
        return 2
    images = [np.ascontiguousarray(np.load(f), dtype=np.uint8) for f in args.images.split(',')]
    bitmaps = [mtmd.mtmd_bitmap_init(im.shape[1], im.shape[0],
                                     im.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
               for im in images]
    for b in bitmaps if args.mergeable else ():
        mtmd.mtmd_bitmap_set_mergeable(b, True)
    marker = mtmd.mtmd_default_marker()
    marker = marker.decode() if isinstance(marker, bytes) else marker
    prompt = (args.prompt if args.prompt is not None else marker * len(images)).encode()
    text = mtmd.mtmd_input_text()
    text.text = prompt
    text.text_len = len(prompt)
    text.add_special = args.add_special
    text.parse_special = True
    chunks = mtmd.mtmd_input_chunks_init()
    array = (mtmd.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps)
    t0 = time.perf_counter()
    rc = mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), array, len(bitmaps))
    preprocess_s = time.perf_counter() - t0
    if rc != 0:
        print(f'mtmd_tokenize failed ({rc})', file=sys.stderr)
        return 2
    # The image rows' width: n_embd, or Qwen3-VL's n_embd x (1 + n_deepstack_layers).
    n_embd = llama_cpp.llama_model_n_embd_inp(model)
    out, types, embeds, encode_s = {}, [], 0, 0.0
    for i in range(mtmd.mtmd_input_chunks_size(chunks)):
        chunk = mtmd.mtmd_input_chunks_get(chunks, i)
        types.append(int(mtmd.mtmd_input_chunk_get_type(chunk)))
        out[f'chunk_{i}'] = _chunk_record(chunk)
        if types[-1] != 1 or args.layout_only:  # an image, to encode
            continue
        t0 = time.perf_counter()
        if mtmd.mtmd_encode_chunk(ctx, chunk) != 0:
            print(f'mtmd_encode_chunk failed on chunk {i}', file=sys.stderr)
            return 2
        encode_s += time.perf_counter() - t0
        n_tokens = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
        embd = mtmd.mtmd_get_output_embd(ctx)
        out[f'embeds_{embeds}'] = np.ctypeslib.as_array(
            embd, shape=(n_tokens * n_embd,)).reshape(n_tokens, n_embd).copy()
        embeds += 1
    rc = 0
    if args.timings:
        out.update(preprocess_s=preprocess_s, encode_s=encode_s)
    if args.tokens:
        # The KV cache takes one cell per token: a Qwen-VL image takes nx x ny tokens but
        # only max(nx, ny) positions (M-RoPE), so size it by both.
        n_pos = max(mtmd.mtmd_helper_get_n_pos(chunks),
                    mtmd.mtmd_helper_get_n_tokens(chunks)) + args.tokens + 1
        lctx = _context(model, args.threads, max(CTX, n_pos))
        rc = _greedy(model, ctx, chunks, lctx, args.tokens, out, max(CTX, n_pos))
        llama_cpp.llama_free(lctx)
    out.update({f'dump_{k}_{name}': value for k, (name, value) in enumerate(dumped)})
    np.savez(args.out, n_chunks=embeds, chunk_types=np.array(types, np.int64), **out)
    mtmd.mtmd_input_chunks_free(chunks)
    for b in bitmaps:
        mtmd.mtmd_bitmap_free(b)
    mtmd.mtmd_free(ctx)
    return rc


if __name__ == '__main__':
    sys.exit(main())
