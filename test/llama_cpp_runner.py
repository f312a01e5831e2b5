"""Greedy-decode token ids with llama.cpp and save every step's logits (runs in the peer venv).

    <peer python> test/llama_cpp_runner.py model.gguf out.npz --prompt 5,17,99 --tokens 32

Run by test/llama_cpp_parity.py with the python of bench/llama_peer.py's venv (llama-cpp-python
built portably), so it imports only llama_cpp and numpy. Token ids go in directly (no
tokenizer), the KV cache is float32 and flash attention is off, so what is left of llama.cpp's
own rounding is its weight formats and the activation quantization of its matmuls. Writes
`logits` [steps, vocab] (the prompt's last position, then one row per generated token) and
`tokens` [n] to out.npz. --kv q8_0 gives it a q8_0 KV cache with flash attention instead (what
kv.dtype int8 is compared with), --kv f16 llama.cpp's default f16 cache (what
bench_models' peer runs); --follow feeds those ids after the prompt instead of its own
greedy choices (teacher forcing: rows comparable with another model's on the same ids).
"""
import argparse
import ctypes
import sys

import llama_cpp
import numpy as np

GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_Q8_0 = 8


@llama_cpp.llama_log_callback
def _quiet(level, text, user_data):  # llama.cpp logs every load to stderr otherwise
    if level == 4:  # GGML_LOG_LEVEL_ERROR only
        sys.stderr.write(text.decode(errors='replace'))


def load_model(path: str):
    """Quiet llama.cpp's logging and load a GGUF on the CPU; None when it cannot."""
    llama_cpp.llama_log_set(_quiet, ctypes.c_void_p())
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = 0
    return llama_cpp.llama_model_load_from_file(path.encode(), mparams)


def set_adapters(model, ctx, specs) -> bool:
    """Apply LoRA GGUFs ('path:scale' each) with llama.cpp's adapter API."""
    adapters, scales = [], []
    for spec in specs:
        path, _, scale = spec.rpartition(':')
        adapter = llama_cpp.llama_adapter_lora_init(model, path.encode())
        if not adapter:
            print(f'llama.cpp could not load the LoRA adapter {path}', file=sys.stderr)
            return False
        adapters.append(adapter)
        scales.append(float(scale))
    arr = (llama_cpp.llama_adapter_lora_p_ctypes * len(adapters))(*adapters)
    rc = llama_cpp.llama_set_adapters_lora(ctx, arr, len(adapters),
                                           (ctypes.c_float * len(scales))(*scales))
    if rc != 0:
        print(f'llama_set_adapters_lora returned {rc}', file=sys.stderr)
    return rc == 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('model')
    p.add_argument('out')
    p.add_argument('--prompt', required=True, help='comma-separated token ids')
    p.add_argument('--tokens', type=int, default=32)
    p.add_argument('--threads', type=int, default=1)
    p.add_argument('--ctx', type=int, default=256)
    p.add_argument('--lora', action='append', default=[],
                   help='PATH:SCALE, a LoRA GGUF applied at SCALE (repeatable)')
    p.add_argument('--kv', choices=('f32', 'f16', 'q8_0'), default='f32')
    p.add_argument('--follow', default='', help='comma-separated ids fed after the prompt')
    args = p.parse_args(argv)
    follow = [int(t) for t in args.follow.split(',') if t]
    model = load_model(args.model)
    if not model:
        print(f'llama.cpp could not load {args.model}', file=sys.stderr)
        return 2
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = args.ctx
    cparams.n_batch = args.ctx
    cparams.n_ubatch = args.ctx
    cparams.n_seq_max = 1
    cparams.n_threads = args.threads
    cparams.n_threads_batch = args.threads
    if args.kv == 'q8_0':   # a quantized V needs flash attention
        cparams.type_k = cparams.type_v = GGML_TYPE_Q8_0
        cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    elif args.kv == 'f16':  # llama.cpp's defaults (bench_models' peer): f16 cache, FA auto
        cparams.type_k = cparams.type_v = GGML_TYPE_F16
    else:
        cparams.type_k = cparams.type_v = GGML_TYPE_F32
        cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        print('llama.cpp could not create a context', file=sys.stderr)
        return 2
    if args.lora and not set_adapters(model, ctx, args.lora):
        return 2
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    ids = [int(t) for t in args.prompt.split(',') if t]
    rows, out = [], []
    for _ in range(args.tokens + 1):
        arr = (llama_cpp.llama_token * len(ids))(*ids)
        rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(ids)))
        if rc != 0:
            print(f'llama_decode returned {rc}', file=sys.stderr)
            return 3
        ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
        rows.append(np.ctypeslib.as_array(ptr, shape=(vocab,)).copy())
        if len(out) == args.tokens:
            break
        out.append(follow[len(out)] if follow else int(np.argmax(rows[-1])))
        ids = [out[-1]]
    np.savez(args.out, logits=np.stack(rows), tokens=np.array(out, np.int64))
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return 0


if __name__ == '__main__':
    sys.exit(main())
