"""The burst microbenchmark on two GPUs: every byte delivered to the peer, records monotone and complete,
for periodic and isolated bursts, remote and local, both directions (needs 2 sm_90a GPUs with peer access)."""
from __future__ import annotations

import json

import pytest
from ranks import run_ranks

from calibrate.sweep import Point

POINTS = [
    Point("rate", "remote", 132, 32768, bursts=8),
    Point("gap", "remote", 66, 16384, "fma", 512, bursts=6),
    Point("gap", "remote", 33, 8192, "spin", 2000, bursts=4),
    Point("gap", "local", 132, 32768, "fma", 64, bursts=4),
    Point("isolated", "remote", 132, 65536, bursts=3),
    Point("isolated", "local", 16, 2048, bursts=2),
]


A2A_POINTS = [
    Point("rate", "all_peers", 132, 32768, bursts=8),
    Point("gap", "all_peers", 66, 16384, "fma", 256, bursts=4),
    Point("isolated", "all_peers", 132, 16384, bursts=3),
]


def _with_producers(p: Point, sm_count: int) -> Point:
    return Point(p.mode, p.target, min(p.producers, sm_count), p.bytes_per_producer, p.gap_kind, p.gap, p.bursts)


def _rejection(call) -> str | None:
    """The ValueError ``call`` raises before launching, or None where it ran."""
    try:
        call()
    except ValueError as e:
        return str(e)
    return None


def _worker(rank, world, init_file, out):
    from cute_kernels.dist import process_group

    with process_group(rank, world, init_file):
        from calibrate.bench import BurstBench

        bench = BurstBench(buffer_bytes=64 << 20, timeout_s=2.0)
        results = []
        for s, d in ((0, 1), (1, 0)):
            for i, p in enumerate(POINTS):
                m = bench.run_point(_with_producers(p, bench.sm_count), s, d)  # raises on a wrong byte or record
                if m is not None:
                    results.append({**m, "point": i})
        # All-to-all injection: every rank sends at once, each receiver verifies every sender's words.
        a2a = [{**bench.run_all_peers(_with_producers(p, bench.sm_count)), "point": i}
               for i, p in enumerate(A2A_POINTS)]
        # Bad configurations are rejected before launch, on every rank alike.
        rejected = {"all_peers_of_a_pair_point": _rejection(lambda: bench.run_all_peers(POINTS[0])),
                    "too_many_producers": _rejection(lambda: bench.run_point(Point("rate", "remote", 10_000, 32768),
                                                                             0, 1))}
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"results": results, "a2a": a2a, "rejected": rejected}, f)


@pytest.mark.multigpu
def test_bursts_delivered_and_recorded(tmp_path):
    import torch

    if not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("GPUs 0 and 1 have no peer access")
    res = run_ranks(_worker, tmp_path)
    for r, rank_res in enumerate(res):
        assert rank_res["rejected"]["all_peers_of_a_pair_point"] is not None, "pair point run as all-to-all"
        assert "target='all_peers'" in rank_res["rejected"]["all_peers_of_a_pair_point"]
        assert "producers must be in [1," in (rank_res["rejected"]["too_many_producers"] or ""), rank_res["rejected"]
        # rank r reports every point it sent, once (the receiver returns nothing)
        assert sorted(m["point"] for m in rank_res["results"]) == list(range(len(POINTS))), r
        assert all(m["sender"] == r for m in rank_res["results"])
    for m in res[0]["results"] + res[1]["results"]:
        mt, what = m["metrics"], (POINTS[m["point"]], m["sender"])
        assert mt["t_iss_us"] > 0 and mt["clock_ghz"] > 0.5, what
        assert mt["producers"] == m["producers"] and mt["bursts"] == POINTS[m["point"]].bursts, what
        # Delivered throughput cannot beat the links (18 NVLink4 links: 450 GB/s each way; local HBM ~4.8 TB/s).
        ceiling = 450e3 if m["target"] == "remote" else 4.8e6  # bytes/µs
        assert mt["volume_bytes"] / mt["t_period_agg_us"] <= 1.05 * ceiling, what
        if m["mode"] != "isolated":
            assert mt["t_period_us"] >= mt["t_iss_us"], what
            assert mt["gap_us"] > (0.5 if m["gap"] else 0.0), what
        else:
            assert mt["completion_us"] >= mt["t_iss_us"], what

    for r, rank_res in enumerate(res):
        assert sorted(m["point"] for m in rank_res["a2a"]) == list(range(len(A2A_POINTS))), r
        for m in rank_res["a2a"]:
            mt = m["metrics"]
            assert m["sender"] == r and m["receiver"] == -1 and r not in m["peers"], m
            assert mt["t_iss_us"] > 0
            assert mt["volume_bytes"] / mt["t_period_agg_us"] <= 1.05 * 450e3 * (len(res) - 1)
