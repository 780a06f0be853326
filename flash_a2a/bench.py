"""``xstage bench flash-a2a``: FlashAttention + Ulysses post-attention All-to-All on every GPU of the node
(one process each), all variants side by side in one process per rank, timed by CUDA-Graph replay.

Columns (per M in SEQ_LENS and heads per rank in HEADS_PER_RANK; d = 128, b = 1, bf16):
  fa_ours (in the fused kernel's tile order, so E_res compares one schedule), fa_ours_plain_order,
  fa_ours_no_overlap, fa_ours_lag_v (FA3/FA4's producer order, K[n+1] before V[n], first GEMM not
  ping-ponged), fa_ours_nonpersistent (one CTA per tile), fa_ours_unpinned (the mainloop before
  pin_softmax / rescale_before_pv became the default), fa_ours_pin_all (all exponentials held ahead of the PV
  wait in the SASS), --variants (any other knobs), fa4 (flash-attn-4's SM90 forward), cudnn (torch SDPA, cuDNN backend);
  a2a_nccl (yunchang: permutes around all_to_all_single), a2a_symm (our device-initiated scatter);
  pre_a2a_nccl / pre_a2a_symm (the pre-attention All-to-All of q, k and v, each way);
  serial_fa4_nccl, serial_ours_nccl; fused (piggyback), fused_cc (completion-coupled), fused_visible.
Sender-side boundary as in the paper (sec. 5.1): fused runs launch the attention kernel alone, back to
back (it advances its own epoch), and remote visibility is settled once after the replays;
``fused_visible`` also waits for every peer's data each call (the remote-visible boundary).
Time per call = graph replay time / calls per graph, median over interleaved rounds (every round replays
every column, in a fresh random order; every timed region starts after a one-element NCCL all-reduce that
aligns the ranks on the device); each trial's time is the max over ranks, then the median over trials (the
paper's statistic, sec. 5.1). Derived: E_res = T_fused - T_FA
and the serial excess T_serial - T_FA, each the median over rounds of the difference within a round
(pairing cancels clock drift between rounds); for kernels of T_FA >= --alternate-min-us both come instead
from pairs of adjacent launches on one stream, each pair aligned, in alternating order
(``alternated_excess``; the round-paired value is kept
as ``fused_E_res_round_paired_us``); hiding ratio H = 1 - E_res / (T_serial - T_FA) (eq. 21),
speedups over each serial, TFLOP/s, and the model's G* and M*_ub from the platform profile. The same
adjacent pairs, for those kernels, give T_FA4 / T_ours (``fa4_over_ours_paired``) and the speedup over
serial FA4 + NCCL (``speedup_fused_over_serial_fa4_nccl_paired``) free of the round-to-round drift.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from flash_a2a.hiding import row_interval, upper_median

SEQ_LENS = (8192, 16384, 32768, 49152, 65536)
HEADS_PER_RANK = (3, 12)
HEAD_DIM = 128


def add_arguments(p) -> None:
    p.add_argument("--out", default="benchmarks/results/h200x2/flash_a2a.json")
    p.add_argument("--seq-lens", type=int, nargs="+", default=list(SEQ_LENS))
    p.add_argument("--heads-per-rank", type=int, nargs="+", default=list(HEADS_PER_RANK))
    p.add_argument("--calls-per-graph", type=int, default=4)
    p.add_argument("--replays", type=int, default=15, help="interleaved rounds")
    p.add_argument("--profile", default="h200x2", help="platform profile for G* and M*_ub")
    p.add_argument("--skip", nargs="*", default=[], help="columns to leave out")
    p.add_argument("--variants", type=json.loads, default={}, metavar="JSON",
                   help='extra columns, as {"name": {mainloop knobs}}: fa_ours_<name> (FA-only, in the fused tile '
                        'order), or fused_<name> where the knobs hold a "mode", e.g. '
                        '\'{"pin48": {"pin_softmax": 48}, "pb31": {"mode": "piggyback", "pin_softmax": 31}}\'; an '
                        'FA-only column with "out": "symmetric" stores into the fused op\'s symmetric buffer')
    p.add_argument("--replot", metavar="JSON", default=None,
                   help="recompute the model columns of a saved result and redraw its figure (no GPU)")
    p.add_argument("--table", metavar="JSON", default=None,
                   help="print a saved result as the README's Markdown table (no GPU)")
    p.add_argument("--pool-hiding", metavar="JSON", nargs="+", default=None,
                   help="H with its 95%% bootstrap interval from the adjacent pairs of saved results, pooled per "
                        "shape over the runs given (rows of the same recorded split/store/relay only; no GPU)")
    p.add_argument("--split", metavar="JSON", default=None,
                   help="print the fused residual of a saved fadiag result split into epilogue code, flag "
                        "protocol and NVLink stores (no GPU)")
    p.add_argument("--no-spans", dest="spans", action="store_false",
                   help="skip the instrumented launches per shape (per-tile store spans of the fused kernel and of "
                        "FA-only in the same tile order)")
    p.add_argument("--alternate-pairs", type=int, default=48,
                   help="adjacent-launch pairs per residual for long kernels (0: off)")
    p.add_argument("--alternate-min-us", type=float, default=500.0,
                   help="FA-only time from which residuals come from adjacent launches")
    p.add_argument("--pair-launch", choices=("graph", "eager"), default="graph",
                   help="how each launch of a pair is made: a one-call CUDA graph's replay (the default: no host "
                        "launch cost in the timed span) or the eager call (before 2026-11-30)")


def _capture(fn, calls, group):
    """A CUDA graph of ``calls`` back-to-back calls of ``fn`` (after one eager warm-up call), or None with
    the reason when capture fails (the column is then timed eagerly)."""
    import torch
    import torch.distributed as dist

    fn()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        return g, "graph"
    except Exception as e:  # noqa: BLE001 - fall back to eager launches, and say so
        torch.cuda.synchronize()
        return None, f"eager ({type(e).__name__})"


def _device_align(group):
    """A one-element NCCL all-reduce on the current stream: what follows it starts on every GPU within a few µs
    of each other (a host barrier alone leaves the launches as far apart as the processes' wake-ups). The
    fused columns need it: their first store to a peer waits for that peer's launch to start, so a head start
    on one rank would count as that rank's residual. In a DiT the pre-attention All-to-All aligns them so."""
    import torch
    import torch.distributed as dist

    token = torch.zeros(1, device="cuda")

    def align():
        dist.all_reduce(token, group=group)

    return align


def _measure(columns: dict, calls: int, replays: int, group) -> dict:
    """µs per call for every column, timed in interleaved rounds (a fresh random order every round, so clock
    or thermal drift hits all variants alike); each round's time is the max over ranks, then the median over
    rounds. Every timed region starts right after a device-side alignment of the ranks (``_device_align``).
    Returns the medians and every column's per-round (rank-max) times."""
    import torch
    import torch.distributed as dist

    import random

    align = _device_align(group)
    names = list(columns)
    times = {n: [] for n in names}
    for rnd in range(replays):
        # A fresh order every round, the same on every rank (the columns hold collectives): a fixed or merely
        # rotated order gives each column a fixed predecessor, and what ran just before (an All-to-All that
        # lets the clocks recover, or a long attention that heats the chip) biases long-M times by a few %.
        order = names[:]
        random.Random(rnd).shuffle(order)
        for name in order:
            fn, graph = columns[name]
            dist.barrier(group=group)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            align()
            a.record()
            if graph is not None:
                graph.replay()
            else:
                for _ in range(calls):
                    fn()
            b.record()
            b.synchronize()
            times[name].append(a.elapsed_time(b) * 1e3 / calls)
    times = dict(zip(names, rank_max([times[n] for n in names], group)))
    return {n: sorted(times[n])[len(times[n]) // 2] for n in names}, times


def alternated_excess(first, second, pairs: int, group) -> dict:
    """Pairs of adjacent launches on one stream, each pair started by a device-side alignment of the ranks
    (``_device_align``) and run in alternating order (first, second; then second, first; ...), so each kernel
    is timed by its neighbouring events while the GPU barely idles (steady clocks), each difference compares
    two launches a few ms apart, neither kernel always runs first, and the ranks cannot drift apart over the
    pairs (a rank that drifted ahead would wait in the fused kernel for its peer, and count that as its
    residual). Each launch's time is the max over ranks; returns the median and the quartiles over ``pairs``
    of (T_second − T_first) in µs — the residual measurement for long kernels, where round-to-round drift
    exceeds it."""
    import torch
    import torch.distributed as dist

    align = _device_align(group)
    first()
    second()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(pairs)]
    for i, ev in enumerate(events):
        align()
        ev[0].record()
        (first if i % 2 == 0 else second)()
        ev[1].record()
        (second if i % 2 == 0 else first)()
        ev[2].record()
    torch.cuda.synchronize()
    spans = [(ev[0].elapsed_time(ev[1]) * 1e3, ev[1].elapsed_time(ev[2]) * 1e3) for ev in events]
    firsts = [a if i % 2 == 0 else b for i, (a, b) in enumerate(spans)]
    seconds = [b if i % 2 == 0 else a for i, (a, b) in enumerate(spans)]
    firsts, seconds = rank_max([firsts, seconds], group)
    return pair_stats(firsts, seconds, first_ran_first=[i % 2 == 0 for i in range(pairs)])


def kernel_knobs(knobs: dict) -> dict:
    """A ``--variants`` knob set without the benchmark's own keys (``"out"``): what the kernel is built with."""
    return {n: x for n, x in knobs.items() if n != "out"}


def variant_output_errors(variants: dict, run_fused, run_fa, ref_fused, ref_fa) -> dict:
    """Max |output − reference| of every ``--variants`` column, so a faster variant that computes something
    else shows. Fused variants (``run_fused(knobs)``: the completed post-A2A output) against ``ref_fused`` (our
    default FA-only + the reference All-to-All), FA-only ones (``run_fa(knobs)``) against ``ref_fa``. The
    controls whose output is not the attention (``self_store``, a ``signal`` other than True, ``relay_wait=False``:
    nothing, the wrong rows or stale rows arrive) are left out; a variant that fails records its error instead of stopping the run."""
    errors = {}
    for name, knobs in variants.items():
        if knobs.get("self_store") or knobs.get("signal", True) is not True or knobs.get("relay_wait") is False:
            continue
        try:
            got, ref = (run_fused(knobs), ref_fused) if "mode" in knobs else (run_fa(knobs), ref_fa)
            errors[name] = float((got.float() - ref.float()).abs().max())
        except Exception as e:  # noqa: BLE001 - one bad variant must not hide the rest of the row
            errors[name] = f"{type(e).__name__}: {e}"[:300]
    return errors


def pair_launchers(fns: dict, how: str, capture) -> tuple[dict, dict]:
    """The launch of each paired column: with ``how="graph"`` the replay of a one-call CUDA graph
    (``capture(fn)`` -> (graph or None, kind)), so a pair's events time the GPU and not the host's launch path
    (FA4's Python launch once took longer than its 188 µs kernel and its pairs measured 334 µs, at ea6408f);
    a column whose capture fails, or every column with ``how="eager"``, is called directly. Returns the
    launchers and how each is launched."""
    launch, kinds = {}, {}
    for name, fn in fns.items():
        graph, kind = capture(fn) if how == "graph" else (None, "eager")
        launch[name], kinds[name] = (graph.replay, "graph") if graph is not None else (fn, kind)
    return launch, kinds


def fused_residual_columns(variants: dict) -> list[str]:
    """The fused columns whose residual over ``fa_ours`` is reported: ``fused`` and every fused variant."""
    return ["fused"] + ["fused_" + name for name, knobs in variants.items() if "mode" in knobs]


def apply_alternated(row: dict, fused_columns: list[str]) -> None:
    """Long kernels: the adjacent-launch residuals in ``row["alternated"]`` replace the round-paired ones
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


def paired_ratio(pair: dict) -> float:
    """T_second / T_first from adjacent alternating launches (``alternated_excess``): the first kernel's
    median plus the median paired difference, over the first's median. For FA4 against ours (T_FA4 / T_ours,
    1 = parity) on long kernels, where clocks drift between rounds by more than the two kernels differ
    (12 heads/48K at d00e7f3: per-round times of one column spread over 7%)."""
    return (pair["first_median_us"] + pair["median_us"]) / pair["first_median_us"]


def pair_stats(firsts: list[float], seconds: list[float], first_ran_first: list[bool] | None = None) -> dict:
    """Quartiles of the per-pair differences second − first (µs), and each kernel's median.

    With ``first_ran_first`` (per pair: whether the first kernel was launched first, ``alternated_excess``'s
    alternating order) also the crossover split: the median difference over the pairs of each launch order, the
    order-balanced difference (their mean: a position effect p, what running second adds, enters the two
    halves as +p and -p and cancels) and p itself, and every pair's difference (µs, launch order marked)."""
    if not firsts or len(firsts) != len(seconds):
        raise ValueError("need one time of each kernel per pair")
    raw = [b - a for a, b in zip(firsts, seconds)]
    diffs = sorted(raw)
    n = len(diffs)
    out = {"q1_us": diffs[n // 4], "median_us": diffs[n // 2], "q3_us": diffs[(3 * n) // 4], "pairs": n,
           "first_median_us": upper_median(firsts), "second_median_us": upper_median(seconds)}
    if first_ran_first is not None:
        if len(first_ran_first) != n:
            raise ValueError("need one launch order per pair")
        ab = [x for x, f in zip(raw, first_ran_first) if f]
        ba = [x for x, f in zip(raw, first_ran_first) if not f]
        if ab and ba:
            m_ab, m_ba = upper_median(ab), upper_median(ba)
            out.update({"median_first_ran_first_us": m_ab, "median_second_ran_first_us": m_ba,
                        "order_balanced_us": (m_ab + m_ba) / 2, "position_effect_us": (m_ab - m_ba) / 2})
        # to the ns: H from these (flash_a2a.hiding) then equals the medians' H (0.1 µs moved it by 0.001)
        out["diffs_us"] = [[round(x, 3), int(f)] for x, f in zip(raw, first_ran_first)]
    return out


def _paired_excess(times: dict, name: str, base: str) -> float | None:
    """Median over rounds of (T_name − T_base) measured in the same round (``times``: each round's max over
    ranks, the same on every rank): a residual of a few µs on a kernel of tens of ms is below the
    round-to-round clock drift, which pairing cancels."""
    if name not in times or base not in times:
        return None
    return pair_stats(times[base], times[name])["median_us"]


def rank_max(trials: list[list[float]], group) -> list[list[float]]:
    """Elementwise max over ranks of per-trial times (every rank passes lists of the same lengths): a trial
    of a multi-rank operation lasts as long as its slowest rank."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(trials, device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _worker(rank, world, init_file, args):
    from cute_kernels.dist import process_group

    with process_group(rank, world, init_file):
        _run(rank, world, args)


def _baselines():
    import torch

    out = {}
    try:
        from flash_attn.cute import flash_attn_func

        def fa4(q, k, v):
            r = flash_attn_func(q, k, v)
            return r[0] if isinstance(r, tuple) else r

        out["fa4"] = fa4
    except Exception as e:  # noqa: BLE001 - the baseline is optional: record why it is missing
        out["fa4_error"] = f"{type(e).__name__}: {e}"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                                 v.transpose(1, 2))
        return o.transpose(1, 2)

    out["cudnn"] = cudnn
    return out


def _run(rank, world, args):
    import torch
    import torch.distributed as dist

    from calibrate.profile import resolve_profile
    from flash_a2a.a2a import SymmetricUlyssesA2A, nccl_post_a2a
    from flash_a2a.api import FUSED_WALK, FusedAttentionA2A, flash_attention, pre_attention_a2a

    torch.set_grad_enabled(False)
    base = _baselines()
    fused = FusedAttentionA2A()
    a2a = SymmetricUlyssesA2A()
    profile = resolve_profile(args.profile)
    rows = []
    for h_loc in args.heads_per_rank:
        for s in args.seq_lens:
            q, k, v = (torch.randn(1, s, h_loc, HEAD_DIM, device="cuda").to(torch.bfloat16) for _ in range(3))
            o_ours = torch.empty_like(q)
            # pre-attention inputs: this rank's (b, S/P, H, d) slices of q, k, v
            xs = [torch.randn(1, s // world, h_loc * world, HEAD_DIM, device="cuda").to(torch.bfloat16)
                  for _ in range(3)]
            # this rank's fused tile walk, the fused kernel's default walk included (FUSED_WALK)
            fused_order = {"tile_order_world": world, "tile_order_rank": rank, **FUSED_WALK}
            # the fused kernel's reference: FA-only in its walk (the same tiles split, where the split tail is
            # taken), then the All-to-All
            ref = flash_attention(q, k, v, out=o_ours, **fused_order).clone()
            cols = {
                "fa_ours": lambda: flash_attention(q, k, v, out=o_ours, **fused_order),
                "fa_ours_plain_order": lambda: flash_attention(q, k, v, out=o_ours),
                "fa_ours_no_overlap": lambda: flash_attention(q, k, v, out=o_ours, overlap=False),
                "fa_ours_lag_v": lambda: flash_attention(q, k, v, out=o_ours, **fused_order,
                                                         lag_v=True, sync_first_block=False),
                "fa_ours_nonpersistent": lambda: flash_attention(q, k, v, out=o_ours, **fused_order,
                                                                 persistent=False),
                "fa_ours_unpinned": lambda: flash_attention(q, k, v, out=o_ours, **fused_order,
                                                            pin_softmax=False, rescale_before_pv=False),
                "fa_ours_pin_all": lambda: flash_attention(q, k, v, out=o_ours, **fused_order,
                                                           pin_softmax=True),
                "cudnn": lambda: base["cudnn"](q, k, v),
                "a2a_nccl": lambda: nccl_post_a2a(o_ours),
                "a2a_symm": lambda: a2a(o_ours),
                "pre_a2a_nccl": lambda: [pre_attention_a2a(x) for x in xs],
                "pre_a2a_symm": lambda: [a2a.pre(x, slot) for slot, x in enumerate(xs)],
                "serial_ours_nccl": lambda: nccl_post_a2a(flash_attention(q, k, v, out=o_ours)),
                "fused": lambda: fused.launch(q, k, v, mode="piggyback", wait=False),
                "fused_cc": lambda: fused.launch(q, k, v, mode="completion_coupled", wait=False),
                "fused_visible": lambda: fused.launch(q, k, v, mode="piggyback", wait=True),
            }
            for name, knobs in args.variants.items():
                if "mode" in knobs:  # a fused column (sender-side, like ``fused``)
                    cols["fused_" + name] = (lambda kn: lambda: fused.launch(q, k, v, wait=False, **kn))(knobs)
                else:  # an FA-only column; "out": "symmetric" stores into the fused op's symmetric buffer
                    out = fused.state(q).out.view(q.shape) if knobs.get("out") == "symmetric" else o_ours
                    cols["fa_ours_" + name] = (lambda kn, out: lambda: flash_attention(
                        q, k, v, out=out, **{**fused_order, **kn}))(kernel_knobs(knobs), out)
            if "fa4" in base:
                cols["fa4"] = lambda: base["fa4"](q, k, v)
                cols["serial_fa4_nccl"] = lambda: nccl_post_a2a(base["fa4"](q, k, v))
            row = {"seq_len": s, "heads_per_rank": h_loc, "world": world, "head_dim": HEAD_DIM, "timing": {}}
            captured = {}
            for name, fn in cols.items():
                if name in args.skip:
                    continue
                try:
                    graph, row["timing"][name] = _capture(fn, args.calls_per_graph, None)
                    captured[name] = (fn, graph)
                except Exception as e:  # noqa: BLE001 - one failing column must not hide the others
                    row[name + "_error"] = f"{type(e).__name__}: {e}"[:300]
            medians, times = _measure(captured, args.calls_per_graph, args.replays, None)
            for name, t in medians.items():
                row[name + "_us"] = t
            if args.alternate_pairs and medians.get("fa_ours", 0.0) >= args.alternate_min_us:
                # Long kernels: residuals from adjacent launches (see alternated_excess).
                pairs = {"fused_cc_minus_fused": ("fused", "fused_cc"),
                         "serial_ours_nccl_minus_fa_plain": ("fa_ours_plain_order", "serial_ours_nccl"),
                         "fa4_minus_fa_ours": ("fa_ours", "fa4"),
                         "serial_fa4_nccl_minus_fused": ("fused", "serial_fa4_nccl")}
                pairs.update({f"{c}_minus_fa_ours": ("fa_ours", c) for c in fused_residual_columns(args.variants)})
                pairs.update({f"fa_ours_{n}_minus_fa_ours": ("fa_ours", f"fa_ours_{n}")  # FA-only variants
                              for n, kn in args.variants.items() if "mode" not in kn})
                pairs = {key: ab for key, ab in pairs.items() if all(c in captured for c in ab)}
                used = sorted({c for ab in pairs.values() for c in ab})  # the same capture order on every rank
                launch, row["pair_launch"] = pair_launchers({c: cols[c] for c in used}, args.pair_launch,
                                                            lambda fn: _capture(fn, 1, None))
                row["alternated"] = {key: alternated_excess(launch[a], launch[b], args.alternate_pairs, None)
                                     for key, (a, b) in pairs.items()}
                del launch
            fused.settle(q)  # remote visibility of the sender-side fused runs, once after all replays
            torch.cuda.synchronize()
            del captured
            fused.check()
            a2a.check()
            # correctness of the timed fused output against our local kernel + the NCCL All-to-All
            got = fused.launch(q, k, v, mode="piggyback", wait=True).clone()
            decided = dict(fused.decided[(1, s, h_loc, HEAD_DIM, q.dtype)])  # the default's, before any variant's
            row["fused_exact_vs_serial"] = bool(torch.equal(got, nccl_post_a2a(ref)))
            if args.variants:  # every variant column's output against the same references
                row["variant_max_abs_diff"] = variant_output_errors(
                    args.variants,
                    lambda kn: fused.launch(q, k, v, wait=True, **kn).clone(),
                    lambda kn: flash_attention(q, k, v, out=torch.empty_like(q), **{**fused_order, **kernel_knobs(kn)}),
                    nccl_post_a2a(ref), ref)
            if args.spans:  # one instrumented launch: per-tile store spans, summarized (flash_a2a.spans)
                from flash_a2a.spans import summarize_ready, summarize_spans

                n_tiles_all = (s // 128) * h_loc
                sms = torch.cuda.get_device_properties(0).multi_processor_count
                grid = min(n_tiles_all, sms)
                sp = torch.zeros(n_tiles_all * 2 + grid, 4, dtype=torch.int64, device="cuda")  # + ready rows
                # The summary comes from the second launch, after a barrier: the first instrumented launch of a
                # process ran while the peer was still compiling it, and measured 70-110 µs bursts and a
                # globaltimer jump that a repeat of the same shape did not show (2ca7a0c, 3 heads/8K).
                # The same for our FA-only kernel in the same tile order, as the control: its "remote" tiles are
                # the ones the fused kernel would send (stored locally here), and its clock estimate shows
                # whether the fused launch ran at a lower SM clock (a power-limited chip pays for NVLink too).
                sp_local = torch.zeros(n_tiles_all * 2, 4, dtype=torch.int64, device="cuda")
                launches = {"spans": lambda: fused.launch(q, k, v, mode="piggyback", wait=True, spans=sp),
                            "spans_fa_only": lambda: flash_attention(q, k, v, out=o_ours, **fused_order,
                                                                     spans=sp_local)}
                align = _device_align(None)
                for _ in range(2):
                    for launch in launches.values():
                        torch.cuda.synchronize()
                        dist.barrier()
                        align()  # as every timed region: a host barrier alone left the peer up to ~90 µs behind
                        launch()
                torch.cuda.synchronize()
                fused.check()
                for key, dump in (("spans", sp), ("spans_fa_only", sp_local)):
                    try:  # rank-local reading: a bad dump is recorded, not fatal
                        row[key] = summarize_spans(dump.cpu().numpy(), world=world, rank=rank,
                                                   n_mb_per_rank=s // world // 128, h_loc=h_loc, batch=1,
                                                   grid=grid, bytes_per_row_half=64 * HEAD_DIM * 2,
                                                   cross_halves=FUSED_WALK["cross_halves"])
                    except ValueError as e:
                        row[key + "_error"] = str(e)
                try:
                    row["spans_ready"] = summarize_ready(sp.cpu().numpy(), n_tiles=n_tiles_all, grid=grid)
                except ValueError as e:
                    row["spans_ready_error"] = str(e)
            if "fa4" in base:
                o4 = base["fa4"](q, k, v)
                row["max_abs_diff_vs_fa4"] = float((o4.float() - ref.float()).abs().max())
            flops = 4.0 * s * s * h_loc * HEAD_DIM
            for name in ("fa_ours", "fa4", "cudnn"):
                if name + "_us" in row:
                    row[name + "_tflops"] = flops / (row[name + "_us"] * 1e-6) / 1e12
            t_fa = row.get("fa_ours_us")
            if t_fa:
                n_tiles = (s // 128) * h_loc
                grid = min(n_tiles, torch.cuda.get_device_properties(0).multi_processor_count)
                row["sigma_us_per_kv_tile"] = t_fa * grid / (n_tiles * (s // 128))
                for f in [c for c in times if c.startswith("fused")]:  # every fused column, variants included
                    row[f + "_E_res_us"] = _paired_excess(times, f, "fa_ours")
                row["fused_cc_minus_fused_us"] = _paired_excess(times, "fused_cc", "fused")
                row["tiles_per_cta"] = n_tiles / grid
                # the fused default's decided walk, epilogue and relay, as its checked launch recorded them
                for key in ("tail_split", "store", "relay"):
                    row["fused_" + key] = decided[key]
                for ser in ("serial_ours_nccl", "serial_fa4_nccl"):
                    if ser + "_us" in row and "fused_us" in row:
                        row["speedup_fused_over_" + ser] = row[ser + "_us"] / row["fused_us"]
                alt = row.get("alternated") or {}
                apply_alternated(row, fused_residual_columns(args.variants))
                if "serial_ours_nccl_us" in row and "fused_us" in row:
                    exposed = (alt["serial_ours_nccl_minus_fa_plain"]["median_us"]
                               if "serial_ours_nccl_minus_fa_plain" in alt else
                               _paired_excess(times, "serial_ours_nccl", "fa_ours_plain_order"))
                    row["serial_ours_nccl_excess_us"] = exposed
                    e_res = row.get("fused_E_res_us")
                    row["hiding_ratio"] = (1.0 - e_res / exposed
                                           if e_res is not None and exposed and exposed > 0 else None)
                    interval = row_interval(row)  # from the pairs' own differences, where they were alternated
                    if interval is not None:  # -inf (no positive serial excess resampled) as null: strict JSON
                        row["hiding_ratio_ci95"] = [x if math.isfinite(x) else None for x in interval]
                row.update(model_predictions(row, profile,
                                             torch.cuda.get_device_properties(0).multi_processor_count))
            row["round_times"] = {n: [round(x, 3) for x in ts] for n, ts in times.items()}  # µs, max over ranks
            rows.append(row)
            if rank == 0:
                _write(rows, base, args)  # after every row: a run cut short still leaves its rows
                print(summary_line(row), flush=True)


def _write(rows, base, args) -> None:
    from cute_kernels.runtime import provenance

    argv = sys.argv[1:]
    if argv[:2] == ["bench", "flash-a2a"]:  # run through ``xstage`` / ``calibrate.cli``: already named
        argv = argv[2:]
    out = {"provenance": provenance(" ".join(["xstage bench flash-a2a", *argv])),
           "profile": args.profile, "fa4_error": base.get("fa4_error"), "rows": rows,
           "slope_test": slope_test(rows),
           "method": "CUDA-Graph replay of calls_per_graph back-to-back calls; all columns replayed in "
                     "interleaved rounds, a fresh random order each round, every timed region started after a "
                     "one-element NCCL all-reduce (device-side rank alignment); each trial the max over ranks, "
                     "then the median over trials; E_res and the serial excess are medians of within-round "
                     "differences, or for "
                     "T_FA >= alternate_min_us of alternate_pairs aligned pairs of adjacent launches in "
                     "alternating order (each launch a one-call graph's replay unless pair_launch says "
                     "otherwise); sender-side boundary for fused/fused_cc (settled once after the "
                     "replays)",
           "calls_per_graph": args.calls_per_graph, "replays": args.replays, "skipped": list(args.skip),
           "alternate_pairs": args.alternate_pairs, "alternate_min_us": args.alternate_min_us,
           "pair_launch": args.pair_launch}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    plot(out, os.path.splitext(args.out)[0] + ".png")


def model_predictions(row: dict, profile, sm_count: int) -> dict:
    """The two prior predictions of section 4.3 for one row, from the platform profile and the row's
    measured Q-loop time per KV tile (sigma), without refitting: the X-Stage drain residual
    E_drain = N_t [dt(M) - G_QK]+ (eqs. 18-19; zero for M >= M*_ub) and the completion-coupled
    counterfactual E_cc = N_t [V/R + T_lat - T_cover]+ (eq. 17), for the worst case of aligned output waves
    (V = K x 32 KiB, K = grid). N_t: output-tile waves per CTA; G_QK = T_cover: one QK GEMM of a KV step,
    taken as half of sigma (QK and PV are equal GEMMs)."""
    from calibrate import model

    s, h_loc = row["seq_len"], row["heads_per_rank"]
    sigma = row["sigma_us_per_kv_tile"]
    n_tiles = (s // 128) * h_loc
    grid = min(n_tiles, sm_count)
    n_waves = n_tiles / grid
    v = grid * 128 * HEAD_DIM * 2
    r = profile.drain_rate
    t0 = float(profile.t_iss0(grid, v))
    g_qk = sigma / 2
    g_qloop = float(model.qloop_gap_lower_bound(s, sigma, 128))
    stall = float(model.piggyback_stall(g_qloop, v, t0, r))
    out = {"model_G_star_us": float(model.recovery_gap(v, t0, r)),
           "model_M_star_ub": float(model.m_star_ub(v, t0, r, sigma, 128)),
           "model_E_drain_us": float(model.drain_residual(n_waves, stall, g_qk))}
    t_lat = (profile.fit_quality or {}).get("completion_latency_us")
    if t_lat is not None:
        dt_cc = float(model.completion_coupled_stall(v, r, t_lat, g_qk))
        out.update(model_T_lat_us=float(t_lat),
                   model_E_cc_us=float(model.completion_coupled_exposure(n_waves, dt_cc)))
    return out


def replot(path: str, sm_count: int = 132) -> str:
    """Recompute the model columns of a saved result (its profile, no GPU) and redraw its figure."""
    from calibrate.profile import resolve_profile

    with open(path) as f:
        result = json.load(f)
    profile = resolve_profile(result.get("profile", "h200x2"))
    for row in result["rows"]:
        if row.get("sigma_us_per_kv_tile"):
            row.update(model_predictions(row, profile, sm_count))
    result["slope_test"] = slope_test(result["rows"])
    import datetime

    from cute_kernels.runtime import git_commit

    # the measurement's provenance stays; the recomputation of the model columns is recorded beside it
    result["replotted"] = {"git_commit": git_commit(), "date": datetime.date.today().isoformat(),
                           "command": f"xstage bench flash-a2a --replot {path}"}
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    png = os.path.splitext(path)[0] + ".png"
    plot(result, png)
    return png


def summary_line(row: dict) -> str:
    """One console line per shape: every timed column (µs) and the exactness check."""
    cols = " ".join(f"{k[:-3]}={v:.1f}" for k, v in row.items()
                    if k.endswith("_us") and isinstance(v, (int, float)) and not k.endswith("E_res_us"))
    line = (f"H/P={row['heads_per_rank']:2d} M={row['seq_len']:6d} {cols} "
            f"E_res={row.get('fused_E_res_us')} H={row.get('hiding_ratio')} exact={row.get('fused_exact_vs_serial')}")
    if "variant_max_abs_diff" in row:
        line += f" variant_max_abs_diff={row['variant_max_abs_diff']}"
    return line


def _fit_line(xs, ys):
    """Least-squares slope and intercept, with the slope's standard error (None below 3 points)."""
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    icpt = my - slope * mx
    resid = sum((y - icpt - slope * x) ** 2 for x, y in zip(xs, ys))
    return {"slope": slope, "intercept": icpt, "slope_stderr": math.sqrt(resid / (n - 2) / sxx)}


def slope_test(rows) -> dict:
    """Section 5.3's slope test, per head load: regress the completion-coupled extra cost (T_cc − T_fused,
    paired within rounds) and the piggybacked residual E_res on the tiles each CTA issues (the number of
    per-tile completion waits). Completion coupling pays a round trip per tile, so its slope is positive;
    piggybacking pays none, so E_res does not grow with it."""
    out = {}
    for h_loc in sorted({r["heads_per_rank"] for r in rows}):
        sel = [r for r in rows if r["heads_per_rank"] == h_loc and r.get("tiles_per_cta")
               and r.get("fused_cc_minus_fused_us") is not None and r.get("fused_E_res_us") is not None]
        xs = [r["tiles_per_cta"] for r in sel]
        out[str(h_loc)] = {"tiles_per_cta": xs,
                           "cc_minus_fused_us": _fit_line(xs, [r["fused_cc_minus_fused_us"] for r in sel]),
                           "fused_E_res_us": _fit_line(xs, [r["fused_E_res_us"] for r in sel])}
    return out


def plot(result: dict, path: str) -> None:
    """Figure 11 style: E_res / T_FA vs M for piggybacked and completion-coupled fusion."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, h_loc in zip(axes, sorted({r["heads_per_rank"] for r in result["rows"]})):
        rows = sorted((r for r in result["rows"] if r["heads_per_rank"] == h_loc), key=lambda r: r["seq_len"])
        m = [r["seq_len"] for r in rows]
        for key, label, style in (("fused", "piggyback (X-Stage)", "o-"),
                                  ("fused_cc", "completion-coupled", "s-"),
                                  ("fused_visible", "piggyback, remote-visible", "^:")):
            ys = [r[key + "_E_res_us"] / r["fa_ours_us"] * 100
                  if r.get(key + "_E_res_us") is not None and r.get("fa_ours_us") else math.nan for r in rows]
            ax.plot(m, ys, style, label=label)
        for key, label, color in (("model_E_drain_us", "X-Stage prediction, drain residual (eqs. 18-19)", "tab:blue"),
                                  ("model_E_cc_us", "completion-coupled prediction (eq. 17)", "tab:orange")):
            ys = [r[key] / r["fa_ours_us"] * 100 if r.get(key) is not None and r.get("fa_ours_us") else math.nan
                  for r in rows]
            if any(not math.isnan(y) for y in ys):
                ax.plot(m, ys, "--", lw=1.2, color=color, alpha=0.8, label=label)
        serial = [(r.get("serial_ours_nccl_excess_us") or math.nan) / r["fa_ours_us"] * 100 for r in rows]
        ax.plot(m, serial, "k--", lw=0.8, label="serial (ours + NCCL A2A) − FA")
        mstar = [r.get("model_M_star_ub") for r in rows if r.get("model_M_star_ub")]
        if mstar:
            ax.axvline(mstar[0], color="gray", ls=":", label=f"model M*_ub = {mstar[0]:.0f}")
        ax.axhline(0, color="gray", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length M (tokens)")
        ax.set_ylabel("E_res / T_FA (%)")
        ax.set_title(f"{h_loc} heads per rank, P = {rows[0]['world']}, d = 128")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("FlashAttention–A2A residual beyond FA alone (sender-side), with the two prior model predictions")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _offline(verb: str, path: str, produce) -> int:
    """A subcommand that reads a saved result (no GPU): print what ``produce()`` returns, or exit 2 naming the
    file when it cannot be read."""
    try:
        print(produce())
    except (OSError, ValueError, KeyError) as e:
        print(f"xstage: error: cannot {verb} {path}: {e}", file=sys.stderr)
        return 2
    return 0


def run(args) -> int:
    if args.split:
        from flash_a2a.report import residual_split_text

        def split():
            with open(args.split) as f:
                return residual_split_text(json.load(f))

        return _offline("read", args.split, split)
    if args.pool_hiding:
        from flash_a2a.hiding import pool_text

        def pooled():
            results = []
            for path in args.pool_hiding:
                with open(path) as f:
                    results.append(json.load(f))
            return pool_text(results)

        return _offline("read", " ".join(args.pool_hiding), pooled)
    if args.table:
        from flash_a2a.report import markdown_table_file

        return _offline("read", args.table, lambda: markdown_table_file(args.table))
    if args.replot:
        return _offline("replot", args.replot, lambda: f"wrote {replot(args.replot)}")
    import torch

    from cute_kernels.dist import spawn_ranks

    bad = [m for m in args.seq_lens if m <= 0 or m % 128]
    if bad or any(h <= 0 for h in args.heads_per_rank):
        print(f"xstage: error: sequence lengths must be positive multiples of 128 (got {bad or args.seq_lens}) "
              "and heads per rank positive", file=sys.stderr)
        return 2
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("xstage: error: bench flash-a2a needs 2 or more GPUs with peer access", file=sys.stderr)
        return 2
    world = torch.cuda.device_count()
    if any(m % (128 * world) for m in args.seq_lens):
        print(f"xstage: error: sequence lengths must be multiples of {128 * world} on {world} GPUs", file=sys.stderr)
        return 2
    spawn_ranks(_worker, world, args)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="xstage bench flash-a2a", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
