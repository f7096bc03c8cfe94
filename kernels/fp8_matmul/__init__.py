"""FP8 (e4m3) grouped GEMMs with DeepSeek-V3's fine-grained scales, in Triton (:mod:`.triton`):
the GPU kernels of ``model.precision: fp8`` (``moefast.parallel.fp8_gemm`` quantizes, pads and
calls them; off GPU it computes the same numbers with float32 GEMMs), and a one-pass quantizer
(:func:`.triton.quantize`: 1 x 128 tiles, and 128 x 1 tiles written transposed, from one read;
:func:`.triton.quantize_weights`: 128 x 128 blocks).
"""

from .triton import (BLOCK, available, compile_for, quantize, quantize_torch, quantize_weights, quantize_weights_torch,
                     scaled_grouped_matmul, scaled_grouped_matmul_torch, scaled_weight_grads, scaled_weight_grads_torch,
                     tile_rows)

__all__ = ["BLOCK", "available", "compile_for", "quantize", "quantize_torch", "quantize_weights",
           "quantize_weights_torch", "scaled_grouped_matmul", "scaled_grouped_matmul_torch", "scaled_weight_grads",
           "scaled_weight_grads_torch", "tile_rows"]
