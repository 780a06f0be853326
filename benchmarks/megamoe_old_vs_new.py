"""An older commit's MegaMoE beside this tree's, timed side by side in one process on one GPU (world size 1):
the check a kernel experiment owes before it lands (or is written up and dropped, docs/FINDINGS.md).

    python -m benchmarks.old_vs_new --prepare COMMIT        # here (git, no GPU): .oldtree/old_megamoe, ...
    PYTHONPATH=$PWD:$PWD/.oldtree python -m benchmarks.megamoe_old_vs_new --out J [--cases ...]   # the GPU

``--same-tree --set new.m_group=2`` times this tree against itself with a run-time attribute of one side's
layers changed (a launch-time knob: nothing else differs, no export needed). A side named ``new2``, ``new3``, ...
in ``--set`` is one more layer of this tree with its own settings, timed in the same rounds and paired against
old like ``new`` (several settings of a launch-time knob in one process, one compile).

Each case builds both layers with the same seeded weights, tokens and routing, checks both outputs against
each other (``identical_output``: bit for bit, which a change of schedule-free arithmetic keeps; otherwise
their max difference over max |y|), and times them by CUDA-Graph replay: interleaved rounds in a fresh order
each round, and adjacent-launch pairs in alternating order (old, new; new, old) whose median difference is the
verdict, with an old-against-old pair set for the run's noise. ``--energy S`` adds each side's joules per call
(benchmarks.power_probe: S-second sustained replays, old, new, new, old): on a chip at its power limit a change
pays only if it saves energy.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks.old_vs_new import add_timing_arguments, check_old_tree, old_commit, time_old_new

DTYPES = ("bf16", "w8a8", "w4a8")
SCHEDULES = ("wave", "interleaved")
# the rows issue 28's W8A8 target is judged at, and one bf16 control
DEFAULT_CASES = ("qwen3-moe:8192:balanced:w8a8:interleaved", "dsv4-flash:8192:balanced:w8a8:interleaved",
                 "dit-moe:8192:balanced:w8a8:wave", "qwen3-moe:8192:balanced:bf16:interleaved")


def parse_case(spec: str) -> dict:
    """SHAPE:TOKENS:ROUTING:DTYPE[:SCHEDULE] (a benchmarks.megamoe preset; schedule default interleaved)."""
    from benchmarks.megamoe import PRESETS

    parts = spec.split(":")
    if len(parts) not in (4, 5):
        raise argparse.ArgumentTypeError(f"a case is SHAPE:TOKENS:ROUTING:DTYPE[:SCHEDULE], got {spec!r}")
    shape, tokens, routing, dtype, schedule = (*parts, "interleaved")[:5]
    if shape not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown shape {shape!r}: one of {', '.join(PRESETS)}")
    if not tokens.isdigit() or int(tokens) < 1:
        raise argparse.ArgumentTypeError(f"tokens must be a positive integer, got {tokens!r}")
    if dtype not in DTYPES or schedule not in SCHEDULES:
        raise argparse.ArgumentTypeError(f"dtype one of {DTYPES}, schedule one of {SCHEDULES}: got {spec!r}")
    if routing not in ("balanced", "skewed", "one_expert"):
        raise argparse.ArgumentTypeError(f"routing balanced, skewed or one_expert, got {routing!r}")
    return {"shape": shape, "tokens": int(tokens), "routing": routing, "dtype": dtype, "schedule": schedule}


def case_inputs(case: dict, seed: int):
    """A case's (preset, row seed, w1, w2, x, topk_idx, topk_weights, layer dtype), drawn from the bench's row
    seed on the GPU: the same inputs wherever a case runs (this comparison, benchmarks.megamoe_ncu)."""
    import torch

    from benchmarks.megamoe import PRESETS, make_weights, row_seed
    from megamoe.reference import make_routing

    preset = PRESETS[case["shape"]]
    seed = row_seed(seed, preset.name, 1, case["tokens"], case["routing"])
    w1, w2 = make_weights(preset, seed, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(case["tokens"], preset.hidden, generator=gen, device="cuda").to(torch.bfloat16)
    idx, wts = make_routing(case["tokens"], preset.num_experts, preset.top_k, case["routing"], seed, "cuda")
    dtype = {"bf16": torch.bfloat16, "w8a8": torch.float8_e4m3fn}.get(case["dtype"], case["dtype"])
    return preset, seed, w1, w2, x, idx, wts, dtype


def run(args) -> None:
    import torch
    import torch.distributed as dist

    from cute_kernels.dist import process_group

    from megamoe.api import MegaMoE as NewMoE

    if args.same_tree:
        OldMoE, exported = NewMoE, "this tree"
    else:
        try:
            from old_megamoe.api import MegaMoE as OldMoE
        except ImportError as e:
            raise SystemExit(f"old_megamoe does not import ({e}): put {args.old} on PYTHONPATH") from e
        exported = old_commit(args.old)
    print(f"seed={args.seed}")
    nvml = None
    if args.energy:
        from benchmarks.power_probe import Nvml

        nvml = Nvml(torch.cuda.current_device())
    rows = []
    with process_group(0, 1, os.path.join(args.tmp, "pg")):
        group = dist.group.WORLD
        for case in args.cases:
            preset, seed, w1, w2, x, idx, wts, dtype = case_inputs(case, args.seed)
            layers = {}
            sides = [("old", OldMoE), ("new", NewMoE)] + [(n, NewMoE) for n in args.extra_sides]
            for name, cls in sides:
                layers[name] = cls(None, preset.num_experts, preset.top_k, preset.hidden, preset.intermediate,
                                   dtype=dtype, schedule=case["schedule"], max_tokens_per_rank=case["tokens"])
                layers[name].load_weights(w1, w2)
                for attr, value in args.settings.get(name, {}).items():
                    if not hasattr(layers[name], attr):
                        raise SystemExit(f"--set {name}.{attr}: the {name} layer has no attribute {attr!r}")
                    setattr(layers[name], attr, value)
            del w1, w2
            if args.stale_rows:
                fill_stale_rows(layers.values(), seed)
            outs = {n: torch.empty_like(x) for n in layers}

            def call(n):
                return lambda: outs[n].copy_(layers[n].forward(x, idx, wts))

            calls = {n: call(n) for n in layers}
            for fn in calls.values():
                fn()
            torch.cuda.synchronize()
            ref = outs["old"].float()

            def rel_diff(n):
                return float((outs[n].float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))

            diff, same = rel_diff("new"), bool(torch.equal(outs["old"], outs["new"]))
            medians, pairs, noise, extra_pairs = time_old_new(calls, args, group)
            energy = None
            if nvml is not None:
                from benchmarks.power_probe import energy_verdict, run_case

                runs = {"old": [], "new": []}
                for n in ("old", "new", "new", "old"):
                    runs[n].append(run_case(calls[n], nvml, seconds=args.energy, settle_s=args.energy * 0.4,
                                            calls_per_graph=args.calls_per_graph, flops=None))
                energy = energy_verdict(runs)
                old_e, new_e = energy["old"], energy["new"]
                print(f"  energy: old {old_e['joules_per_call']:.3f} J, new {new_e['joules_per_call']:.3f} J a call "
                      f"(new / old {energy['new_over_old_joules']:.3f}; {old_e['watts']:.0f} / {new_e['watts']:.0f} W, "
                      f"{old_e['sm_mhz']:.0f} / {new_e['sm_mhz']:.0f} MHz)", flush=True)
            extra = {n: {"us": medians[n], "minus_old_us": extra_pairs[n], "settings": args.settings.get(n, {}),
                         "identical_output": bool(torch.equal(outs["old"], outs[n])), "max_rel_diff": rel_diff(n)}
                     for n in args.extra_sides}
            rows.append({**case, "seed": seed, "old_us": medians["old"], "new_us": medians["new"],
                         "new_minus_old_us": pairs, "old_minus_old_us": noise, "identical_output": same,
                         "max_rel_diff": diff, **({"extra_sides": extra} if extra else {}),
                         **({"energy": energy} if energy else {})})
            for n, e in extra.items():
                print(f"  {n} {e['settings']}: {e['us']:.0f} µs; {n}-old by pairs {e['minus_old_us']['median_us']:+.1f} "
                      f"[{e['minus_old_us']['q1_us']:+.1f}, {e['minus_old_us']['q3_us']:+.1f}]; same bits: "
                      f"{e['identical_output']}", flush=True)
            print(f"{case['shape']} {case['tokens']} {case['routing']} {case['dtype']} {case['schedule']}: old "
                  f"{medians['old']:.0f} new {medians['new']:.0f} µs; new-old by pairs {pairs['median_us']:+.1f} "
                  f"[{pairs['q1_us']:+.1f}, {pairs['q3_us']:+.1f}], A/A {noise['median_us']:+.1f}; same bits: "
                  f"{same} (max rel diff {diff:.1e})", flush=True)
            del layers
            torch.cuda.empty_cache()
            write_result(args, exported, rows)  # after every case: a call cut short keeps the cases it finished


def fill_stale_rows(layers, seed: int) -> None:
    """Every layer's pool and intermediate rows filled with seeded random values (bf16 or e4m3 as stored): what
    earlier launches with other routings leave in the rows past an expert's tokens when serving. A fresh arena
    holds zeros there; zeros saved under 1% of the energy (docs/FINDINGS.md, pad_zero)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    for layer in layers:
        for t in (layer.state.pool, layer.state.inter):
            t.copy_(torch.randn(t.shape, generator=gen, device=t.device).to(t.dtype))


def write_result(args, exported: str, rows: list) -> None:
    from cute_kernels.runtime import provenance

    result = {"provenance": provenance(" ".join(sys.argv)), "old_commit": exported, "settings": args.settings,
              "rows": rows,
              "method": f"world size 1; {args.replays} interleaved rounds of {args.calls_per_graph}-call graphs; "
                        f"{args.pairs} alternating adjacent pairs of one-call graph replays (new - old, and old - "
                        "old as noise); outputs copied out of the layer inside each call, in both columns" +
                        (f"; energy: {args.energy} s sustained replays of old and new (old, new, new, old), NVML "
                         "power and SM clock (benchmarks.power_probe)" if args.energy else "") +
                        ("; both sides' pool and intermediate filled with random values before the first call "
                         "(--stale-rows)" if args.stale_rows else "")}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.megamoe_old_vs_new", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="result JSON")
    p.add_argument("--cases", nargs="+", type=parse_case, default=[parse_case(c) for c in DEFAULT_CASES],
                   help="SHAPE:TOKENS:ROUTING:DTYPE[:SCHEDULE] (default: " + " ".join(DEFAULT_CASES) + ")")
    p.add_argument("--same-tree", action="store_true", help="old is this tree too (with --set: a run-time knob)")
    p.add_argument("--set", nargs="+", default=[], metavar="SIDE.ATTR=INT",
                   help="set an integer attribute of one side's layers after load_weights, e.g. new.m_group=2; a side "
                        "new2, new3, ... is one more layer of this tree")
    add_timing_arguments(p, calls_per_graph=2, pairs=24)
    p.add_argument("--energy", type=float, default=0.0, metavar="S",
                   help="also each side's joules per call: sustained S-second replays, old, new, new, old (NVML)")
    p.add_argument("--stale-rows", action="store_true",
                   help="fill both sides' pool and intermediate with random values first (serving's stale rows)")
    args = p.parse_args(argv)
    if args.energy and args.energy < 2:
        p.error(f"--energy {args.energy}: at least 2 s a run (NVML's power is a running average)")
    args.settings = {}
    for spec in args.set:
        side, _, rest = spec.partition(".")
        attr, _, value = rest.partition("=")
        if not (side in ("old", "new") or side[3:].isdigit() and side.startswith("new")) or not attr \
                or not value.lstrip("-").isdigit():
            p.error(f"--set takes old.ATTR=INT, new.ATTR=INT or newN.ATTR=INT (one more side), got {spec!r}")
        args.settings.setdefault(side, {})[attr] = int(value)
    args.extra_sides = sorted(s for s in args.settings if s not in ("old", "new"))
    if not args.same_tree:
        check_old_tree(p, args.old)
    import torch

    if not torch.cuda.is_available():
        p.error("needs a GPU (this compares two kernels' times)")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
