"""Records -> metrics -> fitted profile -> no-refit predictions, on synthetic data drawn fresh each run."""
from __future__ import annotations

import numpy as np
import pytest

from calibrate import model
from calibrate.analysis import RecordError, check_records, run_metrics
from calibrate.fit import fit_profile
from calibrate.sweep import Point, default_sweep, validate_point

GHZ = 1.98


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


def test_run_metrics_recovers_spans():
    rng = np.random.default_rng()
    issue, gap = rng.uniform(0.5, 8.0), rng.uniform(0.0, 20.0)
    m = run_metrics(_records(rng, 16, 24, issue, gap), 32768)
    assert m.clock_ghz == pytest.approx(GHZ, rel=1e-3)
    assert m.t_iss_us == pytest.approx(issue, rel=1e-3, abs=2e-3)
    assert m.gap_us == pytest.approx(gap, rel=1e-3, abs=2e-3)
    assert m.t_period_us == pytest.approx(issue + gap, rel=1e-3, abs=2e-3)
    assert m.volume == 16 * 32768


def test_isolated_completion():
    rng = np.random.default_rng()
    drained = rng.uniform(1.0, 10.0)
    m = run_metrics(_records(rng, 8, 8, 0.7, 0.0, drained), 4096, isolated=True)
    assert m.completion_us == pytest.approx(0.7 + drained, rel=1e-3)


def test_incomplete_or_non_monotone_records_are_errors():
    rng = np.random.default_rng()
    rec = _records(rng, 4, 6, 1.0, 1.0)
    bad = rec.copy()
    bad[2, 3, :] = 0
    with pytest.raises(RecordError, match="never written"):
        check_records(bad)
    bad = rec.copy()
    bad[1, 2, 3] = bad[1, 2, 2] - 5
    with pytest.raises(RecordError, match="monotone"):
        check_records(bad)


def _synthetic_measurements(rng, r, q, sm=132):
    """Measurements the Burst-Gap model would produce for (R, T_iss0(B) linear in B, Q), with 1% noise."""
    def t0(b):
        return 0.25 + 0.6 * b / 32768

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
            out.append(meas("rate", "remote", k, b, 0.05, noisy(max(t0(b), v / r))))
        elif p.mode == "gap":
            g = p.gap * 0.004 if p.gap_kind == "fma" else p.gap * 1e-3
            t = t0(b) if p.target == "local" else noisy(model.t_iss(g, v, t0(b), r))
            out.append(meas("gap", p.target, k, b, g, t, p.gap_kind))
        else:
            t = t0(b) if p.target == "local" else noisy(model.t_iss_isolated(v, t0(b), r, q))
            out.append(meas("isolated", p.target, k, b, 0.0, t))
    return out


def test_fit_recovers_model_and_predicts_without_refit():
    rng = np.random.default_rng()
    r = rng.uniform(300e3, 700e3)          # bytes/µs
    q = rng.uniform(2.0, 4.0) * (1 << 20)  # bytes
    meas = _synthetic_measurements(rng, r, q)
    fit = fit_profile(meas, 132, {"source": "measured", "device": "synthetic", "world_size": 2, "date": "x"})
    assert fit.profile.drain_rate == pytest.approx(r, rel=0.03)
    caps = {c.producers: c.capacity_bytes for c in fit.profile.capacity_points}
    assert caps[132] == pytest.approx(q, rel=0.15)
    assert fit.errors["gap_t_period"]["median"] < 0.05
    assert fit.errors["gap_t_period"]["max"] < 0.15


@pytest.mark.parametrize("kwargs,match", [
    (dict(bytes_per_producer=1000), "multiple of 16"),
    (dict(bytes_per_producer=1024), "multiple of 2048"),
    (dict(producers=133), r"\[1, 132\]"),
    (dict(bursts=4096), "exceeds"),
])
def test_bad_configurations_are_rejected(kwargs, match):
    p = Point(**{**dict(mode="gap", target="remote", producers=132, bytes_per_producer=32768), **kwargs})
    with pytest.raises(ValueError, match=match):
        validate_point(p, sm_count=132, buffer_bytes=512 << 20, threads=128)


def test_default_sweep_is_valid():
    for p in default_sweep(132):
        validate_point(p, 132, 512 << 20, 128)


def test_repeats_are_aggregated_by_median():
    from calibrate.fit import aggregate_repeats

    rng = np.random.default_rng()
    base = {"mode": "gap", "target": "remote", "gap_kind": "fma", "producers": 8, "bytes_per_producer": 4096,
            "gap": 64, "bursts": 24, "sender": 0, "receiver": 1}
    vals = rng.uniform(1.0, 2.0, size=3)
    runs = [{**base, "repeat": i, "metrics": {"t_iss_us": float(v), "producers": 8}} for i, v in enumerate(vals)]
    other = {**base, "sender": 1, "receiver": 0, "repeat": 0, "metrics": {"t_iss_us": 5.0, "producers": 8}}
    agg = aggregate_repeats(runs + [other])
    assert len(agg) == 2
    mine = next(a for a in agg if a["sender"] == 0)
    assert mine["repeats"] == 3 and mine["metrics"]["t_iss_us"] == pytest.approx(float(np.median(vals)))
    assert mine["metrics"]["producers"] == 8


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_all_to_all_deals_every_producer_to_one_peer(world):
    from calibrate.bench import peer_order, producers_to

    rng = np.random.default_rng()
    k = int(rng.integers(1, 133))
    for sender in range(world):
        peers = peer_order(sender, world)
        assert sorted(peers) == [j for j in range(world) if j != sender]
        dealt = [producers_to(sender, j, k, world) for j in range(world)]
        assert dealt[sender] == []
        assert sorted(x for d in dealt for x in d) == list(range(k))
        sizes = [len(d) for j, d in enumerate(dealt) if j != sender]
        assert max(sizes) - min(sizes) <= 1  # the peers share the producers evenly


def test_finish_fits_all_to_all_injection_beside_the_pair(tmp_path):
    """calibrate.run.finish on synthetic pairwise + all-to-all measurements (the all-to-all ones drain at
    a different, random rate): both profiles are written and the summary recovers the ratio."""
    import json

    from calibrate.profile import load_profile
    from calibrate.run import finish

    rng = np.random.default_rng()
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
    assert main.drain_rate == pytest.approx(r_pair, rel=0.03)
    assert other.drain_rate == pytest.approx(r_all, rel=0.03)
    summary = json.loads((tmp_path / "calibration.json").read_text())["fit_quality"]["all_to_all"]
    assert summary["rate_vs_pairwise"] == pytest.approx(r_all / r_pair, rel=0.05)
    assert summary["drain_rate_GBps_per_peer"] == pytest.approx(summary["drain_rate_GBps_per_sender"])
