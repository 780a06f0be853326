"""The hiding ratio H (paper eq. 21) from adjacent launch pairs, with a bootstrap interval, one run at a time or
pooled over runs of the same kernels.

H = 1 - E_res / X: E_res the median over pairs of (fused - FA-only), X the median over pairs of (serial ours +
NCCL - FA-only in plain order), each from its own set of adjacent alternating launch pairs
(``benchmarks.timing.pair_stats`` keeps every pair's difference as ``diffs_us``). At 22-40 ms kernels H >= 0.9
needs E_res within 0.1-0.3% of T_FA, near what 20 pairs resolve, so one number per run says little there: the
interval says how much.
"""
from __future__ import annotations

import random

FUSED = "fused_minus_fa_ours"
SERIAL = "serial_ours_nccl_minus_fa_plain"


def upper_median(xs: list[float]) -> float:
    """The median as ``benchmarks.timing.pair_stats`` takes it (the upper one for an even count)."""
    xs = sorted(xs)
    return xs[len(xs) // 2]


def hiding_ratio(fused_diffs: list[float], serial_diffs: list[float]) -> float | None:
    """1 - median(fused_diffs) / median(serial_diffs); None where the serial excess is not positive."""
    x = upper_median(serial_diffs)
    return 1.0 - upper_median(fused_diffs) / x if x > 0 else None


def hiding_interval(fused_diffs: list[float], serial_diffs: list[float], level: float = 0.95, n_boot: int = 4000,
                    seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``hiding_ratio``: the two pair sets resampled independently (they are
    separate launches). A resample whose serial excess is not positive counts as no hiding measured (-inf, the
    low end). Seeded, so a saved result always prints the same interval."""
    if not fused_diffs or not serial_diffs:
        raise ValueError("need at least one pair of each kind")
    if not 0.0 < level < 1.0 or n_boot < 100:
        raise ValueError(f"level must be in (0, 1) and n_boot >= 100, got {level}, {n_boot}")
    rng = random.Random(seed)
    nf, ns = len(fused_diffs), len(serial_diffs)
    hs = []
    for _ in range(n_boot):
        f = [fused_diffs[rng.randrange(nf)] for _ in range(nf)]
        s = [serial_diffs[rng.randrange(ns)] for _ in range(ns)]
        h = hiding_ratio(f, s)
        hs.append(float("-inf") if h is None else h)
    hs.sort()
    k = round((1.0 - level) / 2 * n_boot)  # as many resamples below the interval as above it
    return hs[k], hs[n_boot - 1 - k]


def row_diffs(row: dict) -> tuple[list[float], list[float]] | None:
    """A bench row's per-pair differences (fused - FA-only, serial - FA-only plain), where it kept them."""
    alt = row.get("alternated") or {}
    if "diffs_us" not in alt.get(FUSED, {}) or "diffs_us" not in alt.get(SERIAL, {}):
        return None
    return [d for d, _ in alt[FUSED]["diffs_us"]], [d for d, _ in alt[SERIAL]["diffs_us"]]


def row_interval(row: dict, level: float = 0.95) -> tuple[float, float] | None:
    diffs = row_diffs(row)
    return hiding_interval(*diffs, level=level) if diffs else None


def pool(results: list[dict], level: float = 0.95) -> list[dict]:
    """H pooled over the rows of several saved results that kept their pairs, per (heads per rank, M) and the
    fused launch's recorded decisions (split, store, relay: rows that decided differently are not pooled; that
    the runs ran the same kernels is the caller's to know, their commits are listed). Each entry: the key, the
    runs (git commits) and pairs pooled, H from all pairs, its interval, and each run's own H. The pairs of
    all runs are one sample here: the interval holds the pairs' spread, not what differs from run to run
    (a board, a session), so runs whose H falls outside it say more than it does."""
    groups: dict = {}
    for res in results:
        commit = (res.get("provenance") or {}).get("git_commit", "?")
        for row in res.get("rows", []):
            diffs = row_diffs(row)
            if diffs is None:
                continue
            key = (row["heads_per_rank"], row["seq_len"], str(row.get("fused_tail_split")),
                   str(row.get("fused_store")), str(row.get("fused_relay")))
            g = groups.setdefault(key, {"runs": [], "fused": [], "serial": [], "per_run": []})
            g["runs"].append(commit)
            g["fused"] += diffs[0]
            g["serial"] += diffs[1]
            g["per_run"].append(hiding_ratio(*diffs))
    out = []
    for (heads, m, split, store, relay), g in sorted(groups.items()):
        out.append({"heads_per_rank": heads, "seq_len": m, "tail_split": split, "store": store, "relay": relay,
                    "runs": g["runs"], "pairs": [len(g["fused"]), len(g["serial"])],
                    "hiding_ratio": hiding_ratio(g["fused"], g["serial"]),
                    "interval": hiding_interval(g["fused"], g["serial"], level=level), "level": level,
                    "per_run": g["per_run"]})
    return out


def pool_text(results: list[dict], level: float = 0.95) -> str:
    """``pool`` as a Markdown table."""
    lines = ["| heads/rank | M | split / store / relay | runs | pairs (fused, serial) | H pooled | "
             f"{100 * level:.0f}% interval | H per run |", "|" + " --- |" * 8]
    for e in pool(results, level):
        h = e["hiding_ratio"]
        lo, hi = e["interval"]
        per = ", ".join("–" if x is None else f"{x:.3f}" for x in e["per_run"])
        lines.append(f"| {e['heads_per_rank']} | {e['seq_len'] // 1024}K | {e['tail_split']} / {e['store']} / "
                     f"{e['relay']} | {', '.join(e['runs'])} | {e['pairs'][0]}, {e['pairs'][1]} | "
                     f"{'–' if h is None else f'{h:.3f}'} | {lo:.3f}–{hi:.3f} | {per} |")
    return "\n".join(lines)
