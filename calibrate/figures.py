"""The paper's Figure 3 panels from calibration measurements and the fitted profile (matplotlib, Agg)."""
from __future__ import annotations

import os
from collections import defaultdict

import numpy as np

from calibrate import model

MIB = 1 << 20


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _curves(points, mode, target, gap_kind=None):
    out = defaultdict(list)
    for p in points:
        if p["mode"] == mode and p["target"] == target and (gap_kind is None or p["gap_kind"] == gap_kind):
            out[(p["producers"], p["bytes_per_producer"])].append(p["metrics"])
    return {k: sorted(v, key=lambda m: m["gap_us"]) for k, v in sorted(out.items())}


def plot_issue_vs_gap(ax, points, profile):
    r = profile.drain_rate
    for i, ((k, b), ms) in enumerate(_curves(points, "gap", "remote", "fma").items()):
        c = f"C{i}"
        g = np.array([m["gap_us"] for m in ms])
        ax.plot(g, [m["t_iss_us"] for m in ms], "o", color=c, label=f"remote K={k}, B={b // 1024} KiB")
        gg = np.linspace(0, max(g.max(), 1e-3), 200)
        ax.plot(gg, model.t_iss(gg, k * b, float(profile.t_iss0(k, k * b)), r), "-", color=c, lw=1)
        loc = _curves(points, "gap", "local", "fma").get((k, b), [])
        if loc:
            ax.plot([m["gap_us"] for m in loc], [m["t_iss_us"] for m in loc], "x", color=c, alpha=0.7,
                    label=f"local control K={k}, B={b // 1024} KiB")
    spin = _curves(points, "gap", "remote", "spin")
    for (k, b), ms in spin.items():
        ax.plot([m["gap_us"] for m in ms], [m["t_iss_us"] for m in ms], "^", mfc="none", color="k",
                label=f"remote, globaltimer-spin gap K={k}, B={b // 1024} KiB")
    ax.set_xlabel("producer-side gap G (µs)")
    ax.set_ylabel("sender-visible issue time T_iss (µs)")
    ax.set_title("(a) issue time vs gap; lines: max(T_iss0, V/R − G)")


def plot_period_vs_gap(ax, points, profile):
    r = profile.drain_rate
    for i, ((k, b), ms) in enumerate(_curves(points, "gap", "remote", "fma").items()):
        c = f"C{i}"
        g = np.array([m["gap_us"] for m in ms])
        ax.plot(g, [m["t_period_us"] for m in ms], "o", color=c, label=f"K={k}, B={b // 1024} KiB")
        gg = np.linspace(0, max(g.max(), 1e-3), 200)
        t0 = float(profile.t_iss0(k, k * b))
        ax.plot(gg, model.t_period(gg, k * b, t0, r), "-", color=c, lw=1)
        ax.plot(gg, model.t_period_completion_coupled(gg, k * b, r), "--", color=c, lw=0.8, alpha=0.6)
        ax.axvline(float(model.recovery_gap(k * b, t0, r)), color=c, ls=":", lw=0.8)
    ax.set_xlabel("producer-side gap G (µs)")
    ax.set_ylabel("start-to-start period T_period (µs)")
    ax.set_title("(b) period; solid: max(T_iss0+G, V/R), dashed: G+V/R, dotted: G*")


def plot_isolated(ax, points, profile):
    r = profile.drain_rate
    remote = _curves(points, "isolated", "remote")
    local = _curves(points, "isolated", "local")
    by_k = defaultdict(list)
    for (k, b), ms in remote.items():
        by_k[k].append((k * b, float(np.median([m["t_iss_us"] for m in ms])),
                        float(np.median([m["t_iss_us"] for m in local.get((k, b), ms)]))))
    for i, (k, rows) in enumerate(sorted(by_k.items())):
        c = f"C{i}"
        rows.sort()
        v = np.array([x[0] for x in rows], dtype=float)
        ax.plot(v / MIB, [x[1] for x in rows], "o-", color=c, label=f"remote K={k}")
        ax.plot(v / MIB, [x[2] for x in rows], "x:", color=c, alpha=0.7, label=f"local control K={k}")
        vv = np.linspace(v.min(), v.max(), 200)
        q = float(profile.capacity(k))
        ax.plot(vv / MIB, model.t_iss_isolated(vv, profile.t_iss0(k, vv), r, q), "-", color=c, lw=0.8, alpha=0.5)
        for p in profile.capacity_points:
            if p.producers == k and p.knee_bytes_per_producer:
                ax.axvline(k * p.knee_bytes_per_producer / MIB, color=c, ls="--", lw=0.8)
    ax.set_xlabel("aggregate burst volume V (MiB)")
    ax.set_ylabel("isolated-burst issue time (µs)")
    ax.set_title("(c) isolated bursts after a checked drain; dashed: knee")


def plot_rate(ax, points, profile, rate_points):
    by_k = defaultdict(list)
    for p in points:
        if p["mode"] == "rate" and p["target"] == "remote":
            mt = p["metrics"]
            agg = mt.get("t_period_agg_us")
            by_k[p["producers"]].append((mt["volume_bytes"], agg if agg == agg and agg is not None else mt["t_period_us"]))
    vmax = 0
    for i, (k, rows) in enumerate(sorted(by_k.items())):
        rows.sort()
        ax.plot([x[0] / MIB for x in rows], [x[1] for x in rows], "o", color=f"C{i}", label=f"K={k}")
        vmax = max(vmax, rows[-1][0])
    vv = np.linspace(0, vmax, 100)
    ax.plot(vv / MIB, vv / profile.drain_rate, "k-", lw=1,
            label=f"V/R, R = {profile.drain_rate_GBps:.0f} GB/s ({len(rate_points)} points)")
    ax.set_xlabel("aggregate burst volume V (MiB)")
    ax.set_ylabel("zero-gap delivered period (µs)")
    ax.set_title("(d) drain-dominated period vs volume")


def plot_figure3(points, profile, rate_points, out_dir) -> list[str]:
    """Write the four panels (fig3a..d) and a combined fig3.png; returns the paths."""
    plt = _plt()
    os.makedirs(out_dir, exist_ok=True)
    panels = [("fig3a_issue_vs_gap.png", lambda ax: plot_issue_vs_gap(ax, points, profile)),
              ("fig3b_period_vs_gap.png", lambda ax: plot_period_vs_gap(ax, points, profile)),
              ("fig3c_isolated_knee.png", lambda ax: plot_isolated(ax, points, profile)),
              ("fig3d_rate_fit.png", lambda ax: plot_rate(ax, points, profile, rate_points))]
    paths = []
    fig_all, axes = plt.subplots(2, 2, figsize=(15, 11))
    device = profile.provenance.get("device", "")
    for (name, draw), ax_all in zip(panels, axes.flat):
        fig, ax = plt.subplots(figsize=(7.5, 5.5))
        for a in (ax, ax_all):
            draw(a)
            a.grid(alpha=0.3)
            a.legend(fontsize=7)
        fig.suptitle(f"X-Stage calibration, {device}", fontsize=9)
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    fig_all.suptitle(f"X-Stage calibration (Figure 3), {device}")
    fig_all.tight_layout()
    path = os.path.join(out_dir, "fig3.png")
    fig_all.savefig(path, dpi=110)
    plt.close(fig_all)
    return paths + [path]
