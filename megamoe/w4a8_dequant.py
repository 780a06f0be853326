"""W4A8 in the MegaMoE kernel (issue 30): E2M1 weights with UE8M0 scales per 32 along K, turned into e4m3 in shared
memory right before the FP8 WGMMA (Hopper has no FP4 MMA), so the W8A8 mainloop and its promotion run unchanged.

The recipe is ``megamoe.reference.w4a8_fp8_weights``: per 128 x 128 weight block the fp32 block scale is
2^e_max (the block's largest UE8M0 exponent: W8A8's block-scale slot), and each 32-run's values are E2M1 codes
times 2^-d, d = e_max - e32 >= 0, rounded to e4m3. ``MegaMoE.load_weights`` stores d per run, clamped to
SHIFT_MAX (from d = 13 on every E2M1 value rounds to zero in e4m3), block-major so one TMA box of 512 bytes
carries a stage's 128 rows x 4 runs.

In the kernel, per pipeline stage, the producer's TMA brings the packed codes (128 rows x 64 bytes) and the
shifts; each MMA thread converts two (row, 32-code run) items of its warpgroup's 64 rows (a warp takes 8 whole
rows a step, so its code loads are 2-way bank conflicted, not 8-way as with one row's K half a thread): 8 codes (one 32-bit word) become 8 e4m3 bytes with two byte permutes (``prmt``) through the run's
8-entry table (E2M1 magnitude -> e4m3 byte at shift d, a 112-byte table in shared memory) and two for the
signs, then 128-bit stores into the stage's e4m3 B buffer in WGMMA's 128-byte swizzle. The two warpgroups
each need all 128 rows, so a named barrier (after the async-proxy fence) closes each stage's conversion. quack's
SM90 W4A8 GEMM (``quack.gemm_w4``) decodes in registers for a register-sourced WGMMA through the same kind of
folded e4m3 table; here B stays in shared memory for the SS WGMMA both warpgroups share.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.experimental import primitives as prims

# the recipe's constants from its one source: the shift clamp (d >= 13: 6 * 2^-13 is below half of e4m3's least
# subnormal 2^-9, so every value is 0) and the E2M1 magnitudes of codes 0-7 (bit 3 is the sign)
from megamoe.reference import E2M1_VALUES as E2M1_MAGNITUDES
from megamoe.reference import W4A8_SHIFT_MAX as SHIFT_MAX

ROWS, K = 128, 128  # one stage's B block
PACKED_ROW_BYTES = K // 2
RUN = 32  # elements per UE8M0 scale
SHIFT_STAGE_BYTES = ROWS * K // RUN  # 512: one byte per run


def _e4m3_values() -> list[tuple[float, int]]:
    """Every finite non-negative e4m3 (E4M3FN) value with its code, ascending."""
    vals = [(m * 2.0 ** -9, m) for m in range(8)]  # subnormals (and zero)
    for e in range(1, 16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            vals.append(((1 + m / 8) * 2.0 ** (e - 7), e << 3 | m))
    return vals


def e4m3_code(x: float) -> int:
    """The e4m3 code of x >= 0 rounded to nearest, ties to the even code (cvt.rn's and torch's rounding)."""
    best = None
    for v, c in _e4m3_values():
        d = abs(v - x)
        if best is None or d < best[0] or (d == best[0] and c % 2 == 0):
            best = (d, c)
    return best[1]


def shift_table() -> tuple[int, ...]:
    """(SHIFT_MAX + 1) x 2 little-endian words: word 2d + i holds the e4m3 bytes of E2M1 magnitudes 4i..4i+3
    times 2^-d (byte j of the pair = code j: the layout ``prmt`` indexes)."""
    words = []
    for d in range(SHIFT_MAX + 1):
        codes = [e4m3_code(v * 2.0 ** -d) for v in E2M1_MAGNITUDES]
        for i in range(2):
            words.append(sum(codes[4 * i + j] << (8 * j) for j in range(4)))
    return tuple(words)


SHIFT_TABLE = shift_table()
SIGN_BYTES = 0x00008000  # prmt table: selector nibble 0 -> 0x00, 1 -> 0x80 (the e4m3 sign bit)


def _permute(lo, hi, selector):
    """prmt.b32: byte j of the result is byte (nibble j of ``selector``) of {hi, lo} (no side effects, so ptxas
    may schedule it freely; the selectors here never set a nibble's sign-replicate bit)."""
    return prims.prmt(lo, selector, prims.PermuteMode.DEFAULT, hi=hi)


class W4DequantMixin:
    """``write_shift_table`` (once per launch) and ``dequant_stage`` (once per pipeline stage, both MMA
    warpgroups); the host class provides ``DequantBarrier`` and ``ab_stages``."""

    @staticmethod
    @cute.jit
    def write_shift_table(lut: cute.Tensor, tidx):
        """The shift table into shared memory (thread 0; the launch's first CTA barrier publishes it)."""
        if tidx == 0:
            for i in cutlass.range_constexpr(len(SHIFT_TABLE)):
                lut[i] = Int32(SHIFT_TABLE[i] - (1 << 32) if SHIFT_TABLE[i] >= 1 << 31 else SHIFT_TABLE[i])

    @cute.jit
    def dequant_stage(self, dq, stage, barrier_id: cutlass.Constexpr, num_threads: cutlass.Constexpr):
        """Stage ``stage``'s packed B block (``dq``: packed words, shift bytes, table, e4m3 B words, thread
        0..255 of the MMA warpgroups) into e4m3, this thread's two (row, run) items; then the fence that hands the
        generic-proxy stores to WGMMA, and the barrier both warpgroups pass before reading the block."""
        packed, shifts, lut, sB, t = dq
        # (row, run) items, 2 a thread: a warp's 32 lanes take 8 whole rows (4 runs each), so its 8-byte code
        # loads cover 512 contiguous bytes in two (2-way; the row-and-half mapping had 8-way conflicts) and a
        # quarter-warp's stores land on 8 distinct chunks of the swizzle
        wg, lt = t // 128, t % 128
        lane = lt % 32
        run = lane % 4
        atom64 = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=64)
        src = cute.make_rmem_tensor(cute.make_layout(2), Int32)
        out = cute.make_rmem_tensor(cute.make_layout(2), Int32)
        tab = cute.make_rmem_tensor(cute.make_layout(2), Int32)
        for j in cutlass.range_constexpr(2):
            r = wg * 64 + (lt // 32) * 16 + j * 8 + lane // 4
            pair = Int32(shifts[stage * (SHIFT_STAGE_BYTES // 2) + r * 2 + run // 2])
            d = (pair >> (8 * (run % 2))) & 0xFF
            cute.copy(atom64, cute.make_tensor(lut.iterator + cute.assume(2 * d, divby=2), cute.make_layout(2)), tab)
            t_lo, t_hi = tab[0], tab[1]
            for c in cutlass.range_constexpr(2):  # 16 codes -> 16 e4m3 bytes: one swizzle chunk
                word0 = stage * (ROWS * PACKED_ROW_BYTES // 4) + r * (PACKED_ROW_BYTES // 4) + 4 * run + 2 * c
                cute.copy(atom64, cute.make_tensor(packed + cute.assume(word0, divby=2), cute.make_layout(2)), src)
                chunk = 2 * run + c  # of the row's 8 chunks of 16 bytes; 128-byte swizzle: chunk ^ (row % 8)
                dst = stage * (ROWS * K // 4) + r * (K // 4) + ((chunk ^ (r % 8)) * 4)
                for i in cutlass.range_constexpr(2):  # 8 codes -> 8 bytes (ptxas pairs the stores)
                    w = src[i]
                    out[0] = _permute(t_lo, t_hi, w & 0x7777) | _permute(SIGN_BYTES, 0, (w >> 3) & 0x1111)
                    out[1] = (_permute(t_lo, t_hi, (w >> 16) & 0x7777)
                              | _permute(SIGN_BYTES, 0, (w >> 19) & 0x1111))
                    cute.copy(atom64, out, cute.make_tensor(sB + cute.assume(dst + 2 * i, divby=2), cute.make_layout(2)))
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
