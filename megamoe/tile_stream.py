"""The device side of ``megamoe.schedule``: the persistent MoE kernel's tile walk, in CuTe DSL.

It mirrors :func:`megamoe.schedule.expert_wave_order` and :func:`megamoe.schedule.interleaved_scheduler`
line by line (integers only), over the rows the Dispatch phase produced this launch: the kernel keeps
``O_e`` (each local expert's first scheduler row, ``O[E]`` = P, the rank's row count) and ``n_e`` (its token
rows) in shared memory. One warp of the CTA, the scheduler warp, walks the stream and publishes each tile in a
small shared-memory ring (:class:`TileRing`); the producer warp, the MMA warpgroups and the store warps read
it there, so the walk's integer arithmetic is on none of their paths (quack's sm90 GEMM does the same with its
scheduler warp). The GPU test ``tests/megamoe/test_megamoe_gpu.py`` checks the instrumented kernel's per-CTA
tile order against ``megamoe.schedule`` for both orders (one source of truth).

A walk's state is eight Int32 (``cursor`` fields); what they mean depends on the order:
  wave:        (i, w, base, 0, e, 0, n, 0): i the CTA's next list index, w its wave, base the list index of wave
               w's first tile, e the expert of its last tile, n its tiles so far (its round; row groups only);
  interleaved: (k_1, k_2, 0, 0, e_1, e_2, n_1, n_2): Algorithm 1's pair cursors, the experts they were at and
               the steps each took (row groups only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
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


TILE_SLOTS = 8  # the ring's depth: the producer runs at most ~2 tiles ahead of the store warps, so 8 keeps
#                 the scheduler warp ahead of every reader
TILE_FIELDS = 4  # kind (0: the walk's end), p, n, e


@dataclass(frozen=True)
class TileRing:
    """The CTA's tile walk, computed once: the scheduler warp publishes each tile of :func:`next_tile` (then an
    end record) into ``TILE_SLOTS`` shared-memory slots; every reader warp takes them in order and frees a slot
    once all ``reader_warps`` have read it (one arrival per warp). A reader is a whole warp: the producer warp,
    a store warp, or each warp of an MMA warpgroup. Intra-CTA mbarrier waits, like the operand pipeline's."""

    slots: cute.Tensor  # (TILE_FIELDS, TILE_SLOTS) Int32
    pipe: pipeline.PipelineAsync

    @staticmethod
    def create(barrier_storage, slots: cute.Tensor, reader_warps: int) -> "TileRing":
        return TileRing(slots, pipeline.PipelineAsync.create(
            barrier_storage=barrier_storage, num_stages=TILE_SLOTS,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, reader_warps), defer_sync=True))

    @staticmethod
    def reader_state():
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, TILE_SLOTS)

    @cute.jit
    def publish_walk(self, walk, n1: cutlass.Constexpr, n2: cutlass.Constexpr, num_experts: cutlass.Constexpr):
        """The scheduler warp: every tile of the CTA's stream (``walk``: the kernel's walk arguments), then the
        end record."""
        order, s_row_off, num_rows, epw, lead, m_group, bidx, grid = walk
        lane = cute.arch.lane_idx()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, TILE_SLOTS)
        cursor = initial_cursor(order, bidx)
        found, kind, p, n, e, cursor = next_tile(order, cursor, s_row_off, num_rows, epw, lead, m_group, bidx, grid,
                                                 n1, n2, num_experts)
        while found != 0:
            self.publish(state, lane, kind, p, n, e)
            state.advance()
            found, kind, p, n, e, cursor = next_tile(order, cursor, s_row_off, num_rows, epw, lead, m_group, bidx,
                                                     grid, n1, n2, num_experts)
        self.publish(state, lane, Int32(0), Int32(0), Int32(0), Int32(0))

    @cute.jit
    def publish(self, state, lane, kind, p, n, e):
        self.pipe.producer_acquire(state)
        if lane == 0:
            for i, v in enumerate((kind, p, n, e)):
                self.slots[i, state.index] = v
            self.pipe.producer_commit(state)

    @cute.jit
    def read(self, state):
        """A reader warp's next tile: (found, kind, p, n, e, state advanced); ``state`` from :meth:`reader_state`."""
        self.pipe.consumer_wait(state)
        kind = self.slots[0, state.index]
        p = self.slots[1, state.index]
        n = self.slots[2, state.index]
        e = self.slots[3, state.index]
        cute.arch.sync_warp()  # every lane's reads done before the warp frees the slot
        if cute.arch.lane_idx() == 0:
            self.pipe.consumer_release(state)
        state.advance()
        found = Int32(1)
        if kind == 0:
            found = Int32(0)
        return found, kind, p, n, e, state


def lead_rows(lead: float) -> int:
    """Algorithm 1's D (a float) as the whole rows the kernel compares with (ceil; rows are integers)."""
    if lead < 0 or not math.isfinite(lead):
        raise ValueError(f"the lead D must be a finite number >= 0, got {lead}")
    return int(math.ceil(lead))


__all__ = ["WAVE", "INTERLEAVED", "ORDERS", "KIND_L1", "KIND_L2", "TILE_SLOTS", "TILE_FIELDS", "TileRing", "next_tile",
           "initial_cursor", "lead_rows", "raster"]
