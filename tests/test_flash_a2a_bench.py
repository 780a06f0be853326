"""CPU checks of the flash-a2a benchmark's reporting: the console line, the slope test and the figure,
run on a result shaped like a real run (random numbers, so nothing here is a recorded result)."""
from __future__ import annotations

import json
import random

import pytest

from flash_a2a import bench


def _fake_rows(slope_cc: float):
    rng = random.Random()
    rows = []
    for h_loc in (3, 12):
        for s in (8192, 16384, 32768, 65536):
            tiles = (s // 128) * h_loc / 132
            t_fa = rng.uniform(100, 1e4)
            row = {"seq_len": s, "heads_per_rank": h_loc, "world": 2, "head_dim": 128, "timing": {},
                   "fa_ours_us": t_fa, "fused_us": t_fa + 3, "fused_E_res_us": rng.uniform(-2, 2),
                   "fused_cc_E_res_us": 5.0, "fused_cc_minus_fused_us": slope_cc * tiles + rng.uniform(-0.1, 0.1),
                   "serial_ours_nccl_excess_us": 50.0, "hiding_ratio": 0.95, "tiles_per_cta": tiles,
                   "fused_exact_vs_serial": True, "model_M_star_ub": 800.0,
                   "round_times": {"fa_ours": [t_fa] * 3}}
            rows.append(row)
    return rows


def test_summary_line_skips_non_numeric_fields():
    row = _fake_rows(1.0)[0]
    line = bench.summary_line(row)
    assert "fa_ours=" in line and "round_times" not in line and "exact=True" in line


def test_slope_test_recovers_the_slope_and_plot_writes(tmp_path):
    slope = random.uniform(0.5, 3.0)
    rows = _fake_rows(slope)
    result = bench.slope_test(rows)
    for h in ("3", "12"):
        assert result[h]["cc_minus_fused_us"]["slope"] == pytest.approx(slope, abs=0.05)
        assert abs(result[h]["fused_E_res_us"]["slope"]) < 2.0
    out = {"rows": rows, "slope_test": result}
    json.dumps(out)
    bench.plot(out, str(tmp_path / "f.png"))
    assert (tmp_path / "f.png").stat().st_size > 10_000


def test_pair_stats_recovers_a_small_residual_under_drift():
    """A residual of 0.3% under a slow ±5% drift shared by both kernels of a pair: the paired median finds
    it; the difference of the two medians would not be reliable."""
    rng = random.Random()
    base, excess, n = rng.uniform(1e3, 4e4), 0.003, 25
    drift = [1 + 0.05 * (2 * i / n - 1) for i in range(n)]
    rng.shuffle(drift)
    firsts = [base * d * (1 + rng.gauss(0, 2e-4)) for d in drift]
    seconds = [base * d * (1 + excess + rng.gauss(0, 2e-4)) for d in drift]
    st = bench.pair_stats(firsts, seconds)
    assert st["median_us"] == pytest.approx(base * excess, rel=0.25)
    assert st["q1_us"] <= st["median_us"] <= st["q3_us"] and st["pairs"] == n
    with pytest.raises(ValueError):
        bench.pair_stats([1.0], [])


def test_pair_stats_crossover_split_cancels_a_position_effect():
    """Alternating launch order with a position effect p (the kernel launched second runs p slower) and a
    residual e: the two orders' medians are e + p and e - p; the order-balanced value recovers e and
    position_effect_us recovers p, and every pair's difference is kept with its order."""
    rng = random.Random()
    base, n = rng.uniform(1e3, 4e4), 64
    e, p = base * rng.uniform(0.001, 0.004), base * rng.uniform(0.004, 0.01)
    order = [i % 2 == 0 for i in range(n)]
    firsts, seconds = [], []
    for f in order:
        a = base * (1 + rng.gauss(0, 1e-4))
        b = a + e + rng.gauss(0, 1e-4 * base)
        firsts.append(a + (0 if f else p))  # the first kernel ran second in the odd pairs
        seconds.append(b + (p if f else 0))
    st = bench.pair_stats(firsts, seconds, first_ran_first=order)
    assert st["order_balanced_us"] == pytest.approx(e, rel=0.2)
    assert st["position_effect_us"] == pytest.approx(p, rel=0.2)
    assert st["median_first_ran_first_us"] > st["median_second_ran_first_us"]
    assert len(st["diffs_us"]) == n and {o for _, o in st["diffs_us"]} == {0, 1}
    with pytest.raises(ValueError):
        bench.pair_stats(firsts, seconds, first_ran_first=order[:-1])


def test_model_predictions_follow_eqs_17_to_20(tmp_path):
    """E_drain vanishes above M*_ub and the completion-coupled E_cc grows with the number of output waves,
    from the shipped H200 profile (with its fitted T_lat) and a random sigma; replot redraws a saved result."""
    from calibrate.profile import resolve_profile

    profile = resolve_profile("h200x2")
    assert profile.fit_quality.get("completion_latency_us") is not None
    sigma = random.uniform(0.8, 2.5)
    rows = []
    for h_loc in (3, 12):
        for s in (8192, 16384, 65536):
            row = {"seq_len": s, "heads_per_rank": h_loc, "world": 2, "sigma_us_per_kv_tile": sigma,
                   "fa_ours_us": 1000.0, "fused_E_res_us": 1.0, "fused_cc_minus_fused_us": 2.0,
                   "tiles_per_cta": (s // 128) * h_loc / 132}
            row.update(bench.model_predictions(row, profile, 132))
            rows.append(row)
    for r in rows:
        assert r["seq_len"] >= r["model_M_star_ub"] and r["model_E_drain_us"] == 0.0
    # aligned waves of 132 x 32 KiB: E_cc per wave is the same at every M, so E_cc scales with the waves
    per_wave = {r["model_E_cc_us"] / r["tiles_per_cta"] for r in rows if r["tiles_per_cta"] >= 1}
    assert max(per_wave) == pytest.approx(min(per_wave), rel=1e-9) and min(per_wave) > 0
    path = tmp_path / "fa.json"
    path.write_text(json.dumps({"rows": rows, "profile": "h200x2"}))
    png = bench.replot(str(path))
    assert (tmp_path / "fa.png").stat().st_size > 10_000 and png.endswith("fa.png")
    assert "slope_test" in json.loads(path.read_text())


def test_markdown_table_has_one_line_per_row_with_its_numbers(tmp_path):
    from flash_a2a.report import markdown_table_file

    rows = _fake_rows(1.0)
    rng = random.Random()
    for r in rows:
        r["fa4_us"] = r["fa_ours_us"] * rng.uniform(0.9, 1.1)
        r["serial_fa4_nccl_us"] = r["fa4_us"] + 40.0
    rows[-1]["fused_E_res_round_paired_us"] = 123.0
    rows[-1]["fa4_over_ours_paired"] = 0.9876
    rows[-1]["speedup_fused_over_serial_ours_nccl"] = 1.01
    rows[-1]["speedup_fused_over_serial_fa4_nccl"] = 1.02
    rows[-1]["speedup_fused_over_serial_fa4_nccl_paired"] = 1.0345
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"rows": rows}))
    lines = markdown_table_file(str(path)).splitlines()
    assert len(lines) == 2 + len(rows)
    n_cols = lines[0].count("|")
    assert all(line.count("|") == n_cols for line in lines)
    first = lines[2].split(" | ")
    assert first[0] == "| 3" and first[1] == "8K"
    assert first[5] == f"{rows[0]['fa4_us'] / rows[0]['fa_ours_us']:.3f}"  # T_FA4 / T_ours
    assert "[rounds +123]" in lines[-1]
    assert "[pairs 0.988]" in lines[-1] and "[pairs" not in lines[2]
    assert "[pairs 1.034]" in lines[-1].split(" | ")[-1]  # the speedup over serial FA4 + NCCL from pairs
    assert "–" in lines[2]  # columns a row lacks (cuDNN here) print as a dash, not a crash


def test_alternated_residuals_replace_round_paired_ones_for_every_fused_column():
    from flash_a2a.bench import apply_alternated, fused_residual_columns

    rng = random.Random()
    variants = {"self": {"mode": "piggyback", "self_store": True}, "pin40": {"pin_softmax": 40}}
    cols = fused_residual_columns(variants)
    assert cols == ["fused", "fused_self"], cols  # FA-only variants have no residual
    paired = {c: rng.uniform(-50, 50) for c in cols}
    alt = {c: rng.uniform(-50, 50) for c in cols}
    cc = rng.uniform(0, 100)
    row = {c + "_E_res_us": paired[c] for c in cols}
    row["fused_cc_minus_fused_us"] = -1.0
    row["alternated"] = {**{f"{c}_minus_fa_ours": {"median_us": alt[c]} for c in cols},
                         "fused_cc_minus_fused": {"median_us": cc}}
    apply_alternated(row, cols)
    for c in cols:
        assert row[c + "_E_res_us"] == alt[c] and row[c + "_E_res_round_paired_us"] == paired[c]
    assert row["fused_cc_minus_fused_us"] == cc
    # FA4 against ours from the same adjacent pairs: T_FA4 / T_ours from ours' median and the paired difference
    t_ours, diff = rng.uniform(500, 40000), rng.uniform(-2000, 2000)
    row["alternated"]["fa4_minus_fa_ours"] = {"first_median_us": t_ours, "median_us": diff,
                                              "second_median_us": t_ours + diff + 7.0}
    t_fused, gap = rng.uniform(500, 40000), rng.uniform(0, 900)
    row["alternated"]["serial_fa4_nccl_minus_fused"] = {"first_median_us": t_fused, "median_us": gap,
                                                        "second_median_us": t_fused + gap}
    apply_alternated(row, cols)
    assert abs(row["fa4_over_ours_paired"] - (t_ours + diff) / t_ours) < 1e-12
    assert abs(row["speedup_fused_over_serial_fa4_nccl_paired"] - (t_fused + gap) / t_fused) < 1e-12
    assert "fused_over_fa4_paired" not in row  # needs the fused-against-ours pair's kernel times too
    e_res = rng.uniform(-50, 50)
    row["alternated"]["fused_minus_fa_ours"] = {"first_median_us": t_ours * 1.01, "median_us": e_res}
    apply_alternated(row, cols)
    expected = ((t_ours * 1.01 + e_res) / (t_ours * 1.01)) / ((t_ours + diff) / t_ours)  # T_fused / T_FA4
    assert abs(row["fused_over_fa4_paired"] - expected) < 1e-12
    short = {"fused_E_res_us": 3.0}  # short kernels: no alternated block, nothing replaced
    apply_alternated(short, cols)
    assert short == {"fused_E_res_us": 3.0}


def test_residual_split_takes_the_controls_apart():
    from flash_a2a.report import residual_split

    rng = random.Random()
    code, flags, link, link_noflags = (rng.uniform(0, 10) for _ in range(4))
    row = {"fused_self_nosig_E_res_us": code, "fused_self_E_res_us": code + flags,
           "fused_E_res_us": code + flags + link, "fused_nosig_E_res_us": code + link_noflags}
    split = residual_split(row)
    assert split["epilogue code"] == pytest.approx(code) and split["flag protocol"] == pytest.approx(flags)
    assert split["NVLink stores"] == pytest.approx(link)
    assert split["NVLink stores, no flags"] == pytest.approx(link_noflags)
    assert split["total"] == pytest.approx(code + flags + link)
    assert "ready wait" not in split  # faparts' columns absent
    ready, fence = rng.uniform(0, 5), rng.uniform(0, 5)
    row.update(fused_self_done_E_res_us=code + flags - ready, fused_self_donenf_E_res_us=code + flags - ready - fence)
    split = residual_split(row)
    assert split["ready wait"] == pytest.approx(ready) and split["completion fence"] == pytest.approx(fence)
    assert split["data flags"] == pytest.approx(flags - ready - fence)
    assert residual_split({"fused_E_res_us": 1.0}) == {"total": 1.0}  # no controls: nothing to split


def test_variant_output_errors_check_every_real_variant_and_skip_the_controls():
    """Each --variants column's output against its reference (fused against the post-A2A reference,
    FA-only against ours), controls without the attention's output left out, a failing variant recorded."""
    import torch

    from flash_a2a.bench import summary_line, variant_output_errors

    ref_fa, ref_fused = torch.randn(1, 64, 2, 8), torch.randn(1, 32, 4, 8)
    off = 0.25 + torch.rand(()).item()
    variants = {"pin40": {"pin_softmax": 40}, "fpin40": {"mode": "piggyback", "pin_softmax": 40},
                "self": {"mode": "piggyback", "self_store": True}, "nosig": {"mode": "piggyback", "signal": False},
                "bad": {"mode": "piggyback", "tile_n": 96}}

    def run_fused(kn):
        if kn.get("tile_n") == 96:
            raise ValueError("tile_n must be 128 or 160")
        out = ref_fused.clone()
        out[0, 3, 1, 2] += off
        return out

    errors = variant_output_errors(variants, run_fused, lambda kn: ref_fa.clone(), ref_fused, ref_fa)
    assert set(errors) == {"pin40", "fpin40", "bad"}, errors
    assert errors["pin40"] == 0.0 and abs(errors["fpin40"] - off) < 1e-6
    assert errors["bad"].startswith("ValueError") and "tile_n" in errors["bad"]
    row = {"heads_per_rank": 3, "seq_len": 8192, "fa_ours_us": 150.0, "variant_max_abs_diff": errors}
    assert "variant_max_abs_diff=" in summary_line(row)


def test_pair_launchers_replay_one_call_graphs_and_fall_back_per_column():
    """Paired columns launch as one-call graph replays; a column whose capture fails is called directly, and
    "eager" captures nothing."""
    from flash_a2a.bench import pair_launchers

    calls = []

    class Graph:
        def __init__(self, name):
            self.name = name

        def replay(self):
            calls.append(("replay", self.name))

    def capture(fn):
        name = fn()
        return (None, "eager (RuntimeError)") if name == "nccl" else (Graph(name), "graph")

    fns = {name: (lambda name=name: calls.append(("call", name)) or name) for name in ("fa_ours", "fused", "nccl")}
    launch, kinds = pair_launchers(fns, "graph", capture)
    assert kinds == {"fa_ours": "graph", "fused": "graph", "nccl": "eager (RuntimeError)"}
    calls.clear()
    for name in ("fused", "nccl", "fa_ours"):
        launch[name]()
    assert calls == [("replay", "fused"), ("call", "nccl"), ("replay", "fa_ours")]
    launch, kinds = pair_launchers(fns, "eager", lambda fn: (_ for _ in ()).throw(AssertionError("captured")))
    assert set(kinds.values()) == {"eager"} and launch["fused"] is fns["fused"]
