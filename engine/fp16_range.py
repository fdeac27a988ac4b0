"""bf16 operands of fp16 MMAs: a power of two that brings values into fp16's range, in Triton.

fp16 MMAs take FP8 (e4m3) operands widened in one instruction a pair, where bf16 needs a second conversion; their
other operand, bf16, enters fp16 times a power of two from its largest magnitude.  Used by the MSA decode scan over
an fp8 k-index (``msa.decode_index_kernels``: one a query column).
"""

import triton
import triton.language as tl


@triton.jit
def fp16_shift(largest):
    """Powers of two ``(down, up)`` (float32, ``largest``'s shape) that bring the magnitude ``largest`` into
    [2 ** 14, 2 ** 15): values times ``down`` fit fp16, every bf16 value within 2 ** -30 of ``largest`` exactly,
    and results times ``up`` come back.  Zero stays zero; the exponents are clamped to +-112."""
    shift = ((largest.to(tl.int32, bitcast=True) >> 23) & 0xFF) - (127 + 14)
    shift = tl.minimum(tl.maximum(shift, -112), 112)
    return ((127 - shift) << 23).to(tl.float32, bitcast=True), ((127 + shift) << 23).to(tl.float32, bitcast=True)
