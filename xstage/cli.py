"""The ``xstage`` command line: the design test, the calibration and the application benchmarks.

It sits above every package and imports each downward: ``calibrate`` (design-test, calibrate) and
``benchmarks`` (bench flash-a2a, bench megamoe). A GPU subcommand's module is imported when it is asked for and
parses its own options (``add_arguments``, ``run``), so ``xstage --help`` and the design test need no GPU stack.
Bad input prints one ``xstage: error:`` line and exits 2.
"""
from __future__ import annotations

import argparse
import sys

from calibrate.cli import UsageError, add_design_test

PROG = "xstage"


class Parser(argparse.ArgumentParser):
    # One line on stderr instead of argparse's usage block, and no SystemExit inside main().
    def error(self, message):
        raise UsageError(message)


def _forward(prog: str, description: str, add_arguments, run, args) -> int:
    """Run a subcommand (its options: ``add_arguments(parser)``; ``run(namespace)``) on the arguments left over."""
    parser = Parser(prog=f"{PROG} {prog}", description=description)
    add_arguments(parser)
    return run(parser.parse_args(args.forwarded))


def _unavailable(prog: str, exc: ImportError) -> UsageError:
    return UsageError(f"{prog} is unavailable: {exc}")


def _run_calibrate(args) -> int:
    try:
        import calibrate.run as calibrate_run
    except ImportError as exc:
        raise _unavailable("calibrate", exc) from None
    return _forward("calibrate", "measure T_iss0, R and Q on this machine", calibrate_run.add_arguments,
                    calibrate_run.run, args)


def _run_bench_flash_a2a(args) -> int:
    try:
        import benchmarks.flash_a2a_bench as flash_a2a_bench
    except ImportError as exc:
        raise _unavailable("bench flash-a2a", exc) from None
    return _forward("bench flash-a2a", "FlashAttention + Ulysses A2A benchmark (GPUs)",
                    flash_a2a_bench.add_arguments, flash_a2a_bench.run, args)


def _run_bench_megamoe(args) -> int:
    import benchmarks.megamoe_cli as cli

    if "--matrix" in args.forwarded:  # its own options (benchmarks/megamoe_matrix.py)
        import benchmarks.megamoe_matrix as matrix

        return _forward("bench megamoe --matrix", "MegaMoE wave vs interleaved over the configuration matrix",
                        matrix.add_arguments, cli.run_matrix, args)
    import benchmarks.megamoe as megamoe

    return _forward("bench megamoe", "MegaMoE against the unfused paths and the roofline (one GPU, emulated or real "
                    "ranks)", megamoe.add_arguments, cli.run_bench, args)


def _add_calibrate_and_bench(subparsers) -> None:
    # add_help=False: --help and every option go to the command's own parser.
    p = subparsers.add_parser("calibrate", add_help=False, help="run the remote-store microbenchmarks (GPU)")
    p.set_defaults(func=_run_calibrate, forwards=True)

    bench = subparsers.add_parser("bench", help="application benchmarks")
    kinds = bench.add_subparsers(dest="bench", metavar="{flash-a2a,megamoe}", required=True)
    kinds.add_parser("flash-a2a", add_help=False, help="FlashAttention + Ulysses All-to-All (GPUs)").set_defaults(
        func=_run_bench_flash_a2a, forwards=True)
    kinds.add_parser("megamoe", add_help=False,
                     help="MegaMoE against the unfused paths (one GPU, or real ranks)").set_defaults(
        func=_run_bench_megamoe, forwards=True)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description="X-Stage Burst-Gap model tools")
    subparsers = parser.add_subparsers(dest="command", metavar="{design-test,calibrate,bench}", required=True)
    add_design_test(subparsers)
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
