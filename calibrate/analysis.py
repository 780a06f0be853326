"""Turn BurstGapKernel records into per-run metrics (plain numpy, no GPU).

Records are (K producers, N bursts, 8 fields) int64, fields as in ``burst_kernel.RECORD_FIELDS``.
Spans inside one SM use clock64 (cycle resolution), converted with the clock rate measured in the same
run against %globaltimer; cross-SM quantities (aggregate span, start skew) use %globaltimer.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

GT0, GT1, CK0, CK1, GT2, CK2, GT3, CK3 = range(8)


class RecordError(ValueError):
    """Records are incomplete or not monotone: the run is an error, not a data point."""


def check_records(rec: np.ndarray) -> None:
    """Every (producer, burst) row written, and each producer's timestamps non-decreasing."""
    if rec.ndim != 3 or rec.shape[2] != 8:
        raise RecordError(f"records must be (K, N, 8), got {rec.shape}")
    if (rec[:, :, GT0] == 0).any() or (rec[:, :, CK0] == 0).any():
        missing = int(((rec[:, :, GT0] == 0) | (rec[:, :, CK0] == 0)).sum())
        raise RecordError(f"{missing} record rows were never written")
    for a, b in ((GT0, GT1), (GT1, GT2), (GT2, GT3), (CK0, CK1), (CK1, CK2), (CK2, CK3)):
        if (rec[:, :, b] < rec[:, :, a]).any():
            raise RecordError(f"timestamps not monotone within a burst (field {b} < field {a})")
    if (np.diff(rec[:, :, GT0], axis=1) < 0).any() or (np.diff(rec[:, :, CK0], axis=1) <= 0).any():
        raise RecordError("burst start times not monotone across bursts")


def clock_ghz(rec: np.ndarray) -> float:
    """clock64 cycles per ns over the whole run, median over producers."""
    dck = rec[:, -1, CK3] - rec[:, 0, CK0]
    dgt = rec[:, -1, GT3] - rec[:, 0, GT0]
    ok = dgt > 0
    if not ok.any():
        raise RecordError("run too short to measure the SM clock against globaltimer")
    return float(np.median(dck[ok] / dgt[ok]))


@dataclass
class RunMetrics:
    producers: int
    bytes_per_producer: int
    bursts: int
    steady_from: int
    clock_ghz: float
    t_iss_us: float          # median over steady bursts of the mean per-producer issue span
    t_iss_p90_us: float
    t_period_us: float       # median start-to-start period (steady bursts)
    gap_us: float            # median end-of-issue to next start (the producer-side gap, measured)
    agg_issue_us: float      # median over bursts of max(end) - min(start) across producers (globaltimer)
    start_skew_us: float     # median over bursts of max(start) - min(start)
    completion_us: float     # isolated mode: median burst start to fence return (drained); else nan
    t_period_agg_us: float   # V x bursts / (last byte performed - first burst start): the delivered period

    @property
    def volume(self) -> int:
        return self.producers * self.bytes_per_producer

    def to_dict(self) -> dict:
        d = asdict(self)
        d["volume_bytes"] = self.volume
        return d


def delivered_period_us(rec: np.ndarray, delivered: np.ndarray) -> float:
    """Aggregate period from delivery: all K x N bursts over the span from the first burst start to the
    last producer's final fence (globaltimer). Unlike per-producer periods it stays V/R when the drain
    serves producers unfairly and they drift apart."""
    if delivered is None or delivered.shape[0] != rec.shape[0] or (delivered[:, 0] == 0).any():
        return float("nan")
    span_ns = delivered[:, 0].max() - rec[:, 0, GT0].min()
    return float(span_ns * 1e-3 / rec.shape[1])


def run_metrics(rec: np.ndarray, bytes_per_producer: int, isolated: bool = False,
                steady_from: int | None = None, delivered: np.ndarray | None = None) -> RunMetrics:
    """``delivered``: optional (K, 2) globaltimer/clock64 of each producer's final fence."""
    check_records(rec)
    k, n, _ = rec.shape
    ghz = clock_ghz(rec)
    cyc_to_us = 1.0 / (ghz * 1e3)
    if steady_from is None:
        steady_from = 0 if isolated else min(max(2, n // 4), n - 2)
    issue = ((rec[:, :, CK1] - rec[:, :, CK0]) * cyc_to_us).mean(axis=0)   # per burst, mean over producers
    if n >= 2 and not isolated:
        # Issue, gap and period over the same bursts b (those with a successor), so T_period >= T_iss holds
        # burst by burst and hence for the medians.
        bursts = slice(steady_from if steady_from < n - 1 else 0, n - 1)
        period = (np.diff(rec[:, :, CK0], axis=1) * cyc_to_us).mean(axis=0)[bursts]
        gap = ((rec[:, 1:, CK0] - rec[:, :-1, CK1]) * cyc_to_us).mean(axis=0)[bursts]
        t_iss_burst = issue[bursts]
        t_period, gap_med = float(np.median(period)), float(np.median(gap))
    else:
        t_iss_burst = issue
        t_period = float("nan")
        gap_med = float(np.median((rec[:, :, CK3] - rec[:, :, CK1]) * cyc_to_us))
    agg = (rec[:, :, GT1].max(axis=0) - rec[:, :, GT0].min(axis=0)) * 1e-3
    skew = (rec[:, :, GT0].max(axis=0) - rec[:, :, GT0].min(axis=0)) * 1e-3
    completion = float("nan")
    if isolated:
        completion = float(np.median(((rec[:, :, CK2] - rec[:, :, CK0]) * cyc_to_us).mean(axis=0)))
    return RunMetrics(
        producers=k, bytes_per_producer=int(bytes_per_producer), bursts=n, steady_from=steady_from,
        clock_ghz=ghz, t_iss_us=float(np.median(t_iss_burst)),
        t_iss_p90_us=float(np.percentile(t_iss_burst, 90)), t_period_us=t_period, gap_us=gap_med,
        agg_issue_us=float(np.median(agg[steady_from:])), start_skew_us=float(np.median(skew[steady_from:])),
        completion_us=completion, t_period_agg_us=delivered_period_us(rec, delivered),
    )
