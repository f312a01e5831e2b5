"""Image embeddings from llama.cpp's own multimodal library (runs in the peer venv).

    <peer python> test/mtmd_runner.py text.gguf mmproj.gguf image.npy out.npz

Run by test/test_vision_encoder.py with the python of bench/llama_peer.py's venv
(llama-cpp-python's mtmd bindings over libmtmd), so it imports only llama_cpp and numpy. The
image is an [H, W, 3] uint8 array; it goes through mtmd's own preprocessing and encoder (CPU,
flash attention off), and every image chunk's embeddings are saved in order: `embeds_<i>`
[n_tokens, n_embd], plus `n_chunks`.
"""
import argparse
import ctypes
import sys

import llama_cpp
from llama_cpp import mtmd_cpp as mtmd
from llama_cpp_runner import load_model
import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ('text_model', 'mmproj', 'image', 'out'):
        p.add_argument(name)
    args = p.parse_args(argv)
    model = load_model(args.text_model)  # the sibling runner's: quiet logs, CPU only
    if not model:
        print(f'llama.cpp could not load {args.text_model}', file=sys.stderr)
        return 2
    params = mtmd.mtmd_context_params_default()
    params.use_gpu = False
    params.n_threads = 1
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    params.warmup = False
    params.print_timings = False
    ctx = mtmd.mtmd_init_from_file(args.mmproj.encode(), model, params)
    if not ctx:
        print(f'mtmd could not load {args.mmproj}', file=sys.stderr)
        return 2
    image = np.ascontiguousarray(np.load(args.image), dtype=np.uint8)
    h, w = image.shape[:2]
    bitmap = mtmd.mtmd_bitmap_init(w, h, image.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
    marker = mtmd.mtmd_default_marker()
    text = mtmd.mtmd_input_text()
    prompt = marker if isinstance(marker, bytes) else marker.encode()
    text.text = prompt
    text.text_len = len(prompt)
    text.add_special = False
    text.parse_special = True
    chunks = mtmd.mtmd_input_chunks_init()
    bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
    rc = mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1)
    if rc != 0:
        print(f'mtmd_tokenize failed ({rc})', file=sys.stderr)
        return 2
    n_embd = llama_cpp.llama_model_n_embd(model)
    out = {}
    for i in range(mtmd.mtmd_input_chunks_size(chunks)):
        chunk = mtmd.mtmd_input_chunks_get(chunks, i)
        if mtmd.mtmd_input_chunk_get_type(chunk) != 1:  # image
            continue
        if mtmd.mtmd_encode_chunk(ctx, chunk) != 0:
            print(f'mtmd_encode_chunk failed on chunk {i}', file=sys.stderr)
            return 2
        n_tokens = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
        embd = mtmd.mtmd_get_output_embd(ctx)
        out[f'embeds_{len(out)}'] = np.ctypeslib.as_array(
            embd, shape=(n_tokens * n_embd,)).reshape(n_tokens, n_embd).copy()
    np.savez(args.out, n_chunks=len(out), **out)
    mtmd.mtmd_input_chunks_free(chunks)
    mtmd.mtmd_bitmap_free(bitmap)
    mtmd.mtmd_free(ctx)
    return 0


if __name__ == '__main__':
    sys.exit(main())
