"""benchmarks.megamoe_ncu's summary of ncu's raw CSV (no GPU): the program's own output interleaved with ncu's
lines is skipped, units are converted, the MegaMoE launches are named by the cases in launch order, the stall
reasons are ranked."""
import json

from benchmarks.megamoe_ncu import METRICS, STALL_PREFIX, main, summarize

KERNELS = ["nvjet_sm90_dense", "kernel_cutlass_kernel_megamoekernelMegaMoEForward_object_at_1",
           "void at::reduce_kernel<512>", "kernel_cutlass_kernel_megamoekernelMegaMoEForward_object_at_2"]


def _write_csv(path):
    head = ["ID", "Kernel Name", METRICS["duration_us"], METRICS["sm_clock_ghz"], METRICS["tensor_pipe_pct"],
            METRICS["dram_bytes_per_s"], STALL_PREFIX + "long_scoreboard_per_issue_active.ratio",
            STALL_PREFIX + "barrier_per_issue_active.ratio"]
    units = ["", "", "ns", "hz", "%", "byte/s", "inst", "inst"]
    rows = [[str(i), name, f"{1000 * (i + 1):,}", "1,511,549,951.8", "49.72", "2,808,462,840,470.4",
             str(2.0 + i), "0.5"] for i, name in enumerate(KERNELS)]
    with open(path, "w") as f:
        f.write("==PROF== Connected to process 1\nseed=0\nprofiled a\n")
        for r in [head, units, *rows]:
            f.write(",".join(f'"{c}"' for c in r) + "\n")


def test_summary_converts_units_and_names_the_launches(tmp_path):
    path = tmp_path / "raw.csv"
    _write_csv(path)
    out = summarize(str(path), ["a:1", "b:2"], {"git_commit": "x"})
    ks = out["kernels"]
    assert [k["kernel"][:8] for k in ks] == [n[:8] for n in KERNELS]
    assert [k.get("case") for k in ks] == [None, "a:1", None, "b:2"]
    assert ks[1]["duration_us"] == 2.0  # 2,000 ns
    assert abs(ks[1]["sm_clock_ghz"] - 1.5115) < 1e-3
    assert ks[1]["tensor_pipe_pct"] == 49.72
    assert abs(ks[1]["dram_bytes_per_s"] - 2.808e12) < 1e9
    assert ks[1]["l2_hit_rate_pct"] is None  # not in this CSV: reported missing, not invented
    assert list(ks[1]["stall_cycles_per_issue"]) == ["long_scoreboard", "barrier"]
    assert out["provenance"] == {"git_commit": "x"}


def test_cli_embeds_the_runs_provenance(tmp_path):
    path = tmp_path / "raw.csv"
    _write_csv(path)
    prov = tmp_path / "prov.json"
    prov.write_text(json.dumps({"provenance": {"date": "d"}, "cases": ["c:1", "c:2"]}))
    out = tmp_path / "s.json"
    assert main(["--summarize", str(path), "--provenance", str(prov), "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["provenance"] == {"date": "d"} and got["cases"] == ["c:1", "c:2"]
    assert [k.get("case") for k in got["kernels"]] == [None, "c:1", None, "c:2"]
