"""``xstage calibrate``: sweep, fit, predict, plot.

On a machine with two or more GPUs with peer access it spawns one process per GPU (NCCL + symmetric
memory) and measures every ordered pair (``--pairs all``) or the first pair only. With one GPU it says that
remote calibration needs two GPUs with peer access and runs the local control only. ``--refit RAW.json``
refits and replots saved measurements without a GPU.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from cute_kernels.dist import apply_safe_env, process_group, spawn_ranks


def add_arguments(p) -> None:
    p.add_argument("--out", default=None, help="output folder (default benchmarks/results/<machine>)")
    p.add_argument("--machine", default=None, help="machine name for the output folder, e.g. h200x2")
    p.add_argument("--quick", action="store_true", help="coarser grids (about a quarter of the points)")
    p.add_argument("--pairs", choices=("all", "first"), default="all",
                   help="measure every ordered GPU pair or only 0->1 (default all)")
    p.add_argument("--repeats", type=int, default=3, help="runs of the whole sweep (default 3)")
    p.add_argument("--threads", type=int, default=128, help="threads per producer CTA (default 128)")
    p.add_argument("--buffer-mib", type=int, default=512, help="symmetric destination buffer per GPU (MiB)")
    p.add_argument("--timeout-s", type=float, default=2.0, help="bound on every in-kernel wait")
    p.add_argument("--no-anchors", action="store_true", help="skip the bandwidth anchors")
    p.add_argument("--no-all-to-all", action="store_true",
                   help="skip the all-to-all injection sweep (every rank sending to all its peers at once)")
    p.add_argument("--refit", metavar="RAW_JSON", default=None,
                   help="refit and replot saved raw measurements (no GPU needed)")


def _machine_name() -> str:
    import torch

    name = torch.cuda.get_device_name(0).lower()
    short = name.split()[-1] if name.split() else "gpu"
    return f"{short}x{torch.cuda.device_count()}"


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc="calibrate", unit="pt", file=sys.stderr, mininterval=1.0)
    except ImportError:
        return None


def _worker(rank: int, world: int, init_file: str, cfg: dict, result_path: str) -> None:
    import torch.distributed as dist

    with process_group(rank, world, init_file):
        from calibrate.anchors import measure_anchors
        from calibrate.bench import BurstBench
        from calibrate.sweep import all_peers_sweep, default_sweep

        bench = BurstBench(threads=cfg["threads"], buffer_bytes=cfg["buffer_mib"] << 20,
                           timeout_s=cfg["timeout_s"])
        pts = default_sweep(bench.sm_count, quick=cfg["quick"])
        pairs = [(s, d) for s in range(world) for d in range(world) if s != d]
        if cfg["pairs"] == "first":
            pairs = pairs[:1]
        a2a_pts = [] if cfg.get("no_all_to_all") else all_peers_sweep(pts)
        bar = _progress(cfg["repeats"] * (len(pairs) * len(pts) + len(a2a_pts)), rank == 0)
        t_start = time.time()
        measurements, failures = [], []
        # Warm-up: compile every variant and run it once, outside the measurement.
        # (The variant list is derived from the sweep alone, so every rank runs the same warm-up points.)
        warmups = {}
        for p in pts:
            warmups.setdefault((p.mode == "isolated", p.gap_kind, p.target), p)
        for p in warmups.values():
            bench.run_point(p, pairs[0][0], pairs[0][1])
        a2a_warmups = {}
        for p in a2a_pts:
            a2a_warmups.setdefault((p.mode == "isolated", p.gap_kind), p)
        for p in a2a_warmups.values():
            bench.run_all_peers(p)
        for repeat in range(cfg["repeats"]):
            for s, d in pairs:
                bench.run_point(pts[0], s, d)  # first touch of this pair's mapping stays out of the data
                for p in pts:
                    try:
                        m = bench.run_point(p, s, d)
                        if m is not None:
                            measurements.append({**m, "repeat": repeat})
                    except RuntimeError as e:
                        failures.append(str(e))
                    if bar is not None:
                        bar.update(1)
            for p in a2a_pts:  # all-to-all injection: every rank sends to all its peers at once
                try:
                    measurements.append({**bench.run_all_peers(p), "repeat": repeat})
                except RuntimeError as e:
                    failures.append(str(e))
                if bar is not None:
                    bar.update(1)
        if bar is not None:
            bar.close()
        anchors = {} if cfg["no_anchors"] else measure_anchors(bench, *pairs[0])
        gathered = [None] * world
        dist.all_gather_object(gathered, {"measurements": measurements, "failures": failures})
        if rank == 0:
            allm = [m for g in gathered for m in g["measurements"]]
            allf = sorted({f for g in gathered for f in g["failures"]})
            with open(result_path, "w") as f:
                json.dump({"measurements": allm, "failures": allf, "anchors": anchors,
                           "sweep_seconds": time.time() - t_start, "sm_count": bench.sm_count,
                           "threads": cfg["threads"], "pairs": pairs}, f)
        dist.barrier()


def _local_only(cfg: dict) -> dict:
    """One GPU: the local-memory control alone (no remote path to calibrate)."""
    with tempfile.TemporaryDirectory() as tmp, process_group(0, 1, f"{tmp}/pg"):
        from calibrate.bench import BurstBench
        from calibrate.sweep import default_sweep

        bench = BurstBench(threads=cfg["threads"], buffer_bytes=cfg["buffer_mib"] << 20,
                           timeout_s=cfg["timeout_s"])
        out = [bench.run_point(p, 0, 0) for p in default_sweep(bench.sm_count, cfg["quick"])
               if p.target == "local"]
        return {"measurements": out, "sm_count": bench.sm_count}


def finish(raw: dict, out_dir: str, command: str) -> int:
    """Fit, predict, write calibration.json / calibration_raw.json / figures; print the summary."""
    from calibrate.figures import plot_figure3
    from calibrate.fit import fit_profile
    from calibrate.profile import save_profile
    from cute_kernels.runtime import provenance

    prov = raw.get("provenance") or provenance(command)
    prov.setdefault("source", "measured")
    prov.setdefault("world_size", raw.get("world_size", 2))
    prov.setdefault("link", "NVLink (peer mapping through torch symmetric memory)")
    raw["provenance"] = prov
    pairwise = [m for m in raw["measurements"] if m["target"] != "all_peers"]
    all_peers = [m for m in raw["measurements"] if m["target"] == "all_peers"]
    fit = fit_profile(pairwise, raw["sm_count"], prov, raw.get("anchors"))
    a2a_fit = None
    if all_peers:
        # The same model fitted on all-to-all injection: each sender's producers spread over its P - 1 peers
        # while every other rank does the same (the local control is shared).
        relabeled = [{**m, "target": "remote"} for m in all_peers] + [m for m in pairwise if m["target"] == "local"]
        a2a_prov = {**prov, "injection": "all-to-all (every rank to all its peers at once)"}
        try:
            a2a_fit = fit_profile(relabeled, raw["sm_count"], a2a_prov, raw.get("anchors"))
        except ValueError as e:
            print(f"all-to-all injection: no fit ({e})", file=sys.stderr)
    world = int(prov.get("world_size", 2))
    raw["predictions"] = fit.predictions
    raw["rate_points"] = fit.rate_points
    os.makedirs(out_dir, exist_ok=True)
    if a2a_fit is not None:
        a = a2a_fit.profile
        summary = all_to_all_summary(fit.profile, a, world)
        fit.profile.fit_quality["all_to_all"] = summary
        raw["all_to_all_predictions"] = a2a_fit.predictions
        save_profile(a, os.path.join(out_dir, "calibration_all_to_all.json"))
    save_profile(fit.profile, os.path.join(out_dir, "calibration.json"))
    with open(os.path.join(out_dir, "calibration_raw.json"), "w") as f:
        json.dump(raw, f, indent=1)
    figs = plot_figure3(raw["measurements"], fit.profile, fit.rate_points, out_dir)
    p = fit.profile
    k = p.sm_count
    print(f"R = {p.drain_rate_GBps:.1f} GB/s from {len(fit.rate_points)} zero-gap points")
    for pt in p.t_iss0_points:
        print(f"T_iss0(K={pt.producers}, B={pt.bytes_per_producer:.0f}) = {pt.t_iss0_us:.3f} us")
    for cp in p.capacity_points:
        knee = f", knee {cp.knee_bytes_per_producer:.0f} B/producer" if cp.knee_bytes_per_producer else " (lower bound)"
        print(f"Q(K={cp.producers}) = {cp.capacity_bytes / (1 << 20):.2f} MiB{knee}")
    for name, e in fit.errors.items():
        if e:
            print(f"no-refit prediction error {name}: median {100 * e['median']:.1f}%, "
                  f"max {100 * e['max']:.1f}% over {e['n']} runs")
    if a2a_fit is not None:
        sm = fit.profile.fit_quality["all_to_all"]
        print(f"all-to-all injection (P = {world}): R = {sm['drain_rate_GBps_per_sender']:.1f} GB/s per sender, "
              f"{sm['drain_rate_GBps_per_peer']:.1f} per peer link ({sm['rate_vs_pairwise']:.2f}x one pair); "
              f"Q(K={fit.profile.sm_count}) = {sm['capacity_MiB_all_sms']:.2f} MiB")
    anchors = raw.get("anchors") or {}
    best = max((v for key, v in anchors.items() if key.endswith("unidirectional_GBps")), default=None)
    if best:
        print(f"R / best unidirectional peer-write anchor = {p.drain_rate_GBps / best:.2f} ({best:.0f} GB/s)")
    if raw.get("failures"):
        print(f"{len(raw['failures'])} runs failed verification and were excluded:", file=sys.stderr)
        for f in raw["failures"][:10]:
            print("  " + f, file=sys.stderr)
    print("wrote", out_dir, "(calibration.json, calibration_raw.json,", ", ".join(os.path.basename(x) for x in figs) + ")")
    _ = k
    return 1 if raw.get("failures") else 0


def all_to_all_summary(pair, a2a, world: int) -> dict:
    """How the drain rate divides over peers: the all-to-all profile beside the single-pair one."""
    k = pair.sm_count
    return {"world_size": world,
            "drain_rate_GBps_per_sender": a2a.drain_rate_GBps,
            "drain_rate_GBps_per_peer": a2a.drain_rate_GBps / max(world - 1, 1),
            "rate_vs_pairwise": a2a.drain_rate_GBps / pair.drain_rate_GBps,
            "t_iss0_us_all_sms_32KiB": float(a2a.t_iss0(k, k * 32768)),
            "capacity_MiB_all_sms": float(a2a.capacity(k)) / (1 << 20),
            "profile": "calibration_all_to_all.json"}


def run(args) -> int:
    command = "xstage " + " ".join(sys.argv[1:]) if sys.argv else "xstage calibrate"
    if args.refit:
        try:
            with open(args.refit) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            print(f"xstage: error: cannot read {args.refit}: {e}", file=sys.stderr)
            return 2
        from cute_kernels.runtime import git_commit

        if raw.get("provenance"):  # the measurement's provenance stays; the refit is recorded beside it
            import datetime

            raw["provenance"]["refit"] = {"command": command, "git_commit": git_commit(),
                                          "date": datetime.date.today().isoformat()}
        return finish(raw, args.out or os.path.dirname(os.path.abspath(args.refit)), command)
    import torch

    if not torch.cuda.is_available():
        print("xstage: error: calibrate needs a CUDA GPU (and two with peer access for the remote path); "
              "use `xstage calibrate --refit RAW.json` or `xstage design-test` on this machine", file=sys.stderr)
        return 2
    apply_safe_env()
    world = torch.cuda.device_count()
    if args.repeats < 1:
        print("xstage: error: --repeats must be >= 1", file=sys.stderr)
        return 2
    cfg = {"repeats": args.repeats, "threads": args.threads, "buffer_mib": args.buffer_mib, "timeout_s": args.timeout_s,
           "quick": args.quick, "pairs": args.pairs, "no_anchors": args.no_anchors,
           "no_all_to_all": args.no_all_to_all}
    out_dir = args.out or os.path.join("benchmarks", "results", args.machine or _machine_name())
    peers = world >= 2 and all(torch.cuda.can_device_access_peer(i, j)
                               for i in range(world) for j in range(world) if i != j)
    if not peers:
        print("remote calibration needs two GPUs with peer access; "
              f"found {world} GPU(s){' without peer access' if world >= 2 else ''}: running the local control only")
        raw = _local_only(cfg)
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "local_control_raw.json")
        with open(path, "w") as f:
            json.dump(raw, f, indent=1)
        print("wrote", path)
        return 0
    from cute_kernels.runtime import provenance

    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "raw.json")
        t0 = time.time()
        spawn_ranks(_worker, world, cfg, result_path)
        with open(result_path) as f:
            raw = json.load(f)
    raw["world_size"] = world
    raw["wall_seconds"] = time.time() - t0
    raw["provenance"] = provenance(command)
    raw["provenance"].update(source="measured", world_size=world)
    return finish(raw, out_dir, command)
