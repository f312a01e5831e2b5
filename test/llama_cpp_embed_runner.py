"""Embed texts with llama.cpp and save its vectors and token ids (runs in the peer venv).

    <peer python> test/llama_cpp_embed_runner.py model.gguf out.npz texts.json [--pooling mean]

Run by test/test_embed_parity.py with the python of bench/llama_peer.py's venv, so it imports
only llama_cpp, numpy and the standard library. Each text is embedded alone (its own
sequence), flash attention off, the pooling the GGUF says unless --pooling names one; the
vectors are llama.cpp's pooled output, not normalized. Writes `vectors` [n, dim] (concatenated
rows of pooling 'none' with `lengths`), `tokens` (concatenated ids) and `lengths` to out.npz.
A text may be a list of token ids (fed as they are) or {"query": q, "document": d}: the rerank
prompt of the GGUF (tokenizer.chat_template.rerank) with both put in, tokenized as
llama-server's format_prompt_rerank does (special tokens parsed, none added); with rank
pooling the vector is every label's score (Qwen3-Reranker: P(yes), P(no)).
"""
import argparse
import json
import sys

import llama_cpp
import numpy as np

POOLING = {'gguf': llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED,
           'none': llama_cpp.LLAMA_POOLING_TYPE_NONE, 'mean': llama_cpp.LLAMA_POOLING_TYPE_MEAN,
           'cls': llama_cpp.LLAMA_POOLING_TYPE_CLS, 'last': llama_cpp.LLAMA_POOLING_TYPE_LAST,
           'rank': llama_cpp.LLAMA_POOLING_TYPE_RANK}


def _embed_ids(llm, ids, rank: bool) -> np.ndarray:
    """One sequence of token ids through llama_decode; its pooled vector (rank: the labels')."""
    ctx = llm._ctx.ctx
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    batch = llama_cpp.llama_batch_init(len(ids), 0, 1)
    batch.n_tokens = len(ids)
    for i, t in enumerate(ids):
        batch.token[i] = t
        batch.pos[i] = i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = True
    if llama_cpp.llama_decode(ctx, batch) != 0:
        raise RuntimeError('llama_decode failed')
    n = max(1, llama_cpp.llama_model_n_cls_out(llm.model)) if rank else llm.n_embd()
    ptr = llama_cpp.llama_get_embeddings_seq(ctx, 0)
    out = np.ctypeslib.as_array(ptr, shape=(n,)).astype(np.float32)
    llama_cpp.llama_batch_free(batch)
    return out


def _rerank_prompt(llm, pair) -> list:
    """Return the token ids of llama-server's rerank prompt for {query, document}."""
    template = llama_cpp.llama_model_chat_template(llm.model, b'rerank')
    if not template:
        raise SystemExit('the GGUF has no tokenizer.chat_template.rerank')
    prompt = template.decode('utf-8').replace('{query}', pair['query'])
    prompt = prompt.replace('{document}', pair['document'])
    return llm.tokenize(prompt.encode('utf-8'), add_bos=False, special=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('model')
    p.add_argument('out')
    p.add_argument('texts', help='a JSON list of strings, or of token id lists (fed as they are)')
    p.add_argument('--pooling', default='gguf', choices=sorted(POOLING))
    p.add_argument('--ctx', type=int, default=512)
    p.add_argument('--threads', type=int, default=1)
    p.add_argument('--ubatch', type=int, default=0,
                   help="tokens per ubatch (default: --ctx); llama-server's default is 512")
    p.add_argument('--time', metavar='QUERY', default='',
                   help='instead: time embedding all texts in one batched call, and QUERY '
                        'alone (median of 5); print JSON seconds')
    args = p.parse_args(argv)
    with open(args.texts, encoding='utf-8') as f:
        texts = json.load(f)
    llm = llama_cpp.Llama(args.model, embedding=True, pooling_type=POOLING[args.pooling],
                          n_ctx=args.ctx, n_batch=args.ubatch or args.ctx,
                          n_ubatch=args.ubatch or args.ctx,
                          n_threads=args.threads, n_threads_batch=args.threads,
                          flash_attn=False, n_gpu_layers=0, verbose=False)
    if args.time:
        import json as _json
        import time
        llm.embed(texts[:4], normalize=True)   # warm-up
        t0 = time.perf_counter()
        llm.embed(texts, normalize=True)
        batch_s = time.perf_counter() - t0
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            llm.embed(args.time, normalize=True)
            runs.append(time.perf_counter() - t0)
        print(_json.dumps({'batch_s': batch_s, 'query_s': sorted(runs)[2]}))
        return 0
    vectors, tokens, lengths = [], [], []
    for text in texts:
        if isinstance(text, dict):
            text = _rerank_prompt(llm, text)
        if isinstance(text, list):
            ids, out = text, _embed_ids(llm, text, args.pooling == 'rank')
        else:
            ids = llm.tokenize(text.encode('utf-8'), add_bos=True, special=False)
            out = np.asarray(llm.embed(text, normalize=False, truncate=False), np.float32)
        vectors.append(out.reshape(-1, out.shape[-1]) if out.ndim > 1 else out[None])
        tokens += ids
        lengths.append(len(ids))
    np.savez(args.out, vectors=np.concatenate(vectors), tokens=np.array(tokens, np.int64),
             lengths=np.array(lengths, np.int64))
    return 0


if __name__ == '__main__':
    sys.exit(main())
