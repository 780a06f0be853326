"""How the multi-rank benchmarks time a kernel: CUDA-graph replays in interleaved rounds, each trial the max
over ranks, and pairs of adjacent launches in alternating order, with the pair statistics (medians of
within-pair differences) that cancel the clock drift between rounds.

Every timed region starts right after ``device_align``: a one-element NCCL all-reduce on the current stream,
so what follows starts on every GPU within a few µs (a host barrier alone leaves the launches as far apart as
the processes' wake-ups).
"""
from __future__ import annotations

import random

from benchmarks.hiding import upper_median


def capture_graph(fn, calls: int, group):
    """(graph, how): a CUDA graph of ``calls`` back-to-back calls of ``fn`` (after one eager warm-up call) and
    "graph", or (None, "eager (<error>)") when capture fails (the column is then timed eagerly)."""
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


def device_align(group):
    """A one-element NCCL all-reduce on the current stream (returned as a callable): what follows it starts on
    every GPU within a few µs of each other. The fused columns need it: their first store to a peer waits for
    that peer's launch to start, so a head start on one rank would count as that rank's residual. In a DiT
    the pre-attention All-to-All aligns them so."""
    import torch
    import torch.distributed as dist

    token = torch.zeros(1, device="cuda")

    def align():
        dist.all_reduce(token, group=group)

    return align


def rank_max(trials: list[list[float]], group) -> list[list[float]]:
    """Elementwise max over ranks of per-trial times (every rank passes lists of the same lengths): a trial
    of a multi-rank operation lasts as long as its slowest rank."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(trials, device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def round_order(names: list, rnd: int, order: str = "shuffle", start: int = 0) -> list:
    """The columns' order in round ``rnd``: "shuffle", a fresh random order (seeded by the round, the same on
    every rank); "rotate", ``names`` rotated left by start + rnd (with two columns: alternating, each first in
    every other round; the paper's rotated order, section 5.1)."""
    if order == "rotate":
        k = (start + rnd) % len(names) if names else 0
        return names[k:] + names[:k]
    if order != "shuffle":
        raise ValueError(f"order must be 'shuffle' or 'rotate', got {order!r}")
    out = names[:]
    random.Random(rnd).shuffle(out)
    return out


def measure_rounds(columns: dict, calls: int, replays: int, group, order: str = "shuffle",
                   start: int = 0) -> tuple[dict, dict]:
    """µs per call for every column ({name: (fn, graph or None)}), timed in interleaved rounds (by default a
    fresh random order every round, so clock or thermal drift hits all variants alike; ``round_order``); each
    round's time is the max over ranks, then the median over rounds. Returns the medians and every column's
    per-round (rank-max) times."""
    import torch
    import torch.distributed as dist

    align = device_align(group)
    names = list(columns)
    times = {n: [] for n in names}
    for rnd in range(replays):
        # A fresh order every round, the same on every rank (the columns hold collectives): a fixed or merely
        # rotated order gives each of several columns a fixed predecessor, and what ran just before (an
        # All-to-All that lets the clocks recover, or a long attention that heats the chip) biases long-M
        # times by a few %. With two columns, rotation is the balanced alternation.
        for name in round_order(names, rnd, order, start):
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
    """Pairs of adjacent launches on one stream, each pair started by ``device_align`` and run in alternating
    order (first, second; then second, first; ...), so each kernel is timed by its neighbouring events while
    the GPU barely idles (steady clocks), each difference compares two launches a few ms apart, neither kernel
    always runs first, and the ranks cannot drift apart over the pairs (a rank that drifted ahead would wait
    in the fused kernel for its peer, and count that as its residual). Each launch's time is the max over
    ranks; returns ``pair_stats`` of (T_second − T_first) in µs over ``pairs`` — the residual measurement for
    long kernels, where round-to-round drift exceeds it."""
    import torch
    import torch.distributed as dist

    align = device_align(group)
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


def pair_launchers(fns: dict, capture) -> tuple[dict, dict]:
    """The launch of each paired column: the replay of a one-call CUDA graph (``capture(fn)`` -> (graph or
    None, kind)), so a pair's events time the GPU and not the host's launch path (FA4's Python launch once
    took longer than its 188 µs kernel and its eager pairs measured 334 µs, at ea6408f); a column whose
    capture fails is called directly. Returns the launchers and how each is launched."""
    launch, kinds = {}, {}
    for name, fn in fns.items():
        graph, kind = capture(fn)
        launch[name], kinds[name] = (graph.replay, "graph") if graph is not None else (fn, kind)
    return launch, kinds


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
        # to the ns: H from these (benchmarks.hiding) then equals the medians' H (0.1 µs moved it by 0.001)
        out["diffs_us"] = [[round(x, 3), int(f)] for x, f in zip(raw, first_ran_first)]
    return out


def paired_excess(times: dict, name: str, base: str) -> float | None:
    """Median over rounds of (T_name − T_base) measured in the same round (``times``: each round's max over
    ranks, the same on every rank): a residual of a few µs on a kernel of tens of ms is below the
    round-to-round clock drift, which pairing cancels. None where either column was not timed."""
    if name not in times or base not in times:
        return None
    return pair_stats(times[base], times[name])["median_us"]


def paired_ratio(pair: dict) -> float:
    """T_second / T_first from adjacent alternating launches (``alternated_excess``): the first kernel's
    median plus the median paired difference, over the first's median. For FA4 against ours (T_FA4 / T_ours,
    1 = parity) on long kernels, where clocks drift between rounds by more than the two kernels differ
    (12 heads/48K at d00e7f3: per-round times of one column spread over 7%)."""
    return (pair["first_median_us"] + pair["median_us"]) / pair["first_median_us"]
