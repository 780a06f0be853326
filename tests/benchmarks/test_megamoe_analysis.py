"""benchmarks.megamoe_analysis on a small synthetic dump written the way ``bench megamoe --dump`` writes one
(FILE.npz keyed r<row>.<column>.<array>, FILE.json with the entries): loading and its errors, the successor
pairing within a CTA in slot order, eq. 15's arithmetic, the full-tile rule, Spearman against hand examples,
the table, the figures and the CLI. CPU only, no torch."""
import json
import math
import os

import numpy as np
import pytest

from benchmarks import megamoe_analysis as ma

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CLOCK = 2.0  # GHz: 1000 cycles = 0.5 us, easy arithmetic

# per (rank, cta) its stream: (kind, expert, m, wait, mainloop, epilogue, gap after, t_rs cycles); times in ns
STREAMS = {
    (0, 0): [(1, 0, 0, 32, 4000, 500, 300, 0), (2, 0, 0, 32, 2000, 1500, 300, 6000),  # T_RS 3.0 us
             (1, 1, 0, 800, 2000, 500, 300, 0), (2, 1, 0, 32, 2000, 1500, 300, 4000)],  # last: no successor
    (0, 1): [(1, 0, 1, 32, 4000, 500, 300, 0), (2, 0, 1, 32, 2000, 1500, 300, 2000),  # T_RS 1.0 us
             (2, 1, 0, 5000, 1000, 1500, 300, 3000)],
    (1, 0): [(2, 0, 0, 32, 2000, 1500, 300, 9000), (1, 0, 0, 64, 5000, 500, 300, 0)],  # 4.5 vs 5.0: 0
}


def synthetic(schedule="wave", t0=10**18, scale=1.0):
    """The arrays of one entry; ``scale`` stretches every T_RS (a different schedule's spans). Tiles are listed
    rank by rank but slots of a CTA out of order, as nothing promises the dump's order."""
    cols = {k: [] for k in ma.ARRAYS + ("rank",)}
    for (rank, cta), tiles in STREAMS.items():
        t = t0 + 1000 * cta
        for slot, (kind, e, m, wait, ml, epi, gap, rs) in enumerate(tiles):
            vals = {"cta": cta, "slot": slot, "kind": kind, "expert": e, "m": m, "n": slot, "sm": 10 * rank + cta,
                    "rank": rank, "t_entry": t, "t_data": t + wait, "t_mma_end": t + wait + ml,
                    "t_end": t + wait + ml + epi, "t_rs": int(rs * scale)}
            for k, v in vals.items():
                cols[k].append(v)
            t = vals["t_end"] + gap
    order = np.random.default_rng(0).permutation(len(cols["cta"]))
    return {k: np.asarray(v, dtype=np.int64)[order] for k, v in cols.items()}


def write_dump(tmp_path, name="dump", with_rank=True):
    arrays, entries = {}, []
    for row, (shape, routing) in enumerate((("tiny", "skewed"), ("small", "balanced"))):
        for schedule, scale in (("wave", 1.0), ("interleaved", 0.5 if row == 0 else 2.0)):
            prefix = f"r{row}.ours_bf16_{schedule}"
            for k, v in synthetic(schedule, scale=scale).items():
                if with_rank or k != "rank":
                    arrays[f"{prefix}.{k}"] = v
            entries.append({"row": row, "column": f"ours_bf16_{schedule}", "key_prefix": prefix, "shape": shape,
                            "world": 2, "tokens_per_rank": 64, "routing": routing, "seed": 1, "arrays": {}})
    np.savez_compressed(tmp_path / f"{name}.npz", **arrays)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"provenance": {"git_commit": "test"}, "npz": f"{name}.npz", "entries": entries}))
    return path


def test_load_dump_default_and_explicit_npz(tmp_path):
    path = write_dump(tmp_path)
    entries = ma.load_dump(str(path))
    assert [(e["shape"], e["schedule"], e["dtype"]) for e in entries] == [
        ("tiny", "wave", "bf16"), ("tiny", "interleaved", "bf16"), ("small", "wave", "bf16"),
        ("small", "interleaved", "bf16")]
    assert entries[0]["arrays"]["t_rs"].size == sum(len(s) for s in STREAMS.values())
    moved = tmp_path / "elsewhere.npz"
    os.rename(tmp_path / "dump.npz", moved)
    again = ma.load_dump(str(path), str(moved))
    np.testing.assert_array_equal(again[1]["arrays"]["t_end"], entries[1]["arrays"]["t_end"])


def test_missing_files_and_arrays_raise_clearly(tmp_path):
    with pytest.raises(ma.DumpError, match="dump header .*nope.json.* not found"):
        ma.load_dump(str(tmp_path / "nope.json"))
    path = write_dump(tmp_path)
    os.remove(tmp_path / "dump.npz")
    with pytest.raises(ma.DumpError, match=r"dump.npz.* not found .*--npz"):
        ma.load_dump(str(path))
    with pytest.raises(ma.DumpError, match="not found"):
        ma.load_dump(str(path), str(tmp_path / "other.npz"))
    path = write_dump(tmp_path)
    with np.load(tmp_path / "dump.npz") as z:
        kept = {k: z[k] for k in z.files if k != "r1.ours_bf16_wave.t_rs"}
    np.savez(tmp_path / "dump.npz", **kept)
    with pytest.raises(ma.DumpError, match=r"r1.ours_bf16_wave lacks arrays \['t_rs'\]"):
        ma.load_dump(str(path))
    assert ma.main([str(tmp_path / "missing.json"), "--out-dir", str(tmp_path / "o")]) == 2


def test_world1_dump_without_rank_gets_zeros(tmp_path):
    entries = ma.load_dump(str(write_dump(tmp_path, with_rank=False)))
    assert not entries[0]["arrays"]["rank"].any()


def test_successor_pairing_within_cta_in_slot_order():
    t = ma.tile_table(synthetic(), CLOCK)
    s = t["sorted"]
    pairs = [((s["rank"][i], s["cta"][i], s["slot"][i]), (s["rank"][j], s["cta"][j], s["slot"][j]))
             for i, j in zip(t["succ_i"], t["succ_j"])]
    # every L2 tile but the last of its CTA, each to the next slot of the same CTA; rank 1's CTA 0 is not
    # rank 0's CTA 0, and the last L2 of (0, 0) or (0, 1) pairs with nothing across the boundary
    assert pairs == [((0, 0, 1), (0, 0, 2)), ((0, 1, 1), (0, 1, 2)), ((1, 0, 0), (1, 0, 1))]
    np.testing.assert_array_equal(t["succ_kind"], [1, 2, 1])


def test_eq15_arithmetic_and_measured_quantities():
    t = ma.tile_table(synthetic(), CLOCK)
    np.testing.assert_allclose(t["t_rs_succ"], [3.0, 1.0, 4.5])
    np.testing.assert_allclose(t["cover_succ"], [2.0, 1.0, 5.0])  # successor mainloop t_mma_end - t_data
    np.testing.assert_allclose(t["pred_succ"], [1.0, 0.0, 0.0])  # [T_RS - T_cover]+
    np.testing.assert_allclose(t["wait_succ"], [0.8, 5.0, 0.064])  # successor's t_data - t_entry
    np.testing.assert_allclose(t["gap_succ"], [0.3, 0.3, 0.3])
    # MMA idle between the two mainloops = epilogue + gap + successor wait
    np.testing.assert_allclose(t["mma_idle_succ"], [1.5 + 0.3 + 0.8, 1.5 + 0.3 + 5.0, 1.5 + 0.3 + 0.064])


def test_full_tiles_and_summary():
    a = synthetic()
    full = ma.full_tile_mask(a)
    # rank 0 expert 0 has m blocks 0 and 1: only m = 0 is certainly full; expert 1 (one block) none
    expect = (a["rank"] == 0) & (a["expert"] == 0) & (a["m"] == 0)
    np.testing.assert_array_equal(full, expect)
    entry = {"shape": "tiny", "tokens_per_rank": 64, "routing": "skewed", "world": 2, "dtype": "bf16",
             "schedule": "wave", "column": "ours_bf16_wave", "arrays": a}
    s = ma.entry_summary(entry, CLOCK)
    assert (s["tiles"], s["l1_tiles"], s["l2_tiles"], s["l2_with_successor"], s["ctas"]) == (9, 4, 5, 3, 3)
    assert s["mainloop_full_us"]["L1"]["median"] == 4.0 and s["mainloop_full_us"]["L2"]["median"] == 2.0
    assert s["t_rs_us"]["median"] == pytest.approx(2.0)  # of 3, 2, 1, 1.5, 4.5
    assert s["successor"]["pred_dt_us"]["mean"] == pytest.approx(1 / 3)
    # Table 2's variant: full-tile medians of the successor's kind (L1 4.0, L2 2.0) as the cover
    assert s["successor"]["pred_dt_fullmedian_cover_us"]["mean"] == pytest.approx((0 + 0 + 0.5) / 3)
    assert s["timer_tick_ns"] == 4  # gcd of the synthetic offsets (32, 64, 300, 500, ...)
    assert s["epilogue_us"]["L2"]["median"] == 1.5 and s["rank_end_us"][1] < s["rank_end_us"][0]


def test_spearman_hand_examples():
    assert ma.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)  # 1 - 6 * 2 / (4 * 15)
    # with a tie: ranks of y (5, 6, 7, 8, 7) are (1, 2, 3.5, 5, 3.5): 8 / sqrt(10 * 9.5)
    assert ma.spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / math.sqrt(95))
    assert ma.spearman([3, 1, 2], [30, 10, 20]) == pytest.approx(1.0)
    assert ma.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(ma.spearman([0, 0, 0], [1, 2, 3])) and math.isnan(ma.spearman([1], [2]))
    with pytest.raises(ValueError):
        ma.spearman([1, 2], [1, 2, 3])


def test_stall_table_groups_schedules_and_markdown(tmp_path):
    table = ma.stall_table(ma.load_dump(str(write_dump(tmp_path))), CLOCK)
    assert [(r["shape"], sorted(r["schedules"])) for r in table["rows"]] == [
        ("tiny", ["interleaved", "wave"]), ("small", ["interleaved", "wave"])]
    assert table["rows"][0]["t_rs_median_int_over_wave"] == pytest.approx(0.5, rel=1e-3)
    assert table["rows"][1]["t_rs_median_int_over_wave"] == pytest.approx(2.0)
    corr = table["spearman_pred_vs_meas"]
    assert corr["mean"]["all"]["n"] == 4 and corr["median"]["wave"]["n"] == 2
    md = ma.stall_markdown(table, "t")
    assert "| tiny | bf16 | 64 | skewed | 2 |" in md and "ρ" in md and "t_entry" in md
    assert table["rows"][0]["precision"] == table["rows"][0]["dtype"] == "bf16"  # from the column (an old dump)
    assert set(corr["mean"]) == {"all", "wave", "interleaved"}  # one precision: no per-precision ρ


def test_precisions_and_rank_modes_are_kept_apart(tmp_path):
    """A matrix dump names its precision (w8a8's column is ours_w8a8_*) and rank mode: the same shape, tokens,
    routing and world at two precisions, or emulated and real, are rows of their own; per-precision ρ."""
    arrays, entries = {}, []
    cases = (("bf16", "emulated", 1.0), ("w8a8", "emulated", 0.5), ("bf16", "real", 3.0))
    for row, (precision, ranks, scale) in enumerate(cases):
        for schedule in ("wave", "interleaved"):
            prefix = f"r{row}.ours_{precision}_{schedule}"
            arrays.update({f"{prefix}.{k}": v for k, v in synthetic(schedule, scale=scale).items()})
            entries.append({"row": row, "column": f"ours_{precision}_{schedule}", "key_prefix": prefix,
                            "shape": "tiny", "world": 2, "ranks": ranks, "tokens_per_rank": 64, "routing": "skewed",
                            "zipf_exponent": 1.2, "seed": 1, "precision": precision, "schedule": schedule,
                            "key": f"tiny/{precision}/skewed@1.2/T64/{'EP' if ranks == 'real' else 'P'}2"})
    np.savez_compressed(tmp_path / "m.npz", **arrays)
    (tmp_path / "m.json").write_text(json.dumps({"npz": "m.npz", "entries": entries}))
    loaded = ma.load_dump(str(tmp_path / "m.json"))
    assert [(e["precision"], e["ranks"], e["key"].split("/")[-1]) for e in loaded][::2] == [
        ("bf16", "emulated", "P2"), ("w8a8", "emulated", "P2"), ("bf16", "real", "EP2")]
    table = ma.stall_table(loaded, CLOCK)
    assert [(r["precision"], r["ranks"], sorted(r["schedules"])) for r in table["rows"]] == [
        (p, m, ["interleaved", "wave"]) for p, m, _ in cases]
    t_rs = [r["schedules"]["wave"]["t_rs_us"]["median"] for r in table["rows"]]
    assert t_rs == pytest.approx([2.0, 1.0, 6.0], rel=1e-3)  # each row its own entry's spans
    assert table["spearman_pred_vs_meas"]["median"]["w8a8"]["n"] == 2
    assert table["spearman_pred_vs_meas"]["median"]["bf16"]["n"] == 4
    md = ma.stall_markdown(table)
    assert "| tiny | w8a8 | 64 | skewed | 2 |" in md and "| tiny | bf16 | 64 | skewed | 2 (real) |" in md
    out = tmp_path / "out"
    assert ma.main([str(tmp_path / "m.json"), "--out-dir", str(out), "--all-timelines"]) == 0
    names = sorted(n for n in os.listdir(out) if n.startswith("m_timeline_"))
    assert len(names) == 6 and "m_timeline_tiny_w8a8_64_skewed_P2_wave.png" in names
    assert "m_timeline_tiny_bf16_64_skewed_EP2_interleaved.png" in names
    # by default per shape one precision (bf16), its largest world: both of its rank modes' P2 here
    assert ma.timeline_entries(loaded) == [e for e in loaded if e["precision"] == "bf16"]


def test_plots_and_cli(tmp_path):
    path = write_dump(tmp_path, name="x_header")
    entries = ma.load_dump(str(path))
    ma.plot_spans(entries, str(tmp_path / "s.png"), CLOCK)
    ma.plot_timeline(entries[0], str(tmp_path / "t.png"), window_us=5.0)
    ma.plot_timeline(entries[1], str(tmp_path / "t2.png"), max_sms=1, window_us=None)
    for f in ("s.png", "t.png", "t2.png"):
        assert (tmp_path / f).read_bytes()[:8] == PNG_MAGIC
    out = tmp_path / "out"
    assert ma.main([str(path), "--out-dir", str(out), "--clock-ghz", "2"]) == 0
    names = sorted(os.listdir(out))
    assert "x_stall.json" in names and "x_stall.md" in names and "x_spans.png" in names
    assert [n for n in names if n.startswith("x_timeline_")] == [  # per shape its skewed (else first) routing
        "x_timeline_small_bf16_64_balanced_P2_interleaved.png", "x_timeline_small_bf16_64_balanced_P2_wave.png",
        "x_timeline_tiny_bf16_64_skewed_P2_interleaved.png", "x_timeline_tiny_bf16_64_skewed_P2_wave.png"]
    saved = json.loads((out / "x_stall.json").read_text())
    assert saved["clock_ghz"] == 2 and saved["provenance"] == {"git_commit": "test"} and len(saved["rows"]) == 2


def test_staged_dump_measures_the_successors_staging_wait(tmp_path):
    """A dump of the staged epilogue (t_staging_wait present) takes each L2 tile's successor's staging wait as
    the measured stall; an older dump (no such array) its entry wait, and says which."""
    path = write_dump(tmp_path, name="staged")
    with np.load(tmp_path / "staged.npz") as z:
        arrays = {k: z[k] for k in z.files}
    rng = np.random.default_rng(5)
    waits = {}
    for key in [k for k in arrays if k.endswith(".t_rs")]:
        prefix = key[: -len(".t_rs")]
        waits[prefix] = rng.integers(0, 3000, size=arrays[key].size).astype(np.int64)
        arrays[f"{prefix}.t_staging_wait"] = waits[prefix]
    np.savez(tmp_path / "staged.npz", **arrays)
    staged = ma.load_dump(str(path))
    assert all(e["staged"] for e in staged)
    e = staged[0]
    t = ma.tile_table(e["arrays"], CLOCK)
    o = ma.stream_order(e["arrays"])
    np.testing.assert_allclose(t["staging_succ"], waits[e["key_prefix"]][o][t["succ_j"]] * 1e-3)
    summary = ma.entry_summary(e, CLOCK)
    assert summary["successor"]["meas_wait_is"] == "staging wait"
    assert summary["successor"]["meas_wait_us"]["mean"] == pytest.approx(float(t["staging_succ"].mean()))
    assert summary["clock_ghz_lower_bound"] is None  # T_RS no longer sits inside the MMA side's epilogue
    old = ma.entry_summary(ma.load_dump(str(write_dump(tmp_path, name="old")))[0], CLOCK)
    assert old["successor"]["meas_wait_is"] == "entry wait" and not old["staged"]


def test_load_waits_split_full_from_last_blocks(tmp_path):
    """A dump with load_wait_cycles reports the mainloops' waits on their loads per kind, in tiles below their
    expert's last M block and in last blocks; a dump without it says None."""
    a = synthetic()
    a["load_wait_cycles"] = np.where(ma.full_tile_mask(a), 1000, 3000 * a["kind"]).astype(np.int64)  # 0.5 / 1.5, 3 us
    entry = {"shape": "tiny", "tokens_per_rank": 64, "routing": "skewed", "world": 2, "dtype": "bf16",
             "schedule": "wave", "column": "ours_bf16_wave", "arrays": a}
    s = ma.entry_summary(entry, CLOCK)["load_wait_us"]
    assert s["L1 full"]["median"] == pytest.approx(0.5) and s["L1 last"]["median"] == pytest.approx(1.5)
    assert s["L2 last"]["median"] == pytest.approx(3.0) and s["L2 full"]["median"] == pytest.approx(0.5)
    path = write_dump(tmp_path, name="lw")
    with np.load(tmp_path / "lw.npz") as z:
        arrays = {k: z[k] for k in z.files}
    for key in [k for k in arrays if k.endswith(".t_rs")]:
        arrays[key[: -len(".t_rs")] + ".load_wait_cycles"] = np.full_like(arrays[key], 2000)
    np.savez(tmp_path / "lw.npz", **arrays)
    loaded = ma.entry_summary(ma.load_dump(str(path))[0], CLOCK)["load_wait_us"]
    assert loaded["L1 last"]["median"] == pytest.approx(1.0)
    assert ma.entry_summary(ma.load_dump(str(write_dump(tmp_path, name="nolw")))[0], CLOCK)["load_wait_us"] is None


def test_mainloop_cycles_give_each_tiles_clock_and_convert_its_load_waits():
    """With mainloop_cycles the SM clock is measured per tile (cycles over t_mma_end - t_entry) and the load waits
    are converted at it, not at the assumed clock; a tile at 1.5 GHz and one at 1.0 GHz keep their own."""
    a = synthetic()
    span = a["t_mma_end"] - a["t_entry"]
    slow = a["kind"] == 2  # L2 tiles at 1.0 GHz, L1 tiles at 1.5 GHz
    a["mainloop_cycles"] = np.where(slow, span, (span * 3) // 2).astype(np.int64)
    a["load_wait_cycles"] = np.full_like(a["t_rs"], 3000)
    entry = {"shape": "tiny", "tokens_per_rank": 64, "routing": "skewed", "world": 2, "dtype": "bf16",
             "schedule": "wave", "column": "ours_bf16_wave", "arrays": a}
    s = ma.entry_summary(entry, CLOCK)
    assert s["sm_clock_ghz"]["L1 full"]["median"] == pytest.approx(1.5, rel=1e-3)
    assert s["sm_clock_ghz"]["L2 last"]["median"] == pytest.approx(1.0, rel=1e-3)
    assert s["load_wait_us"]["L1 full"]["median"] == pytest.approx(2.0, rel=1e-3)  # 3000 cycles at 1.5 GHz
    assert s["load_wait_us"]["L2 last"]["median"] == pytest.approx(3.0, rel=1e-3)
    md = ma.stall_markdown(ma.stall_table([entry], CLOCK))
    assert "## Mainloops: time, wait on loads, SM clock" in md and "4.00, 2.00, 1.50 / -" in md.split("SM clock")[1]
    del a["mainloop_cycles"]
    assert ma.entry_summary(entry, CLOCK)["sm_clock_ghz"] is None
    assert "## Mainloops" not in ma.stall_markdown(ma.stall_table([entry], CLOCK))


def test_phase_spans_from_the_stamps(tmp_path):
    """A dump with per-CTA phase stamps: each phase's median and max over CTAs, and the kernel's span; a dump
    without them reports None."""
    stamps = np.array([[0, 10_000, 30_000, 90_000, 92_000, 95_000, 99_000, 0],
                       [0, 12_000, 30_500, 80_000, 93_000, 95_500, 101_000, 0]], dtype=np.int64) + 10**15
    stamps[:, 7] = 0  # a dump from before the dispatch_end stamp: its slot unwritten
    spans = ma.phase_spans(stamps)
    assert spans["count_b1"] == {"median_us": pytest.approx(11.0), "max_us": pytest.approx(12.0)}
    assert spans["tiles"]["max_us"] == pytest.approx(60.0) and spans["stores_drain"]["max_us"] == pytest.approx(13.0)
    assert spans["kernel_us"] == pytest.approx(101.0)
    assert "dispatch" not in spans and "b2_wait" not in spans  # no dispatch_end stamps (zeros): no such spans
    stamped = stamps.copy()
    stamped[:, 7] = stamped[:, 1] + np.array([15_000, 18_000])
    spans = ma.phase_spans(stamped)
    assert spans["dispatch"] == {"median_us": pytest.approx(16.5), "max_us": pytest.approx(18.0)}
    assert spans["b2_wait"]["max_us"] == pytest.approx(5.0) and spans["dispatch_b2"]["max_us"] == pytest.approx(20.0)
    assert ma.phase_spans(None) is None
    path = write_dump(tmp_path, name="ph")
    with np.load(tmp_path / "ph.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays["r0.ours_bf16_wave.phase_stamps"] = stamps
    np.savez(tmp_path / "ph.npz", **arrays)
    entries = ma.load_dump(str(path))
    summary = ma.entry_summary(entries[0], CLOCK)
    assert summary["phases_us"]["dispatch_b2"]["median_us"] == pytest.approx(19.25)
    assert ma.entry_summary(entries[1], CLOCK)["phases_us"] is None
    md = ma.stall_markdown(ma.stall_table(entries, CLOCK))
    assert "## Phases" in md and "| tiny | bf16 | 64 | skewed | 2 | 11.0 / - |" in md


def test_phase_names_follow_the_kernels_stamps():
    """The analysis names the dumped per-CTA stamps without importing the kernel; its names are the kernel's."""
    from megamoe.epilogue import PHASES

    assert ma.PHASE_NAMES == PHASES


def test_weight_block_mates_start_spread():
    """Tiles of one weight block (rank, kind, expert, N block) are grouped and their start spread reported; a
    block read by one tile has none. The synthetic streams give two such blocks on rank 0 (CTAs 0 and 1 at slots
    0 and 1: L1 and L2 of expert 0), each started 1.0 us apart (CTA 1 starts 1000 ns later)."""
    a = synthetic()
    spread = ma.weight_block_start_spread(a)
    assert sorted(spread.tolist()) == pytest.approx([1.0, 1.0])
    a["t_entry"] = np.where((a["rank"] == 0) & (a["cta"] == 1) & (a["n"] == 0), a["t_entry"] + 4000, a["t_entry"])
    assert sorted(ma.weight_block_start_spread(a).tolist()) == pytest.approx([1.0, 5.0])
    entry = {"shape": "tiny", "tokens_per_rank": 64, "routing": "skewed", "world": 2, "dtype": "bf16",
             "schedule": "wave", "column": "ours_bf16_wave", "arrays": a}
    s = ma.entry_summary(entry, CLOCK)["weight_block_start_spread_us"]
    assert s["n"] == 2 and s["median"] == pytest.approx(3.0)
    md = ma.stall_markdown(ma.stall_table([entry], CLOCK))
    assert "## Weight-block mates" in md and "| 2 / - | 3.00 / - |" in md.split("Weight-block mates")[1]
    del a["rank"]  # a world-1 dump without ranks: one rank
    assert ma.weight_block_start_spread(a).size == 2
