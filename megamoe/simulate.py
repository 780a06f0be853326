"""CPU replay of MegaMoE tile streams against the X-Stage Burst-Gap model (xstage-paper sections 3.2, 4.2, 5.2.3).

Each CTA of the persistent grid has an MMA role and an epilogue role joined by ``staging_slots`` accumulator /
staging slots (2: double buffering). The MMA runs its stream in order: a tile starts when a slot is free and
its dependencies are met (an L2 tile: every L1 N block of its row complete; an L1 tile: its dispatched tokens
ready and its ring slot free), and its mainloop lasts T_mma_L1 or T_mma_L2 (:class:`TileCosts`). The epilogue
takes finished tiles in order and keeps the slot until it is done: an L1 epilogue lasts ``l1_epilogue_us``; an
L2 epilogue spends ``l2_staging_us`` (the paper's fixed staging overhead) and then issues the tile's bf16 Combine
output, valid_m x b_n x 2 bytes, of which (world_size - 1) / world_size goes to peer ranks as remote stores.

All CTAs' remote stores share one fluid X-Stage (:class:`XStagePath`): outstanding volume q drains at R while
q > 0, each issuer injects at its backpressure-free rate V_t / T_iss0 while q < Q, and once q reaches the
effective capacity Q the issuers share R. This is the paper's fluid abstraction; for the cases the model
solves in closed form it gives eq. 3 (periodic aligned bursts) and eq. 7 (an isolated burst), which the tests
check against ``calibrate.model.t_iss`` / ``t_iss_isolated``; T_iss0, R and Q come from a profile.

Per L2 tile the replay reports the sender-visible remote-store span T_RS (staging plus issue: section 4.2's
T_iss0 + dT_iss plus fixed staging, dT_iss as eq. 4 / 13 price it), the critical-path stall predicted by eq. 15,
[T_RS - T_cover]+ with T_cover the successor's
mainloop in the same stream (``calibrate.model.critical_path_stall``), and the MMA-side wait for a free slot
at tile entry (the paper's tmem_empty measurement), plus dependency waits and the makespan. A replay that
stops with tiles left raises :class:`DeadlockError` naming what each CTA waits for.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from calibrate import model
from calibrate.design import MEGAMOE_MAINLOOPS_US
from calibrate.profile import load_builtin
from megamoe.schedule import (BF16_BYTES, L1, L2, MoEShape, RankWork, Schedule, ScheduleError, Tile, check_tiles,
                              d_knee, expert_wave_order, interleaved_order)

# The fluid's tolerances: volumes are ~1e3-1e7 bytes, times ~1e-1-1e5 us; a relative time resolution of 1e-12
# is a few float64 ulps, far below any modeled duration.
_EPS_BYTES = 1e-6
_TIME_RESOLUTION = 1e-12


class SimulationError(RuntimeError):
    """The replay could not finish: bad inputs, or more events than its bound (a runaway)."""


class DeadlockError(SimulationError):
    """Tiles are left but no CTA can make progress; the message names each blocked CTA's unmet dependency."""


@dataclass(frozen=True)
class TileCosts:
    """Per-tile times in us: full-tile mainloops (the paper's T_mma_L1 / T_mma_L2) and the epilogues' fixed parts."""

    t_mma_l1_us: float
    t_mma_l2_us: float
    l1_epilogue_us: float = 0.0
    l2_staging_us: float = 0.0

    def mainloop(self, kind: str) -> float:
        return self.t_mma_l1_us if kind == L1 else self.t_mma_l2_us

    @classmethod
    def paper_table2(cls, model_name: str, **epilogues) -> "TileCosts":
        """Table 2's full-tile mainloop medians (W8A8, skewed, 55,808 tokens, 8 GPUs) for one of its models
        (calibrate.design.MEGAMOE_MAINLOOPS_US: dit-moe, qwen3.5, hy3, mimo-v2.5, glm-5.2, dsv4-flash, dsv4-pro)."""
        t_l2, t_l1 = MEGAMOE_MAINLOOPS_US[model_name]
        return cls(t_mma_l1_us=t_l1, t_mma_l2_us=t_l2, **epilogues)

    @classmethod
    def from_throughput(cls, shape, tflops_per_sm: float, **epilogues) -> "TileCosts":
        """Mainloops from a per-SM MMA rate (TFLOP/s): a tile is 2 * b_m * b_n * K FLOP, K = hidden for L1 and
        intermediate for L2."""
        flop = 2.0 * shape.block_m * shape.block_n
        return cls(flop * shape.hidden / (tflops_per_sm * 1e6), flop * shape.intermediate / (tflops_per_sm * 1e6),
                   **epilogues)


# --- the X-Stage fluid ------------------------------------------------------------------------------------


class XStagePath:
    """One GPU's post-issue path as a fluid queue shared by every issuing CTA (all volumes in bytes, times in us).

    Every active issuer injects at the same rate (``floor_rate`` while q < Q, an equal share of R while q = Q),
    so issuers are served like processor sharing: ``service`` is the bytes each active issuer has injected since
    t = 0, and an issuer finishes when its own share reaches the service it started at plus its volume."""

    def __init__(self, drain_rate: float, capacity_bytes: float, floor_rate: float, remote_fraction: float):
        if not (drain_rate > 0 and floor_rate > 0 and capacity_bytes >= 0 and 0 <= remote_fraction <= 1):
            raise SimulationError(f"bad X-Stage parameters: R={drain_rate}, Q={capacity_bytes}, "
                                  f"floor rate={floor_rate}, remote fraction={remote_fraction}")
        self.drain_rate, self.capacity = float(drain_rate), float(capacity_bytes)
        self.floor_rate, self.remote_fraction = float(floor_rate), float(remote_fraction)
        self.now = 0.0
        self.outstanding = 0.0  # q
        self.service = 0.0
        self._issuers: list = []  # heap of (service at which it finishes, seq, tag)
        self._seq = 0

    @classmethod
    def from_profile(cls, profile, producers: int, tile_bytes: float, remote_fraction: float) -> "XStagePath":
        """R and Q(K) from the profile; the floor rate V_t / T_iss0(K, K*V_t) of ``producers`` CTAs each issuing
        one ``tile_bytes`` tile (a partial tile issues proportionally faster)."""
        t_iss0 = float(profile.t_iss0(producers, producers * tile_bytes))
        return cls(profile.drain_rate, float(profile.capacity(producers)), tile_bytes / t_iss0, remote_fraction)

    @property
    def active(self) -> int:
        return len(self._issuers)

    def _rates(self) -> tuple[float, float]:
        """(per-issuer injection rate, dq/dt) in the current state."""
        n, f, rate = len(self._issuers), self.remote_fraction, self.drain_rate
        inflow = n * f * self.floor_rate
        if n and f > 0 and self.outstanding >= self.capacity - _EPS_BYTES and inflow > rate:
            return rate / (n * f), 0.0  # at capacity: the issuers share the drain
        growth = inflow - rate if (self.outstanding > 0 or inflow > rate) else 0.0
        return self.floor_rate, growth

    def next_event(self) -> float:
        """When the next issuer finishes or q reaches Q, whichever is first (inf if neither is pending)."""
        if not self._issuers:
            return math.inf
        rate, growth = self._rates()
        t = self.now + max(self._issuers[0][0] - self.service, 0.0) / rate
        if growth > 0:
            t = min(t, self.now + (self.capacity - self.outstanding) / growth)
        return t

    def advance(self, t: float) -> list:
        """Move to time ``t`` (never past :meth:`next_event`); returns the tags of the issuers that finished."""
        dt = t - self.now
        if dt < -1e-9:
            raise SimulationError(f"X-Stage moved backwards: {self.now} -> {t}")
        dt = max(dt, 0.0)
        # Events closer than the time resolution at t count as reached, so the replay always progresses.
        resolution = _TIME_RESOLUTION * max(1.0, abs(t))
        rate, growth = self._rates()
        self.service += rate * dt
        if growth > 0 and self.capacity - self.outstanding <= growth * (dt + resolution):
            self.outstanding = self.capacity  # q reached Q: from here the issuers share R
        else:  # clamped at 0: once empty, q stays 0 while the inflow is below R
            self.outstanding = min(max(self.outstanding + growth * dt, 0.0), self.capacity)
        self.now = max(self.now, t)
        done = []
        while self._issuers and self._issuers[0][0] - self.service <= _EPS_BYTES + rate * resolution:
            done.append(heapq.heappop(self._issuers)[2])
        return done

    def add(self, volume_bytes: float, tag) -> None:
        """An issuer starts a burst of ``volume_bytes`` now (call :meth:`advance` to now first)."""
        self._seq += 1
        heapq.heappush(self._issuers, (self.service + float(volume_bytes), self._seq, tag))


def periodic_burst_issue_times(path: XStagePath, producers: int, bytes_per_producer: float, gap_us: float,
                               periods: int) -> list[float]:
    """Replay the microbenchmark's aligned periodic bursts on ``path``: ``producers`` issuers start together,
    each issues ``bytes_per_producer``, and all start again ``gap_us`` after the burst's issue ends (the
    producer-side gap G); returns each period's sender-visible issue time T_iss."""
    times, start = [], path.now
    for _ in range(periods):
        path.advance(start)
        for k in range(producers):
            path.add(bytes_per_producer, k)
        left = producers
        while left:
            left -= len(path.advance(path.next_event()))
        times.append(path.now - start)
        start = path.now + gap_us
    return times


# --- the replay -------------------------------------------------------------------------------------------


@dataclass
class TileRecord:
    """One tile's timeline in the replay (us); issue_* and t_rs only for L2 tiles."""

    tile: Tile
    cta: int
    position: int
    mma_start: float = math.nan
    mma_end: float = math.nan
    epi_start: float = math.nan
    epi_end: float = math.nan
    issue_start: float = math.nan
    issue_end: float = math.nan
    staging_wait: float = 0.0  # MMA idle at tile entry waiting for a free accumulator / staging slot
    dependency_wait: float = 0.0  # then waiting for its data (L1 rows, dispatch, ring slot)
    cover_us: float | None = None  # T_cover: the successor's mainloop in this stream (None: last tile)

    @property
    def t_rs(self) -> float:
        """Sender-visible remote-store span: fixed staging plus issue (epilogue start to end)."""
        return self.epi_end - self.epi_start

    @property
    def eq15_stall(self) -> float | None:
        """Eq. 15's predicted critical-path stall [T_RS - T_cover]+ (None for a stream's last tile)."""
        return None if self.cover_us is None else float(model.critical_path_stall(self.t_rs, self.cover_us))


@dataclass
class SimResult:
    """The replay of one schedule: every tile's record (stream order per CTA) and the makespan."""

    order: str
    records: list[TileRecord]
    makespan_us: float
    params: dict = field(default_factory=dict)

    def of_kind(self, kind: str) -> list[TileRecord]:
        return [r for r in self.records if r.tile.kind == kind]

    def summary(self) -> dict:
        """Medians and totals (us) over L2 tiles: T_RS, eq. 15's stall, the MMA-side slot wait at L2 entry."""
        l2 = self.of_kind(L2)
        stalls = [r.eq15_stall for r in l2 if r.cover_us is not None]

        def stats(values, prefix):
            values = list(values)
            if not values:
                return {f"{prefix}_median": 0.0, f"{prefix}_mean": 0.0, f"{prefix}_p90": 0.0}
            return {f"{prefix}_median": statistics.median(values), f"{prefix}_mean": statistics.fmean(values),
                    f"{prefix}_p90": float(np.percentile(values, 90))}

        return {"order": self.order, "tiles": len(self.records), "l2_tiles": len(l2), "makespan_us": self.makespan_us,
                **stats((r.t_rs for r in l2), "t_rs"), **stats(stalls, "eq15_stall"),
                **stats((r.staging_wait for r in l2), "slot_wait"),
                "slot_wait_total_us": sum(r.staging_wait for r in self.records),
                "l2_dependency_wait_total_us": sum(r.dependency_wait for r in l2),
                "l1_dependency_wait_total_us": sum(r.dependency_wait for r in self.of_kind(L1)), **self.params}


def simulate(work: RankWork, schedule: Schedule, costs: TileCosts, profile, world_size: int, *,
             ring_slots: int | None = None, dispatch_ready_us=0.0, ring_refill_us: float = 0.0,
             staging_slots: int = 2, producers: int | None = None, max_events: int | None = None) -> SimResult:
    """Replay ``schedule`` (see the module docstring) and return every tile's timeline.

    ``profile``: a calibrate.profile.PlatformProfile (T_iss0, R, Q); ``producers`` (default: the grid) is the K
    its T_iss0(K, V) and Q(K) are read at. ``dispatch_ready_us``: when each row's dispatched tokens land, one
    number or one per row; a row past the first ``ring_slots`` also waits for its slot to free, plus
    ``ring_refill_us``. Raises DeadlockError if tiles are left with no CTA able to progress."""
    check_tiles(work, schedule)
    if world_size < 1 or staging_slots < 1 or (ring_slots is not None and ring_slots < 1):
        raise SimulationError(f"world_size, staging_slots and ring_slots must be >= 1 (got {world_size}, "
                              f"{staging_slots}, {ring_slots})")
    shape, streams = work.shape, schedule.streams
    n_ctas, n_rows = len(streams), work.num_rows
    try:
        ready_rows = np.broadcast_to(np.asarray(dispatch_ready_us, dtype=float), (n_rows,))
    except ValueError:
        raise SimulationError(f"dispatch_ready_us must be one number or one per row ({n_rows})") from None
    path = XStagePath.from_profile(profile, producers or n_ctas, shape.l2_tile_bytes, (world_size - 1) / world_size)
    limit = max_events or 20 * (work.num_tiles + n_ctas) + 1000

    records = {}
    for c, stream in enumerate(streams):
        for i, tile in enumerate(stream):
            nxt = stream[i + 1] if i + 1 < len(stream) else None
            records[tile] = TileRecord(tile, c, i, cover_us=None if nxt is None else costs.mainloop(nxt.kind))
    l1_left = [shape.l1_n_blocks] * n_rows
    l2_left = [shape.l2_n_blocks] * n_rows
    l1_done_at = [math.nan] * n_rows
    l2_done_at = [math.nan] * n_rows
    waiting_l1 = [[] for _ in range(n_rows)]  # CTAs whose next L2 tile waits for row p's L1 tiles
    waiting_slot = [[] for _ in range(n_rows)]  # CTAs whose next L1 tile waits for row p's ring slot

    position = [0] * n_ctas
    mma_busy = [False] * n_ctas
    idle_since = [0.0] * n_ctas
    slot_ok_at = [0.0] * n_ctas  # when a slot became free for the next tile (nan: none free yet)
    held = [0] * n_ctas  # slots in use: tiles started and not through their epilogue
    epi_queue = [deque() for _ in range(n_ctas)]
    epi_busy = [False] * n_ctas
    events: list = []
    seq = 0

    def push(t, what, c, tile=None):
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, what, c, tile))

    def data_ready_at(tile):
        """When the tile's data dependencies were met (nan: not yet known)."""
        p = work.row_of(tile)
        if tile.kind == L2:
            return l1_done_at[p]
        if ring_slots is None or p < ring_slots:
            return float(ready_rows[p])
        freed = l2_done_at[p - ring_slots]
        return max(float(ready_rows[p]), freed + ring_refill_us) if freed == freed else math.nan

    def try_start(c, now):
        if mma_busy[c] or position[c] == len(streams[c]) or held[c] >= staging_slots:
            return
        tile = streams[c][position[c]]
        ready = data_ready_at(tile)
        if ready != ready:
            p = work.row_of(tile)
            (waiting_l1[p] if tile.kind == L2 else waiting_slot[p - ring_slots]).append(c)
            return
        if ready > now:
            push(ready, "wake", c)
            return
        rec = records[tile]
        rec.staging_wait = slot_ok_at[c] - idle_since[c]
        rec.dependency_wait = now - slot_ok_at[c]
        rec.mma_start = now
        rec.mma_end = now + costs.mainloop(tile.kind)
        mma_busy[c] = True
        held[c] += 1
        position[c] += 1
        push(rec.mma_end, "mma_end", c, tile)

    def try_epilogue(c, now):
        if epi_busy[c] or not epi_queue[c]:
            return
        tile = epi_queue[c].popleft()
        epi_busy[c] = True
        records[tile].epi_start = now
        if tile.kind == L1:
            push(now + costs.l1_epilogue_us, "epi_end", c, tile)
        elif costs.l2_staging_us > 0:
            push(now + costs.l2_staging_us, "issue", c, tile)
        else:
            start_issue(c, tile, now)

    def start_issue(c, tile, now):
        records[tile].issue_start = now
        valid = work.valid_m(tile.expert, tile.m_block)
        path.add(valid * shape.block_n * BF16_BYTES, (c, tile))

    def wake(ctas, now):
        for c in ctas:
            try_start(c, now)
        ctas.clear()

    def epilogue_end(c, tile, now):
        rec = records[tile]
        rec.epi_end = now
        if tile.kind == L2:
            rec.issue_end = now
        epi_busy[c] = False
        held[c] -= 1
        if not mma_busy[c] and slot_ok_at[c] != slot_ok_at[c]:
            slot_ok_at[c] = now
        p = work.row_of(tile)
        if tile.kind == L1:
            l1_left[p] -= 1
            if not l1_left[p]:
                l1_done_at[p] = now
                wake(waiting_l1[p], now)
        else:
            l2_left[p] -= 1
            if not l2_left[p]:
                l2_done_at[p] = now
                wake(waiting_slot[p], now)
        try_epilogue(c, now)
        try_start(c, now)

    for c in range(n_ctas):
        try_start(c, 0.0)
    handled = 0
    while True:
        t = min(events[0][0] if events else math.inf, path.next_event())
        if t == math.inf:
            break
        for c, tile in path.advance(t):
            epilogue_end(c, tile, t)
        while events and events[0][0] <= t:
            _, _, what, c, tile = heapq.heappop(events)
            if what == "mma_end":
                mma_busy[c] = False
                idle_since[c] = t
                slot_ok_at[c] = t if held[c] < staging_slots else math.nan
                epi_queue[c].append(tile)
                try_epilogue(c, t)
                try_start(c, t)
            elif what == "epi_end":
                epilogue_end(c, tile, t)
            elif what == "issue":
                start_issue(c, tile, t)
            else:  # "wake": a row's dispatch time came
                try_start(c, t)
        handled += 1
        if handled > limit:
            raise SimulationError(f"{schedule.order}: more than {limit} events at t = {t:.3f} us: a runaway replay")

    left = [c for c in range(n_ctas) if position[c] < len(streams[c]) or epi_queue[c] or epi_busy[c]]
    if left:
        tiles_left = sum(len(s) - position[c] for c, s in enumerate(streams))
        blocked = "; ".join(_blocked(work, streams, records, position, c, ring_slots) for c in left[:6])
        raise DeadlockError(f"{schedule.order}: deadlock with {tiles_left} tile(s) left; {blocked}"
                            + (" ..." if len(left) > 6 else ""))
    makespan = max((r.epi_end for r in records.values()), default=0.0)
    ordered = [records[t] for stream in streams for t in stream]
    return SimResult(schedule.order, ordered, makespan, dict(schedule.params, world_size=world_size,
                                                             ring_slots=ring_slots, ctas=n_ctas))


def _blocked(work, streams, records, position, c, ring_slots) -> str:
    """What CTA ``c`` waits for: the unmet dependency of its next tile and where the missing tiles sit."""
    tile = streams[c][position[c]]
    p = work.row_of(tile)
    if tile.kind == L2:
        need, why = work.row_tiles(L1, p), f"row {p}'s L1 tiles"
    elif ring_slots is None:
        return f"CTA {c} at {tile} (position {position[c]}) waits for its dispatched tokens"
    else:
        need, why = work.row_tiles(L2, p - ring_slots), f"ring slot {p % ring_slots} (row {p - ring_slots}'s L2 tiles)"
    missing = [t for t in need if records[t].epi_end != records[t].epi_end]
    where = ", ".join(f"{t}@CTA{records[t].cta}[{records[t].position}]" for t in missing[:3])
    return f"CTA {c} at {tile} (position {position[c]}) waits for {why}: {len(missing)} not done, e.g. {where}"


def verify_trace(work: RankWork, result: SimResult, ring_slots: int | None = None, dispatch_ready_us=0.0,
                 staging_slots: int = 2) -> None:
    """Check a replay's timeline independently of the replay: each tile exactly once, each CTA's mainloops in
    stream order without overlap and at most ``staging_slots`` tiles between mainloop start and epilogue end,
    every L2 after all L1 N blocks of its row, every L1 after its dispatch and its ring slot's previous
    occupant's L2 tiles. Raises ScheduleError naming the first violation."""
    by_tile = {r.tile: r for r in result.records}
    if len(by_tile) != len(result.records) or set(by_tile) != set(work.tiles()):
        raise ScheduleError(f"{result.order}: the trace does not hold every tile exactly once")
    ready_rows = np.broadcast_to(np.asarray(dispatch_ready_us, dtype=float), (work.num_rows,))
    l1_end = [max(by_tile[t].epi_end for t in work.row_tiles(L1, p)) for p in range(work.num_rows)]
    l2_end = [max(by_tile[t].epi_end for t in work.row_tiles(L2, p)) for p in range(work.num_rows)]
    tol = 1e-9
    for rec in result.records:
        p = work.row_of(rec.tile)
        if not rec.mma_start <= rec.mma_end <= rec.epi_start + tol <= rec.epi_end + 2 * tol:
            raise ScheduleError(f"{result.order}: {rec.tile} has an out-of-order timeline {rec}")
        if rec.tile.kind == L2 and rec.mma_start < l1_end[p] - tol:
            raise ScheduleError(f"{result.order}: {rec.tile} starts at {rec.mma_start:.3f} us before row {p}'s L1 "
                                f"tiles complete at {l1_end[p]:.3f} us")
        if rec.tile.kind == L1:
            if rec.mma_start < ready_rows[p] - tol:
                raise ScheduleError(f"{result.order}: {rec.tile} starts before its dispatched tokens are ready")
            if ring_slots is not None and p >= ring_slots and rec.mma_start < l2_end[p - ring_slots] - tol:
                raise ScheduleError(f"{result.order}: {rec.tile} starts at {rec.mma_start:.3f} us before its ring "
                                    f"slot frees at {l2_end[p - ring_slots]:.3f} us")
    streams: dict[int, list[TileRecord]] = {}
    for rec in result.records:
        streams.setdefault(rec.cta, []).append(rec)
    for c, recs in streams.items():
        recs.sort(key=lambda r: r.position)
        for a, b in zip(recs, recs[1:]):
            if b.mma_start < a.mma_end - tol or b.epi_start < a.epi_end - tol:
                raise ScheduleError(f"{result.order}: CTA {c} runs {b.tile} before {a.tile} is out of its role")
        for a, b in zip(recs, recs[staging_slots:]):
            if b.mma_start < a.epi_end - tol:
                raise ScheduleError(f"{result.order}: CTA {c} starts {b.tile} with {staging_slots} slots still held")


# --- workloads and the two orders side by side -------------------------------------------------------------


def routed_tokens_per_expert(num_tokens: int, num_experts: int, top_k: int, rng: np.random.Generator,
                             skew: float = 0.0, chunk: int = 8192) -> np.ndarray:
    """Route ``num_tokens`` tokens to ``top_k`` distinct experts each; returns the rows per expert (sums to
    num_tokens * top_k). Expert popularity is Zipf-like, (1 + rank)^-skew over a random expert order (skew 0:
    balanced); each token draws its experts without replacement by Gumbel top-k on log popularity."""
    if not 1 <= top_k <= num_experts:
        raise ScheduleError(f"top_k must be in [1, num_experts = {num_experts}], got {top_k}")
    logw = -skew * np.log1p(rng.permutation(num_experts).astype(float))
    counts = np.zeros(num_experts, dtype=np.int64)
    for start in range(0, num_tokens, chunk):
        n = min(chunk, num_tokens - start)
        scores = logw + rng.gumbel(size=(n, num_experts))
        picks = np.argpartition(-scores, top_k - 1, axis=1)[:, :top_k]
        counts += np.bincount(picks.ravel(), minlength=num_experts)
    return counts


def rank_work(shape, counts: np.ndarray, world_size: int, rank: int | None = None) -> RankWork:
    """Rank ``rank``'s local experts (contiguous: rank r owns experts [r*E/P, (r+1)*E/P)); None: the busiest rank
    (most routed rows), the one that decides the layer's time."""
    counts = np.asarray(counts)
    if len(counts) % world_size:
        raise ScheduleError(f"{len(counts)} experts do not split over {world_size} ranks")
    per_rank = counts.reshape(world_size, -1)
    rank = int(np.argmax(per_rank.sum(axis=1))) if rank is None else rank
    return RankWork(shape, tuple(int(n) for n in per_rank[rank]))


def model_prediction(work: RankWork, costs: TileCosts, profile, world_size: int, producers: int) -> dict:
    """The closed-form steady state of section 4.2 (calibrate.model): eq. 4 at G_wave = T_mma_L2, eq. 13 with the
    tile mix n1/n2 = L1 / L2 N blocks per row, eq. 14, and eq. 15's stall with T_cover = the successor's mainloop
    (L2 in the wave order, L1 in the interleaved one). V = producers x V_t x (P-1)/P aligned remote bytes."""
    shape = work.shape
    volume = producers * shape.l2_tile_bytes * (world_size - 1) / world_size
    t0 = float(profile.t_iss0(producers, producers * shape.l2_tile_bytes))
    rate, n1_per_n2 = profile.drain_rate, shape.l1_n_blocks / shape.l2_n_blocks
    wave = float(model.issue_overhead(costs.t_mma_l2_us, volume, t0, rate))
    inter = float(model.interleaved_overhead(wave, costs.t_mma_l1_us, n1_per_n2))
    rs_wave = float(model.remote_store_span(t0, wave)) + costs.l2_staging_us
    rs_int = float(model.remote_store_span(t0, inter)) + costs.l2_staging_us
    return {"volume_bytes": volume, "t_iss0_us": t0, "n1_per_n2": n1_per_n2,
            "interleave_sufficient": bool(model.interleave_sufficient(volume, t0, costs.t_mma_l2_us,
                                                                      costs.t_mma_l1_us, rate, n1=n1_per_n2)),
            "wave_t_rs_us": rs_wave, "interleaved_t_rs_us": rs_int,
            "wave_stall_us": float(model.critical_path_stall(rs_wave, costs.t_mma_l2_us)),
            "interleaved_stall_us": float(model.critical_path_stall(rs_int, costs.t_mma_l1_us))}


def compare_orders(work: RankWork, costs: TileCosts, profile, world_size: int, num_ctas: int,
                   lead: float | None = None, experts_per_wave: int | None = None, **replay) -> dict:
    """Build both orders for ``work``, replay each, and return {"wave": summary, "interleaved": summary,
    "model": model_prediction, "d_knee": eq. 16 rows}."""
    orders = {"wave": expert_wave_order(work, num_ctas, experts_per_wave),
              "interleaved": interleaved_order(work, num_ctas, lead)}
    out = {name: simulate(work, s, costs, profile, world_size, **replay).summary() for name, s in orders.items()}
    out["model"] = model_prediction(work, costs, profile, world_size, replay.get("producers") or num_ctas)
    out["d_knee"] = d_knee(work.shape, num_ctas)
    return out


# --- the paper's shapes -------------------------------------------------------------------------------------

# (hidden, intermediate, experts, top-k): the two Table 2 models whose dimensions issue 28 names (the paper
# gives none); their mainloop times come from Table 2 (TileCosts.paper_table2).
PAPER_SHAPES = {"dit-moe": (1152, 4608, 8, 2), "dsv4-flash": (4096, 2048, 256, 6)}
# Table 2's setting: 55,808 tokens over 8 GPUs (read as the total, 6,976 per rank), EP = 8, 148 SMs.
PAPER_TOKENS, PAPER_WORLD, PAPER_CTAS = 55808, 8, 148


def paper_comparison(model_name: str, seed: int, skew: float = 1.0, tokens_per_rank: int = PAPER_TOKENS // PAPER_WORLD,
                     block_m: int = 128, l2_staging_us: float = 0.0, profile=None) -> dict:
    """Both orders at one of PAPER_SHAPES on the paper profile: seeded routing (skew 1: Zipf-like popularity),
    the busiest of the 8 ranks, 148 CTAs, D = D_knee; returns compare_orders' dict plus the rank's counts."""
    hidden, intermediate, experts, top_k = PAPER_SHAPES[model_name]
    counts = routed_tokens_per_expert(tokens_per_rank * PAPER_WORLD, experts, top_k, np.random.default_rng(seed), skew)
    work = rank_work(MoEShape(hidden, intermediate, block_m), counts, PAPER_WORLD)
    costs = TileCosts.paper_table2(model_name, l2_staging_us=l2_staging_us)
    out = compare_orders(work, costs, profile or load_builtin("paper"), PAPER_WORLD, PAPER_CTAS)
    out["tokens_per_expert"] = work.tokens_per_expert
    return out


def main(argv=None) -> int:
    """Print both orders' predictions at the paper's shapes (``python -m megamoe.simulate --help``)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m megamoe.simulate", description=main.__doc__)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--skew", type=float, default=1.0)
    parser.add_argument("--tokens-per-rank", type=int, default=PAPER_TOKENS // PAPER_WORLD)
    parser.add_argument("--block-m", type=int, default=128)
    parser.add_argument("--staging-us", type=float, default=0.0, help="fixed L2 staging overhead per tile")
    args = parser.parse_args(argv)
    print(f"seed={args.seed} skew={args.skew} tokens/rank={args.tokens_per_rank} block_m={args.block_m} "
          f"staging={args.staging_us} us (paper profile, EP={PAPER_WORLD}, {PAPER_CTAS} CTAs, D = D_knee)")
    for name in PAPER_SHAPES:
        out = paper_comparison(name, args.seed, args.skew, args.tokens_per_rank, args.block_m, args.staging_us)
        print(f"{name}: busiest rank {sum(out['tokens_per_expert'])} rows, D_knee {out['d_knee']:.3f}")
        for order in ("wave", "interleaved"):
            s = out[order]
            print(f"  {order:11} makespan {s['makespan_us']:9.1f} us  T_RS median {s['t_rs_median']:.2f} (p90 "
                  f"{s['t_rs_p90']:.2f})  eq.15 stall median {s['eq15_stall_median']:.2f} mean "
                  f"{s['eq15_stall_mean']:.3f}  slot wait mean {s['slot_wait_mean']:.3f}  L2 spin "
                  f"{s['l2_dependency_wait_total_us']:.0f} us")
        m = out["model"]
        print(f"  closed form: T_RS wave {m['wave_t_rs_us']:.2f} / interleaved {m['interleaved_t_rs_us']:.2f}, stall "
              f"{m['wave_stall_us']:.2f} / {m['interleaved_stall_us']:.2f} us (eq. 4, 13, 15)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
