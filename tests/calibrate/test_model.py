"""Burst-Gap model equations: regimes on seeded random inputs, and the paper's derived numbers."""

import zlib

import numpy as np
import pytest

from calibrate import model as m
from calibrate.profile import load_builtin

MIB = 1024 * 1024
N = 2000


@pytest.fixture
def rng(request):
    # One fixed seed per test (from its name), printed and in every assertion message.
    seed = zlib.crc32(request.node.name.encode())
    print(f"{request.node.name}: seed={seed}")
    return seed, np.random.default_rng(seed)


def random_platform(gen, n=N):
    """Random (V bytes, T_iss0 us, R bytes/us, Q bytes) around the paper's scale."""
    volume = gen.uniform(1e4, 2e7, n)
    t_iss0 = gen.uniform(0.05, 5.0, n)
    rate = m.gbps_to_bytes_per_us(gen.uniform(50.0, 2000.0, n))
    capacity = gen.uniform(0.0, 2e7, n)
    return volume, t_iss0, rate, capacity


def drain_limited(gen, t_iss0, rate):
    """Volumes whose drain time V/R exceeds T_iss0, so G* > 0 (the regime of interest)."""
    return rate * t_iss0 * gen.uniform(1.001, 20.0, np.shape(t_iss0))


def test_unit_conversion():
    assert m.gbps_to_bytes_per_us(717) == pytest.approx(717e3)
    assert m.bytes_per_us_to_gbps(717e3) == pytest.approx(717)


def test_positive_part_clamps():
    np.testing.assert_array_equal(m.positive_part(np.array([-2.0, 0.0, 3.0])), [0.0, 0.0, 3.0])


def test_below_recovery_gap_is_drain_limited(rng):
    seed, gen = rng
    _, t0, rate, _ = random_platform(gen)
    volume = drain_limited(gen, t0, rate)
    g_star = m.recovery_gap(volume, t0, rate)
    gap = gen.uniform(0.0, 1.0, N) * g_star  # strictly inside [0, G*)
    drain = volume / rate
    np.testing.assert_allclose(m.t_iss(gap, volume, t0, rate), drain - gap, rtol=1e-12, err_msg=f"seed={seed}")
    np.testing.assert_allclose(m.t_period(gap, volume, t0, rate), drain, rtol=1e-12, err_msg=f"seed={seed}")
    np.testing.assert_allclose(m.issue_overhead(gap, volume, t0, rate), drain - gap - t0, rtol=1e-9, atol=1e-12,
                               err_msg=f"seed={seed}")


def test_above_recovery_gap_is_backpressure_free(rng):
    seed, gen = rng
    volume, t0, rate, _ = random_platform(gen)
    gap = m.recovery_gap(volume, t0, rate) + gen.uniform(0.0, 50.0, N)
    np.testing.assert_array_equal(m.t_iss(gap, volume, t0, rate), t0, err_msg=f"seed={seed}")
    np.testing.assert_allclose(m.t_period(gap, volume, t0, rate), t0 + gap, rtol=1e-12, err_msg=f"seed={seed}")
    np.testing.assert_array_equal(m.issue_overhead(gap, volume, t0, rate), 0.0, err_msg=f"seed={seed}")


def test_period_is_issue_plus_gap_and_max_law_beats_completion_coupled(rng):
    seed, gen = rng
    _, t0, rate, _ = random_platform(gen)
    volume = drain_limited(gen, t0, rate)
    gap = gen.uniform(0.0, 100.0, N)
    period = m.t_period(gap, volume, t0, rate)
    np.testing.assert_allclose(period, m.t_iss(gap, volume, t0, rate) + gap, rtol=1e-12, err_msg=f"seed={seed}")
    np.testing.assert_allclose(m.t_iss(gap, volume, t0, rate), t0 + m.issue_overhead(gap, volume, t0, rate),
                               rtol=1e-9, err_msg=f"seed={seed}")
    # The max law hides min(G, G*) of the gap behind draining; the coupled sum hides none.
    coupled = m.t_period_completion_coupled(gap, volume, rate)
    np.testing.assert_allclose(coupled - period, np.minimum(gap, m.recovery_gap(volume, t0, rate)),
                               rtol=1e-9, atol=1e-9, err_msg=f"seed={seed}")


def test_monotonicity_in_gap_and_volume(rng):
    seed, gen = rng
    volume, t0, rate, _ = random_platform(gen)
    gap = gen.uniform(0.0, 50.0, N)
    more_gap = gap + gen.uniform(0.0, 10.0, N)
    more_volume = volume * gen.uniform(1.0, 3.0, N)
    assert np.all(m.t_iss(more_gap, volume, t0, rate) <= m.t_iss(gap, volume, t0, rate)), f"seed={seed}"
    assert np.all(m.t_period(more_gap, volume, t0, rate) >= m.t_period(gap, volume, t0, rate)), f"seed={seed}"
    assert np.all(m.issue_overhead(gap, more_volume, t0, rate) >= m.issue_overhead(gap, volume, t0, rate)), \
        f"seed={seed}"
    assert np.all(m.recovery_gap(more_volume, t0, rate) >= m.recovery_gap(volume, t0, rate)), f"seed={seed}"


def test_clamps_hold_for_small_bursts(rng):
    seed, gen = rng
    _, t0, rate, _ = random_platform(gen)
    small = rate * t0 * gen.uniform(0.0, 1.0, N)  # drains within T_iss0
    assert np.all(m.recovery_gap(small, t0, rate) == 0.0), f"seed={seed}"
    assert np.all(m.q_peak(small, t0, rate) == 0.0), f"seed={seed}"
    assert np.all(m.issue_overhead(0.0, small, t0, rate) == 0.0), f"seed={seed}"


def test_isolated_burst_below_and_above_capacity(rng):
    seed, gen = rng
    volume, t0, rate, capacity = random_platform(gen)
    iso = m.t_iss_isolated(volume, t0, rate, capacity)
    fits = m.q_peak(volume, t0, rate) <= capacity
    np.testing.assert_array_equal(iso[fits], t0[fits], err_msg=f"seed={seed}")
    np.testing.assert_allclose(iso[~fits], (volume - capacity)[~fits] / rate[~fits], rtol=1e-12,
                               err_msg=f"seed={seed}")
    assert np.all(iso[~fits] > t0[~fits]), f"seed={seed}"


def test_capacity_overhead_is_eq7_over_the_floor_and_zero_iff_the_capacity_bound_holds(rng):
    seed, gen = rng
    volume, t0, rate, capacity = random_platform(gen)
    cost = m.capacity_overhead(volume, t0, rate, capacity)
    np.testing.assert_allclose(cost, m.t_iss_isolated(volume, t0, rate, capacity) - t0, rtol=1e-12, atol=1e-12,
                               err_msg=f"seed={seed}")
    holds = m.q_peak(volume, t0, rate) <= capacity
    clear = np.abs(m.q_peak(volume, t0, rate) - capacity) > 1e-6 * volume  # away from float ties at the knee
    assert np.all(holds[clear] == (cost[clear] == 0.0)), f"seed={seed}"
    assert np.all(cost >= 0.0), f"seed={seed}"


def test_capacity_from_knee_is_the_isolated_burst_knee(rng):
    seed, gen = rng
    knee, t0, rate, _ = random_platform(gen)
    knee = knee + rate * t0  # a knee past the backpressure-free drain
    capacity = m.capacity_from_knee(knee, t0, rate)
    np.testing.assert_allclose(m.t_iss_isolated(knee, t0, rate, capacity), t0, rtol=1e-9, err_msg=f"seed={seed}")
    beyond = knee * gen.uniform(1.01, 2.0, N)
    assert np.all(m.t_iss_isolated(beyond, t0, rate, capacity) > t0), f"seed={seed}"


def test_design_test_regimes(rng):
    seed, gen = rng
    volume, t0, rate, _ = (float(x[0]) for x in random_platform(gen, 1))
    g_star = float(m.recovery_gap(volume, t0, rate))
    peak = float(m.q_peak(volume, t0, rate))
    roomy = m.design_test(volume, g_star + 1.0, t0, rate, peak * 1.1 + 1.0)
    assert (roomy.rate_ok, roomy.capacity_ok, roomy.verdict, roomy.overhead) == (True, True, "piggyback", 0.0), \
        f"seed={seed}"
    if g_star > 0:
        short = m.design_test(volume, g_star * 0.5, t0, rate, peak * 1.1 + 1.0)
        assert not short.rate_ok and short.verdict == "reshape", f"seed={seed}"
        assert "rate bound fails" in short.reason and short.overhead == pytest.approx(g_star * 0.5), f"seed={seed}"
    if peak > 0:
        tight = m.design_test(volume, g_star + 1.0, t0, rate, peak * 0.5)
        assert tight.rate_ok and not tight.capacity_ok, f"seed={seed}"
        assert "capacity bound fails" in tight.reason and "MiB" in tight.reason, f"seed={seed}"
    assert set(roomy.to_dict()) >= {"rate_ok", "capacity_ok", "verdict", "injection_rate", "q_peak", "capacity"}


def test_rate_bound_is_equivalent_to_gap_at_least_recovery_gap(rng):
    seed, gen = rng
    volume, t0, rate, _ = random_platform(gen, 200)
    gaps = gen.uniform(0.0, 60.0, 200)
    for v, t, r, g in zip(volume, t0, rate, gaps):
        verdict = m.design_test(v, g, t, r, capacity_bytes=np.inf)
        assert verdict.rate_ok == (g >= m.recovery_gap(v, t, r) - 1e-12), f"seed={seed}"
        assert verdict.rate_ok == (verdict.overhead == 0.0), f"seed={seed}"


def test_design_test_prices_each_bound_and_the_larger_decides(rng):
    seed, gen = rng
    volume, t0, rate, capacity = random_platform(gen, 300)
    gaps = gen.uniform(0.0, 60.0, 300)
    for v, t, r, q, g in zip(volume, t0, rate, capacity, gaps):
        verdict = m.design_test(v, g, t, r, q)
        assert verdict.overhead == pytest.approx(float(m.issue_overhead(g, v, t, r)), abs=1e-12), f"seed={seed}"
        assert verdict.capacity_overhead == pytest.approx(float(m.capacity_overhead(v, t, r, q)), abs=1e-12), \
            f"seed={seed}"
        assert verdict.t_iss_isolated == pytest.approx(float(m.t_iss_isolated(v, t, r, q))), f"seed={seed}"
        cost = max(verdict.overhead, verdict.capacity_overhead)
        assert verdict.cost_fraction == pytest.approx(cost / (t + cost + g)), f"seed={seed}"
        if verdict.rate_ok and verdict.capacity_ok:
            assert (verdict.decided_by, verdict.verdict) == ("none", "piggyback"), f"seed={seed}"
        else:
            larger = "rate" if verdict.overhead >= verdict.capacity_overhead else "capacity"
            assert verdict.decided_by == larger and verdict.verdict == "reshape", f"seed={seed}"  # tolerance 0
            assert f"the {larger} bound decides" in verdict.reason, f"seed={seed}"


def test_design_test_tolerance_piggybacks_a_small_capacity_cost():
    # A burst past Q with a long gap: eq. 7 costs 1 us per 101-us period; the rate bound holds.
    rate, t0, capacity = 400e3, 0.5, 1e6
    volume = capacity + rate * (t0 + 1.0)
    strict = m.design_test(volume, 100.0, t0, rate, capacity)
    assert strict.rate_ok and not strict.capacity_ok and strict.verdict == "reshape"
    assert strict.capacity_overhead == pytest.approx(1.0) and strict.decided_by == "capacity"
    assert strict.cost_fraction == pytest.approx(1.0 / 101.5)
    assert m.design_test(volume, 100.0, t0, rate, capacity, tolerance=0.01).verdict == "piggyback"
    assert m.design_test(volume, 100.0, t0, rate, capacity, tolerance=0.009).verdict == "reshape"
    with pytest.raises(ValueError, match="tolerance must be >= 0"):
        m.design_test(volume, 100.0, t0, rate, capacity, tolerance=-0.1)


def test_design_test_rejects_zero_period():
    with pytest.raises(ValueError, match="T_iss0 \\+ G"):
        m.design_test(1e6, 0.0, 0.0, 717e3, 1e6)


# --- MegaMoE (eq. 12-16) ---------------------------------------------------------


def test_interleaving_offsets_overhead_one_for_one(rng):
    seed, gen = rng
    volume, t0, rate, _ = random_platform(gen)
    t_l2, t_l1 = gen.uniform(1.0, 20.0, N), gen.uniform(1.0, 20.0, N)
    ratio = gen.uniform(0.0, 2.0, N)
    wave = m.issue_overhead(t_l2, volume, t0, rate)
    g_int = m.interleaved_gap(t_l2, t_l1, ratio)
    # Eq. 13 equals eq. 4 evaluated at the interleaved gap of eq. 12.
    np.testing.assert_allclose(m.interleaved_overhead(wave, t_l1, ratio), m.issue_overhead(g_int, volume, t0, rate),
                               rtol=1e-9, atol=1e-9, err_msg=f"seed={seed}")
    # Eq. 14 is the rate bound at the interleaved gap (n2 = 1).
    sufficient = m.interleave_sufficient(volume, t0, t_l2, t_l1, rate, n1=ratio, n2=1.0)
    margin = g_int - m.recovery_gap(volume, t0, rate)
    clear = np.abs(margin) > 1e-9
    np.testing.assert_array_equal(sufficient[clear], (margin >= 0)[clear], err_msg=f"seed={seed}")
    np.testing.assert_array_equal(m.interleaved_gap(t_l2, t_l1, 0.0), t_l2)


def test_interleave_sufficient_scales_with_n1_n2(rng):
    seed, gen = rng
    volume, t0, rate, _ = random_platform(gen)
    t_l2, t_l1 = gen.uniform(1.0, 20.0, N), gen.uniform(1.0, 20.0, N)
    n1, n2 = gen.integers(1, 5, N), gen.integers(1, 5, N)
    np.testing.assert_array_equal(m.interleave_sufficient(volume, t0, t_l2, t_l1, rate, n1, n2),
                                  m.interleave_sufficient(volume, t0, t_l2, t_l1, rate, n1 / n2, 1.0),
                                  err_msg=f"seed={seed}")


def test_critical_path_stall_and_d_knee(rng):
    seed, gen = rng
    t_rs, cover = gen.uniform(0.0, 20.0, N), gen.uniform(0.0, 20.0, N)
    stall = m.critical_path_stall(t_rs, cover)
    np.testing.assert_allclose(stall, np.maximum(t_rs - cover, 0.0), err_msg=f"seed={seed}")
    assert np.all((stall == 0) == (t_rs <= cover)), f"seed={seed}"
    np.testing.assert_allclose(m.remote_store_span(0.76, 0.7), 1.46)
    assert m.d_knee(128, 148, 2048) == pytest.approx(128 * 148 / 4096)


def test_table2_wave_predictions_follow_eq15():
    # paper-numbers.json table2: dt_wave_pred = [span_wave - T_mma_L2]+ (cover = next L2 mainloop).
    rows = {"DiT-MoE": (9.93, 5.30, 4.63), "Qwen3.5": (9.17, 4.24, 4.94), "MiMo-V2.5": (9.22, 7.77, 1.45),
            "DSv4-Pro": (7.88, 9.54, 0.0)}
    for name, (span, t_l2, predicted) in rows.items():
        assert m.critical_path_stall(span, t_l2) == pytest.approx(predicted, abs=0.015), name


# --- FlashAttention-A2A (eq. 17-20) -------------------------------------------------


def test_fa_stalls_vanish_beyond_m_star(rng):
    seed, gen = rng
    volume, t0, rate, _ = random_platform(gen)
    sigma, b_n = gen.uniform(0.1, 2.0, N), 128
    m_star = m.m_star_ub(volume, t0, rate, sigma, b_n)
    for seq_len, positive in ((m_star * gen.uniform(1.0, 4.0, N), False),
                              (m_star * gen.uniform(0.0, 0.99, N), True)):
        gap = m.qloop_gap_lower_bound(seq_len, sigma, b_n)
        stall = m.piggyback_stall(gap, volume, t0, rate)
        has_stall = m.recovery_gap(volume, t0, rate) > 1e-9
        if positive:
            assert np.all(stall[has_stall] > 0), f"seed={seed}"
        else:
            np.testing.assert_allclose(stall, 0.0, atol=1e-9, err_msg=f"seed={seed}")


def test_fa_residuals_and_completion_coupled(rng):
    seed, gen = rng
    volume, t0, rate, _ = random_platform(gen)
    gap, g_qk = gen.uniform(0.0, 40.0, N), gen.uniform(0.0, 5.0, N)
    n_tiles = gen.integers(1, 1000, N)
    stall = m.piggyback_stall(gap, volume, t0, rate)
    residual = m.critical_path_residual(stall, g_qk)
    assert np.all(residual <= stall) and np.all(residual >= 0), f"seed={seed}"
    np.testing.assert_allclose(m.drain_residual(n_tiles, stall, g_qk), n_tiles * residual, err_msg=f"seed={seed}")
    t_lat, t_cover = gen.uniform(0.0, 5.0, N), gen.uniform(0.0, 5.0, N)
    dt_cc = m.completion_coupled_stall(volume, rate, t_lat, t_cover)
    np.testing.assert_allclose(dt_cc, np.maximum(volume / rate + t_lat - t_cover, 0.0), err_msg=f"seed={seed}")
    np.testing.assert_allclose(m.completion_coupled_exposure(n_tiles, dt_cc), n_tiles * dt_cc)
    # Piggybacking never exposes more than blocking until completion with only a QK^T cover window.
    assert np.all(m.piggyback_stall(gap + t_cover, volume, t0, rate) <= dt_cc + t0 + 1e-9), f"seed={seed}"


def test_fa_shapes():
    assert m.fa_burst_bytes(128, 128, 2) == 32768
    assert m.k_equiv(128) == 256
    assert m.qloop_gap_lower_bound(8192, 0.79, 128) == pytest.approx(50.56)


# --- the paper's derived numbers from the shipped profile --------------------------


def test_paper_numbers_from_shipped_profile():
    profile = load_builtin("paper")
    rate, volume = profile.drain_rate, 148 * 32768
    t0 = float(profile.t_iss0(148, volume))
    capacity = float(profile.capacity(148))
    sigma = profile.applications["flash_a2a"]["sigma_us_per_kv_tile"]
    assert rate == pytest.approx(717e3)
    assert t0 == pytest.approx(0.76)
    assert volume / MIB == pytest.approx(4.6, rel=0.05)
    assert 148 * 33792 / MIB == pytest.approx(4.77, rel=0.05)
    assert capacity / MIB == pytest.approx(4.25, rel=0.05)
    assert m.capacity_from_knee(148 * 33792, t0, rate) / MIB == pytest.approx(4.25, rel=0.05)
    assert m.q_peak(volume, t0, rate) / MIB == pytest.approx(4.1, rel=0.05)
    assert m.recovery_gap(volume, t0, rate) == pytest.approx(6.0, rel=0.05)
    assert m.m_star_ub(volume, t0, rate, sigma, 128) == pytest.approx(1000, rel=0.05)
    verdict = m.design_test(volume, m.qloop_gap_lower_bound(8192, sigma, 128), t0, rate, capacity)
    assert verdict.verdict == "piggyback"
