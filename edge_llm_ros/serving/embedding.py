"""The embedding / rerank engine: an encoder folder served like Engine serves a chat folder.

`EmbeddingEngine(EmbeddingConfig(model_dir=...))` opens a folder whose model.yaml says
`kind: embedding` or `kind: rerank` (convert/encoder.py) and answers `embed` and `rerank`;
every request is checked once, here, before the model runs (EmbeddingInputError /
WrongModelKindError say what to change). `generate` on it raises WrongModelKindError, as
Engine.embed / Engine.rerank do on a chat folder. A served folder takes its query and
document prefixes from its family in config/models (model_prefixes). Calls are serialized by
a lock: the model call itself is batched (runtime/encoder.py: length buckets, one call per
bucket).
"""
from dataclasses import dataclass
import logging
import threading
from typing import Optional, Sequence, Tuple

import numpy as np

from edge_llm_ros.errors import EmbeddingInputError, WrongModelKindError
from edge_llm_ros.runtime.encoder import EncoderConfig, is_encoder_folder, TextEncoder
from edge_llm_ros.runtime.model_config import family_for_model_dir, ModelConfigError

_LOG = logging.getLogger(__name__)

__all__ = ('EmbeddingConfig', 'EmbeddingEngine', 'EmbedResult', 'is_encoder_folder',
           'RerankResult', 'not_a_chat_model', 'not_an_embedding_model')


@dataclass(frozen=True)
class EmbeddingConfig:
    """How to load and serve an encoder folder."""

    model_dir: str
    threads: int = 0           # onnxruntime intra-op threads; 0 = its default
    max_batch: int = 256       # texts (or documents) per request
    batch_tokens: int = 4096   # padded tokens per model call
    # Prepended to texts sent with is_query (else document_prefix): e5's 'query: ' /
    # 'passage: ', nomic's 'search_query: ' / 'search_document: '.
    query_prefix: str = ''
    document_prefix: str = ''


@dataclass(frozen=True)
class EmbedResult:
    """Vectors [n, dimensions] float32 in request order, and each text's tokens."""

    vectors: np.ndarray
    token_counts: Tuple[int, ...]
    model_id: str

    @property
    def dimensions(self) -> int:
        return int(self.vectors.shape[1])


@dataclass(frozen=True)
class RerankResult:
    """One score per document (input order) and the indices best first (top_n of them)."""

    scores: np.ndarray
    order: Tuple[int, ...]


def not_an_embedding_model(name: str) -> WrongModelKindError:
    """Return the error of an embed / rerank request to a chat folder."""
    return WrongModelKindError(f'{name} is a chat model: embed and rerank need a folder '
                               'converted from an embedding or rerank GGUF (edge-llm-convert)')


def not_a_chat_model(name: str) -> WrongModelKindError:
    """Return the error of a generate request to an embedding / rerank folder."""
    return WrongModelKindError(f'{name} is an embedding/rerank model: it serves ~/embed and '
                               '~/rerank; generate with a chat model folder')


class EmbeddingEngine:
    """An opened encoder folder; thread-safe (one model call at a time)."""

    def __init__(self, config: EmbeddingConfig) -> None:
        self.config = config
        self.model_dir = config.model_dir
        self.encoder = TextEncoder(config.model_dir, EncoderConfig(
            config.threads, config.max_batch, config.batch_tokens))
        self.kind = self.encoder.kind
        self.model_name = self.encoder.model_id
        self.context_length = self.encoder.context
        self.dimensions = self.encoder.dimensions
        self.providers = ('CPUExecutionProvider',)
        self.vocab_size = self.encoder.tokenizer.get_vocab_size()
        self._lock = threading.Lock()

    def embed(self, texts: Sequence[str], is_query: bool = False, dimensions: int = 0,
              truncate: bool = False) -> EmbedResult:
        """Return the texts' vectors (checked first: see the module docstring)."""
        texts = self._texts(texts, 'texts')
        prefix = self.config.query_prefix if is_query else self.config.document_prefix
        with self._lock:
            out = self.encoder.embed([prefix + t for t in texts], int(dimensions), truncate)
        return EmbedResult(out.vectors, out.token_counts, self.model_name)

    def rerank(self, query: str, documents: Sequence[str], top_n: int = 0,
               truncate: bool = False) -> RerankResult:
        """Return each document's score and the order, best first (top_n > 0: that many)."""
        documents = self._texts(documents, 'documents')
        if top_n < 0:
            raise EmbeddingInputError(f'top_n must be >= 0 (0 = all), got {top_n}')
        with self._lock:
            scores = self.encoder.rerank(query, documents, truncate)
        order = tuple(int(i) for i in np.argsort(-scores, kind='stable'))
        return RerankResult(scores.astype(np.float32), order[:top_n] if top_n else order)

    def generate(self, *args, **kwargs):
        """Refuse: an encoder generates nothing."""
        raise not_a_chat_model(self.model_name)

    def prepare(self, *args, **kwargs):
        """Refuse a generation request at admission, as generate does."""
        raise not_a_chat_model(self.model_name)

    def model_info(self) -> dict:
        """Describe the model as Engine.model_info does (what ~/get_model_info reads)."""
        return {'model_name': self.model_name, 'gguf_name': self.encoder.meta.get('gguf_name'),
                'model_dir': self.model_dir, 'architecture': self.encoder.meta.get('architecture'),
                'quantization': ','.join(self.encoder.meta.get('quantization', {}).get(
                    'source_types', ())),
                'context_length': self.context_length, 'vocab_size': self.vocab_size,
                'providers': self.providers, 'kind': self.kind, 'dimensions': self.dimensions,
                'query_prefix': self.config.query_prefix,
                'document_prefix': self.config.document_prefix,
                'capabilities': {}}

    def kv_occupancy(self) -> Tuple[int, int]:
        """Return (0, 0): an encoder keeps no KV cache."""
        return 0, 0

    def close(self) -> None:
        """Nothing to free beyond the session (kept for Engine's interface)."""

    @staticmethod
    def _texts(texts: Sequence[str], what: str) -> Tuple[str, ...]:
        if isinstance(texts, str) or texts is None:
            raise EmbeddingInputError(f'{what} must be a list of strings, got '
                                      f'{type(texts).__name__}')
        return tuple(texts)


def model_prefixes(model_dir: str) -> Tuple[str, str]:
    """Return the (query, document) prefixes of the folder's family (config/models).

    A model no family config names takes none (all-MiniLM, bge-m3 and the rerankers need
    none); the choice is logged and shown in model_info.
    """
    try:
        family = family_for_model_dir(model_dir)
    except ModelConfigError:
        return '', ''
    return family.query_prefix, family.document_prefix


def open_embedding_engine(model_dir: str, threads: int = 0) -> Optional[EmbeddingEngine]:
    """Return an EmbeddingEngine when model_dir is an encoder folder, else None."""
    if not is_encoder_folder(model_dir):
        return None
    query, document = model_prefixes(model_dir)
    _LOG.info('%s: query prefix %r, document prefix %r (config/models)', model_dir, query,
              document)
    return EmbeddingEngine(EmbeddingConfig(model_dir, threads, query_prefix=query,
                                           document_prefix=document))
