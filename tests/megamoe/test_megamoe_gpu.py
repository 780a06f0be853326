"""MegaMoE on one GPU: world size 1 and P = 2, 4 ranks emulated (concurrent launches on P streams, SMs / P
CTAs each, pointer tables into each other's buffers), against the fp32 reference with the kernel's roundings
(h and each expert's output row in bf16), poisoned outputs, fresh seeded inputs.

Tolerance: ||y - ref|| / ||ref|| <= 1e-2 and max |y - ref| <= 3e-2 * max |ref| (bf16 output, fp32 accumulation
in a different order, fast exp in SiLU: an h near a bf16 rounding boundary may round the other way). W8A8
against megamoe.reference_moe_fp8 with the kernel's quantization (weights 128 x 128 blocks, x 1 x 128, h 1 x 64):
3e-2 and 1e-1, since an h element that lands on the other side of an e4m3 rounding boundary moves by 1/16.
W4A8 against megamoe.reference_moe_w4a8 (the same weight recipe and activations) at W8A8's tolerance."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper: sm_90a)")]

SMALL = dict(hidden=1152, intermediate=512)  # 9 L2 N blocks: the interleaved order's odd-count pair slot
PAIRED = 1024  # a hidden size of 8 L2 N blocks: FP8 kernels run CTA pairs that multicast A (MegaMoEForward.cluster_n)
WIDE = 1024  # a hidden size bf16 runs in 128 x 256 tiles (4 L1 and 4 L2 N blocks of 256) at _wide_capacity


def _weights(num_experts, hidden, intermediate, seed):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(num_experts, 2 * intermediate, hidden, generator=g) / hidden ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, intermediate, generator=g) / intermediate ** 0.5).to(torch.bfloat16)
    return w1.cuda(), w2.cuda()


def _inputs(tokens, num_experts, top_k, mode, seed, hidden, drop=0.0):
    from megamoe.reference import make_routing

    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).cuda()
    idx, w = make_routing(tokens, num_experts, top_k, mode, seed, "cuda")
    if drop:
        mask = torch.rand(tokens, top_k, generator=g) < drop
        idx = torch.where(mask.cuda(), torch.full_like(idx, -1), idx)
    return x, idx, w


def _reference(x, idx, w, w1, w2):
    from megamoe.reference import reference_moe

    return reference_moe(x, idx, w, w1, w2, dtype=torch.float32, intermediate_dtype=torch.bfloat16,
                         combine_dtype=torch.bfloat16)


def _reference_fp8(x, idx, w, w1, w2, l2_block=64):
    """W8A8's reference; ``l2_block``: the intermediate's scale run, N / 2 of the layer's tile (64, or 128 in
    128 x 256 tiles)."""
    from megamoe.reference import quantize_fp8_blockwise_weights, reference_moe_fp8

    return reference_moe_fp8(x, idx, w, quantize_fp8_blockwise_weights(w1), quantize_fp8_blockwise_weights(w2),
                             l2_block=l2_block, combine_dtype=torch.bfloat16)


def _weights_w4(num_experts, hidden, intermediate, seed):
    """_weights with each 32-run scaled by 2^-j, j in 0..16 (a quarter of the runs; the rest 1): W4A8's
    conversion then takes every shift path inside the 128 x 128 blocks (exact, rounded below 2^-8, zero from
    2^-13 on)."""
    w1, w2 = _weights(num_experts, hidden, intermediate, seed)
    g = torch.Generator().manual_seed(seed + 7)

    def spread(w):
        j = torch.randint(0, 17, (*w.shape[:-1], w.shape[-1] // 32), generator=g).float()
        j = torch.where(torch.rand(j.shape, generator=g) < 0.25, j, torch.zeros_like(j))
        return (w.float() * torch.exp2(-j).repeat_interleave(32, -1).cuda()).to(torch.bfloat16)

    return spread(w1), spread(w2)


def _reference_w4(x, idx, w, w1, w2, l2_block=64):
    from megamoe.reference import reference_moe_w4a8

    return reference_moe_w4a8(x, idx, w, w1, w2, l2_block=l2_block, combine_dtype=torch.bfloat16)


def _close(y, ref, what, rel_tol=1e-2, worst_tol=3e-2):
    y = y.float()
    assert torch.isfinite(y).all(), f"{what}: non-finite output"
    scale = ref.abs().max().clamp_min(1e-6)
    rel = ((y - ref).norm() / ref.norm().clamp_min(1e-6)).item()
    worst = ((y - ref).abs().max() / scale).item()
    assert rel <= rel_tol and worst <= worst_tol, f"{what}: relative error {rel:.3g}, worst {worst:.3g}"


def _wide_capacity(num_experts, top_k, world=1, precision="bf16"):
    """The max_tokens_per_rank from which a bf16 or W8A8 layer runs 128 x 256 tiles (schedule.block_n_for)."""
    from megamoe.schedule import WIDE_TILE_MIN_ROWS_PER_EXPERT

    return -(-WIDE_TILE_MIN_ROWS_PER_EXPERT[precision] * num_experts // (top_k * world))


def _layer(num_experts, top_k, tokens, hidden=SMALL["hidden"], **kw):
    """A world-1 layer with room for ``tokens``; at hidden WIDE, room for the wide tile's capacity (W4A8 has
    no wide tile: its layers stay 128 x 128 there)."""
    from megamoe.api import MegaMoE, precision_of
    from megamoe.schedule import WIDE_TILE_MIN_ROWS_PER_EXPERT

    precision = precision_of(kw.get("dtype", torch.bfloat16))
    wide = hidden == WIDE and precision in WIDE_TILE_MIN_ROWS_PER_EXPERT
    cap = max(tokens, 1, _wide_capacity(num_experts, top_k, precision=precision) if wide else 1)
    return MegaMoE(None, num_experts, top_k, hidden, SMALL["intermediate"], max_tokens_per_rank=cap, **kw)


@pytest.mark.parametrize("tokens,num_experts,top_k,mode,drop,hidden", [
    (300, 8, 2, "balanced", 0.0, 1152), (1000, 8, 2, "skewed", 0.0, 1152), (127, 16, 1, "balanced", 0.0, 1152),
    (129, 16, 6, "skewed", 0.1, 1152), (513, 16, 8, "balanced", 0.0, 1152), (200, 8, 2, "one_expert", 0.0, 1152),
    (1, 8, 2, "balanced", 0.0, 1152), (300, 8, 2, "balanced", 0.0, WIDE), (129, 16, 6, "skewed", 0.1, WIDE),
    (200, 8, 2, "one_expert", 0.0, WIDE), (1, 8, 2, "balanced", 0.0, WIDE)])
def test_world1_matches_reference_both_schedules_bit_equal(seed, tokens, num_experts, top_k, mode, drop, hidden):
    """bf16 against the reference; both schedules, row groups and a second launch the same bits (hidden 1024:
    128 x 256 tiles, schedule.block_n_for)."""
    moe = _layer(num_experts, top_k, tokens, hidden=hidden)
    assert moe.shape.block_n == (256 if hidden == WIDE else 128)
    w1, w2 = _weights(num_experts, hidden, SMALL["intermediate"], seed)
    moe.load_weights(w1, w2)
    x, idx, w = _inputs(tokens, num_experts, top_k, mode, seed, hidden, drop)
    ref = _reference(x, idx, w, w1, w2)
    ys = {}
    for schedule in ("wave", "interleaved", "wave"):  # twice "wave": a second launch reuses every buffer
        y = torch.full_like(x, float("nan"))
        moe.launch(x, idx, w, y, schedule)
        moe.check_errors()
        _close(y, ref, f"{schedule} seed={seed}")
        ys.setdefault(schedule, []).append(y)
    assert torch.equal(ys["wave"][0], ys["interleaved"][0]), f"the two schedules differ (seed={seed})"
    assert torch.equal(ys["wave"][0], ys["wave"][1]), f"a second launch differs (seed={seed})"
    for m_group in (2, 4):  # row groups change only the order in which tiles run, never a tile's arithmetic
        moe.m_group = m_group
        for schedule in ("wave", "interleaved"):
            y = torch.full_like(x, float("nan"))
            moe.launch(x, idx, w, y, schedule)
            moe.check_errors()
            assert torch.equal(y, ys["wave"][0]), f"m_group={m_group} {schedule} differs (seed={seed})"


@pytest.mark.parametrize("world,hidden", [(2, 1152), (4, 1152), (2, WIDE)])
def test_emulated_ranks_match_reference(seed, world, hidden):
    from megamoe.api import EmulatedMoE

    num_experts, top_k = 16, 2
    tokens = [333, 0, 200, 129][:world]  # rank 1 has no tokens
    cap = _wide_capacity(num_experts, top_k, world) if hidden == WIDE else 400
    moe = EmulatedMoE(world, num_experts, top_k, hidden, SMALL["intermediate"], max_tokens_per_rank=cap)
    assert moe.ranks[0].shape.block_n == (256 if hidden == WIDE else 128)
    w1, w2 = _weights(num_experts, hidden, SMALL["intermediate"], seed)
    moe.load_weights(w1, w2)
    ins = [_inputs(t, num_experts, top_k, "skewed", seed + r, hidden) for r, t in enumerate(tokens)]
    for schedule in ("interleaved", "wave", "interleaved"):
        ys = moe.forward([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins], schedule)
        torch.cuda.synchronize()
        moe.check_errors()
        for r, (y, (x, idx, w)) in enumerate(zip(ys, ins)):
            if tokens[r]:
                _close(y, _reference(x, idx, w, w1, w2), f"rank {r}/{world} {schedule} seed={seed}")


@pytest.mark.parametrize("m_group,hidden", [(1, 1152), (2, 1152), (3, 1152), (2, WIDE)])
@pytest.mark.parametrize("schedule", ["wave", "interleaved"])
def test_instrumented_tile_order_is_the_schedule(seed, schedule, m_group, hidden):
    """The kernel's per-CTA tile order (its records) is megamoe.schedule's stream, tile for tile, for row groups
    of 1, 2 and 3 M blocks (3 leaves partial groups: the skewed experts have 1 to 9 M blocks)."""
    from megamoe import schedule as sched

    num_experts, top_k, tokens = 8, 2, 1500
    moe = _layer(num_experts, top_k, tokens, hidden=hidden, instrument=True)
    moe.m_group = m_group
    w1, w2 = _weights(num_experts, hidden, SMALL["intermediate"], seed)
    moe.load_weights(w1, w2)
    x, idx, w = _inputs(tokens, num_experts, top_k, "skewed", seed, hidden)
    y = moe.forward(x, idx, w, schedule)
    moe.check_errors()
    _close(y, _reference(x, idx, w, w1, w2), f"instrumented {schedule}")
    counts = torch.bincount(idx.flatten().long(), minlength=num_experts).tolist()
    work = sched.RankWork(moe.shape, tuple(counts))
    if schedule == "wave":
        want = sched.expert_wave_order(work, moe.grid, moe.experts_per_wave(tokens), m_group=m_group)
    else:
        want = sched.interleaved_order(work, moe.grid, moe.lead_rows, m_group=m_group)
    assert want.params["m_group"] == m_group
    dump = moe.last_dump()
    kinds = {1: sched.L1, 2: sched.L2}
    got = [[] for _ in range(moe.grid)]
    for c, s, k, e, m, n in zip(dump["cta"], dump["slot"], dump["kind"], dump["expert"], dump["m"], dump["n"]):
        got[int(c)].append((int(s), sched.Tile(kinds[int(k)], int(e), int(m), int(n))))
    assert sum(len(s) for s in want.streams) > 0
    for c in range(moe.grid):
        assert [t for _, t in sorted(got[c])] == list(want.streams[c]), f"CTA {c} ({schedule})"
    l2 = dump["kind"] == 2
    assert (dump["t_rs"][l2] > 0).all() and (dump["t_end"] >= dump["t_entry"]).all()
    # the store warp takes a tile's rows only once its mainloop ended, and its wait returns after that
    assert (dump["t_store_begin"] >= dump["t_mma_end"]).all()
    assert (dump["t_store_end"] >= dump["t_store_begin"]).all() and (dump["t_staging_wait"] >= 0).all()
    # each CTA's phases in order, its walk ending after its last tile was staged
    from megamoe.epilogue import PHASES

    ph = dump["phase_stamps"][:, : PHASES.index("dispatch_end")]
    assert ph.shape == (moe.grid, len(PHASES) - 1) and (ph > 0).all() and (np.diff(ph, axis=1) >= 0).all()
    # each CTA's own Dispatch ends after B1 and before B2 lets it go
    d_end = dump["phase_stamps"][:, PHASES.index("dispatch_end")]
    assert (d_end >= ph[:, PHASES.index("b1")]).all() and (d_end <= ph[:, PHASES.index("b2")]).all()
    for c in range(moe.grid):
        mine = dump["cta"] == c
        if mine.any():
            assert ph[c, PHASES.index("walk_end")] >= dump["t_end"][mine].max()
            assert ph[c, PHASES.index("b2")] <= dump["t_entry"][mine].min()


@pytest.mark.parametrize("dtype", ["bf16", "w4a8"])
def test_graph_replays_with_changing_inputs(seed, dtype):
    """1,000 CUDA-Graph replays over 4 input sets copied into the captured inputs: every replay's output equals
    that set's eager output bit for bit (counted on the GPU), and the eager outputs match the reference."""
    num_experts, top_k, tokens = 8, 2, 256
    moe = _layer(num_experts, top_k, tokens, dtype=torch.bfloat16 if dtype == "bf16" else dtype)
    w1, w2 = (_weights if dtype == "bf16" else _weights_w4)(num_experts, SMALL["hidden"], SMALL["intermediate"], seed)
    moe.load_weights(w1, w2)
    sets = [_inputs(tokens, num_experts, top_k, mode, seed + i, SMALL["hidden"])
            for i, mode in enumerate(("balanced", "skewed", "one_expert", "balanced"))]
    eager = []
    for x, idx, w in sets:
        y = moe.forward(x, idx, w)
        if dtype == "bf16":
            _close(y, _reference(x, idx, w, w1, w2), "eager")
        else:
            _close(y, _reference_w4(x, idx, w, w1, w2), "eager w4a8", 3e-2, 1e-1)
        eager.append(y.clone())
    sx, si, sw = (t.clone() for t in sets[0])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe.forward(sx, si, sw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = moe.forward(sx, si, sw)
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    for r in range(1000):
        x, idx, w = sets[r % 4]
        sx.copy_(x)
        si.copy_(idx)
        sw.copy_(w)
        graph.replay()
        bad += (y_static != eager[r % 4]).any().long()
    torch.cuda.synchronize()
    moe.check_errors()
    assert int(bad) == 0, f"{int(bad)} of 1000 replays differ from their eager output (seed={seed})"


def test_bad_inputs_raise_before_launch(seed):
    moe = _layer(8, 2, 64)
    x, idx, w = _inputs(64, 8, 2, "balanced", seed, SMALL["hidden"])
    with pytest.raises(ValueError, match="load_weights"):
        moe.forward(x, idx, w)
    moe.load_weights(*_weights(8, SMALL["hidden"], SMALL["intermediate"], seed))
    with pytest.raises(ValueError, match="expert ids"):
        moe.forward(x, torch.where(idx == 0, torch.full_like(idx, 8), idx), w)
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        moe.forward(torch.cat([x, x]), torch.cat([idx, idx]), torch.cat([w, w]))
    with pytest.raises(ValueError, match="int32"):
        moe.forward(x, idx.long(), w)
    with pytest.raises(ValueError, match="bfloat16"):
        moe.forward(x.float(), idx, w)
    with pytest.raises(ValueError, match="top_k"):
        moe.forward(x, idx[:, :1].contiguous(), w[:, :1].contiguous())
    with pytest.raises(ValueError, match="schedule"):
        moe.forward(x, idx, w, "fast")


def test_missing_peer_times_out_into_the_error_word(seed):
    """Emulated P = 2 with only rank 0 launched: its cross-rank barriers time out (bounded), the kernel
    finishes, and check_errors names the barrier."""
    from cute_kernels.runtime import XStageKernelError
    from megamoe.api import EmulatedMoE

    moe = EmulatedMoE(2, 8, 2, SMALL["hidden"], SMALL["intermediate"], max_tokens_per_rank=64)
    moe.load_weights(*_weights(8, SMALL["hidden"], SMALL["intermediate"], seed))
    x, idx, w = _inputs(64, 8, 2, "balanced", seed, SMALL["hidden"])
    r0 = moe.ranks[0]
    r0.launch(x, idx, w, torch.empty_like(x))
    torch.cuda.synchronize()
    with pytest.raises(XStageKernelError, match="barrier"):
        r0.check_errors()


def test_custom_op_equals_forward(seed):
    """moe(x, ...) goes through torch.ops.xstage.megamoe: the same bits as forward, and torch.compile keeps it
    as one opaque op."""
    moe = _layer(8, 2, 300)
    w1, w2 = _weights(8, SMALL["hidden"], SMALL["intermediate"], seed)
    moe.load_weights(w1, w2)
    x, idx, w = _inputs(300, 8, 2, "skewed", seed, SMALL["hidden"])
    direct = moe.forward(x, idx, w)
    via_op = moe(x, idx, w)
    compiled = torch.compile(lambda a, b, c: moe(a, b, c) * 1, fullgraph=True)(x, idx, w)
    moe.check_errors()
    assert torch.equal(direct, via_op) and torch.equal(direct, compiled), f"seed={seed}"


def _quantized(precision):
    """(MegaMoE dtype, weights, reference) of a quantized precision: W8A8 against reference_moe_fp8, W4A8 against
    reference_moe_w4a8 (its weights' runs spread over every shift path)."""
    return {"w8a8": (torch.float8_e4m3fn, _weights, _reference_fp8),
            "w4a8": ("w4a8", _weights_w4, _reference_w4)}[precision]


@pytest.mark.parametrize("precision,tokens,num_experts,top_k,mode,hidden", [
    ("w8a8", 300, 8, 2, "balanced", 1152), ("w8a8", 1000, 16, 6, "skewed", 1152),
    ("w8a8", 129, 8, 1, "one_expert", 1152), ("w4a8", 300, 8, 2, "balanced", 1152),
    ("w4a8", 1000, 16, 6, "skewed", 1152), ("w4a8", 129, 8, 1, "one_expert", 1152),
    ("w4a8", 200, 16, 8, "balanced", 1152), ("w8a8", 300, 8, 2, "balanced", PAIRED),
    ("w8a8", 1000, 16, 6, "skewed", PAIRED),
    ("w8a8", 129, 8, 1, "one_expert", PAIRED), ("w8a8", 1, 8, 2, "balanced", PAIRED),
    ("w4a8", 300, 8, 2, "balanced", PAIRED)])
def test_quantized_world1_matches_the_quantized_reference(seed, precision, tokens, num_experts, top_k, mode,
                                                           hidden):
    """W8A8 / W4A8 against the reference under the same quantization, at W8A8's tolerance; both schedules the
    same bits (hidden 1024: W8A8 in 128 x 256 tiles, its intermediate in 1 x 128 scale runs; W4A8 128 x 128)."""
    dtype, weights, reference = _quantized(precision)
    moe = _layer(num_experts, top_k, tokens, hidden=hidden, dtype=dtype)
    assert moe.shape.block_n == (256 if precision == "w8a8" and hidden == WIDE else 128)
    w1, w2 = weights(num_experts, hidden, SMALL["intermediate"], seed)
    moe.load_weights(w1, w2)
    x, idx, w = _inputs(tokens, num_experts, top_k, mode, seed, hidden)
    ref = reference(x, idx, w, w1, w2, moe.shape.block_n // 2)
    ys = {}
    for schedule in ("wave", "interleaved"):
        y = torch.full_like(x, float("nan"))
        moe.launch(x, idx, w, y, schedule)
        moe.check_errors()
        _close(y, ref, f"{precision} {schedule} seed={seed}", 3e-2, 1e-1)
        ys[schedule] = y
    assert torch.equal(ys["wave"], ys["interleaved"]), f"the two schedules differ (seed={seed})"


@pytest.mark.parametrize("precision,world,hidden", [("w8a8", 2, 1152), ("w4a8", 2, 1152), ("w8a8", 2, PAIRED),
                                                     ("w8a8", 4, PAIRED)])
def test_quantized_emulated_ranks(seed, precision, world, hidden):
    from megamoe.api import EmulatedMoE

    dtype, weights, reference = _quantized(precision)
    num_experts, top_k, tokens = 16, 2, [257, 100, 1, 31][:world]
    moe = EmulatedMoE(world, num_experts, top_k, hidden, SMALL["intermediate"], max_tokens_per_rank=300,
                      dtype=dtype)
    w1, w2 = weights(num_experts, hidden, SMALL["intermediate"], seed)
    moe.load_weights(w1, w2)
    ins = [_inputs(t, num_experts, top_k, "skewed", seed + r, hidden) for r, t in enumerate(tokens)]
    ys = moe.forward([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins])
    torch.cuda.synchronize()
    moe.check_errors()
    for r, (y, (x, idx, w)) in enumerate(zip(ys, ins)):
        _close(y, reference(x, idx, w, w1, w2, moe.ranks[0].shape.block_n // 2),
               f"{precision} rank {r}/{world} seed={seed}", 3e-2, 1e-1)


def test_auto_schedule_resolves_the_rules_pick_and_keeps_the_histogram(seed):
    moe = _layer(8, 2, 300, schedule="auto")
    w1, w2 = _weights(8, SMALL["hidden"], SMALL["intermediate"], seed)
    moe.load_weights(w1, w2)
    x, idx, w = _inputs(300, 8, 2, "balanced", seed, SMALL["hidden"])
    picked = moe.resolve_schedule(300)  # before any launch: the expected histogram
    assert picked in ("wave", "interleaved")
    assert torch.equal(moe.forward(x, idx, w), moe.forward(x, idx, w, picked)), f"seed={seed}"
    moe.check_errors()
    # the auto launch left its routing histogram for the next decision (copied without a sync)
    torch.cuda.synchronize()
    rows, tokens = moe.history.latest()
    assert tokens == 300 and rows == tuple(torch.bincount(idx.flatten().long().cpu(), minlength=8).tolist()), seed
    assert moe.resolve_schedule(300) in ("wave", "interleaved") and len(moe.auto_keys) == 2


def _dump_order(dump) -> tuple:
    """An instrumented launch's tile walk: every CTA's (slot, kind, expert, m, n) records, sorted."""
    return tuple(sorted(zip(*(dump[k].tolist() for k in ("cta", "slot", "kind", "expert", "m", "n")))))


def test_auto_trial_runs_on_the_device_as_megamoe_auto_says(seed):
    """schedule="auto": each launch's tile walk (its records) is the order megamoe.auto.trial_launch_order gives
    for the key's launches so far: the rule's pick through TRIAL_WARMUP launches, then the two orders
    alternating MEASURED_CALLS times each, then the decision the kernel wrote, which is faster_measured of the
    samples it wrote (read back by auto_trial); every output the same bits."""
    from megamoe.auto import MEASURED_CALLS, TRIAL_SETTLE, TRIAL_WARMUP, faster_measured, trial_launch_order
    from megamoe.tile_stream import ORDERS

    num_experts, top_k, tokens = 8, 2, 1500
    moe = _layer(num_experts, top_k, tokens, instrument=True, schedule="auto")
    w1, w2 = _weights(num_experts, SMALL["hidden"], SMALL["intermediate"], seed)
    moe.load_weights(w1, w2)
    x, idx, w = _inputs(tokens, num_experts, top_k, "skewed", seed, SMALL["hidden"])
    walks, ref = {}, None
    for name in ORDERS:
        y = moe.forward(x, idx, w, name)
        walks[name] = _dump_order(moe.last_dump())
        ref = y if ref is None else ref
        assert torch.equal(y, ref), f"seed={seed}"
    assert walks["wave"] != walks["interleaved"], "both orders walk alike here: the test would prove nothing"
    _close(ref, _reference(x, idx, w, w1, w2), f"auto seed={seed}")
    moe.forward(x, idx, w)  # keyed on the expected histogram; from here on on this input's (landed: synced)
    torch.cuda.synchronize()
    prior, decided, run = None, 0, []
    for n in range(TRIAL_SETTLE + 3):
        y = moe.forward(x, idx, w)
        walk = _dump_order(moe.last_dump())
        assert torch.equal(y, ref), f"launch {n} seed={seed}"
        got = next((name for name, v in walks.items() if v == walk), None)
        prior = prior or moe.auto_trial()["prior"]
        if n == TRIAL_SETTLE:
            decided = ORDERS[moe.auto_trial()["decided"]] + 1
        want = trial_launch_order(min(n, TRIAL_SETTLE), ORDERS[prior], decided)
        run.append(got)
        assert got is not None and ORDERS[got] == want, (n, run, prior)
    trial = moe.auto_trial()
    assert trial["launches"] == TRIAL_SETTLE and trial["decided"] in ORDERS, trial
    assert all(len(t) == MEASURED_CALLS and min(t) > 0 for t in trial["times_us"].values()), trial
    assert trial["decided"] == faster_measured(trial["times_us"], trial["prior"]), trial
    assert run[-1] == trial["decided"] and run[:TRIAL_WARMUP] == [prior] * TRIAL_WARMUP
    moe.check_errors()


def test_auto_trial_settles_inside_a_replayed_graph(seed):
    """A graph captured with schedule="auto" on a fresh key: its replays run the kernel's trial (nothing on the
    host), every replay's output the eager one's bits, and the slot has decided after TRIAL_SETTLE launches."""
    from megamoe.auto import MEASURED_CALLS, TRIAL_SETTLE, faster_measured

    num_experts, top_k, tokens = 8, 2, 256
    moe = _layer(num_experts, top_k, tokens, schedule="auto")
    w1, w2 = _weights(num_experts, SMALL["hidden"], SMALL["intermediate"], seed)
    moe.load_weights(w1, w2)
    x, idx, w = _inputs(tokens, num_experts, top_k, "skewed", seed, SMALL["hidden"])
    eager = moe.forward(x, idx, w, "wave")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe.forward(x, idx, w)  # the auto launch whose histogram keys the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    moe.resolve_schedule(tokens)  # lands that launch's histogram: the capture's key is this input's, still fresh
    key = moe.auto_key
    assert moe.auto_trial(key)["launches"] == 0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = moe.forward(x, idx, w)
    assert moe.auto_key == key and moe.auto_trial(key)["launches"] == 0, "the capture launched nothing"
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    for _ in range(TRIAL_SETTLE + 2):
        graph.replay()
        bad += (y_static != eager).any().long()
    torch.cuda.synchronize()
    moe.check_errors()
    assert int(bad) == 0, f"{int(bad)} replays differ from the eager output (seed={seed})"
    trial = moe.auto_trial(key)
    assert trial["launches"] == TRIAL_SETTLE and trial["decided"] is not None, trial
    assert all(len(t) == MEASURED_CALLS for t in trial["times_us"].values()), trial
    assert trial["decided"] == faster_measured(trial["times_us"], trial["prior"]), trial


def test_emulated_auto_decides_once_for_all_ranks(seed):
    """EmulatedMoE(schedule="auto"): the lead rank's launch times itself into its slot, the other ranks' read
    it, so every rank walks the same order at every call (their records), the outputs stay the reference's."""
    from megamoe.api import EmulatedMoE
    from megamoe.auto import TRIAL_SETTLE
    from megamoe.tile_stream import ORDERS

    moe = EmulatedMoE(2, 8, 2, SMALL["hidden"], SMALL["intermediate"], max_tokens_per_rank=600, schedule="auto",
                      instrument=True)
    w1, w2 = _weights(8, SMALL["hidden"], SMALL["intermediate"], seed)
    moe.load_weights(w1, w2)
    ins = [_inputs(t, 8, 2, "skewed", seed + r, SMALL["hidden"]) for r, t in enumerate((600, 377))]
    args = [[i[k] for i in ins] for k in range(3)]
    walks, first = {}, None
    for name in ORDERS:
        ys = moe.forward(*args, schedule=name)
        walks[name] = [_dump_order(m.last_dump()) for m in moe.ranks]
        first = first or ys
        assert all(torch.equal(a, b) for a, b in zip(ys, first)), f"seed={seed}"
    assert all(a != b for a, b in zip(walks["wave"], walks["interleaved"])), "the orders walk alike here"
    for r, (y, (x, idx, w)) in enumerate(zip(first, ins)):
        _close(y, _reference(x, idx, w, w1, w2), f"auto rank {r}/2 seed={seed}")
    moe.forward(*args)
    torch.cuda.synchronize()  # the histograms landed: the next calls decide from them
    run = []
    for _ in range(TRIAL_SETTLE + 2):
        ys = moe.forward(*args)
        got = [next((n for n, v in walks.items() if v[r] == _dump_order(m.last_dump())), None)
               for r, m in enumerate(moe.ranks)]
        assert got[0] is not None and got == [got[0]] * len(got), (run, got)
        run.append(got[0])
        assert all(torch.equal(a, b) for a, b in zip(ys, first)), f"seed={seed}"
    lead = moe.ranks[0]
    trial = lead.auto_trial()
    assert trial["decided"] in ORDERS and run[-1] == trial["decided"] and set(run) == set(ORDERS), (trial, run)
    assert all(m.auto_keys == {} for m in moe.ranks[1:])  # the lead rank decides for all
    moe.check_errors()
