"""schedule="auto" (megamoe.auto) and its regret tool (benchmarks.megamoe_auto), on the CPU."""
from __future__ import annotations

import json

import pytest


def test_auto_picks_interleaved_where_the_replay_gains_and_wave_where_it_loses():
    """DiT-MoE at 1024 tokens on 132 CTAs: the waves' ragged ends make interleaving faster in the replay (and on
    the H200: 220 against 249 us at 147e2d5); at P = 2 and 8192 tokens the replay has it slower (as measured:
    2279 against 2216 us)."""
    from megamoe import auto

    small = auto.predicted_makespans(1152, 4608, 8, 2, 1, 1024, 132)
    assert small["interleaved"] < 0.9 * small["wave"]
    assert auto.choose_schedule(1152, 4608, 8, 2, 1, 1024, 132) == "interleaved"
    assert auto.choose_schedule(1152, 4608, 8, 2, 2, 8192, 66) == "wave"
    assert auto.token_bucket(1) == 256 and auto.token_bucket(257) == 512 and auto.token_bucket(4096) == 4096


def test_margin_demands_a_gain_and_ties_take_the_measured_default():
    """Within the margin neither replay decides: the tie-break takes wave for bf16 and interleaved for W8A8 and
    W4A8 (megamoe.auto.tie_break's measurements)."""
    from megamoe import auto

    m = auto.predicted_makespans(1152, 4608, 8, 2, 1, 1024, 132)
    gain = 1 - m["interleaved"] / m["wave"]
    wide = gain + 0.01
    assert auto.choose_schedule(1152, 4608, 8, 2, 1, 1024, 132, margin=wide) == "wave"  # a tie, bf16, world 1
    assert auto.choose_schedule(1152, 4608, 8, 2, 1, 1024, 132, "w4a8", margin=wide) == "interleaved"
    m2 = auto.predicted_makespans(1152, 4608, 8, 2, 2, 1024, 66)
    wide2 = abs(1 - m2["interleaved"] / m2["wave"]) + 0.01
    assert auto.choose_schedule(1152, 4608, 8, 2, 2, 1024, 66, margin=wide2) == "wave"  # a tie, bf16, P = 2
    assert auto.choose_schedule(1152, 4608, 8, 2, 2, 1024, 66, "w8a8", margin=1.0) == "interleaved"
    assert auto.tie_break("bf16", 1) == "wave" and auto.tie_break("w8a8", 4) == "interleaved"
    assert auto.tie_break("w4a8", 1) == "interleaved"


def test_regret_tool_on_a_synthetic_result(tmp_path, capsys):
    from benchmarks import megamoe_auto

    def row(world, tokens, wave, inter):
        return {"shape": "dit-moe", "world": world, "tokens_per_rank": tokens, "routing": "balanced",
                "columns": {"ours_bf16_wave": {"us": wave}, "ours_bf16_interleaved": {"us": inter},
                            "unfused_bf16": {"us": 2 * wave}}}

    bench = {"provenance": {"git_commit": "abc"}, "rows": [row(1, 1024, 250.0, 220.0), row(2, 8192, 2200.0, 2300.0),
                                                          {"shape": "dit-moe", "columns": {}}]}
    path = tmp_path / "b.json"
    path.write_text(json.dumps(bench))
    out = tmp_path / "r.json"
    assert megamoe_auto.main([str(path), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["summary"]["rows"] == 2 and result["summary"]["max_regret"] == pytest.approx(0.0)
    assert result["summary"]["always_wave_max_regret"] == pytest.approx(250 / 220 - 1)
    assert [r["pick"] for r in result["rows"]] == ["interleaved", "wave"]
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="no row"):
        megamoe_auto.main([str(path)])
    # a --matrix result: every measured configuration of the precision asked for (default: all of them)
    cfg = {"status": "measured", "model": "dit-moe", "hidden": 1152, "intermediate": 4608, "num_experts": 8,
           "top_k": 2, "precision": "w4a8", "routing": "skewed", "zipf_exponent": 1.2, "tokens_per_rank": 4096,
           "world": 2, "ranks": "emulated", "wave": {"us": 100.0}, "interleaved": {"us": 103.0}}
    path.write_text(json.dumps({"kind": "megamoe_matrix", "configurations": [cfg, {**cfg, "status": "skipped"}]}))
    assert megamoe_auto.main([str(path), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["precision"] == "w4a8" and rows[0]["routing"] == "skewed@1.2"
    assert rows[0]["grid"] == 66 and rows[0]["regret"] == pytest.approx(0.0 if rows[0]["pick"] == "wave" else 0.03)
    with pytest.raises(SystemExit, match="no row"):
        megamoe_auto.main([str(path), "--dtype", "bf16"])
