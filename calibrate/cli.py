"""The ``xstage`` command line: design test, calibration and application benchmarks."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from calibrate.profile import default_profile_name, resolve_profile

PROG = "xstage"


class UsageError(Exception):
    """Bad command-line input; reported as one line and exit status 2."""


class _Parser(argparse.ArgumentParser):
    # One line on stderr instead of argparse's usage block, and no SystemExit inside main().
    def error(self, message):
        raise UsageError(message)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _float(text: str, *, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got '{text}'") from None
    if not (value >= 0 if allow_zero else value > 0) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be {'>= 0' if allow_zero else '> 0'} and finite, got {text}")
    return value


def _positive_float(text: str) -> float:
    return _float(text, allow_zero=False)


def _non_negative_float(text: str) -> float:
    return _float(text, allow_zero=True)


# --- design-test ----------------------------------------------------------------------

_TABLE_COLUMNS = (
    ("name", "{name}", "<"), ("K", "{producers}", ">"), ("B", "{bytes_per_producer:.0f}", ">"),
    ("V MiB", "{volume_MiB:.2f}", ">"), ("G us", "{gap:.2f}", ">"), ("V/R us", "{drain_time_us:.2f}", ">"),
    ("T_iss0 us", "{t_iss0:.2f}", ">"), ("G* us", "{recovery_gap:.2f}", ">"),
    ("q_peak MiB", "{q_peak_MiB:.2f}", ">"), ("Q MiB", "{capacity_MiB:.2f}", ">"),
    ("rate ok", "{rate_ok}", ">"), ("capacity ok", "{capacity_ok}", ">"), ("verdict", "{verdict}", ">"),
    ("dT_iss us", "{overhead:.2f}", ">"),
)


def _format_table(results: list[dict]) -> str:
    cells = [[title for title, _, _ in _TABLE_COLUMNS]]
    cells += [[fmt.format(**r) for _, fmt, _ in _TABLE_COLUMNS] for r in results]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_TABLE_COLUMNS))]
    lines = ["  ".join(f"{cell:{align}{w}}" for cell, (_, _, align), w in zip(row, _TABLE_COLUMNS, widths))
             for row in cells]
    lines += [f"{r['name']}: {r['reason']}" for r in results if r["verdict"] != "piggyback"]
    return "\n".join(lines)


def _bursts_from_args(args, profile):
    from calibrate.design import KernelBurst, select_presets

    custom = (args.bytes_per_producer, args.producers, args.gap_us)
    if args.preset and any(v is not None for v in custom):
        raise UsageError("give either --preset or --bytes-per-producer/--producers/--gap-us, not both")
    if args.preset:
        return select_presets(profile, args.preset, args.sigma_us)
    if any(v is None for v in custom):
        raise UsageError("give --preset NAME, or all of --bytes-per-producer, --producers and --gap-us")
    return [KernelBurst(name=args.name, producers=args.producers,
                        bytes_per_producer=args.bytes_per_producer, gap_us=args.gap_us)]


def _run_design_test(args) -> int:
    try:
        return _design_test(args)
    except (ValueError, OSError) as exc:  # bad sizes, unknown presets, bad profiles (ProfileError)
        raise UsageError(str(exc) or type(exc).__name__) from None


def _design_test(args) -> int:
    from calibrate.design import evaluate, plot_design, presets

    profile = resolve_profile(args.profile)
    if args.list_presets:
        for name, burst in presets(profile, args.sigma_us).items():
            print(f"{name:22s} {burst.description}")
        return 0
    bursts = _bursts_from_args(args, profile)
    results = [evaluate(profile, burst) for burst in bursts]
    figure = plot_design(profile, bursts, args.out)
    if args.json:
        print(json.dumps({"profile": args.profile, "provenance": profile.provenance,
                          "figure": str(figure), "verdicts": results}, indent=2))
    else:
        print(f"profile: {args.profile} (source: {profile.source}, {profile.provenance['device']}; "
              f"R = {profile.drain_rate_GBps:g} GB/s)")
        print(_format_table(results))
        print(f"figure: {figure}")
    return 0


def _add_design_test(subparsers) -> None:
    p = subparsers.add_parser("design-test", help="apply the two-bound design test (eq. 10) to kernel bursts")
    p.add_argument("--profile", default=default_profile_name(),
                   help="built-in profile name or path to a profile JSON (default: %(default)s)")
    p.add_argument("--preset", action="append", metavar="NAME",
                   help="preset burst, repeatable; 'all' or a family ('fa-a2a', 'megamoe') selects several")
    p.add_argument("--list-presets", action="store_true", help="list the presets for the profile and exit")
    p.add_argument("--bytes-per-producer", type=_positive_float, metavar="B", help="bytes each producer writes")
    p.add_argument("--producers", type=_positive_int, metavar="K", help="concurrent remote-store producers")
    p.add_argument("--gap-us", type=_non_negative_float, metavar="G", help="producer-side gap between bursts (us)")
    p.add_argument("--name", default="custom", help="name of the custom burst (default: %(default)s)")
    p.add_argument("--sigma-us", type=_positive_float, metavar="SIGMA",
                   help="FlashAttention Q-loop time per KV tile (us); overrides the profile")
    p.add_argument("--out", default="design-test.png", help="figure path (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print machine-readable verdicts")
    p.set_defaults(func=_run_design_test)


# --- calibrate and bench ----------------------------------------------------------------


def _forward(module: str, prog: str, description: str, args) -> int:
    """Run a GPU subcommand whose options live in ``module`` (add_arguments, run); imported only when asked
    for, since it needs the GPU stack."""
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise UsageError(f"{prog} is unavailable: {exc}") from None
    parser = _Parser(prog=f"{PROG} {prog}", description=description)
    mod.add_arguments(parser)
    return mod.run(parser.parse_args(args.forwarded))


def _run_calibrate(args) -> int:
    return _forward("calibrate.run", "calibrate", "measure T_iss0, R and Q on this machine", args)


def _run_bench_flash_a2a(args) -> int:
    return _forward("flash_a2a.bench", "bench flash-a2a", "FlashAttention + Ulysses A2A benchmark (GPUs)", args)


def _not_implemented(args) -> int:
    raise UsageError(f"bench {args.bench} is not implemented yet: tracked in the project issues")


def _add_calibrate_and_bench(subparsers) -> None:
    # add_help=False: --help and every option go to the command's own parser.
    p = subparsers.add_parser("calibrate", add_help=False, help="run the remote-store microbenchmarks (GPU)")
    p.set_defaults(func=_run_calibrate, forwards=True)

    bench = subparsers.add_parser("bench", help="application benchmarks")
    kinds = bench.add_subparsers(dest="bench", metavar="{flash-a2a,megamoe}", required=True)
    kinds.add_parser("flash-a2a", add_help=False, help="FlashAttention + Ulysses All-to-All (GPUs)").set_defaults(
        func=_run_bench_flash_a2a, forwards=True)
    kinds.add_parser("megamoe", help="MegaMoE benchmark (not implemented yet)").set_defaults(func=_not_implemented)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="X-Stage Burst-Gap model tools")
    subparsers = parser.add_subparsers(dest="command", metavar="{design-test,calibrate,bench}", required=True)
    _add_design_test(subparsers)
    _add_calibrate_and_bench(subparsers)
    return parser


def main(argv=None) -> int:
    try:
        args, extra = build_parser().parse_known_args(argv)
        if getattr(args, "forwards", False):
            args.forwarded = extra
        elif extra:
            raise UsageError(f"unrecognized arguments: {' '.join(extra)}")
        return args.func(args)
    except SystemExit as exc:  # --help and sub-parsers that exit on their own
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except UsageError as exc:
        print(f"{PROG}: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
