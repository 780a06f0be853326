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
    for path in files:
        text = path.read_text()
        assert not re.search(r"(?<!old_)\b(from|import) (flash_a2a|cute_kernels)\b", text), path
    probe = ("import sys; sys.path.insert(0, %r); import old_flash_a2a.mapping as m, old_cute_kernels.flags as f; "
             "print(m.__name__, f.__name__)") % into
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["old_flash_a2a.mapping", "old_cute_kernels.flags"], out
