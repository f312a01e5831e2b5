"""Run an embedding / rerank model folder (convert/encoder.py): texts in, vectors or scores out.

Texts are tokenized, sorted by length and cut into batches of neighbouring lengths, each
batch one model call whose rows are padded to its own longest row, not to the longest text
of the request: plan_batches picks the cut that pads the fewest tokens, a call costing
CALL_TOKENS padded tokens (one short text alone is one call of its own length, unpadded).
The states are pooled as the GGUF said (mean over the text's tokens, the first token (CLS),
the last token, or none), as llama.cpp pools them, then L2-normalized (a
graph with a `pooled` output pools itself: EmbeddingGemma's dense projections follow its mean);
`dimensions` below the model's keeps the first ones (Matryoshka) and normalizes again.
A rerank pair is the tokenizer's pair ([CLS] query [SEP] document [SEP]), or, where the model
has a rerank prompt (model.yaml `embedding.rerank_template`: Qwen3-Reranker), that prompt
with {query} and {document} replaced, special tokens parsed and none added, as llama-server's
format_prompt_rerank builds it; the score is the classifier's first output. With `truncate`,
a text over the context keeps its first tokens and its last; a pair keeps its query and
prompt whole and loses the end of its document.
"""
from dataclasses import dataclass
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np
import onnxruntime as ort
import yaml

from edge_llm_ros.errors import EmbeddingInputError, ModelLoadError, WrongModelKindError
from edge_llm_ros.model_format import MODEL_FILE, MODEL_YAML, TOKENIZER_FILE
from edge_llm_ros.runtime import native_ops

# A model call's fixed cost in padded tokens (its ops' overhead, one more pass over the
# weights), what plan_batches trades fewer calls against. bench_embed's 256 bge-small texts:
# 8 pads 1.0 % of the tokens in 40 calls, 32 2.6 % in 21, 64 3.7 % in 16 (buckets of 16
# tokens padded 9.9 % in 9; docs/benchmarks.md).
CALL_TOKENS = 32
KINDS = ('embedding', 'rerank')


@dataclass(frozen=True)
class EncoderConfig:
    """How the encoder runs: threads and the largest batch a call may carry."""

    threads: int = 0           # 0 = onnxruntime's default
    max_batch: int = 256       # texts per request
    batch_tokens: int = 4096   # padded tokens per model call


@dataclass(frozen=True)
class Embeddings:
    """Vectors [n, dimensions] float32 in the request's order, and each text's token count."""

    vectors: np.ndarray
    token_counts: Tuple[int, ...]


def is_encoder_folder(model_dir: str) -> bool:
    """Whether model_dir's model.yaml says it is an embedding or rerank model."""
    try:
        with open(os.path.join(model_dir, MODEL_YAML), encoding='utf-8') as f:
            raw = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(raw, dict) and raw.get('kind') in KINDS


class TextEncoder:
    """An opened embedding / rerank folder."""

    def __init__(self, model_dir: str, config: EncoderConfig = EncoderConfig()) -> None:
        from tokenizers import Tokenizer
        self.config = config
        with open(os.path.join(model_dir, MODEL_YAML), encoding='utf-8') as f:
            self.meta = yaml.safe_load(f)
        if self.meta.get('kind') not in KINDS:
            raise ModelLoadError(f'{model_dir} is not an embedding or rerank model (model.yaml '
                                 f'kind {self.meta.get("kind")!r}): convert an embedding GGUF')
        emb = self.meta['embedding']
        self.kind = self.meta['kind']
        self.pooling = str(emb['pooling'])
        self.normalize = bool(emb['normalize'])
        self.dimensions = int(emb['dimensions'])
        self.context = int(self.meta['max_position_embeddings'])
        self.model_id = str(self.meta.get('name', os.path.basename(model_dir)))
        self.pad_id = int(self.meta.get('pad_token_id') or 0)
        self.rerank_template = emb.get('rerank_template')
        self.tokenizer = Tokenizer.from_file(os.path.join(model_dir, TOKENIZER_FILE))
        opts = ort.SessionOptions()
        if config.threads:
            opts.intra_op_num_threads = config.threads
        if self.meta.get('op_domains'):
            native_ops.register(opts, f'model {model_dir}')
        self._session = ort.InferenceSession(os.path.join(model_dir, MODEL_FILE), opts,
                                             providers=['CPUExecutionProvider'])
        names = [o.name for o in self._session.get_outputs()]
        # A graph that pools itself (dense projections after the pooling: EmbeddingGemma)
        # gives its vectors as `pooled`; the others give per-token states, pooled here.
        self._pooled_at = names.index('pooled') if 'pooled' in names else None
        self._rank_at = names.index('rank_scores') if 'rank_scores' in names else None

    # --- requests --------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str], truncate: bool,
                 pairs: Optional[Sequence[str]] = None) -> List[List[int]]:
        """Token ids per text (pairs: [CLS] a [SEP] b [SEP]); too long is an error unless cut."""
        if not texts:
            raise EmbeddingInputError('no texts: send at least one non-empty text')
        if len(texts) > self.config.max_batch:
            raise EmbeddingInputError(f'{len(texts)} texts is over the limit of '
                                      f'{self.config.max_batch} per request: split the request')
        for i, t in enumerate(texts):
            if not isinstance(t, str) or not t.strip():
                raise EmbeddingInputError(f'text {i} is empty: send non-empty texts')
        if pairs is None:
            enc = self.tokenizer.encode_batch(list(texts))
        elif self.rerank_template:
            enc = self.tokenizer.encode_batch(
                [self._rerank_prompt(q, d) for q, d in zip(texts, pairs)],
                add_special_tokens=False)
        else:
            enc = self.tokenizer.encode_batch(list(zip(texts, pairs)))
        out = []
        for i, e in enumerate(enc):
            ids = list(e.ids)
            if len(ids) > self.context:
                if not truncate:
                    what = 'text' if pairs is None else 'rerank pair'
                    raise EmbeddingInputError(
                        f'{what} {i} is {len(ids)} tokens, over the context of {self.context}: '
                        'shorten it or set truncate')
                if pairs is None:
                    ids = ids[:self.context - 1] + ids[-1:]  # keep the closing [SEP] / EOS
                else:
                    ids = self._cut_pair(i, texts[i], pairs[i])
            out.append(ids)
        return out

    def _rerank_prompt(self, query: str, document: str) -> str:
        return self.rerank_template.replace('{query}', query).replace('{document}', document)

    def _cut_pair(self, i: int, query: str, document: str) -> List[int]:
        """Fit a rerank pair to the context by cutting the end of its document only.

        The query, the separators and the rerank prompt stay whole: cutting them would score
        something other than "this document for this query".
        """
        def pair_ids(text: str) -> List[int]:
            if self.rerank_template:
                return self.tokenizer.encode(self._rerank_prompt(query, text),
                                             add_special_tokens=False).ids
            return self.tokenizer.encode(query, text).ids

        # The document's text is cut where its kept tokens end (their character offsets), so
        # the kept part tokenizes as it did inside the whole document.
        ends = [end for _, end in self.tokenizer.encode(document,
                                                        add_special_tokens=False).offsets]
        keep, ids = len(ends), pair_ids(document)
        for _ in range(4):   # a cut may still tokenize a little longer at its seam: cut again
            keep -= len(ids) - self.context
            if keep < 1:
                raise EmbeddingInputError(
                    f'rerank pair {i}: the query (with the separators or rerank prompt) fills '
                    f'the context of {self.context} tokens: shorten the query')
            ids = pair_ids(document[:ends[keep - 1]])
            if len(ids) <= self.context:
                return ids
        raise EmbeddingInputError(f'rerank pair {i} does not fit the context of {self.context} '
                                  'tokens even with its document cut: shorten the document')

    def embed(self, texts: Sequence[str], dimensions: int = 0,
              truncate: bool = False) -> Embeddings:
        """Return the texts' vectors (pooled, normalized, truncated to `dimensions`)."""
        if self.kind != 'embedding':
            raise WrongModelKindError(f'{self.model_id} is a reranker: call rerank, or load an '
                                      'embedding model')
        if self.pooling == 'none':
            raise WrongModelKindError(f'{self.model_id} pools nothing (pooling none): its '
                                      'per-token states are not served as embeddings')
        if dimensions < 0 or dimensions > self.dimensions:
            raise EmbeddingInputError(f"dimensions {dimensions} is above the model's "
                                      f'{self.dimensions}: ask for at most {self.dimensions} '
                                      '(0 = all)')
        ids = self.tokenize(texts, truncate)
        vectors = self.pooled(ids)
        if dimensions and dimensions < vectors.shape[1]:
            vectors = vectors[:, :dimensions]
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return Embeddings(np.ascontiguousarray(vectors, np.float32),
                          tuple(len(i) for i in ids))

    def rerank(self, query: str, documents: Sequence[str], truncate: bool = False) -> np.ndarray:
        """Return one relevance score per document (the classifier's first label)."""
        if self.kind != 'rerank':
            raise WrongModelKindError(f'{self.model_id} is no reranker (kind {self.kind}): '
                                      'load a rerank model')
        if not documents:
            raise EmbeddingInputError('rerank needs at least one document')
        if not isinstance(query, str) or not query.strip():
            raise EmbeddingInputError('the rerank query is empty: send a query text')
        ids = self.tokenize([query] * len(documents), truncate, pairs=list(documents))
        return self._run(ids, rank=True)[:, 0].copy()

    # --- the model ---------------------------------------------------------------------
    def pooled(self, ids: List[List[int]]) -> np.ndarray:
        """Pooled (and normalized, where the model says) vectors per token list, in order."""
        out = self._run(ids, rank=False)
        if self.normalize:
            out = out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return out

    def _run(self, ids: List[List[int]], rank: bool) -> np.ndarray:
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        results: List[Optional[np.ndarray]] = [None] * len(ids)
        cuts = plan_batches([len(ids[i]) for i in order], self.config.batch_tokens)
        for start, end in cuts:
            batch = order[start:end]
            width = len(ids[batch[-1]])   # the longest: rows are sorted by length
            tok = np.full((len(batch), width), self.pad_id, np.int64)
            mask = np.zeros((len(batch), width), np.int64)
            for r, i in enumerate(batch):
                tok[r, :len(ids[i])] = ids[i]
                mask[r, :len(ids[i])] = 1
            outs = self._session.run(None, {'input_ids': tok, 'attention_mask': mask})
            for r, i in enumerate(batch):
                if rank:
                    results[i] = outs[self._rank_at][r]
                elif self._pooled_at is not None:
                    results[i] = outs[self._pooled_at][r]
                else:
                    results[i] = self._pool(outs[0][r, :len(ids[i])])
        return np.stack(results)

    def _pool(self, states: np.ndarray) -> np.ndarray:
        if self.pooling == 'mean':
            return states.mean(axis=0)
        if self.pooling == 'cls':
            return states[0]
        if self.pooling == 'last':
            return states[-1]
        return states  # 'none': every token's state


def plan_batches(lengths: Sequence[int], batch_tokens: int) -> List[Tuple[int, int]]:
    """Cut sorted lengths into batches [start, end) that pad the fewest tokens.

    A batch's rows are padded to its last (longest) length and it costs CALL_TOKENS more;
    a batch holds at most batch_tokens padded tokens unless it is one row. Exact over all
    cuts into neighbours (a shortest path over the n + 1 cut points).
    """
    n = len(lengths)
    best = [0] + [0] * n
    start = [0] * (n + 1)
    for end in range(1, n + 1):
        width = lengths[end - 1]
        best[end], start[end] = best[end - 1] + width + CALL_TOKENS, end - 1
        for first in range(end - 2, -1, -1):
            padded = width * (end - first)
            if padded > batch_tokens:
                break
            cost = best[first] + padded + CALL_TOKENS
            if cost < best[end]:
                best[end], start[end] = cost, first
    cuts: List[Tuple[int, int]] = []
    end = n
    while end:
        cuts.append((start[end], end))
        end = start[end]
    return cuts[::-1]
