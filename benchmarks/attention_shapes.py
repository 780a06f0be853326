"""FA-only at DiT shapes on one GPU (issue 29's rows): ours against flash-attn-4 and cuDNN, side by side in one
process, at head_dim 64 and 128, sequence lengths that need not be multiples of 128, and a cross-attention
shape. Each column by CUDA-Graph replay in interleaved rounds (a fresh order each round), then ours against the
faster baseline by adjacent-launch pairs in alternating order, with the same run's A/A noise (ours against
ours). TFLOP/s count only unmasked work: 4 · S · S_kv · H · d per call.

    python -m benchmarks.attention_shapes --out J [--shapes 1x4096x16x64 ... | --grid]
    python -m benchmarks.attention_shapes --plot J --out PNG
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# (b, S, H, d, S_kv): issue 29's grid (d 64 and 128; S 4096, 4608, 8192, 32760, 65536; heads 12, 16, 24) is
# --grid; the default is a one-call subset with the shapes the issue names and the cross-attention shape
DEFAULT = ("1x4096x16x64", "1x4608x24x64", "1x8192x12x64", "1x32760x12x64", "1x4096x16x128", "1x32760x12x128",
           "1x8192x16x128x512")


def _shape(spec: str) -> tuple[int, int, int, int, int]:
    parts = [int(x) for x in spec.split("x")]
    if len(parts) not in (4, 5):
        raise argparse.ArgumentTypeError(f"a shape is BxSxHxD[xS_kv], got {spec!r}")
    return (*parts, parts[1])[:5]


def grid() -> list[tuple[int, int, int, int, int]]:
    return [(1, s, h, d, s) for d in (64, 128) for s in (4096, 4608, 8192, 32760, 65536) for h in (12, 16, 24)] + \
        [(1, 8192, 16, 128, 512), (1, 8192, 16, 64, 512)]


def run(args) -> dict:
    import torch
    import torch.distributed as dist

    from benchmarks.baselines import cudnn_forward, fa4_forward, fa4_unavailable
    from benchmarks.timing import alternated_excess, capture_graph, measure_rounds, paired_ratio
    from cute_kernels.dist import process_group
    from cute_kernels.runtime import provenance
    from flash_a2a import flash_attention

    missing = fa4_unavailable()
    rows = []
    with process_group(0, 1, os.path.join(args.tmp, "attention_shapes_pg")):
        group = dist.group.WORLD
        torch.manual_seed(args.seed)
        print(f"seed={args.seed}" + (f"; flash-attn-4 missing ({missing})" if missing else ""))
        for b, s, h, d, s_kv in args.shapes:
            q = torch.randn(b, s, h, d, device="cuda").to(torch.bfloat16)
            k, v = (torch.randn(b, s_kv, h, d, device="cuda").to(torch.bfloat16) for _ in range(2))
            out = torch.empty_like(q)
            calls = {"ours": lambda: flash_attention(q, k, v, out=out), "cudnn": lambda: cudnn_forward(q, k, v)}
            if not missing:
                calls["fa4"] = lambda: fa4_forward(q, k, v)
            dropped = {}
            for name in ("cudnn", "fa4"):  # a baseline that does not take the shape is left out, with why
                try:
                    if name in calls:
                        calls[name]()
                except Exception as e:  # noqa: BLE001 - recorded in the row
                    dropped[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    del calls[name]
            columns = {n: (fn, capture_graph(fn, args.calls_per_graph, group)[0]) for n, fn in calls.items()}
            medians, _ = measure_rounds(columns, args.calls_per_graph, args.replays, group)
            best = min((n for n in medians if n != "ours"), key=medians.get, default=None)
            if best is None:
                raise SystemExit(f"no baseline takes {b}x{s}x{h}x{d} S_kv={s_kv}: {dropped}")
            one = {n: capture_graph(fn, 1, group)[0] for n, fn in calls.items()}
            pairs = alternated_excess(one["ours"].replay, one[best].replay, args.pairs, group)  # best - ours
            noise = alternated_excess(one["ours"].replay, capture_graph(calls["ours"], 1, group)[0].replay,
                                      args.pairs, group)
            flops = 4.0 * b * s * s_kv * h * d
            row = {"shape": [b, s, h, d, s_kv], "us": medians, "tflops": {n: flops / t / 1e6 for n, t in medians.items()},
                   "best_baseline": best, "best_minus_ours_by_pairs_us": pairs, "ours_minus_ours_by_pairs_us": noise,
                   "best_over_ours_by_pairs": paired_ratio(pairs), "dropped": dropped}
            rows.append(row)
            print(f"{b}x{s}x{h}x{d} S_kv={s_kv}: " + ", ".join(f"{n} {t:.1f} µs ({row['tflops'][n]:.0f})"
                                                              for n, t in medians.items())
                  + f"; {best}/ours by pairs {row['best_over_ours_by_pairs']:.3f} ({best} - ours "
                  f"{pairs['median_us']:+.2f} [{pairs['q1_us']:+.2f}, {pairs['q3_us']:+.2f}], A/A "
                  f"[{noise['q1_us']:+.2f}, {noise['q3_us']:+.2f}])", flush=True)
    return {"provenance": provenance(" ".join(sys.argv)), "rows": rows, "fa4_missing": missing,
            "method": f"{args.replays} interleaved rounds of {args.calls_per_graph}-call graphs; {args.pairs} "
                      "alternating adjacent pairs of one-call graph replays (the faster baseline - ours, and ours - "
                      "ours as the run's noise); TFLOP/s = 4 S S_kv H d / t"}


def plot(result: dict, path: str) -> None:
    """TFLOP/s of ours, flash-attn-4 and cuDNN per row, and the faster baseline / ours by pairs (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [("{}x{}x{}".format(*r["shape"][1:4]) + (f" kv{r['shape'][4]}" if r["shape"][4] != r["shape"][1] else ""))
              for r in rows]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(max(10, 0.42 * len(rows)), 7), sharex=True)
    xs = range(len(rows))
    for i, (name, color) in enumerate((("ours", "C0"), ("fa4", "C1"), ("cudnn", "C2"))):
        ax.bar([x + (i - 1) * 0.27 for x in xs], [r["tflops"].get(name, 0) for r in rows], 0.27, label=name,
               color=color)
    ax.set_ylabel("TFLOP/s (4 S S_kv H d / t)")
    ax.legend(ncol=3)
    ratios = [r["best_over_ours_by_pairs"] for r in rows]
    bx.bar(list(xs), [x - 1 for x in ratios], 0.6, bottom=1, color=["C0" if x >= 1 else "C3" for x in ratios])
    bx.axhline(1, color="k", lw=0.8)
    bx.set_ylabel("faster baseline / ours\n(adjacent pairs)")
    bx.set_xticks(list(xs))
    bx.set_xticklabels(labels, rotation=70, fontsize=7)
    fig.suptitle(f"FA-only on one H200, bf16, commit {result['provenance'].get('git_commit', '?')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention_shapes", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", nargs="+", type=_shape, default=[_shape(x) for x in DEFAULT])
    p.add_argument("--grid", action="store_true", help="issue 29's whole grid instead of --shapes (several calls)")
    p.add_argument("--replays", type=int, default=8)
    p.add_argument("--calls-per-graph", type=int, default=8)
    p.add_argument("--pairs", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmp", default="/tmp")
    p.add_argument("--plot", metavar="JSON", help="draw an earlier run's JSON into --out (a PNG); no GPU")
    args = p.parse_args(argv)
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f), args.out)
        return 0
    if args.grid:
        args.shapes = grid()
    with open(args.out, "w") as f:
        json.dump(run(args), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
