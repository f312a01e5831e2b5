"""A converted VLM's vision encoder (vision.onnx): an RGB image -> its embedding rows.

The llm_node runs it on the frames goals bring, and the perception node on its camera stream
(publishing each frame's rows in their wire form, media.DeclaredEncoded, which goals can
bring instead of the frame): both through this class. The image is preprocessed as
llama.cpp's libmtmd does it (runtime/mmproj_preprocess.py: the family's resize, tiles and
normalization), every tile goes through the graph in one batch, and the rows come out in
prompt order (tiles row by row, then the overview). The last few images' rows are kept by
content digest, so the same frame asked about again is not encoded again.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
import os
import pathlib
import time
from typing import Mapping, Optional, Sequence, Tuple

import numpy as np
import onnxruntime as ort

from edge_llm_ros.errors import ModelLoadError
from edge_llm_ros.model_format import (VISION_INPUT as PIXELS, VISION_POS_INPUTS,
                                       VISION_ROPE_INPUTS, VISION_WINDOW_INPUTS)
from edge_llm_ros.runtime.decoder import check_providers
from edge_llm_ros.runtime.media import (clip_digest, clip_pairs, declared_encoding,
                                        encoded_form, encoded_rows, image_digest,
                                        ImageInputError, VideoClip)
from edge_llm_ros.runtime.mmproj_preprocess import grid_for, preprocess

CACHED_IMAGES = 8


@dataclass(frozen=True)
class Encoded:
    """One image's embedding rows [rows, n_out], its digest and what it cost."""

    rows: np.ndarray
    digest: str
    preprocess_s: float = 0.0
    encode_s: float = 0.0
    cached: bool = False


class ImageEncoder:
    """vision.onnx of a model folder, with its model.yaml `vision` section."""

    def __init__(self, model_dir: os.PathLike, vision: Mapping,
                 providers: Sequence[str] = ('CPUExecutionProvider',),
                 provider_options: Sequence[dict] = (), threads: int = 0) -> None:
        path = pathlib.Path(model_dir) / str(vision.get('file', 'vision.onnx'))
        if not path.is_file():
            raise ModelLoadError(f'{path} is missing, but model.yaml has a vision section: '
                                 'reconvert the model with --mmproj')
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(threads)
        # A provider this onnxruntime lacks is a load error, as for the decoder: the encoder
        # must not quietly run on the CPU where the board profile asked for the GPU.
        check_providers(providers, provider_options)
        opts = [dict(o) for o in provider_options] if provider_options else None
        try:
            self._session = ort.InferenceSession(str(path), options, providers=list(providers),
                                                 provider_options=opts)
        except Exception as exc:  # noqa: B902 - onnxruntime raises its own types
            raise ModelLoadError(f'cannot load {path}: {exc}') from exc
        inputs = [(i.name, i.type) for i in self._session.get_inputs()]
        # Qwen-VL (any image size) also takes its RoPE tables and window layout (Qwen2.5-VL)
        # or its learned positions' interpolation (Qwen3-VL).
        # Gemma 4 (positions 'rope_2d') takes its RoPE tables alone.
        self._mrope = vision.get('positions') == 'mrope'
        self._rope_2d = vision.get('positions') == 'rope_2d'
        extra = [(n, 'tensor(float)') for n in VISION_ROPE_INPUTS] + (
            [] if self._rope_2d else
            [(VISION_POS_INPUTS[0], 'tensor(int64)'), (VISION_POS_INPUTS[1], 'tensor(float)')]
            if vision.get('position_grid') else
            [(n, f'tensor({t})') for n, t in zip(VISION_WINDOW_INPUTS,
                                                 ('int64', 'float', 'int64'))])
        dynamic = self._mrope or self._rope_2d
        if inputs != [(PIXELS, 'tensor(uint8)')] + (extra if dynamic else []):
            raise ModelLoadError(f'{path} takes {inputs}, not uint8 tiles {PIXELS!r} (a vision '
                                 'graph from before the normalization moved into it, or a '
                                 "Qwen2.5-VL one from before the windows' layout replaced "
                                 'the [N, N] window mask): reconvert the model with --mmproj')
        # A Qwen-VL graph of any frame count takes a video chunk's 2 frames (one temporal
        # patch); one converted before video support takes exactly 1.
        self.takes_clips = self._mrope and self._session.get_inputs()[0].shape[0] != 1
        self.vision = dict(vision)
        self.providers = tuple(self._session.get_providers())
        self.n_out = int(vision['embedding_size'])
        self._cache: 'collections.OrderedDict[str, np.ndarray]' = collections.OrderedDict()

    def encode(self, image, digest: Optional[str] = None) -> Encoded:
        """Return the image's rows ([H, W, 3] uint8 RGB; Pillow's resampler unpacks it once).

        A tuple of 2 frames of one size is a video chunk (Qwen-VL): both resized as images,
        through the patch embedding's two temporal kernels (mtmd's merged pair).
        """
        frames = image if isinstance(image, tuple) else (image,)
        if len(frames) == 1:
            digest = digest or image_digest(frames[0])
        else:
            digest = digest or clip_digest([image_digest(f) for f in frames])
        hit = self._cache.get(digest)
        if hit is not None:
            self._cache.move_to_end(digest)
            return Encoded(hit, digest, cached=True)
        t0 = time.perf_counter()
        each = [preprocess(f, self.vision) for f in frames]
        tiles = each[0]
        pixels = np.stack([t for e in each for t in e.tiles])  # uint8: the graph normalizes
        t1 = time.perf_counter()
        feeds = {PIXELS: pixels}
        if self._mrope:
            from edge_llm_ros.runtime.mmproj_qwen import encoder_inputs
            feeds.update(encoder_inputs(tiles.tiles[0], self.vision))
        elif self._rope_2d:
            from edge_llm_ros.runtime.mmproj_gemma4 import encoder_inputs as gemma4_inputs
            feeds.update(gemma4_inputs(tiles.tiles[0], self.vision))
        (out,) = self._session.run(None, feeds)
        rows = np.ascontiguousarray(out.reshape(-1, out.shape[-1]))
        t2 = time.perf_counter()
        self._cache[digest] = rows
        while len(self._cache) > CACHED_IMAGES:
            self._cache.popitem(last=False)
        return Encoded(rows, digest, t1 - t0, t2 - t1)

    def rows_of(self, image: np.ndarray, name: str = 'image',
                known: Optional[Mapping[str, np.ndarray]] = None) -> Encoded:
        """Encode an RGB image, or take the rows of one already encoded.

        An already encoded image is the perception node's wire form (media.DeclaredEncoded,
        written by encode_into): its rows are used as they are, the encoder does not run.
        known: rows by content digest that need no encoding (a session's stored images).
        """
        digest = image_digest(image)
        if known and digest in known:
            return Encoded(known[digest], digest, cached=True)
        if isinstance(image, VideoClip):
            return self.encode_clip(image, name, digest)
        if declared_encoding(image, name) is None:
            return self.encode(image, digest)
        if not np.isfinite(image).all():
            raise ImageInputError(f'{name} is an encoded image with NaN or infinite values')
        return Encoded(encoded_rows(image), digest, cached=True)

    def encode_clip(self, clip: VideoClip, name: str = 'clip',
                    digest: Optional[str] = None) -> Encoded:
        """Return a clip's rows: its frames two by two (an odd last alone), chunk after chunk."""
        if not self.takes_clips:
            raise ImageInputError(f'{name} is a video clip, but this vision.onnx takes one '
                                  'frame (converted before video support): reconvert the '
                                  'model with --mmproj')
        parts = [self.encode(tuple(pair)) for pair in clip_pairs(clip.frames)]
        return Encoded(np.concatenate([p.rows for p in parts]), digest or image_digest(clip),
                       sum(p.preprocess_s for p in parts), sum(p.encode_s for p in parts),
                       all(p.cached for p in parts))

    def encoded_shape(self, height: int, width: int) -> Tuple[int, int, int, int]:
        """Return the wire form's shape for a height x width image (media.DeclaredEncoded)."""
        if self._mrope or self._rope_2d:
            raise ImageInputError(f'a {self.vision.get("projector")} model takes frames, not '
                                  'pre-encoded rows (its rows per image vary with the size): '
                                  'send the pixels')
        cols, rows, _ = grid_for(height, width, self.vision)
        return (rows + 1, max(cols, 1), int(self.vision['tokens_per_tile']), self.n_out)

    def encode_into(self, image: np.ndarray, out: np.ndarray) -> Encoded:
        """Encode an RGB image and write its rows, in the wire form, into `out` (a pool slot)."""
        encoded = self.encode(image)
        encoded_form(encoded.rows, grid_for(image.shape[0], image.shape[1], self.vision),
                     int(self.vision['tokens_per_tile']), out)
        return encoded

    def clear(self) -> None:
        """Forget the cached rows."""
        self._cache.clear()


def single_token(encode, decode) -> 'callable':
    """Return token_id(piece): the id when `piece` is exactly one token, else None."""
    def token_id(piece: str) -> Optional[int]:
        ids = encode(piece)
        return ids[0] if len(ids) == 1 and decode(ids) == piece else None
    return token_id


def open_vision(model_dir: os.PathLike, extra: Mapping, tokenizer, **session
                ) -> Tuple[Optional[ImageEncoder], Optional[object]]:
    """Return the folder's (ImageEncoder, PromptLayout), or (None, None) without `vision`."""
    vision = extra.get('vision')
    if not vision:
        return None, None
    from edge_llm_ros.runtime.mmproj_layout import PromptLayout
    layout = PromptLayout(vision, single_token(tokenizer.encode, tokenizer.decode),
                          tokenizer.encode)
    encoder = ImageEncoder(model_dir, vision, **session)
    if encoder._mrope and not encoder.takes_clips:
        layout.clip_refusal = ('this vision.onnx takes one frame (converted before video '
                               'support): reconvert the model with --mmproj to send clips')
    return encoder, layout
