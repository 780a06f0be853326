"""An older commit's kernels beside this tree's, timed side by side in one process on one GPU: the check a
refactor owes where an instruction of a kernel legitimately moved (benchmarks.sass_fingerprints shows which).

    python -m benchmarks.old_vs_new --prepare 43e424d        # here (git, no GPU): .oldtree/old_flash_a2a, ...
    PYTHONPATH=$PWD:$PWD/.oldtree python -m benchmarks.old_vs_new --out J [--shapes 1x8192x3 ...]   # the GPU

``--prepare`` exports the commit's ``flash_a2a``, ``megamoe`` and ``cute_kernels`` into ``.oldtree/`` as ``old_*``
(their imports renamed), so both versions import in one process (``benchmarks.megamoe_old_vs_new`` times the
MegaMoE layers the same way). The run times FA-only
(``flash_attention`` at its defaults, in the fused kernel's tile order for 2 ranks, as the benchmark's FA-only
column does; ``--tile-order-world 1``: the local kernel) of both by CUDA-Graph replay: interleaved rounds in a
fresh order each round, and adjacent-launch pairs in alternating order (old, new; new, old) whose median
difference is the verdict; an old-against-old pair set gives the run's noise. Both outputs are compared bit for bit (the refactor must not change them).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tarfile

OLD_DIR = ".oldtree"
PACKAGES = ("flash_a2a", "megamoe", "cute_kernels")  # every kernel package (benchmarks.megamoe_old_vs_new uses megamoe)
# split shapes (the tail launch moved) and unsplit ones (byte-identical: a control), bf16, d = 128 and 64
DEFAULT_SHAPES = ("1x8192x3", "1x16384x12", "1x32768x12", "1x16384x3", "1x8192x12", "1x8192x3x64")


WORKTREE = "WORKTREE"  # --prepare WORKTREE: this working tree's files (a device copy has no git)


def _sources(commit: str):
    """(path, text) of every .py file of PACKAGES at ``commit``, or in the working tree for WORKTREE."""
    if commit == WORKTREE:
        for pkg in PACKAGES:
            for root, _, files in sorted(os.walk(pkg)):
                for name in sorted(files):
                    if name.endswith(".py"):
                        with open(os.path.join(root, name)) as f:
                            yield os.path.join(root, name), f.read()
        return
    blob = subprocess.run(["git", "archive", "--format=tar", commit, *PACKAGES], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.endswith(".py"):
                yield member.name, tar.extractfile(member).read().decode()


def prepare(commit: str, into: str = OLD_DIR) -> str:
    """Export ``commit``'s packages (WORKTREE: the working tree's) under ``into`` with every import of them
    renamed ``old_*``."""
    pattern = re.compile(r"\b(" + "|".join(PACKAGES) + r")\b")
    for name, text in _sources(commit):
        path = os.path.join(into, "old_" + name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            # the old copy's custom ops under their own namespace (one name cannot be defined twice)
            text = text.replace('"xstage::', '"xstage_old::').replace("torch.ops.xstage.", "torch.ops.xstage_old.")
            f.write(pattern.sub(lambda m: "old_" + m.group(1), text))
    if commit == WORKTREE:
        commit = os.environ.get("XSTAGE_GIT_COMMIT", WORKTREE)
    with open(os.path.join(into, "COMMIT"), "w") as f:
        f.write(commit + "\n")
    return into


class ShapeError(ValueError, argparse.ArgumentTypeError):
    """A shape that is not BxSxH[xD]: a ValueError to callers, and argparse prints its message."""


def parse_shape(spec: str) -> tuple[int, int, int, int]:
    """"BxSxH" (d = 128) or "BxSxHxD" -> (b, S, H, d); also benchmarks.fa_clocks' shapes."""
    parts = [int(x) for x in spec.split("x")]
    if len(parts) not in (3, 4):
        raise ShapeError(f"a shape is BxSxH or BxSxHxD, got {spec!r}")
    return (*parts, 128)[:4]


def add_timing_arguments(p, *, calls_per_graph: int, pairs: int) -> None:
    """The options every old-against-new runner takes: the exported tree and the timing (``time_old_new``)."""
    p.add_argument("--old", default=OLD_DIR,
                   help="the exported tree (python -m benchmarks.old_vs_new --prepare; on PYTHONPATH for the run)")
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--calls-per-graph", type=int, default=calls_per_graph)
    p.add_argument("--pairs", type=int, default=pairs)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tmp", default="/tmp")


def check_old_tree(p, old: str) -> None:
    """Refuse (``p.error``) a tree with no exported commit."""
    if not os.path.isfile(os.path.join(old, "COMMIT")):
        p.error(f"{old} holds no exported commit: run python -m benchmarks.old_vs_new --prepare COMMIT first and "
                f"carry {old}")


def old_commit(old: str) -> str:
    """The commit exported into ``old``."""
    with open(os.path.join(old, "COMMIT")) as f:
        return f.read().strip()


def time_old_new(calls: dict, args, group) -> tuple[dict, dict, dict, dict]:
    """``calls`` {"old": fn, "new": fn, ...} timed side by side: medians of ``args.replays`` interleaved rounds of
    ``args.calls_per_graph``-call graphs, new - old over ``args.pairs`` alternating adjacent one-call replays,
    old - old over as many (the run's noise), and each further side - old the same way ({name: pairs})."""
    from benchmarks.timing import alternated_excess, capture_graph, measure_rounds

    columns = {n: (fn, capture_graph(fn, args.calls_per_graph, group)[0]) for n, fn in calls.items()}
    medians, _ = measure_rounds(columns, args.calls_per_graph, args.replays, group)
    one = {n: capture_graph(fn, 1, group)[0] for n, fn in calls.items()}
    pairs = alternated_excess(one["old"].replay, one["new"].replay, args.pairs, group)
    noise = alternated_excess(one["old"].replay, capture_graph(calls["old"], 1, group)[0].replay, args.pairs, group)
    extra = {n: alternated_excess(one["old"].replay, g.replay, args.pairs, group)
             for n, g in one.items() if n not in ("old", "new")}
    return medians, pairs, noise, extra


def run(args) -> dict:
    import torch
    import torch.distributed as dist

    from cute_kernels.dist import process_group
    from cute_kernels.runtime import provenance

    try:
        from old_flash_a2a.api import flash_attention as old_fa
    except ImportError as e:
        raise SystemExit(f"old_flash_a2a does not import ({e}): put {args.old} on PYTHONPATH") from e
    from flash_a2a.api import flash_attention as new_fa

    exported = old_commit(args.old)
    rows = []
    with process_group(0, 1, os.path.join(args.tmp, "pg")):
        group = dist.group.WORLD
        torch.manual_seed(args.seed)
        print(f"seed={args.seed}")
        for b, s, h, d in args.shapes:
            q, k, v = (torch.randn(b, s, h, d, device="cuda").to(torch.bfloat16) for _ in range(3))
            outs = {"old": torch.empty_like(q), "new": torch.empty_like(q)}
            calls = {"old": lambda: old_fa(q, k, v, out=outs["old"], tile_order_world=args.tile_order_world),
                     "new": lambda: new_fa(q, k, v, out=outs["new"], tile_order_world=args.tile_order_world)}
            medians, pairs, noise, _ = time_old_new(calls, args, group)
            torch.cuda.synchronize()
            rows.append({"shape": [b, s, h, d], "old_us": medians["old"], "new_us": medians["new"],
                         "new_minus_old_us": pairs, "old_minus_old_us": noise,
                         "identical_output": bool(torch.equal(outs["old"], outs["new"]))})
            r = rows[-1]
            print(f"{b}x{s}x{h}x{d}: old {r['old_us']:.1f} new {r['new_us']:.1f} µs; new-old by pairs "
                  f"{pairs['median_us']:+.2f} [{pairs['q1_us']:+.2f}, {pairs['q3_us']:+.2f}], A/A "
                  f"{noise['median_us']:+.2f} [{noise['q1_us']:+.2f}, {noise['q3_us']:+.2f}]; "
                  f"same bits: {r['identical_output']}", flush=True)
    return {"provenance": provenance(" ".join(sys.argv)), "old_commit": exported, "rows": rows,
            "method": f"{args.replays} interleaved rounds of {args.calls_per_graph}-call graphs; {args.pairs} "
                      "alternating adjacent pairs of one-call graph replays (new - old, and old - old as noise)"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.old_vs_new", description=__doc__.split("\n")[0])
    p.add_argument("--prepare", metavar="COMMIT", help="export COMMIT's kernels into --old (needs git; no GPU); "
                   "WORKTREE: the working tree's (on a device copy, before a patch is applied to another copy)")
    p.add_argument("--out", help="result JSON (the GPU run)")
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape(x) for x in DEFAULT_SHAPES],
                   help="BxSxH[xD] shapes (default: split and unsplit FA-only shapes)")
    p.add_argument("--tile-order-world", type=int, default=2,
                   help="FA-only walks the fused tile order of this many ranks (1: the local one-launch kernel)")
    add_timing_arguments(p, calls_per_graph=8, pairs=48)
    args = p.parse_args(argv)
    if args.prepare:
        print(f"exported {args.prepare} into {prepare(args.prepare, args.old)}")
        return 0
    if not args.out:
        p.error("give --prepare COMMIT (here) or --out JSON (on the GPU)")
    check_old_tree(p, args.old)
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
