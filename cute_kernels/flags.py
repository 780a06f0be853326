"""Flags, grid arrival barriers and bounded spin-waits.

Every wait is bounded by a ``%globaltimer`` deadline. On timeout the waiter records an error code in the
error word (``errors[0]``, first error wins, ``errors[1]`` = block, ``errors[2]`` = value seen) and returns,
so the host raises instead of hanging (see ``runtime.check_error_word``).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr
from cutlass._mlir.dialects import nvvm
from cutlass.cutlass_dsl import dsl_user_op

ERR_NONE = 0
ERR_GRID_BARRIER_TIMEOUT = 1
ERR_FLAG_TIMEOUT = 2
ERROR_NAMES = {
    ERR_GRID_BARRIER_TIMEOUT: "grid arrival barrier timed out (are all CTAs co-resident?)",
    ERR_FLAG_TIMEOUT: "flag wait timed out (did every sender launch and signal?)",
}
ERROR_WORDS = 4  # errors tensor: [code, block, value seen, spare]


def elem_ptr(t: cute.Tensor, i):
    """LLVM pointer to element ``i`` of a 1-D tensor."""
    return (t.iterator + i).llvm_ptr


@cute.jit
def record_error(errors: cute.Tensor, code: Int32, block: Int32, seen: Int32):
    old = cute.arch.atomic_cas(elem_ptr(errors, 0), cmp=Int32(0), val=code, sem="relaxed", scope="sys")
    if old == Int32(0):
        errors[1] = block
        errors[2] = seen


@dsl_user_op
def nanosleep(ns, *, loc=None, ip=None) -> None:
    """Suspend the calling warp for up to about ``ns`` nanoseconds (PTX ``nanosleep``)."""
    nvvm.nanosleep(Int32(ns).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)


@cute.jit
def wait_geq(flags: cute.Tensor, index: Int32, target, timeout_ns: Int64,
             errors: cute.Tensor, code: Int32, block: Int32, scope: cutlass.Constexpr = "gpu",
             sleep_ns: cutlass.Constexpr = 0, relaxed_poll: cutlass.Constexpr = False) -> Int32:
    """Spin (acquire loads) until ``flags[index] >= target`` or the deadline passes; returns 1 if met.
    ``flags`` holds Int32 or Int64 words (``target`` is converted to that type). ``sleep_ns`` > 0 backs off
    that long between polls (fewer loads on the flag's line while many waiters poll it). ``relaxed_poll``:
    relaxed loads, then one acquire fence at ``scope`` (the same ordering, without an acquire per poll)."""
    word = flags.element_type
    goal = word(target)
    sem = "relaxed" if relaxed_poll else "acquire"
    deadline = cute.arch.globaltimer() + timeout_ns
    seen = cute.arch.load(elem_ptr(flags, index), word, sem=sem, scope=scope)
    while seen < goal and cute.arch.globaltimer() < deadline:
        if const_expr(sleep_ns > 0):
            nanosleep(sleep_ns)
        seen = cute.arch.load(elem_ptr(flags, index), word, sem=sem, scope=scope)
    if const_expr(relaxed_poll):
        if const_expr(scope == "sys"):
            cute.arch.fence_acq_rel_sys()
        else:
            cute.arch.fence_acq_rel_gpu()
    met = Int32(1)
    if seen < goal:
        record_error(errors, code, block, Int32(seen))
        met = Int32(0)
    return met


def signal_add(flags: cute.Tensor, index, value=1, scope: str = "gpu") -> None:
    """Release-add ``value`` to ``flags[index]`` (orders this thread's earlier stores before the flag)."""
    cute.arch.red(elem_ptr(flags, index), Int32(value), op="add", dtype="s32", sem="release", scope=scope)


@cute.jit
def grid_arrive_and_wait(counter: cute.Tensor, index: Int32, target: Int32, timeout_ns: Int64,
                         errors: cute.Tensor, block: Int32) -> Int32:
    """One thread per CTA: arrive on ``counter[index]`` and wait for ``target`` arrivals (bounded).

    Needs every CTA of the grid co-resident (the callers launch at most one CTA per SM).
    """
    signal_add(counter, index, 1, "gpu")
    return wait_geq(counter, index, target, timeout_ns, errors, Int32(ERR_GRID_BARRIER_TIMEOUT), block, "gpu")
