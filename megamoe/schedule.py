"""MegaMoE tile schedules in plain Python: the expert-wave order, the interleaved order of Algorithm 1, their
dependencies, and the anti-starvation lead D_knee (xstage-paper sections 2.2, 4.2 and 5.2).

This module is the single source of truth for the order in which a persistent MegaMoE grid walks its tiles;
the kernel consumes these streams or mirrors :func:`interleaved_scheduler` / :func:`expert_wave_order` (a
test then proves equality). The time-resolved replay against the Burst-Gap model is ``megamoe.simulate``.

One rank's work (:class:`RankWork`): the local experts e, each with n_e routed token rows (n_e >= 0, any
value). Expert e has ceil(n_e / BLOCK_M) M blocks; the paper calls each (expert, M block) a scheduler *row*,
numbered expert by expert: O_e is expert e's first row, e(p) the expert of row p, P the number of rows.
A tile is (kind, expert, m_block, n_block):
  * L1 (Linear-1, gate and up fused): N = 2 * intermediate, K = hidden;
  * L2 (Linear-2): N = hidden, K = intermediate. An L2 tile reads the whole intermediate row, so it depends
    on every L1 N block of its row.

Symbols of Algorithm 1 (named in the code as in the paper):
  G     number of scheduler instances (CTA pairs) and the cursor stride; the grid has 2G CTAs, CTA c = 2g + r
  g     instance id, 0 <= g < G;  r in {0, 1}: the CTA's role in its pair
  P     rows per stream (all rows of the rank);  P_i: N-block pairs per row of L_i, ceil(n_blocks_i / 2)
  k_i   pair cursor of L_i;  p_i = floor(k_i / P_i): its row (p_1 = +inf once L1 is done)
  D     minimum row lead of L1 over L2: L2 of row p_2 is emitted only when p_2 + D <= p_1
Eq. 16: D_knee = b_n * K_SM / (2 * h_inter) rows. It is G / P_1 with G = K_SM / 2 and P_1 = h_inter / b_n:
the rows one stride of all instances' L1 cursors spans, i.e. the cross-SM phase skew of L1 readiness.
Eq. 12-15 (the gap, the issue overhead, the rate test and the per-tile stall) are evaluated by
``megamoe.simulate`` through ``calibrate.model``.

Dependencies (checked statically by :func:`check_schedule`, in time by ``megamoe.simulate.verify_trace``):
  * L2 (e, m, n) starts only after all L1 N blocks of row (e, m) are complete;
  * L1 of row p starts only after its dispatched tokens are ready and its ring slot is free. The ring holds
    ``ring_slots`` rows of dispatched tokens (and their L1 output); row p uses slot p mod ring_slots, which
    is free once every L2 tile of row p - ring_slots (the slot's previous occupant) is done.
    ``ring_slots=None`` is a pool with a slot for every row (no ring backpressure).
"""

from __future__ import annotations

import math
import operator
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

from calibrate import model

BLOCK_M = 128
BLOCK_N = 128  # the FP8 tile's N and the layer's granularity; bf16 tiles may be 256 wide (block_n_for)
BLOCK_K = 128
L1 = "L1"
L2 = "L2"
KINDS = (L1, L2)
BF16_BYTES = 2

# The wave-size heuristic's default: a wave's expected L1 tiles fill the grid at least this many rounds.
WAVE_FILL_ROUNDS = 2


class ScheduleError(ValueError):
    """A shape, a token count or a tile stream is invalid: a missing, repeated or foreign tile, or an order
    that deadlocks whatever the timing (a cycle of program order and dependencies)."""


class Tile(NamedTuple):
    """One output tile: kind (L1 | L2), local expert, M block within the expert, N block."""

    kind: str
    expert: int
    m_block: int
    n_block: int

    def __str__(self) -> str:
        return f"{self.kind}(e={self.expert},m={self.m_block},n={self.n_block})"


@dataclass(frozen=True)
class MoEShape:
    """The layer's GEMM shapes and tile sizes; hidden is L2's N and L1's K, 2*intermediate is L1's N."""

    hidden: int
    intermediate: int
    block_m: int = BLOCK_M
    block_n: int = BLOCK_N
    block_k: int = BLOCK_K

    def __post_init__(self):
        for name in ("hidden", "intermediate", "block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ScheduleError(f"{name} must be a positive integer, got {value!r}")
        for name, value, tile in (("hidden", self.hidden, self.block_n), ("2*intermediate", 2 * self.intermediate,
                                  self.block_n), ("hidden", self.hidden, self.block_k),
                                  ("intermediate", self.intermediate, self.block_k)):
            if value % tile:
                raise ScheduleError(f"{name} = {value} is not a multiple of the tile size {tile}")

    @property
    def l1_n_blocks(self) -> int:
        return 2 * self.intermediate // self.block_n

    @property
    def l2_n_blocks(self) -> int:
        return self.hidden // self.block_n

    @property
    def l1_k_blocks(self) -> int:
        return self.hidden // self.block_k

    @property
    def l2_k_blocks(self) -> int:
        return self.intermediate // self.block_k

    def n_blocks(self, kind: str) -> int:
        return self.l1_n_blocks if kind == L1 else self.l2_n_blocks

    def pairs_per_row(self, kind: str) -> int:
        """Algorithm 1's P_i: N-block pairs per row; an odd N-block count leaves role r = 1 idle on the last pair."""
        return -(-self.n_blocks(kind) // 2)

    @property
    def l2_tile_bytes(self) -> int:
        """Combine output of one full L2 tile: block_m x block_n bf16 (the paper's V_t, 32 KiB at 128 x 128)."""
        return self.block_m * self.block_n * BF16_BYTES


@dataclass(frozen=True)
class RankWork:
    """One MoE layer's work on one rank: the shape and the token rows routed to each local expert."""

    shape: MoEShape
    tokens_per_expert: tuple[int, ...]
    _rows: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        counts = []
        for e, n in enumerate(self.tokens_per_expert):
            try:  # operator.index takes Python and numpy integers and refuses floats and strings
                value = operator.index(n)
            except TypeError:
                value = None
            if value is None or isinstance(n, bool) or value < 0:
                raise ScheduleError(f"tokens_per_expert[{e}] must be an integer >= 0, got {n!r}")
            counts.append(value)
        if not counts:
            raise ScheduleError("a rank owns at least one expert (tokens_per_expert is empty)")
        counts = tuple(counts)
        object.__setattr__(self, "tokens_per_expert", counts)
        m_blocks = [-(-n // self.shape.block_m) for n in counts]
        offsets, rows, start = [], [], 0
        for e, mb in enumerate(m_blocks):
            offsets.append(start)
            rows.extend((e, m) for m in range(mb))
            start += mb
        object.__setattr__(self, "_rows", (tuple(m_blocks), tuple(offsets), tuple(rows)))

    @property
    def num_experts(self) -> int:
        return len(self.tokens_per_expert)

    @property
    def m_blocks(self) -> tuple[int, ...]:
        """ceil(n_e / BLOCK_M) per local expert."""
        return self._rows[0]

    @property
    def row_offsets(self) -> tuple[int, ...]:
        """O_e: the first scheduler row of each expert (an expert without tokens owns no rows)."""
        return self._rows[1]

    @property
    def rows(self) -> tuple[tuple[int, int], ...]:
        """Row p -> (e(p), p - O_e(p)), expert by expert."""
        return self._rows[2]

    @property
    def num_rows(self) -> int:
        """Algorithm 1's P."""
        return len(self._rows[2])

    def row_of(self, tile: Tile) -> int:
        return self.row_offsets[tile.expert] + tile.m_block

    def valid_m(self, expert: int, m_block: int) -> int:
        """Token rows the M block really holds (the last block of an expert may be partial)."""
        return min(self.shape.block_m, self.tokens_per_expert[expert] - m_block * self.shape.block_m)

    def raster(self, first_row: int, j: int, units: int, m_group: int, index: int = 0,
               stride: int = 1) -> tuple[int, int, int, int]:
        """The ``j``-th (row, unit) of the rows from ``first_row`` on (whole experts), ``units`` per row (N blocks
        or N-block pairs), in row groups: each expert's M blocks taken ``m_group`` at a time, a group walked unit
        by unit with its rows fastest, each unit's rows rotated by its round (``index``, the list index of entry
        ``j``, less its place in the unit, over the ``stride`` at which a CTA takes entries). Returns (row, unit,
        the group's first row, its last row).

        Why: the rows of a group read the same weight block (expert, N block) one after another, so a grid that
        walks the list in order has them in flight together and the weight block comes from HBM once, from L2
        for the others; ``m_group=1`` is the row-major walk (N block fastest). Without the rotation an even
        stride hands a CTA the same row of every group (only full blocks, or only tail blocks: 20% slower at
        DSv4-Flash 8192 tokens, megamoe_mgroup2_b0afe07.json). An expert's tiles fill exactly its rows' slots,
        so row slot first_row + j // units names the expert."""
        if m_group < 1:
            raise ScheduleError(f"m_group must be >= 1, got {m_group}")
        if m_group == 1:
            p = first_row + j // units
            return p, j % units, p, p
        e, _ = self.rows[first_row + j // units]
        start, blocks = self.row_offsets[e], self.m_blocks[e]
        local = j - (start - first_row) * units
        k = local // (m_group * units)
        group_rows = min(m_group, blocks - k * m_group)
        t = local - k * m_group * units
        first = start + k * m_group
        turn = (index - t % group_rows) // stride
        return first + (t + turn) % group_rows, t // group_rows, first, first + group_rows - 1

    @property
    def mma_rows(self) -> int:
        """The rows the MMA warpgroups multiply: :func:`mma_rows` of this rank's experts."""
        return mma_rows(self.tokens_per_expert, self.shape.block_m)

    def row_tiles(self, kind: str, p: int) -> list[Tile]:
        e, m = self.rows[p]
        return [Tile(kind, e, m, n) for n in range(self.shape.n_blocks(kind))]

    def tiles(self, kind: str | None = None) -> list[Tile]:
        """Every tile of the layer on this rank (both kinds, or one), row by row, N block fastest."""
        kinds = KINDS if kind is None else (kind,)
        return [t for k in kinds for p in range(self.num_rows) for t in self.row_tiles(k, p)]

    @property
    def num_tiles(self) -> int:
        return self.num_rows * (self.shape.l1_n_blocks + self.shape.l2_n_blocks)


def mma_rows(tokens_per_expert, block_m: int = BLOCK_M) -> int:
    """The token rows the kernel's Tensor Cores multiply for experts with these routed rows: each full M block's
    ``block_m``, and an expert's last, partial M block in halves of ``block_m // 2`` (one per MMA warpgroup; a
    warpgroup whose half holds no token issues no WGMMA, ``megamoe.kernel``). The rows past an expert's tokens
    in its last half are padding: multiplied, then thrown away. Routed rows / this is the share of the
    Tensor Cores' work the layer keeps (benchmarks.megamoe_padding)."""
    half = block_m // 2
    total = 0
    for e, n in enumerate(tokens_per_expert):
        n = operator.index(n)
        if n < 0:
            raise ScheduleError(f"tokens_per_expert[{e}] must be >= 0, got {n}")
        total += -(-n // half) * half
    return total


@dataclass(frozen=True)
class Schedule:
    """Per-CTA tile streams of a persistent grid: CTA c runs ``streams[c]`` in order.

    ``order`` is "wave" or "interleaved"; ``params`` holds what chose the order (experts_per_wave, or G and D)."""

    order: str
    streams: tuple[tuple[Tile, ...], ...]
    params: dict = field(default_factory=dict)

    @property
    def num_ctas(self) -> int:
        return len(self.streams)

    def tiles(self) -> list[Tile]:
        return [t for stream in self.streams for t in stream]


# --- the expert-wave order -------------------------------------------------------------------------------


def expert_wave_size(num_experts: int, mean_tokens_per_expert: float, l1_n_blocks: int, block_m: int,
                     num_ctas: int, rounds: int = WAVE_FILL_ROUNDS) -> int:
    """Experts per wave: the fewest whose expected L1 tiles fill the persistent grid ``rounds`` whole rounds,
    rounded up to a divisor of ``num_experts`` so every wave holds the same number of experts.

    Why: a wave with fewer L1 tiles than the grid leaves CTAs idle at each L1 -> L2 boundary, and routing skew
    leaves some experts below the mean, so the expected count is asked to fill two rounds (DeepGEMM's expert-wave
    baseline, the paper's [10], uses the same factor); beyond that, larger waves only delay the first L2 tiles
    and need more ring slots (a wave's rows must fit the ring). The expected tiles use the mean token count so
    the size depends only on quantities known at launch (total routed rows and shapes), not on the skew.
    """
    if num_experts <= 0 or num_ctas <= 0 or rounds <= 0:
        raise ScheduleError(f"num_experts, num_ctas and rounds must be > 0 (got {num_experts}, {num_ctas}, {rounds})")
    expected_tiles = math.ceil(mean_tokens_per_expert / block_m) * l1_n_blocks
    wave = num_experts if expected_tiles == 0 else min(num_experts, -(-rounds * num_ctas // expected_tiles))
    while num_experts % wave:
        wave += 1
    return wave


def expert_waves(work: RankWork, experts_per_wave: int) -> list[range]:
    """The waves: consecutive local experts, ``experts_per_wave`` each (the last one may be shorter)."""
    if experts_per_wave <= 0:
        raise ScheduleError(f"experts_per_wave must be > 0, got {experts_per_wave}")
    return [range(s, min(s + experts_per_wave, work.num_experts)) for s in range(0, work.num_experts, experts_per_wave)]


def wave_rows(work: RankWork, wave: range) -> range:
    """Scheduler rows of one wave's experts (contiguous: rows are numbered expert by expert)."""
    start = work.row_offsets[wave.start]
    end = work.row_offsets[wave.stop] if wave.stop < work.num_experts else work.num_rows
    return range(start, end)


def expert_wave_order(work: RankWork, num_ctas: int, experts_per_wave: int | None = None,
                      rounds: int = WAVE_FILL_ROUNDS, m_group: int = 1) -> Schedule:
    """The expert-wave order: wave w's L1 tiles, then its L2 tiles, then wave w + 1, as one list that the
    persistent grid walks with stride ``num_ctas`` (CTA c takes list entries c, c + num_ctas, ...; within a
    wave rows go expert by expert, N block fastest), which is the baseline's static persistent walk.
    ``experts_per_wave=None`` takes :func:`expert_wave_size` at the rank's mean token count. ``m_group``: each
    kind's tiles of a wave in :meth:`RankWork.raster`'s row groups (1: row by row, N block fastest)."""
    if num_ctas <= 0:
        raise ScheduleError(f"num_ctas must be > 0, got {num_ctas}")
    if experts_per_wave is None:
        mean = sum(work.tokens_per_expert) / work.num_experts
        experts_per_wave = expert_wave_size(work.num_experts, mean, work.shape.l1_n_blocks, work.shape.block_m,
                                            num_ctas, rounds)
    walk: list[Tile] = []
    for wave in expert_waves(work, experts_per_wave):
        rows = wave_rows(work, wave)
        for kind in KINDS:
            units = work.shape.n_blocks(kind)
            for j in range(len(rows) * units):
                p, n, _, _ = work.raster(rows.start, j, units, m_group, len(walk), num_ctas)
                e, m = work.rows[p]
                walk.append(Tile(kind, e, m, n))
    streams = tuple(tuple(walk[c::num_ctas]) for c in range(num_ctas))
    return Schedule("wave", streams, {"experts_per_wave": experts_per_wave, "num_waves": -(-work.num_experts //
                                                                                         experts_per_wave),
                                      "m_group": m_group})


def row_group_size(precision: str) -> int:
    """M blocks per row group (:meth:`RankWork.raster`) the kernel walks: 2 for every precision. Measured by
    adjacent pairs at world 1 against the row-major walk: bf16 DSv4-Flash 8192 tokens -15% (its weight blocks,
    1 MiB, were read from HBM once per M block), Qwen3-MoE -4..5%, groups of 4 the same
    (megamoe_mgroup{2,4}_4788669.json); W8A8 lost (+4..8%) while every role walked the stream itself, the group
    walk's divisions costing ~1 us a tile even where groups move no tile (megamoe_mgroup2_fp8_3e324ea.json), and
    wins since the scheduler warp walks it alone (megamoe_mgroup2_ring_a65d6f9.json: DSv4-Flash 8192 -2.6%,
    Qwen3-MoE 8192 -0.6%, DSv4-Flash 4096, where groups move no tile, a tie)."""
    if precision not in ("bf16", "w8a8", "w4a8"):
        raise ValueError(f"precision must be bf16, w8a8 or w4a8, got {precision!r}")
    return 2


# Local experts up to which a 128 x 256 bf16 tile's shared memory (3 stages of 48 KiB, 66 KiB of staging) leaves
# room for the kernel's per-expert tables (megamoe.kernel: 228,352 of the 232,448 opt-in bytes at 256, max_world 8)
WIDE_TILE_MAX_LOCAL_EXPERTS = 256
# Rows a local expert expects at the layer's capacity from which a layer runs 128 x 256 tiles. bf16, measured on
# H100 by adjacent pairs against 128 x 128 (docs/FINDINGS.md, megamoe_bf16_wide*_old_vs_new_a64160d.json): Qwen3-MoE
# 8192 tokens (512 rows) -13.5% balanced, -16% skewed; at 256 rows and fewer the wide tile's 3 stages (5 at
# 128 x 128) cost more than its A reuse saves: Qwen3-MoE 4096 +4%, DSv4-Flash 8192 (192 rows) +3.7%, 1024 +6%.
# W8A8 (one H100, by pairs against 128 x 128, megamoe_fp8_wide{,2}_old_vs_new_05b58a6.json) wins from 192 rows:
# Qwen3-MoE 8192 -10%, skewed -10%, 4096 (256 rows) -4.7%, skewed -6%, DSv4-Flash 8192 (192) -6.2%, skewed a tie;
# it loses where an expert has one tail tile or less: DSv4-Flash 4096 (96 rows) +3.3%, 1024 +3.1%, Qwen3-MoE 1024
# +2.5% (a tail tile's lone warpgroup promotes with the Tensor Cores idle). So: from one full M block expected.
WIDE_TILE_MIN_ROWS_PER_EXPERT = {"bf16": 384, "w8a8": 128}


def wide_tile_fits(precision: str, hidden: int, intermediate: int, num_local_experts: int) -> bool:
    """Whether the kernel can run a layer in 128 x 256 tiles: bf16 or W8A8 (W8A8 promotes each 128-wide half of
    the tile in turn through one half-width block accumulator, megamoe.fp8_mainloop; W4A8's conversion is laid
    out for 128-row weight blocks), hidden a multiple of 256 (2 * intermediate always is) and at most
    WIDE_TILE_MAX_LOCAL_EXPERTS local experts (shared memory)."""
    if precision not in ("bf16", "w8a8", "w4a8"):
        raise ValueError(f"precision must be bf16, w8a8 or w4a8, got {precision!r}")
    return (precision in ("bf16", "w8a8") and hidden % 256 == 0 and intermediate % 128 == 0
            and num_local_experts <= WIDE_TILE_MAX_LOCAL_EXPERTS)


def block_n_for(precision: str, hidden: int, intermediate: int, num_experts: int, top_k: int, world: int,
                max_tokens_per_rank: int) -> int:
    """The kernel's tile N for a layer: 256 where :func:`wide_tile_fits` and a local expert expects at least
    WIDE_TILE_MIN_ROWS_PER_EXPERT[precision] rows at the layer's capacity (world x max_tokens_per_rank x top_k /
    num_experts), else 128. A 128 x 256 tile reads one A block for twice the columns: 25% fewer L2-to-SM bytes
    per FLOP, the resource the mainloop is short of (docs/HISTORY.md 23), which pays where an expert has several
    M blocks to share its weights' reads (bf16), or at least one full one (W8A8, whose L2 promotions also
    halve: the intermediate's scale runs become 1 x 128)."""
    rows_per_expert = world * max_tokens_per_rank * top_k / num_experts
    wide = (wide_tile_fits(precision, hidden, intermediate, num_experts // world)
            and rows_per_expert >= WIDE_TILE_MIN_ROWS_PER_EXPERT[precision])
    return 256 if wide else BLOCK_N


def layer_shape(hidden: int, intermediate: int, precision: str, num_experts: int, top_k: int, world: int,
                max_tokens_per_rank: int) -> MoEShape:
    """The layer's shape with the tile the kernel uses (:func:`block_n_for`)."""
    return MoEShape(hidden, intermediate, block_n=block_n_for(precision, hidden, intermediate, num_experts, top_k,
                                                              world, max_tokens_per_rank))


def wave_order_ring_slots_needed(work: RankWork, experts_per_wave: int) -> int:
    """The fewest ring slots with which the wave order cannot deadlock: a wave's L1 rows must not wait for
    slots that only the same wave's L2 tiles (later in every stream) free, so the ring holds a whole wave."""
    return max((len(wave_rows(work, w)) for w in expert_waves(work, experts_per_wave)), default=0)


# --- the interleaved order: Algorithm 1 --------------------------------------------------------------------


def interleaved_scheduler(g: int, r: int, G: int, P: int, P_1: int, P_2: int, D: float,
                          raster=None) -> Iterator[tuple[str, int, int]]:
    """Algorithm 1, procedure Scheduler(g, r), line by line: yields (kind, p, n) for the CTA of role ``r`` in
    instance ``g``; the tile is <e(p), m = p - O_e(p), n>. Both CTAs of a pair walk the same cursors, so they
    emit the same rows with n = 2*(k mod P_i) + r. Integers only, so the kernel can mirror it exactly.

    ``raster(k, P_i)`` -> (row, pair, first row, last row of k's row group) maps a pair cursor to its tile
    (:meth:`RankWork.raster`); None is the paper's row-major map (k // P_i, k mod P_i, a group of one row).
    With row groups the lead compares whole groups: L2's group may start once its last row + D <= the first
    row of L1's group, which is line 6 when every group is one row."""
    if raster is None:
        def raster(k, units):
            return k // units, k % units, k // units, k // units
    k_1 = g
    k_2 = g  # line 2
    while k_1 < P * P_1 or k_2 < P * P_2:  # line 3
        row_1, pair_1, p_1, _ = raster(k_1, P_1) if k_1 < P * P_1 else (None, None, math.inf, None)  # line 4
        if k_2 < P * P_2:
            row_2, pair_2, _, p_2 = raster(k_2, P_2)  # line 5
        if k_2 < P * P_2 and p_2 + D <= p_1:  # line 6
            yield L2, row_2, 2 * pair_2 + r
            k_2 += G  # line 7
        else:  # lines 9-11
            yield L1, row_1, 2 * pair_1 + r
            k_1 += G


def d_knee(shape: MoEShape, k_sm: int) -> float:
    """Eq. 16: D_knee = b_n * K_SM / (2 * h_inter) scheduler rows, for ``k_sm`` participating SMs
    (calibrate.model.d_knee)."""
    return float(model.d_knee(shape.block_n, k_sm, shape.intermediate))


def d_lead(shape: MoEShape, k_sm: int) -> float:
    """The lead the kernel runs by default: eq. 16's knee times (1 + T_L2 / T_L1), T_L2 / T_L1 = intermediate /
    hidden (the two mainloops' K, same tile). Eq. 16 counts the rows one stride of every instance's L1 cursor
    spans, as if all instances advanced in lockstep; but an instance inside an L2 mainloop falls behind its
    peers by the L1 tiles they run meanwhile, T_L2 / T_L1 more strides of rows. Where L2 tiles are long (DiT-MoE:
    hidden 1152, intermediate 4608, 4x) the knee alone lets L2 spin: the simulator gives 2500 us against the
    wave order's 914 at D = ceil(1.83) = 2, and 914 at D = 10 (docs/FINDINGS.md, megamoe_lead)."""
    return d_knee(shape, k_sm) * (1.0 + shape.intermediate / shape.hidden)


def d_knee_from_profile(shape: MoEShape, profile, k_sm: int | None = None) -> float:
    """Eq. 16 on a platform profile (calibrate.profile.PlatformProfile): K_SM is ``k_sm`` or the profile's SM
    count. The knee contains no X-Stage parameter (T_iss0, R, Q): it comes from cross-SM data readiness."""
    return d_knee(shape, profile.sm_count if k_sm is None else k_sm)


def interleaved_order(work: RankWork, num_ctas: int, lead: float | None = None, m_group: int = 1) -> Schedule:
    """The interleaved order of Algorithm 1 on a grid of ``num_ctas`` CTAs (even): G = num_ctas / 2 instances,
    CTA c = 2g + r. ``lead`` is D in rows; None takes D_knee (eq. 16) with K_SM = num_ctas. A pair slot whose
    n is past the last N block (odd N-block count, role r = 1) is skipped, with the cursors unchanged.
    ``m_group``: the cursors walk :meth:`RankWork.raster`'s row groups (1: Algorithm 1's row-major walk)."""
    if num_ctas <= 0 or num_ctas % 2:
        raise ScheduleError(f"the interleaved order runs CTA pairs: num_ctas must be even and > 0, got {num_ctas}")
    G = num_ctas // 2
    D = d_knee(work.shape, num_ctas) if lead is None else float(lead)
    P, P_1, P_2 = work.num_rows, work.shape.pairs_per_row(L1), work.shape.pairs_per_row(L2)

    def raster(k, units):
        return work.raster(0, k, units, m_group, k, G)

    streams = []
    for c in range(num_ctas):
        g, r = divmod(c, 2)
        stream = []
        for kind, p, n in interleaved_scheduler(g, r, G, P, P_1, P_2, D, raster):
            if n < work.shape.n_blocks(kind):
                e, m = work.rows[p]
                stream.append(Tile(kind, e, m, n))
        streams.append(tuple(stream))
    return Schedule("interleaved", tuple(streams), {"G": G, "D": D, "P": P, "P_1": P_1, "P_2": P_2,
                                                    "m_group": m_group})


# --- checks ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScheduleCheck:
    """What :func:`check_schedule` proved: tile counts per kind and the dependency edges it ordered."""

    l1_tiles: int
    l2_tiles: int
    ring_slots: int | None
    edges: int


def check_tiles(work: RankWork, schedule: Schedule) -> None:
    """Every tile of ``work`` exactly once across the streams, nothing else; raises ScheduleError naming them."""
    expected = set(work.tiles())
    seen: dict[Tile, tuple[int, int]] = {}
    for c, stream in enumerate(schedule.streams):
        for i, tile in enumerate(stream):
            if tile in seen:
                raise ScheduleError(f"{schedule.order}: {tile} appears twice (CTA {seen[tile][0]} position "
                                    f"{seen[tile][1]} and CTA {c} position {i})")
            if tile not in expected:
                raise ScheduleError(f"{schedule.order}: CTA {c} position {i} holds {tile}, which is no tile of "
                                    f"this rank's work")
            seen[tile] = (c, i)
    missing = expected - seen.keys()
    if missing:
        raise ScheduleError(f"{schedule.order}: {len(missing)} tile(s) never scheduled, e.g. "
                            f"{', '.join(map(str, sorted(missing)[:4]))}")


def check_schedule(work: RankWork, schedule: Schedule, ring_slots: int | None = None) -> ScheduleCheck:
    """Prove the streams are a complete, deadlock-free order: every tile exactly once (:func:`check_tiles`), and
    program order within each CTA plus the dependencies (L1 row -> its L2 tiles; L2 of row p - ring_slots ->
    L1 of row p) form no cycle, so every CTA that waits on an unmet dependency is eventually released, for any
    tile durations. Raises ScheduleError with the cycle otherwise."""
    check_tiles(work, schedule)
    if ring_slots is not None and ring_slots <= 0:
        raise ScheduleError(f"ring_slots must be > 0 or None, got {ring_slots}")
    # Nodes: tiles, plus two per row: "row p's L1 done" and "row p's L2 done" (a join, so edges stay linear).
    l1_done = {p: ("L1 done", p) for p in range(work.num_rows)}
    l2_done = {p: ("L2 done", p) for p in range(work.num_rows)}
    succ: dict[object, list] = {}
    indeg: dict[object, int] = {}

    def edge(a, b):
        succ.setdefault(a, []).append(b)
        indeg[b] = indeg.get(b, 0) + 1
        indeg.setdefault(a, indeg.get(a, 0))

    for stream in schedule.streams:
        for a, b in zip(stream, stream[1:]):
            edge(a, b)
    for p in range(work.num_rows):
        for t in work.row_tiles(L1, p):
            edge(t, l1_done[p])
        for t in work.row_tiles(L2, p):
            edge(l1_done[p], t)
            edge(t, l2_done[p])
        if ring_slots is not None and p + ring_slots < work.num_rows:
            for t in work.row_tiles(L1, p + ring_slots):
                edge(l2_done[p], t)
    for node in list(l1_done.values()) + list(l2_done.values()) + work.tiles():
        indeg.setdefault(node, 0)
    ready = deque(n for n, d in indeg.items() if d == 0)
    left = dict(indeg)
    done = 0
    while ready:
        node = ready.popleft()
        done += 1
        for nxt in succ.get(node, ()):
            left[nxt] -= 1
            if left[nxt] == 0:
                ready.append(nxt)
    if done < len(left):
        raise ScheduleError(f"{schedule.order}: the streams deadlock (ring_slots={ring_slots}; a -> b: a before b): "
                            f"{_describe_cycle(work, schedule, succ, left)}")
    return ScheduleCheck(len(work.tiles(L1)), len(work.tiles(L2)), ring_slots, sum(map(len, succ.values())))


def _describe_cycle(work, schedule, succ, left) -> str:
    """One cycle among the nodes Kahn's algorithm could not order, as 'a -> b -> ... -> a'."""
    stuck = {n for n, d in left.items() if d > 0}
    pred = {}
    for a, outs in succ.items():
        for b in outs:
            if a in stuck and b in stuck:
                pred.setdefault(b, a)
    where = {t: (c, i) for c, s in enumerate(schedule.streams) for i, t in enumerate(s)}
    node, path, index = next(iter(stuck)), [], {}
    while node not in index:
        index[node] = len(path)
        path.append(node)
        node = pred[node]
    cycle = path[index[node]:][::-1]

    def name(n):
        if isinstance(n, Tile):
            c, i = where[n]
            return f"{n}@CTA{c}[{i}]"
        e, m = work.rows[n[1]]
        return f"row {n[1]} (e={e},m={m}) {n[0]}"

    shown = [name(n) for n in cycle[:8]] + (["..."] if len(cycle) > 8 else [])
    return " -> ".join(shown + [name(cycle[0])])
