"""Encoded images (PNG, JPEG, ...) -> RGB uint8 arrays, checked before they are decoded.

The CLI's --image files and the OpenAI bridge's data: URLs come through here. The size is read
from the header first, so a 100-megapixel or zero-size image is refused before its pixels are
decoded; a corrupt or truncated file, or one Pillow cannot read, gets an ImageInputError
that names it.
"""
from __future__ import annotations

import io
import os
from typing import Optional, Union

import numpy as np

from edge_llm_ros.runtime.media import DeclaredImage, image_size, ImageInputError

FORMATS = ('PNG', 'JPEG', 'WEBP', 'BMP', 'GIF', 'TIFF')


def decode_image(data: Union[bytes, os.PathLike, str], what: str = 'the image',
                 formats: Optional[tuple] = FORMATS, into: Optional[np.ndarray] = None
                 ) -> np.ndarray:
    """Decode an encoded image (bytes or a file path) into RGB [H, W, 3] uint8.

    into: an [H, W, 3] uint8 buffer of exactly the image's size (a pool slot) to decode into
    instead of a new array.
    """
    from PIL import Image, UnidentifiedImageError
    source = io.BytesIO(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    try:
        with Image.open(source, formats=formats) as img:
            image_size(DeclaredImage(img.height, img.width), what)  # before decoding pixels
            img.load()
            rgb = img.convert('RGB') if img.mode != 'RGB' else img
            if into is not None:
                if into.shape != (rgb.height, rgb.width, 3) or into.dtype != np.uint8:
                    raise ImageInputError(f'{what} is {rgb.width}x{rgb.height}, but the '
                                          f'buffer is {into.dtype} {list(into.shape)}')
                into[...] = np.asarray(rgb)
                return into
            return np.asarray(rgb).copy()
    except ImageInputError:
        raise
    except FileNotFoundError:
        raise ImageInputError(f'{what}: no such file') from None
    except UnidentifiedImageError:
        raise ImageInputError(f'{what} is not an image in a supported format '
                              f'({", ".join(formats or ())})') from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ImageInputError(f'{what} cannot be decoded (corrupt or truncated?): '
                              f'{exc}') from None
