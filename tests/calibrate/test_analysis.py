"""Records -> metrics -> fitted profile -> no-refit predictions, on synthetic data drawn from a fixed seed per
test; the default sweep holds every point the fit reads."""
from __future__ import annotations

import inspect
import math
from collections import defaultdict

import numpy as np
import pytest

from calibrate import model
from calibrate.analysis import RecordError, check_records, run_metrics
from calibrate.fit import fit_completion_latency, fit_profile, fit_t_iss0
from calibrate.profile import load_builtin
from calibrate.sweep import Point, all_peers_sweep, default_sweep, validate_point

GHZ = 1.98
# One FMA gap iteration on the H200: 14.6 ns (calibration_raw.json of 3b9abde, h200x2: 3072 iterations of the
# local control's gap took 45.2 µs, 16 took 0.41 µs).
FMA_US_PER_ITERATION = 0.0146
BUFFER_BYTES, THREADS = 512 << 20, 128  # xstage calibrate's --buffer-mib and --threads defaults


def _records(rng, k, n, issue_us, gap_us, drained_us=0.0):
    """Records for K producers x N bursts with the given spans (µs) on a 1.98 GHz clock."""
    rec = np.zeros((k, n, 8), dtype=np.int64)
    for p in range(k):
        t = 1e6 + rng.uniform(0, 0.05)  # µs; small start skew
        for b in range(n):
            i = issue_us[b] if np.ndim(issue_us) else issue_us
            times = [t, t + i, t + i + drained_us, t + i + drained_us + gap_us]
            rec[p, b, [0, 1, 4, 6]] = np.round(np.array(times) * 1e3)           # globaltimer ns
            rec[p, b, [2, 3, 5, 7]] = np.round(np.array(times) * 1e3 * GHZ)     # clock64 cycles
            t = times[-1]
    return rec


def test_run_metrics_recovers_spans(seed):
    rng = np.random.default_rng(seed)
    issue, gap = rng.uniform(0.5, 8.0), rng.uniform(0.0, 20.0)
    m = run_metrics(_records(rng, 16, 24, issue, gap), 32768)
    assert m.clock_ghz == pytest.approx(GHZ, rel=1e-3), seed
    assert m.t_iss_us == pytest.approx(issue, rel=1e-3, abs=2e-3), seed
    assert m.gap_us == pytest.approx(gap, rel=1e-3, abs=2e-3), seed
    assert m.t_period_us == pytest.approx(issue + gap, rel=1e-3, abs=2e-3), seed
    assert m.volume == 16 * 32768


def test_isolated_completion(seed):
    rng = np.random.default_rng(seed)
    drained = rng.uniform(1.0, 10.0)
    m = run_metrics(_records(rng, 8, 8, 0.7, 0.0, drained), 4096, isolated=True)
    assert m.completion_us == pytest.approx(0.7 + drained, rel=1e-3), seed


def test_incomplete_or_non_monotone_records_are_errors(seed):
    rng = np.random.default_rng(seed)
    rec = _records(rng, 4, 6, 1.0, 1.0)
    check_records(rec)  # the unbroken records pass
    bad = rec.copy()
    bad[2, 3, :] = 0
    with pytest.raises(RecordError, match="never written"):
        check_records(bad)
    bad = rec.copy()
    bad[1, 2, 3] = bad[1, 2, 2] - 5
    with pytest.raises(RecordError, match="monotone"):
        check_records(bad)


def _t_iss0(b):
    """The synthetic platform's plateau issue time, linear in B (µs)."""
    return 0.25 + 0.6 * b / 32768


def _synthetic_measurements(rng, r, q, sm=132):
    """Measurements the Burst-Gap model would produce for (R, T_iss0(B) linear in B, Q), with 1% noise."""
    def noisy(x):
        return float(x * rng.normal(1.0, 0.01))

    def meas(mode, target, k, b, g, t_iss, gap_kind="fma"):
        # top-level fields as bench.run_point writes them (Point fields + pair), metrics as RunMetrics
        return {"mode": mode, "target": target, "gap_kind": gap_kind, "producers": k, "bytes_per_producer": b,
                "gap": g, "bursts": 24, "sender": 0, "receiver": 1,
                "metrics": {"producers": k, "bytes_per_producer": b, "volume_bytes": k * b, "gap_us": g,
                            "t_iss_us": t_iss, "t_period_us": t_iss + g}}

    out = []
    for p in default_sweep(sm):
        k, b = p.producers, p.bytes_per_producer
        v = k * b
        if p.mode == "rate":
            out.append(meas("rate", "remote", k, b, 0.05, noisy(max(_t_iss0(b), v / r))))
        elif p.mode == "gap":
            g = p.gap * FMA_US_PER_ITERATION if p.gap_kind == "fma" else p.gap * 1e-3
            t = _t_iss0(b) if p.target == "local" else noisy(model.t_iss(g, v, _t_iss0(b), r))
            out.append(meas("gap", p.target, k, b, g, t, p.gap_kind))
        else:
            t = _t_iss0(b) if p.target == "local" else noisy(model.t_iss_isolated(v, _t_iss0(b), r, q))
            out.append(meas("isolated", p.target, k, b, 0.0, t))
    return out


def test_fit_recovers_model_and_predicts_without_refit(seed):
    rng = np.random.default_rng(seed)
    r = rng.uniform(300e3, 700e3)          # bytes/µs
    q = rng.uniform(2.0, 4.0) * (1 << 20)  # bytes
    meas = _synthetic_measurements(rng, r, q)
    fit = fit_profile(meas, 132, {"source": "measured", "device": "synthetic", "world_size": 2, "date": "x"})
    why = f"seed={seed} R={r:.0f} B/us Q={q:.0f} B"
    assert fit.profile.drain_rate == pytest.approx(r, rel=0.03), why
    caps = {c.producers: c.capacity_bytes for c in fit.profile.capacity_points}
    assert caps[132] == pytest.approx(q, rel=0.15), why
    # Each remote FMA gap curve's plateau is the platform's T_iss0 at its B.
    curves = {(p.producers, p.bytes_per_producer) for p in default_sweep(132)
              if p.mode == "gap" and p.target == "remote" and p.gap_kind == "fma"}
    t0 = {(p.producers, p.bytes_per_producer): p.t_iss0_us for p in fit.profile.t_iss0_points}
    assert curves and curves <= set(t0), why
    for k, b in curves:
        assert t0[(k, b)] == pytest.approx(_t_iss0(b), rel=0.03), (why, k, b)
    assert fit.errors["gap_t_period"]["median"] < 0.05, why
    assert fit.errors["gap_t_period"]["max"] < 0.15, why


@pytest.mark.parametrize("kwargs,match", [
    (dict(bytes_per_producer=1000), "multiple of 16"),
    (dict(bytes_per_producer=1024), "multiple of 2048"),
    (dict(producers=133), r"\[1, 132\]"),
    (dict(bursts=4096), "exceeds"),
    (dict(mode="rate", bursts=1), "at least 2 bursts"),
    (dict(gap=-1), "gap >= 0"),
    (dict(gap_kind="sleep"), "gap_kind"),
    (dict(target="peer"), "unknown mode/target"),
])
def test_bad_configurations_are_rejected(kwargs, match):
    base = dict(mode="gap", target="remote", producers=132, bytes_per_producer=32768)
    validate_point(Point(**base), sm_count=132, buffer_bytes=512 << 20, threads=128)  # the base point is valid
    with pytest.raises(ValueError, match=match):
        validate_point(Point(**{**base, **kwargs}), sm_count=132, buffer_bytes=512 << 20, threads=128)


def _default(fn, name):
    """The default of ``fn``'s argument ``name``: what the fit applies when calibrate.run calls it."""
    return inspect.signature(fn).parameters[name].default


def _knee_bytes(profile, k):
    """The measured knee (bytes per producer) of the capacity point nearest K (in log distance)."""
    cp = min(profile.capacity_points, key=lambda c: abs(math.log(c.producers / k)))
    assert cp.knee_bytes_per_producer, (profile.source, cp)
    return cp.knee_bytes_per_producer


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
@pytest.mark.parametrize("platform", ["h200x2", "paper"])
def test_default_sweep_holds_what_the_fit_reads(platform, quick):
    """The default sweep, checked against the shipped profiles (our H200 measurement, the paper's platform):
    every point valid for `xstage calibrate`'s defaults, and each fitted quantity has the points it is read
    from (calibrate.fit): zero-gap runs across K and B for R, FMA gap curves reaching the plateau for T_iss0
    (and sampling the backpressured slope below G*), each beside its local control, isolated bursts on both
    sides of the knee for Q(K) at two or more K, and bursts small enough to read T_lat."""
    prof = load_builtin(platform)
    sm, r = prof.sm_count, prof.drain_rate  # r in bytes/µs
    pts = default_sweep(sm, quick)
    assert len(set(pts)) == len(pts), "a point listed twice would be aggregated as a repeat of itself"
    for p in pts + all_peers_sweep(pts):
        validate_point(p, sm, BUFFER_BYTES, THREADS)
    listed = set(pts)

    # R: one line through the origin over the zero-gap remote runs of V >= min_rate_volume.
    rate = [p for p in pts if p.mode == "rate"]
    assert rate and all(p.target == "remote" and p.gap == 0 and p.bursts >= 8 for p in rate)
    fitted = [p for p in rate if p.volume >= _default(fit_profile, "min_rate_volume")]
    assert len({p.producers for p in fitted}) >= 2 and len({p.bytes_per_producer for p in fitted}) >= 2, fitted

    # T_iss0: the recovered plateau (gap >= plateau_factor x V/R) of every remote FMA curve.
    plateau_factor = _default(fit_t_iss0, "plateau_factor")
    curves = defaultdict(list)
    for p in pts:
        if p.mode == "gap" and p.target == "remote":
            curves[(p.gap_kind, p.producers, p.bytes_per_producer)].append(p)
    fma = {key: runs for key, runs in curves.items() if key[0] == "fma"}
    assert fma and any(key[0] == "spin" for key in curves), sorted(curves)
    for (kind, k, b), runs in curves.items():
        v = k * b
        drain_us = v / r
        gap_us = sorted(p.gap * (FMA_US_PER_ITERATION if kind == "fma" else 1e-3) for p in runs)
        assert gap_us[0] == 0.0, (kind, k, b)
        if kind == "fma":
            on_plateau = [g for g in gap_us if g >= plateau_factor * drain_us]
            assert len(on_plateau) >= 2, (platform, k, b, f"V/R = {drain_us:.1f} us", gap_us)
            slope = [g for g in gap_us if g < drain_us - prof.t_iss0(k, v)]  # T_iss = V/R - G there (eq. 3)
            assert len(slope) >= 3, (platform, k, b, gap_us)
            for p in runs:
                assert Point("gap", "local", k, b, "fma", p.gap, p.bursts) in listed, ("no local control", p)
        else:
            assert gap_us[-1] >= plateau_factor * drain_us, (platform, k, b, gap_us)

    # Q(K): isolated remote bursts below and above the knee, each beside its local control (backpressure is
    # read against it), at two or more K (Q is interpolated in K).
    isolated = defaultdict(list)
    for p in pts:
        if p.mode == "isolated" and p.target == "remote":
            isolated[p.producers].append(p.bytes_per_producer)
            assert Point("isolated", "local", p.producers, p.bytes_per_producer, bursts=p.bursts) in listed, p
    assert len(isolated) >= 2, sorted(isolated)
    for k, bs in isolated.items():
        knee = _knee_bytes(prof, k)
        below, above = [b for b in bs if b < knee], [b for b in bs if b > knee]
        assert len(below) >= 2 and len(above) >= 2, (platform, k, knee, sorted(bs))
    # T_lat (eq. 17): isolated bursts that drain in under max_drain_us.
    max_drain_us = _default(fit_completion_latency, "max_drain_us")
    assert any(k * min(bs) / r <= max_drain_us for k, bs in isolated.items()), (platform, max_drain_us)


@pytest.mark.parametrize("sm_count", [132, 148])
def test_quick_sweep_is_a_coarser_default_sweep(sm_count):
    full, quick = default_sweep(sm_count), default_sweep(sm_count, quick=True)
    assert set(quick) < set(full), sorted(set(quick) - set(full), key=str)[:5]
    assert len(quick) < len(full) / 2
    assert {p.mode for p in quick} == {p.mode for p in full} == {"rate", "gap", "isolated"}
    assert all_peers_sweep(full) == [Point(**{**p.to_dict(), "target": "all_peers"}) for p in full
                                     if p.target == "remote"]


def test_repeats_are_aggregated_by_median(seed):
    from calibrate.fit import aggregate_repeats

    rng = np.random.default_rng(seed)
    base = {"mode": "gap", "target": "remote", "gap_kind": "fma", "producers": 8, "bytes_per_producer": 4096,
            "gap": 64, "bursts": 24, "sender": 0, "receiver": 1}
    vals = rng.uniform(1.0, 2.0, size=3)
    runs = [{**base, "repeat": i, "metrics": {"t_iss_us": float(v), "producers": 8}} for i, v in enumerate(vals)]
    other = {**base, "sender": 1, "receiver": 0, "repeat": 0, "metrics": {"t_iss_us": 5.0, "producers": 8}}
    agg = aggregate_repeats(runs + [other])
    assert sorted(a["sender"] for a in agg) == [0, 1]
    mine = next(a for a in agg if a["sender"] == 0)
    assert mine["repeats"] == 3 and mine["metrics"]["t_iss_us"] == pytest.approx(float(np.median(vals))), seed
    assert mine["metrics"]["producers"] == 8
    theirs = next(a for a in agg if a["sender"] == 1)
    assert theirs["repeats"] == 1 and theirs["metrics"]["t_iss_us"] == 5.0


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_all_to_all_deals_every_producer_to_one_peer(world, seed):
    from calibrate.bench import peer_order, producers_to

    rng = np.random.default_rng(seed)
    for k in [1, world - 1, 132] + [int(x) for x in rng.integers(1, 133, size=4)]:
        for sender in range(world):
            peers = peer_order(sender, world)
            assert sorted(peers) == [j for j in range(world) if j != sender]
            dealt = [producers_to(sender, j, k, world) for j in range(world)]
            assert dealt[sender] == []
            assert sorted(x for d in dealt for x in d) == list(range(k)), (seed, k, sender)
            sizes = [len(d) for j, d in enumerate(dealt) if j != sender]
            assert max(sizes) - min(sizes) <= 1, (seed, k, sender, sizes)  # the peers share the producers evenly


def test_finish_fits_all_to_all_injection_beside_the_pair(tmp_path, seed):
    """calibrate.run.finish on synthetic pairwise + all-to-all measurements (the all-to-all ones drain at
    a different, random rate): both profiles are written and the summary recovers the ratio."""
    import json

    from calibrate.profile import load_profile
    from calibrate.run import all_to_all_summary, finish

    rng = np.random.default_rng(seed)
    r_pair = rng.uniform(300e3, 500e3)
    r_all = r_pair * rng.uniform(0.8, 1.9)
    q = rng.uniform(2.0, 4.0) * (1 << 20)
    pair = _synthetic_measurements(rng, r_pair, q)
    a2a = [{**m, "target": "all_peers", "receiver": -1} for m in _synthetic_measurements(rng, r_all, q)
           if m["target"] == "remote"]
    raw = {"measurements": pair + a2a, "sm_count": 132, "world_size": 2,
           "provenance": {"source": "measured", "device": "synthetic", "world_size": 2, "date": "x"}}
    assert finish(raw, str(tmp_path), "test") == 0
    main = load_profile(str(tmp_path / "calibration.json"))
    other = load_profile(str(tmp_path / "calibration_all_to_all.json"))
    why = f"seed={seed} R_pair={r_pair:.0f} R_all={r_all:.0f}"
    assert main.drain_rate == pytest.approx(r_pair, rel=0.03), why
    assert other.drain_rate == pytest.approx(r_all, rel=0.03), why
    summary = json.loads((tmp_path / "calibration.json").read_text())["fit_quality"]["all_to_all"]
    assert summary["rate_vs_pairwise"] == pytest.approx(r_all / r_pair, rel=0.05), why
    assert summary["drain_rate_GBps_per_sender"] == pytest.approx(other.drain_rate_GBps)
    # each sender's rate divides over its P - 1 peers
    assert all_to_all_summary(main, other, 4)["drain_rate_GBps_per_peer"] == pytest.approx(other.drain_rate_GBps / 3)
