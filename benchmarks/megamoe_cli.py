"""``xstage bench megamoe [--matrix]`` (and ``python -m benchmarks.megamoe_cli``): the command's runners above
the bench (benchmarks/megamoe.py), the matrix (benchmarks/megamoe_matrix.py) and their real-rank phases
(benchmarks/megamoe_ep.py): parse, resolve each world's rank mode, run in this process or in P spawned ranks."""
from __future__ import annotations

import sys

from benchmarks import megamoe as mb
from benchmarks import megamoe_ep
from benchmarks import megamoe_matrix as mx
from benchmarks.megamoe_ranks import rank_modes
from calibrate.cli import UsageError


def run_bench(args) -> int:
    """``xstage bench megamoe``: the rows at every world, local or at real ranks."""
    if getattr(args, "matrix", False):
        raise UsageError("--matrix has its own options: run it as xstage bench megamoe --matrix ...")
    if args.replays < 1 or args.calls_per_graph < 1:
        raise UsageError("--replays and --calls-per-graph must be at least 1")
    _resolve_ranks(args, "bench megamoe")
    if "real" in args.rank_modes.values():
        megamoe_ep.run_bench(args)
    else:
        with mb.local_group(args.tmp) as group:
            mb.bench(args, group)
    print(f"wrote {args.out}", flush=True)
    return 0


def run_matrix(args) -> int:
    """``xstage bench megamoe --matrix``: plan, replot, or run the matrix, local or at real ranks."""
    mx.resolve(args)
    if args.trials < 1 or args.calls_per_graph < 1:
        raise UsageError("--trials and --calls-per-graph must be at least 1")
    if args.replot:
        return mx.replot(args)
    if args.plan:  # no GPU needed: a real world is planned as asked (or as the GPUs visible here would run it)
        args.gpus = _visible_gpus()
        args.rank_modes = rank_modes(args.ranks, args.world, args.gpus, check=False)
        p = mx.plan(args)
        for r in p["configurations"]:
            print(f"{r['key']:40s} {r['memory_gb']:7.1f} GB  " + (r["skip"] or f"~{r['estimated_s']:.1f} s"))
        alone = ", ".join(f"{d} alone {p['estimated_s'][d]} s" for d in args.precision)
        dump = (f"; --dump adds {p['estimated_s']['dump']} s of it (an instrumented layer per layer, an "
                "instrumented launch per schedule and configuration)" if "dump" in p["estimated_s"] else "")
        print(f"capacity {p['capacity_gb']:.1f} GB; estimated {p['estimated_s']['all']} s in all ({alone}; start-up "
              f"{mx.EST['startup_s']:g} s included in each; at bf16 rates, an upper bound for w8a8 and w4a8{dump})")
        return 0
    _resolve_ranks(args, "bench megamoe --matrix", "; --plan and --replot do not")
    if "real" in args.rank_modes.values():
        result = megamoe_ep.run_matrix(args)
    else:
        with mb.local_group(args.tmp) as group:
            result = mx.run_matrix(args, group)
    print(f"wrote {args.out}, {args.md}, {args.png}: " + ", ".join(
        f"{n} {v}" for n, v in result["summary"]["counts"].items()), flush=True)
    return 0


def _resolve_ranks(args, command: str, hint: str = "") -> None:
    """The GPUs this run sees and each world's rank mode (local or real), printed; ``command`` needs a GPU."""
    import torch

    if not torch.cuda.is_available():
        raise UsageError(f"{command} needs a CUDA GPU (torch.cuda.is_available() is False){hint}")
    args.gpus = torch.cuda.device_count()
    args.rank_modes = rank_modes(args.ranks, args.world, args.gpus)
    print("ranks: " + ", ".join(f"world {w} {m}" for w, m in args.rank_modes.items()), flush=True)


def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no torch or no driver: none visible
        return 0


def main(argv=None) -> int:
    """``python -m benchmarks.megamoe_cli [--matrix] ...`` (the same as ``xstage bench megamoe [--matrix] ...``)."""
    from benchmarks.entry import module_main

    argv = sys.argv[1:] if argv is None else list(argv)
    if "--matrix" in argv:
        return module_main("xstage bench megamoe --matrix", mx.__doc__.splitlines()[0], mx.add_arguments,
                           run_matrix, argv)
    return module_main("xstage bench megamoe", mb.__doc__.splitlines()[0], mb.add_arguments, run_bench, argv)


if __name__ == "__main__":
    raise SystemExit(main())
