"""Stand-in per-tile records for the CPU tests of ``--dump`` (the arrays MegaMoE.last_dump returns, in the
layout benchmarks/megamoe_analysis.py reads), derived from a launch's routing so that they differ per
configuration, rank and schedule."""
from __future__ import annotations

import numpy as np

ARRAYS = ("cta", "slot", "kind", "expert", "m", "n", "sm", "t_entry", "t_data", "t_mma_end", "t_end", "t_rs")
T_RS_CYCLES = {"wave": 3000, "interleaved": 2000}  # the L2 store span: interleaved's shorter here


def fake_records(topk_idx, experts, schedule: str, ctas: int = 4, block: int = 4) -> dict:
    """An L1 then an L2 tile per ``block`` rows of each expert in ``experts`` (rows: the entries of
    ``topk_idx`` that name it), dealt round-robin over ``ctas`` CTAs, each CTA's stream in slot order."""
    idx = np.asarray(topk_idx).reshape(-1)
    tiles = [(kind, e, m) for e in experts for m in range(-(-int((idx == e).sum()) // block)) for kind in (1, 2)]
    cols = {k: [] for k in ARRAYS}
    clock = [10**12 + 100 * c for c in range(ctas)]
    slots = [0] * ctas
    for n, (kind, e, m) in enumerate(tiles):
        c, t = n % ctas, clock[n % ctas]
        main, epilogue = (2000, 500) if kind == 1 else (1000, 1500)
        vals = (c, slots[c], kind, e, m, n, c, t, t + 32, t + 32 + main, t + 32 + main + epilogue,
                0 if kind == 1 else T_RS_CYCLES[schedule])
        for k, v in zip(ARRAYS, vals):
            cols[k].append(v)
        clock[c], slots[c] = vals[10] + 300, slots[c] + 1
    return {k: np.asarray(v, dtype=np.int64) for k, v in cols.items()}


def ranked(parts: list[dict]) -> dict:
    """Per-rank records concatenated with a ``rank`` array (as benchmarks.megamoe.RankLists returns them)."""
    out = {k: np.concatenate([p[k] for p in parts]) for k in ARRAYS}
    out["rank"] = np.concatenate([np.full(p["cta"].size, r, dtype=np.int64) for r, p in enumerate(parts)])
    return out
