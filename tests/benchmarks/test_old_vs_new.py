"""benchmarks.old_vs_new --prepare: a commit's kernels exported with every import renamed, so an old and a new
version import side by side in one process (the GPU run itself is a device stage)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from benchmarks.old_vs_new import PACKAGES, prepare


def test_prepare_renames_every_import(tmp_path):
    if subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: nothing to export")
    into = prepare("HEAD", str(tmp_path / "old"))
    files = list((tmp_path / "old").rglob("*.py"))
    assert {p.relative_to(tmp_path / "old").parts[0] for p in files} == {f"old_{p}" for p in PACKAGES}
    assert (tmp_path / "old" / "old_flash_a2a" / "api.py").is_file()
    assert (tmp_path / "old" / "old_megamoe" / "api.py").is_file()
    for path in files:
        text = path.read_text()
        assert not re.search(r"(?<!old_)\b(from|import) (flash_a2a|megamoe|cute_kernels)\b", text), path
        assert '"xstage::' not in text and "torch.ops.xstage." not in text, path  # custom ops renamespaced
    probe = ("import sys; sys.path.insert(0, %r); import old_flash_a2a.mapping as m, old_cute_kernels.flags as f; "
             "print(m.__name__, f.__name__)") % into
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["old_flash_a2a.mapping", "old_cute_kernels.flags"], out


def test_prepare_worktree_exports_the_working_tree_files(tmp_path, monkeypatch):
    """--prepare WORKTREE (a device copy has no git): the packages' files as they stand, renamed the same way."""
    import benchmarks.old_vs_new as ovn

    root = tmp_path / "tree"
    for pkg in PACKAGES:
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text(f"from {PACKAGES[0]} import x  # {pkg}\n")
    (root / PACKAGES[1] / "notes.txt").write_text("not python")
    monkeypatch.chdir(root)
    monkeypatch.setenv("XSTAGE_GIT_COMMIT", "abc1234+patch")
    into = tmp_path / "old"
    ovn.prepare(ovn.WORKTREE, str(into))
    files = sorted(p.relative_to(into).as_posix() for p in into.rglob("*") if p.is_file())
    assert files == ["COMMIT"] + sorted(f"old_{p}/__init__.py" for p in PACKAGES)
    assert (into / f"old_{PACKAGES[1]}" / "__init__.py").read_text() == f"from old_{PACKAGES[0]} import x  # old_{PACKAGES[1]}\n"
    assert (into / "COMMIT").read_text() == "abc1234+patch\n"


def test_old_and_new_megamoe_ops_register_side_by_side(tmp_path):
    """Both versions' custom ops load in one process: the old copy's as ``xstage_old.old_megamoe``."""
    if subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: nothing to export")
    pytest.importorskip("torch")
    into = prepare("HEAD", str(tmp_path / "old"))
    probe = ("import sys; sys.path.insert(0, %r); import torch, megamoe.ops, old_megamoe.ops; "
             "print(hasattr(torch.ops.xstage, 'megamoe'), hasattr(torch.ops.xstage_old, 'old_megamoe'))") % into
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["True", "True"], out.stderr[-2000:]


def test_megamoe_old_vs_new_cases_and_refusals(tmp_path, capsys):
    from benchmarks import megamoe_old_vs_new as mo

    assert mo.parse_case("qwen3-moe:8192:balanced:w8a8") == {
        "shape": "qwen3-moe", "tokens": 8192, "routing": "balanced", "dtype": "w8a8", "schedule": "interleaved"}
    assert mo.parse_case("dit-moe:100:skewed:bf16:wave")["schedule"] == "wave"
    for bad in ("qwen3-moe:8192", "nope:1:balanced:bf16", "dit-moe:x:balanced:bf16", "dit-moe:8:hot:bf16",
                "dit-moe:8:balanced:fp4", "dit-moe:8:balanced:bf16:zigzag"):
        with pytest.raises(Exception):
            mo.parse_case(bad)
    with pytest.raises(SystemExit) as e:
        mo.main(["--old", str(tmp_path / "none"), "--out", str(tmp_path / "o.json")])
    assert e.value.code == 2 and "--prepare COMMIT" in capsys.readouterr().err
    for bad in ("newx.m_group=1", "mid.m_group=1", "new2.m_group=x", "new2.=1"):  # sides: old, new, new2, new3, ...
        with pytest.raises(SystemExit) as e:
            mo.main(["--same-tree", "--out", str(tmp_path / "o.json"), "--set", bad])
        assert e.value.code == 2 and "newN.ATTR=INT" in capsys.readouterr().err
