"""The design test and the ``xstage`` CLI, in-process and as ``python -m calibrate.cli``."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from calibrate import cli
from calibrate.design import KernelBurst, evaluate, presets, select_presets
from calibrate.profile import load_builtin

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path):
    assert path.is_file() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == PNG_MAGIC


def run_module(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "calibrate.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def assert_one_line_error(stderr: str, fragment: str):
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xstage: error:") and fragment in lines[0], stderr


# --- design module ---------------------------------------------------------------------


def test_presets_reproduce_the_paper_audit():
    profile = load_builtin("paper")
    fa = evaluate(profile, presets(profile)["fa-a2a-m8192"])
    assert fa["verdict"] == "piggyback" and fa["producers"] == 148
    assert fa["q_peak_MiB"] == pytest.approx(4.1, rel=0.05) and fa["capacity_MiB"] == pytest.approx(4.25, rel=0.05)
    assert fa["recovery_gap"] == pytest.approx(6.0, rel=0.05)
    assert fa["m_star_ub_tokens"] == pytest.approx(1000, rel=0.05)
    moe = evaluate(profile, presets(profile)["megamoe-qwen3.5"])
    assert moe["verdict"] == "reshape" and not moe["rate_ok"] and "rate bound fails" in moe["reason"]
    assert moe["interleave_sufficient"] and moe["interleaved_overhead_us"] == 0.0


def test_select_presets_families_and_sigma_override():
    profile = load_builtin("paper")
    assert len(select_presets(profile, ["fa-a2a"])) == 5
    assert len(select_presets(profile, ["megamoe"])) == 7
    assert len(select_presets(profile, ["all", "megamoe"])) == 12
    slow = select_presets(profile, ["fa-a2a-m8192"], sigma_us=0.01)[0]
    assert slow.gap_us == pytest.approx(0.01 * 8192 / 128)
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
    assert "fa-a2a-m8192" in text and "megamoe-dit-moe" in text and "reshape" in text and str(out) in text
    assert_png(out)


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
    assert "fa-a2a-m65536" in names and "megamoe-dsv4-pro" in names


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
    (["bench", "megamoe"], "not implemented yet"),
    (["bench", "flash-a2a", "--seq-lens", "1000"], "multiples of 128"),
    ([], "required"),
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


def test_calibrate_without_run_module(monkeypatch, capsys):
    # Simulate a checkout where calibrate.run does not exist (or cannot import its GPU stack).
    monkeypatch.setitem(sys.modules, "calibrate.run", None)
    assert cli.main(["calibrate", "--help"]) == 2
    assert_one_line_error(capsys.readouterr().err, "calibrate is unavailable")


def test_calibrate_forwards_arguments(monkeypatch):
    seen = {}

    def run(args):
        seen["iters"] = args.iters
        return 0

    fake = types.ModuleType("calibrate.run")
    fake.add_arguments = lambda parser: parser.add_argument("--iters", type=int)
    fake.run = run
    monkeypatch.setitem(sys.modules, "calibrate.run", fake)
    assert cli.main(["calibrate", "--iters", "7"]) == 0
    assert seen == {"iters": 7}


# --- CLI as a module in a fresh interpreter -------------------------------------------


def test_module_entry_point_writes_default_png(tmp_path):
    result = run_module("design-test", "--profile", "paper", "--preset", "fa-a2a", cwd=tmp_path)
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
