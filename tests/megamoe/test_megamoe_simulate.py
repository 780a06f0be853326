"""The MegaMoE replay (megamoe/simulate.py): its X-Stage fluid against calibrate.model's closed forms, hand-timed
pipelines, every tile once with every dependency kept, deadlocks reported, and the paper's qualitative results.
Random inputs use the printed ``seed`` fixture."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from calibrate import model
from calibrate.profile import load_builtin
from megamoe.schedule import (L1, L2, MoEShape, RankWork, ScheduleError, check_schedule, d_knee, expert_wave_order,
                              interleaved_order, wave_order_ring_slots_needed)
from megamoe.simulate import (DeadlockError, SimulationError, TileCosts, XStagePath, paper_comparison,
                              periodic_burst_issue_times, rank_work, routed_tokens_per_expert, simulate, verify_trace)

PAPER = load_builtin("paper")
MEASURED = load_builtin("h200x2")
SHAPE = MoEShape(512, 256)
PAPER_NUMBERS = Path("/work/shared/paper/paper-numbers.json")


@pytest.mark.parametrize("profile, producers, bytes_per_producer", [(PAPER, 148, 32768), (MEASURED, 132, 16384)],
                         ids=["paper", "h200x2"])
@pytest.mark.parametrize("gap_us", [0.0, 1.0, 3.0, 5.0, 5.9, 6.1, 8.0, 20.0])
def test_fluid_periodic_bursts_follow_eq3(profile, producers, bytes_per_producer, gap_us):
    volume = producers * bytes_per_producer
    t_iss0 = float(profile.t_iss0(producers, volume))
    assert model.q_peak(volume, t_iss0, profile.drain_rate) <= profile.capacity(producers)  # eq. 3's regime
    path = XStagePath.from_profile(profile, producers, bytes_per_producer, remote_fraction=1.0)
    steady = periodic_burst_issue_times(path, producers, bytes_per_producer, gap_us, periods=80)[-1]
    assert steady == pytest.approx(float(model.t_iss(gap_us, volume, t_iss0, profile.drain_rate)), rel=1e-9)


@pytest.mark.parametrize("bytes_per_producer", [8192, 32768, 33792, 40000, 65536, 131072])
def test_fluid_isolated_burst_follows_eq7(bytes_per_producer):
    tile = 32768
    path = XStagePath.from_profile(PAPER, 148, tile, remote_fraction=1.0)
    issue = periodic_burst_issue_times(path, 148, bytes_per_producer, 1e6, periods=1)[0]
    t_iss0 = 0.76 * bytes_per_producer / tile  # the floor rate V_t / T_iss0 is the full tile's
    expected = float(model.t_iss_isolated(148 * bytes_per_producer, t_iss0, PAPER.drain_rate, PAPER.capacity(148)))
    assert issue == pytest.approx(expected, rel=1e-9)
    assert (issue > t_iss0 * (1 + 1e-9)) == (bytes_per_producer > 33792)  # the paper's knee: 33 KB per producer


def test_local_stores_never_backpressure():
    path = XStagePath.from_profile(PAPER, 148, 32768, remote_fraction=0.0)
    assert periodic_burst_issue_times(path, 148, 32768, 0.0, periods=20) == pytest.approx([0.76] * 20)
    with pytest.raises(SimulationError, match="bad X-Stage parameters"):
        XStagePath(0.0, 1.0, 1.0, 0.5)


def test_single_cta_pipeline_by_hand():
    # 1 expert, 128 tokens: L1 n = 0, 1 (10 us each), then L2 n = 0, 1 (5 us each); world 1: local stores, each
    # L2 epilogue issues its 32 KiB at the floor, 0.76 us.
    work = RankWork(MoEShape(256, 128), (128,))
    schedule = expert_wave_order(work, 1)
    assert [str(t) for t in schedule.streams[0]] == ["L1(e=0,m=0,n=0)", "L1(e=0,m=0,n=1)", "L2(e=0,m=0,n=0)",
                                                     "L2(e=0,m=0,n=1)"]
    costs = TileCosts(t_mma_l1_us=10.0, t_mma_l2_us=5.0)
    double = simulate(work, schedule, costs, PAPER, world_size=1)
    assert [r.mma_start for r in double.records] == pytest.approx([0, 10, 20, 25])
    assert [r.epi_end for r in double.records] == pytest.approx([10, 20, 25.76, 30.76])
    assert double.makespan_us == pytest.approx(30.76)
    assert [r.eq15_stall for r in double.records[2:]] == [0.0, None]  # 0.76 us span under a 5 us cover; last tile
    single = simulate(work, schedule, costs, PAPER, world_size=1, staging_slots=1)  # no double buffering
    assert [r.mma_start for r in single.records] == pytest.approx([0, 10, 20, 25.76])
    assert single.records[3].staging_wait == pytest.approx(0.76) and single.makespan_us == pytest.approx(31.52)
    staged = simulate(work, schedule, dataclasses.replace(costs, l2_staging_us=6.0), PAPER, world_size=1)
    assert [r.t_rs for r in staged.records[2:]] == pytest.approx([6.76, 6.76])  # staging + issue
    # One epilogue role: the second L2 epilogue queues behind the first, 25 + 2 x 6.76 us.
    assert staged.records[3].epi_start == pytest.approx(31.76) and staged.makespan_us == pytest.approx(38.52)


def small_cases(seed):
    """Seeded small works (zero-token experts and partial M blocks included), costs and grids."""
    rng = np.random.default_rng(seed)
    for _ in range(12):
        shape = MoEShape(128 * int(rng.integers(1, 5)), 64 * int(rng.integers(1, 7)), block_k=64)
        counts = tuple(int(n) * int(rng.random() < 0.8) for n in rng.integers(0, 500, int(rng.integers(1, 6))))
        costs = TileCosts(*(float(x) for x in rng.uniform(0.5, 12.0, 2)), l1_epilogue_us=float(rng.uniform(0, 2)),
                          l2_staging_us=float(rng.uniform(0, 3)))
        yield RankWork(shape, counts), costs, 2 * int(rng.integers(1, 9)), int(rng.integers(1, 9)), rng


def test_replay_runs_every_tile_once_and_keeps_every_dependency(seed):
    replays = 0
    for work, costs, num_ctas, world, rng in small_cases(seed):
        dispatch = rng.uniform(0, 30, work.num_rows)
        for schedule in (expert_wave_order(work, num_ctas), interleaved_order(work, num_ctas)):
            for ring in (None, work.num_rows + 1, max(wave_order_ring_slots_needed(work, work.num_experts), 1)):
                try:
                    check_schedule(work, schedule, ring_slots=ring)
                except ScheduleError:
                    continue  # an order this ring cannot hold: the deadlock test covers it
                result = simulate(work, schedule, costs, PAPER, world, ring_slots=ring, dispatch_ready_us=dispatch)
                assert sorted(r.tile for r in result.records) == sorted(work.tiles()), f"seed={seed}"
                verify_trace(work, result, ring_slots=ring, dispatch_ready_us=dispatch)
                assert result.makespan_us >= max([0.0, *(r.epi_end for r in result.records)]) - 1e-9
                replays += 1
    assert replays >= 40, f"seed={seed}: only {replays} replays ran"


def test_static_check_and_replay_agree_on_deadlock(seed):
    # check_schedule's cycle test (any timing) and the timed replay must agree: both deadlock or neither.
    outcomes = {True: 0, False: 0}
    for work, costs, num_ctas, world, rng in small_cases(seed):
        for lead in (0, 1, 3):
            for ring in (1, 2, 4, None):
                schedule = interleaved_order(work, num_ctas, lead) if rng.random() < 0.7 else \
                    expert_wave_order(work, num_ctas, int(rng.integers(1, work.num_experts + 1)))
                try:
                    check_schedule(work, schedule, ring_slots=ring)
                    static = False
                except ScheduleError:
                    static = True
                try:
                    simulate(work, schedule, costs, PAPER, world, ring_slots=ring)
                    replayed = False
                except DeadlockError:
                    replayed = True
                assert static == replayed, (work, schedule.order, lead, ring, f"seed={seed}")
                outcomes[static] += 1
    assert outcomes[True] and outcomes[False], f"seed={seed}: {outcomes}"


def test_deadlocks_name_the_unmet_dependency():
    work = RankWork(SHAPE, (300, 0, 129, 1, 128))
    costs = TileCosts(2.0, 1.0)
    with pytest.raises(DeadlockError, match="interleaved: deadlock .* waits for row 0's L1 tiles"):
        simulate(work, interleaved_order(work, 4, lead=0), costs, PAPER, 2)
    with pytest.raises(DeadlockError, match="wave: deadlock .* waits for ring slot 0 \\(row 0's L2 tiles\\)"):
        simulate(work, expert_wave_order(work, 4, experts_per_wave=5), costs, PAPER, 2, ring_slots=2)
    with pytest.raises(SimulationError, match="more than 10 events"):
        simulate(work, expert_wave_order(work, 4), costs, PAPER, 2, max_events=10)


def test_verify_trace_catches_violations(seed):
    work = RankWork(SHAPE, (300, 0, 129, 1, 128))
    result = simulate(work, interleaved_order(work, 4), TileCosts(3.0, 2.0), PAPER, 2, ring_slots=4)
    verify_trace(work, result, ring_slots=4)

    def broken(pick, **changes):
        records = [dataclasses.replace(r, **changes) if pick(r) else r for r in result.records]
        return dataclasses.replace(result, records=records)

    first_l2 = next(r for r in result.records if r.tile.kind == L2)
    with pytest.raises(ScheduleError, match="before row 0's L1 tiles complete"):
        verify_trace(work, broken(lambda r: r is first_l2, mma_start=0.0), ring_slots=4)
    late_l1 = next(r for r in result.records if r.tile.kind == L1 and work.row_of(r.tile) == 4)
    with pytest.raises(ScheduleError, match="before its ring slot frees"):
        verify_trace(work, broken(lambda r: r is late_l1, mma_start=0.0), ring_slots=4)
    with pytest.raises(ScheduleError, match="before its dispatched tokens"):
        verify_trace(work, result, ring_slots=4, dispatch_ready_us=1e6)
    with pytest.raises(ScheduleError, match="every tile exactly once"):
        verify_trace(work, dataclasses.replace(result, records=result.records[1:]))
    with pytest.raises(ScheduleError, match="slots still held"):
        verify_trace(work, result, ring_slots=4, staging_slots=1)


def test_drain_limited_wave_span_and_eq15(seed):
    # Consecutive L2 tiles on 148 CTAs with a 5.3 us mainloop inject 148 x 28 KiB per 5.3 us > R: the span settles
    # on the drain time of the aligned remote volume, K*V_t*(P-1)/P / R, and the MMA waits eq. 15's stall.
    rng = np.random.default_rng(seed)
    work = RankWork(MoEShape(1152, 128), (int(rng.integers(80_000, 90_000)),))
    result = simulate(work, expert_wave_order(work, 148), TileCosts(9.77, 5.30), PAPER, world_size=8)
    drain = float(model.drain_time(148 * 32768 * 7 / 8, PAPER.drain_rate))
    summary = result.summary()
    assert summary["t_rs_median"] == pytest.approx(drain, rel=1e-3), f"seed={seed}"
    assert summary["eq15_stall_median"] == pytest.approx(drain - 5.30, rel=1e-2), f"seed={seed}"
    assert summary["slot_wait_median"] == pytest.approx(summary["eq15_stall_median"], rel=1e-6), f"seed={seed}"


def test_routing_and_rank_slices(seed):
    rng = np.random.default_rng(seed)
    for top_k in (1, 2, 8):
        counts = routed_tokens_per_expert(5000, 16, top_k, rng, skew=1.0)
        assert counts.sum() == 5000 * top_k and counts.max() <= 5000, f"seed={seed}"
    balanced = routed_tokens_per_expert(20000, 16, 2, rng)
    skewed = routed_tokens_per_expert(20000, 16, 2, rng, skew=1.5)
    assert balanced.max() < 1.2 * balanced.mean() < skewed.max(), f"seed={seed}"
    counts = np.arange(8)
    assert rank_work(SHAPE, counts, 4, 1).tokens_per_expert == (2, 3)
    assert rank_work(SHAPE, counts, 4).tokens_per_expert == (6, 7)  # the busiest rank
    with pytest.raises(ScheduleError, match="top_k"):
        routed_tokens_per_expert(10, 4, 5, rng)
    with pytest.raises(ScheduleError, match="do not split"):
        rank_work(SHAPE, counts, 3)


def test_costs_from_the_paper_and_a_rate():
    costs = TileCosts.paper_table2("dsv4-flash")
    assert (costs.t_mma_l1_us, costs.t_mma_l2_us) == (7.40, 8.01)
    if PAPER_NUMBERS.is_file():
        table = json.loads(PAPER_NUMBERS.read_text())["table2_W8A8_skewed_55808_tokens_8gpu"]
        column = table["columns"]
        for name, row in (("dit-moe", "DiT-MoE"), ("dsv4-flash", "DSv4-Flash"), ("qwen3.5", "Qwen3.5")):
            c = TileCosts.paper_table2(name)
            assert (c.t_mma_l2_us, c.t_mma_l1_us) == (table[row][column.index("t_mma_L2_us")],
                                                      table[row][column.index("t_mma_L1_us")])
    rate = TileCosts.from_throughput(MoEShape(4096, 2048), tflops_per_sm=10.0)
    assert rate.t_mma_l1_us == pytest.approx(2 * 128 * 128 * 4096 / 10e6) and rate.t_mma_l2_us == rate.t_mma_l1_us / 2


def test_paper_shapes_interleaving_removes_the_wave_stall(seed):
    # Table 2's setting on the paper profile (busiest of 8 ranks, skewed routing, 148 CTAs, D = D_knee).
    dit = paper_comparison("dit-moe", seed)
    wave, inter = dit["wave"], dit["interleaved"]
    print(f"seed={seed} dit-moe wave: T_RS median {wave['t_rs_median']:.3f} eq15 mean {wave['eq15_stall_mean']:.3f} "
          f"slot wait mean {wave['slot_wait_mean']:.3f}; interleaved: T_RS median {inter['t_rs_median']:.3f} eq15 "
          f"mean {inter['eq15_stall_mean']:.3f} slot wait mean {inter['slot_wait_mean']:.3f}")
    assert wave["eq15_stall_mean"] > 0 and wave["slot_wait_mean"] > 0, f"seed={seed}: no wave backpressure"
    assert inter["eq15_stall_mean"] < wave["eq15_stall_mean"], f"seed={seed}"
    assert inter["slot_wait_mean"] < wave["slot_wait_mean"], f"seed={seed}"
    assert inter["t_rs_median"] < wave["t_rs_median"] and inter["t_rs_p90"] < wave["t_rs_p90"], f"seed={seed}"
    dsv4 = paper_comparison("dsv4-flash", seed)
    print(f"seed={seed} dsv4-flash eq15 mean wave {dsv4['wave']['eq15_stall_mean']:.3f} interleaved "
          f"{dsv4['interleaved']['eq15_stall_mean']:.3f}")
    assert dsv4["interleaved"]["eq15_stall_mean"] <= dsv4["wave"]["eq15_stall_mean"], f"seed={seed}"
    assert dsv4["interleaved"]["t_rs_median"] <= dsv4["wave"]["t_rs_median"], f"seed={seed}"


@pytest.mark.parametrize("model_name", ["dit-moe", "dsv4-flash"])
def test_leads_below_the_knee_let_linear2_spin(seed, model_name):
    # Condition 2: below D_knee (eq. 16) the L2 stream catches up with L1 and spins; at and above it stops.
    hidden, intermediate = {"dit-moe": (1152, 4608), "dsv4-flash": (4096, 2048)}[model_name]
    counts = routed_tokens_per_expert(55808, {"dit-moe": 8, "dsv4-flash": 256}[model_name],
                                      {"dit-moe": 2, "dsv4-flash": 6}[model_name], np.random.default_rng(seed), 1.0)
    work = rank_work(MoEShape(hidden, intermediate), counts, 8)
    knee = math.ceil(d_knee(work.shape, 148))
    spin = {}
    for lead in (knee - 1, knee + 1):
        result = simulate(work, interleaved_order(work, 148, lead), TileCosts.paper_table2(model_name), PAPER, 8)
        spin[lead] = result.summary()["l2_dependency_wait_total_us"]
    print(f"seed={seed} {model_name}: L2 spin {spin} us around the knee {d_knee(work.shape, 148):.3f}")
    assert spin[knee - 1] > 10 * spin[knee + 1], f"seed={seed}: {spin}"


def test_d_lead_removes_the_l2_spin_that_the_knee_leaves_on_long_l2_tiles():
    """DiT-MoE (hidden 1152, intermediate 4608: L2 mainloops 4x L1's), balanced, 132 CTAs: at eq. 16's knee the
    interleaved order spins on L1 readiness (over twice the wave order's makespan); at d_lead it matches the
    wave order's makespan within 2% and its L2 dependency wait falls below a tenth."""
    import math

    from calibrate import profile as prof
    from megamoe import schedule as s
    from megamoe import simulate as sim

    p = prof.load_builtin(prof.default_profile_name())
    shape = s.MoEShape(1152, 4608)
    work = s.RankWork(shape, (2048,) * 8)
    costs = sim.TileCosts.from_throughput(shape, 600 / 132)
    wave = sim.simulate(work, s.expert_wave_order(work, 132), costs, p, 1).summary()
    knee = sim.simulate(work, s.interleaved_order(work, 132, math.ceil(s.d_knee(shape, 132))), costs, p, 1).summary()
    lead = sim.simulate(work, s.interleaved_order(work, 132, math.ceil(s.d_lead(shape, 132))), costs, p, 1).summary()
    assert s.d_lead(shape, 132) == pytest.approx(s.d_knee(shape, 132) * 5)
    assert knee["makespan_us"] > 2 * wave["makespan_us"]
    assert lead["makespan_us"] <= 1.02 * wave["makespan_us"]
    assert lead["l2_dependency_wait_total_us"] < 0.1 * knee["l2_dependency_wait_total_us"]
