"""Real ranks for ``xstage bench megamoe`` and its ``--matrix`` (issue 31, items 3-4): world P > 1 as P
processes, one GPU each, in one NCCL process group, instead of P ranks emulated on one GPU.

--ranks emulated|real applies to every --world value above 1 (world 1 is one GPU either way). Left out, it is
real for a world P where torch.cuda.device_count() >= P, else emulated; the JSON records the request, the rule
and the mode of every world ("ranks_by_world") and every row or configuration ("ranks").

A run with real worlds goes in phases: the one-GPU and emulated worlds first, in this process (as before), then
each real world P in P spawned ranks (cute_kernels.dist.spawn_ranks), which continue the result file the phase
before wrote (rank 0 writes; every rank keeps the rows). At real P:
  * Inputs: every rank draws the emulated row's P*T tokens and routing (the same seeds) and keeps its slice of T
    (rank r: rows [rT, (r+1)T)), so a real and an emulated row of one seed hold the same layer and inputs.
  * Ours: megamoe.api.MegaMoE(group, ...) over symmetric memory (torch.distributed._symmetric_memory).
  * The unfused baseline: unfused_nccl_bf16 / unfused_nccl_fp8 (benchmarks.moe_nccl: NCCL all_to_all_single
    dispatch and combine around the grouped GEMMs of benchmarks.moe_baselines; the split sizes exchanged once
    per row, untimed, and that exchange timed alone as nccl_splits_exchange_us). The one-GPU unfused columns
    are skipped with why.
  * Timing: benchmarks.timing as at P = 1 (CUDA-graph replays in shuffled rounds, each timed region after a
    barrier and device_align, per round the max over ranks via rank_max, median over rounds); the matrix's
    rotated order likewise. Every rank decides alike: a column that fails on one rank is failed on all
    (run_columns' agree), a layer not built on one rank is skipped on all, --max-minutes stops all together.
  * Errors: each rank's output against megamoe.reference on its own tokens; the row keeps the max over ranks.
  * Roofline per rank (benchmarks.moe_baselines.roofline_terms over the rows its experts receive, its touched
    experts' weights, its own x and y; NVLink traffic not counted): the slowest rank's, every rank's beside it.
"""
from __future__ import annotations

import json
import os
import time

from benchmarks.megamoe_ranks import Ranks, ep_stats, merge_columns

# --- what a real row records -------------------------------------------------------------------------------------

def rank_roofline(preset, tokens: int, stats: dict, dtype: str, ceilings: dict) -> dict:
    """The per-rank roofline (module docstring): the slowest rank's terms, with every rank's seconds."""
    from benchmarks.moe_baselines import roofline_terms

    per = [roofline_terms(preset, tokens, preset.top_k, dtype, ceilings, rows=r, experts_touched=t)
           for r, t in zip(stats["rows_by_rank"], stats["experts_touched_by_rank"])]
    slowest = max(range(len(per)), key=lambda i: per[i]["seconds"])
    return {**per[slowest], "rank": slowest, "seconds_by_rank": [p["seconds"] for p in per],
            "scope": "per rank: its experts' rows and touched weights, its own x and y (NVLink not counted); "
                     "the slowest rank's"}


def exchange_seconds(fn, trials: int, group, device) -> list[float]:
    """Host wall time of ``fn`` (eager; it ends in a device-to-host copy), each trial started after a barrier
    (and, on a GPU, a device-aligning all-reduce and a sync), per trial the max over ranks."""
    import torch
    import torch.distributed as dist

    cuda = torch.device(device).type == "cuda"
    align = None
    if cuda:
        from benchmarks.timing import device_align

        align = device_align(group)
    times = []
    for _ in range(trials):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier(group=group)
        if align is not None:
            align()
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


# --- the bench at real P ------------------------------------------------------------------------------------------

def load_result(path: str, command: str) -> dict:
    """bench's in-memory result from the JSON that benchmarks.megamoe._write wrote."""
    with open(path) as f:
        saved = json.load(f)
    return {"command": command, **{k: v for k, v in saved.items() if k not in ("provenance", "method", "args")}}


def run_bench(args, hooks: dict | None = None) -> None:
    """The bench in phases (module docstring); ``args.rank_modes`` says each world's mode. ``hooks``: for the
    CPU tests, {"backend": "gloo", "local": bench()'s keywords, "rank": bench_rank's} (picklable)."""
    import torch

    from benchmarks import megamoe as mb
    from cute_kernels.dist import spawn_ranks

    hooks = hooks or {}
    command = "xstage bench megamoe " + " ".join(mb._argv())
    local = [w for w in args.world if args.rank_modes[w] != "real"]
    real = [w for w in args.world if args.rank_modes[w] == "real"]
    prior = None
    if local:
        with mb.local_group(args.tmp, hooks.get("backend", "nccl")) as group:
            mb.bench(args, group, worlds=local, command=command, **hooks.get("local", {}))
        prior = args.out if os.path.exists(args.out) else None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for w in real:
        spawn_ranks(_bench_worker, w, args, prior, command, hooks)
        prior = args.out


def _bench_worker(rank, world, init_file, args, prior, command, hooks):
    from cute_kernels.dist import process_group

    with process_group(rank, world, init_file, backend=hooks.get("backend", "nccl")) as group:
        bench_rank(args, group, prior=prior, command=command, **hooks.get("rank", {}))


def bench_rank(args, group, *, prior=None, command=None, device=None, ceilings=None, capture=None, timer=None,
               api=None, exchange=None) -> dict:
    """Every row of ``args`` at real P = the group's size, on this rank; rank 0 writes args.out after every
    row, continuing ``prior`` (a result file this run wrote, or None). The keywords replace the GPU parts
    for a test as in benchmarks.megamoe.bench, and ``exchange(fn)`` -> per-trial seconds (exchange_seconds)."""
    from types import SimpleNamespace

    import torch

    from benchmarks import megamoe as mb
    from benchmarks.moe_baselines import fp8_grouped_unavailable, measure_ceilings
    from benchmarks.timing import capture_graph, measure_rounds

    torch.set_grad_enabled(False)
    torch.backends.cuda.matmul.allow_tf32 = False
    device = device or torch.device("cuda", torch.cuda.current_device())
    ranks = Ranks(group, device)
    ctx = SimpleNamespace(args=args, device=device, ranks=ranks)
    ctx.ceilings = ceilings if ceilings is not None else measure_ceilings(group, replays=args.replays)
    ctx.capture = capture or (lambda fn: capture_graph(fn, args.calls_per_graph, group))
    ctx.timer = timer or (lambda cols: measure_rounds(cols, args.calls_per_graph, args.replays, group))
    ctx.exchange = exchange or (lambda fn: exchange_seconds(fn, max(3, args.replays), group, device))
    api = api or mb.load_api()
    fp8_why = (fp8_grouped_unavailable(str(device)) if {"unfused_fp8", "unfused_nccl_fp8"} & set(args.columns)
               else None)
    ctx.fp8_why = fp8_why if ranks.agree(fp8_why is None) else (fp8_why or "unavailable on another rank")
    command = command or "xstage bench megamoe " + " ".join(mb._argv())
    if prior:
        result = load_result(prior, command)
    else:
        result = mb.new_result(args, command, ctx.ceilings, api, ctx.fp8_why)
    result["ceilings_by_world"] = {**result.get("ceilings_by_world", {}), str(ranks.world): ctx.ceilings}
    ours_dtypes = [d for d in mb.DTYPES if any(f"ours_{d}_{s}" in args.columns for s in mb.SCHEDULES)]
    ctx.dumps, ctx.dump_entries = mb.load_dump(args.dump) if prior and args.dump and ranks.writer else ({}, [])
    try:
        for preset in args.shapes:
            w1, w2 = mb.make_weights(preset, mb.row_seed(args.seed, preset.name, "weights"), device)
            nccl = ranks.agreed_layers(build_nccl(group, w1, w2, args.columns, ctx.fp8_why))
            for tokens in args.tokens:
                ours = ranks.agreed_layers(mb.build_ours(api, group, preset, ranks.world, tokens, w1, w2,
                                                         ours_dtypes, real=True))
                probes = None
                if args.dump:
                    built = ranks.agreed_layers(mb.build_ours(api, group, preset, ranks.world, tokens, w1, w2,
                                                              ours_dtypes, instrument=True, real=True))
                    probes = {d: v if isinstance(v, str) else mb.GatheredProbe(v, ranks) for d, v in built.items()}
                for routing in args.routing:
                    row = measure_row(ctx, preset, tokens, routing, (w1, w2), nccl, ours, probes,
                                      len(result["rows"]))
                    result["rows"].append(row)
                    if ranks.writer:
                        mb._write(result, args)
                        print(mb.summary_line(row), flush=True)
                del ours, probes
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            del w1, w2, nccl
    finally:
        if args.dump and ranks.writer:
            mb._write_dump(args.dump, ctx.dumps, ctx.dump_entries, result["command"])
    return result


def build_nccl(group, w1, w2, columns, fp8_why) -> dict:
    """{dtype: NcclEPMoE, or the reason there is none} for the unfused_nccl columns asked for."""
    from benchmarks import megamoe as mb
    from benchmarks.moe_nccl import NcclEPMoE

    out = {}
    for d in mb.UNFUSED_DTYPES:
        if f"unfused_nccl_{d}" not in columns:
            out[d] = "left out by --columns"
        elif d == "fp8" and fp8_why:
            out[d] = fp8_why
        else:
            try:
                out[d] = NcclEPMoE(group, w1, w2, d)
            except Exception as e:  # noqa: BLE001 - a skipped column, with why
                out[d] = mb._reason(e)
    return out


def measure_row(ctx, preset, tokens: int, routing: str, weights, nccl: dict, ours: dict, probes,
                index: int) -> dict:
    """One row at real P on this rank (module docstring): every rank's columns checked, timed together."""
    import torch

    from benchmarks import megamoe as mb
    from benchmarks.moe_baselines import moe_flops
    from megamoe.reference import make_routing, routing_stats

    args, ranks = ctx.args, ctx.ranks
    w1, w2 = weights
    world, rank, total = ranks.world, ranks.rank, ranks.world * tokens
    seed = mb.row_seed(args.seed, preset.name, world, tokens, routing)  # the emulated row's
    gen = torch.Generator(device=ctx.device).manual_seed(seed)
    x_all = torch.randn(total, preset.hidden, generator=gen, device=ctx.device).to(torch.bfloat16)
    idx_all, wts_all = make_routing(total, preset.num_experts, preset.top_k, routing, seed, ctx.device)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    x, idx, wts = (a[mine].clone() for a in (x_all, idx_all, wts_all))
    del x_all
    stats = routing_stats(idx_all, preset.num_experts)
    ep = ep_stats(idx_all, preset.num_experts, world)
    roof = {d: rank_roofline(preset, tokens, ep, d, ctx.ceilings) for d in mb.DTYPES}
    row = {"shape": preset.name, "hidden": preset.hidden, "intermediate": preset.intermediate,
           "num_experts": preset.num_experts, "top_k": preset.top_k, "world": world, "ranks": "real",
           "tokens_per_rank": tokens, "tokens": total, "routing": routing, "seed": seed, **stats, **ep,
           "flops": moe_flops(preset, stats["rows"]), "mma_rows": mb.routed_mma_rows(idx_all, preset.num_experts),
           "roofline": roof, "columns": {}, "interleaved_over_wave": {}}
    del idx_all, wts_all
    plans = {d: m.plan(idx) for d, m in nccl.items() if not isinstance(m, str)}  # untimed, collective
    built = [m for m in nccl.values() if not isinstance(m, str)]
    if built:
        times = ctx.exchange(lambda: built[0].plan(idx))
        row["nccl_splits_exchange_us"] = sorted(times)[len(times) // 2] * 1e6
        row["nccl_splits"] = {"send_by_rank": ranks.gather(plans[built[0].precision].send_splits),
                              "excluded_from_timing": "the per-expert counts all_to_all and .tolist()"}
    refs = {}

    def reference(name):
        key = {"ours_fp8": "fp8", "ours_w4a8": "w4a8"}.get(name.rsplit("_", 1)[0], "bf16")
        if key not in refs:
            refs[key] = mb.reference_output(key, x, idx, wts, w1, w2, mb.fp8_h_block(ours.get(key)))
        return refs[key][0], refs[key][1] + (" (unquantized: this column's row-wise FP8 is not applied)"
                                             if name == "unfused_nccl_fp8" else "")

    calls = real_calls(x, idx, wts, nccl, plans, ours, args.columns)
    cols, times = mb.run_columns(calls, reference, ctx.capture, ctx.timer, agree=ranks.agree)
    row["columns"] = merge_columns(ranks.gather(cols))
    for name, c in row["columns"].items():
        if "us" in c:
            d = mb.column_dtype(name)
            c.update(dtype=d, tflops=row["flops"] / c["us"] / 1e6, tflops_per_gpu=row["flops"] / c["us"] / 1e6 / world,
                     roofline_efficiency=roof[d]["seconds"] * 1e6 / c["us"])
        elif "timing" in c:
            c["dtype"] = mb.column_dtype(name)
    row["round_times_us"] = {n: [round(t, 3) for t in ts] for n, ts in times.items()}
    mb.derive(row, preset)
    if probes is not None:
        mb.dump_row(ctx, row, index, probes, (x, idx, wts))
    return row


REAL_SKIP = "at real EP the unfused path is unfused_nccl_{d} (this column is the one-GPU path)"


def real_calls(x, idx, wts, nccl: dict, plans: dict, ours: dict, wanted) -> dict:
    """{column: a call, or {"skipped": why}} at real P, in COLUMNS order (the same on every rank)."""
    from benchmarks import megamoe as mb

    cols = {}
    for name in mb.COLUMNS:
        d = mb.column_dtype(name)
        if name.startswith("unfused_nccl_"):
            m = nccl.get(d, "not built")
            cols[name] = ({"skipped": m} if isinstance(m, str)
                          else (lambda m=m, p=plans[d]: m.forward(x, idx, wts, p)))
        elif name.startswith("unfused_"):
            cols[name] = {"skipped": REAL_SKIP.format(d=d)}
        else:
            s = name.rsplit("_", 1)[1]
            m = ours.get(d, "not built")
            cols[name] = ({"skipped": m} if isinstance(m, str)
                          else (lambda m=m, s=s: m.forward(x, idx, wts, schedule=s)))
    return {n: (c if n in wanted or isinstance(c, dict) else {"skipped": "left out by --columns"})
            for n, c in cols.items()}


# --- the matrix at real P -------------------------------------------------------------------------------------

def run_matrix(args, hooks: dict | None = None) -> dict:
    """The matrix in phases (module docstring), one clock for --max-minutes across them; returns the result
    the last phase wrote. ``hooks`` as run_bench's ("local" and "rank": run_matrix's keywords)."""
    import torch

    from benchmarks import megamoe as mb
    from benchmarks import megamoe_matrix as mx
    from cute_kernels.dist import spawn_ranks

    hooks = hooks or {}
    start = time.monotonic()
    local = [w for w in args.world if args.rank_modes[w] != "real"]
    real = [w for w in args.world if args.rank_modes[w] == "real"]
    result, phase = None, None
    if local:
        with mb.local_group(args.tmp, hooks.get("backend", "nccl")) as group:
            result = mx.run_matrix(args, group, worlds=local, start=start, **hooks.get("local", {}))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        phase = args.out
    for w in real:
        if result is not None and result.get("stopped"):
            break
        spawn_ranks(_matrix_worker, w, args, phase, start, hooks)
        phase = args.out
        with open(args.out) as f:
            result = json.load(f)
    return result


def _matrix_worker(rank, world, init_file, args, phase, start, hooks):
    import torch

    from benchmarks import megamoe_matrix as mx
    from cute_kernels.dist import process_group

    prior = None
    if phase and os.path.exists(phase):
        with open(phase) as f:
            prior = json.load(f)
    kw = dict(hooks.get("rank", {}))
    with process_group(rank, world, init_file, backend=hooks.get("backend", "nccl")) as group:
        device = kw.pop("device", None) or torch.device("cuda", torch.cuda.current_device())
        mx.run_matrix(args, group, worlds=[world], start=start, phase=prior, ranks=Ranks(group, device),
                      device=device, **kw)
