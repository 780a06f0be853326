"""The design test's kernel presets, verdicts and figure (calibrate/design.py).

The presets restate our fused kernel's tile walk without importing flash_a2a; here it is checked tile by tile
against the kernel's own walk function and round by round against the measured per-round remote volumes.
"""

import importlib
import json
from pathlib import Path

import numpy as np
import pytest

from calibrate import design, model
from calibrate.design import (KernelBurst, burst_shapes, design_figure, evaluate, flash_a2a_burst, presets,
                              remote_tiles_per_round, select_presets)
from calibrate.model import MIB
from calibrate.profile import load_builtin

REPO = Path(__file__).resolve().parents[2]
MEASURED = REPO / "benchmarks" / "results" / "h200x2" / "flash_a2a.json"
TILE_BYTES = 128 * 128 * 2


def kernel_walks():
    """The kernel's tile walk, ``tile_coords(t, world, n_mb_per_rank, h_loc, rank, n_tiles, grid)``, wherever it
    lives now (the scheduler module in cute_kernels, or flash_a2a.mapping before the move)."""
    found = []
    for module in ("cute_kernels.tile_scheduler", "flash_a2a.mapping"):
        try:
            walk = getattr(importlib.import_module(module), "tile_coords", None)
        except ImportError:
            continue
        if walk is not None:
            found.append(pytest.param(walk, id=module))
    return found or [pytest.param(None, marks=pytest.mark.skip(
        reason="no tile_coords in cute_kernels.tile_scheduler or flash_a2a.mapping: point this test at the "
               "kernel walk's new home"))]


# (world, row blocks per rank, heads per rank, batch, grid): one round, partial rounds, full rounds, grids that
# P does not divide, and the local tail longer or shorter than a round.
WALK_SHAPES = [(p, n_mb, h, b, grid) for p in (2, 4)
               for n_mb, h, b in ((1, 3, 1), (4, 3, 1), (8, 12, 1), (16, 3, 2), (2, 1, 1), (32, 12, 1))
               for grid in (132, 64, 7)]


@pytest.mark.parametrize("walk", kernel_walks())
def test_remote_share_per_round_counts_the_kernels_own_walk(walk):
    for world, n_mb, h_loc, batch, grid in WALK_SHAPES:
        n_tiles = n_mb * world * h_loc * batch
        grid = min(grid, n_tiles)
        for rank in range(world):
            dest = np.array([walk(t, world, n_mb, h_loc, rank, n_tiles, grid)[3] for t in range(n_tiles)])
            remote = dest != rank
            shape = (world, n_mb, h_loc, batch, grid, rank)
            np.testing.assert_array_equal(design.fused_tile_is_remote(n_tiles, world, grid, rank), remote,
                                          err_msg=f"(P, n_mb, h_loc, b, grid, rank) = {shape}")
            per_round = [int(remote[r * grid:(r + 1) * grid].sum()) for r in range(-(-n_tiles // grid))]
            assert remote_tiles_per_round(n_tiles, world, grid, rank) == per_round, shape
            last_round = n_tiles - (n_tiles - 1) // grid * grid
            local_last = last_round - per_round[-1]
            assert local_last == min(last_round, n_tiles // world), f"{shape}: the walk ends on local tiles"
            full_share = [c for r, c in enumerate(per_round)
                          if (r + 1) * grid <= design.fused_walk_stretches(n_tiles, world, grid)[0]]
            if grid % world == 0:  # destination fastest: (P-1)/P of every first-stretch round goes to peers
                assert all(c == grid * (world - 1) // world for c in full_share), (shape, per_round)


def test_remote_tiles_per_round_match_the_measured_spans():
    if not MEASURED.is_file():
        pytest.skip(f"{MEASURED.relative_to(REPO)} is not in this checkout")
    rows = json.loads(MEASURED.read_text())["rows"]
    checked = 0
    for row in rows:
        rounds = (row.get("spans") or {}).get("rounds")
        if not rounds:
            continue
        n_tiles = row["seq_len"] // 128 * row["heads_per_rank"]
        counts = remote_tiles_per_round(n_tiles, row["world"], min(n_tiles, 132))
        measured = [r["remote_MiB"] * MIB / TILE_BYTES for r in rounds]
        assert counts == pytest.approx(measured), (row["heads_per_rank"], row["seq_len"])
        checked += 1
    if not checked:
        pytest.skip(f"no row of {MEASURED.name} has per-round spans")


@pytest.mark.parametrize("world,wave", [(2, 66), (4, 99)])
def test_kernel_presets_burst_is_the_remote_share_of_a_round(world, wave):
    profile = load_builtin("h200x2")
    sigma = 1.6
    burst = flash_a2a_burst(profile, 65536, 12, sigma, world=world)
    assert burst.name == f"fa-a2a-p{world}-h12-m65536"
    assert (burst.producers, burst.bytes_per_producer) == (wave, TILE_BYTES)
    assert burst.volume_bytes / MIB == pytest.approx(wave / 32)  # 32 tiles of 32 KiB per MiB
    assert burst.gap_us == pytest.approx(65536 / 128 * sigma)  # one Q-loop: S/128 KV blocks x sigma
    counts = burst.extra["remote_tiles_per_round"]
    assert len(counts) == -(-65536 // 128 * 12 // 132) and counts[-1] == 0
    last = burst.extra["last_remote_round"]
    assert last["round"] == len(counts) - 2 and last["producers"] == counts[-2] > wave


def test_kernel_preset_without_a_full_wave_takes_its_one_remote_round():
    # 3 heads/8K at P = 2: 192 tiles, 132 + 60; round 0 is 36 first-stretch remote tiles + 60 remote-stretch ones.
    burst = flash_a2a_burst(load_builtin("h200x2"), 8192, 3, 1.6)
    assert burst.extra["remote_tiles_per_round"] == [96, 0]
    assert burst.producers == 96


def test_kernel_presets_reject_shapes_the_kernel_cannot_walk():
    profile = load_builtin("h200x2")
    with pytest.raises(ValueError, match="multiple of P x 128"):
        flash_a2a_burst(profile, 8192 + 128, 3, 1.6, world=2)
    with pytest.raises(ValueError, match="sends no tile to a peer"):
        flash_a2a_burst(profile, 8192, 3, 1.6, world=1)


def test_h200x2_verdicts_piggyback_on_the_capacity_bound():
    """At P = 2 on H200 a round's 66 x 32 KiB exceed Q(66); the excess costs eq. 7's issue time once per round,
    against a whole Q-loop of gap: the rate bound holds, the capacity bound decides, and the verdict is piggyback
    except at 3 heads/8K, whose only remote round is 96 tiles."""
    profile = load_builtin("h200x2")
    sigma = design.fa_sigma_us(profile)
    results = {b.name: evaluate(profile, b) for b in select_presets(profile, ["fa-a2a"])}
    assert len(results) == 10
    rate, t0 = profile.drain_rate, float(profile.t_iss0(66, 66 * TILE_BYTES))
    q66 = float(profile.capacity(66))
    assert q66 == pytest.approx(1458052.9, rel=1e-6)  # the profile's measured Q at K = 66
    for name, r in results.items():
        assert r["rate_ok"] and not r["capacity_ok"] and r["decided_by"] == "capacity", name
        assert r["overhead"] == 0.0 and r["gap"] >= 100.0 > r["recovery_gap"], name
        if r["producers"] == 66:
            assert r["volume_MiB"] == pytest.approx(2.0625)
            assert r["capacity"] == pytest.approx(q66)
            assert r["t_iss_isolated"] == pytest.approx((66 * TILE_BYTES - q66) / rate)
            assert r["capacity_overhead"] == pytest.approx((66 * TILE_BYTES - q66) / rate - t0)
            assert r["verdict"] == "piggyback", name
    odd = results["fa-a2a-p2-h3-m8192"]
    assert odd["producers"] == 96 and odd["verdict"] == "reshape"
    assert odd["cost_fraction"] == pytest.approx(odd["capacity_overhead"] / (odd["t_iss0"] + odd["capacity_overhead"]
                                                                              + 8192 / 128 * sigma))
    # The strict eq. 10 (tolerance 0) says reshape wherever a bound fails; a 5% tolerance piggybacks them all.
    assert {evaluate(profile, b, 0.0)["verdict"] for b in select_presets(profile, ["fa-a2a"])} == {"reshape"}
    assert {evaluate(profile, b, 0.05)["verdict"] for b in select_presets(profile, ["fa-a2a"])} == {"piggyback"}


def test_paper_presets_keep_the_papers_audit():
    profile = load_builtin("paper")
    names = set(presets(profile))
    assert {f"paper-fa-a2a-m{s}" for s in design.FA_SEQ_LENS} <= names
    fa = evaluate(profile, presets(profile)["paper-fa-a2a-m8192"])
    assert fa["verdict"] == "piggyback" and fa["decided_by"] == "none" and fa["producers"] == 148
    assert fa["capacity_overhead"] == 0.0 and fa["t_iss_isolated"] == pytest.approx(0.76)


def test_eq7_columns_follow_the_model():
    profile = load_builtin("h200x2")
    for burst in select_presets(profile, ["all"]):
        r = evaluate(profile, burst)
        v, t0, q, rate = r["volume"], r["t_iss0"], r["capacity"], profile.drain_rate
        assert r["t_iss_isolated"] == pytest.approx(float(model.t_iss_isolated(v, t0, rate, q))), burst.name
        assert r["capacity_overhead"] == pytest.approx(max((v - q) / rate - t0, 0.0), abs=1e-12), burst.name
        assert r["capacity_ok"] == (r["capacity_overhead"] == 0.0), burst.name
        assert r["overhead"] == pytest.approx(float(model.issue_overhead(r["gap"], v, t0, rate))), burst.name
        deciding = {"rate": r["overhead"], "capacity": r["capacity_overhead"], "none": 0.0}[r["decided_by"]]
        assert deciding == max(r["overhead"], r["capacity_overhead"]), burst.name


# --- figure ---------------------------------------------------------------------------


def _visible_axes(fig):
    return [ax for ax in fig.axes if ax.get_visible()]


def _artists_with_gid(ax, prefix):
    return [a for a in (*ax.lines, *ax.patches, *ax.texts, *ax.collections) if (a.get_gid() or "").startswith(prefix)]


def test_figure_has_one_panel_per_distinct_burst_shape():
    import matplotlib.pyplot as plt

    profile = load_builtin("h200x2")
    bursts = select_presets(profile, ["fa-a2a"])
    groups = burst_shapes(bursts)
    # 16K-64K: 3 and 12 heads per rank share (66, 32 KiB, Q-loop); 8K: 96 tiles at 3 heads, 66 at 12.
    assert len(bursts) == 10 and len(groups) == 6
    assert all(len({b.shape for b in g}) == 1 for g in groups)
    fig = design_figure(profile, bursts)
    try:
        axes = _visible_axes(fig)
        assert len(axes) == 6
        title = next(ax.get_title() for ax in axes if "m16384" in ax.get_title())
        assert "fa-a2a-p2-h3-m16384" in title and "fa-a2a-p2-h12-m16384" in title
        twin = KernelBurst("twin", bursts[1].producers, bursts[1].bytes_per_producer, bursts[1].gap_us)
        assert len(burst_shapes([bursts[1], twin])) == 1
        assert len(burst_shapes([bursts[1], KernelBurst("other", 66, TILE_BYTES, bursts[1].gap_us + 1)])) == 2
    finally:
        plt.close(fig)


@pytest.mark.parametrize("gap_us,fails", [
    (200.0, {"capacity"}),          # a Q-loop of gap: only the capacity bound fails
    (2.0, {"rate", "capacity"}),    # a short gap: both fail
])
def test_figure_marks_the_failing_bound_with_value_and_margin(gap_us, fails):
    import matplotlib.pyplot as plt

    profile = load_builtin("h200x2")
    burst = KernelBurst("probe", 66, TILE_BYTES, gap_us)
    r = evaluate(profile, burst)
    fig = design_figure(profile, [burst])
    try:
        (ax,) = _visible_axes(fig)
        for bound in ("rate", "capacity"):
            marked = _artists_with_gid(ax, f"failing-bound:{bound}")
            assert bool(marked) == (bound in fails), bound
        if "capacity" in fails:
            marked = _artists_with_gid(ax, "failing-bound:capacity")
            (line,) = [a for a in marked if a in ax.lines]
            assert line.get_ydata()[0] == pytest.approx(r["t_iss_isolated"])
            (text,) = [a.get_text() for a in marked if a in ax.texts]
            assert f"{r['q_peak_MiB']:.2f}" in text and f"{r['capacity_MiB']:.2f}" in text
            assert f"by {r['q_peak_MiB'] - r['capacity_MiB']:.2f} MiB" in text
            assert f"+{r['capacity_overhead']:.2f} µs" in text
        if "rate" in fails:
            marked = _artists_with_gid(ax, "failing-bound:rate")
            (span,) = [a for a in marked if a in ax.patches]
            if hasattr(span, "get_width"):  # a Rectangle (matplotlib >= 3.9), else a Polygon
                xs = [span.get_x(), span.get_x() + span.get_width()]
            else:
                xs = np.asarray(span.get_xy())[:, 0]
            assert min(xs) == pytest.approx(gap_us) and max(xs) == pytest.approx(r["recovery_gap"])
            (text,) = [a.get_text() for a in marked if a in ax.texts]
            assert f"{r['recovery_gap'] - gap_us:.2f} µs short" in text and f"+{r['overhead']:.2f} µs" in text
        decides = [a.get_text() for a in ax.texts if "(decides)" in a.get_text()]
        assert len(decides) == 1 and decides[0].startswith(f"{r['decided_by']} bound fails")
        assert not _artists_with_gid(ax, "bounds-hold")
    finally:
        plt.close(fig)


def test_figure_says_when_both_bounds_hold():
    import matplotlib.pyplot as plt

    profile = load_builtin("paper")
    fig = design_figure(profile, [presets(profile)["paper-fa-a2a-m8192"]])
    try:
        (ax,) = _visible_axes(fig)
        assert _artists_with_gid(ax, "bounds-hold") and not _artists_with_gid(ax, "failing-bound:")
    finally:
        plt.close(fig)
