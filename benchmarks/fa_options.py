"""What flash_attention's options cost on one GPU: the default beside return_lse, GQA/MQA (fewer K/V heads) and
cross-attention (another K/V length), each at the same query shape, timed side by side by CUDA-Graph replay in
interleaved rounds (a fresh order per round) and by adjacent-launch pairs against the default.

    python -m benchmarks.fa_options --out J [--shapes 1x8192x12 1x32768x12]
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def _shape(spec: str) -> tuple[int, int, int]:
    b, s, h = (int(x) for x in spec.split("x"))
    return b, s, h


def run(args) -> dict:
    import torch
    import torch.distributed as dist

    from benchmarks.timing import alternated_excess, capture_graph, measure_rounds
    from cute_kernels.dist import process_group
    from cute_kernels.runtime import provenance
    from flash_a2a import flash_attention

    rows = []
    with process_group(0, 1, os.path.join(args.tmp, "fa_options_pg")):
        group = dist.group.WORLD
        torch.manual_seed(args.seed)
        print(f"seed={args.seed}")
        for b, s, h in args.shapes:
            def t(*shape):
                return torch.randn(*shape, device="cuda").to(torch.bfloat16)

            q, k, v = t(b, s, h, 128), t(b, s, h, 128), t(b, s, h, 128)
            kv_gqa = (t(b, s, h // 4, 128), t(b, s, h // 4, 128))
            kv_cross = (t(b, 512, h, 128), t(b, 512, h, 128))
            out = torch.empty_like(q)
            calls = {"default": lambda: flash_attention(q, k, v, out=out),
                     "return_lse": lambda: flash_attention(q, k, v, out=out, return_lse=True),
                     "gqa_4": lambda: flash_attention(q, *kv_gqa, out=out),
                     "cross_kv512": lambda: flash_attention(q, *kv_cross, out=out)}
            columns = {n: (fn, capture_graph(fn, args.calls_per_graph, group)[0]) for n, fn in calls.items()}
            medians, _ = measure_rounds(columns, args.calls_per_graph, args.replays, group)
            one = {n: capture_graph(fn, 1, group)[0] for n, fn in calls.items()}
            pairs = {n: alternated_excess(one["default"].replay, one[n].replay, args.pairs, group)
                     for n in ("return_lse", "gqa_4")}
            row = {"shape": [b, s, h, 128], "us": medians, "minus_default_by_pairs_us": pairs}
            rows.append(row)
            print(f"{b}x{s}x{h}: " + ", ".join(f"{n} {x:.1f}" for n, x in medians.items()) + " µs; by pairs: "
                  + ", ".join(f"{n} {p['median_us']:+.2f} [{p['q1_us']:+.2f}, {p['q3_us']:+.2f}]"
                              for n, p in pairs.items()), flush=True)
    return {"provenance": provenance(" ".join(sys.argv)), "rows": rows,
            "method": f"{args.replays} interleaved rounds of {args.calls_per_graph}-call graphs; {args.pairs} "
                      "alternating adjacent pairs of one-call graph replays against the default"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fa_options", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", nargs="+", type=_shape, default=[_shape("1x8192x12"), _shape("1x32768x12")])
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--calls-per-graph", type=int, default=8)
    p.add_argument("--pairs", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmp", default="/tmp")
    args = p.parse_args(argv)
    with open(args.out, "w") as f:
        json.dump(run(args), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
