"""CPU tests of the clock/power probe's parsing (benchmarks/fa_clocks.py): nvidia-smi rows to samples, and
the samples a phase owns; the two-rank fused probe (benchmarks/fused_clocks.py): its phase order and its
split of a time difference into cycles and clock; and the link power probe's pairing (benchmarks/link_power.py)."""
import datetime
import json
import os
import pathlib
import random
import statistics

import pytest

from benchmarks import fa_clocks, fused_clocks, link_power
from benchmarks.variant_sets import parse_variants

REPO = pathlib.Path(__file__).resolve().parents[2]


def _rng(seed: int) -> random.Random:
    print(f"seed={seed}")
    return random.Random(seed)


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


def test_fused_clocks_rotates_the_kernels():
    names = ["fa_ours", "fused", "fused_self"]
    orders = [fused_clocks.phase_order(names, p) for p in range(3)]
    assert orders[1] == ["fused", "fused_self", "fa_ours"]
    # every kernel comes first once and follows every other once in three phases
    assert sorted(o[0] for o in orders) == sorted(names)
    assert fused_clocks.phase_order(names, 3) == names


@pytest.mark.parametrize("flip", [False, True])
def test_fused_clocks_splits_time_into_cycles_and_clock(flip):
    # fused: the same cycles as FA-only at a clock 2% lower in every phase; self: 1% more cycles, same clock.
    # One GPU runs 3% faster (with flip, GPU 0 in odd phases, GPU 1 in even ones); the fused kernels hold the
    # ranks together (each takes the slower's time), so their time is compared with FA-only's slowest rank,
    # and their clock and cycles on the phase's slower GPU, where no wait for the peer counts as cycles.
    rng = _rng(7)
    rows = []
    for phase in range(4):
        mhz = 1600.0 + rng.uniform(-40, 40)  # drift shared by the kernels of one phase
        fast = (phase + 1) % 2 if flip else 1
        for name, cycles, scale in (("fa_ours", 35.0, 1.0), ("fused", 35.0, 0.98), ("fused_self", 35.35, 1.0)):
            clocks = [mhz * scale * (1.03 if rank == fast else 1.0) for rank in range(2)]
            own = [cycles * 1e6 / c for c in clocks]
            for rank in range(2):
                us = own[rank] if name == "fa_ours" else max(own)
                rows.append({"shape": "1x49152x12", "kernel": name, "phase": phase, "rank": rank, "samples": 9,
                             "us_per_launch": us, "sm_mhz": clocks[rank], "power_w": 690.0, "temp_c": 60.0,
                             "mcycles": us * clocks[rank] / 1e6, "mj_per_launch": us * 690.0 / 1e3})
    rows.append({"shape": "1x49152x12", "kernel": "fused", "phase": 9, "rank": 0, "samples": 0,
                 "us_per_launch": 1e9})  # no samples, but timed: it counts in the time, not in the clocks
    per = fused_clocks.summarize_kernels(rows)["1x49152x12"]
    assert per["fa_ours"]["phases"] == 4 and per["fused"]["phases"] == 4
    d_fused, d_self = per["fused"]["minus_fa_ours"], per["fused_self"]["minus_fa_ours"]
    slow_fa = [max(r["us_per_launch"] for r in rows if r["kernel"] == "fa_ours" and r["phase"] == p)
               for p in range(4)]
    # time: against FA-only's slower rank, so only the fused kernel's own 2% clock shows, none of the ranks'
    assert abs(d_fused["us_per_launch"] / statistics.median(slow_fa) - 1 / 0.98 + 1) < 2e-3
    assert abs(d_self["us_per_launch"] / statistics.median(slow_fa) - 0.01) < 2e-3
    # on the slower GPU of each phase: the fused kernel's 2% clock at equal cycles, the self-store's cycles
    assert abs(d_fused["slow_rank"]["mcycles"]) < 1e-9 and d_fused["slow_rank"]["sm_mhz"] < -25
    assert abs(d_self["slow_rank"]["mcycles"] - 0.35) < 1e-9 and abs(d_self["slow_rank"]["sm_mhz"]) < 1e-9
    assert d_self["slow_rank"]["phases"] == 4 and d_self["pairs"] == 8 and d_self["phases"] == 4
    # over both ranks the faster GPU's wait shows up as cycles (why the slow rank is read)
    assert d_self["mcycles"] > 0.35 + 0.1
    assert "minus_fa_ours" not in per["fa_ours"]
    assert per["fused"]["us_per_launch"] < 1e6  # the unsampled row's phase has no FA-only phase to pair


def test_fused_clocks_refuses_ambiguous_variants():
    assert parse_variants('{"pb": {"mode": "piggyback"}, "nosplit": {"tail_split": false}}', fused_clocks.BUILT_IN) \
        == {"pb": {"mode": "piggyback"}, "nosplit": {"tail_split": False}}
    with pytest.raises(ValueError, match="more than once"):
        parse_variants('{"pb": {"mode": "piggyback"}, "pb": {"tail_split": false}}', fused_clocks.BUILT_IN)
    with pytest.raises(ValueError, match="built-in column 'fused_self'"):
        parse_variants('{"self": {"mode": "piggyback"}}', fused_clocks.BUILT_IN)
    with pytest.raises(ValueError, match="remote_first not an option"):
        parse_variants('{"rf": {"mode": "piggyback", "remote_first": true}}', fused_clocks.BUILT_IN)


def test_fused_clocks_replot_writes_beside_its_input(tmp_path):
    """--plot recomputes the summaries from the phases into <name>.replot.json and <name>.replot.png; the saved
    result keeps its bytes."""
    rng = _rng(420)
    rows = []
    for phase in range(3):
        for name in ("fa_ours", "fused", "serial_ours_nccl"):
            for rank in range(2):
                us = {"fa_ours": 2e4, "fused": 2.01e4, "serial_ours_nccl": 2.05e4}[name] + rng.uniform(-5, 5)
                rows.append({"shape": "1x49152x12", "kernel": name, "phase": phase, "rank": rank, "samples": 9,
                             "us_per_launch": us, "sm_mhz": 1600.0, "power_w": 690.0, "temp_c": 60.0,
                             "mcycles": us * 1600.0 / 1e6, "mj_per_launch": us * 690.0 / 1e3})
    path = tmp_path / "fc.json"
    path.write_text(json.dumps({"phases": rows, "world": 2, "provenance": {"device": "x", "git_commit": "abc"}}))
    before = path.read_bytes()
    out_json, png = fused_clocks.replot(str(path))
    assert path.read_bytes() == before and not (tmp_path / "fc.png").exists()
    assert out_json == str(tmp_path / "fc.replot.json") and os.path.getsize(png) > 10_000
    result = json.loads((tmp_path / "fc.replot.json").read_text())
    assert "fused/serial_ours_nccl" in result["hiding"]["1x49152x12"]


def test_sampler_child_dies_with_its_parent_and_keeps_no_pipe(tmp_path):
    """A sampler started by a process that is then killed is ended too, and holds none of the caller's pipes
    (a two-rank run whose rank failed once left nvidia-smi holding `| tee` open until the call's limit: its
    stderr was the rank's)."""
    import subprocess
    import sys
    import time

    code = ("import sys, time; from benchmarks import fa_clocks; "
            "p = fa_clocks.spawn_tied(['sleep', '600'], open(sys.argv[1], 'w')); print(p.pid, flush=True); "
            "time.sleep(600)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    parent = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "log")], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()
    # EOF on both pipes at once: the child holds neither (else this times out while it sleeps)
    out, err = parent.communicate(timeout=20)
    assert out == "" and err == ""

    def alive(pid: int) -> bool:  # a zombie (killed, not yet reaped by an init that may never reap) is dead
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    for _ in range(100):
        if not alive(child):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the sampler outlived its parent")


def test_link_power_pairs_peer_and_local_rows_of_the_same_rank_and_phase():
    """The peer - local difference is taken per (rank, phase): a drift shared by both rows of a phase cancels,
    and one glitched phase is one difference among many, where the difference of the unpaired medians would
    mix phases and ranks (here it would be far off); rows without samples are left out."""
    rng = _rng(401)
    link_w = rng.uniform(5.0, 40.0)
    rows = []
    for rank, offset in ((0, 0.0), (1, rng.uniform(20.0, 60.0))):  # rank 1's board draws more throughout
        for phase in range(3):
            drift = 100.0 * phase  # both rows of a phase see it
            glitch = -300.0 if (rank, phase) == (1, 2) else 0.0  # one peer row sampled through a dip
            rows.append({"rank": rank, "phase": phase, "load": "idle", "target": "none", "samples": 5,
                         "power_w": 80.0 + offset, "sm_mhz": 345.0})
            local = 150.0 + offset + drift
            rows.append({"rank": rank, "phase": phase, "load": "trickle", "target": "local", "samples": 5,
                         "power_w": local, "sm_mhz": 1980.0, "gb_per_s": 1.6})
            rows.append({"rank": rank, "phase": phase, "load": "trickle", "target": "peer", "samples": 5,
                         "power_w": local + link_w + glitch, "sm_mhz": 1980.0 - phase, "gb_per_s": 1.5})
    rows.append({"rank": 0, "phase": 3, "load": "trickle", "target": "peer", "samples": 0})  # no samples: out
    s = link_power.summarize_loads(rows)
    diff = s["trickle"]["peer_minus_local"]
    assert diff["power_w"] == pytest.approx(link_w)
    assert diff["pairs"] == 6 and diff["sm_mhz"] == pytest.approx(-1.0)
    unpaired = s["trickle"]["peer"]["power_w"] - s["trickle"]["local"]["power_w"]
    assert abs(unpaired - link_w) > 5.0  # what the pairing protects against
    assert s["trickle"]["peer"]["gb_per_s"] == 1.5 and s["idle"]["sm_mhz"] == 345.0


def test_link_power_loads_fit_the_burst_kernel():
    """Every load's bursts are whole 128-bit stores for 128 threads and fit the probe's default region."""
    for name, (producers, burst_bytes, gap_kind, gap, bursts) in link_power.LOADS.items():
        assert gap_kind in ("spin", "fma") and gap >= 0 and bursts > 0, name
        assert burst_bytes % (16 * 128) == 0, name
        assert producers * burst_bytes <= 16 << 20, name
        assert gap < 2 ** 31, name  # the kernel's gap is an Int32 (ns for spin gaps)


def test_link_power_reads_the_threshold_nvidia_smi_reported():
    text = ("\t Low Power Threshold are in units of 100 us\n\t Link 0: Low Power Mode: Low Power State\n"
            "\t Link 0: Low Power Threshold: 50000 us\n\t Link 1: Low Power Threshold: 20000 us\n")
    assert link_power.low_power_threshold_ms([{"nvlink": {"nvlink_low_power": text}}]) == 50.0
    assert link_power.low_power_threshold_ms([{"nvlink": {"nvlink_low_power": "unavailable"}}], 7.0) == 7.0


def test_fused_clocks_hiding_over_both_bases():
    """H = 1 - E/X from phase-matched rank-max times, over FA-only and over FA-only with NVLink kept awake;
    the self-store control is no fused column."""
    rng = _rng(402)
    fa, link, fused_over_awake, serial_over_awake = 20000.0, rng.uniform(200, 400), rng.uniform(0, 100), 800.0
    times = {"fa_ours": fa, "fa_ours_awake": fa + link, "fused": fa + link + fused_over_awake,
             "fused_self": fa + 50.0, "serial_ours_nccl": fa + link + serial_over_awake}
    rows = []
    for phase in range(3):
        drift = rng.uniform(-30, 30)
        for name, us in times.items():
            for rank in range(2):
                rows.append({"shape": "1x49152x12", "kernel": name, "phase": phase, "rank": rank, "samples": 9,
                             "us_per_launch": us + drift - 5.0 * rank, "sm_mhz": 1600.0, "power_w": 690.0,
                             "temp_c": 60.0, "mcycles": 30.0, "mj_per_launch": 14000.0})
    h = fused_clocks.summaries(rows)["hiding"]["1x49152x12"]
    assert set(h) == {"fused/serial_ours_nccl"}
    over_fa = 1 - (link + fused_over_awake) / (link + serial_over_awake)
    assert h["fused/serial_ours_nccl"]["fa_ours"] == pytest.approx(over_fa)
    assert h["fused/serial_ours_nccl"]["fa_ours_awake"] == pytest.approx(1 - fused_over_awake / serial_over_awake)
    no_awake = [r for r in rows if r["kernel"] != "fa_ours_awake"]
    assert set(fused_clocks.summaries(no_awake)["hiding"]["1x49152x12"]["fused/serial_ours_nccl"]) == {"fa_ours"}


def test_link_power_awake_fraction_and_gaps():
    """Bursts closer than the low-power threshold keep the links awake throughout; sparser ones for the
    threshold after each burst. The gap sweep's loads are spin loads whose gap is their period."""
    assert link_power.awake_fraction(1.0, 50.0) == 1.0 and link_power.awake_fraction(0.0, 50.0) == 1.0
    assert link_power.awake_fraction(100.0, 50.0) == pytest.approx(0.5)
    assert link_power.awake_fraction(400.0, 50.0) == pytest.approx(0.125)
    assert link_power.burst_gap_ms(link_power.LOADS["gap_100ms"]) == pytest.approx(100.0)
    assert link_power.burst_gap_ms(link_power.LOADS["fma_trickle"]) is None


def test_fa_clocks_shape_takes_an_optional_head_dim():
    assert fa_clocks.parse_shape("1x32760x12") == (1, 32760, 12, 128)
    assert fa_clocks.parse_shape("1x32760x12x64") == (1, 32760, 12, 64)
    with pytest.raises(ValueError, match="BxSxH"):
        fa_clocks.parse_shape("1x32760")
