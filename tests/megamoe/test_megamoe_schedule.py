"""MegaMoE tile schedules (megamoe/schedule.py): tile sets, Algorithm 1, the expert-wave walk, the static
dependency check, the wave-size heuristic and D_knee (eq. 16). Random inputs use the printed ``seed`` fixture."""

import math

import numpy as np
import pytest

from calibrate.profile import load_builtin
from megamoe.schedule import (L1, L2, MoEShape, RankWork, Schedule, ScheduleError, Tile, check_schedule, check_tiles,
                              d_knee, d_knee_from_profile, expert_wave_order, expert_wave_size, expert_waves,
                              interleaved_order, interleaved_scheduler, mma_rows, wave_order_ring_slots_needed,
                              wave_rows)
from megamoe.simulate import rank_work, routed_tokens_per_expert

SHAPE = MoEShape(512, 256)  # L1: 4 N blocks, L2: 4 N blocks
ODD = MoEShape(384, 320, block_k=64)  # L1: 5 N blocks, L2: 3: role r = 1 idles on each row's last pair


def edge_works(seed):
    """The edge cases the issue names, on small shapes; top-k 1 and 8 come from seeded routing."""
    rng = np.random.default_rng(seed)
    return {
        "zero-token expert": RankWork(SHAPE, (300, 0, 129, 1, 128)),
        "not a multiple of BLOCK_M": RankWork(ODD, (1, 127, 129, 255, 257)),
        "one expert takes all": RankWork(SHAPE, (0, 0, 1000, 0)),
        "rank without tokens": RankWork(SHAPE, (0, 0, 0)),
        "top-k 1": rank_work(SHAPE, routed_tokens_per_expert(700, 8, 1, rng), 2, 0),
        "top-k 8": rank_work(ODD, routed_tokens_per_expert(300, 16, 8, rng, skew=1.0), 4, None),
    }


def test_shapes_and_counts_are_validated():
    with pytest.raises(ScheduleError, match="hidden = 500 is not a multiple of the tile size 128"):
        MoEShape(500, 256)
    with pytest.raises(ScheduleError, match="2\\*intermediate = 400 is not a multiple"):
        MoEShape(512, 200)
    with pytest.raises(ScheduleError, match="intermediate = 320 is not a multiple of the tile size 128"):
        MoEShape(384, 320)  # L1's N (640) fits b_n, but L2's K does not fit b_k
    with pytest.raises(ScheduleError, match="block_m must be a positive integer"):
        MoEShape(512, 256, block_m=0)
    for bad in ((1, -1), (1.5,), ("3",), (True,)):
        with pytest.raises(ScheduleError, match="tokens_per_expert"):
            RankWork(SHAPE, bad)
    with pytest.raises(ScheduleError, match="at least one expert"):
        RankWork(SHAPE, ())
    assert RankWork(SHAPE, tuple(np.array([3, 0], dtype=np.int64))).tokens_per_expert == (3, 0)


def test_row_layout_and_partial_blocks():
    work = RankWork(SHAPE, (300, 0, 129, 1, 128))
    assert work.m_blocks == (3, 0, 2, 1, 1)
    assert work.row_offsets == (0, 3, 3, 5, 6)  # O_e: expert 1 owns no rows
    assert work.rows == ((0, 0), (0, 1), (0, 2), (2, 0), (2, 1), (3, 0), (4, 0))
    assert [work.valid_m(e, m) for e, m in work.rows] == [128, 128, 44, 128, 1, 1, 128]
    assert work.num_tiles == 7 * (4 + 4) == len(work.tiles()) == len(set(work.tiles()))
    assert work.shape.l1_k_blocks == 4 and work.shape.l2_k_blocks == 2 and work.shape.l2_tile_bytes == 32768


def test_mma_rows_are_the_warpgroup_halves_the_kernel_runs(seed):
    # megamoe.kernel: warpgroup w of M block m multiplies its 64 rows iff n_e - 128 m > 64 w
    assert [mma_rows((n,)) for n in (0, 1, 64, 65, 127, 128, 129, 192, 193, 256)] == [
        0, 64, 64, 128, 128, 128, 192, 192, 256, 256]
    for name, work in edge_works(seed).items():
        by_halves = sum(64 * sum(work.valid_m(e, m) > 64 * w for w in (0, 1)) for e, m in work.rows)
        assert work.mma_rows == by_halves == mma_rows(work.tokens_per_expert), name
        assert sum(work.tokens_per_expert) <= work.mma_rows < sum(work.tokens_per_expert) + 64 * work.num_experts
    with pytest.raises(ScheduleError, match=r"tokens_per_expert\[1\] must be >= 0"):
        mma_rows((3, -1))


@pytest.mark.parametrize("num_ctas", [2, 6, 16])
def test_both_orders_hold_every_tile_exactly_once_and_the_same_set(seed, num_ctas):
    for name, work in edge_works(seed).items():
        wave, inter = expert_wave_order(work, num_ctas), interleaved_order(work, num_ctas)
        for schedule in (wave, inter):
            assert schedule.num_ctas == num_ctas
            check_tiles(work, schedule)
            check_schedule(work, schedule)
            assert len(schedule.tiles()) == work.num_tiles, (name, schedule.order, f"seed={seed}")
        assert sorted(wave.tiles()) == sorted(inter.tiles()) == sorted(work.tiles()), (name, f"seed={seed}")


def test_check_tiles_catches_missing_repeated_and_foreign_tiles():
    work = RankWork(SHAPE, (300, 0, 129))
    good = expert_wave_order(work, 4)
    streams = [list(s) for s in good.streams]
    dropped = Schedule("wave", tuple(map(tuple, [streams[0][1:]] + streams[1:])))
    with pytest.raises(ScheduleError, match="1 tile\\(s\\) never scheduled"):
        check_tiles(work, dropped)
    repeated = Schedule("wave", tuple(map(tuple, [streams[0] + [streams[1][0]]] + streams[1:])))
    with pytest.raises(ScheduleError, match="appears twice"):
        check_tiles(work, repeated)
    for foreign in (Tile(L1, 1, 0, 0), Tile(L2, 0, 3, 0), Tile(L2, 0, 0, 4)):  # no tokens / past the M, N blocks
        with pytest.raises(ScheduleError, match="no tile of this rank"):
            check_tiles(work, Schedule("wave", tuple(map(tuple, [streams[0] + [foreign]] + streams[1:]))))


def test_check_schedule_finds_deadlocks():
    work = RankWork(SHAPE, (300, 0, 129, 1, 128))
    # One CTA running a row's L2 tile before that row's L1 tiles waits for itself.
    backwards = Schedule("hand", (tuple(work.tiles(L2)[:1] + work.tiles(L1) + work.tiles(L2)[1:]),))
    with pytest.raises(ScheduleError, match="deadlock.*L2\\(e=0,m=0,n=0\\)@CTA0\\[0\\]"):
        check_schedule(work, backwards)
    check_schedule(work, Schedule("hand", (tuple(work.tiles()),)))
    # D = 0 lets L2 of row p2 be emitted before the CTA's own L1 of the same row.
    with pytest.raises(ScheduleError, match="interleaved: the streams deadlock"):
        check_schedule(work, interleaved_order(work, 4, lead=0))
    # The wave order needs a ring that holds a whole wave's rows.
    wave = expert_wave_order(work, 4, experts_per_wave=2)
    needed = wave_order_ring_slots_needed(work, 2)
    assert needed == 3  # waves {0, 1}: 3 rows, {2, 3}: 3 rows, {4}: 1 row
    check_schedule(work, wave, ring_slots=needed)
    with pytest.raises(ScheduleError, match="ring_slots=2"):
        check_schedule(work, wave, ring_slots=needed - 1)
    with pytest.raises(ScheduleError, match="ring_slots must be > 0"):
        check_schedule(work, wave, ring_slots=0)


def test_algorithm1_by_hand():
    # P = 2 rows, P_1 = 2 and P_2 = 1 pairs per row, G = 2 instances, D = 1, traced by hand through lines 1-11.
    for r in (0, 1):
        assert list(interleaved_scheduler(0, r, 2, 2, 2, 1, 1)) == [(L1, 0, r), (L2, 0, r), (L1, 1, r)]
        assert list(interleaved_scheduler(1, r, 2, 2, 2, 1, 1)) == [(L1, 0, 2 + r), (L1, 1, 2 + r), (L2, 1, r)]
    # D = 2 never lets L2 in before L1 is done (p_1 = +inf), since the last row is 1.
    assert [k for k, _, _ in interleaved_scheduler(0, 0, 2, 2, 2, 1, 2)] == [L1, L1, L2]


def test_interleaved_streams_follow_the_lead_rule(seed):
    rng = np.random.default_rng(seed)
    for _ in range(20):
        shape = MoEShape(128 * int(rng.integers(1, 7)), 64 * int(rng.integers(1, 9)), block_k=64)
        work = RankWork(shape, tuple(int(n) for n in rng.integers(0, 700, int(rng.integers(1, 6)))))
        num_ctas, lead = 2 * int(rng.integers(1, 9)), float(rng.choice([0.5, 1, 2, 3, 4.5, 7]))
        schedule = interleaved_order(work, num_ctas, lead)
        D = max(math.ceil(lead), 1)  # p_2 + D <= p_1 on integer rows
        for g in range(num_ctas // 2):
            even, odd = schedule.streams[2 * g], schedule.streams[2 * g + 1]
            rows = [(t.kind, work.row_of(t)) for t in even]  # role 0 never skips a pair slot
            for i, (kind, p) in enumerate(rows):
                later = [q for k, q in rows[i + 1:] if k != kind]
                if kind == L2 and later:  # emitted while the L1 cursor's row led by >= D
                    assert later[0] >= p + D, (i, rows, f"seed={seed}")
                if kind == L1 and later:  # emitted because the L2 cursor's row did not trail by D
                    assert later[0] + D > p, (i, rows, f"seed={seed}")
            # The pair walks the same cursors: role 1 emits n + 1 wherever that N block exists.
            expected = [t._replace(n_block=t.n_block + 1) for t in even
                        if t.n_block + 1 < shape.n_blocks(t.kind)]
            assert list(odd) == expected, f"seed={seed}"


def test_odd_n_blocks_leave_role_one_idle_on_the_last_pair():
    work = RankWork(ODD, (200,))  # 2 rows, L1: 5 N blocks (3 pairs), L2: 3 (2 pairs)
    schedule = interleaved_order(work, 2, lead=1)
    assert schedule.params["P_1"] == 3 and schedule.params["P_2"] == 2
    # Traced by hand (G = 1, D = 1): role 1 skips L1 n = 5 and L2 n = 3 of each row.
    assert [str(t) for t in schedule.streams[1]] == [
        "L1(e=0,m=0,n=1)", "L1(e=0,m=0,n=3)", "L2(e=0,m=0,n=1)", "L1(e=0,m=1,n=1)", "L1(e=0,m=1,n=3)",
        "L2(e=0,m=1,n=1)"]
    assert [str(t) for t in schedule.streams[0]][:5] == [
        "L1(e=0,m=0,n=0)", "L1(e=0,m=0,n=2)", "L1(e=0,m=0,n=4)", "L2(e=0,m=0,n=0)", "L2(e=0,m=0,n=2)"]
    check_schedule(work, schedule)


def test_wave_order_is_the_strided_walk_of_waves(seed):
    rng = np.random.default_rng(seed)
    work = RankWork(SHAPE, tuple(int(n) for n in rng.integers(0, 600, 12)))
    for num_ctas in (3, 8, 64):
        schedule = expert_wave_order(work, num_ctas, experts_per_wave=4)
        walk = []
        for wave in expert_waves(work, 4):
            rows = wave_rows(work, wave)
            walk += [t for p in rows for t in work.row_tiles(L1, p)] + [t for p in rows for t in work.row_tiles(L2, p)]
        rebuilt = [schedule.streams[t % num_ctas][t // num_ctas] for t in range(len(walk))]
        assert rebuilt == walk, f"seed={seed}"
        for stream in schedule.streams:  # per CTA: waves in order, each wave's L1 before its L2
            phases = [(t.expert // 4, t.kind) for t in stream]
            assert phases == sorted(phases), f"seed={seed}"


def test_wave_size_heuristic():
    # DSv4-Flash-like rank at 148 CTAs: mean 1308 tokens -> 11 M blocks x 32 L1 N blocks = 352 >= 2 x 148.
    assert expert_wave_size(32, 1308, 32, 128, 148) == 1
    # 50 tokens -> 1 M block x 32 = 32 tiles; 296 / 32 -> 10 experts, rounded up to a divisor of 256.
    assert expert_wave_size(256, 50, 32, 128, 148) == 16
    assert expert_wave_size(256, 50, 32, 128, 148, rounds=1) == 8  # needs 5; 5, 6, 7 do not divide 256
    assert expert_wave_size(7, 10, 4, 128, 20) == 7  # needs 10 of 7 experts: all of them
    assert expert_wave_size(6, 10, 4, 128, 4) == 2  # needs 2: divides 6
    assert expert_wave_size(8, 0, 4, 128, 4) == 8  # nothing routed: one wave
    with pytest.raises(ScheduleError):
        expert_wave_size(8, 10, 4, 128, 0)
    work = RankWork(SHAPE, (300, 0, 129, 1, 128))  # mean 111.6 -> 1 M block x 4 tiles; 2 x 6 CTAs -> 3 -> 5
    assert expert_wave_order(work, 6).params == {"experts_per_wave": 5, "num_waves": 1, "m_group": 1}


def test_d_knee_eq16_by_hand():
    paper, measured = load_builtin("paper"), load_builtin("h200x2")
    # b_n * K_SM / (2 h_inter) with the paper's K_SM = 148 SMs.
    assert d_knee_from_profile(MoEShape(4096, 2048), paper) == pytest.approx(128 * 148 / 4096) == pytest.approx(4.625)
    assert d_knee_from_profile(MoEShape(1152, 4608), paper) == pytest.approx(2.0555555555555554)
    assert d_knee_from_profile(MoEShape(4096, 1536), measured) == pytest.approx(5.5)  # 132 SMs on the H200
    assert d_knee_from_profile(MoEShape(4096, 2048), measured, k_sm=66) == pytest.approx(2.0625)  # P = 2 emulated
    # It is G / P_1: the rows one stride of all G = K_SM / 2 instances' L1 cursors spans.
    shape = MoEShape(4096, 2048)
    assert d_knee(shape, 148) == pytest.approx((148 // 2) / shape.pairs_per_row(L1))
    assert interleaved_order(RankWork(shape, (500,)), 148).params["D"] == pytest.approx(4.625)


def test_rank_without_tokens_has_empty_streams():
    work = RankWork(SHAPE, (0, 0, 0))
    for schedule in (expert_wave_order(work, 4), interleaved_order(work, 4)):
        assert schedule.streams == ((),) * 4
        assert check_schedule(work, schedule, ring_slots=1).l1_tiles == 0
