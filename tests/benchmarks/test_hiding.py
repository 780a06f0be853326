"""CPU checks of the hiding ratio's pair statistics (benchmarks/hiding.py): H from the pairs' differences as the
bench takes it, its bootstrap interval, pooling over runs, and the table's H cell. Seeded random data."""
from __future__ import annotations

import random

import pytest

from benchmarks import hiding, timing
from benchmarks.report import table_row


def _rng(seed: int) -> random.Random:
    print(f"seed={seed}")
    return random.Random(seed)


def _pairs(rng, n, mean, sd):
    return [rng.gauss(mean, sd) for _ in range(n)]


def _row(rng, n, e_res, excess, sd, split="launch", heads=12, seq=65536):
    f, s = _pairs(rng, n, e_res, sd), _pairs(rng, n, excess, sd)
    return {"heads_per_rank": heads, "seq_len": seq, "fused_tail_split": split, "fused_store": "st",
            "fused_relay": False, "hiding_ratio": hiding.hiding_ratio(f, s),
            "alternated": {hiding.FUSED: {"diffs_us": [[round(x, 1), i % 2] for i, x in enumerate(f)]},
                           hiding.SERIAL: {"diffs_us": [[round(x, 1), i % 2] for i, x in enumerate(s)]}}}


def test_hiding_ratio_is_one_minus_the_ratio_of_the_pairs_medians_as_the_bench_takes_them():
    rng = _rng(201)
    f, s = _pairs(rng, 20, 40.0, 5.0), _pairs(rng, 20, 500.0, 5.0)  # an even count: the upper median
    assert hiding.hiding_ratio(f, s) == pytest.approx(1 - sorted(f)[10] / sorted(s)[10])
    assert hiding.hiding_ratio(f, [-1.0, -2.0, 3.0]) is None  # no positive serial excess: no H
    # the bench's pair statistics (its H) and its stored differences give the same medians
    base = [rng.uniform(2e4, 4e4) for _ in f]
    st = timing.pair_stats(base, [b + d for b, d in zip(base, f)], [i % 2 == 0 for i in range(len(f))])
    stored = [d for d, _ in st["diffs_us"]]
    assert hiding.upper_median(stored) == pytest.approx(st["median_us"], abs=1e-3)


def test_interval_covers_the_true_ratio_and_narrows_with_more_pairs():
    rng = _rng(202)
    e_res, excess, sd = rng.uniform(20, 80), rng.uniform(400, 800), 150.0
    true_h = 1 - e_res / excess
    lo20, hi20 = hiding.hiding_interval(_pairs(rng, 20, e_res, sd), _pairs(rng, 20, excess, sd),
                                        seed=rng.randrange(1 << 30))
    lo2k, hi2k = hiding.hiding_interval(_pairs(rng, 2000, e_res, sd), _pairs(rng, 2000, excess, sd), n_boot=200)
    assert lo20 <= hi20
    # 2000 pairs: H's standard error is below 0.007, the interval about ±0.014; 0.05 more is beyond seven errors
    assert lo2k - 0.05 <= true_h <= hi2k + 0.05 and hi2k - lo2k < 0.08
    assert hi2k - lo2k < 0.5 * (hi20 - lo20)  # the widths go as 1/sqrt(pairs): ~0.1 expected


def test_interval_reaches_minus_infinity_when_the_serial_excess_may_vanish():
    rng = _rng(203)
    serial = [10.0 * k for k in range(-10, 0)] + [10.0 * k for k in range(1, 11)]  # median +10: H defined
    rng.shuffle(serial)
    fused = _pairs(rng, 20, 2.0, 1.0)
    assert hiding.hiding_ratio(fused, serial) is not None
    lo, hi = hiding.hiding_interval(fused, serial)  # about half the resamples have no positive excess
    assert lo == float("-inf") and hi > 0.5
    with pytest.raises(ValueError):
        hiding.hiding_interval([], [1.0])


def test_pool_merges_runs_of_the_same_kernels_only():
    rng = _rng(204)
    a = {"provenance": {"git_commit": "aaa"}, "rows": [_row(rng, 20, 50, 500, 100), _row(rng, 20, 5, 50, 3, seq=8192)]}
    b = {"provenance": {"git_commit": "bbb"}, "rows": [_row(rng, 128, 50, 500, 100),
                                                       _row(rng, 20, 50, 500, 100, split="False")]}
    b["rows"].append({"heads_per_rank": 12, "seq_len": 65536, "hiding_ratio": 0.9})  # no pairs kept: left out
    pooled = {(e["seq_len"], e["tail_split"]): e for e in hiding.pool([a, b])}
    assert set(pooled) == {(65536, "launch"), (8192, "launch"), (65536, "False")}
    both = pooled[(65536, "launch")]
    assert both["runs"] == ["aaa", "bbb"] and both["pairs"] == [148, 148] and len(both["per_run"]) == 2
    lo, hi = both["interval"]
    assert lo <= both["hiding_ratio"] <= hi
    assert "aaa, bbb" in hiding.pool_text([a, b])


def test_table_cell_shows_the_interval_where_the_pairs_were_kept():
    rng = _rng(205)
    row = _row(rng, 20, 50, 500, 100)
    row.update({"fa_ours_us": 40000.0, "fused_us": 40050.0})
    cell = table_row(row).split(" | ")[13]
    lo, hi = hiding.row_interval(row)
    assert cell == f"{row['hiding_ratio']:.3f} [{lo:.2f}–{hi:.2f}]"
    del row["alternated"]
    assert table_row(row).split(" | ")[13] == f"{row['hiding_ratio']:.3f}"


def test_table_cell_writes_an_unbounded_low_end():
    rng = _rng(206)
    row = _row(rng, 20, 50, 500, 100)
    row.update({"fa_ours_us": 40000.0, "fused_us": 40050.0, "hiding_ratio_ci95": [None, 0.97]})
    assert table_row(row).split(" | ")[13] == f"{row['hiding_ratio']:.3f} [−inf–0.97]"
