"""An experiment (issue 29): our FA-only kernel with other tile rows, K/V and Q stage counts and pinned
exponential counts, beside the default, flash-attn-4 and cuDNN, one process, CUDA-Graph replay in interleaved
rounds (a fresh order each round). d = 64 rows sweep the 192-row three-warpgroup kernel's pins; d = 128 rows
the Q double buffer. What each sweep found: docs/FINDINGS.md (FA-only at DiT shapes).

    python -m benchmarks.hdim64_sweep --out J [--replays N]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# name -> (class attributes, constructor keywords) beside the API's default (flash_attention)
_D64 = {"tile_m": 192, "q_stages": 2, "kv_stages": 3}  # the API's d = 64 kernel
D64 = {"p8": ({"pinned_exponentials": 8}, _D64), "p12": ({"pinned_exponentials": 12}, _D64),
       "p16": ({"pinned_exponentials": 16}, _D64)}
D128 = {"q1": ({}, {"q_stages": 1}), "q2": ({}, {"q_stages": 2})}  # a third K/V stage: over the shared memory
# the masked partial KV block (S_kv = 32760) at three head counts, and the whole-block control beside it
SHAPES = ((1, 32760, 12, 64, 32760), (1, 32760, 16, 64, 32760), (1, 32760, 24, 64, 32760), (1, 32768, 12, 64, 32768))


def run(args) -> dict:
    import math

    import cutlass
    import torch
    import torch.distributed as dist
    from cutlass.runtime import make_fake_stream

    from benchmarks.baselines import cudnn_forward, fa4_forward
    from benchmarks.timing import capture_graph, measure_rounds
    from cute_kernels.compile import compile_kernel
    from cute_kernels.dist import process_group
    from cute_kernels.runtime import provenance
    from flash_a2a.api import _local_args, flash_attention
    from flash_a2a.attention import FlashAttentionA2AForward

    cache = {}

    def kernel(name, attrs, kw, d, flags):
        key = (name, d, tuple(sorted(flags.items())))
        if key not in cache:
            k = FlashAttentionA2AForward(cutlass.BFloat16, d, "local", **kw, **flags)
            for attr, value in attrs.items():  # after the constructor, which sets the d = 64 pin count itself
                setattr(k, attr, value)
            cache[key] = compile_kernel(k, *k.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True))
        return cache[key]

    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with process_group(0, 1, os.path.join(args.tmp, "hdim64_pg")):
        group = dist.group.WORLD
        torch.manual_seed(args.seed)
        print(f"seed={args.seed}")
        for b, s, h, d, s_kv in SHAPES:
            q = torch.randn(b, s, h, d, device="cuda").to(torch.bfloat16)
            k, v = (torch.randn(b, s_kv, h, d, device="cuda").to(torch.bfloat16) for _ in range(2))
            la = _local_args(q.device)
            variants = D64 if d == 64 else D128
            outs = {n: torch.empty_like(q) for n in (*variants, "default")}

            def launch(n, attrs, kw):
                tile_m = kw.get("tile_m", 128)
                flags = {"masked_q": bool(s % tile_m), "masked_kv": bool(s_kv % 128), "separate_kv": s_kv != s}
                fn = kernel(n, attrs, kw, d, {f: True for f, on in flags.items() if on})
                grid = min((-(-s // tile_m)) * h * b, sms)
                return lambda: fn(q, k, v, outs[n], la.dst_ptrs, la.flag_ptrs, la.flags, la.epoch, la.counter,
                                  la.errors, la.spans, 1 / math.sqrt(d), 0, 1, grid, 2_000_000_000, None, None, 1,
                                  None, None)

            calls = {n: launch(n, *spec) for n, spec in variants.items()}
            calls["default"] = lambda: flash_attention(q, k, v, out=outs["default"])
            calls["fa4"] = lambda: fa4_forward(q, k, v)
            calls["cudnn"] = lambda: cudnn_forward(q, k, v)
            for fn in calls.values():
                fn()
            columns = {n: (fn, capture_graph(fn, args.calls_per_graph, group)[0]) for n, fn in calls.items()}
            medians, per_round = measure_rounds(columns, args.calls_per_graph, args.replays, group)
            torch.cuda.synchronize()
            ref = outs["default"].float()
            err = {n: float((outs[n].float() - ref).abs().max()) for n in variants}
            rows.append({"shape": [b, s, h, d, s_kv], "us": medians, "rounds_us": per_round,
                         "max_abs_diff_to_default": err})
            print(f"{b}x{s}x{h}x{d} S_kv={s_kv}: " + ", ".join(
                f"{n} {t:.1f}" for n, t in sorted(medians.items(), key=lambda x: x[1])) + f"; diffs {err}",
                flush=True)
    return {"provenance": provenance(" ".join(sys.argv)), "variants": {"d64": D64, "d128": D128}, "rows": rows,
            "method": f"{args.replays} interleaved rounds of {args.calls_per_graph}-call graphs, medians (µs)"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hdim64_sweep", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--replays", type=int, default=8)
    p.add_argument("--calls-per-graph", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmp", default="/tmp")
    args = p.parse_args(argv)
    with open(args.out, "w") as f:
        json.dump(run(args), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
