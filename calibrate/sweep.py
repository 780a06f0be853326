"""The calibration sweep: which (mode, target, K, B, gap) points to run, and their validation.

Grids are chosen around the expected knee and plateau: B from 2 KiB to 128 KiB per producer, K from an
eighth of the SMs to all of them, FMA gaps on a geometric grid that reaches several times V/R.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

STORE_BYTES = 16  # one 128-bit store


@dataclass(frozen=True)
class Point:
    mode: str            # "rate" (zero gap, periodic), "gap" (periodic with a gap), "isolated"
    target: str          # "remote" (one peer), "all_peers" (all-to-all injection) or "local" (HBM control)
    producers: int       # K
    bytes_per_producer: int  # B
    gap_kind: str = "fma"    # "fma" (iterations) or "spin" (ns)
    gap: int = 0
    bursts: int = 24

    @property
    def volume(self) -> int:
        return self.producers * self.bytes_per_producer

    @property
    def footprint(self) -> int:
        """Bytes the run writes: every burst lands in its own ring slot, so every byte can be verified."""
        return self.volume * self.bursts

    def to_dict(self) -> dict:
        return asdict(self)


TARGETS = ("remote", "all_peers", "local")


def validate_point(p: Point, sm_count: int, buffer_bytes: int, threads: int) -> None:
    """Reject a configuration before launch, naming the fix."""
    if p.mode not in ("rate", "gap", "isolated") or p.target not in TARGETS:
        raise ValueError(f"unknown mode/target {p.mode!r}/{p.target!r}")
    if p.gap_kind not in ("fma", "spin"):
        raise ValueError(f"gap_kind must be 'fma' or 'spin', got {p.gap_kind!r}")
    if p.bytes_per_producer <= 0 or p.bytes_per_producer % STORE_BYTES:
        raise ValueError(f"B={p.bytes_per_producer} bytes per producer must be a positive multiple of 16 "
                         "(one 128-bit store)")
    if p.bytes_per_producer % (STORE_BYTES * threads):
        raise ValueError(f"B={p.bytes_per_producer} must be a multiple of {STORE_BYTES * threads} bytes "
                         f"(16 B x {threads} threads) so every thread issues the same number of stores")
    if not 1 <= p.producers <= sm_count:
        raise ValueError(f"K={p.producers} producers must be in [1, {sm_count}] (one CTA per SM, all co-resident)")
    if p.bursts < 2 and p.mode != "isolated":
        raise ValueError("periodic runs need at least 2 bursts to measure a period")
    if p.bursts < 1 or p.gap < 0:
        raise ValueError("bursts must be >= 1 and the gap >= 0")
    if p.footprint > buffer_bytes:
        raise ValueError(f"K*B*bursts = {p.footprint} bytes exceeds the {buffer_bytes}-byte destination buffer; "
                         "lower bursts or B, or pass a larger --buffer-mib")


# One FMA iteration is ~15 ns on the H200 (8 chains, 128 threads): this grid spans 0 to ~45 µs, dense near G*.
FMA_GAPS = (0, 16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1536, 2048, 3072)
SPIN_GAPS_NS = (0, 500, 1000, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 9000, 10000, 12000, 16000, 24000, 32000)
ISOLATED_B = (2048, 4096, 8192, 12288, 16384, 20480, 24576, 28672, 32768, 40960, 49152, 65536, 98304, 131072)
RATE_B = (4096, 8192, 16384, 32768, 65536)


def default_sweep(sm_count: int, quick: bool = False) -> list[Point]:
    ks = sorted({max(1, sm_count // 8), max(1, sm_count // 4), max(1, sm_count // 2), sm_count})
    pts: list[Point] = []
    # (d) zero-gap steady state across K and B: the drain rate R.
    for k in ks:
        for b in (RATE_B[1::2] if quick else RATE_B):
            pts.append(Point("rate", "remote", k, b, bursts=48))
    # (a, b) gap sweeps, remote and the local control; one spin-gap variant.
    curves = [(sm_count, 32768), (sm_count, 16384), (max(1, sm_count // 2), 32768)]
    gaps = FMA_GAPS[::2] if quick else FMA_GAPS
    for k, b in (curves[:1] if quick else curves):
        for g in gaps:
            for target in ("remote", "local"):
                pts.append(Point("gap", target, k, b, "fma", g, bursts=32))
    for g in (SPIN_GAPS_NS[::2] if quick else SPIN_GAPS_NS):
        pts.append(Point("gap", "remote", curves[0][0], curves[0][1], "spin", g, bursts=32))
    # (c) isolated bursts after a checked drain: the capacity knee.
    for k in ks[1:]:
        for b in (ISOLATED_B[::2] if quick else ISOLATED_B):
            for target in ("remote", "local"):
                pts.append(Point("isolated", target, k, b, bursts=8))
    return pts


def all_peers_sweep(points: list[Point]) -> list[Point]:
    """The all-to-all injection sweep: every remote point again, now with every rank sending at once and
    each sender's producers spread over all its peers (the traffic of a Ulysses All-to-All)."""
    from dataclasses import replace

    return [replace(p, target="all_peers") for p in points if p.target == "remote"]
