"""``xstage bench flash-a2a``: FlashAttention + Ulysses post-attention All-to-All on every GPU of the node
(one process each), all columns side by side in one process per rank, timed by CUDA-Graph replay.

Columns (per M in SEQ_LENS and heads per rank in HEADS_PER_RANK; d = 128, b = 1, bf16):
  fa_ours (our FA-only in the fused kernel's tile order, so E_res compares one schedule), fa_ours_plain_order,
  fa4 (flash-attn-4's SM90 forward, where installed), cudnn (torch SDPA, cuDNN backend);
  a2a_nccl (yunchang: permutes around all_to_all_single), a2a_symm (our device-initiated scatter);
  pre_a2a_nccl / pre_a2a_symm (the pre-attention All-to-All of q, k and v, each way);
  serial_ours_nccl, serial_fa4_nccl; fused (piggyback), fused_cc (completion-coupled), fused_visible;
  --variants: fa_ours_<name> / fused_<name> (benchmarks.variant_sets), e.g. the self-store control
  '{"self": {"mode": "piggyback", "self_store": true}}' (every tile into the sender's own buffer: no NVLink).
On a node of one GPU only the attention columns run (the others need a peer: ``peer_columns``).
Sender-side boundary as in the paper (sec. 5.1): fused runs launch the attention kernel alone, back to
back (it advances its own epoch), and remote visibility is settled once after the replays;
``fused_visible`` also waits for every peer's data each call (the remote-visible boundary).
Time per call = graph replay time / calls per graph, median over interleaved rounds (benchmarks.timing: every
round replays every column, in a fresh random order; every timed region starts after a one-element NCCL
all-reduce that aligns the ranks on the device); each trial's time is the max over ranks, then the median
over trials (the paper's statistic, sec. 5.1). Derived: E_res = T_fused - T_FA and the serial excess
T_serial - T_FA, each the median over --pairs pairs of adjacent launches on one stream, each pair aligned, in
alternating order (``alternated_excess``: free of the clock drift between rounds), the median over rounds of
the difference within a round kept beside it (``fused_E_res_round_paired_us``; the value itself with
--pairs 0); hiding ratio H = 1 - E_res / (T_serial - T_FA) (eq. 21) with its bootstrap interval
(benchmarks.hiding), speedups over each serial, TFLOP/s, the model's G* and M*_ub from the platform profile and
the slope test (benchmarks.report). The same adjacent pairs give T_FA4 / T_ours (``fa4_over_ours_paired``) and
the speedup over serial FA4 + NCCL (``speedup_fused_over_serial_fa4_nccl_paired``), free of the round-to-round
drift.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from benchmarks.hiding import row_interval
from benchmarks.report import model_predictions, plot, slope_test
from benchmarks.timing import (alternated_excess, capture_graph, device_align, measure_rounds, pair_launchers,
                               paired_excess, paired_ratio)
from benchmarks.variant_sets import parse_variants, variant_column
from calibrate.cli import UsageError

SEQ_LENS = (8192, 16384, 32768, 49152, 65536)
HEADS_PER_RANK = (3, 12)
HEAD_DIM = 128
PEER_COLUMNS = ("a2a_nccl", "a2a_symm", "pre_a2a_nccl", "pre_a2a_symm", "serial_ours_nccl", "serial_fa4_nccl",
                "fused", "fused_cc", "fused_visible")
BUILT_IN = ("fa_ours", "fa_ours_plain_order", "fa4", "cudnn", *PEER_COLUMNS)


def _variants_argument(text: str) -> dict:
    try:
        return parse_variants(text, BUILT_IN)
    except (ValueError, OSError) as e:  # json.JSONDecodeError is a ValueError
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p) -> None:
    p.add_argument("--out", default="benchmarks/results/h200x2/flash_a2a.json",
                   help="result JSON, rewritten after every row (its figure beside it, .png)")
    p.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS))
    p.add_argument("--heads-per-rank", type=int, nargs="+", default=list(HEADS_PER_RANK))
    p.add_argument("--calls-per-graph", type=int, default=4)
    p.add_argument("--replays", type=int, default=15, help="interleaved rounds")
    p.add_argument("--profile", default="h200x2", help="platform profile for G* and M*_ub")
    p.add_argument("--skip", nargs="*", default=[], metavar="COLUMN",
                   help=f"columns to leave out: {', '.join(BUILT_IN)} or a variant's")
    p.add_argument("--variants", type=_variants_argument, default={}, metavar="JSON",
                   help='extra columns, as a JSON object or the path of a .json file holding one, {"name": '
                        '{knobs}}: fused_<name> where the knobs hold a "mode" (knobs: mode, self_store, '
                        'tail_split, store, relay), else fa_ours_<name> (FA-only in the fused tile order; knob: '
                        'tail_split), e.g. \'{"nosplit": {"tail_split": false}, "self": {"mode": "piggyback", '
                        '"self_store": true}}\'')
    p.add_argument("--replot", metavar="JSON", default=None,
                   help="recompute the model columns and the slope test of a saved result and redraw its figure, "
                        "written beside it as <name>.replot.json and <name>.replot.png (no GPU)")
    p.add_argument("--table", metavar="JSON", default=None,
                   help="print a saved result as the README's Markdown table (no GPU)")
    p.add_argument("--pool-hiding", metavar="JSON", nargs="+", default=None,
                   help="H with its 95%% bootstrap interval from the adjacent pairs of saved results, pooled per "
                        "shape over the runs given (rows of the same recorded split/store/relay only; no GPU)")
    p.add_argument("--no-spans", dest="spans", action="store_false",
                   help="skip the instrumented launches per shape (per-tile store spans of the fused kernel and of "
                        "FA-only in the same tile order)")
    p.add_argument("--pairs", dest="alternate_pairs", type=int, default=48,
                   help="adjacent-launch pairs per residual and ratio, at every shape (0: from the rounds only)")


def variant_output_errors(variants: dict, run_fused, run_fa, ref_fused, ref_fa) -> dict:
    """Max |output − reference| of every ``--variants`` column, so a faster variant that computes something
    else shows. Fused variants (``run_fused(knobs)``: the completed post-A2A output) against ``ref_fused`` (our
    default FA-only + the reference All-to-All), FA-only ones (``run_fa(knobs)``) against ``ref_fa``. The
    self-store control is left out (its output is not the All-to-All's: every tile stays with its sender); a
    variant that fails records its error instead of stopping the run."""
    errors = {}
    for name, knobs in variants.items():
        if knobs.get("self_store"):
            continue
        try:
            got, ref = (run_fused(knobs), ref_fused) if "mode" in knobs else (run_fa(knobs), ref_fa)
            errors[name] = float((got.float() - ref.float()).abs().max())
        except Exception as e:  # noqa: BLE001 - one bad variant must not hide the rest of the row
            errors[name] = f"{type(e).__name__}: {e}"[:300]
    return errors


def fused_residual_columns(variants: dict) -> list[str]:
    """The fused columns whose residual over ``fa_ours`` is reported: ``fused`` and every fused variant."""
    return ["fused"] + [variant_column(name, knobs) for name, knobs in variants.items() if "mode" in knobs]


def apply_alternated(row: dict, fused_columns: list[str]) -> None:
    """The adjacent-launch residuals in ``row["alternated"]`` replace the round-paired ones
    (kept as ``<column>_E_res_round_paired_us``), for ``fused`` and each fused variant, and cc − fused."""
    alt = row.get("alternated") or {}
    for c in fused_columns:
        key = f"{c}_minus_fa_ours"
        if key in alt:
            row[c + "_E_res_round_paired_us"] = row.get(c + "_E_res_us")
            row[c + "_E_res_us"] = alt[key]["median_us"]
    if "fused_cc_minus_fused" in alt:
        row["fused_cc_minus_fused_us"] = alt["fused_cc_minus_fused"]["median_us"]
    if "fa4_minus_fa_ours" in alt:
        row["fa4_over_ours_paired"] = paired_ratio(alt["fa4_minus_fa_ours"])
    if "serial_fa4_nccl_minus_fused" in alt:  # the speedup over serial FA4 + NCCL, free of round drift
        row["speedup_fused_over_serial_fa4_nccl_paired"] = paired_ratio(alt["serial_fa4_nccl_minus_fused"])
    if "fa4_minus_fa_ours" in alt and "first_median_us" in alt.get("fused_minus_fa_ours", {}):
        # The FA4 target (speedup over serial FA4 + NCCL >= 0.98 x T_serial / T_FA4) is T_fused <= T_FA4 / 0.98:
        # T_serial cancels. Both pairs are against our FA-only in the same phase of the run, so their ratio is
        # free of the drift between rounds and between pair phases (the pairs with the serial NCCL column ran
        # 3-10% slower than the rounds on H200, so their speedup cannot be held against a round-based target).
        row["fused_over_fa4_paired"] = (paired_ratio(alt["fused_minus_fa_ours"])
                                        / paired_ratio(alt["fa4_minus_fa_ours"]))


def decided_fields(config) -> dict:
    """The fused launch's shape-resolved choices (``FusedAttentionA2A.decided[...]``: a
    flash_a2a.config.AttentionConfig, or the dict older kernels kept) as the row's ``fused_tail_split``,
    ``fused_store``, ``fused_relay`` and, where the config has it, ``fused_split_k``. A split tail is recorded
    as "launch" (the split in a second launch, the one that stays), as results before the config wrote it, so
    ``--pool-hiding`` pools old and new rows of one decision; values JSON cannot hold are written as text."""
    def field(key):
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)

    out = {"fused_" + key: field(key) for key in ("tail_split", "store", "relay")}
    if out["fused_tail_split"] is True:
        out["fused_tail_split"] = "launch"
    if field("split_k") is not None:
        out["fused_split_k"] = field("split_k")
    return out


def peer_columns(variants: dict) -> list[str]:
    """The columns that need a peer (the All-to-All, serial and fused ones, fused variants included): left out
    when the node has one GPU, where the bench times the attention columns alone."""
    return list(PEER_COLUMNS) + [variant_column(n, kn) for n, kn in variants.items() if "mode" in kn]


def alternated_pairs(variants: dict, captured) -> dict:
    """{pair name: (first, second)}: the adjacent-launch pairs the row's residuals and ratios come from
    (``alternated_excess``), those whose columns were both captured."""
    pairs = {"fused_cc_minus_fused": ("fused", "fused_cc"),
             "serial_ours_nccl_minus_fa_plain": ("fa_ours_plain_order", "serial_ours_nccl"),
             "fa4_minus_fa_ours": ("fa_ours", "fa4"),
             "serial_fa4_nccl_minus_fused": ("fused", "serial_fa4_nccl")}
    pairs.update({f"{c}_minus_fa_ours": ("fa_ours", c) for c in fused_residual_columns(variants)})
    pairs.update({f"{c}_minus_fa_ours": ("fa_ours", c)  # FA-only variants
                  for c in (variant_column(n, kn) for n, kn in variants.items() if "mode" not in kn)})
    return {key: ab for key, ab in pairs.items() if all(c in captured for c in ab)}


def derive(row: dict, times: dict, variants: dict, n_tiles: int, grid: int) -> None:
    """The row's derived columns from its timed ones (``<column>_us``, per-round ``times`` and, for long
    kernels, ``row["alternated"]``): TFLOP/s, sigma (FA-only's time per KV tile and CTA), every fused column's
    E_res, cc − fused, the speedups over each serial composition, and H with its interval."""
    s, h_loc, d = row["seq_len"], row["heads_per_rank"], row["head_dim"]
    flops = 4.0 * s * s * h_loc * d
    for name in ("fa_ours", "fa4", "cudnn"):
        if name + "_us" in row:
            row[name + "_tflops"] = flops / (row[name + "_us"] * 1e-6) / 1e12
    if not row.get("fa_ours_us"):
        return
    row["sigma_us_per_kv_tile"] = row["fa_ours_us"] * grid / (n_tiles * (s // 128))
    row["tiles_per_cta"] = n_tiles / grid
    for f in [c for c in times if c.startswith("fused")]:  # every fused column, variants included
        row[f + "_E_res_us"] = paired_excess(times, f, "fa_ours")
    if "fused" in times:
        row["fused_cc_minus_fused_us"] = paired_excess(times, "fused_cc", "fused")
    for ser in ("serial_ours_nccl", "serial_fa4_nccl"):
        if ser + "_us" in row and "fused_us" in row:
            row["speedup_fused_over_" + ser] = row[ser + "_us"] / row["fused_us"]
    alt = row.get("alternated") or {}
    apply_alternated(row, fused_residual_columns(variants))
    if "serial_ours_nccl_us" in row and "fused_us" in row:
        exposed = (alt["serial_ours_nccl_minus_fa_plain"]["median_us"] if "serial_ours_nccl_minus_fa_plain" in alt
                   else paired_excess(times, "serial_ours_nccl", "fa_ours_plain_order"))
        row["serial_ours_nccl_excess_us"] = exposed
        e_res = row.get("fused_E_res_us")
        row["hiding_ratio"] = 1.0 - e_res / exposed if e_res is not None and exposed and exposed > 0 else None
        interval = row_interval(row)  # from the pairs' own differences, where they were alternated
        if interval is not None:  # -inf (no positive serial excess resampled) as null: strict JSON
            row["hiding_ratio_ci95"] = [x if math.isfinite(x) else None for x in interval]


def _worker(rank, world, init_file, args):
    from cute_kernels.dist import process_group

    with process_group(rank, world, init_file) as group:
        _run(rank, world, group, args)


def _columns(q, k, v, o, xs, world, rank, group, fused, a2a, variants, fa4) -> dict:
    """Every column's call for one shape: {name: fn}. ``fused``/``a2a`` None (one GPU): the attention columns
    only; ``fa4`` None where flash-attn-4 is missing."""
    from benchmarks.baselines import cudnn_forward
    from flash_a2a import flash_attention, nccl_post_a2a, pre_attention_a2a

    order = {"tile_order_world": world, "tile_order_rank": rank}  # the fused kernel's tile order, stored locally
    cols = {"fa_ours": lambda: flash_attention(q, k, v, out=o, **order),
            "fa_ours_plain_order": lambda: flash_attention(q, k, v, out=o),
            "cudnn": lambda: cudnn_forward(q, k, v)}
    if fa4 is not None:
        cols["fa4"] = lambda: fa4(q, k, v)
    for name, knobs in variants.items():
        if "mode" not in knobs:  # an FA-only column in the fused tile order
            cols[variant_column(name, knobs)] = (lambda kn: lambda: flash_attention(q, k, v, out=o, **order,
                                                                                    **kn))(knobs)
    if fused is None:
        return cols
    cols.update({
        "a2a_nccl": lambda: nccl_post_a2a(o, group),
        "a2a_symm": lambda: a2a(o),
        "pre_a2a_nccl": lambda: [pre_attention_a2a(x, group) for x in xs],
        "pre_a2a_symm": lambda: [a2a.pre(x, slot) for slot, x in enumerate(xs)],
        "serial_ours_nccl": lambda: nccl_post_a2a(flash_attention(q, k, v, out=o), group),
        "fused": lambda: fused.launch(q, k, v, mode="piggyback", wait=False),
        "fused_cc": lambda: fused.launch(q, k, v, mode="completion_coupled", wait=False),
        "fused_visible": lambda: fused.launch(q, k, v, mode="piggyback", wait=True),
    })
    for name, knobs in variants.items():
        if "mode" in knobs:  # a fused column (sender-side, like ``fused``)
            cols[variant_column(name, knobs)] = (lambda kn: lambda: fused.launch(q, k, v, wait=False, **kn))(knobs)
    if fa4 is not None:
        cols["serial_fa4_nccl"] = lambda: nccl_post_a2a(fa4(q, k, v), group)
    return cols


def _spans(q, k, v, o, world, rank, group, fused, grid) -> dict:
    """One instrumented launch of the fused kernel (where there is one) and of FA-only in its tile order,
    summarized (``benchmarks.spans``): the row's spans, spans_fa_only and spans_ready, or the reason a dump
    could not be read (``<key>_error``)."""
    import torch
    import torch.distributed as dist

    from benchmarks.spans import summarize_ready, summarize_spans
    from flash_a2a import flash_attention
    from flash_a2a.spans import dump_rows

    s, h_loc, d = q.shape[1], q.shape[2], q.shape[3]
    n_tiles = (s // 128) * h_loc
    # The summary comes from the second launch, after a barrier: the first instrumented launch of a process ran
    # while the peer was still compiling it, and measured 70-110 µs bursts and a globaltimer jump that a repeat
    # of the same shape did not show (2ca7a0c, 3 heads/8K). FA-only in the same tile order is the control: its
    # "remote" tiles are the ones the fused kernel would send (stored locally here), and its clock estimate
    # shows whether the fused launch ran at a lower SM clock (a power-limited chip pays for NVLink too).
    dumps = {"spans_fa_only": torch.zeros(dump_rows(n_tiles), 4, dtype=torch.int64, device="cuda")}
    launches = {"spans_fa_only": lambda: flash_attention(q, k, v, out=o, tile_order_world=world,
                                                         tile_order_rank=rank, spans=dumps["spans_fa_only"])}
    if fused is not None:  # its dump adds one ready row per CTA
        dumps["spans"] = torch.zeros(dump_rows(n_tiles, grid), 4, dtype=torch.int64, device="cuda")
        launches["spans"] = lambda: fused.launch(q, k, v, mode="piggyback", wait=True, spans=dumps["spans"])
    align = device_align(group)
    for _ in range(2):
        for key in sorted(launches):  # the same order on every rank
            torch.cuda.synchronize()
            dist.barrier(group=group)
            align()  # as every timed region: a host barrier alone left the peer up to ~90 µs behind
            launches[key]()
    torch.cuda.synchronize()
    if fused is not None:
        fused.check()
    out = {}
    for key, dump in dumps.items():
        try:  # rank-local reading: a bad dump is recorded, not fatal
            out[key] = summarize_spans(dump.cpu().numpy(), world=world, rank=rank, n_mb_per_rank=s // world // 128,
                                       h_loc=h_loc, batch=1, grid=grid, bytes_per_row_half=64 * d * 2)
        except ValueError as e:
            out[key + "_error"] = str(e)
    if "spans" in dumps:
        try:
            out["spans_ready"] = summarize_ready(dumps["spans"].cpu().numpy(), n_tiles=n_tiles, grid=grid)
        except ValueError as e:
            out["spans_ready_error"] = str(e)
    return out


def _run(rank, world, group, args):
    import torch

    from benchmarks.baselines import fa4_forward, fa4_unavailable
    from calibrate.profile import resolve_profile
    from flash_a2a import FusedAttentionA2A, SymmetricUlyssesA2A, flash_attention, nccl_post_a2a

    torch.set_grad_enabled(False)
    fa4_error = fa4_unavailable()
    fa4 = fa4_forward if fa4_error is None else None
    peers = world > 1
    fused = FusedAttentionA2A(group) if peers else None
    a2a = SymmetricUlyssesA2A(group) if peers else None
    variants = args.variants if peers else {n: kn for n, kn in args.variants.items() if "mode" not in kn}
    profile = resolve_profile(args.profile)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for h_loc in args.heads_per_rank:
        for s in args.seq_lens:
            q, k, v = (torch.randn(1, s, h_loc, HEAD_DIM, device="cuda").to(torch.bfloat16) for _ in range(3))
            o = torch.empty_like(q)
            # pre-attention inputs: this rank's (b, S/P, H, d) slices of q, k, v
            xs = [torch.randn(1, s // world, h_loc * world, HEAD_DIM, device="cuda").to(torch.bfloat16)
                  for _ in range(3)]
            # the fused kernel's reference: FA-only in its walk (the same tiles split, where the split tail is
            # taken), then the All-to-All
            ref = flash_attention(q, k, v, out=o, tile_order_world=world, tile_order_rank=rank).clone()
            cols = _columns(q, k, v, o, xs, world, rank, group, fused, a2a, variants, fa4)
            row = {"seq_len": s, "heads_per_rank": h_loc, "world": world, "head_dim": HEAD_DIM, "timing": {}}
            captured = {}
            for name, fn in cols.items():
                if name in args.skip:
                    continue
                try:
                    graph, row["timing"][name] = capture_graph(fn, args.calls_per_graph, group)
                    captured[name] = (fn, graph)
                except Exception as e:  # noqa: BLE001 - one failing column must not hide the others
                    row[name + "_error"] = f"{type(e).__name__}: {e}"[:300]
            medians, times = measure_rounds(captured, args.calls_per_graph, args.replays, group)
            for name, t in medians.items():
                row[name + "_us"] = t
            if args.alternate_pairs:  # residuals and ratios from adjacent launches (see alternated_excess)
                pairs = alternated_pairs(variants, captured)
                used = sorted({c for ab in pairs.values() for c in ab})  # the same capture order on every rank
                launch, row["pair_launch"] = pair_launchers({c: cols[c] for c in used},
                                                            lambda fn: capture_graph(fn, 1, group))
                row["alternated"] = {key: alternated_excess(launch[a], launch[b], args.alternate_pairs, group)
                                     for key, (a, b) in pairs.items()}
                del launch
            del captured
            if peers:
                fused.settle(q)  # remote visibility of the sender-side fused runs, once after all replays
                torch.cuda.synchronize()
                fused.check()
                a2a.check()
                # correctness of the timed fused output against our local kernel + the NCCL All-to-All
                got = fused.launch(q, k, v, mode="piggyback", wait=True).clone()
                # the default's tail split, store and relay as its launch resolved them, before any variant's
                row.update(decided_fields(fused.decided[(1, s, h_loc, HEAD_DIM, q.dtype)]))
                row["fused_exact_vs_serial"] = bool(torch.equal(got, nccl_post_a2a(ref, group)))
            if variants:  # every variant column's output against the same references
                row["variant_max_abs_diff"] = variant_output_errors(
                    variants, lambda kn: fused.launch(q, k, v, wait=True, **kn).clone(),
                    lambda kn: flash_attention(q, k, v, out=torch.empty_like(q), tile_order_world=world,
                                               tile_order_rank=rank, **kn),
                    nccl_post_a2a(ref, group) if peers else None, ref)
            n_tiles = (s // 128) * h_loc
            grid = min(n_tiles, sms)
            if args.spans:
                row.update(_spans(q, k, v, o, world, rank, group, fused, grid))
            if fa4 is not None:
                row["max_abs_diff_vs_fa4"] = float((fa4(q, k, v).float() - ref.float()).abs().max())
            derive(row, times, variants, n_tiles, grid)
            if row.get("sigma_us_per_kv_tile"):
                row.update(model_predictions(row, profile, sms))
            row["round_times"] = {n: [round(x, 3) for x in ts] for n, ts in times.items()}  # µs, max over ranks
            rows.append(row)
            if rank == 0:
                _write(rows, fa4_error, args)  # after every row: a run cut short still leaves its rows
                print(summary_line(row), flush=True)


def _write(rows, fa4_error, args) -> None:
    from cute_kernels.runtime import provenance

    argv = sys.argv[1:]
    if argv[:2] == ["bench", "flash-a2a"]:  # run through ``xstage``: already named
        argv = argv[2:]
    out = {"provenance": provenance(" ".join(["xstage bench flash-a2a", *argv])),
           "profile": args.profile, "fa4_error": fa4_error, "rows": rows,
           "slope_test": slope_test(rows),
           "method": "CUDA-Graph replay of calls_per_graph back-to-back calls; all columns replayed in "
                     "interleaved rounds, a fresh random order each round, every timed region started after a "
                     "one-element NCCL all-reduce (device-side rank alignment); each trial the max over ranks, "
                     "then the median over trials; E_res and the serial excess are medians of the differences "
                     "of alternate_pairs aligned pairs of adjacent launches in alternating order (each launch a "
                     "one-call graph's replay; alternate_pairs = 0: of within-round differences); sender-side "
                     "boundary for fused/fused_cc (settled once after the replays)",
           "calls_per_graph": args.calls_per_graph, "replays": args.replays, "skipped": list(args.skip),
           "variants": args.variants, "alternate_pairs": args.alternate_pairs, "pair_launch": "graph"}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    plot(out, os.path.splitext(args.out)[0] + ".png")


def replot(path: str, sm_count: int = 132) -> tuple[str, str]:
    """Recompute the model columns and the slope test of a saved result (its profile, no GPU) and redraw its
    figure. Both are written beside ``path`` under new names, <name>.replot.json and <name>.replot.png: the
    measured result (a tracked file) is never overwritten. Returns their paths."""
    import datetime

    from calibrate.profile import resolve_profile
    from cute_kernels.runtime import git_commit

    with open(path) as f:
        result = json.load(f)
    profile = resolve_profile(result.get("profile", "h200x2"))
    for row in result["rows"]:
        if row.get("sigma_us_per_kv_tile"):
            row.update(model_predictions(row, profile, sm_count))
    result["slope_test"] = slope_test(result["rows"])
    # the measurement's provenance stays; the recomputation of the model columns is recorded beside it
    result["replotted"] = {"from": os.path.basename(path), "git_commit": git_commit(),
                           "date": datetime.date.today().isoformat(),
                           "command": f"xstage bench flash-a2a --replot {path}"}
    stem = os.path.splitext(path)[0] + ".replot"
    out_json, png = stem + ".json", stem + ".png"
    with open(out_json, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, png)
    return out_json, png


def summary_line(row: dict) -> str:
    """One console line per shape: every timed column (µs) and the exactness check."""
    cols = " ".join(f"{k[:-3]}={v:.1f}" for k, v in row.items()
                    if k.endswith("_us") and isinstance(v, (int, float)) and not k.endswith("E_res_us"))
    line = (f"H/P={row['heads_per_rank']:2d} M={row['seq_len']:6d} {cols} "
            f"E_res={row.get('fused_E_res_us')} H={row.get('hiding_ratio')} exact={row.get('fused_exact_vs_serial')}")
    if "variant_max_abs_diff" in row:
        line += f" variant_max_abs_diff={row['variant_max_abs_diff']}"
    return line


def _offline(verb: str, path: str, produce) -> int:
    """A subcommand that reads a saved result (no GPU): print what ``produce()`` returns; a file that cannot be
    read is a usage error naming it."""
    try:
        text = produce()
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"cannot {verb} {path}: {e}") from None
    print(text)
    return 0


def check_columns(args) -> None:
    """UsageError for a --skip name that is no column of this run (a typo would time every column)."""
    columns = set(BUILT_IN) | {variant_column(n, kn) for n, kn in args.variants.items()}
    unknown = sorted(set(args.skip) - columns)
    if unknown:
        raise UsageError(f"--skip: no column {', '.join(unknown)} (columns: {', '.join(sorted(columns))})")


def run(args) -> int:
    if args.pool_hiding:
        from benchmarks.hiding import pool_text

        def pooled():
            results = []
            for path in args.pool_hiding:
                with open(path) as f:
                    results.append(json.load(f))
            return pool_text(results)

        return _offline("read", " ".join(args.pool_hiding), pooled)
    if args.table:
        from benchmarks.report import markdown_table_file

        return _offline("read", args.table, lambda: markdown_table_file(args.table))
    if args.replot:
        return _offline("replot", args.replot, lambda: "wrote " + " and ".join(replot(args.replot)))
    bad = [m for m in args.seq_lens if m <= 0 or m % 128]
    if bad or any(h <= 0 for h in args.heads_per_rank):
        raise UsageError(f"sequence lengths must be positive multiples of 128 (got {bad or args.seq_lens}) "
                         "and heads per rank positive")
    check_columns(args)
    import torch

    from cute_kernels.dist import spawn_ranks

    if not torch.cuda.is_available():
        raise UsageError("bench flash-a2a needs a GPU (2 or more with peer access for the All-to-All columns)")
    world = torch.cuda.device_count()
    if any(m % (128 * world) for m in args.seq_lens):
        raise UsageError(f"sequence lengths must be multiples of {128 * world} on {world} GPUs")
    if world == 1:  # the attention columns alone
        dropped = [c for c in peer_columns(args.variants) if c not in args.skip]
        print(f"one GPU: the columns that need a peer are left out ({', '.join(dropped)})", flush=True)
        args.skip = list(args.skip) + dropped
    spawn_ranks(_worker, world, args)
    return 0


def main(argv=None) -> int:
    """``python -m benchmarks.flash_a2a_bench`` (the same as ``xstage bench flash-a2a``)."""
    from benchmarks.entry import module_main

    return module_main("xstage bench flash-a2a", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
