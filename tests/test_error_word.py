"""A bounded wait that times out sets the error word, and the host turns it into an exception."""
from __future__ import annotations

import pytest
import torch

from cute_kernels.runtime import XStageKernelError, check_error_word, new_error_word


def test_error_word_raises_with_its_meaning():
    errors = new_error_word("cpu")
    check_error_word(errors, "clean")  # no error: no exception
    errors[0], errors[1], errors[2] = 2, 7, 3
    with pytest.raises(XStageKernelError, match="flag wait timed out.*block 7.*value seen 3"):
        check_error_word(errors, "receiver")


@pytest.mark.gpu
def test_flag_wait_times_out_instead_of_hanging():
    from calibrate.bench import _compile
    from calibrate.burst_kernel import FlagWaitKernel

    flag = torch.zeros(64, dtype=torch.int32, device="cuda")
    errors = new_error_word("cuda")
    k = _compile(FlagWaitKernel())
    k(flag, errors, 1, 50_000_000)  # nobody signals: must give up after 50 ms
    torch.cuda.synchronize()
    with pytest.raises(XStageKernelError, match="flag wait timed out"):
        check_error_word(errors, "flag wait")
    flag[0] = 5
    errors.zero_()
    k(flag, errors, 5, 50_000_000)
    torch.cuda.synchronize()
    check_error_word(errors, "flag already set")


def test_process_group_helper_joins_and_leaves(tmp_path):
    import os

    import torch.distributed as dist

    from cute_kernels.dist import SAFE_ENV, process_group

    with process_group(0, 1, str(tmp_path / "pg"), backend="gloo") as group:
        assert dist.is_initialized() and group.size() == 1
        assert all(os.environ[k] == v for k, v in SAFE_ENV.items())
    assert not dist.is_initialized()


def _gloo_rank(rank, world, init_file, out):
    import torch
    import torch.distributed as dist

    from cute_kernels.dist import process_group

    with process_group(rank, world, init_file, backend="gloo"):
        t = torch.tensor([rank + 1])
        dist.all_reduce(t)
        with open(f"{out}.{rank}", "w") as f:
            f.write(f'{{"sum": {int(t)}}}')


def test_spawned_ranks_meet_and_report(tmp_path):
    from ranks import run_ranks

    assert [r["sum"] for r in run_ranks(_gloo_rank, tmp_path, world=2)] == [3, 3]


_STUCK_TEARDOWN = """
import atexit, sys, time
sys.path[:0] = {paths!r}
from cute_kernels.dist import process_group, spawn_ranks


def rank(r, world, init_file, out):
    atexit.register(time.sleep, 600)  # a teardown that never ends (what held the H200 bench processes)
    with process_group(r, world, init_file, backend="gloo"):
        with open(f"{{out}}.{{r}}", "w") as f:
            f.write("done")


if __name__ == "__main__":
    spawn_ranks(rank, 2, sys.argv[1])
"""


def test_spawned_ranks_skip_a_stuck_teardown(tmp_path):
    """A rank that finished its work exits at once (cute_kernels.dist._rank_main), past an atexit handler that
    would block for 10 minutes: the spawner returns, every rank's output is there."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "stuck.py"
    script.write_text(_STUCK_TEARDOWN.format(paths=[root]))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(script), str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [(tmp_path / f"out.{r}").read_text() for r in range(2)] == ["done", "done"]


def test_ranks_meet_only_after_a_compile(monkeypatch):
    """cute_kernels.dist.meet_after_compile: a barrier of the group when the JIT cache grew (a rank compiled
    before launching kernels with bounded waits), none when every kernel was cached."""
    import torch.distributed as dist

    from cute_kernels.dist import meet_after_compile

    met = []
    monkeypatch.setattr(dist, "barrier", lambda group=None: met.append(group))
    meet_after_compile(3, 3, "group")
    assert met == []
    meet_after_compile(3, 5, "group")
    assert met == ["group"]
