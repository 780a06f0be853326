"""The design test's command-line pieces: its parser (``add_design_test``) and runner (``run_design_test``), and
the one-line usage error every ``xstage`` subcommand raises. The ``xstage`` command itself is xstage/cli.py."""

from __future__ import annotations

import argparse
import json

from calibrate.profile import default_profile_name, resolve_profile


class UsageError(Exception):
    """Bad command-line input; reported as one line and exit status 2."""


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

def _pct(x: float) -> str:
    return f"{100 * x:.2f}"


# (title with its unit, cell, alignment). eq. 4 prices the rate bound, eq. 7 the capacity bound (see NOTES).
_TABLE_COLUMNS = (
    ("name", lambda r: r["name"], "<"),
    ("K", lambda r: f"{r['producers']}", ">"),
    ("B KiB", lambda r: f"{r['bytes_per_producer'] / 1024:g}", ">"),
    ("V MiB", lambda r: f"{r['volume_MiB']:.2f}", ">"),
    ("G us", lambda r: f"{r['gap']:.2f}", ">"),
    ("V/R us", lambda r: f"{r['drain_time_us']:.2f}", ">"),
    ("T_iss0 us", lambda r: f"{r['t_iss0']:.2f}", ">"),
    ("G* us", lambda r: f"{r['recovery_gap']:.2f}", ">"),
    ("q_peak MiB", lambda r: f"{r['q_peak_MiB']:.2f}", ">"),
    ("Q(K) MiB", lambda r: f"{r['capacity_MiB']:.2f}", ">"),
    ("rate", lambda r: "ok" if r["rate_ok"] else "FAILS", ">"),
    ("capacity", lambda r: "ok" if r["capacity_ok"] else "FAILS", ">"),
    ("eq4 dT us", lambda r: f"{r['overhead']:.2f}", ">"),
    ("eq7 T_iss us", lambda r: f"{r['t_iss_isolated']:.2f}", ">"),
    ("eq7 dT us", lambda r: f"{r['capacity_overhead']:.2f}", ">"),
    ("cost %", lambda r: _pct(r["cost_fraction"]), ">"),
    ("decides", lambda r: r["decided_by"], ">"),
    ("verdict", lambda r: r["verdict"], ">"),
)
_TABLE_NOTES = ("rate: V/(T_iss0 + G) <= R; capacity: q_peak = [V - R T_iss0]+ <= Q(K) (eq. 10). "
                "eq4 dT = [V/R - G - T_iss0]+ (rate-bound cost per burst); eq7 T_iss = max(T_iss0, (V - Q)/R), "
                "eq7 dT = eq7 T_iss - T_iss0 (capacity-bound cost per burst); decides: the bound with the larger "
                "cost; cost % = that cost / (T_iss0 + cost + G); verdict: piggyback when the cost is within the "
                "tolerance of {tolerance}% of the period (0: eq. 10 strictly), else reshape.")


def _last_round_note(r: dict) -> str | None:
    """One line on our kernel's last remote round (stretch 2 of the walk), when it is larger than the wave."""
    last = r.get("last_remote_round")
    if not last or last["producers"] == r["producers"]:
        return None
    fits = last["q_peak_MiB"] <= last["capacity_MiB"]
    return (f"{r['name']}: round {last['round']} (the last remote round, once) sends {last['producers']} tiles, "
            f"{last['volume_MiB']:.2f} MiB: q_peak {last['q_peak_MiB']:.2f} {'<=' if fits else '>'} "
            f"Q({last['producers']}) {last['capacity_MiB']:.2f} MiB, eq. 7 +{last['capacity_overhead_us']:.2f} us; "
            f"all {sum(1 for c in r['remote_tiles_per_round'] if c)} remote rounds together "
            f"+{r['capacity_overhead_all_rounds_us']:.2f} us if their boundaries align")


def _format_table(results: list[dict], tolerance: float | None = None) -> str:
    cells = [[title for title, _, _ in _TABLE_COLUMNS]]
    cells += [[cell(r) for _, cell, _ in _TABLE_COLUMNS] for r in results]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_TABLE_COLUMNS))]
    lines = ["  ".join(f"{cell:{align}{w}}" for cell, (_, _, align), w in zip(row, _TABLE_COLUMNS, widths))
             for row in cells]
    if results:
        tolerance = results[0]["tolerance"] if tolerance is None else tolerance
        lines.append(_TABLE_NOTES.format(tolerance=f"{100 * tolerance:g}"))
    for r in results:
        if not (r["rate_ok"] and r["capacity_ok"]):
            lines.append(f"{r['name']}: {r['reason']}")
        note = _last_round_note(r)
        if note:
            lines.append(note)
    return "\n".join(lines)


def _shape_options(args) -> dict:
    return {"world": args.world, "heads_per_rank": tuple(args.heads_per_rank), "seq_lens": tuple(args.seq_lens)}


def _bursts_from_args(args, profile):
    from calibrate.design import KernelBurst, select_presets

    custom = (args.bytes_per_producer, args.producers, args.gap_us)
    if args.preset and any(v is not None for v in custom):
        raise UsageError("give either --preset or --bytes-per-producer/--producers/--gap-us, not both")
    if args.preset:
        return select_presets(profile, args.preset, args.sigma_us, **_shape_options(args))
    if any(v is None for v in custom):
        raise UsageError("give --preset NAME, or all of --bytes-per-producer, --producers and --gap-us")
    return [KernelBurst(name=args.name, producers=args.producers,
                        bytes_per_producer=args.bytes_per_producer, gap_us=args.gap_us)]


def run_design_test(args) -> int:
    try:
        return _design_test(args)
    except (ValueError, OSError) as exc:  # bad sizes, unknown presets, bad profiles (ProfileError)
        raise UsageError(str(exc) or type(exc).__name__) from None


def _world_note(profile, results: list[dict]) -> str | None:
    """A line when a preset's world size differs from the one the profile was measured at."""
    measured = profile.provenance.get("world_size")
    worlds = sorted({r["world"] for r in results if "world" in r and r["world"] != measured})
    if not worlds:
        return None
    return (f"note: the profile was measured at P = {measured}; presets at P = {', '.join(map(str, worlds))} use "
            f"its R, T_iss0 and Q, which a machine with that many peers may not share")


def _design_test(args) -> int:
    from calibrate.design import RESULT_UNITS, evaluate, plot_design, presets

    profile = resolve_profile(args.profile)
    if args.list_presets:
        for name, burst in presets(profile, args.sigma_us, **_shape_options(args)).items():
            print(f"{name:22s} {burst.description}")
        return 0
    bursts = _bursts_from_args(args, profile)
    results = [evaluate(profile, burst, args.tolerance) for burst in bursts]
    figure = plot_design(profile, bursts, args.out, args.tolerance)
    if args.json:
        print(json.dumps({"profile": args.profile, "provenance": profile.provenance, "figure": str(figure),
                          "tolerance": args.tolerance, "units": RESULT_UNITS, "verdicts": results}, indent=2))
    else:
        print(f"profile: {args.profile} (source: {profile.source}, {profile.provenance['device']}; "
              f"R = {profile.drain_rate_GBps:g} GB/s)")
        note = _world_note(profile, results)
        if note:
            print(note)
        print(_format_table(results, args.tolerance))
        print(f"figure: {figure}")
    return 0


def add_design_test(subparsers) -> None:
    from calibrate.design import DEFAULT_TOLERANCE, FA_HEADS_PER_RANK, FA_SEQ_LENS, FA_WORLD

    p = subparsers.add_parser("design-test", help="apply the two-bound design test (eq. 10) to kernel bursts")
    p.add_argument("--profile", default=default_profile_name(),
                   help="built-in profile name or path to a profile JSON (default: %(default)s)")
    p.add_argument("--preset", action="append", metavar="NAME",
                   help="preset burst, repeatable; 'all' or a family ('fa-a2a', 'fa-a2a-p2-h3', 'paper-fa-a2a', "
                        "'megamoe') selects several")
    p.add_argument("--list-presets", action="store_true", help="list the presets for the profile and exit")
    p.add_argument("--bytes-per-producer", type=_positive_float, metavar="B", help="bytes each producer writes")
    p.add_argument("--producers", type=_positive_int, metavar="K", help="concurrent remote-store producers")
    p.add_argument("--gap-us", type=_non_negative_float, metavar="G", help="producer-side gap between bursts (us)")
    p.add_argument("--name", default="custom", help="name of the custom burst (default: %(default)s)")
    p.add_argument("--sigma-us", type=_positive_float, metavar="SIGMA",
                   help="FlashAttention Q-loop time per KV tile (us); overrides the profile")
    p.add_argument("--world", type=_positive_int, default=FA_WORLD, metavar="P",
                   help="world size P of our fused FA-A2A presets (default: %(default)s, as measured)")
    p.add_argument("--heads-per-rank", type=_positive_int, nargs="+", default=list(FA_HEADS_PER_RANK),
                   metavar="H", help="heads per rank H/P of our fused FA-A2A presets (default: %(default)s)")
    p.add_argument("--seq-lens", type=_positive_int, nargs="+", default=list(FA_SEQ_LENS), metavar="S",
                   help="sequence lengths of the FA-A2A presets, multiples of P x 128 (default: %(default)s)")
    p.add_argument("--tolerance", type=_non_negative_float, default=DEFAULT_TOLERANCE, metavar="FRACTION",
                   help="largest modeled backpressure cost per burst, as a fraction of its period, that still "
                        "counts as piggyback; 0 is eq. 10 strictly (default: %(default)s, the H >= 0.98 target)")
    p.add_argument("--out", default="design-test.png", help="figure path (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print machine-readable verdicts")
    p.set_defaults(func=run_design_test)
