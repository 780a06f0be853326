"""``schedule="auto"``: wave or interleaved from the model, per launch, from the routing histogram.

The rule (issue 30, item 5). Replay both orders with ``megamoe.simulate`` on the routing histogram (rows per local
expert: the previous call's, which ``megamoe.api`` copies to the host without a sync; the expected one, every
expert at T * top_k * P / E rows, before the first call) with the measured tile costs below, and turn the
replayed ratio into a predicted gain of interleaving with a locality cost:

    ln(T_wave / T_interleaved) = a * ln(replayed T_wave / T_interleaved) + b - c * L,
    L = (one expert's weight bytes at this precision) * (ranks that share the GPU's L2) / L2 bytes,

interleaved where the gain is positive. The replay carries eq. (14)'s X-stage backpressure (from the platform
profile), the dependency waits and the waves' ragged ends; with local stores (one GPU, or P ranks emulated on one)
backpressure plays no part. ``L`` is the locality cost: interleaving keeps a wave's Linear-2 weights and the next
wave's Linear-1 weights in flight together, and P ranks emulated on one GPU share its L2 (``a`` < 1: the replay
over-predicts order effects the kernel's latency hiding absorbs; ``b``: what interleaving gains where the replay
sees a tie).

``FITS``: least squares of the measured ln(T_wave / T_int) on the two terms, over the bf16 and W8A8 matrix
at 87d2fbe (``megamoe_matrix_bf16_w8a8_87d2fbe.json``: 7 models x balanced / skewed x 4096 / 8192 tokens x world
1 and emulated 2, one H200); W4A8 takes the FP8 fit (the same FP8 mainloop; only its weight bytes differ). Max
regret against the better measured order (``python -m benchmarks.megamoe_auto``; ``megamoe_auto_regret_hist_*``):
on that matrix (in-sample) bf16 2.4%, W8A8 3.7%; on its replicate at 024f989 (80 configurations, another run and
the kernel after the walk change) 3.8% / 2.8%; on the W4A8 matrix (f3649cd, not fitted on) 2.0%; on the bfa38e6
grids 2.9% / 2.9% (0.8% / 3.7% at 1024 tokens). Four of those 320 evaluations are past 3%, at 3.6-3.8%: the
measured ratio itself moved by up to 3.8% between the two matrix runs (median 0.9%). The rule it replaced (the
replay at the expected histogram, a 3.5% margin, ties to wave for bf16) was 10.7% / 11.5% behind in bf16 on the
two matrix runs (docs/FINDINGS.md, MegaMoE, "auto from the routing histogram").
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from megamoe import schedule as sched

# This kernel's bf16 tile costs on one H200 (147e2d5, megamoe_dump_P2_147e2d5_summary.json): the mainloops run
# at ~671 TFLOP/s over 132 SMs (DSv4-Flash L2 tiles: 13.2 us for 2 * 128 * 128 * 2048 FLOP); the epilogues,
# which the MMA warpgroups run themselves, about 1.0 us (L1: SwiGLU, intermediate stores, the counter) and
# 3.4 us (L2: staging plus the Combine's stores, T_RS 2.5-3.4 us). Re-measured costs picked worse before the
# fit absorbed the replay's scale (docs/FINDINGS.md, megamoe auto costs); the fit below is on these.
MMA_TFLOPS_PER_SM = 671.0 / 132
L1_EPILOGUE_US = 1.0
L2_EPILOGUE_US = 3.4
L2_BYTES = 50 * 2**20  # the H200's 50 MiB (the fit's; the API passes the device's own L2 size)
WEIGHT_BYTES = {"bf16": 2.0, "w8a8": 1.0, "w4a8": 0.5}  # per weight element as the kernel reads it from HBM


@dataclass(frozen=True)
class AutoFit:
    replay: float  # a: weight of the replayed ln ratio
    bias: float  # b: interleaving's gain where the replay sees a tie
    locality: float  # c: cost per L2-full of one expert's weights times the ranks sharing the L2


# fitted on megamoe_matrix_bf16_w8a8_87d2fbe.json (module docstring); W4A8 runs W8A8's FP8 mainloop
FITS = {"bf16": AutoFit(0.7025, 0.0149, 0.0344), "w8a8": AutoFit(0.9303, 0.0505, 0.0537)}
FITS["w4a8"] = FITS["w8a8"]


def tile_costs(shape: sched.MoEShape, precision: str = "bf16"):
    from megamoe.simulate import TileCosts

    rate = MMA_TFLOPS_PER_SM * (1.0 if precision == "bf16" else 2.0)  # W8A8, W4A8: FP8 WGMMA
    base = TileCosts.from_throughput(shape, rate)
    return TileCosts(base.t_mma_l1_us + L1_EPILOGUE_US, base.t_mma_l2_us + L2_EPILOGUE_US)


def expected_rows(num_experts: int, top_k: int, world: int, tokens: int) -> tuple[int, ...]:
    """Rows per local expert when routing is balanced: T * top_k * P / E each."""
    local = num_experts // world
    return (int(round(tokens * top_k * world / num_experts)),) * local


@functools.lru_cache(maxsize=256)
def predicted_makespans(hidden: int, intermediate: int, num_experts: int, top_k: int, world: int, tokens: int,
                        grid: int, precision: str = "bf16", rows_per_expert: tuple[int, ...] | None = None) -> dict:
    """Both orders' replayed makespans (us) for one rank: ``rows_per_expert`` (its local experts' rows; None:
    ``expected_rows``)."""
    from calibrate import profile as prof
    from megamoe import simulate as sim

    # the tile a layer built for this token count runs (a larger layer's wide bf16 tile is a per-tile constant
    # the orders share: it scales both makespans alike)
    shape = sched.layer_shape(hidden, intermediate, precision, num_experts, top_k, world, tokens)
    rows = expected_rows(num_experts, top_k, world, tokens) if rows_per_expert is None else tuple(rows_per_expert)
    if len(rows) != num_experts // world:
        raise ValueError(f"rows_per_expert has {len(rows)} entries, this rank has {num_experts // world} experts")
    work = sched.RankWork(shape, rows)
    if work.num_rows == 0:
        return {"wave": 0.0, "interleaved": 0.0}
    costs = tile_costs(shape, precision)
    profile = prof.load_builtin(prof.default_profile_name())
    epw = sched.expert_wave_size(len(rows), sum(rows) / len(rows), shape.l1_n_blocks, shape.block_m, grid)
    lead = math.ceil(sched.d_lead(shape, grid))
    groups = sched.row_group_size(precision)  # the walk the kernel runs
    return {"wave": sim.simulate(work, sched.expert_wave_order(work, grid, epw, m_group=groups), costs, profile,
                                 1).makespan_us,
            "interleaved": sim.simulate(work, sched.interleaved_order(work, grid, lead, m_group=groups), costs,
                                        profile, 1).makespan_us}


def locality_cost(hidden: int, intermediate: int, precision: str, ranks_per_gpu: int = 1,
                  l2_bytes: float = L2_BYTES) -> float:
    """L: one expert's three weight matrices (gate, up, down) at the precision's bytes, times the ranks sharing
    the L2, over the L2's bytes."""
    return 3.0 * hidden * intermediate * WEIGHT_BYTES[precision] * ranks_per_gpu / l2_bytes


def predicted_gain(hidden: int, intermediate: int, num_experts: int, top_k: int, world: int, tokens: int,
                   grid: int, precision: str = "bf16", rank_rows=None, ranks_per_gpu: int = 1,
                   l2_bytes: float = L2_BYTES) -> float:
    """The predicted ln(T_wave / T_interleaved) (> 0: interleaving pays); the module docstring's formula.
    ``rank_rows``: the histograms (rows per local expert) of the ranks the decision covers, one per rank (a
    real rank its own; emulated ranks all of theirs); each order's makespan is the slowest rank's. None: one
    rank at ``expected_rows``."""
    if precision not in FITS:
        raise ValueError(f"precision must be one of {', '.join(FITS)}, got {precision!r}")
    hists = [None] if rank_rows is None else [tuple(r) for r in rank_rows]
    ms = [predicted_makespans(hidden, intermediate, num_experts, top_k, world, tokens, grid, precision, h)
          for h in hists]
    wave, inter = max(m["wave"] for m in ms), max(m["interleaved"] for m in ms)
    if wave <= 0.0 or inter <= 0.0:
        return 0.0
    fit = FITS[precision]
    return (fit.replay * math.log(wave / inter) + fit.bias
            - fit.locality * locality_cost(hidden, intermediate, precision, ranks_per_gpu, l2_bytes))


def choose_schedule(hidden: int, intermediate: int, num_experts: int, top_k: int, world: int, tokens: int,
                    grid: int, precision: str = "bf16", rank_rows=None, ranks_per_gpu: int = 1,
                    l2_bytes: float = L2_BYTES) -> str:
    """``schedule_for_gain`` of ``predicted_gain``."""
    return schedule_for_gain(predicted_gain(hidden, intermediate, num_experts, top_k, world, tokens, grid, precision,
                                            rank_rows, ranks_per_gpu, l2_bytes))


def schedule_for_gain(gain: float) -> str:
    """"interleaved" where the predicted ln(T_wave / T_interleaved) is positive, else "wave"."""
    return "interleaved" if gain > 0.0 else "wave"


# schedule="auto"'s measured pick runs on the device (megamoe.trial): per decision key a slot of TRIAL_WORDS Int64
# that the kernel reads at entry and its last CTA updates, so the trial goes on inside replayed CUDA graphs. A
# key's first TRIAL_WARMUP launches run the rule's pick untimed (the chip reaches the load it will serve under:
# timed from its first eager launches, the 664e95b matrix's trial met a cool chip and picked wrong twice, docs/
# FINDINGS.md), then MEASURED_CALLS launches of each order alternate, each timed from its first CTA's entry to
# its last CTA's exit; the last one's CTA writes the order with the lower median. MEASURED_CALLS 8: a pick from
# each matrix configuration's first 8 graph trials, judged on its other trials, is within 1.2% / 2.1% / 0.4%
# (the 87d2fbe matrix, its 024f989 replicate, W4A8), none of 248 above 3%; from the first 4: 2.8% / 3.3% / 0.7%.
MEASURED_CALLS = 8
TRIAL_WARMUP = 16
# a slot's words: launches of its key so far, the decided order (0: none yet, else 1 + the order), the current
# launch's start (globaltimer ns), a spare, then MEASURED_CALLS times (ns) of each order (tile_stream.ORDERS')
TRIAL_LAUNCHES, TRIAL_DECIDED, TRIAL_START, TRIAL_TIMES = 0, 1, 2, 4
TRIAL_WORDS = TRIAL_TIMES + 2 * MEASURED_CALLS
TRIAL_SETTLE = TRIAL_WARMUP + 2 * MEASURED_CALLS  # launches of a key until its slot has decided


def trial_launch_order(launches: int, prior: int, decided: int = 0) -> int:
    """The order (tile_stream.ORDERS' value) that a key's launch runs when its slot has counted ``launches`` and
    holds ``decided``: the device side's rule (megamoe.trial.trial_order), mirrored for the tests."""
    if decided:
        return decided - 1
    if launches < TRIAL_WARMUP:
        return prior
    return prior ^ ((launches - TRIAL_WARMUP) % 2)


def read_trial(words, prior: int) -> dict:
    """A slot's words (TRIAL_WORDS integers) as: launches, prior, decided (None or the order's name), times_us
    (per order name, its samples so far)."""
    from megamoe.tile_stream import ORDERS

    names = {v: k for k, v in ORDERS.items()}
    w = [int(v) for v in words]
    timed = max(0, min(w[TRIAL_LAUNCHES] - TRIAL_WARMUP, 2 * MEASURED_CALLS))
    times = {}
    for o in (0, 1):
        count = (timed + (1 if o == prior else 0)) // 2  # the prior runs first in each pair
        base = TRIAL_TIMES + o * MEASURED_CALLS
        times[names[o]] = [t / 1e3 for t in w[base:base + count]]
    return {"launches": w[TRIAL_LAUNCHES], "prior": names[prior],
            "decided": names[w[TRIAL_DECIDED] - 1] if w[TRIAL_DECIDED] else None, "times_us": times}


def faster_measured(times_us: dict, prior: str | None = None) -> str:
    """The order whose measured times (per order name, a list each) have the lower median (the upper one of an
    even count), ties to ``prior``: the pick the kernel's trial writes (megamoe.trial.close_trial, mirrored),
    and what the regret tool's ``measured_pick_floor`` replays on a run's own trials."""
    med = {name: sorted(t)[len(t) // 2] for name, t in times_us.items()}
    return min(med, key=lambda name: (med[name], name != prior))


def token_bucket(tokens: int) -> int:
    """The token count a decision is cached under: rounded up to a multiple of 256 (a decision per bucket,
    not per count, keeps the replays off a serving loop's path after warm-up)."""
    return max(256, -(-tokens // 256) * 256)


def skew_class(rows_per_expert) -> int:
    """A histogram's class for the decision cache: round(2 log2(max / mean)), 0 for balanced routing (the
    matrix's balanced histograms: max / mean 1.02-1.30; its Zipf 1.2 ones: 2.8-54)."""
    rows = list(rows_per_expert)
    total = sum(rows)
    if total <= 0:
        return 0
    return max(0, round(2.0 * math.log2(max(rows) * len(rows) / total)))


def scaled_rows(rows_per_expert, from_tokens: int, to_tokens: int) -> tuple[int, ...]:
    """A histogram seen at ``from_tokens`` tokens per rank, rescaled to ``to_tokens`` (its shape kept)."""
    f = to_tokens / max(from_tokens, 1)
    return tuple(int(round(r * f)) for r in rows_per_expert)
