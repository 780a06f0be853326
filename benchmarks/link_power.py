"""Board power and SM clock while every GPU of the group trickles remote stores to its peers, against the same
stores into its own HBM: what does keeping NVLink busy cost in watts, apart from the bytes?

At the power cap the fused kernel needs FA-only's cycles but runs 15-75 MHz slower
(``flash_a2a_variants/fused_clocks_d8a07f6.json`` at 43e424d), about 2-4% of the board's 700 W, while its peer traffic
is only ~3-5 GB/s per direction. If the links' active state draws a fixed power whenever stores trickle
through them, a slow trickle costs nearly what a saturated link does, and no kernel-side store path (st,
TMA, bulk: ``fused_clocks_stores_*.json``) can avoid it; if the cost is per byte, a trickle is nearly free.

Loads (``LOADS``) are runs of ``BurstGapKernel`` (calibrate): ``producers`` CTAs each write
``burst_bytes`` with 128-bit stores, then spin (``%globaltimer``) or run an FMA loop for ``gap``, for
``bursts`` bursts per launch, every burst into the same ring slot (so the local stores stay in L2, as
the peer's stores arriving there do); each launch is replayed back to back from a one-launch CUDA Graph for
``--seconds`` per phase on every rank at once, the loads taking turns in a rotated order, while
``nvidia-smi`` samples each rank's own GPU. Each load runs twice, into the peers' symmetric buffers
(``peer``) and into local memory (``local``, the same kernel and bytes, no NVLink); ``idle`` is the host
sleeping. Per load and rank: the median power and clock over its phases, and the peer - local difference
phase by phase (``summarize_loads``). Usage (device):
python3 -m benchmarks.link_power --out $OUT/link_power.json (from the repository root)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.fa_clocks import annotate_phases, close_sampler, one_launch_graph, open_sampler, timed_batch
from benchmarks.fused_clocks import phase_order, run_ranks_and_gather, smi_target

# name -> (producers, burst bytes per producer, gap kind, gap (ns for spin, iterations for fma), bursts/launch)
LOADS = {
    # 8 SMs, 4 KiB each every ~20 us: ~1.6 GB/s, below the fused kernel's ~3.4 GB/s at 12 heads/48K
    "trickle": (8, 4096, "spin", 20_000, 2000),
    # the same bursts 1 ms apart: the links idle between them (~33 MB/s)
    "sparse": (8, 4096, "spin", 1_000_000, 40),
    # every SM, 2 KiB each, then 8000 FMA iterations (~117 us a burst on the H200s): the SMs busy as in a
    # mainloop, ~2.3 GB/s of stores
    "fma_trickle": (132, 2048, "fma", 8000, 1000),
    # every SM, 64 KiB each with no gap: the links saturated (~390 GB/s each way)
    "saturate": (132, 65536, "spin", 0, 400),
}
# the "sparse" bursts further apart (~0.4 s per launch): where the links' low-power state (entered after an
# idle threshold, ``nvidia-smi nvlink -gLowPwrInfo``) starts to save power between bursts
for _ms, _bursts in ((3, 130), (10, 40), (30, 13), (100, 4), (400, 1)):
    LOADS[f"gap_{_ms}ms"] = (8, 4096, "spin", _ms * 1_000_000, _bursts)
DEFAULT_LOADS = ("trickle", "sparse", "fma_trickle", "saturate")


def summarize_loads(rows: list[dict]) -> dict:
    """Per load (``trickle``, ...): per target (``peer``, ``local``) the medians over (rank, phase) rows of
    ``power_w`` and ``sm_mhz``; and ``peer_minus_local``: the median over (rank, phase) of that rank's peer
    row minus its local row of the same phase (the same stretch of the run, so drift cancels). ``idle``:
    the medians of the idle rows."""
    sampled = [r for r in rows if r.get("samples")]
    out: dict = {}
    idle = [r for r in sampled if r["load"] == "idle"]
    if idle:
        out["idle"] = {k: statistics.median(r[k] for r in idle) for k in ("power_w", "sm_mhz")}
    for load in sorted({r["load"] for r in sampled} - {"idle"}):
        per: dict = {}
        for target in ("peer", "local"):
            sel = [r for r in sampled if r["load"] == load and r["target"] == target]
            if sel:
                per[target] = {k: statistics.median(r[k] for r in sel) for k in ("power_w", "sm_mhz")}
                per[target]["gb_per_s"] = statistics.median(r["gb_per_s"] for r in sel)
        by_key = {(r["rank"], r["phase"], r["target"]): r for r in sampled if r["load"] == load}
        diffs = [(by_key[(rk, ph, "peer")], by_key[(rk, ph, "local")]) for (rk, ph, t) in by_key
                 if t == "peer" and (rk, ph, "local") in by_key]
        if diffs:
            per["peer_minus_local"] = {k: statistics.median(p[k] - q[k] for p, q in diffs)
                                       for k in ("power_w", "sm_mhz")}
            per["peer_minus_local"]["pairs"] = len(diffs)
        out[load] = per
    return out


def awake_fraction(gap_ms: float, threshold_ms: float) -> float:
    """The fraction of time the links spend awake when short bursts come every ``gap_ms``: each burst wakes
    them and they fall back to low power ``threshold_ms`` after it (``nvidia-smi nvlink -gLowPwrInfo``)."""
    return min(1.0, threshold_ms / gap_ms) if gap_ms > 0 else 1.0


def burst_gap_ms(load: tuple) -> float | None:
    """A spin load's time from burst to burst (ms): its gap (the bursts' own few µs left out); None for FMA gaps,
    whose length is not set in time."""
    _, _, kind, gap, _ = load
    return gap / 1e6 if kind == "spin" else None


def low_power_threshold_ms(results: list[dict], default: float = 50.0) -> float:
    """The NVLink low-power threshold that ``nvidia-smi nvlink -gLowPwrInfo`` reported in a result (the largest
    over links, ms), else ``default``."""
    import re

    texts = [res.get("nvlink", {}).get("nvlink_low_power", "") for res in results]
    found = [float(us) / 1e3 for text in texts for us in re.findall(r"Low Power Threshold: (\d+) us", text)]
    return max(found) if found else default


def plot(results: list[dict], path: str, threshold_ms: float | None = None) -> None:
    """Peer - local power per load at equal rates (left), and against the time from burst to burst for the spin
    loads, with ``awake_fraction`` times the power the links draw awake (the median over loads that come more
    often than ``threshold_ms``; by default the threshold the results' nvidia-smi reported) (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if threshold_ms is None:
        threshold_ms = low_power_threshold_ms(results)
    points = {}  # load -> (peer - local W, load tuple); a load in several results: the later one's
    for res in results:
        for load, per in res["summary"].items():
            # only where both targets moved the same bytes per second: a saturated link is ~11x slower than
            # local HBM, so its difference is no link cost (the JSON keeps both)
            same_rate = "peer" in per and "local" in per and \
                abs(per["peer"]["gb_per_s"] / per["local"]["gb_per_s"] - 1.0) < 0.1
            if "peer_minus_local" in per and same_rate:
                points[load] = (per["peer_minus_local"]["power_w"], tuple(res["loads"][load]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    names = sorted(points, key=lambda n: -points[n][0])
    axes[0].bar(range(len(names)), [points[n][0] for n in names], color="tab:blue")
    axes[0].set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    axes[0].set_title("board power, peer stores minus the same stores local (W)")
    sweep = sorted((burst_gap_ms(points[n][1]), points[n][0]) for n in names
                   if burst_gap_ms(points[n][1]) not in (None, 0.0))
    awake = [w for g, w in sweep if g < threshold_ms]
    if sweep and awake:
        p_awake = statistics.median(awake)
        xs = [g for g, _ in sweep]
        axes[1].plot(xs, [w for _, w in sweep], "o", color="tab:blue", label="measured")
        grid = [xs[0] * (xs[-1] / xs[0]) ** (i / 100) for i in range(101)]
        axes[1].plot(grid, [p_awake * awake_fraction(g, threshold_ms) for g in grid], "-", color="tab:gray",
                     label=f"{p_awake:.1f} W x min(1, {threshold_ms:g} ms / gap)")
        axes[1].set_xscale("log")
        axes[1].legend(fontsize=8)
    axes[1].set_xlabel("time from burst to burst (ms)")
    axes[1].set_title("NVLink awake: peer minus local (W)")
    for ax in axes:
        ax.grid(alpha=0.3)
    prov = results[0]["provenance"]
    fig.suptitle(f"NVLink power state, {results[0].get('world', 2)} GPUs ({prov.get('device', '')}, "
                 f"{prov.get('git_commit', '')})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _nvlink_info() -> dict:
    """Read-only: nvidia-smi's NVLink options and link status (what the driver reports of link power states)."""
    info = {}
    for key, argv in (("nvlink_help", ["nvidia-smi", "nvlink", "-h"]),
                      ("nvlink_status", ["nvidia-smi", "nvlink", "-s", "-i", "0"]),
                      ("nvlink_low_power", ["nvidia-smi", "nvlink", "-gLowPwrInfo", "-i", "0"])):
        try:
            info[key] = subprocess.run(argv, capture_output=True, text=True, timeout=20).stdout[-6000:]
        except (OSError, subprocess.TimeoutExpired) as e:
            info[key] = f"unavailable: {e}"
    return info


def _run(rank: int, world: int, group, args) -> list[dict]:
    import torch
    import torch.distributed as dist

    from calibrate.bench import BurstBench, peer_order
    from calibrate.burst_kernel import RECORD_FIELDS
    from cute_kernels.runtime import check_error_word

    bench = BurstBench(group, buffer_bytes=args.buffer_mib << 20)
    region = bench.buffer_bytes
    peers = peer_order(rank, world)
    targets = {
        "peer": (bench._ptrs(*(bench.buf_hdl.buffer_ptrs[j] + rank * region for j in peers)),
                 bench._ptrs(*(bench.flag_hdl.buffer_ptrs[j] + 4 * (1 + rank) for j in peers))),
        "local": (bench._ptrs(bench.local.data_ptr()), bench._ptrs(bench.local_flag.data_ptr())),
    }
    smi, log = open_sampler(smi_target(rank), args.sample_ms)
    graphs, launch_bytes = {}, {}
    rows = []
    try:
        for load in args.loads:
            producers, burst_bytes, gap_kind, gap, bursts = LOADS[load]
            producers = min(producers, bench.sm_count)
            vec_per_thread = burst_bytes // (16 * bench.threads)
            if vec_per_thread * 16 * bench.threads * producers > region:
                raise ValueError(f"{load}: {producers} x {burst_bytes} B exceeds the {region} B region")
            kernel = bench.kernel(False, gap_kind)
            records = torch.zeros(producers * (bursts + 1), len(RECORD_FIELDS), dtype=torch.int64, device="cuda")
            for name, (dst, done) in targets.items():
                def launch(dst=dst, done=done):
                    bench.sync.zero_()  # the kernel's grid barrier counter, per launch
                    # one ring slot: every burst rewrites the same region (power, not delivery, is measured here)
                    kernel(dst, done, records, bench.sync, bench.errors, bench.sink, producers, vec_per_thread,
                           bursts, 1, gap, bench.tag, bench.timeout_ns)
                graphs[(load, name)] = one_launch_graph(launch, warmup=2)
                check_error_word(bench.errors, f"{load}/{name} warm-up")  # the capture launched nothing
                launch_bytes[(load, name)] = producers * vec_per_thread * 16 * bench.threads * bursts
        dist.barrier(group=group)
        names = ["idle"] + list(graphs)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for phase in range(args.phases):
            for key in phase_order(names, phase):
                dist.barrier(group=group)
                t0 = time.time()
                row = {"rank": rank, "phase": phase, "t0": t0}
                if key == "idle":
                    time.sleep(args.seconds)
                    row.update(load="idle", target="none", us_per_launch=0.0)
                else:
                    times = []
                    while time.time() - t0 < args.seconds:
                        times.append(timed_batch(graphs[key], 1, start, stop))
                    us = statistics.median(times[1:] or times)
                    row.update(load=key[0], target=key[1], us_per_launch=us, launches=len(times),
                               gb_per_s=launch_bytes[key] / us / 1e3)
                    check_error_word(bench.errors, f"{key}")
                row["t1"] = time.time()
                rows.append(row)
                if rank == 0:
                    print(f"phase {phase} {key}: {row['us_per_launch']:.1f} us", flush=True)
    finally:
        samples = close_sampler(smi, log)
    annotate_phases(rows, samples, args.settle)
    return rows


def _worker(rank: int, world: int, init_file: str, args) -> None:
    from cute_kernels.runtime import provenance

    every = run_ranks_and_gather(rank, world, init_file, _run, args)
    if every is not None:
        result = {"provenance": provenance(" ".join(sys.argv)), "args": vars(args), "world": world,
                  "loads": {k: LOADS[k] for k in args.loads}, "nvlink": _nvlink_info(),
                  "summary": summarize_loads(every), "phases": every}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result["summary"], indent=1), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="result JSON")
    p.add_argument("--plot", nargs="+", metavar="JSON", help="draw saved results (one figure) into --figure; no GPU")
    p.add_argument("--figure", help="the --plot figure's path (PNG)")
    p.add_argument("--loads", nargs="+", default=list(DEFAULT_LOADS), choices=list(LOADS))
    p.add_argument("--phases", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--settle", type=float, default=1.2, help="seconds dropped at each phase's start (nvidia-smi's "
                                                             "power.draw is an average over the last second)")
    p.add_argument("--sample-ms", type=int, default=20)
    p.add_argument("--buffer-mib", type=int, default=16)
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args(argv)
    if args.plot:
        if not args.figure:
            p.error("--plot needs --figure")
        results = []
        for path in args.plot:
            with open(path) as f:
                results.append(json.load(f))
        plot(results, args.figure)
        return
    if not args.out:
        p.error("--out is required (or --plot JSON... --figure PNG)")
    from cute_kernels.dist import spawn_ranks

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    spawn_ranks(_worker, args.world, args)


if __name__ == "__main__":
    main()
