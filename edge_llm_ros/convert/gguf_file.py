"""Open a GGUF file with gguf's reader, refusing short reads (checkpoints and LoRA adapters).

gguf slices its memory map, which silently stops at the end of a truncated file: this reader
checks every read against the file's size, and the error names the byte where the file stops
making sense. The converter reads checkpoints with it (convert/checkpoint.py), and LoRA
adapters (convert/lora.py).
"""
import pathlib

import numpy as np

from edge_llm_ros.errors import ModelLoadError


class _ShortRead(ValueError):
    """The file ends before a header field or tensor it declares."""


def open_gguf(path: pathlib.Path):
    """Open a GGUF with gguf's reader; errors name the byte where the file stops making sense."""
    import gguf
    size = path.stat().st_size
    where = [0]

    class _Reader(gguf.GGUFReader):
        # Every read goes through _get: remember where it starts, and refuse short reads
        # (gguf slices its memory map, which silently stops at the end of the file).
        def _get(self, offset, dtype, count=1, override_order=None):
            where[0] = int(offset)
            need = int(count) * np.dtype(dtype).itemsize
            if int(offset) + need > size:
                raise _ShortRead(f'{need} bytes needed at byte {offset}, but the file ends at '
                                 f'byte {size}')
            return super()._get(offset, dtype, count, override_order)

        def _build_tensors(self, start_offs, fields):
            # Type fields are checked here, where the byte holding each one is known.
            for f in fields:
                where[0] = int(f.offset) + sum(int(p.nbytes) for p in f.parts[:4])
                gguf.GGMLQuantizationType(int(f.parts[4][0]))
            super()._build_tensors(start_offs, fields)

    try:
        return _Reader(str(path))
    except (ValueError, IndexError, KeyError, OSError, TypeError, OverflowError,
            UnicodeDecodeError) as exc:
        raise ModelLoadError(
            f'{path}: not a readable GGUF file: {exc} (reading at byte {where[0]} of {size}); '
            'the file is truncated or corrupt, download it again') from exc


def unpermute_llama_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's Q/K permutation: interleaved pairs back to NEOX halves (axis 0)."""
    n = rows.shape[0]
    return (rows.reshape(n_head, n // n_head // 2, 2, *rows.shape[1:])
            .swapaxes(1, 2).reshape(rows.shape))
