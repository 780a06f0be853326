"""Real ranks for ``xstage bench megamoe`` and ``--matrix`` (benchmarks/megamoe_ep.py) and the unfused NCCL
baseline (benchmarks/moe_nccl.py), on the CPU: the rank-mode choice and the flags; the baseline's dispatch,
receive permutation and combine with the All-to-Alls simulated by list shuffling at P = 1, 2, 4 against the
reference; the layer itself through real collectives (gloo, one rank in process and two spawned); and whole
runs of the bench and the matrix with a one-GPU phase in process and a real-P = 2 phase in two spawned gloo
ranks, the GPU parts stubbed (timing, capture, ceilings, a stand-in MegaMoE). The multi-GPU test (marked
``multigpu``) runs the baseline over NCCL on two GPUs, captured in a CUDA graph."""

import argparse
import json
import os
from types import SimpleNamespace

import pytest
import torch

from benchmarks import megamoe as mb
from benchmarks import megamoe_ep as ep
from benchmarks import megamoe_ranks as rk
from benchmarks import megamoe_matrix as mx
from benchmarks import moe_nccl as nc
from benchmarks.moe_baselines import sort_by_expert
from calibrate.cli import UsageError
from megamoe.reference import make_routing, reference_moe
from xstage import cli

TINY = mb.Preset("tiny", 256, 128, 8, 3)
CEILINGS = {"bf16_tflops": 800.0, "fp8_tflops": 1450.0, "hbm_tb_s": 4.3}


def _grouped_mm_on_cpu() -> str | None:
    try:
        torch._grouped_mm(torch.zeros(4, 16, dtype=torch.bfloat16), torch.zeros(2, 16, 8, dtype=torch.bfloat16),
                          offs=torch.tensor([2, 4]).int())
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        return f"torch {torch.__version__} runs no torch._grouped_mm on the CPU ({type(e).__name__})"
    return None


needs_grouped_mm = pytest.mark.skipif(_grouped_mm_on_cpu() is not None, reason=str(_grouped_mm_on_cpu()))


def _rel(got, ref):
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max())


# --- the rank mode and the flags --------------------------------------------------------------------------------

def test_rank_mode_choice():
    assert rk.rank_modes(None, [1, 2], 2) == {1: "one GPU", 2: "real"}
    assert rk.rank_modes(None, [1, 2, 4], 2) == {1: "one GPU", 2: "real", 4: "emulated"}
    assert rk.rank_modes(None, [2], 1) == {2: "emulated"} == rk.rank_modes("emulated", [2], 8)
    assert rk.rank_modes("real", [2, 8], 8) == {2: "real", 8: "real"}
    with pytest.raises(UsageError, match="--ranks real --world 4 needs 4 GPUs, 2 visible"):
        rk.rank_modes("real", [1, 4], 2)
    assert rk.rank_modes("real", [4], 0, check=False) == {4: "real"}  # --plan
    rec = rk.ranks_record(None, {1: "one GPU", 2: "real"}, 2)
    assert rec == {"ranks": "auto", "ranks_by_world": {"1": "one GPU", "2": "real"},
                   "ranks_rule": "default: real where torch.cuda.device_count() (2) >= the world, else emulated"}
    assert rk.ranks_record("emulated", {2: "emulated"}, 2)["ranks_rule"] == "--ranks emulated"


def test_flags_of_the_bench_and_the_matrix(capsys):
    p = argparse.ArgumentParser()
    mb.add_arguments(p)
    args = p.parse_args(["--world", "1,2,8", "--ranks", "real", "--columns", "unfused_nccl_bf16,ours_bf16_wave"])
    assert args.ranks == "real" and args.world == [1, 2, 8] and args.columns == ["unfused_nccl_bf16", "ours_bf16_wave"]
    assert p.parse_args([]).ranks is None
    for argv in (["bench", "megamoe", "--ranks", "both"], ["bench", "megamoe", "--world", "3"],
                 ["bench", "megamoe", "--matrix", "--ranks", "fake"]):
        assert cli.main(argv) == 2
    if not torch.cuda.is_available():  # the GPU check comes before the rank mode's
        assert cli.main(["bench", "megamoe", "--world", "2", "--ranks", "real"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
    capsys.readouterr()
    assert cli.main(["bench", "megamoe", "--matrix", "--plan", "--shapes", "dit-moe", "--precision", "bf16",
                     "--world", "1,2", "--ranks", "real", "--tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert "dit-moe/bf16/skewed@1.2/T4096/EP2" in out and "dit-moe/bf16/balanced/T4096/P1" in out
    assert "/P2 " not in out


def test_real_configurations_memory_and_time():
    p = argparse.ArgumentParser()
    mx.add_arguments(p)
    args = mx.resolve(p.parse_args(["--shapes", "dsv4-pro", "--precision", "bf16", "--routing", "balanced",
                                    "--tokens", "8192", "--world", "1,2"]))
    args.rank_modes = {1: "one GPU", 2: "real"}
    one, real = mx.configurations(args)
    assert (one.key, real.key, real.real) == ("dsv4-pro/bf16/balanced/T8192/P1", "dsv4-pro/bf16/balanced/T8192/EP2",
                                              True)
    assert mx.describe(real)["ranks"] == "real" and mx.describe(real)["world_mode"].startswith("real: 2 ranks")
    emu = mx.memory_estimate(real.preset, 2, 8192, 2)
    per_gpu = mx.memory_estimate(real.preset, 2, 8192, 2, real=True)
    assert per_gpu["layer_copy"] == pytest.approx(emu["layer_copy"] / 2, abs=1e-3)
    assert per_gpu["buffers"] == pytest.approx(emu["buffers"] / 2, abs=1e-3) and per_gpu["total"] < emu["total"]
    emulated_s = mx.kernel_seconds(real.preset, 2, 8192)
    assert mx.kernel_seconds(real.preset, 2, 8192, real=True) == pytest.approx(emulated_s / 2)
    assert mx.config_seconds(real, 20, 2) < mx.config_seconds(mx.Config(real.preset, "bf16", "balanced", 8192, 2,
                                                                       None), 20, 2)


# --- the index math, the All-to-Alls simulated ---------------------------------------------------------------------

def test_receive_index_by_hand():
    # 2 sources x 2 local experts: received chunks (j, l) of sizes [[2, 1], [0, 3]] arrive as
    # rows 0-1 (j0 l0), 2 (j0 l1), 3-5 (j1 l1); expert-major: l0 from j0 (0, 1), l1 from j0 (2), from j1 (3, 4, 5)
    src, offs = nc.receive_index(torch.tensor([[2, 1], [0, 3]]), 6)
    assert src.tolist() == [0, 1, 2, 3, 4, 5] and offs.tolist() == [2, 6] and offs.dtype == torch.int32
    src, offs = nc.receive_index(torch.tensor([[1, 2], [3, 0]]), 6)  # rows j0l0 | j0l1 j0l1 | j1l0 x3
    assert src.tolist() == [0, 3, 4, 5, 1, 2] and offs.tolist() == [4, 6]
    src, offs = nc.receive_index(torch.zeros(2, 3, dtype=torch.int64), 0)
    assert src.numel() == 0 and offs.tolist() == [0, 0, 0]
    assert nc.rank_splits([1, 2, 3, 4], 2) == [3, 7] and nc.rank_splits([5], 1) == [5]
    with pytest.raises(ValueError):
        nc.rank_splits([1, 2, 3], 2)
    idx = torch.tensor([[3, -1], [0, 3]])
    key, order = nc.sort_entries(idx, 4)
    assert key.tolist() == [0, 3, 3, 4] and order.tolist() == [2, 0, 3, 1]
    assert nc.expert_counts(key, 4).tolist() == [1, 0, 0, 2]


def simulate_ep(x, idx, wts, w1, w2, world: int) -> tuple[list, list]:
    """The baseline's pieces on ``world`` simulated ranks (rank r: rows [rT, (r+1)T)): per rank y, and the rows
    each rank's grouped GEMM saw (expert-major)."""
    e, k = w1.shape[0], idx.shape[1]
    t, local = x.shape[0] // world, e // world
    parts = [slice(r * t, (r + 1) * t) for r in range(world)]
    srt = [nc.sort_entries(idx[s], e) for s in parts]
    counts = [nc.expert_counts(key, e) for key, _ in srt]
    sent = [int(c.sum()) for c in counts]
    token = [order[:n] // k for (_, order), n in zip(srt, sent)]
    send_splits = [nc.rank_splits(c.tolist(), world) for c in counts]
    recv_counts = nc.simulate_all_to_all(counts, [[local] * world] * world)  # the counts All-to-All
    recv = nc.simulate_all_to_all([x[s].index_select(0, tok) for s, tok in zip(parts, token)], send_splits)
    rows, backs = [], []
    for r in range(world):
        src, offs = nc.receive_index(recv_counts[r].view(world, local), recv[r].shape[0])
        rows.append(recv[r].index_select(0, src))
        out = nc.expert_ffn_bf16(rows[-1], offs, w1[r * local:(r + 1) * local], w2[r * local:(r + 1) * local])
        back = torch.empty_like(out)
        back.index_copy_(0, src, out)
        backs.append(back)
    recv_splits = [nc.rank_splits(c.tolist(), world) for c in recv_counts]
    back = nc.simulate_all_to_all(backs, recv_splits)  # the combine: each rank's rows back to their sources
    ys = [nc.weighted_sum(back[j], token[j], wts[s].reshape(-1)[srt[j][1][:sent[j]]], t)
          for j, s in enumerate(parts)]
    return ys, rows


@needs_grouped_mm
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("mode", ["balanced", "skewed", "one_expert"])
def test_simulated_dispatch_and_combine_reproduce_the_reference(seed, world, mode):
    t = 29  # per rank, not a multiple of anything
    w1, w2 = mb.make_weights(TINY, seed, "cpu")
    x = torch.randn(world * t, TINY.hidden, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    idx, wts = make_routing(world * t, TINY.num_experts, TINY.top_k, mode, seed)
    idx[::4, 1] = -1  # skipped entries (never sent)
    ys, rows = simulate_ep(x, idx, wts, w1, w2, world)
    for r, y in enumerate(ys):
        s = slice(r * t, (r + 1) * t)
        ref = reference_moe(x[s], idx[s], wts[s], w1, w2, intermediate_dtype=torch.bfloat16)
        assert y.shape == (t, TINY.hidden) and _rel(y, ref) < 2e-2, (world, mode, r, seed)
    # the rows each rank's GEMMs see are the one-GPU path's expert-sorted rows of its experts, in the same order
    one = sort_by_expert(idx, wts, TINY.num_experts)
    every = x.index_select(0, one.token)
    ends = [0, *one.offs.tolist()]
    local = TINY.num_experts // world
    for r in range(world):
        assert torch.equal(rows[r], every[ends[r * local]:ends[(r + 1) * local]]), (world, mode, r)


# --- the layer through real collectives (gloo) -------------------------------------------------------------------

@pytest.fixture
def gloo_one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@needs_grouped_mm
def test_the_layer_on_a_one_rank_gloo_group(seed, gloo_one_rank):
    w1, w2 = mb.make_weights(TINY, seed, "cpu")
    x = torch.randn(50, TINY.hidden, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    idx, wts = make_routing(50, TINY.num_experts, TINY.top_k, "skewed", seed)
    idx[::3, 0] = -1
    layer = nc.NcclEPMoE(gloo_one_rank, w1, w2)
    plan = layer.plan(idx)
    valid = int((idx >= 0).sum())
    assert (plan.sent, plan.received, plan.send_splits, plan.recv_splits) == (valid, valid, [valid], [valid])
    assert plan.recv_counts.shape == (1, TINY.num_experts)
    ref = reference_moe(x, idx, wts, w1, w2, intermediate_dtype=torch.bfloat16)
    assert _rel(layer.forward(x, idx, wts, plan), ref) < 2e-2, seed
    assert len(ep.exchange_seconds(lambda: layer.plan(idx), 3, gloo_one_rank, "cpu")) == 3
    with pytest.raises(ValueError, match="bf16 or fp8"):
        nc.NcclEPMoE(gloo_one_rank, w1, w2, "w4a8")


def _layer_worker(rank, world, init_file, out, seed):
    from cute_kernels.dist import process_group

    with process_group(rank, world, init_file, backend="gloo") as group:
        t = 31 + 7 * rank  # uneven tokens per rank
        w1, w2 = mb.make_weights(TINY, seed, "cpu")
        x = torch.randn(t, TINY.hidden, generator=torch.Generator().manual_seed(seed + rank)).to(torch.bfloat16)
        idx, wts = make_routing(t, TINY.num_experts, TINY.top_k, "skewed", seed + rank)
        idx[::5, 2] = -1
        layer = nc.NcclEPMoE(group, w1, w2)
        plan = layer.plan(idx)
        ref = reference_moe(x, idx, wts, w1, w2, intermediate_dtype=torch.bfloat16)
        dest = torch.where(idx >= 0, idx // layer.num_local, world).reshape(-1)
        report = {"rel": _rel(layer.forward(x, idx, wts, plan), ref),
                  "send_splits": plan.send_splits, "want_splits": [int((dest == d).sum()) for d in range(world)],
                  "recv_splits": plan.recv_splits, "experts": [layer.w1.shape[0], layer.num_local]}
        with open(f"{out}.{rank}", "w") as f:
            json.dump(report, f)


@needs_grouped_mm
def test_the_layer_across_two_gloo_ranks(seed, tmp_path):
    from ranks import run_ranks

    reports = run_ranks(_layer_worker, tmp_path, world=2, args=(seed,))
    for rank, rep in enumerate(reports):
        assert rep["rel"] < 2e-2, (rank, seed)
        assert rep["send_splits"] == rep["want_splits"] and rep["experts"] == [4, 4]
    # what rank j sends rank d is what d receives from j
    assert [r["send_splits"][d] for r in reports for d in range(2)] == [
        reports[d]["recv_splits"][j] for j in range(2) for d in range(2)]


# --- what a real row records, and agreement -----------------------------------------------------------------------

def test_ep_stats_and_the_per_rank_roofline():
    idx = torch.tensor([[0, 5], [1, -1], [6, 7], [4, 2]])  # 2 ranks x 2 tokens; 8 experts, 4 per rank
    s = rk.ep_stats(idx, 8, 2)
    assert s["dispatch_rows"] == [[2, 1], [1, 3]] and s["rows_by_rank"] == [3, 4] and s["tokens_by_rank"] == [2, 2]
    assert s["experts_touched_by_rank"] == [3, 4] and s["remote_fraction"] == pytest.approx(2 / 7)
    roof = ep.rank_roofline(TINY, 2, s, "bf16", CEILINGS)
    assert roof["rank"] == 1 and len(roof["seconds_by_rank"]) == 2 and roof["rows"] == 4
    assert roof["seconds"] == max(roof["seconds_by_rank"]) and "NVLink not counted" in roof["scope"]


def test_merge_columns_over_ranks():
    err = lambda a, r, fin=True: {"reference": "fp32", "max_abs": a, "max_rel": r, "finite": fin}
    rank0 = {"a": {"timing": "graph", "error": err(0.1, 0.01), "us": 5.0}, "b": {"failed": "failed on another rank"},
             "c": {"skipped": "x"}, "d": {"failed": "boom"}}
    rank1 = {"a": {"timing": "eager (E)", "error": err(0.3, None, False), "us": 5.0}, "b": {"failed": "OOM"},
             "c": {"skipped": "x"}, "d": {"failed": "boom"}}
    m = rk.merge_columns([rank0, rank1])
    assert m["a"]["error"]["max_abs"] == 0.3 and m["a"]["error"]["max_rel"] == 0.01 and not m["a"]["error"]["finite"]
    assert m["a"]["timing"] == ["graph", "eager (E)"] and m["a"]["us"] == 5.0
    assert m["b"] == {"failed": "rank 1: OOM"} and m["c"] == {"skipped": "x"} and m["d"] == {"failed": "boom"}
    assert rk.one_reason([(0, "a"), (1, "a")], 2) == "a" and rk.one_reason([(1, "a")], 2) == "rank 1: a"


def test_run_columns_times_only_what_every_rank_checked():
    votes = []

    def agree(ok):  # another rank failed "b"'s eager check
        votes.append(ok)
        return ok and len(votes) != 3

    calls = {"a": lambda: torch.ones(2), "b": lambda: torch.ones(2), "c": {"skipped": "no"}}
    timed = {}

    def timer(live):
        timed.update(live)
        return {n: 1.0 for n in live}, {n: [1.0] for n in live}

    cols, _ = mb.run_columns(calls, lambda n: (torch.ones(2), "ones"), lambda fn: (None, "eager (stub)"), timer,
                             agree=agree)
    assert list(timed) == ["a"] and cols["b"] == {"failed": "failed on another rank"} and cols["c"] == {"skipped": "no"}
    assert cols["a"]["us"] == 1.0 and cols["a"]["timing"] == "eager (stub)" and votes == [True, True, True]


# --- whole runs: a one-GPU phase here, a real P = 2 phase in two gloo ranks -------------------------------------------

class FakeMegaMoE:
    """MegaMoE as the bench and the matrix build it at real ranks (MegaMoE(group, ...)); forward is the
    reference on this rank's tokens. Only bf16 is built."""

    def __init__(self, group, num_experts, top_k, hidden, intermediate, dtype=torch.bfloat16,
                 schedule="interleaved", lead=None, max_tokens_per_rank=None, emulated_ranks=1, instrument=False):
        if dtype != torch.bfloat16:
            raise NotImplementedError("fp8 not built")
        self.limit = max_tokens_per_rank * emulated_ranks

    def load_weights(self, w1, w2):
        self.w = (w1, w2)

    def forward(self, x, topk_idx, topk_weights, schedule=None):
        assert x.shape[0] <= self.limit
        return reference_moe(x, topk_idx, topk_weights, *self.w).to(torch.bfloat16)


API = (SimpleNamespace(MegaMoE=FakeMegaMoE), None)


def stub_capture(fn):
    return None, "eager (stub)"


def stub_timer(cols):  # distinct medians per column, in COLUMNS order
    us = {n: 100.0 + 10 * mb.COLUMNS.index(n) for n in cols}
    return us, {n: [t, t + 1.0] for n, t in us.items()}


def stub_matrix_timer(cols, index):
    us = {"wave": 110.0 + index, "interleaved": 100.0}
    return {n: us[n] for n in cols}, {n: [us[n]] for n in cols}


def hooks(timer):
    kw = {"device": "cpu", "capture": stub_capture, "timer": timer, "api": API}
    bench_kw = {**kw, "ceilings": CEILINGS} if timer is stub_timer else {**kw, "capacity_gb": 50.0}
    return {"backend": "gloo", "local": bench_kw, "rank": bench_kw}


@needs_grouped_mm
def test_whole_bench_run_with_a_real_world(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["xstage", "bench", "megamoe", "--world", "1,2", "--ranks", "real"])
    p = argparse.ArgumentParser()
    mb.add_arguments(p)
    args = p.parse_args(["--out", str(tmp_path / "moe.json"), "--tokens", "24", "--routing", "balanced,one_expert",
                         "--world", "1,2", "--ranks", "real", "--replays", "3", "--tmp", str(tmp_path)])
    args.shapes, args.gpus = [TINY], 2
    args.rank_modes = rk.rank_modes(args.ranks, args.world, args.gpus)
    ep.run_bench(args, hooks(stub_timer))
    saved = json.loads((tmp_path / "moe.json").read_text())
    assert (tmp_path / "moe.png").read_bytes()[:4] == b"\x89PNG"
    assert saved["ranks_by_world"] == {"1": "one GPU", "2": "real"} and saved["args"]["ranks"] == "real"
    assert "P processes" in saved["method_real_ranks"] and "all_to_all_single" in saved["unfused_nccl_recipe"]
    assert set(saved["ceilings_by_world"]) == {"1", "2"}
    rows = saved["rows"]
    assert [(r["world"], r["ranks"], r["routing"]) for r in rows] == [
        (1, "one GPU", "balanced"), (1, "one GPU", "one_expert"), (2, "real", "balanced"), (2, "real", "one_expert")]
    for r in rows[:2]:
        assert r["columns"]["unfused_nccl_bf16"]["skipped"].startswith("needs real ranks") and "us" in r["columns"][
            "unfused_bf16"]
        assert r["baseline"]["bf16"] == "unfused_bf16"
    for r in rows[2:]:
        cols = r["columns"]
        assert list(cols) == list(mb.COLUMNS)
        assert r["tokens_per_rank"] == 24 and r["tokens"] == 48 and r["tokens_by_rank"] == [24, 24]
        assert sum(r["rows_by_rank"]) == r["rows"] == sum(map(sum, r["dispatch_rows"]))
        assert r["nccl_splits"]["send_by_rank"] == r["dispatch_rows"] and r["nccl_splits_exchange_us"] > 0
        base = cols["unfused_nccl_bf16"]
        assert base["us"] == 100.0 + 10 * mb.COLUMNS.index("unfused_nccl_bf16") and base["error"]["max_rel"] < 2e-2
        assert base["error"]["over"].startswith("max over 2 ranks")
        assert cols["unfused_bf16"]["skipped"].startswith("at real EP the unfused path is unfused_nccl_bf16")
        assert "CUDA" in cols["unfused_nccl_fp8"]["skipped"] and "fp8 not built" in cols["ours_fp8_wave"]["skipped"]
        wave = cols["ours_bf16_wave"]
        assert wave["error"]["max_rel"] < 2e-2 and r["baseline"]["bf16"] == "unfused_nccl_bf16"
        assert wave["speedup_vs_unfused"] == pytest.approx(base["us"] / wave["us"])
        assert wave["tflops_per_gpu"] == pytest.approx(wave["tflops"] / 2)
        roof = r["roofline"]["bf16"]
        assert len(roof["seconds_by_rank"]) == 2 and wave["roofline_efficiency"] == pytest.approx(
            roof["seconds"] * 1e6 / wave["us"])
        assert set(r["round_times_us"]) == {"unfused_nccl_bf16", "ours_bf16_wave", "ours_bf16_interleaved"}
    one = rows[3]  # every token on experts 0..2: all on rank 0, rank 1's experts idle
    assert one["dispatch_rows"] == [[72, 0], [72, 0]] and one["rows_by_rank"] == [144, 0]


@needs_grouped_mm
def test_whole_matrix_run_with_a_real_world(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["xstage", "bench", "megamoe", "--matrix", "--world", "1,2"])
    p = argparse.ArgumentParser()
    mx.add_arguments(p)
    argv = ["--out", str(tmp_path / "m.json"), "--tokens", "8", "--precision", "bf16,w8a8", "--world", "1,2",
            "--trials", "2", "--tmp", str(tmp_path)]
    args = mx.resolve(p.parse_args(argv))
    args.shapes, args.gpus = [TINY], 2
    args.rank_modes = rk.rank_modes(None, args.world, args.gpus)
    ep.run_matrix(args, hooks(stub_matrix_timer))
    saved = json.loads((tmp_path / "m.json").read_text())
    assert os.path.exists(tmp_path / "m.png") and "| 2 (real) |" in (tmp_path / "m.md").read_text()
    assert len(saved["runs"]) == 1 and saved["ranks_by_world"] == {"1": "one GPU", "2": "real"}
    by = {c["key"]: c for c in saved["configurations"]}
    real = by["tiny/bf16/skewed@1.2/T8/EP2"]
    assert real["status"] == "measured" and real["ranks"] == "real" and real["world_mode"].startswith("real: 2")
    assert real["wave"]["error"]["max_rel"] < 2e-2 and real["wave"]["error"]["over"].startswith("max over 2")
    assert real["tokens_by_rank"] == [8, 8] and sum(real["rows_by_rank"]) == real["rows"] == 16 * 3
    assert by["tiny/bf16/balanced/T8/P1"]["status"] == "measured"
    assert by["tiny/w8a8/balanced/T8/EP2"]["skip_kind"] == "precision"
    assert saved["summary"]["counts"]["measured"] == 4 and saved["summary"]["by_world"]["2"]["n"] == 2
    # --max-minutes reached in the one-GPU phase: the real phase is never started, its entries say why
    args = mx.resolve(p.parse_args([*argv, "--max-minutes", "0.0001"]))
    args.shapes, args.gpus, args.rank_modes = [TINY], 2, {1: "one GPU", 2: "real"}
    ep.run_matrix(args, hooks(stub_matrix_timer))
    saved = json.loads((tmp_path / "m.json").read_text())
    assert saved["stopped"].startswith("--max-minutes") and saved["summary"]["counts"]["measured"] == 0
    assert all(c["reason"] == saved["stopped"] for c in saved["configurations"] if c["status"] == "not_run")


class InstrumentedMegaMoE(FakeMegaMoE):
    """FakeMegaMoE with instrument=True's records (megamoe_fakes) of this rank's experts, as MegaMoE(group)'s
    last_dump returns them (no rank array: one rank's own)."""

    def __init__(self, group, num_experts, top_k, hidden, intermediate, instrument=False, **kw):
        import torch.distributed as dist

        super().__init__(group, num_experts, top_k, hidden, intermediate, **kw)
        self.instrument, self.num_experts = instrument, num_experts
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def forward(self, x, topk_idx, topk_weights, schedule=None):
        self.last = (topk_idx, schedule)
        return super().forward(x, topk_idx, topk_weights, schedule)

    def last_dump(self):
        from megamoe_fakes import fake_records

        if not self.instrument:
            raise ValueError("build the layer with instrument=True to record tiles")
        local = self.num_experts // self.world
        # rank 1 runs on 2 CTAs, rank 0 on 4: the gathered records tell the ranks apart by their rank array only
        return fake_records(self.last[0], range(self.rank * local, (self.rank + 1) * local), self.last[1],
                            ctas=4 - 2 * self.rank)


def test_whole_matrix_run_with_a_real_world_dumps(tmp_path, monkeypatch):
    """--dump at real EP = 2 (two gloo ranks) after a one-GPU phase: one dump, the real world's records of both
    ranks gathered to rank 0 and tagged with their rank, which the analysis CLI reads (EP2 rows apart)."""
    from benchmarks import megamoe_analysis as ma

    monkeypatch.setattr("sys.argv", ["xstage", "bench", "megamoe", "--matrix", "--world", "1,2", "--dump", "d"])
    p = argparse.ArgumentParser()
    mx.add_arguments(p)
    args = mx.resolve(p.parse_args(["--out", str(tmp_path / "m.json"), "--tokens", "8", "--precision", "bf16",
                                    "--world", "1,2", "--trials", "2", "--tmp", str(tmp_path),
                                    "--dump", str(tmp_path / "d")]))
    args.shapes, args.gpus = [TINY], 2
    args.rank_modes = rk.rank_modes(None, args.world, args.gpus)
    h = hooks(stub_matrix_timer)
    for phase in ("local", "rank"):
        h[phase]["api"] = (SimpleNamespace(MegaMoE=InstrumentedMegaMoE), None)
    ep.run_matrix(args, h)
    saved = json.loads((tmp_path / "m.json").read_text())
    by = {c["key"]: c for c in saved["configurations"]}
    assert saved["summary"]["counts"]["measured"] == 4
    header = json.loads((tmp_path / "d.json").read_text())
    got = {(e["key"], e["schedule"]): e for e in header["entries"]}
    assert set(got) == {(k, s) for k in by for s in mx.SCHEDULES}  # both phases' configurations in one dump
    import numpy as np

    with np.load(tmp_path / "d.npz") as z:
        for (key, s), e in got.items():
            assert e["key_prefix"] == by[key]["dump"][s]["key_prefix"] and e["precision"] == "bf16"
            if by[key]["ranks"] != "real":
                assert f"{e['key_prefix']}.rank" not in z.files
                continue
            assert e["ranks"] == "real" and e["world"] == 2
            rank, cta = z[f"{e['key_prefix']}.rank"], z[f"{e['key_prefix']}.cta"]
            assert set(rank.tolist()) == {0, 1}
            assert set(cta[rank == 0].tolist()) == {0, 1, 2, 3} and set(cta[rank == 1].tolist()) <= {0, 1}
            experts = z[f"{e['key_prefix']}.expert"]
            assert experts[rank == 0].max() < 4 <= experts[rank == 1].min()  # each rank its own experts
    out = tmp_path / "analysis"
    assert ma.main([str(tmp_path / "d.json"), "--out-dir", str(out)]) == 0
    stall = json.loads((out / "d_stall.json").read_text())
    rows = {(r["routing"], r["world"], r["ranks"]): r for r in stall["rows"]}
    assert set(rows) == {(r, w, m) for r in ("balanced", "skewed") for w, m in ((1, "one GPU"), (2, "real"))}
    real = rows[("skewed", 2, "real")]["schedules"]["wave"]
    assert real["ctas"] == 6 and set(real["rank_end_us"]) == {"0", "1"}
    assert "| tiny | bf16 | 8 | skewed | 2 (real) |" in (out / "d_stall.md").read_text()
    assert any(n.endswith("_EP2_wave.png") for n in os.listdir(out))


def test_regret_tool_uses_a_whole_gpu_per_real_rank(tmp_path):
    from benchmarks import megamoe_auto

    row = {"shape": "dit-moe", "world": 2, "tokens_per_rank": 4096, "routing": "skewed",
           "columns": {"ours_bf16_wave": {"us": 900.0}, "ours_bf16_interleaved": {"us": 800.0}}}
    rows = megamoe_auto.regrets({"rows": [{**row, "ranks": "real"}, {**row, "ranks": "emulated"}]}, "bf16")
    assert [(r["ranks"], r["grid"]) for r in rows] == [("real", 132), ("emulated", 66)]


# --- on two GPUs ---------------------------------------------------------------------------------------------------

def _nccl_worker(rank, world, init_file, out):
    import torch.distributed as dist

    from benchmarks.moe_baselines import fp8_grouped_unavailable
    from cute_kernels.dist import process_group

    with process_group(rank, world, init_file) as group:
        w1, w2 = mb.make_weights(mb.Preset("gpu", 1024, 512, 16, 4), 7, "cuda")
        t = 1000 + 37 * rank  # uneven tokens per rank
        x = torch.randn(t, 1024, generator=torch.Generator("cuda").manual_seed(rank), device="cuda").to(torch.bfloat16)
        idx, wts = make_routing(t, 16, 4, "skewed", 11 + rank, "cuda")
        ref = reference_moe(x, idx, wts, w1, w2, intermediate_dtype=torch.bfloat16)
        report = {}
        for d in ("bf16", "fp8"):
            if d == "fp8" and fp8_grouped_unavailable("cuda"):
                continue
            tol = 2e-2 if d == "bf16" else 8e-2  # row-wise FP8 against the unquantized layer
            layer = nc.NcclEPMoE(group, w1, w2, d)
            plan = layer.plan(idx)
            report[f"{d} eager close"] = _rel(layer.forward(x, idx, wts, plan), ref) < tol
            torch.cuda.synchronize()
            dist.barrier(group=group)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # no host sync may happen in here (capture raises if one does)
                y = layer.forward(x, idx, wts, plan)
            for _ in range(2):
                dist.barrier(group=group)
                graph.replay()
            torch.cuda.synchronize()
            report[f"{d} replay close"] = _rel(y, ref) < tol
        with open(f"{out}.{rank}", "w") as f:
            json.dump(report, f)


@pytest.mark.multigpu
def test_nccl_baseline_across_two_gpus(tmp_path):
    from ranks import run_ranks

    reports = run_ranks(_nccl_worker, tmp_path, world=2)
    assert reports[0], "no check reported"
    for rank, rep in enumerate(reports):
        for name, ok in rep.items():
            assert ok, f"rank {rank}: {name}"
