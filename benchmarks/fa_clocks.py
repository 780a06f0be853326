"""SM clock and board power while our FA-only and flash-attn-4 run, one GPU: is FA4's ~2% lead at the
unsplit long shapes a faster schedule at the same clock, or the same work at a higher clock?

Each kernel is captured in a CUDA Graph and replayed back to back for ``--seconds`` per phase, the two
kernels alternating for ``--phases`` phases per shape, while ``nvidia-smi -lms`` samples the SM clock,
power and the active clock-event reasons. Per phase: the median time per launch (CUDA events around each
batch of replays) and the median of the samples taken inside it (its first ``--settle`` seconds dropped).
Usage (device, from the repository root): python3 -m benchmarks.fa_clocks --out $OUT/fa_clocks.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.old_vs_new import parse_shape  # "BxSxH[xD]" -> (b, S, H, d)

SMI_FIELDS = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
SMI_FIELDS_OLD = "timestamp,clocks.sm,power.draw,temperature.gpu"  # a driver without the reasons field


def parse_smi(lines: list[str]) -> list[tuple[float, float, float, float, str]]:
    """nvidia-smi CSV rows (``SMI_FIELDS`` or ``SMI_FIELDS_OLD``, noheader, nounits) -> (unix time, SM MHz,
    W, °C, reasons or ""); rows that do not parse (a header, a cut last line) are skipped. The timestamp is
    local time."""
    out = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4:
            parts.append("")
        if len(parts) != 5:
            continue
        try:
            stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((stamp, float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
        except ValueError:
            continue
    return out


def _tie_to_parent():
    """A ``preexec_fn`` that asks the kernel to SIGTERM the child when the process that started it dies (Linux
    prctl PR_SET_PDEATHSIG), so a rank killed mid-run leaves no nvidia-smi behind; None where libc has no
    prctl. Everything is looked up here, in the parent: between fork and exec the child only makes the call
    (a fork of a process with NCCL and torch threads must not load libraries), then leaves at once if its
    parent already died before the call took effect."""
    import ctypes
    import signal

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent, sig = os.getpid(), int(signal.SIGTERM)

    def tie() -> None:
        prctl(1, sig)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return tie


def smi_ok(fields: str, target: str) -> bool:
    """Whether ``nvidia-smi`` answers a query of ``fields`` for GPU ``target``."""
    return subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", target],
                          capture_output=True, text=True, check=False).returncode == 0


def open_sampler(target: str, sample_ms: int):
    """(sampler, log): ``start_sampler`` for GPU ``target`` into a fresh temporary file, with the clock-event
    reasons where the driver has that field (``SMI_FIELDS_OLD`` where it does not)."""
    fields = SMI_FIELDS if smi_ok(SMI_FIELDS, target) else SMI_FIELDS_OLD
    log = tempfile.TemporaryFile(mode="w+")
    return start_sampler(fields, target, sample_ms, log), log


def close_sampler(smi, log) -> list:
    """Stop a sampler (killed if it does not end within 10 s, so a caller's exception is never hidden by a
    timeout here) and parse what it wrote (``parse_smi``)."""
    time.sleep(0.2)
    smi.terminate()
    try:
        smi.wait(timeout=10)
    except subprocess.TimeoutExpired:
        smi.kill()
    log.seek(0)
    return parse_smi(log.read().splitlines())


def annotate_phases(rows: list[dict], samples, settle: float) -> None:
    """Give every phase row (``t0``, ``t1``, ``us_per_launch``) the summary of the samples inside it and,
    where it has samples, its clock-normalized work (cycles per launch at the phase's median SM clock) and
    board energy per launch: under the power cap, the kernel with fewer joules per launch gets the higher
    clock."""
    for r in rows:
        r.update(summarize(phase_samples(samples, r["t0"], r["t1"], settle)))
        if r["samples"]:
            r["mcycles"] = r["us_per_launch"] * r["sm_mhz"] / 1e6
            r["mj_per_launch"] = r["us_per_launch"] * r["power_w"] / 1e3


def start_sampler(fields: str, target: str, sample_ms: int, log):
    """``nvidia-smi --loop-ms`` for GPU ``target`` writing CSV rows to the open file ``log`` (a file, not a
    pipe: a pipe read only at the end fills, ~20 s of samples, and stalls it). Its stdin and stderr are not
    the caller's, so a sampler outliving its caller cannot hold a ``| tee`` open (a failed two-rank run sat
    until its device call's limit so), and it dies with the process that started it."""
    return spawn_tied(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", target,
                       f"--loop-ms={sample_ms}"], log)


def spawn_tied(argv: list[str], log):
    """``argv`` with stdout to ``log``, no stdin or stderr of ours, ended when this process dies."""
    return subprocess.Popen(argv, stdout=log, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=_tie_to_parent())


def one_launch_graph(fn, warmup: int = 3, before_capture=None):
    """A CUDA graph of one call of ``fn``, after ``warmup`` eager calls (compile and warm up outside the graph)
    and a synchronize; ``before_capture`` (e.g. a barrier of the ranks) runs just before the capture."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if before_capture is not None:
        before_capture()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def timed_batch(graph, batch: int, start, stop) -> float:
    """µs per launch over ``batch`` back-to-back replays of ``graph``, between the CUDA events ``start`` and
    ``stop`` (created once by the caller and reused)."""
    start.record()
    for _ in range(batch):
        graph.replay()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e3 / batch


def replay_seconds(graph) -> float:
    """One replay of ``graph`` timed with CUDA events (seconds)."""
    import torch

    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    return timed_batch(graph, 1, start, stop) / 1e6


def phase_samples(samples, start: float, end: float, settle: float):
    """The samples taken in [start + settle, end]."""
    return [s for s in samples if start + settle <= s[0] <= end]


def summarize(samples) -> dict:
    if not samples:
        return {"samples": 0}
    reasons: dict[str, int] = {}
    for s in samples:
        reasons[s[4]] = reasons.get(s[4], 0) + 1
    return {"samples": len(samples), "sm_mhz": statistics.median(s[1] for s in samples),
            "power_w": statistics.median(s[2] for s in samples),
            "temp_c": statistics.median(s[3] for s in samples), "reasons": reasons}


def _run(args) -> dict:
    import torch

    from benchmarks.baselines import fa4_forward, fa4_unavailable
    from cute_kernels.runtime import provenance
    from flash_a2a import flash_attention

    missing = fa4_unavailable()  # the benchmark's own FA4 call, so both time the same thing
    if missing:
        raise SystemExit(f"flash-attn-4 is needed here: {missing}")

    smi, log = open_sampler(str(torch.cuda.current_device()), args.sample_ms)
    rows = []
    try:
        for spec in args.shapes:
            b, s, h, d = parse_shape(spec)
            q, k, v = (torch.randn(b, s, h, d, device="cuda").to(torch.bfloat16) for _ in range(3))
            kernels = {"fa_ours": lambda: flash_attention(q, k, v, tile_order_world=args.tile_order_world),
                       "fa4": lambda: fa4_forward(q, k, v)}
            graphs = {name: one_launch_graph(fn) for name, fn in kernels.items()}
            for name in graphs:
                graphs[name].replay()
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            per_launch_s = replay_seconds(graphs["fa_ours"])
            batch = max(1, int(0.05 / per_launch_s))  # ~50 ms of replays between host checks
            for phase in range(args.phases):
                for name in (("fa_ours", "fa4") if phase % 2 == 0 else ("fa4", "fa_ours")):
                    times = []
                    t0 = time.time()
                    while time.time() - t0 < args.seconds:
                        times.append(timed_batch(graphs[name], batch, start, stop))
                    rows.append({"shape": spec, "kernel": name, "phase": phase, "t0": t0, "t1": time.time(),
                                 "us_per_launch": statistics.median(times[1:] or times)})
                    print(f"{spec} phase {phase} {name}: {rows[-1]['us_per_launch']:.1f} us", flush=True)
            del q, k, v, graphs
            torch.cuda.empty_cache()
    finally:
        samples = close_sampler(smi, log)
    annotate_phases(rows, samples, args.settle)
    summary = {}
    for spec in args.shapes:
        for name in ("fa_ours", "fa4"):
            mine = [r for r in rows if r["shape"] == spec and r["kernel"] == name and r.get("samples")]
            if mine:
                summary[f"{spec}/{name}"] = {key: statistics.median(r[key] for r in mine)
                                             for key in ("us_per_launch", "sm_mhz", "power_w", "temp_c", "mcycles",
                                                         "mj_per_launch")}
    return {"provenance": provenance(" ".join(sys.argv)), "args": vars(args), "summary": summary,
            "phases": rows, "smi_samples": len(samples)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", nargs="+", default=["1x49152x12", "1x32768x12", "1x32768x3", "1x16384x3"],
                   help="b x S x heads [x d] (d = 128 if left out)")
    p.add_argument("--tile-order-world", type=int, default=2,
                   help="our kernel walks the fused tile order of this many ranks (1: the local order)")
    p.add_argument("--phases", type=int, default=6)
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--settle", type=float, default=0.3)
    p.add_argument("--sample-ms", type=int, default=20)
    args = p.parse_args(argv)
    result = _run(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for key, val in result["summary"].items():
        print(key, {k: round(v, 2) for k, v in val.items()})


if __name__ == "__main__":
    main()
