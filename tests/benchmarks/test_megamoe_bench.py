"""``xstage bench megamoe`` (benchmarks/megamoe.py) and its baselines (benchmarks/moe_baselines.py): the
arguments and presets, the unfused bf16 path against the reference (on the CPU, where torch._grouped_mm runs
there), and the result JSON, figure and dump of a whole run on the CPU with the GPU parts stubbed (timing,
graph capture, ceilings) and a stand-in MegaMoE. The GPU tests (marked ``gpu``) check both unfused paths and
their CUDA-Graph replay on new inputs. Random inputs use the printed ``seed`` fixture."""

import argparse
import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchmarks import megamoe as bench
from benchmarks.megamoe_cli import run_bench
from benchmarks.moe_baselines import (
    fp8_grouped_unavailable,
    fp8_rowwise_weights,
    sort_by_expert,
    unfused_bf16_moe,
    unfused_fp8_moe,
)
from calibrate.cli import UsageError
from megamoe.reference import ROUTING_MODES, make_routing, reference_moe
from megamoe.schedule import MoEShape

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = bench.Preset("tiny", 256, 128, 4, 2)


def parse(*argv):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


def test_defaults_and_presets():
    args = parse()
    assert [p.name for p in args.shapes] == ["dsv4-flash", "qwen3-moe", "dit-moe"]
    assert args.tokens == [1024, 4096, 8192] and args.routing == ["balanced", "skewed"] and args.world == [1, 2]
    assert args.columns == list(bench.COLUMNS) and args.out == "benchmarks/results/h200/megamoe.json"
    assert args.dump is None and args.png is None
    assert bench.PRESETS["dsv4-flash"] == bench.Preset("dsv4-flash", 4096, 2048, 256, 6)
    assert bench.PRESETS["qwen3-moe"] == bench.Preset("qwen3-moe", 4096, 1536, 128, 8)
    assert bench.PRESETS["dit-moe"] == bench.Preset("dit-moe", 1152, 4608, 8, 2)
    assert bench.ROUTINGS == ROUTING_MODES
    assert bench.COLUMNS == ("unfused_bf16", "unfused_fp8", "ours_bf16_wave", "ours_bf16_interleaved",
                             "ours_fp8_wave", "ours_fp8_interleaved", "ours_w4a8_wave", "ours_w4a8_interleaved",
                             "unfused_nccl_bf16", "unfused_nccl_fp8")
    assert args.ranks is None  # resolved at run time (benchmarks.megamoe_ranks.rank_modes)


def test_comma_lists():
    args = parse("--shapes", "dit-moe,qwen3-moe,dit-moe", "--tokens", "1000, 129", "--routing", "one_expert",
                 "--world", "2", "--columns", "unfused_bf16,ours_bf16_wave")
    assert [p.name for p in args.shapes] == ["dit-moe", "qwen3-moe"]  # repeats dropped, order kept
    assert args.tokens == [1000, 129] and args.routing == ["one_expert"] and args.world == [2]
    assert args.columns == ["unfused_bf16", "ours_bf16_wave"]
    for bad, fragment in ((bench._shapes, "unknown shape 'nope'"), (bench._tokens, "bad token count 'x'")):
        with pytest.raises(argparse.ArgumentTypeError, match=fragment):
            bad("nope" if bad is bench._shapes else "4,x")
    with pytest.raises(argparse.ArgumentTypeError, match="must be positive"):
        bench._tokens("4,0")
    with pytest.raises(argparse.ArgumentTypeError, match="no shape given"):
        bench._shapes(",")


def test_run_without_a_gpu_is_a_usage_error():
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: run() would start the benchmark")
    with pytest.raises(UsageError, match="bench megamoe needs a CUDA GPU"):
        run_bench(parse("--tokens", "8"))
    with pytest.raises(UsageError, match="at least 1"):
        run_bench(parse("--replays", "0"))


def test_api_missing_is_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "megamoe.api", None)  # as if megamoe/api.py did not exist
    cls, why = bench.load_api()
    assert cls is None and why.startswith("megamoe.api unavailable (ModuleNotFoundError")


def test_sort_by_expert_puts_skipped_entries_last():
    idx = torch.tensor([[2, -1], [0, 2], [-1, -1], [1, 0]], dtype=torch.int32)
    rows = sort_by_expert(idx, torch.arange(8.0).reshape(4, 2), 4)
    assert rows.offs.dtype == torch.int32 and rows.offs.tolist() == [2, 3, 5, 5]  # expert 3: no rows
    assert rows.token.tolist() == [1, 3, 3, 0, 1, 0, 2, 2]
    assert rows.dest.tolist() == [1, 3, 3, 0, 1, 4, 4, 4]  # -1 entries go to the dummy row T = 4
    assert rows.weight.tolist()[:5] == [2.0, 7.0, 6.0, 0.0, 3.0]


def _grouped_mm_on_cpu() -> str | None:
    try:
        a = torch.zeros(4, 16, dtype=torch.bfloat16)
        torch._grouped_mm(a, torch.zeros(2, 16, 8, dtype=torch.bfloat16), offs=torch.tensor([2, 4]).int())
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        return f"torch {torch.__version__} runs no torch._grouped_mm on the CPU ({type(e).__name__})"
    return None


def _layer(seed, tokens, preset, device="cpu", mode="balanced"):
    w1, w2 = bench.make_weights(preset, seed, device)
    x = torch.randn(tokens, preset.hidden, generator=torch.Generator(device).manual_seed(seed),
                    device=device).to(torch.bfloat16)
    idx, wts = make_routing(tokens, preset.num_experts, preset.top_k, mode, seed, device)
    return x, idx, wts, w1, w2


def _rel(got, ref):
    return float((got.float() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("mode", ROUTING_MODES)
def test_unfused_bf16_matches_the_reference_on_cpu(seed, mode):
    why = _grouped_mm_on_cpu()
    if why:
        pytest.skip(why)
    x, idx, wts, w1, w2 = _layer(seed, 37, bench.Preset("p", 256, 128, 6, 3), mode=mode)
    idx[::5, 1] = -1  # skipped entries; with one_expert, experts 3..5 get no rows
    y = unfused_bf16_moe(x, idx, wts, w1, w2)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    ref = reference_moe(x, idx, wts, w1, w2, intermediate_dtype=torch.bfloat16)
    assert _rel(y, ref) < 2e-2, (mode, seed)


# --- a whole run on the CPU ------------------------------------------------------------------------------------

class FakeMegaMoE:
    """MegaMoE's constructor, load_weights, forward and last_dump as benchmarks.megamoe calls them; forward is
    the reference (bf16 out). FP8 is 'not built', so its columns must be recorded as skipped with the reason."""

    def __init__(self, group, num_experts, top_k, hidden, intermediate, dtype=torch.bfloat16,
                 schedule="interleaved", lead=None, max_tokens_per_rank=None, emulated_ranks=1, instrument=False):
        if dtype != torch.bfloat16:
            raise NotImplementedError("fp8 not built")
        self.limit, self.top_k, self.instrument = max_tokens_per_rank * emulated_ranks, top_k, instrument
        self.schedules = []
        self.shape = MoEShape(hidden, intermediate)  # the dump's header names the tile N

    def load_weights(self, w1, w2):
        self.w = (w1, w2)

    def forward(self, x, topk_idx, topk_weights, schedule=None):
        assert x.shape[0] <= self.limit and topk_idx.shape[1] == self.top_k
        self.schedules.append(schedule)
        return reference_moe(x, topk_idx, topk_weights, *self.w).to(torch.bfloat16)

    def last_dump(self):
        assert self.instrument
        return {"tile_kind": np.array([0, 1, 1], dtype=np.int32), "t_rs_ns": np.array([5.0, 7.0, 9.0])}


class NoEmulation(FakeMegaMoE):
    def __init__(self, group, num_experts, top_k, hidden, intermediate, **kw):
        if "emulated_ranks" in kw:
            raise TypeError("__init__() got an unexpected keyword argument 'emulated_ranks'")
        super().__init__(group, num_experts, top_k, hidden, intermediate, **kw)


class FakeEmulated:
    """The API's EmulatedMoE as the bench uses it: P ranks, per-rank lists in and out, bf16 only."""

    def __init__(self, world, num_experts, top_k, hidden, intermediate, max_tokens_per_rank=4096,
                 schedule="interleaved", lead=None, instrument=False):
        self.ranks = [FakeMegaMoE(None, num_experts, top_k, hidden, intermediate,
                                  max_tokens_per_rank=max_tokens_per_rank, instrument=instrument)
                      for _ in range(world)]

    def load_weights(self, w1, w2):
        for m in self.ranks:
            m.load_weights(w1, w2)

    def forward(self, xs, idxs, weights, schedule=None):
        assert len(xs) == len(self.ranks) and all(x.shape[0] == xs[0].shape[0] for x in xs)
        return [m.forward(x, i, w, schedule) for m, x, i, w in zip(self.ranks, xs, idxs, weights)]


FAKE_API = SimpleNamespace(MegaMoE=FakeMegaMoE)


CEILINGS = {"bf16_tflops": 800.0, "fp8_tflops": 1450.0, "hbm_tb_s": 4.3}


def fake_run(tmp_path, *argv, api=(FAKE_API, None)):
    args = parse("--out", str(tmp_path / "moe.json"), *argv)
    args.shapes = [TINY]

    def timer(cols):  # distinct medians per column, in COLUMNS order
        us = {n: 100.0 + 10 * bench.COLUMNS.index(n) for n in cols}
        return us, {n: [t, t + 1.0, t - 1.0] for n, t in us.items()}

    result = bench.bench(args, None, device="cpu", ceilings=CEILINGS, capture=lambda fn: (None, "eager (stub)"),
                         timer=timer, api=api)
    with open(args.out) as f:
        saved = json.load(f)
    assert (tmp_path / "moe.png").read_bytes()[:8] == PNG_MAGIC
    return result, saved


def test_whole_run_schema(tmp_path):
    why = _grouped_mm_on_cpu()
    if why:
        pytest.skip(why)
    _, saved = fake_run(tmp_path, "--tokens", "40,3", "--routing", "balanced,one_expert", "--world", "1,2")
    assert set(saved) >= {"provenance", "method", "args", "ceilings", "rows", "presets", "api_unavailable",
                          "unfused_fp8_unavailable", "unfused_fp8_recipe"}
    assert saved["provenance"]["command"].startswith("xstage bench megamoe")
    assert saved["ceilings"] == CEILINGS and saved["presets"]["tiny"]["num_experts"] == 4
    assert "CUDA" in saved["unfused_fp8_unavailable"]
    rows = saved["rows"]
    assert [(r["world"], r["tokens_per_rank"], r["routing"]) for r in rows] == [
        (w, t, m) for w in (1, 2) for t in (40, 3) for m in ("balanced", "one_expert")]
    for r in rows:
        assert r["tokens"] == r["world"] * r["tokens_per_rank"] and r["rows"] == r["tokens"] * 2
        if r["routing"] == "one_expert":
            assert r["experts_touched"] == 2 and r["max_rows_per_expert"] == r["tokens"]
        assert set(r["roofline"]) == {"bf16", "fp8", "w4a8"} and r["flops"] == r["roofline"]["fp8"]["flops"]
        if r["routing"] == "one_expert":  # two experts of tokens rows each, in 64-row halves
            assert r["mma_rows"] == 2 * 64 * -(-r["tokens"] // 64)
        assert r["rows"] <= r["mma_rows"] < r["rows"] + 64 * r["experts_touched"]
        assert list(r["columns"]) == list(bench.COLUMNS), "every column is recorded"
        for name in ("unfused_bf16", "ours_bf16_wave", "ours_bf16_interleaved"):
            c = r["columns"][name]
            assert c["timing"] == "eager (stub)" and c["dtype"] == "bf16"
            assert c["us"] == 100.0 + 10 * bench.COLUMNS.index(name)
            assert c["tflops"] == pytest.approx(r["flops"] / c["us"] / 1e6)
            assert c["roofline_efficiency"] == pytest.approx(r["roofline"]["bf16"]["seconds"] * 1e6 / c["us"])
            if name.startswith("ours_"):
                assert c["mma_tflops"] == pytest.approx(c["tflops"] * r["mma_rows"] / r["rows"])
            else:
                assert "mma_tflops" not in c, "the padding rows are the kernel's, not the unfused path's"
            assert c["error"]["finite"] and c["error"]["max_rel"] < 2e-2, (name, c["error"])
        assert r["columns"]["ours_bf16_wave"]["speedup_vs_unfused"] == pytest.approx(100.0 / 120.0)
        assert r["interleaved_over_wave"] == {"bf16": pytest.approx(130.0 / 120.0), "fp8": None, "w4a8": None}
        assert "CUDA" in r["columns"]["unfused_fp8"]["skipped"]
        for name in ("ours_fp8_wave", "ours_fp8_interleaved"):
            assert r["columns"][name] == {
                "skipped": "MegaMoE(fp8) unsupported here: NotImplementedError: fp8 not built"}
        assert set(r["round_times_us"]) == {"unfused_bf16", "ours_bf16_wave", "ours_bf16_interleaved"}


def test_missing_api_emulation_and_column_choice(tmp_path):
    _, saved = fake_run(tmp_path, "--tokens", "5", "--routing", "skewed", "--world", "1",
                        "--columns", "ours_bf16_wave", api=(None, "megamoe.api unavailable (ImportError: x)"))
    cols = saved["rows"][0]["columns"]
    assert cols["ours_bf16_wave"] == {"skipped": "megamoe.api unavailable (ImportError: x)"}
    assert cols["unfused_bf16"] == {"skipped": "left out by --columns"}
    assert saved["api_unavailable"] == "megamoe.api unavailable (ImportError: x)"
    _, saved = fake_run(tmp_path, "--tokens", "5", "--routing", "skewed", "--world", "2",
                        "--columns", "ours_bf16_wave", api=(SimpleNamespace(MegaMoE=NoEmulation), None))
    assert saved["rows"][0]["columns"]["ours_bf16_wave"]["skipped"].startswith("MegaMoE takes no emulated_ranks yet")
    # with the API's EmulatedMoE instead: per-rank views of the stacked inputs, bf16 only
    module = SimpleNamespace(MegaMoE=NoEmulation, EmulatedMoE=FakeEmulated)
    _, saved = fake_run(tmp_path, "--tokens", "5", "--routing", "skewed", "--world", "2", "--columns",
                        "ours_bf16_wave,ours_fp8_wave", "--dump", str(tmp_path / "d"), api=(module, None))
    cols = saved["rows"][0]["columns"]
    assert cols["ours_bf16_wave"]["error"]["max_rel"] < 2e-2 and "us" in cols["ours_bf16_wave"]
    assert cols["ours_fp8_wave"]["skipped"].endswith("EmulatedMoE takes no dtype: bf16 only, not fp8")
    with np.load(tmp_path / "d.npz") as z:
        assert z["r0.ours_bf16_wave.rank"].tolist() == [0, 0, 0, 1, 1, 1]


def test_a_failing_column_is_recorded_and_the_rest_still_runs(tmp_path):
    class Broken(FakeMegaMoE):
        def forward(self, x, topk_idx, topk_weights, schedule=None):
            if schedule == "wave":
                raise RuntimeError("bounded wait timed out: l1_done\nmore")
            return super().forward(x, topk_idx, topk_weights, schedule)

    _, saved = fake_run(tmp_path, "--tokens", "5", "--world", "1", "--routing", "balanced",
                        "--columns", "ours_bf16_wave,ours_bf16_interleaved",
                        api=(SimpleNamespace(MegaMoE=Broken), None))
    cols = saved["rows"][0]["columns"]
    assert cols["ours_bf16_wave"] == {"failed": "RuntimeError: bounded wait timed out: l1_done"}
    assert "us" in cols["ours_bf16_interleaved"]


def test_dump_writes_npz_and_header(tmp_path):
    dump = tmp_path / "tiles"
    _, saved = fake_run(tmp_path, "--tokens", "6", "--world", "1", "--routing", "skewed",
                        "--columns", "ours_bf16_wave,ours_bf16_interleaved,ours_fp8_wave", "--dump", str(dump))
    with np.load(tmp_path / "tiles.npz") as z:
        assert sorted(z.files) == sorted(f"r0.ours_bf16_{s}.{k}" for s in ("wave", "interleaved")
                                         for k in ("tile_kind", "t_rs_ns"))
        assert z["r0.ours_bf16_wave.t_rs_ns"].tolist() == [5.0, 7.0, 9.0]
    header = json.loads((tmp_path / "tiles.json").read_text())
    assert header["npz"] == "tiles.npz" and [e["column"] for e in header["entries"]] == ["ours_bf16_wave",
                                                                                         "ours_bf16_interleaved"]
    assert header["entries"][0]["arrays"]["t_rs_ns"] == {"shape": [3], "dtype": "float64", "median": 7.0}
    assert header["entries"][0]["block_n"] == 128, "the header names the tile N the records' n counts in"
    row_dump = saved["rows"][0]["dump"]
    assert row_dump["ours_bf16_wave"]["key_prefix"] == "r0.ours_bf16_wave"
    assert "fp8 not built" in row_dump["ours_fp8_wave"]["skipped"]
    assert bench._dump_paths("a/b.npz") == ("a/b.npz", "a/b.json") == bench._dump_paths("a/b.json")


# --- on the GPU --------------------------------------------------------------------------------------------------

GPU_LAYER = bench.Preset("gpu", 512, 256, 16, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_unfused_paths_on_the_gpu_replay_in_a_graph_on_new_inputs(seed, dtype):
    if dtype == "fp8" and fp8_grouped_unavailable("cuda"):
        pytest.skip(fp8_grouped_unavailable("cuda"))
    x, idx, wts, w1, w2 = _layer(seed, 1000, GPU_LAYER, "cuda", "skewed")  # not a multiple of 128 rows
    idx[::7, 0] = -1
    fp8w = fp8_rowwise_weights(w1, w2) if dtype == "fp8" else None

    def call():
        return unfused_bf16_moe(x, idx, wts, w1, w2) if dtype == "bf16" else unfused_fp8_moe(x, idx, wts, fp8w)

    tol = 2e-2 if dtype == "bf16" else 8e-2  # row-wise FP8 against the unquantized layer
    ref = reference_moe(x, idx, wts, w1, w2, intermediate_dtype=torch.bfloat16)
    assert _rel(call(), ref) < tol, (dtype, seed)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # warm-up on a side stream, as capture wants
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()  # no host sync may happen in here (capture raises if one does)
    for step in range(3):  # new tokens, new routing (one_expert: most experts empty), same buffers
        mode = ("balanced", "one_expert", "skewed")[step]
        nx, nidx, nwts, _, _ = _layer(seed + step + 1, 1000, GPU_LAYER, "cuda", mode)
        x.copy_(nx), idx.copy_(nidx), wts.copy_(nwts)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_moe(x, idx, wts, w1, w2, intermediate_dtype=torch.bfloat16)
        assert _rel(out, ref) < tol, (dtype, mode, seed)
