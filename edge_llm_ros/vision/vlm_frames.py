"""The perception node's model when model.path is a converted VLM folder (with vision.onnx).

Each frame goes through the folder's own vision encoder (runtime/mmproj_encoder.ImageEncoder,
the code llm_node runs on the frames goals bring: libmtmd's preprocessing, every tile in one
batch) and its rows are written, in their wire form (runtime.media.DeclaredEncoded: float32
[grid_rows + 1, grid_cols, tile_rows, hidden]), straight into the perception node's pool slot.
A goal then carries that handle in `images` where its prompt says `<__media__>`, and llm_node
places the rows with the family's wrapper tokens without running the encoder again.
"""
from __future__ import annotations

import pathlib
from typing import Optional, Tuple

import numpy as np

from edge_llm_ros.runtime.media import as_rgb
from edge_llm_ros.vision.errors import ModelMismatchError, VisionModelLoadError
from edge_llm_ros.vision.runner import RunnerConfig, TensorSpec


def vlm_folder(path: str) -> Optional[pathlib.Path]:
    """Return `path` when it is a model folder whose model.yaml has a vision section."""
    folder = pathlib.Path(path) if path else None
    if folder is None or not folder.is_dir():
        return None
    import yaml
    try:
        meta = yaml.safe_load((folder / 'model.yaml').read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise VisionModelLoadError(f'model.path {path!r} is a folder, but its model.yaml '
                                   f'cannot be read ({exc}): give a converted VLM folder '
                                   '(edge-llm-convert ... --mmproj) or an ONNX file') from None
    if not meta.get('vision'):
        raise VisionModelLoadError(f'model.path {path!r} is a model folder without a vision '
                                   'encoder: convert the model with its mmproj (--mmproj)')
    return folder


class VlmFrameEncoder:
    """perception's model interface (as vision.runner.VisionModel) over a VLM's ImageEncoder."""

    def __init__(self, folder: pathlib.Path, config: Optional[RunnerConfig] = None) -> None:
        import yaml
        from edge_llm_ros.errors import ModelLoadError
        from edge_llm_ros.runtime.mmproj_encoder import ImageEncoder
        config = config or RunnerConfig()
        vision = yaml.safe_load((folder / 'model.yaml').read_text())['vision']
        options = [dict(config.provider_options.get(p, {})) for p in config.providers]
        try:
            self.encoder = ImageEncoder(folder, vision, providers=config.providers,
                                        provider_options=options,
                                        threads=config.intra_op_threads)
        except ModelLoadError as exc:
            raise VisionModelLoadError(str(exc)) from None
        n_out, tile_rows = self.encoder.n_out, int(vision['tokens_per_tile'])
        self.input = TensorSpec('frame (RGB or mono uint8)', np.dtype(np.uint8),
                                (None, None, 3))
        self.output = TensorSpec(f'{vision["projector"]} image rows', np.dtype(np.float32),
                                 (None, None, tile_rows, n_out))

    @property
    def providers(self) -> Tuple[str, ...]:
        return self.encoder.providers

    def input_shape(self, dtype, shape) -> Tuple[int, ...]:
        """Check that frames of dtype/shape are images (uint8 RGB or mono)."""
        shape = tuple(int(d) for d in shape)
        image = len(shape) == 2 or (len(shape) == 3 and shape[2] in (1, 3))
        if np.dtype(dtype) != np.uint8 or not image or min(shape[:2]) < 1:
            raise ModelMismatchError(
                f'{np.dtype(dtype).name} {list(shape)} frames are no images: the VLM encoder '
                'takes uint8 RGB [height, width, 3] or mono [height, width(, 1)] frames')
        return shape

    def output_layout(self, frame: np.ndarray) -> Tuple[np.dtype, Tuple[int, ...]]:
        """Return the wire form's dtype and shape for frames of this size."""
        self.input_shape(frame.dtype, frame.shape)
        return np.dtype(np.float32), self.encoder.encoded_shape(*frame.shape[:2])

    def run(self, frame: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Encode the mapped frame (read in place) and write its rows into `out`."""
        self.input_shape(frame.dtype, frame.shape)
        self.encoder.encode_into(as_rgb(frame), out)
        return out
