"""How much of the Tensor Cores' work a MegaMoE row keeps: the padding rows of a ``xstage bench megamoe`` result.

The kernel multiplies each expert's rows in 128-row M blocks, the last one in 64-row warpgroup halves
(``megamoe.schedule.mma_rows``); the rows past an expert's tokens in its last half are multiplied and thrown
away. Per row of a result file this prints the padding share, and per timed column of ours:
  TF      effective TFLOP/s (the routed rows' FLOPs: the bench's ``tflops``);
  mma TF  the FLOPs the Tensor Cores ran (``mma_rows``) per second;
  roof    the bench's roofline efficiency (max(FLOPs at the dense ceiling, bytes at the HBM rate) / time);
  mma     the Tensor Cores' FLOPs at the dense ceiling of the run / time: how near the ceiling the kernel runs
          on the work it does, whatever the routing leaves as padding.
Rows written before the bench recorded ``mma_rows`` get it from their seed: ``megamoe.reference.make_routing``
draws on the CPU, so the routing is the one the GPU ran. CPU only (torch for the routing).

    python -m benchmarks.megamoe_padding RESULT.json [RESULT.json ...] [--md OUT.md]
"""
from __future__ import annotations

import argparse
import json
import sys
from types import SimpleNamespace

from benchmarks.megamoe import DTYPES, SCHEDULES, column_dtype, routed_mma_rows

OURS = tuple(f"ours_{d}_{s}" for d in DTYPES for s in SCHEDULES)  # the bench's columns of ours


def row_mma_rows(row: dict) -> tuple[int, str]:
    """(the row's mma_rows, "recorded" or "from the seed")."""
    if "mma_rows" in row:
        return row["mma_rows"], "recorded"
    from megamoe.reference import make_routing

    idx, _ = make_routing(row["tokens"], row["num_experts"], row["top_k"], row["routing"], row["seed"])
    return routed_mma_rows(idx, row["num_experts"]), "from the seed"


def ceiling_tflops(result: dict, row: dict, dtype: str) -> float:
    ceilings = result.get("ceilings_by_world", {}).get(str(row["world"]), result["ceilings"])
    return ceilings[f"{'fp8' if dtype == 'w4a8' else dtype}_tflops"]


def padding_rows(result: dict) -> list[dict]:
    """One entry per (row, timed column of ours): the table's numbers."""
    from benchmarks.moe_baselines import moe_flops

    out = []
    for row in result["rows"]:
        mma, source = row_mma_rows(row)
        if mma < row["rows"]:
            raise ValueError(f"row {row['shape']} {row['tokens_per_rank']} {row['routing']}: mma_rows {mma} < "
                             f"routed rows {row['rows']}: not this kernel's tiling (megamoe.schedule.mma_rows)")
        flops = moe_flops(SimpleNamespace(hidden=row["hidden"], intermediate=row["intermediate"]), mma)
        for name in OURS:
            c = row["columns"].get(name, {})
            if "us" not in c:
                continue
            dtype = column_dtype(name)
            out.append({"shape": row["shape"], "world": row["world"], "tokens_per_rank": row["tokens_per_rank"],
                        "routing": row["routing"], "column": name, "rows": row["rows"], "mma_rows": mma,
                        "mma_rows_source": source, "padding": 1 - row["rows"] / mma, "us": c["us"],
                        "tflops": c["tflops"], "mma_tflops": flops / c["us"] / 1e6,
                        "roofline_efficiency": c["roofline_efficiency"],
                        "mma_efficiency": flops / (ceiling_tflops(result, row, dtype) * 1e12) / (c["us"] * 1e-6)})
    return out


def markdown(entries: list[dict], title: str) -> str:
    lines = [f"## {title}", "",
             "| shape | P | tokens/rank | routing | padding | column | µs | TF | mma TF | roof | mma |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in entries:
        lines.append(f"| {e['shape']} | {e['world']} | {e['tokens_per_rank']} | {e['routing']} | "
                     f"{100 * e['padding']:.1f}% | {e['column'][5:]} | {e['us']:.0f} | {e['tflops']:.0f} | "
                     f"{e['mma_tflops']:.0f} | {e['roofline_efficiency']:.2f} | {e['mma_efficiency']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.megamoe_padding", description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", help="xstage bench megamoe result JSON files")
    p.add_argument("--md", help="also write the tables here")
    args = p.parse_args(argv)
    parts = []
    for path in args.results:
        with open(path) as f:
            result = json.load(f)
        if "rows" not in result:
            raise ValueError(f"{path}: no rows (not an xstage bench megamoe result)")
        entries = padding_rows(result)
        if not entries:
            raise ValueError(f"{path}: no timed column of ours ({', '.join(OURS)}) to account for")
        prov = result.get("provenance", {})
        parts.append(markdown(entries, f"{path} ({prov.get('device', '?')}, {prov.get('git_commit', '?')}; "
                                       f"mma_rows {entries[0]['mma_rows_source']})"))
    text = "\n".join(parts)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
