"""The regret of ``schedule="auto"`` (megamoe.auto) on a measured ``xstage bench megamoe`` result: per row, the
order auto picks for that shape, world and token count against the better of the two measured orders (no GPU).

    python -m benchmarks.megamoe_auto benchmarks/results/h200/megamoe_bf16_147e2d5.json [--out J] [--margin M]
"""
from __future__ import annotations

import argparse
import json
import statistics

PRESETS = {"dsv4-flash": (4096, 2048, 256, 6), "qwen3-moe": (4096, 1536, 128, 8), "dit-moe": (1152, 4608, 8, 2)}


def regrets(bench: dict, margin: float, dtype: str = "bf16", sms: int = 132) -> list[dict]:
    from megamoe import auto

    out = []
    for row in bench["rows"]:
        cols = row["columns"]
        wave, inter = cols.get(f"ours_{dtype}_wave", {}), cols.get(f"ours_{dtype}_interleaved", {})
        if "us" not in wave or "us" not in inter or row["shape"] not in PRESETS:
            continue
        hidden, intermediate, experts, top_k = PRESETS[row["shape"]]
        world, tokens = row["world"], row["tokens_per_rank"]
        # an emulated rank runs over SMs / P CTAs of the one GPU, a real rank over all of its own GPU's
        per = sms if row.get("ranks") == "real" else sms // world
        grid = per - per % 2
        precision = "w8a8" if dtype == "fp8" else "bf16"
        pick = auto.choose_schedule(hidden, intermediate, experts, top_k, world, auto.token_bucket(tokens), grid,
                                    precision, margin)
        pred = auto.predicted_makespans(hidden, intermediate, experts, top_k, world, auto.token_bucket(tokens),
                                        grid, precision)
        measured = {"wave": wave["us"], "interleaved": inter["us"]}
        best = min(measured.values())
        out.append({"shape": row["shape"], "world": world, "ranks": row.get("ranks"), "grid": grid,
                    "tokens_per_rank": tokens, "routing": row["routing"],
                    "measured_us": measured, "predicted_us": pred, "pick": pick,
                    "better": min(measured, key=measured.get), "regret": measured[pick] / best - 1.0})
    return out


def summary(rows: list[dict]) -> dict:
    reg = [r["regret"] for r in rows]
    always = {name: [r["measured_us"][name] / min(r["measured_us"].values()) - 1.0 for r in rows]
              for name in ("wave", "interleaved")}
    return {"rows": len(rows), "max_regret": max(reg), "mean_regret": statistics.fmean(reg),
            "picks_the_better": sum(r["pick"] == r["better"] for r in rows),
            "always_wave_max_regret": max(always["wave"]), "always_interleaved_max_regret": max(always["interleaved"])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("bench", help="an xstage bench megamoe result JSON")
    p.add_argument("--margin", type=float, default=None, help="AUTO_MARGIN to evaluate (default megamoe.auto's)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp8"))
    p.add_argument("--out", help="write the rows and the summary here")
    args = p.parse_args(argv)
    from megamoe import auto

    margin = auto.AUTO_MARGIN if args.margin is None else args.margin
    with open(args.bench) as f:
        bench = json.load(f)
    rows = regrets(bench, margin, args.dtype)
    if not rows:
        raise SystemExit(f"{args.bench}: no row has both ours_{args.dtype} orders measured")
    result = {"bench": args.bench, "bench_commit": bench.get("provenance", {}).get("git_commit"), "margin": margin,
              "summary": summary(rows), "rows": rows}
    for r in rows:
        print(f"{r['shape']:11s} P={r['world']} T={r['tokens_per_rank']:5d} {r['routing']:8s} pick {r['pick']:11s} "
              f"better {r['better']:11s} regret {100 * r['regret']:5.2f}%  (pred int/wave "
              f"{r['predicted_us']['interleaved'] / max(r['predicted_us']['wave'], 1e-9):.3f}, measured "
              f"{r['measured_us']['interleaved'] / r['measured_us']['wave']:.3f})")
    print(json.dumps(result["summary"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
