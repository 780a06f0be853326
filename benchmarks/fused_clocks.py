"""SM clock and board power while the fused kernel and our FA-only run back to back on every GPU of the
group: at long shapes, is the fused kernel's residual over FA-only more cycles (its own work), or the same
cycles at a lower clock (the power its NVLink stores draw under the board's power cap)?

Two (or more) ranks. Per shape, each kernel is captured in a one-launch CUDA Graph and every rank replays the
same kernel for the same number of launches per phase (the fused kernel's peers wait on each other), the
kernels taking turns over ``--phases`` phases in a rotated order, while ``nvidia-smi -lms`` samples each
rank's own GPU. Per phase and rank: the median time per launch (CUDA events around batches of replays)
and the median of the samples inside it (its first ``--settle`` seconds dropped); cycles per launch are the
time times that median SM clock. Columns: FA-only in the fused walk (``fa_ours``, as in the benchmark), and
FA-only whose every launch then stores 16 bytes into each peer (``fa_ours_awake``: NVLink kept out of its
low-power state, as in a model whose every step uses it) or the same bytes into local memory
(``fa_ours_tiny``, its control), the
fused default (sender-side, ``wait=False``) and as the API returns it (``fused_visible``: the receiver's wait
for every peer's data included), its self-store control (the same kernel storing every tile into its own
buffer: no NVLink), the serial compositions (our FA-only, then the NCCL All-to-All as yunchang does it, or our
symmetric-memory scatter), and
flash-attn-4 alone and in its serial composition where installed.
Usage (device, from the repository root): python3 -m benchmarks.fused_clocks --out $OUT/fused_clocks.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from benchmarks.fa_clocks import (annotate_phases, close_sampler, one_launch_graph, open_sampler, replay_seconds,
                                  smi_ok, timed_batch)
from benchmarks.variant_sets import parse_variants, variant_column

KEYS = ("us_per_launch", "sm_mhz", "power_w", "temp_c", "mcycles", "mj_per_launch")


def phase_order(names: list[str], phase: int) -> list[str]:
    """The kernels' order in ``phase``: rotated by one each phase, so every kernel follows every other."""
    k = phase % len(names)
    return names[k:] + names[:k]


def summarize_kernels(rows: list[dict], base: str = "fa_ours") -> dict:
    """Per shape and kernel: ``us_per_launch``, the median over phases of the slowest rank's time (as the
    benchmark takes each trial's max over ranks: a step is done when its last rank is; the fused kernel and
    the serial All-to-All hold the ranks together anyway, FA-only does not), and the medians over (rank,
    phase) rows of the sampled ``KEYS``. For every kernel but ``base``, its differences from ``base``, phase
    by phase (the same stretch of the run, so slow drift cancels): the time as the median of the per-phase
    rank-max differences; clock, power and cycles as medians of the same rank's differences, over both
    ranks and (``slow_rank``) on the rank whose ``base`` was slower in that phase, where a kernel that holds
    the ranks together has no peer to wait for, so no waiting hides in its cycles."""
    out: dict = {}
    for shape in sorted({r["shape"] for r in rows}):
        timed = [r for r in rows if r["shape"] == shape and "us_per_launch" in r]
        mine = [r for r in timed if r.get("samples")]
        slowest: dict = {}  # (kernel, phase) -> the slowest rank's time, from every timed row
        for r in timed:
            key = (r["kernel"], r["phase"])
            slowest[key] = max(slowest.get(key, 0.0), r["us_per_launch"])
        per: dict = {}
        for name in sorted({r["kernel"] for r in mine}):
            sel = [r for r in mine if r["kernel"] == name]
            per[name] = {key: statistics.median(r[key] for r in sel) for key in KEYS}
            per[name]["us_per_launch"] = statistics.median(t for (n, _), t in slowest.items() if n == name)
            per[name]["phases"] = len({r["phase"] for r in sel})
        ref = {(r["rank"], r["phase"]): r for r in mine if r["kernel"] == base}
        slow_rank = {}  # phase -> the rank whose base was slower then
        for (rank, phase), r in ref.items():
            if phase not in slow_rank or r["us_per_launch"] > ref[(slow_rank[phase], phase)]["us_per_launch"]:
                slow_rank[phase] = rank
        for name in per:
            if name == base:
                continue
            diffs = [(r, ref[(r["rank"], r["phase"])]) for r in mine
                     if r["kernel"] == name and (r["rank"], r["phase"]) in ref]
            phases = sorted({p for (n, p) in slowest if n == name} & {p for (n, p) in slowest if n == base})
            if diffs and phases:
                d = {key: statistics.median(a[key] - b[key] for a, b in diffs)
                     for key in ("mcycles", "sm_mhz", "power_w")}
                d["us_per_launch"] = statistics.median(slowest[(name, p)] - slowest[(base, p)] for p in phases)
                d["pairs"], d["phases"] = len(diffs), len(phases)
                slow = [(a, b) for a, b in diffs if slow_rank.get(a["phase"]) == a["rank"]]
                if slow:
                    d["slow_rank"] = {key: statistics.median(a[key] - b[key] for a, b in slow)
                                      for key in ("mcycles", "sm_mhz", "power_w")}
                    d["slow_rank"]["phases"] = len(slow)
                per[name]["minus_" + base] = d
        out[shape] = per
    return out


AWAKE = "fa_ours_awake"
SERIAL = ("serial_ours_nccl", "serial_ours_symm", "serial_fa4_nccl")


def summaries(rows: list[dict]) -> dict:
    """``summary`` (differences from FA-only), ``summary_awake`` (from FA-only with NVLink kept awake, where
    the run has that column) and ``hiding`` over both."""
    out = {"summary": summarize_kernels(rows)}
    if any(r["kernel"] == AWAKE for r in rows):
        out["summary_awake"] = summarize_kernels(rows, base=AWAKE)
    out["hiding"] = hiding(out)
    return out


def hiding(sums: dict) -> dict:
    """Per shape and (fused column, serial column): H = 1 - E / X, E the fused column's time over the base and X
    the serial composition's, both phase-matched medians of the slowest rank (``summarize_kernels``), for
    the base FA-only (``fa_ours``: its links fall asleep 50 ms into a phase of it) and FA-only whose launches
    keep the links awake (``fa_ours_awake``, as in a model whose every step uses NVLink). The self-store
    control is no fused column here."""
    out: dict = {}
    for key, base in (("summary", "fa_ours"), ("summary_awake", AWAKE)):
        for shape, per in sums.get(key, {}).items():
            for col in per:
                if not col.startswith("fused") or col == "fused_self":
                    continue
                e = per[col].get("minus_" + base)
                for ser in SERIAL:
                    x = per.get(ser, {}).get("minus_" + base)
                    if e and x and x["us_per_launch"] > 0:
                        out.setdefault(shape, {}).setdefault(f"{col}/{ser}", {})[base] = \
                            1.0 - e["us_per_launch"] / x["us_per_launch"]
    return out


BUILT_IN = ("fa_ours", "fa_ours_awake", "fa_ours_tiny", "fused", "fused_visible", "fused_self", "serial_ours_nccl",
            "serial_ours_symm", "fa4", "serial_fa4_nccl")


COLUMN_STYLE = {  # column -> (label, colour); the plot's order
    "fa_ours_awake": ("FA-only, NVLink kept awake", "tab:olive"),
    "fa_ours_tiny": ("FA-only, the same store local", "tab:green"),
    "fused": ("fused (sender-side)", "tab:blue"), "fused_visible": ("fused (output complete)", "tab:blue"),
    "fused_self": ("fused, self-store (no NVLink)", "tab:cyan"),
    "serial_ours_nccl": ("ours + NCCL A2A", "tab:orange"), "serial_ours_symm": ("ours + symm. A2A", "tab:red"),
    "fa4": ("FA4 alone", "tab:gray"), "serial_fa4_nccl": ("FA4 + NCCL A2A", "tab:brown")}


def plot(result: dict, path: str) -> None:
    """Per shape: every column's time over FA-only (%, phase-matched medians of the slowest rank's times) and
    its SM clock against FA-only's on the slower GPU (MHz), side by side: where the bars of the two panels
    match, the time is clock, not cycles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    shapes = list(summary)
    cols = [c for c in COLUMN_STYLE if any(c in summary[s] for s in shapes)]
    cols += sorted({c for s in shapes for c in summary[s] if c != "fa_ours" and c not in cols})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / max(len(cols), 1)
    for i, col in enumerate(cols):
        label, colour = COLUMN_STYLE.get(col, (col, None))
        hatch = "//" if col == "fused_visible" else None
        xs, pct, mhz = [], [], []
        for j, shape in enumerate(shapes):
            d = summary[shape].get(col, {}).get("minus_fa_ours")
            if d:
                xs.append(j + (i - (len(cols) - 1) / 2) * width)
                pct.append(100.0 * d["us_per_launch"] / summary[shape]["fa_ours"]["us_per_launch"])
                mhz.append(d.get("slow_rank", d)["sm_mhz"])  # on the slower GPU, where no wait hides
        axes[0].bar(xs, pct, width, label=label, color=colour, hatch=hatch)
        axes[1].bar(xs, mhz, width, label=label, color=colour, hatch=hatch)
    names = [f"{s.split('x')[2]} heads/{int(s.split('x')[1]) // 1024}K" for s in shapes]
    for ax, title in ((axes[0], "time over FA-only (%)"), (axes[1], "SM clock against FA-only's, slower GPU (MHz)")):
        ax.set_xticks(range(len(shapes)), names)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Back to back at the power cap, {result.get('world', 2)} GPUs "
                 f"({result['provenance'].get('device', '')}, {result['provenance'].get('git_commit', '')})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def smi_target(rank: int) -> str:
    """This rank's GPU for nvidia-smi: by UUID (nvidia-smi's index need not be CUDA's), else by index where
    nvidia-smi does not answer to the UUID."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(rank), "uuid", None)
    target = f"GPU-{uuid}" if uuid else str(rank)
    return target if smi_ok("name", target) else str(rank)


def _run(rank: int, world: int, group, args) -> list[dict]:
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from benchmarks.baselines import fa4_forward, fa4_unavailable
    from flash_a2a import FusedAttentionA2A, SymmetricUlyssesA2A, flash_attention, nccl_post_a2a

    torch.set_grad_enabled(False)
    fa4 = None if args.no_fa4 or fa4_unavailable() else fa4_forward
    fused = FusedAttentionA2A(group)
    a2a = SymmetricUlyssesA2A(group)
    # Keep-alive words: one 16-byte store into every peer per launch keeps NVLink out of its low-power state
    # (entered after 50 ms idle on the H200s; link_power.py: +29.5 W per GPU while awake), as any Ulysses step
    # does; the same store into local memory is its control.
    keep = symm_mem.empty(4, dtype=torch.int32, device="cuda")
    keep_hdl = symm_mem.rendezvous(keep, group)
    keep_peers = [keep_hdl.get_buffer(j, (4,), torch.int32) for j in range(world) if j != rank]
    keep_local = torch.zeros(max(1, world - 1), 4, dtype=torch.int32, device="cuda").unbind(0)
    smi, log = open_sampler(smi_target(rank), args.sample_ms)
    token = torch.zeros(1, device="cuda")
    rows = []
    try:
        for spec in args.shapes:
            b, s, h = (int(x) for x in spec.split("x"))
            q, k, v = (torch.randn(b, s, h, 128, device="cuda").to(torch.bfloat16) for _ in range(3))
            o = torch.empty_like(q)
            order = {"tile_order_world": world, "tile_order_rank": rank}  # the fused kernel's tile order

            def fa_only():
                flash_attention(q, k, v, out=o, **order)

            def awake():  # FA-only, then 16 bytes into every peer: NVLink stays awake
                fa_only()
                for word in keep_peers:
                    word.fill_(1)

            def tiny():  # its control: the same stores into local memory
                fa_only()
                for word in keep_local:
                    word.fill_(1)

            every = {"fa_ours": fa_only, "fa_ours_awake": awake, "fa_ours_tiny": tiny,
                     "fused": lambda: fused.launch(q, k, v, mode="piggyback", wait=False),
                     "fused_visible": lambda: fused.launch(q, k, v, mode="piggyback", wait=True),
                     "fused_self": lambda: fused.launch(q, k, v, mode="piggyback", wait=False, self_store=True),
                     "serial_ours_nccl": lambda: nccl_post_a2a(flash_attention(q, k, v, out=o), group),
                     "serial_ours_symm": lambda: a2a(flash_attention(q, k, v, out=o))}
            if fa4 is not None:
                every["fa4"] = lambda: fa4(q, k, v)
                every["serial_fa4_nccl"] = lambda: nccl_post_a2a(fa4(q, k, v), group)
            for name, knobs in args.variants.items():
                if "mode" in knobs:  # a fused column, sender-side like ``fused``
                    every[variant_column(name, knobs)] = (lambda kn: lambda: fused.launch(q, k, v, wait=False,
                                                                                          **kn))(knobs)
                else:  # FA-only in the fused walk with these knobs
                    every[variant_column(name, knobs)] = (lambda kn: lambda: flash_attention(q, k, v, out=o, **order,
                                                                                             **kn))(knobs)
            kernels = {name: fn for name, fn in every.items() if name not in args.skip}
            if "fa_ours" not in kernels:
                raise ValueError("fa_ours is every difference's base: do not skip it")
            graphs = {name: one_launch_graph(fn, before_capture=lambda: dist.barrier(group=group))
                      for name, fn in kernels.items()}
            fused.settle(q)
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            per_launch = torch.tensor([replay_seconds(graphs["fa_ours"])], device="cuda", dtype=torch.float64)
            dist.all_reduce(per_launch, op=dist.ReduceOp.MAX, group=group)  # one launch count on every rank
            per_launch_s = float(per_launch.item())
            batch = max(1, int(0.05 / per_launch_s))  # ~50 ms of replays between host checks
            n_batches = max(4, int(args.seconds / (batch * per_launch_s)))
            names = list(graphs)
            for phase in range(args.phases):
                for name in phase_order(names, phase):
                    dist.barrier(group=group)
                    dist.all_reduce(token, group=group)  # start together on the device
                    times = []
                    t0 = time.time()
                    for _ in range(n_batches):
                        times.append(timed_batch(graphs[name], batch, start, stop))
                    t1 = time.time()
                    if name.startswith("fused"):
                        fused.settle(q)  # every sender-side launch's data in before the next phase
                        torch.cuda.synchronize()
                    rows.append({"shape": spec, "kernel": name, "phase": phase, "rank": rank, "t0": t0, "t1": t1,
                                 "launches": n_batches * batch, "us_per_launch": statistics.median(times[1:])})
                    if rank == 0:
                        print(f"{spec} phase {phase} {name}: {rows[-1]['us_per_launch']:.1f} us", flush=True)
            fused.check()
            del q, k, v, o, graphs
            torch.cuda.empty_cache()
    finally:
        samples = close_sampler(smi, log)
    annotate_phases(rows, samples, args.settle)
    return rows


def run_ranks_and_gather(rank: int, world: int, init_file: str, run, args) -> list[dict] | None:
    """In a spawned rank: join the group, ``run(rank, world, group, args)`` (its phase rows), gather every
    rank's rows; rank 0 gets them all, the others None."""
    import torch.distributed as dist

    from cute_kernels.dist import process_group

    with process_group(rank, world, init_file) as group:
        rows = run(rank, world, group, args)
        gathered = [None] * world
        dist.all_gather_object(gathered, rows, group=group)
    return [r for part in gathered for r in part] if rank == 0 else None


def replot(path: str) -> tuple[str, str]:
    """A saved result's summaries recomputed from its phases and its figure redrawn, written beside it as
    <name>.replot.json and <name>.replot.png (the measured result is never overwritten). Returns their paths."""
    with open(path) as f:
        result = json.load(f)
    result.update(summaries(result["phases"]))
    stem = os.path.splitext(path)[0] + ".replot"
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, stem + ".png")
    return stem + ".json", stem + ".png"


def _worker(rank: int, world: int, init_file: str, args) -> None:
    from cute_kernels.runtime import provenance

    every = run_ranks_and_gather(rank, world, init_file, _run, args)
    if every is not None:
        result = {"provenance": provenance(" ".join(sys.argv)), "args": vars(args), "world": world,
                  **summaries(every), "phases": every}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        plot(result, os.path.splitext(args.out)[0] + ".png")
        for shape, per in result["summary"].items():
            for name, val in per.items():
                print(shape, name, {k: (round(x, 2) if isinstance(x, float) else x) for k, x in val.items()
                                    if not isinstance(x, dict)}, val.get("minus_fa_ours", ""), flush=True)
        print(json.dumps(result["hiding"], indent=1), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="result JSON (its figure beside it, .png)")
    p.add_argument("--plot", metavar="JSON", help="recompute a saved result's summary from its phases and redraw "
                                                  "its figure, both beside it as <name>.replot.json and "
                                                  "<name>.replot.png (no GPU)")
    p.add_argument("--shapes", nargs="+", default=["1x49152x12", "1x32768x12", "1x65536x3"],
                   help="b x S x heads per rank (d = 128)")
    p.add_argument("--phases", type=int, default=6)
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--settle", type=float, default=0.3)
    p.add_argument("--sample-ms", type=int, default=20)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--no-fa4", action="store_true", help="leave flash-attn-4 out")
    p.add_argument("--variants", default="{}", metavar="JSON",
                   help='extra columns as in xstage bench flash-a2a (a JSON object or the path of a .json file): '
                        '{"name": {knobs}}: fused_<name> where the knobs hold a "mode", else fa_ours_<name>, e.g. '
                        '\'{"nosplit": {"mode": "piggyback", "tail_split": false}}\'')
    p.add_argument("--skip", nargs="*", default=[],
                   help="columns to leave out (fa_ours_awake, fa_ours_tiny, fused, fused_visible, fused_self, "
                        "serial_ours_nccl, serial_ours_symm, fa4, serial_fa4_nccl)")
    args = p.parse_args(argv)
    if args.plot:  # the summary again from the phases (its definition may be newer than the run), then the figure
        print("wrote " + " and ".join(replot(args.plot)))
        return
    if not args.out:
        p.error("--out is required (or --plot JSON)")
    try:
        args.variants = parse_variants(args.variants, BUILT_IN)
    except (ValueError, OSError) as e:  # json.JSONDecodeError is a ValueError
        p.error(f"--variants: {e}")
    from cute_kernels.dist import spawn_ranks

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    spawn_ranks(_worker, args.world, args)


if __name__ == "__main__":
    main()
