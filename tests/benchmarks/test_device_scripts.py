"""The device scripts (benchmarks/device/*.sh) and variant sets (benchmarks/variants/*.json), without a GPU:
every script parses (bash -n), lists the stages it documents, and runs every stage in its dry run
(DRY_RUN=1: each command printed, nothing run); every variant set names only the options that stay."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEVICE = ROOT / "benchmarks" / "device"
VARIANTS = ROOT / "benchmarks" / "variants"
BASH = shutil.which("bash")
if BASH is None:
    pytest.skip("bash is not installed: the device scripts cannot be checked", allow_module_level=True)

STAGES = {
    "h200.sh": ["info", "tests", "sass", "calibrate", "fa", "clocks", "variants", "compare", "moe", "moedump",
                "pack", "all"],
    "h200x2.sh": ["info", "tests", "calibrate", "fa", "hiding", "clocks", "linkpower", "dit", "moe", "variants",
                  "pack", "all"],
    "h200x8.sh": ["info", "tests", "calibrate", "fa", "dit", "variants", "pack", "all"],
}
ALL = {
    "h200.sh": ["info", "tests", "sass", "calibrate", "fa", "pack"],
    "h200x2.sh": ["info", "tests", "calibrate", "fa", "dit", "pack"],
    "h200x8.sh": ["info", "tests", "calibrate", "fa", "pack"],
}
NOMINAL_GPUS = {"h200.sh": 1, "h200x2.sh": 2, "h200x8.sh": 8}
# The options that stay in FusedAttentionA2A.launch / flash_attention (issue 27), with their values.
SURVIVING = {
    "mode": {"local", "piggyback", "completion_coupled"},
    "self_store": {True, False},
    "tail_split": {"auto", False, True},
    "store": {"auto", "st", "paced"},
    "relay": {"auto", True, False},
}
FA_ONLY = {"tail_split"}  # what a column without "mode" (FA-only, flash_attention) may set
# Flags, columns and knobs removed from the bench and the kernel: no dry run may print one.
REMOVED = ["--alternate-pairs", "--alternate-min-us", "fa_ours_no_overlap", "fa_ours_lag_v", "fa_ours_nonpersistent",
           "fa_ours_unpinned", "fa_ours_pin_all", "calibrate.cli", "pin_softmax", "signal", "peel_drip", "cluster_kv",
           "benchmarks/fa_clocks.py", "benchmarks/fused_clocks.py", "benchmarks/link_power.py"]
SAFE_ENV = ("NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1")
COMMIT = "abc1234"


def variant_sets() -> list[Path]:
    return sorted(VARIANTS.glob("*.json"))


def dry_run(script: str, *words: str, out: Path, gpus: int | None = None,
            env: dict | None = None) -> subprocess.CompletedProcess:
    extra = env or {}
    env = {k: v for k, v in os.environ.items()
           if not (k.endswith(("_ARGS", "_TIMEOUT")) or k in ("GPUS", "CALL_BUDGET_S", "XSTAGE_CMD"))}
    # a multicast switch turned on outside must come out off
    env.update(DRY_RUN="1", OUT=str(out), XSTAGE_GIT_COMMIT=COMMIT, NCCL_NVLS_ENABLE="1", **extra)
    if gpus is not None:
        env["GPUS"] = str(gpus)
    return subprocess.run([BASH, str(DEVICE / script), *words], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def check_commands(text: str) -> None:
    for word in REMOVED:
        assert word not in text, f"dry run prints the removed {word!r}:\n{text}"
    for path in re.findall(r"--variants (\S+)", text):
        assert (ROOT / path).is_file(), f"--variants {path}: no such file"
    for module in re.findall(r"python3 -m (\S+)", text):
        assert importlib.util.find_spec(module) is not None, f"python3 -m {module}: no such module"
    for path in re.findall(r"(?:torchrun|python3) .*?(\S+\.py)\b", text):
        assert (ROOT / path).is_file(), f"{path}: no such file"
    header = text.splitlines()[0]
    for setting in SAFE_ENV:
        assert setting in header, f"{setting} not in force: {header}"


@pytest.mark.parametrize("script", sorted(STAGES))
def test_script_parses_and_lists_its_stages(script, tmp_path):
    for path in (DEVICE / script, DEVICE / "lib.sh"):
        parsed = subprocess.run([BASH, "-n", str(path)], check=False, capture_output=True, text=True)
        assert parsed.returncode == 0, parsed.stderr
    listed = dry_run(script, "--list", out=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == STAGES[script]
    assert 8 <= len(STAGES[script]) <= 12
    usage = dry_run(script, "--help", out=tmp_path).stdout
    for stage in STAGES[script]:  # the header documents every stage
        assert re.search(rf"^  {stage}\b", usage, re.MULTILINE), f"{script} --help does not describe {stage}"
    assert len((DEVICE / script).read_text().splitlines()) <= 150


@pytest.mark.parametrize("script,stage", [(s, st) for s, stages in sorted(STAGES.items()) for st in stages
                                          if st not in ("all", "variants")])
def test_every_stage_dry_runs(script, stage, tmp_path):
    r = dry_run(script, stage, out=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    check_commands(r.stdout)
    assert f"=== {stage} " in r.stdout
    assert "\n+ " in r.stdout, f"{script} {stage} prints no command:\n{r.stdout}"
    assert f"{stage} rc=0" in r.stdout


def test_h200_compare_patch_tests_then_times_a_patched_copy_against_this_tree(tmp_path):
    """COMPARE_PATCH=NAME: old exported from the tree as it came, new a copy with docs/experiments/NAME.patch,
    the copy's MegaMoE GPU tests before the pairs, which take COMPARE_ARGS; the steps' timeouts fit the stage's."""
    name = sorted((ROOT / "docs" / "experiments").glob("*.patch"))
    if not name:
        pytest.skip("no patch waits in docs/experiments: nothing to dry-run COMPARE_PATCH with")
    name = name[0].stem
    r = dry_run("h200.sh", "compare", out=tmp_path, env={"COMPARE_PATCH": name, "COMPARE_ARGS": "--pairs 7"})
    assert r.returncode == 0 and "compare rc=0" in r.stdout, r.stdout + r.stderr
    check_commands(r.stdout)
    steps = [line for line in r.stdout.splitlines() if line.startswith("+ timeout ")]
    assert len(steps) == 4, steps
    assert "-m benchmarks.old_vs_new --prepare WORKTREE --old /tmp/xstage-old" in steps[0]
    assert f"docs/experiments/{name}.patch" in r.stdout and "patch -d" in r.stdout
    assert "env -C /tmp/xstage-new0 PYTHONPATH=/tmp/xstage-new0 python3 -m pytest" in steps[2]
    assert "-m gpu tests/megamoe" in steps[2]
    assert "PYTHONPATH=/tmp/xstage-new0:/tmp/xstage-old" in steps[3] and steps[3].endswith("--pairs 7")
    assert f"--out {tmp_path}/h200/megamoe_{name}.json" in steps[3]
    assert sum(int(line.split()[2]) for line in steps) == 540 and "(timeout 540s;" in r.stdout
    missing = dry_run("h200.sh", "compare", out=tmp_path, env={"COMPARE_PATCH": "no_such_patch"})
    assert missing.returncode == 0 and "skipped compare: no " in missing.stdout, missing.stdout


def test_h200_compare_patch_times_comma_separated_variants_in_one_call(tmp_path):
    """COMPARE_PATCH=A,A+B: one copy per variant (A; A then B: a patch written on top of another), the first
    variant's GPU tests once, then each variant against the same old in its own process and result file, the
    stage's 540 s shared out; a missing patch in any variant skips the stage before anything runs."""
    names = [p.stem for p in sorted((ROOT / "docs" / "experiments").glob("*.patch"))]
    if len(names) < 2:
        pytest.skip("fewer than two patches wait in docs/experiments: nothing to stack")
    a, b = names[:2]
    env = {"COMPARE_PATCH": f"{a},{a}+{b}", "COMPARE_ARGS": "--pairs 5", "COMPARE_TESTS_TIMEOUT": "150"}
    r = dry_run("h200.sh", "compare", out=tmp_path, env=env)
    assert r.returncode == 0 and "compare rc=0" in r.stdout, r.stdout + r.stderr
    check_commands(r.stdout)
    steps = [line for line in r.stdout.splitlines() if line.startswith("+ timeout ")]
    assert len(steps) == 6, steps  # prepare, two copies, the tests, two comparisons
    copies = [line for line in r.stdout.splitlines() if "exit 1; done'" in line]
    assert len(copies) == 2 and copies[0].endswith(f"/tmp/xstage-new0 {ROOT} {ROOT}/docs/experiments/{a}.patch")
    assert copies[1].endswith(f"{ROOT}/docs/experiments/{a}.patch {ROOT}/docs/experiments/{b}.patch")
    assert sum("-m pytest" in line for line in steps) == 1 and "/tmp/xstage-new0 " in steps[3]
    for k, variant in enumerate((a, f"{a}+{b}")):
        step = steps[4 + k]
        assert f"PYTHONPATH=/tmp/xstage-new{k}:/tmp/xstage-old XSTAGE_GIT_COMMIT={COMMIT}+{variant} " in step
        assert f"--out {tmp_path}/h200/megamoe_{variant}.json" in step and step.endswith("--pairs 5")
    assert sum(int(line.split()[2]) for line in steps) == 540
    missing = dry_run("h200.sh", "compare", out=tmp_path, env={"COMPARE_PATCH": f"{a},{a}+no_such_patch"})
    assert missing.returncode == 0 and "skipped compare: no " in missing.stdout, missing.stdout
    assert "--prepare WORKTREE" not in missing.stdout


def test_h200x2_moe_stage_runs_its_five_commands_within_its_timeout(tmp_path):
    """Issue 31, items 3-4 in one call: the multi-GPU MegaMoE test, the bench at real EP = 2, the matrix at
    EP = 2 with --dump and --max-minutes inside its share, the analysis of that dump, auto's regret on the
    bench's JSON; the shares add up to the stage's timeout, MOE_ARGS reaches the bench and MOE_MATRIX_ARGS
    the matrix; the dump's arrays stay out of the pack when large."""
    def commands(**env):
        r = dry_run("h200x2.sh", "moe", out=tmp_path, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "(timeout 550s;" in r.stdout and "moe rc=0" in r.stdout
        return [shlex.split(line[2:]) for line in r.stdout.splitlines() if line.startswith("+ timeout ")]

    cmds = commands()
    assert [c[2:5] for c in cmds] == [["python3", "-m", "pytest"], ["python3", "-m", "xstage"],
                                      ["python3", "-m", "xstage"], ["python3", "-m", "benchmarks.megamoe_analysis"],
                                      ["python3", "-m", "benchmarks.megamoe_auto"]]
    test, bench, matrix, analysis, auto = cmds
    dump = matrix[matrix.index("--dump") + 1]
    assert analysis[5] == dump + ".json" and analysis[analysis.index("--out-dir") + 1].endswith("/h200x2")
    assert test[-1] == "tests/megamoe/test_megamoe_multigpu.py" and "-rs" in test
    assert bench[5:7] == ["bench", "megamoe"] and "--matrix" not in bench
    assert bench[bench.index("--world") + 1] == "2" and bench[bench.index("--ranks") + 1] == "real"
    assert matrix[5:8] == ["bench", "megamoe", "--matrix"] and matrix[matrix.index("--ranks") + 1] == "real"
    assert matrix[matrix.index("--world") + 1] == "2"
    assert auto[5] == bench[bench.index("--out") + 1]  # the regret of this bench's result
    timeouts = [int(c[1]) for c in cmds]
    assert sum(timeouts) <= 550, timeouts
    minutes = float(matrix[matrix.index("--max-minutes") + 1])
    assert 0 < minutes * 60 <= timeouts[2] - 60, (minutes, timeouts)  # start-up and a layer's compile fit
    r = dry_run("h200x2.sh", "moe", out=tmp_path)
    assert f"+ keep_out_of_pack {dump}.npz" in r.stdout
    narrowed = commands(MOE_ARGS="--tokens 4096", MOE_MATRIX_ARGS="--shapes dsv4-flash")
    assert narrowed[1][-2:] == ["--tokens", "4096"] and narrowed[2][-2:] == ["--shapes", "dsv4-flash"]


def test_h200_moedump_runs_the_matrix_with_dump_then_its_analysis(tmp_path):
    r = dry_run("h200.sh", "moedump", out=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    cmds = [shlex.split(line[2:]) for line in r.stdout.splitlines() if line.startswith("+ timeout ")]
    (matrix, analysis) = cmds
    assert matrix[5:8] == ["bench", "megamoe", "--matrix"] and matrix[matrix.index("--world") + 1] == "2"
    assert analysis[3:5] == ["-m", "benchmarks.megamoe_analysis"]
    assert analysis[5] == matrix[matrix.index("--dump") + 1] + ".json"
    assert int(matrix[1]) + int(analysis[1]) <= 300 and float(matrix[matrix.index("--max-minutes") + 1]) * 60 < int(
        matrix[1])


@pytest.mark.parametrize("script", sorted(STAGES))
@pytest.mark.parametrize("variant_set", [p.stem for p in variant_sets()])
def test_variants_stage_passes_the_set_file(script, variant_set, tmp_path):
    r = dry_run(script, "variants", variant_set, out=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    check_commands(r.stdout)
    assert f"--variants benchmarks/variants/{variant_set}.json" in r.stdout
    assert f"variants_{variant_set}.json" in r.stdout  # its own result file


@pytest.mark.parametrize("script", sorted(STAGES))
def test_all_runs_the_default_order_and_packs_last(script, tmp_path):
    r = dry_run(script, out=tmp_path)  # no stage: all
    assert r.returncode == 0, r.stdout + r.stderr
    check_commands(r.stdout)
    ran = re.findall(r"^=== (\S+) \d", r.stdout, re.MULTILINE)
    assert ran == ALL[script]
    assert f"_{COMMIT}.tgz" in r.stdout
    # pack moves to the end even when named first
    again = dry_run(script, "pack", "info", out=tmp_path)
    assert re.findall(r"^=== (\S+) \d", again.stdout, re.MULTILINE) == ["info", "pack"]


@pytest.mark.parametrize("script", sorted(STAGES))
def test_stages_skip_with_the_reason_when_gpus_are_missing(script, tmp_path):
    r = dry_run(script, "fa", "tests", out=tmp_path, gpus=0)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "skipped fa: needs" in r.stdout and "skipped tests: needs 1 GPU(s), 0 visible" in r.stdout
    assert "\n+ " not in r.stdout  # nothing would have run
    if NOMINAL_GPUS[script] > 1:
        few = dry_run(script, "fa", out=tmp_path, gpus=1)
        assert "skipped fa: needs" in few.stdout and "1 visible" in few.stdout


@pytest.mark.parametrize("script", sorted(STAGES))
def test_unknown_stage_or_set_stops_before_anything_runs(script, tmp_path):
    for words in (("info", "fahiding"), ("info", "variants", "no_such_set"), ("info", "variants")):
        r = dry_run(script, *words, out=tmp_path)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "===" not in r.stdout


def test_variant_sets_name_only_surviving_options():
    sets = variant_sets()
    assert sets, "benchmarks/variants/ holds no variant set"
    readme = (VARIANTS / "README.md").read_text()
    for path in sets:
        assert f"`{path.name}`" in readme, f"{path.name} has no line in benchmarks/variants/README.md"
        variants = json.loads(path.read_text())
        assert isinstance(variants, dict) and variants, f"{path.name}: not a non-empty object"
        for name, knobs in variants.items():
            where = f"{path.name}: {name}"
            assert re.fullmatch(r"[a-z][a-z0-9_]*", name), f"{where}: not a column name"
            assert isinstance(knobs, dict) and knobs, f"{where}: knobs must be a non-empty object"
            unknown = set(knobs) - set(SURVIVING)
            assert not unknown, f"{where}: removed or unknown options {sorted(unknown)}"
            if "mode" not in knobs:
                assert set(knobs) <= FA_ONLY, f"{where}: an FA-only column takes only {sorted(FA_ONLY)}"
            for knob, value in knobs.items():
                # True == 1 in a set: compare the type too, so 1 or "true" is not taken for True
                assert any(value == v and type(value) is type(v) for v in SURVIVING[knob]), \
                    f"{where}: {knob}={value!r} is not one of {SURVIVING[knob]}"


def xstage_commands(script: str, tmp_path: Path) -> list[list[str]]:
    """The xstage argument lists that the dry runs of every stage (and every variant set) print."""
    runs = [dry_run(script, *(s for s in STAGES[script] if s not in ("variants", "all")), out=tmp_path)]
    runs += [dry_run(script, "variants", p.stem, out=tmp_path) for p in variant_sets()]
    commands = []
    for r in runs:
        for line in r.stdout.splitlines():
            if line.startswith("+ timeout ") and " python3 -m xstage " in line:  # + timeout T python3 -m xstage
                commands.append(shlex.split(line[2:])[5:])
    return commands


@pytest.mark.parametrize("script", sorted(STAGES))
def test_xstage_accepts_every_command_the_scripts_print(script, tmp_path, monkeypatch, capsys):
    """Each printed xstage command, run here without a GPU, gets past its option and column checks to the GPU
    check: a flag, column or variant set that the CLI no longer takes fails here, not in a device call."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: these commands would run the benchmarks for real")
    from xstage.cli import main

    monkeypatch.chdir(ROOT)  # the scripts name the variant sets from the repository root
    commands = xstage_commands(script, tmp_path)
    assert {c[0] for c in commands} >= {"calibrate", "bench"}, commands
    for argv in commands:
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and re.search(r"needs a (CUDA )?GPU", err), f"xstage {shlex.join(argv)}: rc {rc}, {err}"
