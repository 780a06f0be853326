"""A bounded wait that times out sets the error word, and the host turns it into an exception."""
from __future__ import annotations

import re
import time

import pytest
import torch

from cute_kernels.flags import ERR_FLAG_TIMEOUT, ERROR_NAMES
from cute_kernels.runtime import XStageKernelError, check_error_word, new_error_word


@pytest.mark.parametrize("code", sorted(ERROR_NAMES) + [99])
def test_error_word_raises_with_its_meaning(code):
    errors = new_error_word("cpu")
    check_error_word(errors, "clean")  # no error: no exception
    errors[0], errors[1], errors[2] = code, 7, 3
    meaning = re.escape(ERROR_NAMES.get(code, f"error code {code}"))
    with pytest.raises(XStageKernelError, match=f"^receiver: {meaning} \\(block 7, value seen 3\\)$"):
        check_error_word(errors, "receiver")


@pytest.mark.gpu
def test_flag_wait_times_out_instead_of_hanging():
    from cutlass.runtime import make_fake_stream

    from calibrate.burst_kernel import FlagWaitKernel
    from cute_kernels.compile import compile_kernel

    flag = torch.zeros(64, dtype=torch.int32, device="cuda")
    errors = new_error_word("cuda")
    kernel = FlagWaitKernel()
    k = compile_kernel(kernel, *kernel.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True))
    flag[0] = 3
    start = time.perf_counter()
    k(flag, errors, 5, 50_000_000)  # nobody signals: must give up after 50 ms
    torch.cuda.synchronize()
    waited = time.perf_counter() - start
    assert 0.05 <= waited < 10.0, waited
    assert errors[:3].tolist() == [ERR_FLAG_TIMEOUT, 0, 3]  # code, block, the value it saw last
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

    import cute_kernels

    root = os.path.dirname(os.path.dirname(os.path.abspath(cute_kernels.__file__)))  # the repository's root
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
