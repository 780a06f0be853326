"""The device side of ``megamoe.schedule``: the persistent MoE kernel's tile walk, in CuTe DSL.

It mirrors :func:`megamoe.schedule.expert_wave_order` and :func:`megamoe.schedule.interleaved_scheduler`
line by line (integers only), over the rows the Dispatch phase produced this launch: the kernel keeps
``O_e`` (each local expert's first scheduler row, ``O[E]`` = P, the rank's row count) and ``n_e`` (its token
rows) in shared memory. Both the producer warp and the MMA warpgroups walk the same stream, so they agree
on every tile without talking. The GPU test ``tests/megamoe/test_megamoe_gpu.py`` checks the instrumented
kernel's per-CTA tile order against ``megamoe.schedule`` for both orders (one source of truth).

A walk's state is eight Int32 (``cursor`` fields); what they mean depends on the order:
  wave:        (i, w, base, 0, e, 0, n, 0): i the CTA's next list index, w its wave, base the list index of wave
               w's first tile, e the expert of its last tile, n its tiles so far (its round; row groups only);
  interleaved: (k_1, k_2, 0, 0, e_1, e_2, n_1, n_2): Algorithm 1's pair cursors, the experts they were at and
               the steps each took (row groups only).
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Int32

WAVE = 0
INTERLEAVED = 1
ORDERS = {"wave": WAVE, "interleaved": INTERLEAVED}
KIND_L1 = 1
KIND_L2 = 2


@cute.jit
def raster(s_row_off: cute.Tensor, first_row: Int32, j: Int32, units, m_group: Int32, rnd: Int32, pos: Int32,
           stride: Int32, e_lo: Int32, e_hint: Int32):
    """schedule.RankWork.raster: the ``j``-th (row, unit) from ``first_row`` on in row groups of ``m_group``
    M blocks per expert, rows fastest within a group, each unit's rotated by its round. Entry ``j`` is the
    CTA's ``rnd``-th, at ``pos`` in its round of ``stride`` entries (list index pos + rnd * stride), so the
    unit's round needs no division by the stride. The expert is found by a forward scan from ``e_hint`` (the
    cursor's last expert, or ``e_lo`` when the walk went back): the cursors only move forward, a stride at a
    time, so the scan is a step or two where a binary search would be log2(E) dependent loads, on the MMA
    side's path between tiles. Returns (row, unit, group's first row, its last row, the expert of row q: for
    ``m_group == 1``, the row-major walk, that is the tile's; in a group all rows share it)."""
    q = first_row + j // units
    p = q
    u = j % units
    first = q
    last = q
    e = e_hint
    if s_row_off[e] > q:
        e = e_lo
    while s_row_off[e + 1] <= q:
        e = e + 1
    if m_group > 1:
        start = s_row_off[e]
        blocks = s_row_off[e + 1] - start
        local = j - (start - first_row) * units
        k = local // (m_group * units)
        group_rows = cutlass.min(m_group, blocks - k * m_group)
        t = local - k * m_group * units
        first = start + k * m_group
        place = t % group_rows
        turn = rnd
        if place > pos:  # the unit began in an earlier round: floor((pos - place) / stride) rounds back
            turn = rnd - (place - pos + stride - 1) // stride
        p = first + (place + turn) % group_rows
        u = t // group_rows
        last = first + group_rows - 1
    return p, u, first, last, e


@cute.jit
def wave_rows(s_row_off: cute.Tensor, w: Int32, experts_per_wave: Int32, num_experts: cutlass.Constexpr):
    """(first row, row count) of wave ``w`` (schedule.wave_rows)."""
    first = w * experts_per_wave
    last = cutlass.min(first + experts_per_wave, Int32(num_experts))
    r0 = s_row_off[first]
    return r0, s_row_off[last] - r0


@cute.jit
def next_tile(order: Int32, cursor, s_row_off: cute.Tensor, num_rows: Int32, experts_per_wave: Int32,
              lead: Int32, m_group: Int32, bidx: Int32, grid: Int32, n1: cutlass.Constexpr,
              n2: cutlass.Constexpr, num_experts: cutlass.Constexpr):
    """The CTA's next tile after ``cursor``: returns (found, kind, p, n, e, cursor'), e the expert of row p
    (raster's scan: no search by the callers). ``order``: WAVE or
    INTERLEAVED (a run-time choice of the same kernel). ``lead``: Algorithm 1's D as whole rows (ceil(D): the
    rows are integers, so p_2 + D <= p_1 iff p_2 + ceil(D) <= p_1). ``m_group``: the row groups of
    :func:`raster`."""
    a, b, c, d, e1, e2, i1, i2 = cursor
    found = Int32(0)
    kind = Int32(0)
    p = Int32(0)
    n = Int32(0)
    e = Int32(0)
    if order == WAVE:
        num_waves = (Int32(num_experts) + experts_per_wave - 1) // experts_per_wave
        searching = Int32(1)
        while searching != 0 and b < num_waves:
            r0, nr = wave_rows(s_row_off, b, experts_per_wave, num_experts)
            c1 = nr * n1
            j = a - c
            if j < nr * (n1 + n2):
                if j < c1:
                    kind = Int32(KIND_L1)
                    p, n, _, _, e1 = raster(s_row_off, r0, j, n1, m_group, i1, bidx, grid, b * experts_per_wave,
                                            e1)
                else:
                    kind = Int32(KIND_L2)
                    p, n, _, _, e1 = raster(s_row_off, r0, j - c1, n2, m_group, i1, bidx, grid,
                                            b * experts_per_wave, e1)
                found = Int32(1)
                searching = Int32(0)
                e = e1
                a = a + grid
                i1 = i1 + 1
            else:
                c = c + nr * (n1 + n2)
                b = b + 1
    else:
        G = grid // 2
        r = bidx % 2
        g = bidx // 2
        P1 = (n1 + 1) // 2
        P2 = (n2 + 1) // 2
        end1 = num_rows * P1
        end2 = num_rows * P2
        searching = Int32(1)
        while searching != 0 and (a < end1 or b < end2):
            row1, pair1, p1, _, e1 = raster(s_row_off, Int32(0), cutlass.min(a, end1 - 1), P1, m_group, i1, g, G,
                                            Int32(0), e1)
            if a >= end1:
                p1 = num_rows + lead + 1  # +inf: every L2 row qualifies
            row2, pair2, _, p2, e2 = raster(s_row_off, Int32(0), cutlass.min(b, end2 - 1), P2, m_group, i2, g, G,
                                            Int32(0), e2)
            if b < end2 and p2 + lead <= p1:
                kind = Int32(KIND_L2)
                p = row2
                e = e2
                n = 2 * pair2 + r
                b = b + G
                i2 = i2 + 1
                if n < n2:
                    found = Int32(1)
                    searching = Int32(0)
            else:
                kind = Int32(KIND_L1)
                p = row1
                e = e1
                n = 2 * pair1 + r
                a = a + G
                i1 = i1 + 1
                if n < n1:
                    found = Int32(1)
                    searching = Int32(0)
    return found, kind, p, n, e, (a, b, c, d, e1, e2, i1, i2)


@cute.jit
def initial_cursor(order: Int32, bidx: Int32):
    """The first cursor of CTA ``bidx``: wave, list index bidx in wave 0; interleaved, k_1 = k_2 = g = bidx // 2."""
    a = bidx
    b = Int32(0)
    if order != WAVE:
        a = bidx // 2
        b = bidx // 2
    return a, b, Int32(0), Int32(0), Int32(0), Int32(0), Int32(0), Int32(0)


def lead_rows(lead: float) -> int:
    """Algorithm 1's D (a float) as the whole rows the kernel compares with (ceil; rows are integers)."""
    if lead < 0 or not math.isfinite(lead):
        raise ValueError(f"the lead D must be a finite number >= 0, got {lead}")
    return int(math.ceil(lead))


__all__ = ["WAVE", "INTERLEAVED", "ORDERS", "KIND_L1", "KIND_L2", "next_tile",
           "initial_cursor", "lead_rows", "raster"]
