"""Run an ONNX image model on mapped frames without copying them (onnxruntime IOBinding).

The frame (a read-only view of a producer's shared buffer) is bound as the model input by
address: ``bind_input(name, 'cpu', 0, dtype, shape, ptr)``. The output can be bound the
same way to a writable view of the consumer's own pool slot, so the model writes the
embeddings where the LLM will read them. The caller keeps both arrays alive (and the
frame held) until run() returns.
"""
import dataclasses
import os
from typing import Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from edge_llm_ros.vision.errors import ModelMismatchError, VisionModelLoadError

_ORT_DTYPES = {
    'tensor(bool)': np.bool_, 'tensor(uint8)': np.uint8, 'tensor(int8)': np.int8,
    'tensor(uint16)': np.uint16, 'tensor(int16)': np.int16, 'tensor(int32)': np.int32,
    'tensor(int64)': np.int64, 'tensor(float16)': np.float16, 'tensor(float)': np.float32,
    'tensor(double)': np.float64,
}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A model input or output; None marks a symbolic (any size) dimension."""

    name: str
    dtype: np.dtype
    shape: Tuple[Optional[int], ...]

    def describe(self) -> str:
        """'name: dtype [d0, d1, ...]' with '?' for symbolic dimensions."""
        dims = ', '.join('?' if d is None else str(d) for d in self.shape)
        return f'{self.name!r}: {self.dtype.name} [{dims}]'


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    """onnxruntime settings of the perception model."""

    providers: Tuple[str, ...] = ('CPUExecutionProvider',)
    provider_options: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    intra_op_threads: int = 0          # 0: onnxruntime's default
    intra_op_affinity: str = ''        # 'session.intra_op_thread_affinities' ('' = none)
    input_name: str = ''               # '' = the model's only input
    output_name: str = ''              # '' = the model's first output


def _spec(arg) -> TensorSpec:
    dtype = _ORT_DTYPES.get(arg.type)
    if dtype is None:
        raise ModelMismatchError(f'model tensor {arg.name!r} has type {arg.type}, which cannot '
                                 'be bound to a frame or travel in a tensor handle')
    shape = tuple(d if isinstance(d, int) and d >= 0 else None for d in arg.shape)
    return TensorSpec(arg.name, np.dtype(dtype), shape)


def _pick(specs: Sequence[TensorSpec], name: str, what: str) -> TensorSpec:
    if not name:
        return specs[0]
    for spec in specs:
        if spec.name == name:
            return spec
    raise ModelMismatchError(f'model has no {what} named {name!r}; its {what}s: '
                             f'{", ".join(s.describe() for s in specs)}')


class VisionModel:
    """One onnxruntime session taking a frame and producing one output tensor."""

    def __init__(self, model: Union[str, bytes], config: Optional[RunnerConfig] = None) -> None:
        import onnxruntime as ort
        self.config = config or RunnerConfig()
        if isinstance(model, str) and not os.path.isfile(model):
            raise VisionModelLoadError(f'model.path {model!r} is not a file: give an ONNX '
                                       "image model, or '' for the built-in stand-in")
        options = ort.SessionOptions()
        if self.config.intra_op_threads:
            options.intra_op_num_threads = self.config.intra_op_threads
        if self.config.intra_op_affinity:
            options.add_session_config_entry('session.intra_op_thread_affinities',
                                             self.config.intra_op_affinity)
        providers = [(p, dict(self.config.provider_options.get(p, {})))
                     for p in self.config.providers]
        try:
            self._session = ort.InferenceSession(model, options, providers=providers)
        except Exception as exc:  # noqa: B902 - onnxruntime raises many unrelated types
            where = model if isinstance(model, str) else 'the model'
            raise VisionModelLoadError(f'onnxruntime cannot load {where}: {exc}') from exc
        inputs = [_spec(a) for a in self._session.get_inputs()]
        if len(inputs) != 1:
            raise ModelMismatchError(
                f'model has {len(inputs)} inputs ({", ".join(s.describe() for s in inputs)}); '
                'perception feeds exactly one (the frame): export a single-input model')
        self.input = _pick(inputs, self.config.input_name, 'input')
        self.output = _pick([_spec(a) for a in self._session.get_outputs()],
                            self.config.output_name, 'output')

    @property
    def providers(self) -> Tuple[str, ...]:
        """Return the execution providers the session actually uses."""
        return tuple(self._session.get_providers())

    def input_shape(self, dtype: Union[str, np.dtype], shape: Sequence[int]) -> Tuple[int, ...]:
        """Return the shape to bind for frames of dtype/shape; ModelMismatchError if unfit.

        A model input with one more leading dimension of size 1 (or symbolic) takes the
        frame as a batch of one without a copy.
        """
        dtype, shape = np.dtype(dtype), tuple(int(d) for d in shape)
        bound = shape
        if len(self.input.shape) == len(shape) + 1 and self.input.shape[0] in (1, None):
            bound = (1,) + shape
        fits = dtype == self.input.dtype and len(bound) == len(self.input.shape) and all(
            want is None or want == have for want, have in zip(self.input.shape, bound))
        if not fits:
            raise ModelMismatchError(
                f'model input {self.input.describe()} does not accept frames of '
                f'{dtype.name} {list(shape)}: the input is bound to the shared frame without '
                'a copy, so dtype and fixed dimensions must match exactly (export the model '
                'with a uint8 [height, width, 3] input and do resize/normalize inside it, or '
                'set frame_source width/height to the fixed size)')
        return bound

    def run(self, frame: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Run on frame (bound by address); write into out when given, else return a copy."""
        shape = self.input_shape(frame.dtype, frame.shape)
        if not frame.flags.c_contiguous:
            raise ModelMismatchError('frame is not C-contiguous: IOBinding needs densely '
                                     'packed frames (publish them without strides)')
        binding = self._session.io_binding()
        binding.bind_input(self.input.name, 'cpu', 0, self.input.dtype.type, list(shape),
                           frame.__array_interface__['data'][0])
        if out is not None:
            if not out.flags.c_contiguous or not out.flags.writeable:
                raise ValueError('out must be a writable C-contiguous array')
            binding.bind_output(self.output.name, 'cpu', 0, out.dtype.type, list(out.shape),
                                out.__array_interface__['data'][0])
        else:
            binding.bind_output(self.output.name, 'cpu')
        self._session.run_with_iobinding(binding)
        if out is not None:
            return out
        return binding.copy_outputs_to_cpu()[0]

    def output_layout(self, frame: np.ndarray) -> Tuple[np.dtype, Tuple[int, ...]]:
        """Return the output dtype and shape for frames like this one (static, or one probe)."""
        if all(d is not None for d in self.output.shape):
            return self.output.dtype, tuple(int(d) for d in self.output.shape)
        result = self.run(frame)
        return result.dtype, tuple(result.shape)
