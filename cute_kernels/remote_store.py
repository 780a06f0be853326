"""128-bit store atoms. A destination may be local HBM or a peer GPU's buffer mapped through symmetric
memory: the store instruction is the same (``st.global.v4.b32``), only the address differs."""
from __future__ import annotations

import cutlass.cute as cute

STORE_BITS = 128
STORE_BYTES = STORE_BITS // 8


def vec128_atom(dtype):
    """Copy atom that moves 128 bits per thread per instruction (STG.E.128)."""
    return cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=STORE_BITS)


def elems_per_vec128(dtype) -> int:
    return STORE_BITS // dtype.width
