"""A deterministic stand-in embedding for the memory tests: hashed character trigrams.

Texts that share words share trigrams, so their vectors are near (cosine): enough to test
recall order without a model. The real embeddings (llm_node's ~/embed) are tested with it.
"""
import hashlib
from typing import Sequence, Tuple

import numpy as np

DIMS = 64
MODEL_ID = f'test-hashed-trigrams-{DIMS}'


def hashed_vector(text: str, dims: int = DIMS) -> np.ndarray:
    padded = f'  {text.lower()}  '
    vec = np.zeros(dims, np.float32)
    for i in range(len(padded) - 2):
        digest = hashlib.blake2b(padded[i:i + 3].encode(), digest_size=4).digest()
        vec[int.from_bytes(digest, 'little') % dims] += 1.0
    return vec / max(float(np.linalg.norm(vec)), 1e-12)


def hashed_embed(texts: Sequence[str], is_query: bool, dims: int = DIMS,
                 model_id: str = MODEL_ID) -> Tuple[str, np.ndarray]:
    return model_id, np.stack([hashed_vector(t, dims) for t in texts])
