"""schedule="auto" (megamoe.auto) and its regret tool (benchmarks.megamoe_auto), on the CPU."""
from __future__ import annotations

import json

import pytest


def test_auto_picks_interleaved_where_the_replay_gains_and_wave_where_it_loses():
    """DiT-MoE at 1024 tokens on 132 CTAs: the waves' ragged ends make interleaving faster in the replay (and on
    the H200: 220 against 249 us at 147e2d5); DSv4-Pro in bf16 at emulated P = 2: the replay sees a tie and the
    locality cost (two ranks' 132 MB experts in one 50 MB L2) decides wave (measured 0.83-0.95 wave / int on
    megamoe_matrix_bf16_w8a8_87d2fbe.json)."""
    from megamoe import auto

    small = auto.predicted_makespans(1152, 4608, 8, 2, 1, 1024, 132)
    assert small["interleaved"] < 0.9 * small["wave"]
    assert auto.predicted_gain(1152, 4608, 8, 2, 1, 1024, 132) > 0.05
    assert auto.choose_schedule(1152, 4608, 8, 2, 1, 1024, 132) == "interleaved"
    assert auto.choose_schedule(7168, 3072, 384, 6, 2, 4096, 66, "bf16", ranks_per_gpu=2) == "wave"
    assert auto.token_bucket(1) == 256 and auto.token_bucket(257) == 512 and auto.token_bucket(4096) == 4096
    with pytest.raises(ValueError, match="precision"):
        auto.predicted_gain(1152, 4608, 8, 2, 1, 1024, 132, "fp16")


def test_locality_cost_scales_with_weight_bytes_and_ranks_sharing_the_l2():
    from megamoe import auto

    bf16 = auto.locality_cost(4096, 2048, "bf16")
    assert bf16 == pytest.approx(3 * 4096 * 2048 * 2 / auto.L2_BYTES)
    assert auto.locality_cost(4096, 2048, "w8a8") == pytest.approx(bf16 / 2)
    assert auto.locality_cost(4096, 2048, "w4a8") == pytest.approx(bf16 / 4)
    assert auto.locality_cost(4096, 2048, "bf16", ranks_per_gpu=2) == pytest.approx(2 * bf16)
    assert auto.locality_cost(4096, 2048, "bf16", l2_bytes=2 * auto.L2_BYTES) == pytest.approx(bf16 / 2)
    # the cost enters the gain with the fit's weight: the same replay, one more rank on the L2
    one = auto.predicted_gain(4096, 2048, 256, 6, 2, 4096, 66, "w8a8", ranks_per_gpu=1)
    two = auto.predicted_gain(4096, 2048, 256, 6, 2, 4096, 66, "w8a8", ranks_per_gpu=2)
    assert one - two == pytest.approx(auto.FITS["w8a8"].locality * auto.locality_cost(4096, 2048, "w8a8"))
    assert auto.FITS["w4a8"] == auto.FITS["w8a8"]


def test_the_routing_histogram_enters_the_replay():
    """A skewed histogram (one hot expert) replays differently from the expected one; a decision over several
    ranks takes each order's slowest rank; a histogram of the wrong length is refused."""
    from megamoe import auto

    expected = auto.expected_rows(8, 2, 1, 4096)
    assert expected == (1024,) * 8
    hot = (4096, 1024, 512, 512, 512, 512, 512, 512)
    m_exp = auto.predicted_makespans(1152, 4608, 8, 2, 1, 4096, 132)
    m_hot = auto.predicted_makespans(1152, 4608, 8, 2, 1, 4096, 132, "bf16", hot)
    assert m_hot != m_exp and m_hot["wave"] > m_exp["wave"]
    g_hot = auto.predicted_gain(1152, 4608, 8, 2, 1, 4096, 132, "bf16", (hot,))
    assert auto.predicted_gain(1152, 4608, 8, 2, 1, 4096, 132, "bf16", (hot, hot)) == pytest.approx(g_hot)
    assert g_hot != pytest.approx(auto.predicted_gain(1152, 4608, 8, 2, 1, 4096, 132))
    with pytest.raises(ValueError, match="8 experts"):
        auto.predicted_makespans(1152, 4608, 8, 2, 1, 4096, 132, "bf16", (1, 2, 3))
    assert auto.skew_class(expected) == 0 and auto.skew_class(hot) == 4 and auto.skew_class((0, 0)) == 0
    assert auto.scaled_rows((10, 30), 1000, 2000) == (20, 60)


def test_routing_history_sums_the_two_parity_halves():
    """megamoe.api.RoutingHistory on CPU tensors (no event): the kernel's counts are double-buffered by the
    epoch's parity, the other half zeroed; the history reads their sum, the launch's tokens beside it."""
    import torch

    from megamoe.api import RoutingHistory

    counts = torch.tensor([3, 0, 5, 0, 0, 0], dtype=torch.int32)
    hist = RoutingHistory(counts)
    assert hist.latest() == (None, None)
    hist.record(300)
    assert hist.latest() == ((3, 0, 5), 300)
    counts.copy_(torch.tensor([0, 0, 0, 7, 1, 2], dtype=torch.int32))  # the next launch, the other parity
    assert hist.latest() == ((3, 0, 5), 300)  # nothing recorded since
    hist.record(200)
    assert hist.latest() == ((7, 1, 2), 200)


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
    assert rows[0]["histogram"] == "expected"  # no seed in the configuration
    # with a seed the routing is redrawn as the bench drew it: each rank's histogram
    hists = megamoe_auto.rank_histograms(8, 2, 2, 512, "skewed", 7, 1.2)
    assert len(hists) == 2 and all(len(h) == 4 for h in hists) and sum(map(sum, hists)) == 2 * 512 * 2
    path.write_text(json.dumps({"kind": "megamoe_matrix", "configurations": [{**cfg, "seed": 7}]}))
    assert megamoe_auto.main([str(path), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["histogram"] == "redrawn"
    with pytest.raises(SystemExit, match="no row"):
        megamoe_auto.main([str(path), "--dtype", "bf16"])


def test_trial_launch_order_warms_up_then_alternates_then_keeps_the_decision():
    """megamoe.auto.trial_launch_order (the kernel's megamoe.trial.trial_order, mirrored): the prior through
    TRIAL_WARMUP launches, then prior and other alternating, MEASURED_CALLS each; a decided slot its order."""
    from megamoe.auto import MEASURED_CALLS, TRIAL_SETTLE, TRIAL_WARMUP, trial_launch_order

    assert TRIAL_SETTLE == TRIAL_WARMUP + 2 * MEASURED_CALLS
    for prior in (0, 1):
        seq = [trial_launch_order(n, prior) for n in range(TRIAL_SETTLE)]
        assert seq[:TRIAL_WARMUP] == [prior] * TRIAL_WARMUP
        assert seq[TRIAL_WARMUP:] == [prior, 1 - prior] * MEASURED_CALLS
        assert {trial_launch_order(n, prior, decided) for n in range(40) for decided in (1,)} == {0}
        assert trial_launch_order(TRIAL_WARMUP + 1, prior, 2) == 1


def test_read_trial_decodes_a_slot_part_way_and_settled():
    from megamoe.auto import MEASURED_CALLS, TRIAL_DECIDED, TRIAL_LAUNCHES, TRIAL_TIMES, TRIAL_WARMUP, TRIAL_WORDS
    from megamoe.auto import read_trial

    words = [0] * TRIAL_WORDS
    words[TRIAL_LAUNCHES] = TRIAL_WARMUP + 3  # prior (interleaved: 1) twice, wave once
    words[TRIAL_TIMES + MEASURED_CALLS:TRIAL_TIMES + MEASURED_CALLS + 2] = [5000, 5100]
    words[TRIAL_TIMES] = 4900
    got = read_trial(words, 1)
    assert got == {"launches": TRIAL_WARMUP + 3, "prior": "interleaved", "decided": None,
                   "times_us": {"wave": [4.9], "interleaved": [5.0, 5.1]}}
    words[TRIAL_LAUNCHES] = TRIAL_WARMUP + 2 * MEASURED_CALLS
    words[TRIAL_DECIDED] = 1  # wave
    got = read_trial(words, 1)
    assert got["decided"] == "wave" and all(len(t) == MEASURED_CALLS for t in got["times_us"].values())
    assert read_trial([0] * TRIAL_WORDS, 0)["times_us"] == {"wave": [], "interleaved": []}


def test_measured_pick_floor_judges_early_trials_on_the_rest():
    from benchmarks.megamoe_auto import measured_pick_floor
    from megamoe.auto import MEASURED_CALLS as FLOOR_TRIALS

    def conf(precision, wave, inter):
        return {"status": "measured", "precision": precision, "trial_times_us": {"wave": wave, "interleaved": inter}}

    early_wave = [100.0] * FLOOR_TRIALS  # wave looks faster in the first trials, interleaved is faster later
    bench = {"configurations": [
        conf("bf16", early_wave + [110.0] * 6, [105.0] * FLOOR_TRIALS + [100.0] * 6),
        conf("bf16", [100.0] * (FLOOR_TRIALS + 6), [120.0] * (FLOOR_TRIALS + 6)),
        conf("w8a8", [100.0] * (FLOOR_TRIALS + 6), [90.0] * (FLOOR_TRIALS + 6)),
        conf("bf16", [100.0] * (FLOOR_TRIALS + 2), [90.0] * (FLOOR_TRIALS + 2))]}  # too few to judge: left out
    floor = measured_pick_floor(bench, "bf16")
    assert floor["configurations"] == 2 and floor["max_regret"] == pytest.approx(0.10)
    assert floor["over_3pct"] == 1 and floor["first_trials"] == FLOOR_TRIALS
    assert measured_pick_floor(bench, "fp8")["max_regret"] == pytest.approx(0.0)
    assert measured_pick_floor({"configurations": []}) is None


def test_faster_measured_takes_the_upper_median_and_ties_to_the_prior():
    from megamoe.auto import faster_measured

    times = {"wave": [1.0, 5.0, 2.0, 9.0], "interleaved": [3.0, 3.0, 3.0, 0.5]}  # upper medians 5 and 3
    assert faster_measured(times) == "interleaved" and faster_measured(times, "wave") == "interleaved"
    tie = {"wave": [2.0, 2.0], "interleaved": [2.0, 2.0]}
    assert faster_measured(tie, "interleaved") == "interleaved" and faster_measured(tie, "wave") == "wave"
