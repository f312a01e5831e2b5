"""Where an image's embeddings go in the prompt, with the family's wrapper tokens, as mtmd does.

llama.cpp's multimodal library replaces each media marker of the prompt by the image's chunks:
- gemma3: `<start_of_image>` [the image] `<end_of_image>`;
- idefics3: per tile, row by row, `<fake_token_around_image><row_R_col_C>` [tile], a newline
  token between rows; then the double-newline token,
  `<fake_token_around_image><global-img>` [overview] `<fake_token_around_image>`;
- internvl: `<img>` [tiles, then the overview] `</img>`;
- mlp (LLaVA-1.5): the image alone;
- qwen2.5vl_merger, qwen3vl_merger: `<|vision_start|>` [the image's columns x rows merged
  tokens, row by row] `<|vision_end|>`; the placement keeps the grid for the M-RoPE positions.
  A video clip (these two only: their n_temporal_merge is 2) is its frames two by two, each
  pair (an odd last frame alone) one such image of the frame's grid, one after the other;
- gemma4v: `<|image>` [the image's columns x rows pooled tokens, row by row] `<image|>`, at
  plain positions; the image attends both ways unless model.yaml says 'causal' (E2B / E4B).
The wrapper pieces are single tokens of the language model's vocabulary; a model that lacks
one is refused when it loads (llama.cpp would silently put token -1 there).
(test/test_vision_llm_parity.py compares the token ids and chunk sizes with mtmd's.)
"""
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from edge_llm_ros.errors import ModelLoadError
from edge_llm_ros.runtime.media import DeclaredEncoded, ImageInputError
from edge_llm_ros.runtime.mmproj_preprocess import grid_for

# One prompt item: token ids, or the number of embedding rows of one tile / image chunk.
Item = Union[Tuple[int, ...], int]
_PIECES: Dict[str, Tuple[str, ...]] = {
    'gemma3': ('<start_of_image>', '<end_of_image>'),
    'idefics3': ('<fake_token_around_image>', '<global-img>', '\n', '\n\n'),
    'internvl': ('<img>', '</img>'),
    'mlp': (),
    'qwen2.5vl_merger': ('<|vision_start|>', '<|vision_end|>'),
    'qwen3vl_merger': ('<|vision_start|>', '<|vision_end|>'),
    'gemma4v': ('<|image>', '<image|>'),
}
QWEN = ('qwen2.5vl_merger', 'qwen3vl_merger')
DYNAMIC = (*QWEN, 'gemma4v')  # one image of its own size: no tiles, no encoded form


@dataclass(frozen=True)
class ImagePlacement:
    """One image's items in prompt order, and its embedding rows in all."""

    items: Tuple[Item, ...]
    rows: int
    tiles: int
    bidirectional: bool = False   # each span is one forward that sees all of itself
    grid: Tuple[int, int] = (0, 0)  # Qwen-VL: the image's (columns, rows) of tokens (M-RoPE)
    # Qwen-VL: (width, height) in pixels of the image as the model saw it (its smart resize),
    # which its grounded answers' absolute coordinates refer to; (0, 0) for other families.
    input_size: Tuple[int, int] = (0, 0)


class PromptLayout:
    """The prompt items of an image of a given size, for one converted VLM (model.yaml)."""

    def __init__(self, vision: Mapping, token_id: Callable[[str], Optional[int]],
                 encode: Callable[[str], List[int]]) -> None:
        """Look the wrapper tokens up now; ModelLoadError names any the vocabulary lacks."""
        self._vision = dict(vision)
        self.projector = str(vision['projector'])
        if self.projector not in _PIECES:
            raise ModelLoadError(f'model.yaml vision.projector {self.projector!r} is not one '
                                 f'of {", ".join(sorted(_PIECES))}: reconvert the model')
        self.tokens_per_tile = int(vision['tokens_per_tile'])
        self._encode = encode
        ids = {}
        for piece in _PIECES[self.projector]:
            tid = token_id(piece)
            if tid is None:
                raise ModelLoadError(
                    f'the language model has no single token {piece!r}, which a '
                    f'{self.projector} image is wrapped in: pair the mmproj with its own '
                    'language model')
            ids[piece] = tid
        self._ids = ids
        # gemma3's image tokens see each other both ways (llama.cpp and HF): each image is
        # then prefilled as one forward that sees all of itself (the decoder's bidirectional
        # input). A decoder graph without that input refuses such images (refuse_images).
        self.bidirectional = vision.get('attention', 'causal') == 'bidirectional'
        self.refusal = ''
        self.clip_refusal = ''   # why this model's encoder takes no clips ('' : it does)

    def refuse_images(self, why: str) -> None:
        """Refuse every image from now on, saying why (the model still takes text)."""
        self.refusal = why

    def place(self, height: int, width: int) -> ImagePlacement:
        """Return the items of an image of height x width (pixels not needed)."""
        if self.refusal:
            raise ImageInputError(self.refusal)
        return self._place_grid(*grid_for(height, width, self._vision))

    def place_clip(self, height: int, width: int, frames: int, name: str) -> ImagePlacement:
        """Return the items of a clip of `frames` frames of height x width, as mtmd merges them.

        Each two frames are one chunk placed like an image (an odd last frame alone); only
        Qwen-VL's mergers take a clip (llama.cpp's clip_model_n_temporal_merge is 1 for others).
        """
        self.check_clips(name)
        one = self.place(height, width)
        chunks = (frames + 1) // 2
        return ImagePlacement(tuple(merge_items(one.items * chunks)), one.rows * chunks, chunks,
                              False, one.grid, one.input_size)

    def check_clips(self, name: str) -> None:
        """Raise ImageInputError naming `name` unless this model takes video clips."""
        if self.refusal:
            raise ImageInputError(self.refusal)
        if self.projector not in QWEN:
            raise ImageInputError(
                f'{name} is a video clip, but this model ({self.projector}) has no temporal '
                'merge (only Qwen2.5-VL and Qwen3-VL take video): send its frames as images')
        if self.clip_refusal:
            raise ImageInputError(f'{name}: {self.clip_refusal}')

    def place_encoded(self, encoded: DeclaredEncoded, name: str) -> ImagePlacement:
        """Return the items of an image already encoded (media.DeclaredEncoded).

        Its rows per tile and width must be this model's, and its grid one the family makes.
        """
        if self.refusal:
            raise ImageInputError(self.refusal)
        if self.projector in DYNAMIC:
            raise ImageInputError(f'{name} is an encoded image, which a {self.projector} '
                                  'model does not take (its rows vary with the size): send '
                                  'the pixels')
        _, _, tile_rows, hidden = encoded.shape
        cols, rows, tiles = encoded.grid
        width = int(self._vision['embedding_size'])
        if (tile_rows, hidden) != (self.tokens_per_tile, width):
            raise ImageInputError(
                f'{name} is an encoded image of {tile_rows} x {hidden} per tile, but this '
                f'model takes {self.tokens_per_tile} x {width}: encode it with the same '
                'model folder (the perception node with its vision.onnx)')
        tiled = self.projector in ('idefics3', 'internvl')
        if (tiles > 1 and not tiled) or (tiles == 1 and self.projector == 'idefics3'):
            raise ImageInputError(
                f'{name} is an encoded image of {tiles} tile(s), which a {self.projector} '
                'image never has: encode it with the same model folder (vision.onnx)')
        return self._place_grid(cols, rows, tiles)

    def _place_grid(self, cols: int, rows: int, tiles: int) -> ImagePlacement:
        t, ids = self.tokens_per_tile, self._ids
        items: List[Item] = []
        if self.projector in QWEN:
            t = cols * rows
            items = [(ids['<|vision_start|>'],), t, (ids['<|vision_end|>'],)]
            from edge_llm_ros.runtime.mmproj_qwen import MERGE
            side = int(self._vision['patch_size']) * MERGE
            return ImagePlacement(tuple(items), t, 1, False, (cols, rows),
                                  (cols * side, rows * side))
        if self.projector == 'gemma4v':
            t = cols * rows
            items = [(ids['<|image>'],), t, (ids['<image|>'],)]
            return ImagePlacement(tuple(items), t, 1, self.bidirectional)
        if self.projector == 'gemma3':
            items = [(ids['<start_of_image>'],), t, (ids['<end_of_image>'],)]
        elif self.projector == 'idefics3':
            fake = ids['<fake_token_around_image>']
            for r in range(rows):
                if r:
                    items.append((ids['\n'],))
                for c in range(cols):
                    items += [tuple(self._encode(
                        f'<fake_token_around_image><row_{r + 1}_col_{c + 1}>')), t]
            items += [(ids['\n\n'], fake, ids['<global-img>']), t, (fake,)]
        elif self.projector == 'internvl':
            items = [(ids['<img>'],), *([t] * tiles), (ids['</img>'],)]
        else:
            items = [t] * tiles
        return ImagePlacement(tuple(merge_items(items)), t * tiles, tiles, self.bidirectional)


def merge_items(items: Sequence[Item]) -> List[Item]:
    """Join neighbouring token runs (an image's rows stay one item per tile)."""
    out: List[Item] = []
    for item in items:
        if isinstance(item, tuple) and out and isinstance(out[-1], tuple):
            out[-1] = out[-1] + item
        else:
            out.append(item)
    return out
