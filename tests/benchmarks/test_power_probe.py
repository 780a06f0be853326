"""benchmarks.power_probe's arithmetic (CPU): which samples count, J per call, pJ per FLOP."""
import pytest

from benchmarks import power_probe as pp


def test_summary_drops_the_settling_samples_and_prices_each_call():
    # 0.5 s of 300 W settling, then 700 W at 1500 MHz: 1000 calls in 2 s = 2000 us a call, 1.4 J
    samples = [(t / 10, 300.0, 1980) for t in range(5)] + [(0.5 + t / 10, 700.0, 1500) for t in range(20)]
    s = pp.summarize(samples, seconds=2.0, calls=1000, flops=2e12, settle_s=0.5)
    assert s["samples"] == 20 and s["watts"] == pytest.approx(700.0) and s["sm_mhz"] == 1500
    assert s["us_per_call"] == pytest.approx(2000.0) and s["joules_per_call"] == pytest.approx(1.4)
    assert s["pj_per_flop"] == pytest.approx(0.7) and s["tflops"] == pytest.approx(1000.0)
    assert pp.summarize(samples, seconds=2.0, calls=1000, flops=None, settle_s=0.5)["pj_per_flop"] is None


def test_summary_refuses_a_run_with_nothing_to_count():
    with pytest.raises(ValueError, match="run the case longer"):
        pp.summarize([(0.1, 500.0, 1700)], seconds=1.0, calls=10, flops=1e9, settle_s=0.5)


def test_energy_verdict_averages_each_side_and_compares_new_with_old():
    def run(j, us, w=700.0, mhz=1400):
        return {"joules_per_call": j, "us_per_call": us, "watts": w, "sm_mhz": mhz}
    v = pp.energy_verdict({"old": [run(2.0, 3000), run(2.2, 3200)], "new": [run(1.8, 2700), run(1.6, 2500, mhz=1500)]})
    assert v["old"]["joules_per_call"] == pytest.approx(2.1) and v["new"]["us_per_call"] == pytest.approx(2600)
    assert v["new_over_old_joules"] == pytest.approx(1.7 / 2.1) and v["new_over_old_us"] == pytest.approx(2600 / 3100)
    assert v["new"]["sm_mhz"] == 1450 and v["old"]["runs"] == 2
    with pytest.raises(ValueError, match="at least one run of each side"):
        pp.energy_verdict({"old": [run(1.0, 1000)], "new": []})
