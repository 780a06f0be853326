"""Hardware counters of one MegaMoE launch per case, read by Nsight Compute: where the mainloop's time goes
(Tensor-pipe busy, DRAM and L2 throughput, L2 hit rate, warp stall reasons), beside a dense FP8 and bf16
``torch`` product of 8192^3 as the ceiling's own counters.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight ... --csv --page raw \\
        python -m benchmarks.megamoe_ncu --cases dsv4-flash:8192:balanced:w8a8:interleaved ...

Each case's layer is built, run once eagerly (compile, warm-up), then launched once between
``cudaProfilerStart`` and ``cudaProfilerStop``: ncu (with ``--profile-from-start off``) profiles only what runs
there, replaying each kernel per counter pass with its memory restored (the kernel's epochs and counters
included). ``--summarize CSV`` (no GPU) turns ncu's raw CSV into the JSON the findings cite.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys

# the counters the summary keeps (ncu's raw page names; a missing one is reported as missing)
METRICS = {
    "duration_us": "gpu__time_duration.sum",
    "sm_throughput_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_throughput_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_bytes_per_s": "dram__bytes.sum.per_second",  # x duration: the bytes moved
    "l2_throughput_pct": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "l2_hit_rate_pct": "lts__t_sector_hit_rate.pct",
    "l1_throughput_pct": "l1tex__throughput.avg.pct_of_peak_sustained_active",
    "l2_fill_from_dram_pct": "lts__d_sectors_fill_device.avg.pct_of_peak_sustained_elapsed",
    "l2_to_sm_pct": "lts__lts2xbar_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "dram_active_pct": "dram__cycles_active.avg.pct_of_peak_sustained_elapsed",
    "tensor_pipe_pct": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "fma_pipe_pct": "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "issue_active_pct": "sm__inst_issued.avg.pct_of_peak_sustained_elapsed",
    "sm_clock_ghz": "gpc__cycles_elapsed.avg.per_second",
    "dram_clock_ghz": "dram__cycles_elapsed.avg.per_second",
}
STALL_PREFIX = "smsp__average_warps_issue_stalled_"  # WarpStateStats: per reason, warps stalled per issue


def run(args) -> None:
    import torch

    from benchmarks.megamoe_old_vs_new import case_inputs, parse_case
    from megamoe.api import MegaMoE

    print(f"seed={args.seed}", flush=True)
    dense = {}
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    dense["fp8_scaled_mm_8192"] = lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
    ab = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    dense["bf16_mm_8192"] = lambda: ab @ ab
    for fn in dense.values():
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for fn in dense.values():
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    del a, b, ab
    trees = {"new": MegaMoE}
    if args.old:  # an old tree's layer beside this one (benchmarks.old_vs_new --prepare puts it on PYTHONPATH)
        try:
            from old_megamoe.api import MegaMoE as OldMoE
        except ImportError as e:
            raise SystemExit(f"old_megamoe does not import ({e}): put the old tree on PYTHONPATH") from e
        trees = {"old": OldMoE, "new": MegaMoE}
    labels = []  # the MegaMoE launches in profiling order
    for spec in args.cases:
        case = parse_case(spec)
        preset, _, w1, w2, x, idx, wts, dtype = case_inputs(case, args.seed)
        for tree, cls in trees.items():
            layer = cls(None, preset.num_experts, preset.top_k, preset.hidden, preset.intermediate, dtype=dtype,
                        schedule=case["schedule"], max_tokens_per_rank=case["tokens"])
            layer.load_weights(w1, w2)
            for _ in range(2):
                layer.forward(x, idx, wts)
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            layer.forward(x, idx, wts)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            layer.check_errors()
            labels.append(spec if len(trees) == 1 else f"{tree}:{spec}")
            print(f"profiled {labels[-1]}", flush=True)
            del layer
            torch.cuda.empty_cache()
        del w1, w2
    if args.out:  # what ran, for the summary (--summarize ... --provenance this file)
        from cute_kernels.runtime import provenance

        with open(args.out, "w") as f:
            json.dump({"provenance": provenance(" ".join(sys.argv)), "cases": labels, "seed": args.seed}, f,
                      indent=1)


def summarize(path: str, cases: list[str], provenance: dict | None = None) -> dict:
    """ncu's raw CSV (one row per profiled kernel, units in the second row) -> per kernel the METRICS and the
    top stall reasons; the MegaMoE launches are named by ``cases`` in launch order."""
    with open(path, newline="") as f:  # ncu's CSV lines start with a quote; the program's own output does not
        rows = list(csv.reader(line for line in f if line.startswith('"')))
    head, units, data = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(head)}
    kernels = []
    moe_i = 0
    for r in data:
        name = r[col["Kernel Name"]] if "Kernel Name" in col else r[col.get("Function Name", 0)]
        rec = {"kernel": name[:120]}
        if "megamoe" in name.lower():
            rec["case"] = cases[moe_i] if moe_i < len(cases) else None
            moe_i += 1
        for key, metric in METRICS.items():
            if metric not in col:
                rec[key] = None
                continue
            raw = r[col[metric]].replace(",", "")
            try:
                v = float(raw)
            except ValueError:
                rec[key] = None
                continue
            unit = units[col[metric]].lower()
            if key == "duration_us":
                v = v * {"ns": 1e-3, "nsecond": 1e-3, "ms": 1e3, "msecond": 1e3}.get(unit, 1.0)
            if key.endswith("_ghz"):
                v = v * {"hz": 1e-9, "cycle/second": 1e-9, "khz": 1e-6, "mhz": 1e-3}.get(unit, 1.0)
            if key.endswith("_per_s"):
                v = v * {"byte/s": 1.0, "kbyte/s": 1e3, "mbyte/s": 1e6, "gbyte/s": 1e9, "tbyte/s": 1e12}.get(unit, 1.0)
            rec[key] = v
        stalls = {}
        for metric, i in col.items():
            if metric.startswith(STALL_PREFIX) and metric.endswith("_per_issue_active.ratio"):
                try:
                    stalls[metric[len(STALL_PREFIX):-len("_per_issue_active.ratio")]] = float(r[i].replace(",", ""))
                except ValueError:
                    pass
        rec["stall_cycles_per_issue"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:8])
        # ncu --metrics breakdown:lts__throughput...: the L2's sub-units, the busiest first (what bounds it)
        parts = {}
        for metric, i in col.items():
            if metric.startswith(("lts__", "ltc__")) and metric.endswith("pct_of_peak_sustained_elapsed") \
                    and metric not in METRICS.values():
                try:
                    parts[metric] = float(r[i].replace(",", ""))
                except ValueError:
                    pass
        if parts:
            rec["l2_breakdown_pct"] = dict(sorted(parts.items(), key=lambda kv: -kv[1])[:12])
        kernels.append(rec)
    return {"provenance": provenance, "source": os.path.basename(path), "cases": cases, "metrics": METRICS,
            "kernels": kernels}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.megamoe_ncu", description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=["dsv4-flash:8192:balanced:w8a8:interleaved"],
                   help="SHAPE:TOKENS:ROUTING:DTYPE[:SCHEDULE] (benchmarks.megamoe_old_vs_new's cases)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--old", action="store_true",
                   help="profile the old tree's layer (old_megamoe on PYTHONPATH) before this tree's, per case")
    p.add_argument("--summarize", metavar="CSV", help="no GPU: ncu's raw CSV -> JSON (--out)")
    p.add_argument("--out", help="with --summarize: the summary JSON; else: the run's provenance JSON")
    p.add_argument("--provenance", help="with --summarize: the run's --out file, embedded in the summary")
    args = p.parse_args(argv)
    if args.summarize:
        prov = None
        if args.provenance:
            with open(args.provenance) as f:
                prov = json.load(f)
            args.cases = prov.get("cases", args.cases)
            prov = prov.get("provenance")
        result = summarize(args.summarize, args.cases, prov)
        text = json.dumps(result, indent=1)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        print(text)
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
