"""The ``xstage`` command (xstage/cli.py): its subcommands reach the modules that implement them, bad input is
one ``xstage: error:`` line and exit status 2, and the packages import downward only (no string imports, no
sys.path edits, no library module importing the benchmarks or the command)."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import calibrate
from xstage import cli

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_one_line_error(stderr: str, fragment: str):
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("xstage: error:") and fragment in lines[0], stderr


def run_module(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "xstage.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("argv,fragment", [
    (["bench", "megamoe", "--shapes", "nope"], "unknown shape 'nope'"),
    (["bench", "megamoe", "--world", "3"], "unknown world size '3'"),
    (["bench", "megamoe", "--size", "7"], "unrecognized arguments: --size 7"),
    (["bench", "flash-a2a", "--seq-lens", "1000"], "multiples of 128"),
    (["bench"], "required"),
    (["bench", "nope"], "invalid choice"),
    (["design-test", "--profile", "paper", "--preset", "nope"], "unknown preset 'nope'"),
    (["design-test", "--bogus"], "unrecognized arguments: --bogus"),
    ([], "required"),
])
def test_bad_input_exits_2_with_one_line(argv, fragment, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    assert_one_line_error(capsys.readouterr().err, fragment)


@pytest.mark.parametrize("argv", [["--help"], ["bench", "flash-a2a", "--help"], ["bench", "megamoe", "--help"],
                                  ["design-test", "--help"]])
def test_help_exits_0_and_names_the_command(argv, capsys):
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: xstage") and " ".join(a for a in argv if a != "--help") in out.splitlines()[0]


def test_bench_flash_a2a_help_lists_the_kept_flags_only(capsys):
    assert cli.main(["bench", "flash-a2a", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--out", "--seq-lens", "--heads-per-rank", "--replays", "--pairs", "--skip", "--variants",
                 "--replot", "--table", "--pool-hiding", "--no-spans"):
        assert flag in out, flag
    for gone in ("--split", "--alternate-min-us", "--pair-launch", "fa_ours_no_overlap", "pin_softmax"):
        assert gone not in out, gone


def test_design_test_runs_through_the_command(tmp_path, capsys):
    out = tmp_path / "all.png"
    assert cli.main(["design-test", "--profile", "paper", "--preset", "all", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fa-a2a-m8192" in text and "megamoe-dit-moe" in text and str(out) in text
    assert out.read_bytes()[:8] == PNG_MAGIC


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
    monkeypatch.setattr(calibrate, "run", fake, raising=False)
    assert cli.main(["calibrate", "--iters", "7"]) == 0
    assert seen == {"iters": 7}


def test_module_entry_point(tmp_path):
    ok = run_module("design-test", "--profile", "paper", "--preset", "fa-a2a", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "figure: design-test.png" in ok.stdout and (tmp_path / "design-test.png").is_file()
    bad = run_module("bench", "megamoe", "--tokens", "0", cwd=tmp_path)  # refused before any GPU work
    assert bad.returncode == 2
    assert_one_line_error(bad.stderr, "token counts must be positive")


# --- the import graph -------------------------------------------------------------------

LIBRARY = ("flash_a2a", "calibrate", "cute_kernels", "megamoe")
ABOVE = {"benchmarks": ("xstage",), **{lib: ("benchmarks", "xstage") for lib in LIBRARY}}


def _sources(package: str):
    files = sorted((REPO / package).glob("*.py"))
    if not files:
        pytest.skip(f"{package}/ holds no Python files in this checkout")
    return files


def _imports(path: Path):
    """Every module an ``import``/``from`` statement of ``path`` names (at any depth, lazy ones included)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


@pytest.mark.parametrize("package", sorted(ABOVE))
def test_packages_import_downward_only(package):
    for path in _sources(package):
        up = [m for m in _imports(path) if m.split(".")[0] in ABOVE[package]]
        assert not up, f"{path.relative_to(REPO)} imports {up}: imports point down"


@pytest.mark.parametrize("package", ["benchmarks", "xstage", *LIBRARY])
def test_no_string_imports_or_sys_path_edits(package):
    for path in _sources(package):
        text = path.read_text()  # importlib.metadata (package versions) is no import of ours
        assert "import_module" not in text and "__import__(" not in text, f"{path.relative_to(REPO)}: string import"
        assert "sys.path" not in text, f"{path.relative_to(REPO)} edits sys.path"
