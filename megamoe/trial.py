"""schedule="auto"'s measured pick on the device: the kernel's side of a decision key's trial slot.

The slot's layout, the warm-up and the sample counts are ``megamoe.auto``'s (TRIAL_*, MEASURED_CALLS); its
``trial_launch_order`` and ``faster_measured`` are this file's rules in plain Python, and the GPU test checks a
settled slot against them. Every thread of every CTA reads the slot at kernel entry (``trial_order``): the
words change only in the last CTA of a launch (``close_trial``), after every CTA of it has passed barrier B1,
and the next launch of the key is stream-ordered after that one, so all CTAs of a launch run the same order.
``mode``: TRIAL_OFF (``order`` as given), TRIAL_READ (the slot decides the order; another launch owns it: the
ranks emulated beside the lead rank), TRIAL_OWN (it decides, and this launch times itself into it).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from cute_kernels.flags import elem_ptr
from megamoe.auto import MEASURED_CALLS, TRIAL_DECIDED, TRIAL_LAUNCHES, TRIAL_START, TRIAL_TIMES, TRIAL_WARMUP

TRIAL_OFF, TRIAL_READ, TRIAL_OWN = 0, 1, 2


@cute.jit
def trial_order(trial: cute.Tensor, prior: Int32, mode: Int32) -> Int32:
    """The order this launch runs (auto.trial_launch_order): the decided one, else the prior through the warm-up,
    then the prior and the other alternating."""
    order = prior
    if mode != TRIAL_OFF:
        decided = cute.arch.load(elem_ptr(trial, TRIAL_DECIDED), Int64, sem="relaxed", scope="gpu")
        launches = cute.arch.load(elem_ptr(trial, TRIAL_LAUNCHES), Int64, sem="relaxed", scope="gpu")
        if decided != Int64(0):
            order = Int32(decided - 1)
        elif launches >= Int64(TRIAL_WARMUP):
            order = prior ^ Int32((launches - TRIAL_WARMUP) % 2)
    return order


@cute.jit
def open_trial(trial: cute.Tensor, mode: Int32, tidx: Int32, bidx: Int32):
    """CTA 0's first thread stamps the launch's start (the persistent grid's CTAs start together)."""
    if mode == TRIAL_OWN and bidx == 0 and tidx == 0:
        trial[TRIAL_START] = cute.arch.globaltimer()


@cute.jit
def upper_median(trial: cute.Tensor, base: Int32) -> Int64:
    """The element at index MEASURED_CALLS // 2 of the sorted samples trial[base:base + MEASURED_CALLS] (the
    upper median: auto.faster_measured's). Once per key, in one thread: plain loops over global memory."""
    n = MEASURED_CALLS
    med = trial[base]
    for i in cutlass.range(n, unroll=1):
        x = trial[base + i]
        less = Int32(0)
        leq = Int32(0)
        for j in cutlass.range(n, unroll=1):
            y = trial[base + j]
            if y < x:
                less = less + 1
            if y <= x:
                leq = leq + 1
        if less <= n // 2 and leq > n // 2:
            med = x
    return med


@cute.jit
def close_trial(trial: cute.Tensor, order: Int32, prior: Int32, mode: Int32):
    """The last CTA's thread, after every CTA of the launch has finished: a timed launch writes its time into
    its order's next sample; the launch that completes the samples writes the order with the lower median
    (ties: the prior); every launch before the decision counts itself."""
    if mode == TRIAL_OWN:
        if trial[TRIAL_DECIDED] == Int64(0):
            launches = trial[TRIAL_LAUNCHES]
            if launches >= Int64(TRIAL_WARMUP):
                k = Int32(launches - TRIAL_WARMUP)
                trial[TRIAL_TIMES + order * MEASURED_CALLS + k // 2] = cute.arch.globaltimer() - trial[TRIAL_START]
                if k == 2 * MEASURED_CALLS - 1:
                    other = Int32(1) - prior
                    faster = prior
                    if (upper_median(trial, TRIAL_TIMES + other * MEASURED_CALLS)
                            < upper_median(trial, TRIAL_TIMES + prior * MEASURED_CALLS)):
                        faster = other
                    trial[TRIAL_DECIDED] = Int64(faster + 1)
            trial[TRIAL_LAUNCHES] = launches + 1
