"""``schedule="auto"``: wave or interleaved from the model, decided once per layer shape and token count.

The rule (issue 30, item 5): replay both orders with ``megamoe.simulate`` on the routing histogram expected at
launch (every local expert at the mean rows, T * top_k * P / E: known without a host sync, the same for every
routing of that token count) with measured tile costs, and take the order predicted at least ``AUTO_MARGIN``
faster. The costs fold each tile's exposed epilogue into its mainloop. With local stores (one GPU, or P ranks
emulated on one) X-stage backpressure plays no part and what the replay sees is the dependency waits and the
waves' ragged ends.

Where neither replay is ``AUTO_MARGIN`` faster, ``tie_break`` decides: wave for bf16, interleaved for W8A8 and
W4A8. On the current kernel's grids (bfa38e6: ``megamoe_grid{,1024}_bfa38e6.json``) and the W4A8 matrix
(``megamoe_matrix_w4a8_f3649cd.json``: 7 models x 2 routings x 4096/8192 tokens x world 1 and emulated 2) the
regret is at most 0.9% / 2.8% (1024 tokens) for bf16, 2.9% / 2.0% for W8A8 and 2.0% for W4A8
(``megamoe_auto_regret_*_f3649cd.json``; the margin and the bf16 tie-break were chosen on these same files:
docs/FINDINGS.md, megamoe auto tie-break). History below.

Earlier evaluations (``python -m benchmarks.megamoe_auto RESULT.json [--dtype fp8]``) on the staged-epilogue kernel's
grid (``megamoe_grid_916b5e8.json``: 3 shapes x 1024/4096/8192 tokens x balanced/skewed x world 1 and emulated
2, one H200): the regret of its pick against the better measured order is at most 3.7% for bf16 (mean 0.4%;
always-wave 27%, always-interleaved 9.9%) and 1.4% for W8A8 (mean 0.2%; always-interleaved 1.1%)
(``megamoe_auto_regret_{bf16,fp8}_916b5e8.json``). The bf16 worst rows are near ties the replay cannot see
(Qwen3-MoE at 1024 tokens, P = 2: 3.7%; DiT-MoE at 8192, world 1: 3.4%). The first call of a token bucket
replays both orders on the host (up to ~1 s at DSv4-Flash's 256 experts); later calls reuse the decision.
On the grid after the W8A8 promotion units (``megamoe_grid_c19b293.json``) the bf16 regret is still at most
3.7%, W8A8's 5.7% (mean 0.9%; always-interleaved 4.7%): the replay below still costs W8A8 at twice the bf16
rate and picks wave at emulated P = 2 DiT-MoE, where interleaved is now 4-6% faster (refitting these costs
to the new kernel is open work: issue 30). After the tail drain (``megamoe_grid_bd00a6a.json`` with its 1024-token
companion) the regret is 4.5% / 5.0% (1024 tokens) for bf16 and 8.1% / 1.3% for W8A8, the worst rows emulated
P = 2 DiT-MoE again; the dump's W8A8 rates (1.78x / 1.56x bf16, epilogues 0.9 / 0.4 us) in place of these costs
flip no pick there: the replay predicts wave 3.5% faster where interleaved measures 2-8% faster. With the
margin at 5% (below) such near-ties go to the tie-break: W8A8 max regret 1.3% (1.5% at 1024 tokens), bf16
unchanged (``megamoe_auto_regret{,1024}_{bf16,fp8}_m05_bd00a6a.json``).
"""
from __future__ import annotations

import functools
import math

from megamoe import schedule as sched

# The replay's predicted interleaved / wave ratio missed the measured one by up to ~0.1 on the bd00a6a grid (DiT-MoE:
# 0.68 against 0.77-0.79 at 1024 tokens; 1.04 against 0.93 at emulated P = 2, 8192, W8A8), so it decides only a
# predicted gain of a few percent (bd00a6a, at 1%: W8A8 max regret 8.1%; at 5%: 1.3%). 3.5% since f3649cd: the
# same bf16 and W8A8 worst rows on the bfa38e6 grids as 5%, and W4A8's emulated P = 2 DiT-MoE at 8192 tokens
# (predicted wave 3.7% faster, measured 3.0-3.3%) decided (W4A8 max regret 3.3% -> 2.0%; docs/FINDINGS.md)
AUTO_MARGIN = 0.035
# This kernel's bf16 tile costs on one H200 (147e2d5, megamoe_dump_P2_147e2d5_summary.json): the mainloops run
# at ~671 TFLOP/s over 132 SMs (DSv4-Flash L2 tiles: 13.2 us for 2 * 128 * 128 * 2048 FLOP); the epilogues,
# which the MMA warpgroups run themselves, about 1.0 us (L1: SwiGLU, intermediate stores, the counter) and
# 3.4 us (L2: staging plus the Combine's stores, T_RS 2.5-3.4 us). Kept after the staged epilogue (cb8aea6):
# the costs measured then (~720 TFLOP/s bf16, W8A8 1.35x, epilogues 0.9 / 0.3 us) picked worse on the 916b5e8
# grid (W8A8 max regret 6.8% against 1.4%; docs/FINDINGS.md, megamoe auto costs).
MMA_TFLOPS_PER_SM = 671.0 / 132
L1_EPILOGUE_US = 1.0
L2_EPILOGUE_US = 3.4


def tile_costs(shape: sched.MoEShape, precision: str = "bf16"):
    from megamoe.simulate import TileCosts

    rate = MMA_TFLOPS_PER_SM * (1.0 if precision == "bf16" else 2.0)  # W8A8, W4A8: FP8 WGMMA
    base = TileCosts.from_throughput(shape, rate)
    return TileCosts(base.t_mma_l1_us + L1_EPILOGUE_US, base.t_mma_l2_us + L2_EPILOGUE_US)


@functools.lru_cache(maxsize=256)
def predicted_makespans(hidden: int, intermediate: int, num_experts: int, top_k: int, world: int, tokens: int,
                        grid: int, precision: str = "bf16") -> dict:
    """Both orders' replayed makespans (us) for one rank at the expected histogram of ``tokens`` per rank."""
    from calibrate import profile as prof
    from megamoe import simulate as sim

    shape = sched.MoEShape(hidden, intermediate)
    local = num_experts // world
    mean = tokens * top_k * world / num_experts
    work = sched.RankWork(shape, (int(round(mean)),) * local)
    costs = tile_costs(shape, precision)
    profile = prof.load_builtin(prof.default_profile_name())
    epw = sched.expert_wave_size(local, mean, shape.l1_n_blocks, shape.block_m, grid)
    lead = math.ceil(sched.d_lead(shape, grid))
    if work.num_rows == 0:
        return {"wave": 0.0, "interleaved": 0.0}
    groups = sched.row_group_size(precision)  # the walk the kernel runs
    return {"wave": sim.simulate(work, sched.expert_wave_order(work, grid, epw, m_group=groups), costs, profile,
                                 1).makespan_us,
            "interleaved": sim.simulate(work, sched.interleaved_order(work, grid, lead, m_group=groups), costs,
                                        profile, 1).makespan_us}


def tie_break(precision: str, world: int) -> str:
    """The order taken when neither replay is ``margin`` faster (one H200, local stores): wave for bf16 (at
    world > 1 the ranks' doubled weight traffic made it up to 10% faster at 916b5e8; since the bf16 row-group
    walk, bfa38e6, also at world 1: up to 7.7% at DiT-MoE 8192 tokens, where the replay sees a tie), else
    interleaved (W8A8 and W4A8: within 2.9% of the better order wherever the replay ties). ``world`` stays in the
    signature for the multi-GPU issue's refit."""
    return "wave" if precision == "bf16" else "interleaved"


def choose_schedule(hidden: int, intermediate: int, num_experts: int, top_k: int, world: int, tokens: int,
                    grid: int, precision: str = "bf16", margin: float = AUTO_MARGIN) -> str:
    """The order whose replay is at least ``margin`` faster than the other's, else ``tie_break``'s."""
    m = predicted_makespans(hidden, intermediate, num_experts, top_k, world, tokens, grid, precision)
    if m["interleaved"] < (1.0 - margin) * m["wave"]:
        return "interleaved"
    if m["wave"] < (1.0 - margin) * m["interleaved"]:
        return "wave"
    return tie_break(precision, world)


def token_bucket(tokens: int) -> int:
    """The token count a decision is cached under: rounded up to a multiple of 256 (a decision per bucket,
    not per count, keeps the replays off a serving loop's path after warm-up)."""
    return max(256, -(-tokens // 256) * 256)
