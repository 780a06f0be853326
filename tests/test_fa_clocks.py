"""CPU tests of the clock/power probe's parsing (benchmarks/fa_clocks.py): nvidia-smi rows to samples, and
the samples a phase owns."""
import datetime
import importlib.util
import pathlib

_spec = importlib.util.spec_from_file_location(
    "fa_clocks", pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "fa_clocks.py")
fa_clocks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fa_clocks)


def _stamp(sec: float) -> str:
    t = datetime.datetime(2026, 11, 30, 12, 0, 0) + datetime.timedelta(seconds=sec)
    return t.strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]


def test_parse_smi_reads_both_field_sets_and_skips_junk():
    lines = [f"{_stamp(0.0)}, 1980, 612.40, 55, 0x0000000000000000",
             f"{_stamp(0.02)}, 1755, 700.10, 56, 0x0000000000000004",
             f"{_stamp(0.04)}, 1830, 650.00, 56",  # a driver without the reasons field
             "timestamp, clocks.current.sm [MHz], power.draw [W]", "", f"{_stamp(0.06)}, 19"]
    rows = fa_clocks.parse_smi(lines)
    assert [r[1] for r in rows] == [1980.0, 1755.0, 1830.0]
    assert [r[2] for r in rows] == [612.4, 700.1, 650.0]
    assert [r[4] for r in rows] == ["0x0000000000000000", "0x0000000000000004", ""]
    assert abs((rows[1][0] - rows[0][0]) - 0.02) < 1e-6


def test_phase_samples_drop_the_settle_time_and_summarize_medians():
    base = datetime.datetime(2026, 11, 30, 12, 0, 0).timestamp()
    lines = [f"{_stamp(i * 0.1)}, {1700 + i}, {600 + 2 * i}, 50, 0x0" for i in range(30)]
    samples = fa_clocks.parse_smi(lines)
    mine = fa_clocks.phase_samples(samples, base + 1.0, base + 2.05, settle=0.25)  # no sample on a boundary
    assert [round(s[0] - base, 1) for s in mine] == [1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0]
    summary = fa_clocks.summarize(mine)
    assert summary["samples"] == 8 and summary["sm_mhz"] == 1716.5 and summary["power_w"] == 633.0
    assert summary["reasons"] == {"0x0": 8}
    assert fa_clocks.summarize([]) == {"samples": 0}
