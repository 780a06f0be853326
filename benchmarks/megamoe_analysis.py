"""The per-tile stall test (xstage-paper section 5.2.3, eq. 15, Table 2) and per-SM tile timelines (Figure 9's
role) from MegaMoE instrumentation dumps (``xstage bench megamoe --dump FILE``, or its ``--matrix --dump FILE``:
FILE.npz holds ``r<row>.<column>.<array>``, FILE.json the entries). numpy + matplotlib only, so it runs anywhere.
Entries are told apart by shape, tokens per rank, routing, world, rank mode (one GPU, emulated, real) and
precision (the entry's ``precision``; a dump without it, as the bench wrote before, by its column's
``ours_<dtype>_<schedule>``), and within those by schedule.

What each dumped timestamp is (megamoe.kernel, ``MegaMoE.last_dump``; thread 0, i.e. the first MMA
warpgroup's view of the tile, except t_rs):
  t_entry    globaltimer (ns) when the MMA warpgroups begin the tile;
  t_data     when its first K block had arrived: t_data - t_entry is the MMA side's wait at tile entry (for an
             L2 tile it includes the producer's wait for the row's Linear-1 tiles, the l1_done counter);
  t_mma_end  mainloop end; t_end: the tile's rows staged for the store warp (megamoe.epilogue);
  t_staging_wait  ns the MMA side waited, inside its epilogue, for the staging rows: the store warp was still
             sending the previous tile's (the Hopper counterpart of the paper's tmem_empty wait);
  t_rs       L2: clock64 cycles of the store warp from issuing the first warpgroup's 64 Combine rows (bulk row
             copies) to their read-out of shared memory: the sender-visible T_RS.
  load_wait_cycles  clock64 cycles the first warpgroup waited on full stages inside the mainloop (the first K
             block's included): how much of t_mma_end - t_entry the tile's loads left the warpgroup idle.
  mainloop_cycles  its clock64 cycles from t_entry to t_mma_end; over that span's ns, the SM clock the tile
             ran at (``sm_clock_ghz``), which converts the load waits to us (else the assumed clock does).
  phase_stamps  per CTA (not per tile): globaltimer at its start, B1 and B2 passed, the walk done, the store
             warps' last rows written, B3 passed, its sums done, and its own Dispatch done (its arrival at B2);
             ``phases_us`` gives each span's median and max over CTAs (count_b1, dispatch_b2 = dispatch +
             b2_wait, tiles, stores_drain, b3_wait, combine_sum) and the kernel's span.
Dumps of kernels before the staged epilogue (cb8aea6) lack t_staging_wait: there the MMA warpgroups issued the
stores themselves, t_rs sat inside the epilogue (t_end - t_mma_end) and the exposed cost was the whole epilogue.
Per L2 tile i and its successor j (the next slot of the same CTA of the same rank) the stall table computes
  (a) T_RS_i = t_rs / clock;
  (b) T_cover_j = t_mma_end_j - t_data_j, the successor's measured mainloop;
  (c) eq. 15's prediction [T_RS_i - T_cover_j]+ as the paper defines it (and the paper's Table 2 variant with
      the full-tile median mainloop of j's kind in place of j's own);
  (d) the measured stall: the successor's staging wait (older dumps: its entry wait t_data_j - t_entry_j, a
      data wait, reported for both as meas_entry_wait);
and the MMA idle between the two mainloops, t_data_j - t_mma_end_i (epilogue_i + bookkeeping + wait_j).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

DEFAULT_CLOCK_GHZ = 1.98  # SM clock under load on the H200 (benchmarks.spans); this dump cannot calibrate it
ARRAYS = ("cta", "slot", "kind", "expert", "m", "n", "sm", "t_entry", "t_data", "t_mma_end", "t_end", "t_rs")
STAGED = "t_staging_wait"  # dumped since the staged epilogue (cb8aea6); older dumps: zeros, ``staged`` False
LOAD_WAIT = "load_wait_cycles"  # warpgroup 0's cycles waiting on full stages in the mainloop; older dumps lack it
MAINLOOP_CYCLES = "mainloop_cycles"  # its clock64 cycles from t_entry to t_mma_end: the SM clock; older dumps lack it
PHASE_STAMPS = "phase_stamps"  # (CTAs of every rank, megamoe.epilogue.PHASES), dumped since this module's phases
PHASE_NAMES = ("start", "b1", "b2", "walk_end", "stores_done", "b3", "sum_end",
               "dispatch_end")  # megamoe.epilogue.PHASES' order
# what each phase span is: from the first stamp to the second; dispatch_b2 = dispatch + b2_wait, the CTA's own
# Dispatch and its wait at B2 for the slowest (dumps before the dispatch_end stamp: zeros there, no such spans)
PHASE_SPANS = (("count_b1", "start", "b1"), ("dispatch_b2", "b1", "b2"), ("dispatch", "b1", "dispatch_end"),
               ("b2_wait", "dispatch_end", "b2"), ("tiles", "b2", "walk_end"),
               ("stores_drain", "walk_end", "stores_done"), ("b3_wait", "stores_done", "b3"),
               ("combine_sum", "b3", "sum_end"))
L1, L2 = 1, 2
META = ("row", "column", "key_prefix", "shape", "world", "ranks", "tokens_per_rank", "routing", "zipf_exponent", "seed",
        "key")
GROUP = ("shape", "tokens_per_rank", "routing", "world", "ranks", "precision")  # a stall-table row; then schedule


class DumpError(ValueError):
    """A dump that cannot be read: missing file, entry or array."""


# ---------------------------------------------------------------------------------------------- loading
def load_dump(json_path: str, npz_path: str | None = None) -> list[dict]:
    """The dump's entries, each its JSON metadata plus ``precision`` (also as ``dtype``) and ``schedule`` (the
    entry's own, else from the column name ``ours_<dtype>_<schedule>``) and ``arrays`` (name -> numpy array;
    ``rank`` is added as zeros for a world-1 dump that lacks it). ``npz_path`` defaults to the JSON's ``npz``
    name next to the JSON."""
    if not os.path.isfile(json_path):
        raise DumpError(f"dump header {json_path!r} not found (the FILE.json written by bench megamoe --dump)")
    with open(json_path) as f:
        header = json.load(f)
    if npz_path is None:
        name = header.get("npz") or os.path.splitext(os.path.basename(json_path))[0] + ".npz"
        npz_path = os.path.join(os.path.dirname(os.path.abspath(json_path)), name)
    if not os.path.isfile(npz_path):
        raise DumpError(f"dump arrays {npz_path!r} not found (give the npz explicitly: --npz PATH / npz_path=)")
    entries = []
    with np.load(npz_path) as z:
        keys = set(z.files)
        for e in header.get("entries", []):
            prefix = e["key_prefix"]
            missing = [a for a in ARRAYS if f"{prefix}.{a}" not in keys]
            if missing:
                raise DumpError(f"{npz_path}: entry {prefix} lacks arrays {missing}")
            arrays = {a: np.asarray(z[f"{prefix}.{a}"]) for a in ARRAYS}
            staged = f"{prefix}.{STAGED}" in keys
            arrays[STAGED] = np.asarray(z[f"{prefix}.{STAGED}"]) if staged else np.zeros_like(arrays["t_rs"])
            for name in (LOAD_WAIT, MAINLOOP_CYCLES):
                if f"{prefix}.{name}" in keys:
                    arrays[name] = np.asarray(z[f"{prefix}.{name}"])
            if f"{prefix}.{PHASE_STAMPS}" in keys:
                arrays[PHASE_STAMPS] = np.asarray(z[f"{prefix}.{PHASE_STAMPS}"])
            rk = f"{prefix}.rank"
            arrays["rank"] = np.asarray(z[rk]) if rk in keys else np.zeros_like(arrays["cta"])
            parts = e["column"].split("_")
            precision = e.get("precision") or (parts[1] if len(parts) == 3 else "?")
            entries.append({**{k: e.get(k) for k in META}, "precision": precision, "dtype": precision,
                            "schedule": e.get("schedule") or parts[-1], "staged": staged, "arrays": arrays})
    if not entries:
        raise DumpError(f"{json_path}: no dumped entries")
    return entries


# ---------------------------------------------------------------------------------------------- per tile
def phase_spans(stamps) -> dict | None:
    """Median and max over CTAs of each phase span (us) from a dump's phase stamps, and the kernel's span from
    the first CTA's start to the last one's sums; None for a dump without them."""
    if stamps is None or np.asarray(stamps).size == 0:
        return None
    st = np.asarray(stamps, dtype=np.int64)[:, : len(PHASE_NAMES)]
    col = {n: st[:, i] for i, n in enumerate(PHASE_NAMES) if i < st.shape[1] and (st[:, i] != 0).all()}
    out = {name: {"median_us": float(np.median(col[b] - col[a]) * 1e-3), "max_us": float((col[b] - col[a]).max() * 1e-3)}
           for name, a, b in PHASE_SPANS if a in col and b in col}
    out["kernel_us"] = float((col["sum_end"].max() - col["start"].min()) * 1e-3)
    return out


def stream_order(a: dict) -> np.ndarray:
    """Indices sorting the tiles by (rank, cta, slot): each CTA's stream in the order it ran them."""
    return np.lexsort((a["slot"], a["cta"], a["rank"]))


def full_tile_mask(a: dict) -> np.ndarray:
    """Tiles certainly full in M: below their expert's highest m block on their rank. The dump has no per-expert
    row counts, so the last block (possibly partial, with fewer rows to store) is left out even when full."""
    key = a["rank"] * (1 << 20) + a["expert"]
    last = {}
    for k, m in zip(key.tolist(), a["m"].tolist()):
        last[k] = max(last.get(k, -1), m)
    return a["m"] < np.array([last[k] for k in key.tolist()], dtype=a["m"].dtype)


def weight_block_start_spread(a: dict) -> np.ndarray:
    """For each weight block that more than one tile reads (the same rank, kind, expert and N block: the
    expert's M blocks), its tiles' start spread in us (the latest t_entry less the earliest). Tiles that read a
    block together share its DRAM fill; a spread near a tile's time means each fills it alone (swap_tails in
    docs/FINDINGS.md: 0.10 us median in main, 60 us when cheaper tails let CTAs drift)."""
    rank = a["rank"] if "rank" in a else np.zeros_like(a["cta"])
    keys = np.stack([rank, a["kind"], a["expert"], a["n"]], axis=1)
    _, inv, counts = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    inv = np.asarray(inv).ravel()
    t = np.asarray(a["t_entry"], dtype=np.int64)
    lo = np.full(counts.size, np.iinfo(np.int64).max)
    hi = np.full(counts.size, np.iinfo(np.int64).min)
    np.minimum.at(lo, inv, t)
    np.maximum.at(hi, inv, t)
    return (hi - lo)[counts > 1] * 1e-3


def tile_table(a: dict, clock_ghz: float = DEFAULT_CLOCK_GHZ) -> dict:
    """Per-tile derived quantities (us) in stream order, and for each L2 tile with a successor in its CTA the
    (a)-(d) of the module docstring. Keys ending in _succ are indexed by the L2 tiles that have a successor."""
    o = stream_order(a)
    s = {k: v[o] for k, v in a.items() if k != PHASE_STAMPS}  # (the stamps are per CTA, not per tile)
    us = 1e-3
    wait = (s["t_data"] - s["t_entry"]) * us
    mainloop = (s["t_mma_end"] - s["t_data"]) * us
    epilogue = (s["t_end"] - s["t_mma_end"]) * us
    t_rs = s["t_rs"] / (clock_ghz * 1e3)
    staging = s[STAGED] * us if STAGED in s else np.zeros_like(t_rs)
    # the SM clock each tile ran at (GHz), where the dump has its cycles: a power-capped chip moves it by tile
    clock = (s[MAINLOOP_CYCLES] / np.maximum(s["t_mma_end"] - s["t_entry"], 1) if MAINLOOP_CYCLES in s
             else np.full(t_rs.shape, clock_ghz))
    full = full_tile_mask(s)
    same = (s["rank"][1:] == s["rank"][:-1]) & (s["cta"][1:] == s["cta"][:-1])
    i = np.nonzero((s["kind"][:-1] == L2) & same)[0]  # L2 tiles with a successor; j = i + 1
    j = i + 1
    return {"sorted": s, "wait": wait, "mainloop": mainloop, "epilogue": epilogue, "t_rs": t_rs, "full": full,
            "succ_i": i, "succ_j": j, "succ_kind": s["kind"][j], "t_rs_succ": t_rs[i], "cover_succ": mainloop[j],
            "pred_succ": np.maximum(0.0, t_rs[i] - mainloop[j]), "wait_succ": wait[j], "staging_succ": staging[j],
            "staging_wait": staging,
            "load_wait": s[LOAD_WAIT] / (clock * 1e3) if LOAD_WAIT in s else None,
            "clock": clock if MAINLOOP_CYCLES in s else None,
            "gap_succ": (s["t_entry"][j] - s["t_end"][i]) * us,
            "mma_idle_succ": (s["t_data"][j] - s["t_mma_end"][i]) * us}


def _stats(x) -> dict:
    x = np.asarray(x, dtype=float)
    if x.size == 0:
        return {"n": 0, "median": None, "p90": None, "mean": None}
    return {"n": int(x.size), "median": float(np.median(x)), "p90": float(np.percentile(x, 90)),
            "mean": float(x.mean())}


def timer_tick_ns(a: dict) -> int:
    """The globaltimer's resolution as dumped: the gcd of the timestamps' offsets (32 ns on the H200 here),
    which is the floor every measured wait sits on."""
    t = np.concatenate([np.asarray(a[k]).ravel() for k in ("t_entry", "t_data", "t_mma_end", "t_end")])
    return int(np.gcd.reduce(t - t.min())) if t.size > 1 else 0


def entry_summary(entry: dict, clock_ghz: float = DEFAULT_CLOCK_GHZ) -> dict:
    """One (row, schedule): tile counts and the medians the stall test and Table 2 report (us)."""
    a = entry["arrays"]
    t = tile_table(a, clock_ghz)
    kind = t["sorted"]["kind"]
    l1, l2 = kind == L1, kind == L2
    cover_med = {k: float(np.median(t["mainloop"][(kind == k) & t["full"]])) if ((kind == k) & t["full"]).any()
                 else float(np.median(t["mainloop"][kind == k])) for k in (L1, L2) if (kind == k).any()}
    # Table 2's variant: the successor's kind's full-tile median mainloop instead of its own measured one
    pred_med = np.maximum(0.0, t["t_rs_succ"] - np.array([cover_med[k] for k in t["succ_kind"].tolist()]))
    tick = timer_tick_ns(a)
    staged = bool(entry.get("staged"))
    # measured stall: the staging wait where the dump has it, else (older kernels) the entry wait
    meas = t["staging_succ"] if staged else t["wait_succ"]
    ep_ns = (a["t_end"] - a["t_mma_end"])[a["kind"] == L2]
    return {
        **{k: entry.get(k) for k in (*GROUP, "dtype", "schedule", "column")},
        "tiles": int(kind.size), "l1_tiles": int(l1.sum()), "l2_tiles": int(l2.sum()),
        "l1_full_tiles": int((l1 & t["full"]).sum()), "l2_full_tiles": int((l2 & t["full"]).sum()),
        "l2_with_successor": int(t["succ_i"].size), "ctas": int(np.unique(a["rank"] * 4096 + a["cta"]).size),
        "t_rs_us": _stats(t["t_rs"][l2]), "t_rs_full_tiles_us": _stats(t["t_rs"][l2 & t["full"]]),
        "mainloop_full_us": {"L1": _stats(t["mainloop"][l1 & t["full"]]), "L2": _stats(t["mainloop"][l2 & t["full"]])},
        "epilogue_us": {"L1": _stats(t["epilogue"][l1]), "L2": _stats(t["epilogue"][l2])},
        "entry_wait_us": {"L1": _stats(t["wait"][l1]), "L2": _stats(t["wait"][l2])},
        "successor": {
            "cover_us": _stats(t["cover_succ"]), "pred_dt_us": _stats(t["pred_succ"]),
            "pred_dt_fullmedian_cover_us": _stats(pred_med), "meas_wait_us": _stats(meas),
            "meas_wait_above_tick": float(np.mean(meas * 1e3 > tick)) if t["succ_i"].size else None,
            "meas_wait_is": "staging wait" if staged else "entry wait", "meas_entry_wait_us": _stats(t["wait_succ"]),
            "meas_wait_by_kind_us": {n: _stats(t["wait_succ"][t["succ_kind"] == k])
                                     for n, k in (("L1", L1), ("L2", L2))},
            "bookkeeping_gap_us": _stats(t["gap_succ"]), "mma_idle_between_mainloops_us": _stats(t["mma_idle_succ"]),
            "successor_l1_fraction": float(np.mean(t["succ_kind"] == L1)) if t["succ_i"].size else None},
        "timer_tick_ns": tick, "staged": staged, "phases_us": phase_spans(a.get(PHASE_STAMPS)),
        "staging_wait_us": {"L1": _stats(t["staging_wait"][l1]), "L2": _stats(t["staging_wait"][l2])},
        # the mainloop's waits on its loads, in tiles below their expert's last M block and in last blocks (the
        # tails): where a tile's time goes when it is not the Tensor Cores'
        "load_wait_us": None if t["load_wait"] is None else {
            f"{n} {part}": _stats(t["load_wait"][(kind == k) & sel])
            for n, k in (("L1", L1), ("L2", L2)) for part, sel in (("full", t["full"]), ("last", ~t["full"]))},
        "mainloop_last_us": {"L1": _stats(t["mainloop"][l1 & ~t["full"]]),
                             "L2": _stats(t["mainloop"][l2 & ~t["full"]])},
        "sm_clock_ghz": None if t["clock"] is None else {
            f"{n} {part}": _stats(t["clock"][(kind == k) & sel])
            for n, k in (("L1", L1), ("L2", L2)) for part, sel in (("full", t["full"]), ("last", ~t["full"]))},
        # T_RS sits inside the epilogue, so cycles / ns over the epilogue bounds the clock from below
        "clock_ghz_used": clock_ghz,
        "clock_ghz_lower_bound": (float((a["t_rs"][a["kind"] == L2] / np.maximum(ep_ns, 1)).max())
                                  if ep_ns.size and not staged else None),
        "weight_block_start_spread_us": _stats(weight_block_start_spread(a)),
        "span_us": float((a["t_end"].max() - a["t_entry"].min()) * 1e-3),
        # emulated ranks own different experts: skewed routing loads them unevenly, the kernel waits for the last
        "rank_end_us": {int(r): float((a["t_end"][a["rank"] == r].max() - a["t_entry"].min()) * 1e-3)
                        for r in np.unique(a["rank"])},
    }


# ---------------------------------------------------------------------------------------------- the table
def spearman(x, y) -> float:
    """Spearman's rank correlation (average ranks for ties); nan when either side is constant or n < 2."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.size != y.size:
        raise ValueError(f"spearman: {x.size} vs {y.size} values")
    if x.size < 2:
        return float("nan")
    rx, ry = _ranks(x), _ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = np.sqrt((rx * rx).sum() * (ry * ry).sum())
    return float((rx * ry).sum() / den) if den > 0 else float("nan")


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(x.size)
    ranks[order] = np.arange(1, x.size + 1)
    for v in np.unique(x):  # ties share their mean rank
        tie = x == v
        if tie.sum() > 1:
            ranks[tie] = ranks[tie].mean()
    return ranks


def _group(s: dict) -> tuple:
    return tuple(s.get(k) for k in GROUP)


def world_label(e: dict) -> str:
    """P<world>, or EP<world> at real ranks (the matrix's key)."""
    return f"{'EP' if e.get('ranks') == 'real' else 'P'}{e['world']}"


def stall_table(entries: list[dict], clock_ghz: float = DEFAULT_CLOCK_GHZ) -> dict:
    """Every entry's summary, the rows grouped by GROUP (shape, tokens, routing, world, rank mode, precision)
    with the schedules side by side and the interleaved/wave T_RS median ratio, and the Spearman correlation
    of eq. 15's predicted vs the measured successor wait across the entries (medians and means; all, per
    schedule and, where the dump holds more than one, per precision)."""
    summaries = [entry_summary(e, clock_ghz) for e in entries]
    rows = {}
    for s in summaries:
        rows.setdefault(_group(s), {})[s["schedule"]] = s
    table = []
    for key, by in rows.items():
        r = dict(zip(GROUP, key), dtype=key[GROUP.index("precision")], schedules=by)
        w, i = by.get("wave"), by.get("interleaved")
        r["t_rs_median_int_over_wave"] = (i["t_rs_us"]["median"] / w["t_rs_us"]["median"]
                                          if w and i and w["t_rs_us"]["median"] else None)
        table.append(r)
    corr = {}
    precisions = list(dict.fromkeys(s["precision"] for s in summaries))
    subsets = [("all", lambda s: True), *((n, lambda s, n=n: s["schedule"] == n) for n in ("wave", "interleaved")),
               *((p, lambda s, p=p: s["precision"] == p) for p in (precisions if len(precisions) > 1 else []))]
    for stat in ("median", "mean"):
        corr[stat] = {}
        for name, sel in subsets:
            ss = [s for s in summaries if sel(s) and s["l2_with_successor"]]
            corr[stat][name] = {"n": len(ss), "rho": spearman([s["successor"]["pred_dt_us"][stat] for s in ss],
                                                              [s["successor"]["meas_wait_us"][stat] for s in ss])}
    return {"clock_ghz": clock_ghz, "rows": table, "spearman_pred_vs_meas": corr,
            "definitions": _definitions()}


def _definitions() -> str:
    doc = __doc__ or ""  # (python -OO strips docstrings)
    i = doc.find("What each dumped timestamp is")
    return doc[i:].strip() if i >= 0 else "see benchmarks/megamoe_analysis.py"


def _f(x, nd=2) -> str:
    return "-" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.{nd}f}"


ROW_KEY_HEADER = "| shape | precision | tok/rank | routing | P | "


def _row_key(r: dict) -> list[str]:
    """A table row's first five cells (ROW_KEY_HEADER's columns)."""
    return [r["shape"], str(r["precision"]), str(r["tokens_per_rank"]), r["routing"], str(r["world"])]


def _per_order(r: dict, text, needs: str | None = None) -> str:
    """Row ``r``'s cell as wave / interleaved: ``text(entry)`` for each order, "-" where the order, or its field
    ``needs``, is missing."""
    by = r["schedules"]
    return " / ".join(text(by[k]) if k in by and (needs is None or by[k].get(needs)) else "-"
                      for k in ("wave", "interleaved"))


def stall_markdown(table: dict, title: str = "") -> str:
    """Table 2-style markdown: one line per row, each cell wave / interleaved (us)."""
    cols = ["shape", "precision", "tok/rank", "routing", "P", "L2 tiles w/i", "T_RS med", "T_RS p90", "int/wave", "T_mma L1 full",
            "T_mma L2 full", "L2 epilogue", "cover (succ.)", "Δt pred (eq. 15)", "succ. wait meas",
            "MMA idle L2→succ."]
    out = [f"# Per-tile stall test{': ' + title if title else ''}", "",
           (f"Cells are wave / interleaved medians in µs; T_RS at {table['clock_ghz']} GHz. The measured stall is "
            "the successor's staging wait (dumps before the staged epilogue: its entry wait). See the definitions "
            "below."), "",
           "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def pair(r, get, nd=2):
        return _per_order(r, lambda e: _f(get(e), nd))

    for r in table["rows"]:
        out.append("| " + " | ".join([
            r["shape"], str(r["precision"]), str(r["tokens_per_rank"]), r["routing"],
            str(r["world"]) + (" (real)" if r.get("ranks") == "real" else ""),
            pair(r, lambda s: s["l2_tiles"], 0), pair(r, lambda s: s["t_rs_us"]["median"]),
            pair(r, lambda s: s["t_rs_us"]["p90"]), _f(r["t_rs_median_int_over_wave"], 3),
            pair(r, lambda s: s["mainloop_full_us"]["L1"]["median"]),
            pair(r, lambda s: s["mainloop_full_us"]["L2"]["median"]),
            pair(r, lambda s: s["epilogue_us"]["L2"]["median"]),
            pair(r, lambda s: s["successor"]["cover_us"]["median"]),
            pair(r, lambda s: s["successor"]["pred_dt_us"]["median"], 3),
            pair(r, lambda s: s["successor"]["meas_wait_us"]["median"], 3),
            pair(r, lambda s: s["successor"]["mma_idle_between_mainloops_us"]["median"])]) + " |")
    out += ["", "Spearman rank correlation, eq. 15 predicted Δt vs measured successor wait, across entries:", ""]
    for stat, by in table["spearman_pred_vs_meas"].items():
        out.append(f"- {stat}s: " + ", ".join(f"{k} ρ = {_f(v['rho'], 3)} (n = {v['n']})" for k, v in by.items()))
    every = [s for r in table["rows"] for s in r["schedules"].values()]
    ticks = sorted({s["timer_tick_ns"] for s in every})
    bound = max((s["clock_ghz_lower_bound"] or 0) for s in every)
    clock_note = (f"T_RS cycles over the epilogue's ns bound the clock from below at {bound:.2f} GHz. " if bound
                  else "")
    out += ["", "(ρ is undefined, shown -, where one side is constant, e.g. every predicted median is 0.)", "",
            (f"globaltimer resolution in this dump: {ticks} ns, so a wait of one tick is zero within resolution; "
            f"{clock_note}The successor "
            "wait by the successor's kind (an L2 successor also waits for its row's Linear-1 tiles, which eq. 15 "
            "does not model) is in the JSON, meas_wait_by_kind_us."), ""]
    if any(s.get("phases_us") for s in every):
        names = [n for n, _, _ in PHASE_SPANS]
        out += ["## Phases", "", "Median over CTAs (µs), wave / interleaved; the kernel's span from the first CTA's "
                "start to the last one's sums.", "",
                ROW_KEY_HEADER + " | ".join(names) + " | kernel |", "|" + "---|" * (6 + len(names))]
        for r in table["rows"]:
            def cell(get, r=r):
                return _per_order(r, lambda e: _f(get(e["phases_us"]), 1), "phases_us")
            spans = [cell(lambda p, n=n: p[n]["median_us"] if n in p else None) for n in names]
            out.append("| " + " | ".join(_row_key(r) + spans + [cell(lambda p: p["kernel_us"])]) + " |")
        out.append("")
    if any(s.get("sm_clock_ghz") for s in every):
        parts = ("L1 full", "L1 last", "L2 full", "L2 last")
        out += ["## Mainloops: time, wait on loads, SM clock", "",
                "Median per tile kind (µs, µs, GHz), wave / interleaved; full: below the expert's last M block, "
                "last: its last block. Cycles = µs x GHz: a mainloop bound by its own work keeps its cycles when "
                "the clock moves.", "",
                ROW_KEY_HEADER + " | ".join(parts) + " |", "|" + "---|" * (5 + len(parts))]

        def kind_text(e, part):  # one order's mainloop us, load wait us, SM GHz for one tile kind
            kind, which = part.split()
            ml = e["mainloop_full_us" if which == "full" else "mainloop_last_us"][kind]["median"]
            return ", ".join(_f(v) for v in (ml, e["load_wait_us"][part]["median"], e["sm_clock_ghz"][part]["median"]))
        for r in table["rows"]:
            cells = [_per_order(r, lambda e, p=p: kind_text(e, p), "sm_clock_ghz") for p in parts]
            out.append("| " + " | ".join(_row_key(r) + cells) + " |")
        out.append("")
    if any(s.get("weight_block_start_spread_us", {}).get("n") for s in every):
        out += ["## Weight-block mates", "",
                "Tiles reading one weight block (the same kind, expert and N block) share its DRAM fill while they "
                "run together: their start spread (latest start less earliest), µs, median and p90 over the "
                "blocks read by more than one tile, wave / interleaved.", "",
                ROW_KEY_HEADER + "blocks | spread median | spread p90 |", "|" + "---|" * 8]
        for r in table["rows"]:
            def spread(get, nd=2, r=r):
                return _per_order(r, lambda e: _f(get(e["weight_block_start_spread_us"]), nd),
                                  "weight_block_start_spread_us")
            out.append("| " + " | ".join(_row_key(r) + [spread(lambda v: v["n"], 0), spread(lambda v: v["median"]),
                                                         spread(lambda v: v["p90"])]) + " |")
        out.append("")
    out += ["## Definitions", "", "```", table["definitions"], "```", ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- figures
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


COLORS = {"wave": "tab:red", "interleaved": "tab:blue", L1: "tab:green", L2: "tab:purple"}


def plot_spans(entries: list[dict], png: str, clock_ghz: float = DEFAULT_CLOCK_GHZ, dpi: int = 100) -> None:
    """Figure 10-style: per (shape, precision) (rows) and (tokens, routing, world) (columns) the L2 tiles' T_RS
    histograms, wave vs interleaved overlaid, their medians marked."""
    plt = _plt()
    shapes = list(dict.fromkeys((e["shape"], e["precision"]) for e in entries))
    cases = list(dict.fromkeys((e["tokens_per_rank"], e["routing"], world_label(e)) for e in entries))
    fig, axes = plt.subplots(len(shapes), len(cases), figsize=(3.0 * len(cases), 2.3 * len(shapes)),
                             squeeze=False, sharex=True)
    spans = [e["arrays"]["t_rs"][e["arrays"]["kind"] == L2] / (clock_ghz * 1e3) for e in entries]
    hi = max((np.percentile(s, 99.5) for s in spans if s.size), default=1.0)
    bins = np.linspace(0, hi * 1.05, 60)
    for e, s in zip(entries, spans):
        ax = axes[shapes.index((e["shape"], e["precision"]))][cases.index((e["tokens_per_rank"], e["routing"],
                                                                           world_label(e)))]
        c = COLORS.get(e["schedule"], "gray")
        if s.size:
            ax.hist(s, bins=bins, histtype="step", color=c, density=True,
                    label=f"{e['schedule']} (med {np.median(s):.2f})")
            ax.axvline(np.median(s), color=c, ls="--", lw=0.8)
    for r, (shape, precision) in enumerate(shapes):
        for c, (tok, routing, world) in enumerate(cases):
            ax = axes[r][c]
            ax.set_title(f"{shape} {precision} {tok} tok {routing} {world}", fontsize=8)
            ax.tick_params(labelsize=7)
            if ax.get_legend_handles_labels()[0]:  # a case this shape was not run at stays empty
                ax.legend(fontsize=6, loc="upper right")
            if r == len(shapes) - 1:
                ax.set_xlabel("T_RS per L2 tile (µs)", fontsize=8)
    fig.suptitle("Sender-visible Combine store span T_RS (L2 epilogue), wave vs interleaved", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=dpi)
    plt.close(fig)


def _activity(start, end, edges):
    """Mean number of intervals [start, end) active in each bin of ``edges``: F(T) = sum over intervals of
    their length before T, from sorted starts and ends (O(n log n))."""
    def integral(points):
        p = np.sort(points)
        c = np.concatenate([[0.0], np.cumsum(p)])
        k = np.searchsorted(p, edges, side="right")
        return k * edges - c[k]
    F = integral(start) - integral(end)
    return np.diff(F) / np.diff(edges)


def plot_timeline(entry: dict, png: str, max_sms: int | None = None, window_us: float | None = 400.0,
                  dpi: int = 100) -> None:
    """Per-SM Gantt chart of one entry: each CTA a row (grouped by rank, one panel each), the L1 / L2
    mainloops coloured, the epilogue (t_mma_end..t_end) in a light shade, the entry wait in gray; times in µs
    from the first t_entry. Below: the fraction of CTAs in a mainloop over time (the Tensor Core side's
    activity), and a zoom of rank 0's first CTAs over ``window_us`` mid-kernel where single tiles resolve."""
    plt = _plt()
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    a = entry["arrays"]
    t0 = a["t_entry"].min()
    rel = {k: (a[k] - t0) * 1e-3 for k in ("t_entry", "t_data", "t_mma_end", "t_end")}
    ranks = np.unique(a["rank"]).tolist()
    n_ctas = int(np.unique(a["rank"] * 4096 + a["cta"]).size)
    shown = sum(min(np.unique(a["cta"][a["rank"] == r]).size, max_sms or n_ctas) for r in ranks)
    span = float(rel["t_end"].max())
    zoom = window_us is not None and window_us < span
    heights = [1.0] * len(ranks) + [0.35] + ([0.8] if zoom else [])
    fig, axes = plt.subplots(len(heights), 1, figsize=(12, max(4.0, 2.0 + 0.07 * shown) + (1.5 if zoom else 0)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    axes = axes[:, 0]

    def gantt(ax, sel, row_of):
        # one PolyCollection per (segment, kind): tens of thousands of tiles draw in seconds, barh takes minutes
        for k in (L1, L2):
            m = sel & (a["kind"] == k)
            y = row_of[m]
            for lo, hi, color, alpha in (("t_entry", "t_data", "0.6", 1.0), ("t_data", "t_mma_end", COLORS[k], 1.0),
                                         ("t_mma_end", "t_end", COLORS[k], 0.35)):
                x0, x1 = rel[lo][m], rel[hi][m]
                verts = np.stack([np.stack([x0, y - 0.4], -1), np.stack([x1, y - 0.4], -1),
                                  np.stack([x1, y + 0.4], -1), np.stack([x0, y + 0.4], -1)], 1)
                ax.add_collection(PolyCollection(verts, facecolors=color, alpha=alpha, linewidths=0))

    for p, rank in enumerate(ranks):
        ctas = np.unique(a["cta"][a["rank"] == rank])[:max_sms]
        row_of = np.searchsorted(ctas, a["cta"]).astype(float)
        sel = (a["rank"] == rank) & np.isin(a["cta"], ctas)
        gantt(axes[p], sel, row_of)
        axes[p].set_ylim(len(ctas) - 0.5, -0.5)
        axes[p].set_xlim(0, span)
        axes[p].set_ylabel(f"rank {rank}: CTA", fontsize=8)
        axes[p].set_title(f"rank {rank}: {len(ctas)} CTAs on {np.unique(a['sm'][sel]).size} SMs", fontsize=8)
    edges = np.linspace(0, span, 801)
    act = _activity(rel["t_data"], rel["t_mma_end"], edges) / n_ctas
    ax = axes[len(ranks)]
    ax.plot(0.5 * (edges[1:] + edges[:-1]), act, lw=0.7, color="k")
    ax.set_xlim(0, span)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("in mainloop", fontsize=8)
    ax.set_xlabel("time since first tile entry (µs)", fontsize=8)
    if zoom:
        lo = span / 2 - window_us / 2
        ax = axes[-1]
        ctas = np.unique(a["cta"][a["rank"] == ranks[0]])[:min(16, max_sms or 16)]
        sel = ((a["rank"] == ranks[0]) & np.isin(a["cta"], ctas) & (rel["t_end"] > lo)
               & (rel["t_entry"] < lo + window_us))
        gantt(ax, sel, np.searchsorted(ctas, a["cta"]).astype(float))
        ax.set_xlim(lo, lo + window_us)
        ax.set_ylim(len(ctas) - 0.5, -0.5)
        ax.set_ylabel("CTA (zoom)", fontsize=8)
        ax.set_xlabel(f"zoom: rank {ranks[0]}, {window_us:.0f} µs mid-kernel (µs)", fontsize=8)
    for ax in axes:
        ax.tick_params(labelsize=7)
    fig.legend(handles=[Patch(color=COLORS[L1], label="L1 mainloop"), Patch(color=COLORS[L2], label="L2 mainloop"),
                        Patch(color=COLORS[L1], alpha=0.35, label="L1 epilogue"),
                        Patch(color=COLORS[L2], alpha=0.35, label="L2 epilogue (Combine stores)"),
                        Patch(color="0.6", label="entry wait (t_entry..t_data)")],
               loc="upper right", ncol=5, fontsize=7)
    fig.suptitle(f"{entry['shape']} {entry['tokens_per_rank']} tok/rank {entry['routing']} {world_label(entry)} "
                 f"{entry['column']}: {span:.0f} µs", fontsize=9, x=0.3)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(png, dpi=dpi)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- CLI
def timeline_entries(entries: list[dict], every: bool = False) -> list[dict]:
    """Which entries get a timeline: all, or per shape its first precision (bf16 where there), skewed (else
    first) routing, at the most tokens and the largest world, both schedules (the paper's Figure 9 shows where
    bursts matter most)."""
    if every:
        return list(entries)
    picked = []
    for shape in dict.fromkeys(e["shape"] for e in entries):
        mine = [e for e in entries if e["shape"] == shape]
        precision = "bf16" if any(e["precision"] == "bf16" for e in mine) else mine[0]["precision"]
        mine = [e for e in mine if e["precision"] == precision]
        routing = "skewed" if any(e["routing"] == "skewed" for e in mine) else mine[0]["routing"]
        mine = [e for e in mine if e["routing"] == routing]
        best = max((e["world"], e["tokens_per_rank"]) for e in mine)  # a pair that was dumped (a run may stop)
        picked += [e for e in mine if (e["world"], e["tokens_per_rank"]) == best]
    return picked


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.megamoe_analysis",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("dump", help="the FILE.json of xstage bench megamoe --dump")
    p.add_argument("--npz", default=None, help="the arrays (default: the JSON's npz name next to it)")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--clock-ghz", type=float, default=DEFAULT_CLOCK_GHZ, help="clock64 rate for T_RS")
    p.add_argument("--all-timelines", action="store_true", help="a timeline for every entry")
    p.add_argument("--max-sms", type=int, default=None, help="CTAs per rank in a timeline")
    args = p.parse_args(argv)
    try:
        entries = load_dump(args.dump, args.npz)
    except DumpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.splitext(os.path.basename(args.dump))[0].removesuffix("_header")
    def out(suffix):
        return os.path.join(args.out_dir, f"{stem}_{suffix}")

    table = stall_table(entries, args.clock_ghz)
    with open(args.dump) as f:
        provenance = json.load(f).get("provenance")
    with open(out("stall.json"), "w") as f:
        json.dump({"dump": os.path.basename(args.dump), "provenance": provenance, **table}, f, indent=1)
    with open(out("stall.md"), "w") as f:
        f.write(stall_markdown(table, stem))
    plot_spans(entries, out("spans.png"), args.clock_ghz)
    written = [out("stall.json"), out("stall.md"), out("spans.png")]
    for e in timeline_entries(entries, args.all_timelines):
        png = out(f"timeline_{e['shape']}_{e['precision']}_{e['tokens_per_rank']}_{e['routing']}_{world_label(e)}_"
                  f"{e['schedule']}.png")
        plot_timeline(e, png, max_sms=args.max_sms)
        written.append(png)
    print("\n".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
