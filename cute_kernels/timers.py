"""Timestamps for per-CTA spans.

``%globaltimer`` is comparable across SMs but ticks every 32 ns on the H200; ``clock64`` counts one SM's
cycles (about 1.98 GHz under load) and resolves sub-microsecond spans. Spans record both.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

# Field order of one span record (Int64 each): start/end on both clocks.
SPAN_FIELDS = ("gt_start", "gt_end", "ck_start", "ck_end")


def now():
    """(globaltimer ns, clock64 cycles) read back to back."""
    return cute.arch.globaltimer(), cute.arch.clock64()


def write_span(record: cute.Tensor, row, gt_start, gt_end, ck_start, ck_end) -> None:
    """Store one span into ``record[row, 0:4]``: one write per span, after the timed region."""
    record[row, 0] = cutlass.Int64(gt_start)
    record[row, 1] = cutlass.Int64(gt_end)
    record[row, 2] = cutlass.Int64(ck_start)
    record[row, 3] = cutlass.Int64(ck_end)


def close_span(record: cute.Tensor, row, gt_start, ck_start) -> None:
    """Store the span that started at (``gt_start``, ``ck_start``) and ends now into ``record[row, 0:4]``: each
    end is read right before its own store, so the globaltimer end does not wait for the clock64 read."""
    record[row, 0] = gt_start
    record[row, 1] = cute.arch.globaltimer()
    record[row, 2] = ck_start
    record[row, 3] = cute.arch.clock64()


@cute.jit
def now_after_barrier(word: cute.Tensor):
    """``now()`` once a named barrier this thread just passed has completed. Hopper defers a barrier's blocking
    (``BAR.SYNC.DEFER_BLOCKING``) to the warp's next memory access, so timer reads right after ``bar.sync`` run
    before the barrier completes: a wait measured that way reads zero and a span started that way includes the
    wait. Here the reads depend on a shared-memory load of ``word[0]``, a non-negative word (a count)."""
    v = word[0]
    gt = Int64(0)
    ck = Int64(0)
    if v != Int32(-1):
        gt = cute.arch.globaltimer()
        ck = cute.arch.clock64()
    return gt, ck
