"""benchmarks/megamoe_padding.py: a bench result's padding rows and the Tensor Cores' rate, from a recorded
``mma_rows`` or from the row's seed (CPU). Random routings use the printed ``seed`` fixture."""

import json
from types import SimpleNamespace

import pytest

from benchmarks import megamoe_padding as padding
from benchmarks.moe_baselines import moe_flops
from megamoe.reference import expert_counts, make_routing

CEILINGS = {"bf16_tflops": 800.0, "fp8_tflops": 1450.0, "hbm_tb_s": 4.3}


def bench_row(seed, tokens=300, experts=8, top_k=2, recorded=None):
    idx, _ = make_routing(tokens, experts, top_k, "balanced", seed)
    rows = int(expert_counts(idx, experts).sum())
    row = {"shape": "tiny", "hidden": 256, "intermediate": 128, "num_experts": experts, "top_k": top_k,
           "world": 1, "tokens_per_rank": tokens, "tokens": tokens, "routing": "balanced", "seed": seed,
           "rows": rows, "columns": {
               "unfused_bf16": {"us": 50.0, "tflops": 1.0, "roofline_efficiency": 0.5},
               "ours_fp8_wave": {"us": 20.0, "dtype": "fp8", "tflops": 2.0, "roofline_efficiency": 0.4},
               "ours_bf16_interleaved": {"skipped": "not built"}}}
    if recorded is not None:
        row["mma_rows"] = recorded
    return row, idx


def by_halves(idx, experts):
    """The kernel's rule, counted directly: per expert, its rows rounded up to whole 64-row halves."""
    return sum(64 * -(-int(n) // 64) for n in expert_counts(idx, experts))


def test_rows_from_the_seed_match_the_kernels_halves(seed):
    row, idx = bench_row(seed)
    (e,) = padding.padding_rows({"ceilings": CEILINGS, "rows": [row]})
    assert e["column"] == "ours_fp8_wave" and e["mma_rows_source"] == "from the seed"
    assert e["mma_rows"] == by_halves(idx, 8) > e["rows"]
    assert e["padding"] == pytest.approx(1 - e["rows"] / e["mma_rows"])
    flops = moe_flops(SimpleNamespace(hidden=256, intermediate=128), e["mma_rows"])
    assert e["mma_tflops"] == pytest.approx(flops / 20.0 / 1e6)
    assert e["mma_efficiency"] == pytest.approx(flops / 1450e12 / 20e-6)


def test_recorded_rows_win_and_impossible_ones_fail(seed, tmp_path, capsys):
    row, idx = bench_row(seed, recorded=999_999)
    (e,) = padding.padding_rows({"ceilings": CEILINGS, "rows": [row]})
    assert e["mma_rows"] == 999_999 and e["mma_rows_source"] == "recorded"
    row["mma_rows"] = row["rows"] - 1
    with pytest.raises(ValueError, match="not this kernel's tiling"):
        padding.padding_rows({"ceilings": CEILINGS, "rows": [row]})
    row["mma_rows"] = by_halves(idx, 8)
    path, md = tmp_path / "r.json", tmp_path / "r.md"
    path.write_text(json.dumps({"ceilings": CEILINGS, "rows": [row], "provenance": {"device": "X", "git_commit": "c"}}))
    assert padding.main([str(path), "--md", str(md)]) == 0
    assert "| tiny | 1 | 300 | balanced |" in md.read_text() and "fp8_wave" in capsys.readouterr().out
    del row["columns"]["ours_fp8_wave"]
    path.write_text(json.dumps({"ceilings": CEILINGS, "rows": [row]}))
    with pytest.raises(ValueError, match="no timed column of ours"):
        padding.main([str(path)])
