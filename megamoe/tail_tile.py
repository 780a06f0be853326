"""The MegaMoE kernel's tail tiles (``megamoe.kernel``): an expert's last 128-row tile whose tokens all sit in the
first warpgroup's 64 rows (DeepSeek-V4-Flash at 8192 tokens: 192 rows per expert, one full tile and one of 64;
random routing: most experts end in one).

A full tile splits its rows between the two MMA warpgroups (m64n128 WGMMAs each). In a tail tile the second
warpgroup's rows hold no token:
- **W8A8**: warpgroup 0 runs the whole tile's mainloop alone and warpgroup 1 releases the stages unread (``drain``):
  its WGMMAs and their promotion FFMAs gone, warpgroup 0's run on uncontended issue slots.
- **bf16**: the two warpgroups split the columns of the first one's 64 rows instead: warpgroup w runs the full
  tile's mainloop as m64n64 WGMMAs on A's rows [0, 64) and B's rows [64 w, 64 w + 64) (``TAIL_ATOMS``: two atoms
  along N), then hands its 64 columns to warpgroup 0 through its own staging rows (idle: it stages no token),
  and warpgroup 0 assembles the full tile's accumulator (``tail_assemble``) for the usual epilogue (SwiGLU
  pairs gate column c with up column c + 64: the two halves). A lone warpgroup's m64n128 WGMMAs do not fill the
  Tensor Cores: with warpgroup 1 idle, bf16 tail tiles took as long as full ones.
Either way a row's every output element goes through a full tile's arithmetic (the same K order; m64n64 and
m64n128 WGMMAs give the same bits per element, which the GPU tests' bit-equality of the two schedules checks: the
Dispatch's atomic slot order decides which tile a token's row lands in), and warpgroup 1 still commits its empty
staging so its store warp's walk stays in step.

Measured on one H200 against the tiles before (docs/FINDINGS.md, MegaMoE): ``megamoe_tail_skip_feb3fe4.json``
(both precisions with warpgroup 1 idle), ``megamoe_tail_nsplit_b45a91a.json`` (both column-split), and a split of
the K blocks between the warpgroups (``megamoe_tail_split_d156806.json``, dropped: it changed a row's summation
order with its tile, so outputs depended on the slot order).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from quack import layout_utils

from megamoe.epilogue import STAGE_ROW
from megamoe.phases import WG_THREADS, NamedBarrierMoE

BLOCK_M = 128
WG_ROWS = BLOCK_M // 2
TAIL_ATOMS = (1, 2, 1)  # the tail's tiled MMA: two m64n64 atoms side by side along N, one per warpgroup


@cute.jit
def drain(pipe, state, n_kb):
    """Release ``n_kb`` stages unread, each once it is full (released before, it would count toward the stage's
    previous use and let the producer overwrite it under the other warpgroup)."""
    for _ in cutlass.range(n_kb, unroll=1):
        pipe.consumer_wait(state)
        pipe.consumer_release(state)
        state.advance()
    return state


def first_m_block(frag: cute.Tensor) -> cute.Tensor:
    """A WGMMA operand fragment (V, MMA_M, K, stages) of descriptors restricted to its first M block: the tail
    MMA's 64-row tiling over the 128-row A stages, rows [0, 64)."""
    lay = frag.layout
    return cute.make_tensor(frag.iterator, cute.make_layout((1, 1, lay.shape[2], lay.shape[3]),
                                                            stride=(0, 0, lay.stride[2], lay.stride[3])))


@cute.jit
def tail_assemble(acc, acc_t, sC, wg, tidx):
    """Warpgroup 0's ``acc`` (the full tile's fragment) from its columns and warpgroup 1's, handed over through
    warpgroup 1's staging rows (element (r, c) of thread t's half at word (r * cols + c) * 128 + t:
    conflict-free). Both warpgroups call it; warpgroup 1 holds its staging (acquired, not yet committed)."""
    half_mn = layout_utils.reshape_acc_to_mn(acc_t)
    acc_mn = layout_utils.reshape_acc_to_mn(acc)
    rows, cols = cute.size(half_mn, mode=[0]), cute.size(half_mn, mode=[1])
    t = tidx % WG_THREADS
    buf = cute.make_tensor(cute.recast_ptr(sC.iterator + WG_ROWS * STAGE_ROW, dtype=Float32),
                           cute.make_layout((rows * cols, WG_THREADS), stride=(WG_THREADS, 1)))
    if wg == 1:
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cols):
                buf[r * cols + c, t] = half_mn[r, c]
    cute.arch.barrier(barrier_id=NamedBarrierMoE.TailHandOver, number_of_threads=2 * WG_THREADS)
    if wg == 0:
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cols):
                acc_mn[r, c] = half_mn[r, c]
                acc_mn[r, c + cols] = buf[r * cols + c, t]
    # warpgroup 1 may restage (a later tile) only after warpgroup 0 has read
    cute.arch.barrier(barrier_id=NamedBarrierMoE.TailHandOver, number_of_threads=2 * WG_THREADS)


__all__ = ["TAIL_ATOMS", "drain", "first_m_block", "tail_assemble"]
