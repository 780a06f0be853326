"""An experiment (issue 29, head dim 64): our FA-only kernel at d = 64 with other K/V stage counts and pinned
exponential counts, beside the default and flash-attn-4, one process, CUDA-Graph replay in interleaved rounds.

    python -m benchmarks.hdim64_sweep --out J
"""
from __future__ import annotations

import argparse
import json
import os
import sys

VARIANTS = {"s2_p40": (2, 40), "s3_p40": (3, 40), "s4_p40": (4, 40), "s2_p24": (2, 24), "s2_p64": (2, 64),
            "s2_p0": (2, 0), "s3_p64": (3, 64), "s3_p24": (3, 24)}
SHAPES = ((1, 4096, 16), (1, 8192, 12))


def run(args) -> dict:
    import math

    import cutlass
    import torch
    import torch.distributed as dist
    from cutlass.runtime import make_fake_stream

    from benchmarks.baselines import fa4_forward
    from benchmarks.timing import capture_graph, measure_rounds
    from cute_kernels.compile import compile_kernel
    from cute_kernels.dist import process_group
    from cute_kernels.runtime import provenance
    from flash_a2a.api import _grid, _local_args
    from flash_a2a.attention import FlashAttentionA2AForward

    compiled = {}
    for name, (stages, pin) in VARIANTS.items():
        cls = type(name, (FlashAttentionA2AForward,), {"kv_stages": stages, "pinned_exponentials": pin})
        k = cls(cutlass.BFloat16, 64, "local")
        compiled[name] = compile_kernel(k, *k.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True))
    rows = []
    with process_group(0, 1, os.path.join(args.tmp, "hdim64_pg")):
        group = dist.group.WORLD
        torch.manual_seed(0)
        for b, s, h in SHAPES:
            q, k, v = (torch.randn(b, s, h, 64, device="cuda").to(torch.bfloat16) for _ in range(3))
            la = _local_args(q.device)
            grid = _grid((s // 128) * h * b, q.device)
            outs = {n: torch.empty_like(q) for n in VARIANTS}

            def launch(n):
                return lambda: compiled[n](q, k, v, outs[n], la.dst_ptrs, la.flag_ptrs, la.flags, la.epoch,
                                           la.counter, la.errors, la.spans, 1 / math.sqrt(64), 0, 1, grid,
                                           2_000_000_000, None, None, 1, None, None)

            calls = {n: launch(n) for n in VARIANTS}
            calls["fa4"] = lambda: fa4_forward(q, k, v)
            columns = {n: (fn, capture_graph(fn, 8, group)[0]) for n, fn in calls.items()}
            medians, _ = measure_rounds(columns, 8, args.replays, group)
            torch.cuda.synchronize()
            same = {n: bool(torch.equal(outs[n], outs["s2_p40"])) for n in VARIANTS}
            rows.append({"shape": [b, s, h, 64], "us": medians, "same_bits_as_default": same})
            print(f"{b}x{s}x{h}x64: " + ", ".join(f"{n} {t:.1f}" for n, t in sorted(medians.items(), key=lambda x: x[1]))
                  + f"; same bits: {same}", flush=True)
    return {"provenance": provenance(" ".join(sys.argv)), "variants": VARIANTS, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--tmp", default="/tmp")
    args = p.parse_args(argv)
    with open(args.out, "w") as f:
        json.dump(run(args), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
