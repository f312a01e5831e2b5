"""Weights kept in their GGUF blocks, byte for byte, for the edge_llm_ros.KQuantMatMul op.

The op library (native/) reads Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K blocks as
the file holds them and quantizes the activations per block as ggml does, so a matrix costs
its GGUF bytes and no more. Only whole rows move: llama's Q/K row permutation and the fusion
of Q/K/V or gate/up are row permutations and concatenations, exact by construction.
"""
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np

from edge_llm_ros.convert.checkpoint import SourceTensor

# GGUF type name -> ggml type id (the op's quant_type attribute) and weights per block.
KQUANT_TYPES = {'Q4_0': (2, 32), 'Q4_1': (3, 32), 'Q5_0': (6, 32), 'Q5_1': (7, 32),
                'Q8_0': (8, 32), 'Q4_K': (12, 256), 'Q5_K': (13, 256), 'Q6_K': (14, 256)}


@dataclass
class GgufWeights:
    """An [N, K] weight as its GGUF rows: raw uint8 [N, row bytes] of one block type."""

    raw: np.ndarray
    qtype: str
    k: int

    @property
    def shape(self) -> tuple:
        return (self.raw.shape[0], self.k)

    @property
    def type_id(self) -> int:
        return KQUANT_TYPES[self.qtype][0]

    @property
    def nbytes(self) -> int:
        """Bytes the op reads for a full pass over the weight (exactly the GGUF tensor's)."""
        return int(self.raw.nbytes)


def keeps_blocks(t: SourceTensor) -> bool:
    """Whether the op holds this matrix in its GGUF blocks (else the MatMulNBits path)."""
    # A row that is not whole blocks: llama-quantize never writes one; MatMulNBits decides.
    return (t.qtype in KQUANT_TYPES and len(t.shape) == 2
            and t.shape[1] % KQUANT_TYPES[t.qtype][1] == 0)


def gguf_weights(t: SourceTensor) -> Optional[GgufWeights]:
    """Return the tensor's blocks for the op, or None for a type the op does not hold."""
    if not keeps_blocks(t):
        return None
    raw = np.ascontiguousarray(t.values(), dtype=np.uint8)  # Q/K permutation undone
    return GgufWeights(raw.reshape(t.shape[0], -1), t.qtype, int(t.shape[1]))


def fuse_rows(parts: Sequence[GgufWeights]) -> List[GgufWeights]:
    """Stack weights along N (fused Q/K/V or gate/up) when they share one block type.

    Q4_K_M files mix types inside a layer (V or down in Q6_K): those stay separate matmuls.
    """
    if len({(p.qtype, p.k) for p in parts}) != 1:
        return list(parts)
    return [GgufWeights(np.concatenate([p.raw for p in parts]), parts[0].qtype, parts[0].k)]
