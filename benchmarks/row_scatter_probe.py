"""Does the destination pattern of 4 KiB row writes change the write rate? (MegaMoE's Dispatch question.)

Dispatch at world 1 writes each token row into top_k pool rows spread over every expert's region (Qwen3-MoE W8A8
at 8192 tokens: 65,536 rows of 4 KiB over 268 MB) and runs at about 1.8 TB/s of read + write on one H100, half
the HBM rate. This probe times the same bytes moved by one torch kernel with the rows in order, in a random
order, shuffled within 2 MiB, and gathered (random reads, ordered writes): if the random order were much slower,
a Dispatch writing pool rows in row order would pay. CUDA-event median of 30 calls after 3 warm-up calls.

    python -m benchmarks.row_scatter_probe --out scatter_probe.json
"""
from __future__ import annotations

import argparse
import json
import sys

ROWS, ROW_WORDS, TOKENS = 65536, 512, 8192  # 4 KiB rows of int64; 8 KiB bf16 token rows


def main(argv=None) -> int:
    import torch

    from calibrate.anchors import time_us
    from cute_kernels.runtime import provenance

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("row_scatter_probe: needs a GPU")
    print(f"seed {args.seed}")
    torch.manual_seed(args.seed)
    dev = "cuda"
    src = torch.randint(0, 1 << 62, (ROWS, ROW_WORDS), dtype=torch.int64, device=dev)
    pool = torch.empty(ROWS + TOKENS, ROW_WORDS, dtype=torch.int64, device=dev)
    x = torch.randint(0, 1 << 62, (TOKENS, 2 * ROW_WORDS), dtype=torch.int64, device=dev)
    perm = torch.randperm(ROWS, device=dev)
    within = (torch.arange(ROWS, device=dev) // 512) * 512 + torch.randperm(512, device=dev).repeat(ROWS // 512)
    tok = torch.randint(0, TOKENS, (ROWS,), device=dev)
    ident = torch.arange(ROWS, device=dev)
    cases = {
        "copy_contiguous": lambda: pool[:ROWS].copy_(src),
        "index_copy_identity": lambda: pool.index_copy_(0, ident, src),
        "index_copy_random": lambda: pool.index_copy_(0, perm, src),
        "index_copy_within_2MiB": lambda: pool.index_copy_(0, within, src),
        "gather_rows_random_read": lambda: torch.index_select(src, 0, perm, out=pool[:ROWS]),
        "gather_token_rows_8x": lambda: torch.index_select(x[:, :ROW_WORDS], 0, tok, out=pool[:ROWS]),
    }
    res = {"provenance": provenance(" ".join(["python -m benchmarks.row_scatter_probe"] + sys.argv[1:])),
           "seed": args.seed}
    gb = 2 * ROWS * ROW_WORDS * 8 / 1e9  # read + write
    for name, fn in cases.items():
        us = time_us(fn, warmup=3, iters=30)
        res[name] = {"us": us, "rw_GB": gb, "TB_s": gb / us * 1e3}
        print(f"{name}: {us:.1f} us, {gb / us * 1e3:.2f} TB/s (read + write)")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
