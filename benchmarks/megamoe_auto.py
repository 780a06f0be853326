"""The regret of ``schedule="auto"`` (megamoe.auto) on a measured ``xstage bench megamoe`` result: per row, the
order auto picks for that shape, world, token count and routing histogram (redrawn from the row's seed) against
the better of the two measured orders (no GPU).

    python -m benchmarks.megamoe_auto benchmarks/results/h200/megamoe_grid_w1_7b05b02.json [--dtype fp8] [--out J]
    python -m benchmarks.megamoe_auto benchmarks/results/h200/megamoe_matrix_w4a8_f3649cd.json  (a --matrix result)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics

PRESETS = {"dsv4-flash": (4096, 2048, 256, 6), "qwen3-moe": (4096, 1536, 128, 8), "dit-moe": (1152, 4608, 8, 2)}


PRECISION_OF = {"bf16": "bf16", "fp8": "w8a8", "w8a8": "w8a8", "w4a8": "w4a8"}  # bench dtype -> kernel precision


def rank_histograms(experts: int, top_k: int, world: int, tokens: int, routing: str, seed, skew=None):
    """Each rank's rows per local expert of a measured row: its routing redrawn from the row's seed
    (megamoe.reference.make_routing over the P * T tokens, as the benches draw it; experts split in contiguous
    ranges), or None where the row has no seed (the expected histogram then)."""
    if seed is None:
        return None
    from megamoe.reference import expert_counts, make_routing

    kw = {"skew": skew} if skew is not None else {}
    idx, _ = make_routing(world * tokens, experts, top_k, routing, int(seed), **kw)
    counts = expert_counts(idx, experts).tolist()
    local = experts // world
    return tuple(tuple(counts[r * local:(r + 1) * local]) for r in range(world))


def _regret(layer: tuple, name: str, world: int, ranks, tokens: int, routing: str, precision: str,
            measured: dict, sms: int, hists) -> dict:
    """auto's pick for one measured (wave, interleaved) pair of layer (hidden, intermediate, experts, top_k),
    made as the API makes it: emulated ranks together from all their histograms at their token bucket."""
    from megamoe import auto

    hidden, intermediate, experts, top_k = layer
    # an emulated rank runs over SMs / P CTAs of the one GPU, a real rank over all of its own GPU's
    per = sms if ranks == "real" else sms // world
    grid = per - per % 2
    ranks_per_gpu = 1 if ranks == "real" else world
    bucket = auto.token_bucket(tokens)
    rows = None if hists is None else tuple(auto.scaled_rows(h, tokens, bucket) for h in hists)
    gain = auto.predicted_gain(hidden, intermediate, experts, top_k, world, bucket, grid, precision, rows,
                               ranks_per_gpu)
    pick = auto.schedule_for_gain(gain)
    best = min(measured.values())
    return {"shape": name, "precision": precision, "world": world, "ranks": ranks, "grid": grid,
            "tokens_per_rank": tokens, "routing": routing, "histogram": "redrawn" if hists else "expected",
            "measured_us": measured, "predicted_gain": gain,
            "measured_gain": math.log(measured["wave"] / measured["interleaved"]),
            "pick": pick, "better": min(measured, key=measured.get), "regret": measured[pick] / best - 1.0}


def regrets(bench: dict, dtype: str | None = "bf16", sms: int = 132) -> list[dict]:
    """Per measured row of an ``xstage bench megamoe`` result (its three PRESETS shapes), or per measured
    configuration of an ``xstage bench megamoe --matrix`` result (every model; ``dtype`` None: every
    precision in it)."""
    if bench.get("kind") == "megamoe_matrix" or "configurations" in bench:
        want = None if dtype is None else PRECISION_OF[dtype]
        out = []
        for c in bench["configurations"]:
            if c.get("status") != "measured" or (want and c["precision"] != want):
                continue
            measured = {s: c[s]["us"] for s in ("wave", "interleaved")}
            routing = c["routing"] + (f"@{c['zipf_exponent']}" if c.get("zipf_exponent") else "")
            hists = rank_histograms(c["num_experts"], c["top_k"], c["world"], c["tokens_per_rank"], c["routing"],
                                    c.get("seed"), c.get("zipf_exponent"))
            out.append(_regret((c["hidden"], c["intermediate"], c["num_experts"], c["top_k"]), c["model"],
                               c["world"], c.get("ranks"), c["tokens_per_rank"], routing, c["precision"],
                               measured, sms, hists))
        return out
    out = []
    for row in bench["rows"]:
        cols = row["columns"]
        wave, inter = cols.get(f"ours_{dtype}_wave", {}), cols.get(f"ours_{dtype}_interleaved", {})
        if "us" not in wave or "us" not in inter or row["shape"] not in PRESETS:
            continue
        measured = {"wave": wave["us"], "interleaved": inter["us"]}
        layer = PRESETS[row["shape"]]
        hists = rank_histograms(layer[2], layer[3], row["world"], row["tokens_per_rank"], row["routing"],
                                row.get("seed"))
        out.append(_regret(layer, row["shape"], row["world"], row.get("ranks"), row["tokens_per_rank"],
                           row["routing"], PRECISION_OF[dtype], measured, sms, hists))
    return out


def measured_pick_floor(bench: dict, dtype: str | None = None, first: int | None = None) -> dict | None:
    """The regret a pick from measurements would have in the same run: per matrix configuration with per-trial
    times, auto's measured pick (``megamoe.auto.faster_measured``) from the first ``first`` trials of each order
    (default ``MEASURED_CALLS``, as the kernel's trial takes them: megamoe.trial), judged on the median of the rest.
    Its max is what the run can resolve: a schedule rule whose regret is below it cannot be told from a perfect
    one by this run (None: no per-trial times)."""
    from megamoe.auto import MEASURED_CALLS, faster_measured

    first = MEASURED_CALLS if first is None else first
    want = None if dtype is None else PRECISION_OF[dtype]
    regs = []
    for c in bench.get("configurations", []):
        t = c.get("trial_times_us") or {}
        w, i = t.get("wave") or [], t.get("interleaved") or []
        if c.get("status") != "measured" or (want and c["precision"] != want) or min(len(w), len(i)) < first + 3:
            continue
        late = {"wave": statistics.median(w[first:]), "interleaved": statistics.median(i[first:])}
        pick = faster_measured({"wave": w[:first], "interleaved": i[:first]})
        regs.append(late[pick] / min(late.values()) - 1.0)
    if not regs:
        return None
    return {"first_trials": first, "configurations": len(regs), "max_regret": max(regs),
            "mean_regret": statistics.fmean(regs), "over_3pct": sum(r > 0.03 for r in regs)}


# --- the matrix's auto column (benchmarks/megamoe_matrix.py --auto; needs a GPU) -------------------------------

def settle_replays(calls_per_graph: int) -> int:
    """Replays of the auto column's graph (``calls_per_graph`` launches each) that take a fresh decision key's
    trial slot through its warm-up and both orders' samples (megamoe.auto.TRIAL_SETTLE launches)."""
    from megamoe.auto import TRIAL_SETTLE

    return -(-TRIAL_SETTLE // max(1, calls_per_graph))


def lead_layer(layer):
    """The MegaMoE whose trial slots decide a bench layer's schedule="auto": its own, or for ranks emulated behind
    benchmarks.megamoe.RankLists their lead rank's (they decide together)."""
    emulated = getattr(layer, "emulated", None)
    return emulated.ranks[0] if emulated is not None else layer


def settle_auto(graph, call, layer, calls_per_graph: int, sync=None) -> dict:
    """The auto column's trial, settled where a serving loop runs it: its captured ``graph`` (None: ``call``
    eagerly, ``calls_per_graph`` per replay) replayed ``settle_replays`` times back to back, so the slot's
    warm-up and samples run under sustained load (the host trial this replaced ranked the orders on a cool chip:
    docs/FINDINGS.md), then ``sync`` and the slot read back. A fixed count: the ranks of a real group replay
    alike. Returns the settled order (None: not decided), the rule's prior, the launches the slot counted and
    its samples."""
    if sync is None:
        import torch

        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    replays = settle_replays(calls_per_graph)
    for _ in range(replays):
        if graph is not None:
            graph.replay()
        else:
            for _ in range(calls_per_graph):
                call()
    sync()
    trial = lead_layer(layer).auto_trial() or {}
    return {"order": trial.get("decided"), "prior": trial.get("prior"), "settle_replays": replays,
            "launches": trial.get("launches"),
            "trial_us": {n: [round(t, 3) for t in ts] for n, ts in (trial.get("times_us") or {}).items()}}


def summary(rows: list[dict]) -> dict:
    reg = [r["regret"] for r in rows]
    always = {name: [r["measured_us"][name] / min(r["measured_us"].values()) - 1.0 for r in rows]
              for name in ("wave", "interleaved")}
    return {"rows": len(rows), "max_regret": max(reg), "mean_regret": statistics.fmean(reg),
            "picks_the_better": sum(r["pick"] == r["better"] for r in rows),
            "always_wave_max_regret": max(always["wave"]), "always_interleaved_max_regret": max(always["interleaved"])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench", help="an xstage bench megamoe result JSON (a grid or a --matrix result)")
    p.add_argument("--dtype", default=None, choices=tuple(PRECISION_OF),
                   help="the precision's columns (grid: default bf16; matrix: default every precision in it)")
    p.add_argument("--out", help="write the rows and the summary here")
    args = p.parse_args(argv)
    from megamoe import auto

    with open(args.bench) as f:
        bench = json.load(f)
    matrix = "configurations" in bench
    dtype = args.dtype if args.dtype or matrix else "bf16"
    rows = regrets(bench, dtype)
    if not rows:
        raise SystemExit(f"{args.bench}: no row or configuration of precision {dtype} has both orders measured")
    result = {"bench": args.bench, "bench_commit": bench.get("provenance", {}).get("git_commit"),
              "fits": {k: dataclasses.asdict(v) for k, v in auto.FITS.items()}, "summary": summary(rows),
              "measured_pick_floor": measured_pick_floor(bench, dtype) if matrix else None, "rows": rows}
    for r in rows:
        print(f"{r['shape']:11s} {r['precision']:5s} P={r['world']} T={r['tokens_per_rank']:5d} {r['routing']:8s} pick {r['pick']:11s} "
              f"better {r['better']:11s} regret {100 * r['regret']:5.2f}%  (wave/int predicted "
              f"{math.exp(r['predicted_gain']):.3f}, measured {math.exp(r['measured_gain']):.3f})")
    print(json.dumps(result["summary"]))
    if result["measured_pick_floor"]:
        print("a pick from the run's own first trials, judged on the rest:", json.dumps(result["measured_pick_floor"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
