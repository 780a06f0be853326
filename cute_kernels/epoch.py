"""The epoch-flag protocol shared by every kernel that stores into other ranks' symmetric buffers.

Per rank one Int64 array ``flags`` of 2P words (symmetric memory), monotone (never reset, so a CUDA-Graph
replay never sees a stale value; 64 bits never wrap), and the number of this rank's sender launches so far
in a device word ``epoch`` (Int64). A sender kernel reads it at its start (every CTA computes e = epoch + 1);
the last of its CTAs to arrive advances it (safe: every CTA of the launch has read it by then).
- ``flags[P + j]`` (ready): rank j writes its epoch e when its launch e starts, i.e. once its stream is done
  with the output of launch e-1. A sender waits for it (bounded) before storing to j.
- ``flags[s]`` (data): every CTA of sender s adds its share of ``SHARE_TOTAL`` once its stores are performed,
  so after sender s's launch e the word holds e * SHARE_TOTAL, whatever its grid. The receiver's
  EpochWaitKernel waits for every sender's word to reach its own epoch * SHARE_TOTAL. One system-scope fence
  per CTA (release pattern, after the CTA barrier) orders its stores before its share.
"""
from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from cute_kernels import flags as fl


@dataclass(frozen=True)
class FlagProtocol:
    """A sender kernel's buffers of this protocol: every rank's flag array, this rank's flags, its
    launch epoch and arrival counter, the error word, and the bound of every wait."""

    flag_ptrs: cute.Tensor
    flags: cute.Tensor
    epoch: cute.Tensor
    counter: cute.Tensor
    errors: cute.Tensor
    timeout_ns: Int64


SHARE_TOTAL = 1 << 20  # one sender launch's data-flag increments, summed over its CTAs


def _peer_flag(flag_ptrs: cute.Tensor, peer, index):
    base = cute.make_ptr(Int64, flag_ptrs[peer], cute.AddressSpace.gmem, assumed_align=8)
    return (base + index).llvm_ptr


MAX_GRID = (1 << 31) // SHARE_TOTAL - 1  # 2047 CTAs: (bidx + 1) * SHARE_TOTAL stays an Int32


def cta_share(bidx, grid):
    """CTA ``bidx``'s share of SHARE_TOTAL (the shares of CTAs 0..grid-1 sum to it exactly); 32-bit math,
    so ``grid`` <= MAX_GRID (the callers launch at most 2 CTAs per SM). Ints or DSL Int32."""
    return ((bidx + 1) * SHARE_TOTAL) // grid - (bidx * SHARE_TOTAL) // grid


@cute.jit
def announce_ready(flag_ptrs: cute.Tensor, rank: Int32, world: Int32, e_next: Int64, lane: Int32, bidx: Int32):
    """CTA 0, one thread of a warp (``lane`` 0..31) per peer: this rank may now receive epoch ``e_next``.
    The attention kernel calls it from an otherwise idle warp, so its system-scope fences stay off the
    MMA warpgroups' path."""
    if bidx == 0:
        for j in cutlass.range(lane, world, 32, unroll=1):
            cute.arch.red(_peer_flag(flag_ptrs, j, world + rank), Int64(e_next), op="max", dtype="s64",
                          sem="release", scope="sys")


@cute.jit
def ensure_ready(flags: cute.Tensor, ready_mask: Int32, dest: Int32, world: Int32, e_next: Int64,
                 timeout_ns: Int64, errors: cute.Tensor, tidx: Int32, bidx: Int32, barrier_id: int,
                 num_threads: int) -> Int32:
    """Before the first store to ``dest`` in this launch: one thread waits (bounded) for its ready flag,
    then the ``num_threads`` storing threads sync on named barrier ``barrier_id``. Returns the new mask."""
    mask = ready_mask
    if (mask >> dest) & 1 == 0:
        if tidx % num_threads == 0:
            fl.wait_geq(flags, world + dest, e_next, timeout_ns, errors, Int32(fl.ERR_FLAG_TIMEOUT), bidx, "sys")
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)
        mask = mask | (Int32(1) << dest)
    return mask


@cute.jit
def wait_ready_flags(flags: cute.Tensor, world: Int32, e_next: Int64, timeout_ns: Int64, errors: cute.Tensor,
                     bidx: Int32, first, stride: cutlass.Constexpr, max_world: cutlass.Constexpr,
                     sleep_ns: cutlass.Constexpr = 0, relaxed_poll: cutlass.Constexpr = False):
    """Bounded waits (system scope) for the ready flags of ranks first, first + stride, ... below ``world``:
    an unrolled loop bounded by the compile-time ``max_world`` (a run-time loop over the ranks made ptxas
    move a 64-bit operand of the producer warp's TMA loads into vector registers, 8 R2UR per KV block,
    ~0.65% of the kernel on H200: fused_ready_spans_9be24f1.json)."""
    for jj in cutlass.range_constexpr((max_world + stride - 1) // stride):
        j = first + stride * jj
        if j < world:
            fl.wait_geq(flags, world + j, e_next, timeout_ns, errors, Int32(fl.ERR_FLAG_TIMEOUT), bidx, "sys",
                        sleep_ns, relaxed_poll)


@cute.jit
def await_all_ready(flags: cute.Tensor, world: Int32, e_next: Int64, timeout_ns: Int64, errors: cute.Tensor,
                    lane: Int32, bidx: Int32, gate_barriers: cutlass.Constexpr, gate_threads: cutlass.Constexpr,
                    max_world: cutlass.Constexpr = 32):
    """One warp per CTA, at its start: wait (bounded, system scope) until every receiver announced
    epoch ``e_next``, then arrive on each named barrier in ``gate_barriers`` (counted in ``gate_threads``,
    this warp included). Each storing warpgroup syncs
    on its barrier before its first tile's stores, with this warp counted, so those stores follow the
    receivers' announcements (acquire here, then the barrier's CTA-scope ordering); later tiles count without
    this warp, so the loop holds no poll or wait of its own. By the first epilogue, a whole Q-loop later, the
    arrival has long happened. On timeout the error word is set and the warp still arrives, so nothing hangs.
    ``max_world``: a compile-time bound on ``world`` (the kernel's destination count); lane j waits for ranks
    j, j + 32, ... (wait_ready_flags). The polls are relaxed, then one acquire fence: an acquire load per poll
    (CCTL.IVALL each) cost the co-running mainloop ~0.6% on H200 (docs/FINDINGS.md, ready_wait)."""
    wait_ready_flags(flags, world, e_next, timeout_ns, errors, bidx, lane, 32, max_world, 0, True)
    cute.arch.sync_warp()
    for b in cutlass.range_constexpr(len(gate_barriers)):
        cute.arch.barrier_arrive(barrier_id=gate_barriers[b], number_of_threads=gate_threads)


@cute.jit
def publish_done(flag_ptrs: cute.Tensor, counter: cute.Tensor, epoch: cute.Tensor, rank: Int32, world: Int32,
                 e_next: Int64, grid: Int32, bidx: Int32, tidx: Int32):
    """Call after a barrier of every thread of the CTA that stored. Thread 0 fences once at system scope
    (release pattern: cumulative, so it covers the stores the barrier ordered before it), adds the CTA's
    share to every receiver's data flag for this sender (relaxed, no reply awaited), and arrives on the
    launch's arrival counter; the last CTA to arrive advances the device epoch and resets the counter for
    the next launch on this stream (local words, ordered for that launch by the kernel boundary). One
    fence on the kernel's last path."""
    if tidx == 0:
        share = Int64(cta_share(bidx, grid))
        cute.arch.fence_acq_rel_sys()
        for j in cutlass.range(world, unroll=1):
            cute.arch.red(_peer_flag(flag_ptrs, j, rank), share, op="add", dtype="u64", sem="relaxed", scope="sys")
        arrived = cute.arch.atomic_add(fl.elem_ptr(counter, 0), Int32(1), sem="relaxed", scope="gpu")
        if arrived == grid - 1:
            epoch[0] = e_next
            counter[0] = Int32(0)
