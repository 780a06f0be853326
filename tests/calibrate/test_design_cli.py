"""The design test through the ``xstage`` command (its parser and runner live in calibrate/cli.py), in-process
and as ``python -m xstage``. The command's other subcommands: tests/test_xstage_cli.py."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from calibrate.design import KernelBurst, evaluate, presets, select_presets
from calibrate.profile import load_builtin
from xstage import cli

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path):
    assert path.is_file() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == PNG_MAGIC


def run_module(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "xstage", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def assert_one_line_error(stderr: str, fragment: str):
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xstage: error:") and fragment in lines[0], stderr


# --- design module ---------------------------------------------------------------------


def test_presets_reproduce_the_paper_audit():
    profile = load_builtin("paper")
    fa = evaluate(profile, presets(profile)["paper-fa-a2a-m8192"])
    assert fa["verdict"] == "piggyback" and fa["producers"] == 148
    assert fa["q_peak_MiB"] == pytest.approx(4.1, rel=0.05) and fa["capacity_MiB"] == pytest.approx(4.25, rel=0.05)
    assert fa["recovery_gap"] == pytest.approx(6.0, rel=0.05)
    assert fa["m_star_ub_tokens"] == pytest.approx(1000, rel=0.05)
    moe = evaluate(profile, presets(profile)["megamoe-qwen3.5"])
    assert moe["verdict"] == "reshape" and not moe["rate_ok"] and "rate bound fails" in moe["reason"]
    assert moe["decided_by"] == "rate" and moe["overhead"] == pytest.approx(148 * 32768 / 717e3 - 4.24 - 0.76)
    assert moe["cost_fraction"] == pytest.approx(moe["overhead"] / (148 * 32768 / 717e3))  # drain-limited period
    assert moe["interleave_sufficient"] and moe["interleaved_overhead_us"] == 0.0


def test_select_presets_families_and_sigma_override():
    profile = load_builtin("paper")
    ours, paper, moe = (select_presets(profile, [family]) for family in ("fa-a2a", "paper-fa-a2a", "megamoe"))
    assert [b.name for b in ours] == [f"fa-a2a-p2-h{h}-m{s}" for h in (3, 12) for s in (8192, 16384, 32768, 49152,
                                                                                         65536)]
    # the paper's seven MegaMoE shapes, then our kernel's three at EP = 2 and 8
    assert len(paper) == 5 and len(moe) == 7 + 6
    ours_moe = select_presets(profile, ["megamoe-ours"])
    assert [b.name for b in ours_moe] == [f"megamoe-ours-{m}-p{p}" for m in ("dsv4-flash", "qwen3-moe", "dit-moe")
                                          for p in (2, 8)]
    # (P - 1) / P of each 32 KiB tile is remote
    assert [b.bytes_per_producer for b in ours_moe[:2]] == [16384.0, 32768 * 7 / 8]
    assert select_presets(profile, ["all", "megamoe"]) == ours + paper + moe
    assert [b.name for b in select_presets(profile, ["fa-a2a-p2-h3"])] == [b.name for b in ours[:5]]
    slow = select_presets(profile, ["paper-fa-a2a-m8192"], sigma_us=0.01)[0]
    assert slow.gap_us == pytest.approx(0.01 * 8192 / 128)
    wide = select_presets(profile, ["fa-a2a"], world=4, heads_per_rank=(6,), seq_lens=(16384,))
    assert [(b.name, b.producers) for b in wide] == [("fa-a2a-p4-h6-m16384", 3 * 148 // 4)]
    with pytest.raises(ValueError, match="unknown preset"):
        select_presets(profile, ["nope"])


def test_evaluate_rejects_bad_bursts():
    profile = load_builtin("paper")
    for burst, message in ((KernelBurst("k", 149, 1024, 1.0), "exceed the profile's sm_count 148"),
                           (KernelBurst("k", 8, 0, 1.0), "bytes per producer must be > 0"),
                           (KernelBurst("k", 8, 1024, -1.0), "gap must be >= 0")):
        with pytest.raises(ValueError, match=message):
            evaluate(profile, burst)


# --- CLI in-process ----------------------------------------------------------------------


def test_design_test_presets_in_process(tmp_path, capsys):
    out = tmp_path / "figs" / "all.png"
    assert cli.main(["design-test", "--profile", "paper", "--preset", "all", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for name in ("fa-a2a-p2-h3-m8192", "paper-fa-a2a-m8192", "megamoe-dit-moe", str(out)):
        assert name in text
    assert "reshape" in text
    assert_png(out)


def table_rows(text: str) -> list[dict]:
    """The verdict table of the command's text output as {column title: cell} per row."""
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("name "))
    titles = [t for t in re.split(r"\s{2,}", lines[header].strip())]
    rows = []
    for line in lines[header + 1:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(titles):
            break
        rows.append(dict(zip(titles, cells)))
    return rows


def test_table_shows_eq4_and_eq7_costs_and_the_deciding_bound(tmp_path, capsys):
    names = ["fa-a2a-p2-h12-m16384", "megamoe-qwen3.5", "paper-fa-a2a-m8192"]
    argv = ["design-test", "--profile", "h200x2", "--out", str(tmp_path / "t.png")]
    for name in names:
        argv += ["--preset", name]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    rows = {row["name"]: row for row in table_rows(text)}
    assert list(rows) == names
    profile = load_builtin("h200x2")
    for name in names:
        r = evaluate(profile, select_presets(profile, [name])[0])
        row = rows[name]
        assert row["eq4 dT us"] == f"{r['overhead']:.2f}" and row["eq7 T_iss us"] == f"{r['t_iss_isolated']:.2f}"
        assert row["eq7 dT us"] == f"{r['capacity_overhead']:.2f}"
        assert row["cost %"] == f"{100 * r['cost_fraction']:.2f}"
        assert (row["decides"], row["verdict"]) == (r["decided_by"], r["verdict"])
        assert row["Q(K) MiB"] == f"{r['capacity_MiB']:.2f}" and row["K"] == str(r["producers"])
    # our kernel's wave: 66 x 32 KiB against Q(66); the capacity bound decides, its cost is eq. 7's.
    fa = rows["fa-a2a-p2-h12-m16384"]
    assert (fa["K"], fa["V MiB"], fa["Q(K) MiB"], fa["rate"], fa["capacity"]) == ("66", "2.06", "1.39", "ok", "FAILS")
    assert (fa["eq4 dT us"], fa["decides"], fa["verdict"]) == ("0.00", "capacity", "piggyback")
    assert float(fa["eq7 dT us"]) > 1.0
    assert rows["megamoe-qwen3.5"]["decides"] == "rate" and rows["megamoe-qwen3.5"]["verdict"] == "reshape"
    assert "tolerance of 2% of the period" in text
    assert "fa-a2a-p2-h12-m16384: round 10 (the last remote round, once) sends 108 tiles" in text


def test_json_carries_units_both_costs_and_the_tolerance(tmp_path, capsys):
    argv = ["design-test", "--profile", "h200x2", "--preset", "fa-a2a-p2-h12", "--out", str(tmp_path / "j.png"),
            "--json"]
    assert cli.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tolerance"] == 0.02
    assert "eq. 4" in report["units"]["overhead"] and "eq. 7" in report["units"]["t_iss_isolated"]
    assert "eq. 7" in report["units"]["capacity_overhead"]
    assert len(report["verdicts"]) == 5
    for v in report["verdicts"]:
        assert v["producers"] == 66 and v["world"] == 2 and v["decided_by"] == "capacity"
        assert v["verdict"] == "piggyback" and v["capacity_overhead"] > 1.0 and v["overhead"] == 0.0
        assert v["remote_tiles_per_round"][-1] == 0 and v["last_remote_round"]["producers"] > 66
    assert cli.main([*argv, "--tolerance", "0"]) == 0  # eq. 10 strictly: a failing bound is a reshape
    strict = json.loads(capsys.readouterr().out)
    assert strict["tolerance"] == 0.0 and {v["verdict"] for v in strict["verdicts"]} == {"reshape"}


def test_other_world_sizes_are_flagged_against_the_profile(tmp_path, capsys):
    argv = ["design-test", "--profile", "h200x2", "--preset", "fa-a2a", "--world", "4", "--heads-per-rank", "6",
            "--seq-lens", "16384", "--out", str(tmp_path / "w.png")]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "note: the profile was measured at P = 2; presets at P = 4" in text
    (row,) = table_rows(text)
    assert row["name"] == "fa-a2a-p4-h6-m16384" and row["K"] == "99"


def test_design_test_custom_json(tmp_path, capsys):
    out = tmp_path / "custom.png"
    code = cli.main(["design-test", "--profile", "paper", "--producers", "148", "--bytes-per-producer", "40000",
                     "--gap-us", "1", "--out", str(out), "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    (verdict,) = report["verdicts"]
    assert verdict["verdict"] == "reshape" and not verdict["rate_ok"] and not verdict["capacity_ok"]
    assert report["figure"] == str(out)
    assert_png(out)


def test_list_presets(capsys):
    assert cli.main(["design-test", "--profile", "paper", "--list-presets"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert "fa-a2a-p2-h12-m65536" in names and "paper-fa-a2a-m65536" in names and "megamoe-dsv4-pro" in names


@pytest.mark.parametrize("argv,fragment", [
    (["design-test", "--profile", "paper", "--preset", "nope"], "unknown preset 'nope'"),
    (["design-test", "--profile", "paper", "--producers", "-4", "--bytes-per-producer", "1", "--gap-us", "1"],
     "argument --producers: must be > 0"),
    (["design-test", "--profile", "paper", "--producers", "4", "--bytes-per-producer", "0", "--gap-us", "1"],
     "argument --bytes-per-producer: must be > 0"),
    (["design-test", "--profile", "paper", "--producers", "4", "--bytes-per-producer", "8", "--gap-us", "-1"],
     "argument --gap-us: must be >= 0"),
    (["design-test", "--profile", "paper", "--producers", "400", "--bytes-per-producer", "8", "--gap-us", "1"],
     "exceed the profile's sm_count"),
    (["design-test", "--profile", "paper", "--producers", "4"], "all of --bytes-per-producer"),
    (["design-test", "--profile", "no-such-profile", "--preset", "all"], "no built-in profile"),
    (["design-test", "--bogus"], "unrecognized arguments: --bogus"),
    (["design-test", "--profile", "h200x2", "--preset", "fa-a2a", "--seq-lens", "1000"], "multiple of P x 128"),
    (["design-test", "--profile", "h200x2", "--preset", "all", "--tolerance", "-0.1"],
     "argument --tolerance: must be >= 0"),
    (["design-test", "--profile", "h200x2", "--preset", "fa-a2a", "--world", "1"], "sends no tile to a peer"),
])
def test_bad_input_exits_2_with_one_line(argv, fragment, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    assert_one_line_error(capsys.readouterr().err, fragment)


def test_bad_profile_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "xstage.platform_profile", "version": 7}')
    assert cli.main(["design-test", "--profile", str(bad), "--preset", "all"]) == 2
    assert_one_line_error(capsys.readouterr().err, "supported version is 1")


# --- CLI as a module in a fresh interpreter -------------------------------------------


def test_module_entry_point_writes_default_png(tmp_path):
    result = run_module("design-test", "--profile", "paper", "--preset", "paper-fa-a2a", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "figure: design-test.png" in result.stdout
    assert_png(tmp_path / "design-test.png")


def test_module_entry_point_json(tmp_path):
    result = run_module("design-test", "--profile", "paper", "--preset", "megamoe-hy3", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["verdicts"][0]["name"] == "megamoe-hy3"


@pytest.mark.parametrize("args,fragment", [
    (("design-test", "--profile", "paper", "--preset", "nope"), "unknown preset"),
    (("design-test", "--profile", "paper", "--producers", "-1", "--bytes-per-producer", "8", "--gap-us", "1"),
     "must be > 0"),
    (("design-test", "--profile", "broken.json", "--preset", "all"), "is not valid JSON"),
])
def test_module_entry_point_errors(tmp_path, args, fragment):
    (tmp_path / "broken.json").write_text("{")
    result = run_module(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert_one_line_error(result.stderr, fragment)
