"""One place for how our multi-GPU processes join a process group.

NVLink multicast stays off everywhere (NCCL NVLS, torch symmetric-memory multicast, NVSHMEM NVLS): on the
shared machines a program that uses it can take the host's GPUs out of service.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def apply_safe_env() -> None:
    """Force the multicast switches off in this process (and the children it starts)."""
    os.environ.update(SAFE_ENV)


@contextmanager
def process_group(rank: int, world: int, init_file: str, backend: str = "nccl", timeout_s: float = 300.0):
    """Join a ``world``-rank group through a file rendezvous as ``rank`` (one GPU per rank for NCCL) and
    leave it on exit. Collectives time out after ``timeout_s`` (torch's default is 10 minutes, longer than a
    device call): a rank stuck on a peer that failed becomes an error instead of a hang."""
    import datetime

    import torch
    import torch.distributed as dist

    apply_safe_env()
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    yield dist.group.WORLD
    # Only on success: after a failure, destroying the group would wait on peers that are blocked in a
    # collective for this rank (spawn_ranks ends a failed rank's process at once instead).
    dist.destroy_process_group()


def meet_after_compile(cached_before: int, cached_now: int, group) -> None:
    """Call between looking a call's kernels up in a JIT cache and launching them: when the cache grew (this
    rank compiled, seconds and not alike on every rank; the same on every rank, whose calls come in the same
    order) and no CUDA graph is being captured, every rank of ``group`` meets here, so no peer's bounded waits
    (ready gates, data flags) run out while a rank is still compiling."""
    import torch
    import torch.distributed as dist

    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if cached_now != cached_before and not capturing:
        dist.barrier(group=group)


def _rank_main(rank: int, fn, *args) -> None:
    """A spawned rank: run ``fn``; on failure print the traceback and exit at once, so the spawner stops the
    other ranks instead of this one waiting to tear down a group its peers are blocked in. On success it also
    exits at once, past the interpreter's teardown (atexit handlers, module finalizers): ``fn`` has written
    its results and left its process group by then, and on the H200s a benchmark process that had run
    flash-attn-4 sat after its last row until the device call's timeout (fa48parts, 300 s of 300)."""
    import sys

    try:
        fn(rank, *args)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, init_file, *args)`` in ``world`` processes that rendezvous through a file in a
    temporary folder (join ``process_group(rank, world, init_file)`` inside ``fn``)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(fn, world, os.path.join(tmp, "pg"), *args), nprocs=world, join=True)
