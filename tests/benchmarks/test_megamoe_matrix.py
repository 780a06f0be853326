"""``xstage bench megamoe --matrix`` (benchmarks/megamoe_matrix.py) on the CPU: the enumeration, the memory and
precision skips, the statistics on hand values, --max-minutes and --resume, and the JSON, markdown and figure
of a whole run, with the GPU parts stubbed (graph capture, the trial timer, the clock) and stand-in layers."""

import argparse
import json
import math
import os
import sys
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch

from benchmarks import megamoe as mb
from benchmarks import megamoe_cli as mcli
from benchmarks import megamoe_matrix as mx
from benchmarks.timing import round_order
from calibrate.cli import UsageError
from megamoe.reference import SKEW_EXPONENT, reference_moe
from xstage import cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = mb.Preset("tiny", 256, 128, 4, 2)
TINY2 = mb.Preset("tiny2", 128, 256, 8, 2)


def parse(*argv):
    p = argparse.ArgumentParser()
    mx.add_arguments(p)
    return mx.resolve(p.parse_args(list(argv)))


# --- enumeration ----------------------------------------------------------------------------------------------

def test_the_seven_models_and_the_default_matrix():
    assert [(n, mb.PRESETS[n].hidden, mb.PRESETS[n].intermediate, mb.PRESETS[n].num_experts, mb.PRESETS[n].top_k)
            for n in mx.MODELS] == [("dit-moe", 1152, 4608, 8, 2), ("qwen3-moe", 4096, 1536, 128, 8),
                                    ("hunyuan", 4096, 1536, 192, 8), ("mimo", 4096, 2048, 256, 8),
                                    ("glm", 6144, 2048, 256, 8), ("dsv4-flash", 4096, 2048, 256, 6),
                                    ("dsv4-pro", 7168, 3072, 384, 6)]
    args = parse()
    assert [p.name for p in args.shapes] == list(mx.MODELS) and args.precision == ["bf16", "w8a8", "w4a8"]
    assert args.routing == ["balanced", "skewed"] and args.tokens == [4096, 8192] and args.world == [1, 2]
    assert args.trials == 20 and args.skew == SKEW_EXPONENT and args.out == mx.DEFAULT_OUT
    assert args.md.endswith("megamoe_matrix.md") and args.png.endswith("megamoe_matrix.png")
    configs = mx.configurations(args)
    assert len(configs) == 7 * 3 * 2 * 2 * 2 and len({c.key for c in configs}) == len(configs)
    assert configs[0].key == "dit-moe/bf16/balanced/T4096/P1" and configs[1].key == "dit-moe/bf16/skewed@1.2/T4096/P1"
    assert all((c.skew is None) == (c.routing == "balanced") for c in configs)
    # a layer per (model, world, tokens, precision): its routings are adjacent
    assert [c.routing for c in configs[:4]] == ["balanced", "skewed"] * 2 and configs[2].precision == "w8a8"
    assert mx.describe(configs[-1])["world_mode"].startswith("emulated: 2 ranks")


def test_flags_and_their_errors():
    args = parse("--shapes", "glm,dit-moe", "--precision", "w4a8", "--routing", "skewed", "--skew", "0.8",
                 "--tokens", "128", "--world", "2", "--resume", "x/part.json")
    assert [c.key for c in mx.configurations(args)] == ["glm/w4a8/skewed@0.8/T128/P2", "dit-moe/w4a8/skewed@0.8/T128/P2"]
    assert args.out == "x/part.json" and args.md == "x/part.md"  # --resume continues its own file
    for argv, fragment in ((["--precision", "fp8"], "unknown precision 'fp8'"), (["--world", "3"], "unknown world"),
                           (["--shapes", "nope"], "unknown shape")):
        with pytest.raises(SystemExit):
            parse(*argv)
        assert cli.main(["bench", "megamoe", "--matrix", *argv]) == 2


def test_rotated_order():
    names = ["wave", "interleaved"]
    assert [round_order(names, r, "rotate")[0] for r in range(4)] == ["wave", "interleaved"] * 2
    assert [round_order(names, r, "rotate", start=1)[0] for r in range(2)] == ["interleaved", "wave"]
    assert round_order(["a", "b", "c"], 1, "rotate") == ["b", "c", "a"]
    assert sorted(round_order(["a", "b", "c"], 3)) == ["a", "b", "c"]  # the bench's shuffle, unchanged
    with pytest.raises(ValueError):
        round_order(names, 0, "sorted")


# --- memory and time --------------------------------------------------------------------------------------------

def test_memory_arithmetic_and_what_fits_one_h200():
    pro = mb.PRESETS["dsv4-pro"]
    m = mx.memory_estimate(pro, 1, 8192, 2)
    assert m["weights_bf16"] == m["layer_copy"] == pytest.approx(2 * 384 * 3 * 7168 * 3072 / 1e9, abs=1e-3)
    rows = 8192 * 6 + 384 * 128
    assert m["buffers"] == pytest.approx((rows * (7168 * 2 + 3072 * 2 + 8) + 8192 * 6 * (7168 * 2 + 4)
                                          + rows // 128 * 4) / 1e9, abs=1e-3)
    assert m["total"] == pytest.approx(sum(v for k, v in m.items() if k != "total"), abs=1e-2)
    # every model fits one H200 at world 1 and 2, both token counts (the matrix holds ours only)
    worst = max(mx.memory_estimate(mb.PRESETS[n], w, t, 2)["total"] for n in mx.MODELS for w in (1, 2)
                for t in (4096, 8192))
    assert worst < mx.H200_GB and mx.memory_verdict(m, mx.H200_GB) is None
    why = mx.memory_verdict(m, 100.0)
    assert why.startswith(f"memory: needs {m['total']:.1f} GB (weights bf16 50.7 + layer copy 50.7 + buffers")
    assert why.endswith("> 100.0 GB")


def test_plan_fits_one_or_two_device_calls(capsys):
    p = mx.plan(parse())
    assert len(p["configurations"]) == 168 and not any(r["skip"] for r in p["configurations"])
    est = p["estimated_s"]
    assert set(est) == {"all", "bf16", "w8a8", "w4a8"} and est["bf16"] == est["w8a8"] == est["w4a8"]  # bf16 rates
    # one precision within one 10-minute device call, all three within two
    assert est["bf16"] < 8 * 60 and est["all"] < 2 * 9 * 60 and est["all"] > 2 * est["bf16"], est
    small = mx.plan(parse("--shapes", "dsv4-pro,dit-moe", "--memory-gb", "100"))
    skipped = {r["key"].split("/")[0] for r in small["configurations"] if r["skip"]}
    assert skipped == {"dsv4-pro"} and all(r["estimated_s"] == 0 for r in small["configurations"] if r["skip"])
    assert cli.main(["bench", "megamoe", "--matrix", "--plan", "--shapes", "dit-moe", "--precision", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "dit-moe/bf16/skewed@1.2/T8192/P2" in out and "bf16 alone" in out


# --- statistics -----------------------------------------------------------------------------------------------

def test_speedup_statistics_on_hand_values():
    s = mx.speedup_stats([("a", 1.0), ("b", 2.0), ("c", 4.0), ("d", 0.5)])
    assert s["n"] == 4 and s["geomean"] == pytest.approx(math.sqrt(2)) and s["median"] == 1.5
    assert (s["min"], s["min_config"], s["max"], s["max_config"], s["faster"]) == (0.5, "d", 4.0, "c", 2)
    assert mx.speedup_stats([("x", 1.2)])["median"] == 1.2 and mx.speedup_stats([]) == {"n": 0}

    def e(model, precision, routing, speedup, status="measured"):
        return {"key": f"{model}/{precision}/{routing}", "model": model, "precision": precision, "routing": routing,
                "world": 1, "tokens_per_rank": 4096, "speedup": speedup, "status": status}

    entries = [e("dsv4-pro", "bf16", "skewed", 1.21), e("dit-moe", "bf16", "balanced", 0.9),
               e("dit-moe", "w8a8", "skewed", 1.6), e("dit-moe", "w4a8", "skewed", None, "skipped")]
    s = mx.summarize(entries)
    assert list(s["by_model"]) == ["dit-moe", "dsv4-pro"]  # Figure 8's order
    assert s["by_model"]["dit-moe"]["geomean"] == pytest.approx(math.sqrt(0.9 * 1.6))
    assert s["by_precision"]["bf16"]["median"] == pytest.approx((1.21 + 0.9) / 2) and "w4a8" not in s["by_precision"]
    assert s["by_routing"]["skewed"]["min"] == 1.21 and s["overall"]["max_config"] == "dit-moe/w8a8/skewed"
    assert s["overall"]["geomean"] == pytest.approx((1.21 * 0.9 * 1.6) ** (1 / 3))
    assert s["counts"] == {"measured": 3, "failed": 0, "skipped": 1, "not_run": 0}


# --- whole runs on the CPU --------------------------------------------------------------------------------------

class FakeLayer:
    """MegaMoE as the matrix calls it; forward is the reference. ``ACCEPTS``: the dtypes the constructor takes
    (others raise ValueError, as megamoe.api does today for FP8)."""

    ACCEPTS = (torch.bfloat16,)
    built: ClassVar[list] = []

    def __init__(self, group, num_experts, top_k, hidden, intermediate, dtype=torch.bfloat16,
                 schedule="interleaved", lead=None, max_tokens_per_rank=8192, emulated_ranks=1, instrument=False):
        if dtype not in self.ACCEPTS:
            raise ValueError(f"dtype {dtype} is not supported yet")
        self.limit, self.dtype = max_tokens_per_rank * emulated_ranks, dtype
        FakeLayer.built.append((hidden, dtype, emulated_ranks))

    def load_weights(self, w1, w2):
        self.w = (w1, w2)

    def forward(self, x, topk_idx, topk_weights, schedule=None):
        assert x.shape[0] <= self.limit and schedule in mx.SCHEDULES
        return reference_moe(x, topk_idx, topk_weights, *self.w).to(torch.bfloat16)


class W8A8Layer(FakeLayer):
    ACCEPTS = (torch.bfloat16, "w8a8")


class NoEmulation(FakeLayer):
    def __init__(self, *a, **kw):
        if "emulated_ranks" in kw:
            raise TypeError("__init__() got an unexpected keyword argument 'emulated_ranks'")
        super().__init__(*a, **kw)


class FakeEmulated:
    """The API's EmulatedMoE: per-rank lists, no dtype (bf16 only)."""

    def __init__(self, world, num_experts, top_k, hidden, intermediate, max_tokens_per_rank=4096,
                 schedule="interleaved", lead=None, instrument=False):
        self.ranks = [FakeLayer(None, num_experts, top_k, hidden, intermediate, max_tokens_per_rank=max_tokens_per_rank)
                      for _ in range(world)]

    def load_weights(self, w1, w2):
        for m in self.ranks:
            m.load_weights(w1, w2)

    def forward(self, xs, idxs, weights, schedule=None):
        return [m.forward(x, i, w, schedule) for m, x, i, w in zip(self.ranks, xs, idxs, weights)]


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def fake_run(tmp_path, *argv, api=None, shapes=(TINY,), clock=None, capacity_gb=50.0, timer=None):
    args = parse("--out", str(tmp_path / "m.json"), "--tokens", "8", *argv)
    args.shapes = list(shapes)
    clock = clock or Clock()
    calls = []

    def stub_timer(cols, index):  # wave slower than interleaved by 1 + index / 100, each config 10 s
        calls.append((index, list(cols)))
        clock.t += 10.0
        us = {"wave": 100.0 + index, "interleaved": 100.0}
        return {n: us[n] for n in cols}, {n: [us[n], us[n] + 1.0, us[n] - 1.0] for n in cols}

    FakeLayer.built = []
    result = mx.run_matrix(args, None, device="cpu", capture=lambda fn: (None, "eager (stub)"),
                           timer=timer or stub_timer, api=api or (SimpleNamespace(MegaMoE=FakeLayer), None),
                           capacity_gb=capacity_gb, clock=clock)
    saved = json.loads((tmp_path / "m.json").read_text())
    assert (tmp_path / "m.png").read_bytes()[:8] == PNG_MAGIC
    return result, saved, (tmp_path / "m.md").read_text(), calls


def test_whole_run_schema_and_the_precision_skips(tmp_path):
    _, saved, md, calls = fake_run(tmp_path, "--world", "1,2", "--tokens", "8,5")
    assert saved["kind"] == mx.KIND and saved["provenance"]["command"].startswith("xstage bench megamoe")
    assert saved["runs"] == [saved["provenance"]] and saved["args"]["trials"] == 20 and saved["stopped"] is None
    confs = saved["configurations"]
    assert [c["key"] for c in confs] == [c.key for c in mx.configurations(mx.resolve(SimpleNamespace(
        **{**vars(parse("--world", "1,2", "--tokens", "8,5")), "shapes": [TINY]})))]
    measured = [c for c in confs if c["status"] == "measured"]
    assert {c["precision"] for c in measured} == {"bf16"} and len(measured) == 2 * 2 * 2
    for c in measured:
        i = [x["key"] for x in confs].index(c["key"])
        assert c["wave"]["us"] == 100.0 + i and c["interleaved"]["us"] == 100.0
        assert c["speedup"] == pytest.approx((100.0 + i) / 100.0)
        assert c["wave"]["timing"] == "eager (stub)" and c["wave"]["error"]["max_rel"] < 2e-2
        assert c["trial_times_us"]["wave"] == [100.0 + i, 101.0 + i, 99.0 + i]
        assert c["first_in_trial_0"] == ("wave" if i % 2 == 0 else "interleaved")
        assert c["zipf_exponent"] == (SKEW_EXPONENT if c["routing"] == "skewed" else None)
        assert c["rows"] == c["tokens"] * 2 and c["run"] == 0 and c["memory"]["total"] > 0
        assert c["world_mode"] == ("one GPU" if c["world"] == 1 else
                                   "emulated: 2 ranks concurrent on one GPU (SMs split), local stores "
                                   "(the local-store control)")
    assert sorted(i for i, _ in calls) == sorted([x["key"] for x in confs].index(c["key"]) for c in measured)
    assert all(cols == ["wave", "interleaved"] for _, cols in calls)
    skips = {c["key"]: c for c in confs if c["status"] == "skipped"}
    assert len(skips) == 16 and all(c["skip_kind"] == "precision" for c in skips.values())
    w8 = skips["tiny/w8a8/balanced/T8/P1"]["reason"]
    assert w8 == ("MegaMoE(w8a8) unsupported here: dtype='w8a8': ValueError: dtype w8a8 is not supported yet; "
                  "dtype=torch.float8_e4m3fn: ValueError: dtype torch.float8_e4m3fn is not supported yet")
    assert skips["tiny/w4a8/skewed@1.2/T5/P2"]["reason"] == (
        "MegaMoE(w4a8) unsupported here: ValueError: dtype w4a8 is not supported yet")
    s = saved["summary"]
    assert s["counts"] == {"measured": 8, "failed": 0, "skipped": 16, "not_run": 0}
    assert s["overall"]["n"] == 8 and list(s["by_precision"]) == ["bf16"] and set(s["by_world"]) == {"1", "2"}
    assert "## Summary" in md and "| all |  | 8 |" in md and "| tiny | 256 / 128 | 4 | 2 | bf16 | skewed (s = 1.2)" in md
    assert "| skipped | 8 | MegaMoE(w8a8) unsupported here" in md


def test_a_precision_runs_untouched_once_the_api_takes_it(tmp_path):
    _, saved, _, _ = fake_run(tmp_path, "--precision", "bf16,w8a8", "--world", "1",
                              api=(SimpleNamespace(MegaMoE=W8A8Layer), None))
    assert {c["precision"]: c["status"] for c in saved["configurations"]} == {"bf16": "measured", "w8a8": "measured"}
    assert ("w8a8" in [d for _, d, _ in FakeLayer.built])  # the string was passed through to the constructor
    w8 = next(c for c in saved["configurations"] if c["precision"] == "w8a8")
    assert w8["wave"]["error"]["reference"] == "fp32, the same W8A8 quantization (h in 1x64 runs)"
    assert w8["wave"]["error"]["finite"] and w8["wave"]["error"]["max_rel"] < 0.2  # bf16 out vs the FP8 recipe
    import megamoe.reference

    if not hasattr(megamoe.reference, "reference_moe_w4a8"):
        w4 = mx.reference_for("w4a8", *[None] * 5)
        assert w4 == (None, "no megamoe.reference.reference_moe_w4a8 yet: only the output's finiteness is checked")


def test_emulated_world_through_the_api_emulation_and_the_missing_api(tmp_path):
    module = SimpleNamespace(MegaMoE=NoEmulation, EmulatedMoE=FakeEmulated)
    _, saved, _, _ = fake_run(tmp_path, "--precision", "bf16,w8a8", "--world", "2", "--routing", "balanced",
                              api=(module, None))
    by = {c["precision"]: c for c in saved["configurations"]}
    assert by["bf16"]["status"] == "measured" and by["bf16"]["wave"]["error"]["max_rel"] < 2e-2
    assert by["w8a8"]["reason"] == "MegaMoE(w8a8) unsupported here: ValueError: EmulatedMoE takes no dtype: bf16 only, not w8a8"
    _, saved, _, _ = fake_run(tmp_path, "--precision", "bf16", "--routing", "balanced", "--world", "1",
                              api=(None, "megamoe.api unavailable (ImportError: x)"))
    (c,) = saved["configurations"]
    assert (c["status"], c["skip_kind"], c["reason"]) == ("skipped", "api", "megamoe.api unavailable (ImportError: x)")
    assert saved["api_unavailable"] == "megamoe.api unavailable (ImportError: x)"


def test_memory_skip_is_never_attempted(tmp_path):
    need = mx.memory_estimate(TINY2, 1, 8, 2)["total"]
    _, saved, md, calls = fake_run(tmp_path, "--precision", "bf16", "--world", "1", shapes=(TINY, TINY2),
                                   capacity_gb=need - 0.001)
    big = [c for c in saved["configurations"] if c["model"] == "tiny2"]
    assert len(big) == 2 and all(c["status"] == "skipped" and c["skip_kind"] == "memory" for c in big)
    assert big[0]["reason"] == mx.memory_verdict(big[0]["memory"], need - 0.001) and "needs" in big[0]["reason"]
    assert [h for h, _, _ in FakeLayer.built] == [256]  # tiny2 (hidden 128) never built
    assert len(calls) == 2 and "| skipped | 2 | memory: needs" in md


def test_a_failing_schedule_is_recorded(tmp_path):
    class Broken(FakeLayer):
        def forward(self, x, topk_idx, topk_weights, schedule=None):
            if schedule == "wave":
                raise RuntimeError("bounded wait timed out: l1_done\nmore")
            return super().forward(x, topk_idx, topk_weights, schedule)

    _, saved, md, _ = fake_run(tmp_path, "--precision", "bf16", "--world", "1", "--routing", "balanced",
                               api=(SimpleNamespace(MegaMoE=Broken), None))
    (c,) = saved["configurations"]
    assert c["status"] == "failed" and c["speedup"] is None and "us" in c["interleaved"]
    assert c["reason"] == "wave: RuntimeError: bounded wait timed out: l1_done" and "failed: wave" in md


def test_max_minutes_stops_cleanly_and_resume_continues(tmp_path):
    argv = ("--precision", "bf16", "--world", "1", "--max-minutes", "0.5")  # 30 s; each config takes 10 s
    _, saved, md, calls = fake_run(tmp_path, *argv, shapes=(TINY, TINY2))
    status = [c["status"] for c in saved["configurations"]]
    assert status == ["measured", "measured", "measured", "not_run"] and len(calls) == 3
    assert saved["stopped"].startswith("--max-minutes 0.5: stopped before tiny2/bf16/skewed@1.2/T8/P1")
    assert saved["configurations"][3]["reason"] == saved["stopped"] and "Stopped: --max-minutes" in md
    first = saved["configurations"][:3]
    # resume: the measured ones are kept as they were, the rest runs, the runs' provenance accumulates
    _, saved2, _, calls2 = fake_run(tmp_path, "--precision", "bf16", "--world", "1", "--resume",
                                      str(tmp_path / "m.json"), shapes=(TINY, TINY2))
    assert [i for i, _ in calls2] == [3] and saved2["resumed"] == 3 and len(saved2["runs"]) == 2
    assert saved2["configurations"][:3] == first and saved2["configurations"][3]["run"] == 1
    assert saved2["summary"]["counts"]["measured"] == 4 and saved2["stopped"] is None
    with pytest.raises(UsageError, match="seed = 0, this run has 1"):
        fake_run(tmp_path, "--seed", "1", "--resume", str(tmp_path / "m.json"))
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(UsageError, match="not a bench megamoe --matrix result"):
        fake_run(tmp_path, "--resume", str(tmp_path / "other.json"))


def test_replot_rewrites_the_table_and_figure(tmp_path):
    fake_run(tmp_path, "--precision", "bf16,w4a8", "--world", "1")
    (tmp_path / "m.md").unlink()
    (tmp_path / "m.png").unlink()
    assert mcli.main(["--matrix", "--replot", str(tmp_path / "m.json")]) == 0
    assert (tmp_path / "m.png").read_bytes()[:8] == PNG_MAGIC and "## Configurations" in (tmp_path / "m.md").read_text()


# --- --dump -----------------------------------------------------------------------------------------------------

class Instrumented(W8A8Layer):
    """FakeLayer with instrument=True's records (megamoe_fakes): every build and launch logged in ``events``
    beside the timer's trials, with how many timed layers are alive when an instrumented one is built."""

    events: ClassVar[list] = []
    timed: ClassVar = None  # a WeakSet of the live timed layers

    def __init__(self, group, num_experts, top_k, hidden, intermediate, instrument=False, emulated_ranks=1, **kw):
        super().__init__(group, num_experts, top_k, hidden, intermediate, emulated_ranks=emulated_ranks, **kw)
        self.instrument, self.world, self.num_experts = instrument, emulated_ranks, num_experts
        Instrumented.events.append(("build", instrument, len(Instrumented.timed)))
        if not instrument:
            Instrumented.timed.add(self)

    def forward(self, x, topk_idx, topk_weights, schedule=None):
        Instrumented.events.append(("forward", self.instrument, schedule))
        self.last = (topk_idx, schedule)
        return super().forward(x, topk_idx, topk_weights, schedule)

    def last_dump(self):
        from megamoe_fakes import fake_records, ranked

        if not self.instrument:
            raise ValueError("build the layer with instrument=True to record tiles")
        idx, schedule = self.last
        local = self.num_experts // self.world
        parts = [fake_records(idx, range(r * local, (r + 1) * local), schedule) for r in range(self.world)]
        return ranked(parts) if self.world > 1 else parts[0]


def dump_run(tmp_path, *argv):
    import weakref

    Instrumented.events, Instrumented.timed = [], weakref.WeakSet()

    def timer(cols, index):
        Instrumented.events.append(("trials", index))
        clock.t += 10.0
        return {n: 100.0 + (index if n == "wave" else 0) for n in cols}, {n: [100.0] for n in cols}

    clock = Clock()
    return fake_run(tmp_path, "--precision", "bf16,w8a8", *argv, api=(SimpleNamespace(MegaMoE=Instrumented), None),
                    clock=clock, timer=timer)


def test_dump_of_an_emulated_matrix_is_what_the_analysis_reads(tmp_path):
    """--dump FILE: per layer after its timed configurations, its instrumented twin (the timed one freed), one
    launch per schedule and measured configuration on the same seeded inputs; FILE.npz/json in bench
    megamoe --dump's format, precision and configuration in every entry; the analysis CLI reads and
    summarizes it, precisions apart. Without --dump nothing instrumented is built."""
    from benchmarks import megamoe_analysis as ma

    _, saved, _, _ = dump_run(tmp_path, "--world", "1,2")
    assert not any(e[0] == "build" and e[1] for e in Instrumented.events) and saved["args"]["dump"] is None
    dump = tmp_path / "d"
    _, saved, _, _ = dump_run(tmp_path, "--world", "1,2", "--dump", str(dump))
    assert saved["args"]["dump"] == str(dump)
    confs = saved["configurations"]
    measured = [c for c in confs if c["status"] == "measured"]
    assert len(measured) == 2 * 2 * 2  # bf16, w8a8 x routing x world (w4a8 not built)
    events = Instrumented.events
    builds = [i for i, e in enumerate(events) if e[0] == "build"]
    assert [events[i][1] for i in builds] == [False, True] * 4  # a timed layer, then its instrumented twin
    assert all(events[i][2] == 0 for i in builds[1::2])  # built once the timed one was freed
    # per layer: both configurations' trials, then one instrumented launch per schedule of each
    layer = events[:builds[2]]
    inst = [e for e in layer if e[0] == "forward" and e[1]]
    assert inst == [("forward", True, s) for s in mx.SCHEDULES] * 2
    assert max(i for i, e in enumerate(layer) if e[0] == "trials") < builds[1]
    header = json.loads((tmp_path / "d.json").read_text())
    assert header["npz"] == "d.npz" and header["source"] == "xstage bench megamoe --matrix"
    assert header["result"] == "m.json" and header["provenance"]["command"].startswith("xstage bench megamoe")
    keys = [c["key"] for c in confs]
    assert len(header["entries"]) == 2 * len(measured)
    for e in header["entries"]:
        c = confs[keys.index(e["key"])]
        assert e["key_prefix"] == f"r{keys.index(e['key'])}.ours_{c['precision']}_{e['schedule']}" == \
            c["dump"][e["schedule"]]["key_prefix"]
        assert (e["row"], e["column"]) == (keys.index(e["key"]), f"ours_{c['precision']}_{e['schedule']}")
        assert {k: e[k] for k in ("shape", "world", "ranks", "tokens_per_rank", "routing", "zipf_exponent",
                                  "precision", "seed")} == {
            "shape": "tiny", "world": c["world"], "ranks": c["ranks"], "tokens_per_rank": 8,
            "routing": c["routing"], "zipf_exponent": c["zipf_exponent"], "precision": c["precision"],
            "seed": c["seed"]}
        assert ("rank" in e["arrays"]) == (c["world"] == 2)
    with np_load(tmp_path / "d.npz") as z:
        ranks = z["r" + str(keys.index("tiny/bf16/balanced/T8/P2")) + ".ours_bf16_wave.rank"]
        assert set(ranks.tolist()) == {0, 1}
    out = tmp_path / "analysis"
    assert ma.main([str(tmp_path / "d.json"), "--out-dir", str(out)]) == 0
    stall = json.loads((out / "d_stall.json").read_text())
    rows = {(r["precision"], r["routing"], r["world"]): r for r in stall["rows"]}
    assert len(rows) == len(stall["rows"]) == len(measured)  # each configuration its own row: precisions apart
    assert all(sorted(r["schedules"]) == ["interleaved", "wave"] for r in rows.values())
    r = rows[("w8a8", "skewed", 2)]
    assert r["t_rs_median_int_over_wave"] == pytest.approx(2 / 3)  # the fake's 2000 vs 3000 cycles
    assert set(stall["spearman_pred_vs_meas"]["median"]) == {"all", "wave", "interleaved", "bf16", "w8a8"}
    assert "| tiny | w8a8 | 8 | skewed | 2 |" in (out / "d_stall.md").read_text()
    assert sorted(n for n in os.listdir(out) if "timeline" in n) == [
        "d_timeline_tiny_bf16_8_skewed_P2_interleaved.png", "d_timeline_tiny_bf16_8_skewed_P2_wave.png"]
    assert (out / "d_spans.png").read_bytes()[:8] == PNG_MAGIC


def test_dump_kept_when_the_run_stops_mid_layer_and_continued_by_resume(tmp_path):
    # 9 s: the first layer's first configuration fits (its compile, twin's and trials ~7.5 s), its second not
    _, saved, _, _ = dump_run(tmp_path, "--world", "1", "--precision", "bf16", "--max-minutes", "0.15",
                              "--dump", str(tmp_path / "d"))
    assert [c["status"] for c in saved["configurations"]] == ["measured", "not_run"] and saved["stopped"]
    first = json.loads((tmp_path / "d.json").read_text())["entries"]
    assert [e["key_prefix"] for e in first] == ["r0.ours_bf16_wave", "r0.ours_bf16_interleaved"]
    _, saved, _, _ = dump_run(tmp_path, "--world", "1", "--precision", "bf16", "--resume", str(tmp_path / "m.json"),
                              "--dump", str(tmp_path / "d"))
    entries = json.loads((tmp_path / "d.json").read_text())["entries"]
    assert [e["key_prefix"] for e in entries] == [*(e["key_prefix"] for e in first), "r1.ours_bf16_wave",
                                                  "r1.ours_bf16_interleaved"]
    with np_load(tmp_path / "d.npz") as z:
        assert {k.rsplit(".", 1)[0] for k in z.files} == {e["key_prefix"] for e in entries}


def test_plan_counts_the_dump(capsys):
    plain, dumped = mx.plan(parse()), mx.plan(parse("--dump", "x"))
    layers, configs = 7 * 2 * 2 * 3, 168
    extra = dumped["estimated_s"]["dump"]
    assert "dump" not in plain["estimated_s"] and abs(dumped["estimated_s"]["all"] - plain["estimated_s"]["all"] - extra) <= 1
    assert extra >= layers * mx.EST["layer_s"] + configs * mx.EST["dump_s"] - 1
    assert cli.main(["bench", "megamoe", "--matrix", "--plan", "--shapes", "dit-moe", "--dump", "x"]) == 0
    assert "--dump adds" in capsys.readouterr().out


def np_load(path):
    import numpy as np

    return np.load(path)


def test_no_gpu_is_a_usage_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the run would start")
    assert mcli.main(["--matrix", "--tokens", "8"]) == 2  # python -m benchmarks.megamoe_cli --matrix: the matrix
    assert "--matrix needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(UsageError, match="at least 1"):
        mcli.run_matrix(parse("--trials", "0"))
    with pytest.raises(UsageError, match="its own options"):
        mcli.run_bench(SimpleNamespace(matrix=True))


def test_the_bench_still_takes_its_three_default_shapes():
    p = argparse.ArgumentParser()
    mb.add_arguments(p)
    args = p.parse_args([])
    assert [s.name for s in args.shapes] == ["dsv4-flash", "qwen3-moe", "dit-moe"] and not args.matrix
    assert sys.modules["benchmarks.megamoe"] is mb


class AutoLayer(FakeLayer):
    """schedule="auto" settles on interleaved after the rule's prior, wave (the fake's trial slot, read back by
    auto_trial once the settling calls ran)."""

    auto_calls: ClassVar[list] = []

    def forward(self, x, topk_idx, topk_weights, schedule=None):
        if schedule == "auto":
            AutoLayer.auto_calls.append(x.shape[0])
            schedule = "interleaved"
        return super().forward(x, topk_idx, topk_weights, schedule)

    def auto_trial(self):
        return {"launches": 32, "prior": "wave", "decided": "interleaved",
                "times_us": {"wave": [3.0], "interleaved": [2.0]}}


def test_auto_column_settles_then_reports_its_in_run_regret(tmp_path):
    """--auto: the auto column is checked, captured, then run settle_replays times (here eagerly: the stub
    capture makes no graph) before it is timed beside the two schedules in shuffled trials; its regret is its
    own time against the better schedule's, the pick's the settled order's column; the summary and the table
    carry both."""
    from benchmarks.megamoe_auto import settle_replays

    AutoLayer.auto_calls = []
    seen = []

    def timer(cols, index):
        seen.append(list(cols))
        us = {"wave": 110.0, "interleaved": 100.0, "auto": 104.0 if index == 0 else 100.5}
        return {n: us[n] for n in cols}, {n: [us[n]] * 3 for n in cols}

    _, saved, md, _ = fake_run(tmp_path, "--auto", "--world", "1", "--routing", "balanced", "--tokens", "8,5",
                               api=(SimpleNamespace(MegaMoE=AutoLayer), None), timer=timer)
    assert all(cols == ["wave", "interleaved", "auto"] for cols in seen) and len(seen) == 2
    calls = saved["args"]["calls_per_graph"]
    # per configuration: run_columns' eager check, then the settling replays' calls
    assert len(AutoLayer.auto_calls) == 2 * (1 + settle_replays(calls) * calls)
    assert saved["args"]["auto"] and "--auto: a third column" in saved["method"]
    first, second = (c for c in saved["configurations"] if c["status"] == "measured")
    assert first["auto"]["order"] == "interleaved" and first["auto"]["prior"] == "wave"
    assert first["auto"]["settle_replays"] == settle_replays(calls) and first["auto"]["launches"] == 32
    assert first["auto"]["trial_us"]["wave"] == [3.0]
    assert first["auto_regret"] == pytest.approx(0.04) and second["auto_regret"] == pytest.approx(0.005)
    assert first["auto_pick_regret"] == 0.0 and first["speedup"] == pytest.approx(1.1)
    st = saved["summary"]["auto"]["overall"]
    assert st["n"] == 2 and st["max_regret"] == pytest.approx(0.04) and st["over_3pct"] == 1
    assert st["worst_config"] == first["key"] and st["picks_the_better"] == 2 and st["pick_max_regret"] == 0.0
    assert st["round_max_regret"] == pytest.approx(0.04) and st["round_over_3pct"] == 1
    assert "## schedule=\"auto\", in-run regret" in md and "| all | 2 | 4.0% | 2.2% | 1 | 4.0% | 1 | 2 | 0.0% | 0 |" in md
    assert "| 104 | interleaved | +4.0% |" in md
    plain = mx.configurations(parse("--world", "1"))[0]
    assert mx.config_seconds(mx.Config(**{**vars(plain), "auto": True}), 20, 2) > mx.config_seconds(plain, 20, 2)


def test_settle_auto_replays_the_graph_back_to_back_then_reads_the_lead_slot():
    from benchmarks.megamoe_auto import settle_auto, settle_replays
    from megamoe.auto import TRIAL_SETTLE

    assert settle_replays(2) * 2 >= TRIAL_SETTLE and (settle_replays(2) - 1) * 2 < TRIAL_SETTLE
    assert settle_replays(1) == TRIAL_SETTLE
    log = []
    layer = AutoLayer.__new__(AutoLayer)
    graph = SimpleNamespace(replay=lambda: log.append("replay"))
    out = settle_auto(graph, lambda: log.append("call"), layer, 2, sync=lambda: log.append("sync"))
    assert log == ["replay"] * settle_replays(2) + ["sync"]
    assert out == {"order": "interleaved", "prior": "wave", "settle_replays": settle_replays(2), "launches": 32,
                   "trial_us": {"wave": [3.0], "interleaved": [2.0]}}
    log.clear()
    settle_auto(None, lambda: log.append("call"), layer, 3, sync=lambda: log.append("sync"))
    assert log == ["call"] * (3 * settle_replays(3)) + ["sync"]  # no graph: the calls themselves
    emulated = SimpleNamespace(emulated=SimpleNamespace(ranks=[layer, None]))
    assert settle_auto(graph, lambda: None, emulated, 2, sync=lambda: None)["order"] == "interleaved"  # the lead's
