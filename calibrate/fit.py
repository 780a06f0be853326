"""Fit the platform model from calibration measurements, then predict the gap sweeps with no refit.

Measurements are dicts ``{"mode": "rate"|"gap"|"isolated", "target": "remote"|"local",
"gap_kind": "fma"|"spin", "metrics": RunMetrics.to_dict()}`` (see ``calibrate.bench``).

- R: one least-squares line through the origin, T_period = V/R, over all zero-gap (``rate``) remote runs
  with V >= ``min_rate_volume`` (the drain-dominated points; no per-curve fitting). T_period there is the
  delivered aggregate period (``t_period_agg_us``) where recorded, else the per-producer period.
- T_iss0(K, V): the recovered plateau of each remote FMA-gap curve (runs whose gap is at least
  ``plateau_factor`` x V/R), plus isolated remote bursts that the local control shows free of backpressure.
- T_lat (eq. 17, in ``fit_quality``): completion minus issue minus V/R of the smallest isolated bursts.
- Q(K): isolated remote bursts above the knee (issue time beyond the local control's) satisfy eq. 7,
  T_iss = (V - Q)/R, so Q = V - R T_iss; the median over those points. With no point above the knee,
  Q is only bounded below and the fit says so.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from calibrate import model
from calibrate.profile import CapacityPoint, IssuePoint, PlatformProfile

BACKPRESSURE_RATIO = 1.25   # remote isolated issue time above this multiple of the local control ...
BACKPRESSURE_FLOOR_US = 0.1  # ... and this many µs beyond it counts as backpressured


@dataclass
class FitResult:
    profile: PlatformProfile
    rate_points: list[dict]
    predictions: list[dict]
    errors: dict
    notes: list[str] = field(default_factory=list)


def _m(meas: dict) -> dict:
    return meas["metrics"]


def _select(measurements, mode, target="remote", gap_kind=None):
    return [m for m in measurements if m["mode"] == mode and m["target"] == target
            and (gap_kind is None or m.get("gap_kind") == gap_kind)]


def _steady_period(metrics: dict) -> float:
    agg = metrics.get("t_period_agg_us")
    return agg if agg is not None and np.isfinite(agg) else metrics["t_period_us"]


def fit_drain_rate(measurements, min_rate_volume: float = 1 << 20) -> tuple[float, list[dict]]:
    """R in bytes/µs from zero-gap steady-state periods, T = V / R (one fit across all K and B)."""
    pts = [m for m in _select(measurements, "rate") if _m(m)["volume_bytes"] >= min_rate_volume]
    if len(pts) < 2:
        raise ValueError(f"need >= 2 zero-gap remote runs with V >= {min_rate_volume} bytes to fit R, "
                         f"got {len(pts)}")
    v = np.array([_m(m)["volume_bytes"] for m in pts], dtype=float)
    t = np.array([_steady_period(_m(m)) for m in pts], dtype=float)
    slope = float(v @ t / (v @ v))  # µs per byte
    rate = 1.0 / slope
    used = [{"producers": _m(m)["producers"], "bytes_per_producer": _m(m)["bytes_per_producer"],
             "volume_bytes": _m(m)["volume_bytes"], "t_period_us": _steady_period(_m(m)),
             "fit_t_period_us": _m(m)["volume_bytes"] / rate} for m in pts]
    return rate, used


def _curves(measurements, mode, target, gap_kind=None):
    curves = defaultdict(list)
    for m in _select(measurements, mode, target, gap_kind):
        curves[(_m(m)["producers"], _m(m)["bytes_per_producer"])].append(m)
    return curves


def fit_t_iss0(measurements, drain_rate: float, plateau_factor: float = 1.5) -> list[IssuePoint]:
    points = {}
    for (k, b), runs in _curves(measurements, "gap", "remote", "fma").items():
        v = k * b
        recovered = [r for r in runs if _m(r)["gap_us"] >= plateau_factor * v / drain_rate]
        if not recovered:
            recovered = [max(runs, key=lambda r: _m(r)["gap_us"])]
        points[(k, b)] = IssuePoint(k, b, float(np.median([_m(r)["t_iss_us"] for r in recovered])))
    local = {key: runs for key, runs in _curves(measurements, "isolated", "local").items()}
    for (k, b), runs in _curves(measurements, "isolated", "remote").items():
        if (k, b) in points or (k, b) not in local:
            continue
        t_rem = float(np.median([_m(r)["t_iss_us"] for r in runs]))
        t_loc = float(np.median([_m(r)["t_iss_us"] for r in local[(k, b)]]))
        if not backpressured(t_rem, t_loc):
            points[(k, b)] = IssuePoint(k, b, t_rem)
    if not points:
        raise ValueError("no gap-sweep or isolated remote runs to read T_iss0 from")
    return sorted(points.values(), key=lambda p: (p.producers, p.bytes_per_producer))


def backpressured(t_remote_us: float, t_local_us: float) -> bool:
    return t_remote_us > BACKPRESSURE_RATIO * t_local_us + BACKPRESSURE_FLOOR_US


def fit_capacity(measurements, drain_rate: float) -> tuple[list[CapacityPoint], dict]:
    local = _curves(measurements, "isolated", "local")
    points, detail = [], {}
    for k_val in sorted({k for k, _ in _curves(measurements, "isolated", "remote")}):
        rows = []
        for (k, b), runs in sorted(_curves(measurements, "isolated", "remote").items()):
            if k != k_val or (k, b) not in local:
                continue
            t_rem = float(np.median([_m(r)["t_iss_us"] for r in runs]))
            t_loc = float(np.median([_m(r)["t_iss_us"] for r in local[(k, b)]]))
            rows.append((b, k * b, t_rem, t_loc, backpressured(t_rem, t_loc)))
        if not rows:
            continue
        above = [r for r in rows if r[4]]
        if above:
            q = float(np.median([v - drain_rate * t for _, v, t, _, _ in above]))
            knee_b = min(r[0] for r in above)
            points.append(CapacityPoint(k_val, max(q, 0.0), float(knee_b)))
            detail[str(k_val)] = {"knee_bytes_per_producer": knee_b, "capacity_bytes": q, "lower_bound": False,
                                  "points_above_knee": len(above)}
        else:
            b, v, t, _, _ = max(rows)
            q = float(model.q_peak(v, t, drain_rate))
            points.append(CapacityPoint(k_val, q, None))
            detail[str(k_val)] = {"capacity_bytes": q, "lower_bound": True,
                                  "note": f"no backpressure up to {b} B/producer: Q >= q_peak there"}
    if not points:
        raise ValueError("no isolated remote runs with a local control to read Q from")
    return points, detail


def fit_completion_latency(measurements, drain_rate: float, max_drain_us: float = 0.5) -> float | None:
    """T_lat of eq. 17: the fixed part of remote completion, from isolated remote bursts small enough that
    draining them takes under ``max_drain_us``: median of (completion − issue − V/R). None without any."""
    vals = [_m(m)["completion_us"] - _m(m)["t_iss_us"] - _m(m)["volume_bytes"] / drain_rate
            for m in _select(measurements, "isolated")
            if _m(m).get("completion_us") is not None and _m(m)["volume_bytes"] / drain_rate <= max_drain_us]
    return float(np.median(vals)) if vals else None


def _rel(pred, meas):
    return abs(pred - meas) / meas if meas > 0 else float("nan")


def predict(profile: PlatformProfile, measurements) -> tuple[list[dict], dict]:
    """Eqs. (1)-(3) on every remote gap run and eq. (7) on every isolated run, from the fitted profile."""
    r = profile.drain_rate
    rows = []
    for m in _select(measurements, "gap") + _select(measurements, "isolated"):
        mm = _m(m)
        k, v, g = mm["producers"], mm["volume_bytes"], mm["gap_us"]
        t0 = float(profile.t_iss0(k, v))
        row = {"mode": m["mode"], "gap_kind": m.get("gap_kind"), "producers": k,
               "bytes_per_producer": mm["bytes_per_producer"], "volume_bytes": v, "gap_us": g,
               "t_iss_us": mm["t_iss_us"], "t_period_us": mm["t_period_us"]}
        if m["mode"] == "gap":
            row["pred_t_iss_us"] = float(model.t_iss(g, v, t0, r))
            row["pred_t_period_us"] = float(model.t_period(g, v, t0, r))
            row["pred_t_period_cc_us"] = float(model.t_period_completion_coupled(g, v, r))
            row["err_t_period"] = _rel(row["pred_t_period_us"], mm["t_period_us"])
        else:
            row["pred_t_iss_us"] = float(model.t_iss_isolated(v, t0, r, float(profile.capacity(k))))
        row["err_t_iss"] = _rel(row["pred_t_iss_us"], mm["t_iss_us"])
        rows.append(row)

    def stats(key, mode):
        e = np.array([x[key] for x in rows if x["mode"] == mode and key in x and np.isfinite(x[key])])
        return {"median": float(np.median(e)), "max": float(e.max()), "n": int(e.size)} if e.size else None

    errors = {"gap_t_period": stats("err_t_period", "gap"), "gap_t_iss": stats("err_t_iss", "gap"),
              "isolated_t_iss": stats("err_t_iss", "isolated")}
    return rows, errors


POINT_KEYS = ("mode", "target", "gap_kind", "producers", "bytes_per_producer", "gap", "bursts", "sender", "receiver")


def aggregate_repeats(measurements) -> list[dict]:
    """One measurement per sweep point and GPU pair: the median of every metric over the point's repeats
    (repeats of the whole sweep share everything in POINT_KEYS)."""
    groups: dict = defaultdict(list)
    for m in measurements:
        groups[tuple(m.get(k) for k in POINT_KEYS)].append(m)
    out = []
    for runs in groups.values():
        first = runs[0]
        metrics = {}
        for key, val in first["metrics"].items():
            vals = [r["metrics"][key] for r in runs]
            metrics[key] = float(np.median(vals)) if isinstance(val, float) else val
        out.append({**{k: v for k, v in first.items() if k not in ("metrics", "repeat")},
                    "repeats": len(runs), "metrics": metrics})
    return out


def fit_profile(measurements, sm_count: int, provenance: dict, anchors: dict | None = None,
                min_rate_volume: float = 1 << 20) -> FitResult:
    """Fit and predict on the per-point medians of the repeated sweep."""
    measurements = aggregate_repeats(measurements)
    rate, used = fit_drain_rate(measurements, min_rate_volume)
    issue_points = fit_t_iss0(measurements, rate)
    capacity_points, cap_detail = fit_capacity(measurements, rate)
    profile = PlatformProfile(
        drain_rate_GBps=float(model.bytes_per_us_to_gbps(rate)), t_iss0_points=issue_points,
        capacity_points=capacity_points, sm_count=int(sm_count), provenance=dict(provenance),
        anchors=dict(anchors or {}),
    )
    rows, errors = predict(profile, measurements)
    profile.fit_quality = {"rate_fit_points": len(used), "capacity": cap_detail, "prediction_errors": errors,
                           "completion_latency_us": fit_completion_latency(measurements, rate)}
    return FitResult(profile=profile, rate_points=used, predictions=rows, errors=errors)
