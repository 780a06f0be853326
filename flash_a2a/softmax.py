"""Online softmax of one MMA warpgroup's rows (FlashAttention's running max and sum), in registers.

Shared by the attention kernel's Q-loop and its split-tail combine; plain CuTe DSL, no kernel state."""
from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from quack import layout_utils
from quack.cute_dsl_utils import ParamsBase

LN2 = math.log(2.0)


@cute.jit
def row_max_ilp(s_mn: cute.Tensor, r: cutlass.Constexpr[int]) -> Float32:
    """Max of row ``r`` with four independent fmax chains (a single chain is latency-bound)."""
    n = cute.size(s_mn, mode=[1])
    m0, m1, m2, m3 = s_mn[r, 0], s_mn[r, 1], s_mn[r, 2], s_mn[r, 3]
    for c in cutlass.range_constexpr(4, n, 4):
        m0 = cute.arch.fmax(m0, s_mn[r, c])
        m1 = cute.arch.fmax(m1, s_mn[r, c + 1])
        m2 = cute.arch.fmax(m2, s_mn[r, c + 2])
        m3 = cute.arch.fmax(m3, s_mn[r, c + 3])
    return cute.arch.fmax(cute.arch.fmax(m0, m1), cute.arch.fmax(m2, m3))


@cute.jit
def scale_rows(o_mn: cute.Tensor, row_scale: cute.Tensor):
    """Row r of O (an (M, N) view of the accumulator) times row_scale[r]."""
    for r in cutlass.range_constexpr(cute.size(row_scale)):
        o_mn[r, None].store(o_mn[r, None].load() * row_scale[r])


@dataclass
class OnlineSoftmax(ParamsBase):
    """Row max / row sum of one MMA warpgroup's rows, each row spread over a quad of threads. A ParamsBase
    dataclass so it can be carried through the DSL's run-time loops."""

    scale_log2: Float32
    row_max: cute.Tensor
    row_sum: cute.Tensor

    @staticmethod
    def create(scale_log2, num_rows: int) -> "OnlineSoftmax":
        return OnlineSoftmax(scale_log2, cute.make_rmem_tensor(num_rows, Float32),
                             cute.make_rmem_tensor(num_rows, Float32))

    @cute.jit
    def update(self, acc_s: cute.Tensor, is_first: cutlass.Constexpr[bool],
               threshold: cutlass.Constexpr[float] = 0.0) -> cute.Tensor:
        """Exponentiate S in place (P = exp2(S·scale − max·scale)); return each row's rescale factor.
        ``threshold`` > 0: keep the row's max unless the new one exceeds it by more than that (log2 units), so
        P stays below 2^threshold and most blocks rescale nothing (factor exactly 1)."""
        s_mn = layout_utils.reshape_acc_to_mn(acc_s)
        row_scale = cute.make_fragment_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            row = s_mn[r, None].load()
            cur = row_max_ilp(s_mn, r)
            if const_expr(not is_first):
                cur = cute.arch.fmax(cur, self.row_max[r])
            cur = cute.arch.warp_reduction_max(cur, threads_in_group=4)
            if const_expr(threshold > 0.0 and not is_first):
                if (cur - self.row_max[r]) * self.scale_log2 <= Float32(threshold):
                    cur = self.row_max[r]
            cur_scaled = cur * self.scale_log2
            p = cute.math.exp2(row * self.scale_log2 - cur_scaled, fastmath=True)
            if const_expr(is_first):
                row_scale[r] = Float32(1.0)
                self.row_sum[r] = p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            else:
                row_scale[r] = cute.math.exp2((self.row_max[r] - cur) * self.scale_log2, fastmath=True)
                self.row_sum[r] = p.reduce(cute.ReductionOp.ADD, self.row_sum[r] * row_scale[r], 0)
            self.row_max[r] = cur
            s_mn[r, None].store(p)
        return row_scale

    @cute.jit
    def finalize(self) -> cute.Tensor:
        """1 / row sum (quad-reduced), the factor that normalizes O."""
        inv = cute.make_fragment_like(self.row_sum, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            inv[r] = cute.arch.rcp_approx(total)
        return inv

    @cute.jit
    def finalize_with_lse(self) -> tuple[cute.Tensor, cute.Tensor]:
        """(1 / row sum, the row's natural log-sum-exp of the scaled logits: max·scale + ln(sum)), quad-reduced."""
        inv = cute.make_fragment_like(self.row_sum, Float32)
        lse = cute.make_fragment_like(self.row_sum, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            inv[r] = cute.arch.rcp_approx(total)
            lse[r] = (self.row_max[r] * self.scale_log2 + cute.math.log2(total, fastmath=True)) * Float32(LN2)
        return inv, lse

    @cute.jit
    def rescale(self, acc_o: cute.Tensor, row_scale: cute.Tensor, skip_unit: cutlass.Constexpr[bool] = False):
        """O *= each row's factor. ``skip_unit``: a warp none of whose rows changed its max (every factor
        exactly 1, the rescale threshold) skips the multiplies (a warp-uniform branch)."""
        o_mn = layout_utils.reshape_acc_to_mn(acc_o)
        if const_expr(skip_unit):
            changed = row_scale[0] != Float32(1.0)
            for r in cutlass.range_constexpr(1, cute.size(row_scale)):
                changed = changed | (row_scale[r] != Float32(1.0))
            if cute.arch.vote_any_sync(changed):
                scale_rows(o_mn, row_scale)
        else:
            scale_rows(o_mn, row_scale)
