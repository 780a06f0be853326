"""CPU checks of the flash-a2a benchmark (benchmarks/flash_a2a_bench.py) and its report: the console line, the
derived columns, the slope test, the model predictions, the table and the figure, run on results shaped like a
real run (seeded random numbers, so nothing here is a recorded result); and its command line without a GPU."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest

from benchmarks import flash_a2a_bench as bench
from benchmarks import report, timing
from benchmarks.variant_sets import parse_variants
from xstage import cli


def _rng(seed: int) -> random.Random:
    print(f"seed={seed}")
    return random.Random(seed)


def _fake_rows(slope_cc: float, rng: random.Random):
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
    row = _fake_rows(1.0, _rng(101))[0]
    line = bench.summary_line(row)
    assert "fa_ours=" in line and "round_times" not in line and "exact=True" in line


def test_slope_test_recovers_the_slope_and_plot_writes(tmp_path):
    rng = _rng(102)
    slope = rng.uniform(0.5, 3.0)
    rows = _fake_rows(slope, rng)
    result = report.slope_test(rows)
    for h in ("3", "12"):
        assert result[h]["cc_minus_fused_us"]["slope"] == pytest.approx(slope, abs=0.05)
        assert abs(result[h]["fused_E_res_us"]["slope"]) < 2.0
    out = {"rows": rows, "slope_test": result}
    json.dumps(out)
    report.plot(out, str(tmp_path / "f.png"))
    assert (tmp_path / "f.png").stat().st_size > 10_000


def test_pair_stats_recovers_a_small_residual_under_drift():
    """A residual of 0.3% under a slow ±5% drift shared by both kernels of a pair: the paired median finds
    it; the difference of the two medians would not be reliable."""
    rng = _rng(103)
    base, excess, n = rng.uniform(1e3, 4e4), 0.003, 25
    drift = [1 + 0.05 * (2 * i / n - 1) for i in range(n)]
    rng.shuffle(drift)
    firsts = [base * d * (1 + rng.gauss(0, 2e-4)) for d in drift]
    seconds = [base * d * (1 + excess + rng.gauss(0, 2e-4)) for d in drift]
    st = timing.pair_stats(firsts, seconds)
    assert st["median_us"] == pytest.approx(base * excess, rel=0.25)
    assert st["q1_us"] <= st["median_us"] <= st["q3_us"] and st["pairs"] == n
    with pytest.raises(ValueError):
        timing.pair_stats([1.0], [])


def test_pair_stats_crossover_split_cancels_a_position_effect():
    """Alternating launch order with a position effect p (the kernel launched second runs p slower) and a
    residual e: the two orders' medians are e + p and e - p; the order-balanced value recovers e and
    position_effect_us recovers p, and every pair's difference is kept with its order."""
    rng = _rng(104)
    base, n = rng.uniform(1e3, 4e4), 64
    e, p = base * rng.uniform(0.001, 0.004), base * rng.uniform(0.004, 0.01)
    order = [i % 2 == 0 for i in range(n)]
    firsts, seconds = [], []
    for f in order:
        a = base * (1 + rng.gauss(0, 1e-4))
        b = a + e + rng.gauss(0, 1e-4 * base)
        firsts.append(a + (0 if f else p))  # the first kernel ran second in the odd pairs
        seconds.append(b + (p if f else 0))
    st = timing.pair_stats(firsts, seconds, first_ran_first=order)
    assert st["order_balanced_us"] == pytest.approx(e, rel=0.2)
    assert st["position_effect_us"] == pytest.approx(p, rel=0.2)
    assert st["median_first_ran_first_us"] > st["median_second_ran_first_us"]
    assert len(st["diffs_us"]) == n and {o for _, o in st["diffs_us"]} == {0, 1}
    with pytest.raises(ValueError):
        timing.pair_stats(firsts, seconds, first_ran_first=order[:-1])


def test_model_predictions_follow_eqs_17_to_20():
    """E_drain vanishes above M*_ub and the completion-coupled E_cc grows with the number of output waves,
    from the shipped H200 profile (with its fitted T_lat) and a random sigma."""
    from calibrate.profile import resolve_profile

    profile = resolve_profile("h200x2")
    assert profile.fit_quality.get("completion_latency_us") is not None
    sigma = _rng(105).uniform(0.8, 2.5)
    rows = []
    for h_loc in (3, 12):
        for s in (8192, 16384, 65536):
            row = {"seq_len": s, "heads_per_rank": h_loc, "world": 2, "sigma_us_per_kv_tile": sigma,
                   "fa_ours_us": 1000.0, "tiles_per_cta": (s // 128) * h_loc / 132}
            row.update(report.model_predictions(row, profile, 132))
            rows.append(row)
    for r in rows:
        assert r["seq_len"] >= r["model_M_star_ub"] and r["model_E_drain_us"] == 0.0
    # aligned waves of 132 x 32 KiB: E_cc per wave is the same at every M, so E_cc scales with the waves
    per_wave = {r["model_E_cc_us"] / r["tiles_per_cta"] for r in rows if r["tiles_per_cta"] >= 1}
    assert max(per_wave) == pytest.approx(min(per_wave), rel=1e-9) and min(per_wave) > 0


def test_replot_writes_beside_its_input_and_never_over_it(tmp_path, capsys):
    """--replot recomputes the model columns and the slope test into <name>.replot.json and redraws the figure
    as <name>.replot.png; the saved result (a tracked file) keeps its bytes, and its figure is not redrawn."""
    rng = _rng(106)
    rows = _fake_rows(1.0, rng)
    for r in rows:
        r["sigma_us_per_kv_tile"] = rng.uniform(0.8, 2.5)
    path = tmp_path / "fa.json"
    path.write_text(json.dumps({"rows": rows, "profile": "h200x2", "provenance": {"git_commit": "abc"}}))
    before = path.read_bytes()
    assert cli.main(["bench", "flash-a2a", "--replot", str(path)]) == 0
    assert path.read_bytes() == before and not (tmp_path / "fa.png").exists()
    out = json.loads((tmp_path / "fa.replot.json").read_text())
    assert (tmp_path / "fa.replot.png").stat().st_size > 10_000
    assert out["provenance"] == {"git_commit": "abc"} and out["replotted"]["from"] == "fa.json"
    assert set(out["slope_test"]) == {"3", "12"} and all("model_E_drain_us" in r for r in out["rows"])
    assert "fa.replot.json" in capsys.readouterr().out


def test_markdown_table_has_one_line_per_row_with_its_numbers(tmp_path, capsys):
    rng = _rng(107)
    rows = _fake_rows(1.0, rng)
    for r in rows:
        r["fa4_us"] = r["fa_ours_us"] * rng.uniform(0.9, 1.1)
        r["serial_fa4_nccl_us"] = r["fa4_us"] + 40.0
    rows[-1]["fused_E_res_round_paired_us"] = 123.0
    rows[-1]["fa4_over_ours_paired"] = 0.9876
    rows[-1]["speedup_fused_over_serial_ours_nccl"] = 1.01
    rows[-1]["speedup_fused_over_serial_fa4_nccl"] = 1.02
    rows[-1]["speedup_fused_over_serial_fa4_nccl_paired"] = 1.0345
    rows[-1]["cudnn_us"] = 2 * rows[-1]["fa_ours_us"]  # cuDNN in one row only: its column stays, dashed elsewhere
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"rows": rows}))
    capsys.readouterr()  # the seed line
    lines = report.markdown_table_file(str(path)).splitlines()
    assert len(lines) == 2 + len(rows)
    n_cols = lines[0].count("|")
    assert all(line.count("|") == n_cols for line in lines)
    first = lines[2].split(" | ")
    assert first[0] == "| 3" and first[1] == "8K"
    assert first[5] == f"{rows[0]['fa4_us'] / rows[0]['fa_ours_us']:.3f}"  # T_FA4 / T_ours
    assert "[rounds +123]" in lines[-1]
    assert "[pairs 0.988]" in lines[-1] and "[pairs" not in lines[2]
    assert "[pairs 1.034]" in lines[-1].split(" | ")[-1]  # the speedup over serial FA4 + NCCL from pairs
    assert first[4] == "–" and lines[-1].split(" | ")[4] != "–"  # a column a row lacks prints as a dash
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert "cuDNN" in header and "post A2A NCCL / symm" not in header  # a column no row has is left out
    assert cli.main(["bench", "flash-a2a", "--table", str(path)]) == 0  # the same through the command
    assert capsys.readouterr().out.splitlines() == lines


def test_alternated_residuals_replace_round_paired_ones_for_every_fused_column():
    rng = _rng(108)
    variants = {"self": {"mode": "piggyback", "self_store": True}, "nosplit": {"tail_split": False}}
    cols = bench.fused_residual_columns(variants)
    assert cols == ["fused", "fused_self"], cols  # FA-only variants have no residual
    paired = {c: rng.uniform(-50, 50) for c in cols}
    alt = {c: rng.uniform(-50, 50) for c in cols}
    cc = rng.uniform(0, 100)
    row = {c + "_E_res_us": paired[c] for c in cols}
    row["fused_cc_minus_fused_us"] = -1.0
    row["alternated"] = {**{f"{c}_minus_fa_ours": {"median_us": alt[c]} for c in cols},
                         "fused_cc_minus_fused": {"median_us": cc}}
    bench.apply_alternated(row, cols)
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
    bench.apply_alternated(row, cols)
    assert abs(row["fa4_over_ours_paired"] - (t_ours + diff) / t_ours) < 1e-12
    assert abs(row["speedup_fused_over_serial_fa4_nccl_paired"] - (t_fused + gap) / t_fused) < 1e-12
    assert "fused_over_fa4_paired" not in row  # needs the fused-against-ours pair's kernel times too
    e_res = rng.uniform(-50, 50)
    row["alternated"]["fused_minus_fa_ours"] = {"first_median_us": t_ours * 1.01, "median_us": e_res}
    bench.apply_alternated(row, cols)
    expected = ((t_ours * 1.01 + e_res) / (t_ours * 1.01)) / ((t_ours + diff) / t_ours)  # T_fused / T_FA4
    assert abs(row["fused_over_fa4_paired"] - expected) < 1e-12
    short = {"fused_E_res_us": 3.0}  # no alternated block (--pairs 0): nothing replaced
    bench.apply_alternated(short, cols)
    assert short == {"fused_E_res_us": 3.0}


def test_alternated_pairs_name_only_captured_columns():
    variants = {"self": {"mode": "piggyback", "self_store": True}, "nosplit": {"tail_split": False}}
    every = ["fa_ours", "fa_ours_plain_order", "fa4", "serial_ours_nccl", "serial_fa4_nccl", "fused", "fused_cc",
             "fused_self", "fa_ours_nosplit"]
    pairs = bench.alternated_pairs(variants, every)
    assert pairs["fused_minus_fa_ours"] == ("fa_ours", "fused")
    assert pairs["fused_self_minus_fa_ours"] == ("fa_ours", "fused_self")
    assert pairs["fa_ours_nosplit_minus_fa_ours"] == ("fa_ours", "fa_ours_nosplit")
    assert pairs["serial_ours_nccl_minus_fa_plain"] == ("fa_ours_plain_order", "serial_ours_nccl")
    fa_only = bench.alternated_pairs(variants, ["fa_ours", "fa4", "fa_ours_nosplit"])  # one GPU: no peer columns
    assert set(fa_only) == {"fa4_minus_fa_ours", "fa_ours_nosplit_minus_fa_ours"}


def test_derive_takes_residuals_and_hiding_from_the_pairs():
    """E_res and the serial excess from the alternated pairs where the row has them (the round-paired E_res
    kept beside), H = 1 - E_res / excess with its interval; sigma, TFLOP/s and the speedups from the medians."""
    rng = _rng(109)
    s, h_loc, n_tiles, grid = 16384, 3, 384, 132
    t_fa, e_round, e_pair, excess = rng.uniform(1e3, 3e3), rng.uniform(5, 10), rng.uniform(1, 4), rng.uniform(60, 90)
    rounds = 5
    times = {"fa_ours": [t_fa + i for i in range(rounds)], "fa_ours_plain_order": [t_fa] * rounds,
             "fused": [t_fa + i + e_round for i in range(rounds)], "serial_ours_nccl": [t_fa + 999.0] * rounds}
    diffs_f = [[round(e_pair + rng.gauss(0, 0.2), 3), i % 2] for i in range(20)]
    diffs_s = [[round(excess + rng.gauss(0, 0.2), 3), i % 2] for i in range(20)]
    med = lambda d: sorted(x for x, _ in d)[len(d) // 2]  # noqa: E731 - the upper median, as pair_stats takes it
    row = {"seq_len": s, "heads_per_rank": h_loc, "head_dim": 128, "fa_ours_us": t_fa + 2, "fused_us": t_fa + 9,
           "serial_ours_nccl_us": t_fa + 80,
           "alternated": {"fused_minus_fa_ours": {"median_us": med(diffs_f), "diffs_us": diffs_f},
                          "serial_ours_nccl_minus_fa_plain": {"median_us": med(diffs_s), "diffs_us": diffs_s}}}
    bench.derive(row, times, {}, n_tiles, grid)
    assert row["fused_E_res_round_paired_us"] == pytest.approx(e_round)
    assert row["fused_E_res_us"] == med(diffs_f) and row["serial_ours_nccl_excess_us"] == med(diffs_s)
    assert row["hiding_ratio"] == pytest.approx(1 - med(diffs_f) / med(diffs_s))
    lo, hi = row["hiding_ratio_ci95"]
    assert lo <= row["hiding_ratio"] <= hi
    assert row["sigma_us_per_kv_tile"] == pytest.approx((t_fa + 2) * grid / (n_tiles * s // 128))
    assert row["speedup_fused_over_serial_ours_nccl"] == pytest.approx((t_fa + 80) / (t_fa + 9))
    assert row["fa_ours_tflops"] == pytest.approx(4.0 * s * s * h_loc * 128 / ((t_fa + 2) * 1e-6) / 1e12)
    fa_only = {"seq_len": s, "heads_per_rank": h_loc, "head_dim": 128, "fa_ours_us": t_fa}  # one GPU
    bench.derive(fa_only, {"fa_ours": [t_fa] * rounds}, {}, n_tiles, grid)
    assert "hiding_ratio" not in fa_only and "fused_cc_minus_fused_us" not in fa_only
    assert fa_only["tiles_per_cta"] == pytest.approx(n_tiles / grid)


def test_decided_fields_read_the_config_or_the_old_dict():
    @dataclass(frozen=True)
    class Config:  # the fields of flash_a2a.config.AttentionConfig the bench reads
        tail_split: bool
        split_k: int
        store: str
        relay: bool

    class Plan:
        def __str__(self):
            return "rounds+tail"

    assert bench.decided_fields(Config(True, 3, "st", True)) == {
        "fused_tail_split": "launch", "fused_split_k": 3, "fused_store": "st", "fused_relay": True}
    assert bench.decided_fields(Config(False, 1, "paced", False)) == {
        "fused_tail_split": False, "fused_split_k": 1, "fused_store": "paced", "fused_relay": False}
    assert bench.decided_fields({"tail_split": "launch", "store": "st", "relay": False}) == {
        "fused_tail_split": "launch", "fused_store": "st", "fused_relay": False}
    assert bench.decided_fields(Config(Plan(), 2, "st", False))["fused_tail_split"] == "rounds+tail"


def test_variant_output_errors_check_every_real_variant_and_skip_the_control():
    """Each --variants column's output against its reference (fused against the post-A2A reference, FA-only
    against ours), the self-store control left out, a failing variant recorded."""
    import torch

    seed = 110
    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    ref_fa, ref_fused = torch.randn(1, 64, 2, 8, generator=gen), torch.randn(1, 32, 4, 8, generator=gen)
    off = 0.25 + torch.rand((), generator=gen).item()
    variants = {"nosplit": {"tail_split": False}, "fnosplit": {"mode": "piggyback", "tail_split": False},
                "self": {"mode": "piggyback", "self_store": True}, "bad": {"mode": "piggyback", "store": "bulk"}}

    def run_fused(kn):
        if kn.get("store") == "bulk":
            raise ValueError("store must be 'auto', 'st' or 'paced'")
        out = ref_fused.clone()
        out[0, 3, 1, 2] += off
        return out

    errors = bench.variant_output_errors(variants, run_fused, lambda kn: ref_fa.clone(), ref_fused, ref_fa)
    assert set(errors) == {"nosplit", "fnosplit", "bad"}, errors
    assert errors["nosplit"] == 0.0 and abs(errors["fnosplit"] - off) < 1e-6
    assert errors["bad"].startswith("ValueError") and "store" in errors["bad"]
    row = {"heads_per_rank": 3, "seq_len": 8192, "fa_ours_us": 150.0, "variant_max_abs_diff": errors}
    assert "variant_max_abs_diff=" in bench.summary_line(row)


def test_pair_launchers_replay_one_call_graphs_and_fall_back_per_column():
    """Paired columns launch as one-call graph replays; a column whose capture fails is called directly."""
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
    launch, kinds = timing.pair_launchers(fns, capture)
    assert kinds == {"fa_ours": "graph", "fused": "graph", "nccl": "eager (RuntimeError)"}
    calls.clear()
    for name in ("fused", "nccl", "fa_ours"):
        launch[name]()
    assert calls == [("replay", "fused"), ("call", "nccl"), ("replay", "fa_ours")]


def test_variants_from_a_string_or_a_file(tmp_path):
    text = '{"nosplit": {"tail_split": false}, "self": {"mode": "piggyback", "self_store": true}}'
    (tmp_path / "set.json").write_text(text)
    expected = {"nosplit": {"tail_split": False}, "self": {"mode": "piggyback", "self_store": True}}
    assert parse_variants(text) == expected
    assert parse_variants(str(tmp_path / "set.json"), bench.BUILT_IN) == expected
    with pytest.raises(ValueError, match="more than once"):
        parse_variants('{"a": {"tail_split": false}, "a": {"tail_split": true}}')
    with pytest.raises(OSError):
        parse_variants(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("text,fragment", [
    ('{"pin40": {"pin_softmax": 40}}', "pin_softmax not an option of the FA-only kernel"),
    ('{"nosig": {"mode": "piggyback", "signal": false}}', "signal not an option of the fused kernel"),
    ('{"lagv": {"lag_v": true}}', "lag_v not an option"),
    ('{"selfonly": {"self_store": true}}', "self_store not an option of the FA-only kernel"),  # no mode: FA-only
    ('{"plain_order": {"tail_split": false}}', "built-in column 'fa_ours_plain_order'"),
    ('{"cc": {"mode": "completion_coupled"}}', "built-in column 'fused_cc'"),
    ('[1, 2]', "expected"),
])
def test_variants_refuse_removed_knobs_and_taken_names(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_variants(text, bench.BUILT_IN)


def _one_line_error(capsys, fragment):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("xstage: error:") and fragment in lines[0], err


@pytest.mark.parametrize("argv,fragment", [
    (["--seq-lens", "1000"], "multiples of 128"),
    (["--heads-per-rank", "0"], "heads per rank positive"),
    (["--skip", "fa_ours_no_overlap"], "--skip: no column fa_ours_no_overlap"),
    (["--variants", '{"x": {"mode": "piggyback", "early_done": true}}'], "early_done not an option"),
    (["--variants", "no/such/set.json"], "argument --variants"),
    (["--split", "r.json"], "unrecognized arguments: --split"),
    (["--alternate-min-us", "0"], "unrecognized arguments: --alternate-min-us"),
    (["--table", "no/such/result.json"], "cannot read no/such/result.json"),
    (["--replot", "no/such/result.json"], "cannot replot no/such/result.json"),
])
def test_bad_bench_input_is_one_line_and_exit_2(argv, fragment, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "flash-a2a", *argv]) == 2
    _one_line_error(capsys, fragment)
    try:  # python -m benchmarks.flash_a2a_bench refuses it too (argparse's own exit for bad options)
        code = bench.main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2 and fragment.split(": ")[-1] in capsys.readouterr().err


def test_skip_takes_variant_columns(capsys):
    """--skip accepts a variant's column; the check runs before anything needs a GPU."""
    args = bench_args(["--variants", '{"self": {"mode": "piggyback", "self_store": true}}', "--skip", "fused_self",
                       "fa4"])
    bench.check_columns(args)  # no error
    assert bench.peer_columns(args.variants)[-1] == "fused_self"
    assert set(bench.PEER_COLUMNS) < set(bench.BUILT_IN) and "fa_ours" not in bench.peer_columns({})


def bench_args(argv):
    import argparse

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(argv)


def test_pool_hiding_through_the_command(tmp_path, capsys):
    from benchmarks import hiding

    rng = _rng(111)
    f, s = [rng.gauss(20, 5) for _ in range(20)], [rng.gauss(400, 5) for _ in range(20)]
    row = {"heads_per_rank": 12, "seq_len": 49152, "fused_tail_split": False, "fused_store": "st",
           "fused_relay": False,
           "alternated": {hiding.FUSED: {"diffs_us": [[x, i % 2] for i, x in enumerate(f)]},
                          hiding.SERIAL: {"diffs_us": [[x, i % 2] for i, x in enumerate(s)]}}}
    for name in ("a", "b"):
        (tmp_path / f"{name}.json").write_text(json.dumps({"provenance": {"git_commit": name}, "rows": [row]}))
    assert cli.main(["bench", "flash-a2a", "--pool-hiding", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "| 12 | 48K |" in out and "a, b" in out and "40, 40" in out


def test_columns_call_the_public_api_with_the_fused_tile_order(monkeypatch):
    """Every column's call, with recording stand-ins for the kernels: FA-only in the fused kernel's order is
    flash_attention(tile_order_world=P, tile_order_rank=rank); fused columns launch sender-side (wait=False)
    except fused_visible; variants add their knobs; one GPU gets the attention columns only."""
    import flash_a2a

    calls = []
    monkeypatch.setattr(flash_a2a, "flash_attention", lambda q, k, v, **kw: calls.append(("fa", kw)) or "o")
    monkeypatch.setattr(flash_a2a, "nccl_post_a2a", lambda o, group: calls.append(("nccl", o, group)))
    monkeypatch.setattr(flash_a2a, "pre_attention_a2a", lambda x, group: calls.append(("pre_nccl", x, group)))

    class Fused:
        def launch(self, q, k, v, **kw):
            calls.append(("fused", kw))

    class A2A:
        def __call__(self, o):
            calls.append(("symm", o))

        def pre(self, x, slot):
            calls.append(("pre_symm", x, slot))

    variants = {"nosplit": {"tail_split": False}, "self": {"mode": "piggyback", "self_store": True}}
    fa4 = lambda q, k, v: calls.append(("fa4",)) or "o4"  # noqa: E731
    cols = bench._columns("q", "k", "v", "o", ["x0", "x1", "x2"], 2, 1, "g", Fused(), A2A(), variants, fa4)
    assert set(cols) == set(bench.BUILT_IN) | {"fa_ours_nosplit", "fused_self"}
    expect = {
        "fa_ours": [("fa", {"out": "o", "tile_order_world": 2, "tile_order_rank": 1})],
        "fa_ours_plain_order": [("fa", {"out": "o"})],
        "fa_ours_nosplit": [("fa", {"out": "o", "tile_order_world": 2, "tile_order_rank": 1, "tail_split": False})],
        "fa4": [("fa4",)],
        "a2a_nccl": [("nccl", "o", "g")],
        "a2a_symm": [("symm", "o")],
        "pre_a2a_nccl": [("pre_nccl", x, "g") for x in ("x0", "x1", "x2")],
        "pre_a2a_symm": [("pre_symm", x, i) for i, x in enumerate(("x0", "x1", "x2"))],
        "serial_ours_nccl": [("fa", {"out": "o"}), ("nccl", "o", "g")],
        "serial_fa4_nccl": [("fa4",), ("nccl", "o4", "g")],
        "fused": [("fused", {"mode": "piggyback", "wait": False})],
        "fused_cc": [("fused", {"mode": "completion_coupled", "wait": False})],
        "fused_visible": [("fused", {"mode": "piggyback", "wait": True})],
        "fused_self": [("fused", {"wait": False, "mode": "piggyback", "self_store": True})],
    }
    for name, want in expect.items():
        calls.clear()
        cols[name]()
        assert calls == want, name
    one_gpu = bench._columns("q", "k", "v", "o", [], 1, 0, "g", None, None, {"nosplit": {"tail_split": False}}, None)
    assert set(one_gpu) == {"fa_ours", "fa_ours_plain_order", "cudnn", "fa_ours_nosplit"}
