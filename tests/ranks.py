"""Run a multi-GPU test worker on every rank and collect what each rank reported."""
from __future__ import annotations

import json

from cute_kernels.dist import spawn_ranks


def run_ranks(worker, tmp_path, world: int = 2, args: tuple = ()) -> list[dict]:
    """``worker(rank, world, init_file, out, *args)`` writes its JSON report to ``f"{out}.{rank}"``."""
    out = str(tmp_path / "report")
    spawn_ranks(worker, world, out, *args)
    reports = []
    for rank in range(world):
        with open(f"{out}.{rank}") as f:
            reports.append(json.load(f))
    return reports
