"""The values the runtime's settings take, as plain tuples: this module imports nothing.

The runtime owns them (native_ops pins the kernels, speculative.py runs the modes). Bringup's
parameter table and the command lines offer them from here, so naming a choice loads none of
the runtime (no ctypes library, no onnxruntime).
"""

# CPU kernels of the native op library's GGUF-block ops; 'auto' = the best this CPU has
# (native_ops.pin_kernel).
KERNEL_CHOICES = ('auto', 'scalar', 'avx2', 'avx512_vnni', 'amx', 'neon', 'neon_dotprod',
                  'neon_i8mm')
# Speculative decoding modes (speculative_config.SpeculativeConfig.mode, docs/speculative.md).
SPECULATIVE_MODES = ('off', 'prompt_lookup', 'draft', 'auto')
# How a grounding family's JSON boxes are written (config/models `grounding`,
# vision/grounding.py): pixels of the model's input, or a 0..1000 grid.
GROUNDING_FRAMES = ('absolute', 'normalized_1000')
