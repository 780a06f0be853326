"""Board power and SM clock under a sustained load: each case's CUDA graph replayed back to back for a few seconds
while a thread samples NVML (the board's power draw, the SM clock, the enforced power limit), so a layer's energy
per call and per FLOP stand beside the dense products the roofline's ceilings come from.

A heavy kernel on a power-capped H100 / H200 runs at whatever SM clock the cap leaves it: there the layer's time
follows its energy, not its cycles (docs/FINDINGS.md, MegaMoE: the per-tile SM clock of the dumps). This probe
says how close to the cap each case runs and what each call costs in joules.

    python -m benchmarks.power_probe --shapes dsv4-flash,qwen3-moe --tokens 8192 --precisions fp8,bf16 \\
        --out benchmarks/results/<machine>/power_probe_<commit>.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import threading
import time

NVML_CLOCK_SM = 1


class Nvml:
    """The few NVML calls this probe needs, through ctypes (no pynvml on the device): device ``index``'s power
    draw (W, NVML's running average), SM clock (MHz) and enforced power limit (W)."""

    def __init__(self, index: int = 0):
        try:
            self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as e:
            raise RuntimeError(f"NVML is not available here ({e}): the power probe needs the NVIDIA driver") from e
        self._check(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        self.handle = ctypes.c_void_p()
        self._check(self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)), "GetHandleByIndex")

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"NVML {what} failed with code {rc}")

    def _uint(self, fn, *args) -> int:
        out = ctypes.c_uint()
        self._check(fn(self.handle, *args, ctypes.byref(out)), fn.__name__)
        return out.value

    def power_w(self) -> float:
        return self._uint(self.lib.nvmlDeviceGetPowerUsage) / 1e3

    def sm_clock_mhz(self) -> int:
        return self._uint(self.lib.nvmlDeviceGetClockInfo, NVML_CLOCK_SM)

    def power_limit_w(self) -> float:
        return self._uint(self.lib.nvmlDeviceGetEnforcedPowerLimit) / 1e3


def summarize(samples: list[tuple[float, float, float]], seconds: float, calls: int, flops: float | None,
              settle_s: float) -> dict:
    """A case's numbers from its (t, W, MHz) samples over a ``seconds``-long run of ``calls`` calls: the samples
    after the first ``settle_s`` seconds (NVML's power is a running average) give mean W and median MHz; J per
    call = mean W x the run's time per call; pJ per FLOP where ``flops`` (per call) is known."""
    import statistics

    kept = [s for s in samples if s[0] >= settle_s]
    if not kept or calls <= 0 or seconds <= 0:
        raise ValueError(f"no samples after {settle_s} s, or no calls: run the case longer")
    watts = sum(w for _, w, _ in kept) / len(kept)
    us = seconds / calls * 1e6
    joules = watts * us * 1e-6
    return {"us_per_call": us, "watts": watts, "sm_mhz": statistics.median(m for _, _, m in kept),
            "samples": len(kept), "joules_per_call": joules,
            "pj_per_flop": joules / flops * 1e12 if flops else None,
            "tflops": flops / us / 1e6 if flops else None}


def energy_verdict(runs: dict) -> dict:
    """Old against new in joules: ``runs`` {"old": [summaries], "new": [...]} from alternating sustained runs
    (old, new, new, old, ...); each side's mean J, W, us per call and median MHz, and new / old of the joules and
    of the time per call. On a chip at its power limit the two ratios move together."""
    import statistics

    if not runs.get("old") or not runs.get("new"):
        raise ValueError("energy_verdict needs at least one run of each side")
    side = {n: {"joules_per_call": statistics.fmean(r["joules_per_call"] for r in rs),
                "watts": statistics.fmean(r["watts"] for r in rs),
                "us_per_call": statistics.fmean(r["us_per_call"] for r in rs),
                "sm_mhz": statistics.median(r["sm_mhz"] for r in rs), "runs": len(rs)} for n, rs in runs.items()}
    return {**side, "new_over_old_joules": side["new"]["joules_per_call"] / side["old"]["joules_per_call"],
            "new_over_old_us": side["new"]["us_per_call"] / side["old"]["us_per_call"]}


def run_case(fn, nvml: Nvml, *, seconds: float, settle_s: float, calls_per_graph: int, flops: float | None) -> dict:
    """``fn`` captured in a graph of ``calls_per_graph`` calls, replayed back to back for ``seconds`` while a
    thread samples NVML every 20 ms; the run's time from CUDA events (the replays queue ahead of the GPU, so a
    short sync cadence keeps the sample times and the GPU's work aligned)."""
    import torch

    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls_per_graph):
            fn()
    g.replay()
    torch.cuda.synchronize()
    samples: list[tuple[float, float, float]] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def sample():
        while not stop.is_set():
            samples.append((time.monotonic() - t0, nvml.power_w(), nvml.sm_clock_mhz()))
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = 0
    timed = False
    while time.monotonic() - t0 < seconds:
        if not timed and time.monotonic() - t0 >= settle_s:
            torch.cuda.synchronize()
            start.record()
            timed, replays = True, 0
        for _ in range(4):
            g.replay()
        replays += 4
        torch.cuda.synchronize()  # keeps the queue short: the samples see the work being timed
    end.record()
    torch.cuda.synchronize()
    stop.set()
    thread.join()
    out = summarize(samples, start.elapsed_time(end) / 1e3, replays * calls_per_graph, flops, settle_s)
    out["power_limit_w"] = nvml.power_limit_w()
    return out


def ours_case(shape: str, tokens: int, precision: str, schedule: str, seed: int, group):
    """(fn, flops): one loaded MegaMoE at world 1 on seeded balanced routing, as ``xstage bench megamoe`` builds
    it (benchmarks.megamoe), and its FLOPs per call."""
    import torch

    from benchmarks.megamoe import PRESETS, build_ours, load_api, make_weights, row_seed
    from benchmarks.moe_baselines import moe_flops
    from megamoe.reference import make_routing, routing_stats

    preset = PRESETS[shape]
    w1, w2 = make_weights(preset, seed, "cuda")
    layer = build_ours(load_api(), group, preset, 1, tokens, w1, w2, [precision])[precision]
    if isinstance(layer, str):
        raise ValueError(f"{shape} {precision}: {layer}")
    s = row_seed(seed, preset.name, 1, tokens, "balanced")
    x = torch.randn(tokens, preset.hidden, generator=torch.Generator(device="cuda").manual_seed(s),
                    device="cuda").to(torch.bfloat16)
    idx, wts = make_routing(tokens, preset.num_experts, preset.top_k, "balanced", s, "cuda")
    rows = routing_stats(idx, preset.num_experts)["rows"]
    return (lambda: layer.forward(x, idx, wts, schedule=schedule)), moe_flops(preset, rows)


def dense_case(kind: str, n: int = 8192):
    """(fn, flops): the n^3 product the roofline's ceiling is measured on (benchmarks.moe_baselines.dense_products;
    FP8 with fast accumulation)."""
    import torch

    from benchmarks.moe_baselines import dense_products

    fns = dense_products(n, torch.Generator(device="cuda").manual_seed(0))
    return fns["bf16" if kind == "bf16" else "fp8_fast_accum"], 2.0 * n ** 3


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="dsv4-flash,qwen3-moe")
    p.add_argument("--tokens", default="8192", help="comma list of tokens per rank")
    p.add_argument("--precisions", default="fp8,bf16")
    p.add_argument("--schedule", default="wave", choices=("wave", "interleaved"))
    p.add_argument("--seconds", type=float, default=4.0, help="per case, the first --settle not timed")
    p.add_argument("--settle", type=float, default=1.5)
    p.add_argument("--dense", default="fp8,bf16", help="the dense 8192^3 products to probe too ('' for none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmp", default="/tmp")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.settle >= args.seconds:
        raise ValueError(f"--settle {args.settle} must be below --seconds {args.seconds}")
    import torch

    from benchmarks.megamoe import local_group
    from cute_kernels.runtime import provenance

    if not torch.cuda.is_available():
        raise RuntimeError("the power probe needs a GPU")
    print(f"seed {args.seed}")
    nvml = Nvml(torch.cuda.current_device())
    cases = {}
    with local_group(args.tmp) as group:
        for d in [d for d in args.dense.split(",") if d]:
            fn, flops = dense_case(d)
            cases[f"dense_{d}_8192"] = run_case(fn, nvml, seconds=args.seconds, settle_s=args.settle,
                                                calls_per_graph=8, flops=flops)
            print(f"dense_{d}_8192", json.dumps(cases[f"dense_{d}_8192"]))
        for shape in args.shapes.split(","):
            for tokens in (int(t) for t in args.tokens.split(",")):
                for d in args.precisions.split(","):
                    name = f"ours_{d}_{args.schedule}_{shape}_{tokens}"
                    fn, flops = ours_case(shape, tokens, d, args.schedule, args.seed, group)
                    cases[name] = run_case(fn, nvml, seconds=args.seconds, settle_s=args.settle, calls_per_graph=2,
                                           flops=flops)
                    print(name, json.dumps(cases[name]))
                    torch.cuda.empty_cache()
    result = {"provenance": provenance("python -m benchmarks.power_probe " + " ".join(argv or [])),
              "method": f"each case's CUDA graph replayed back to back for {args.seconds} s; NVML power (its running "
                        f"average) and SM clock sampled every 20 ms, the first {args.settle} s not counted; J per "
                        "call = mean W x time per call (CUDA events over the counted replays)",
              "seed": args.seed, "cases": cases}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
