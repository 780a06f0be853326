"""Our persistent Hopper attention: every variant compiles for sm_90a with WGMMA (CPU), bad input is
rejected before launch, and on an H200 it matches an fp32 reference; fused variants match the local kernel
followed by the reference All-to-All bit for bit, also across CUDA-Graph replays (2 GPUs)."""
from __future__ import annotations

import json

import pytest
from ranks import run_ranks
import torch

pytest.importorskip("cutlass")


def _compile(dump_dir, **knobs):
    """FlashAttentionA2AForward(**knobs) compiled for sm_90a from fake tensors, dumping into ``dump_dir``."""
    from cutlass.runtime import make_fake_stream

    from cute_kernels.compile import compile_kernel
    from flash_a2a.attention import FlashAttentionA2AForward

    dump_dir.mkdir(exist_ok=True)
    k = FlashAttentionA2AForward(**knobs)
    return compile_kernel(k, *k.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True), dump_dir=str(dump_dir))


def _sass(compiled) -> str:
    from cute_kernels.compile import sass

    text = sass(compiled.cubin)
    if text is None:
        pytest.skip("no nvdisasm on this machine (it comes with triton)")
    return text


@pytest.mark.parametrize("store", ["st", "bulk", "tma", "paced"])
@pytest.mark.parametrize("mode", ["local", "piggyback", "completion_coupled"])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_variants_compile_with_wgmma(tmp_path, mode, head_dim, store):
    from cute_kernels.compile import ptxas_resource_usage
    from flash_a2a.attention import FlashAttentionA2AForward

    if store == "paced" and mode != "piggyback":
        with pytest.raises(ValueError, match="paced"):
            FlashAttentionA2AForward(head_dim=head_dim, mode=mode, store=store, n_dst=1 if mode == "local" else 2)
        return
    c = _compile(tmp_path, head_dim=head_dim, mode=mode, store=store, n_dst=1 if mode == "local" else 2)
    assert c.ptx_count(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16") >= 2 * (head_dim // 16)
    assert c.ptx_count(r"cp\.async\.bulk\.tensor") >= 3, "Q, K, V through TMA"
    if store in ("st", "paced"):
        assert c.ptx_count(r"st\.global\.v4") >= 1, "128-bit output stores"
    elif store == "tma":
        assert c.ptx_count(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta") >= 1, "TMA tensor stores"
        assert c.ptx_count(r"st\.global\.v4") == 0
    else:
        assert c.ptx_count(r"cp\.async\.bulk\.global\.shared::cta") >= 1, "rows handed to the TMA engine"
        assert c.ptx_count(r"st\.global\.v4") == 0
    assert c.ptx_count(r"setmaxnreg") == 2, "producer/consumer register split"
    assert c.ptx_count(r"ld\.local|st\.local") == 0
    fences = c.ptx_count(r"fence\.acq_rel\.sys")
    # the ready wait's acquire fence after its relaxed polls, the completion fence (and per half when coupled);
    # no GPU-scope fence (early_done is off by default)
    assert fences == {"local": 0, "piggyback": 2, "completion_coupled": 3}[mode], fences
    assert c.ptx_count(r"fence\.acq_rel\.gpu") == 0
    if mode != "local":
        assert c.ptx_count(r"ld\.relaxed\.sys") >= 1, "bounded wait for the receiver's ready flag"
        assert c.ptx_count(r"ld\.acquire\.sys") == 0, "no acquire (L1 invalidation) per poll"
    usage = ptxas_resource_usage(c.ptx)
    if usage is not None:
        for u in usage.values():
            assert u.spill_stores == 0 and u.spill_loads == 0


@pytest.mark.parametrize("pin, at_least", [(True, 64), ("first_row", 48), (False, 0)])
def test_pinned_softmax_overlaps_the_pv_gemm_in_sass(tmp_path, pin, at_least):
    """pin_softmax: in the SASS of the mainloop the pinned exponentials (and their FFMAs) are issued between
    the wait for S and the wait for the warpgroup's own PV GEMM (the default "first_row": one row of two, plus
    what ptxas hoists of the second; True: all 2 x 32); the kernel stays free of local-memory spills and keeps
    its HGMMAs. Unpinned, ptxas sinks nearly all of them below the PV wait (what the knob is for)."""
    from cute_kernels.compile import softmax_overlap

    text = _sass(_compile(tmp_path, head_dim=128, mode="local", pin_softmax=pin))
    assert "HGMMA.64x128x16.F32.BF16" in text
    assert "STL" not in text and "LDL" not in text
    windows = softmax_overlap(text)
    assert len(windows) == 1, windows  # one overlapped mainloop
    ex2, ffma = windows[0]
    if pin is False:
        assert ex2 < 16, windows
    else:
        assert ex2 >= at_least and ffma >= at_least, windows


def test_unsignaled_control_has_no_flag_protocol(tmp_path):
    """Each ``signal`` value compiles to exactly its part of the flag protocol: False none; True the ready
    polls (one warp: relaxed loads, then one acquire fence; a named barrier for the storing warpgroups), the
    completion fence and the data-flag adds; the controls leave out the completion fence, the ready wait,
    or both."""
    from flash_a2a.attention import FlashAttentionA2AForward

    # (system fences: the ready wait's + the completion fence, ready polls, data-flag adds) per signal value,
    # without early_done (the default); with it the completion fence is two: the idle warp's system fence
    # before the peers' flags and a GPU fence on the last path
    expect = {False: (0, 0, 0), True: (2, 1, 1), "nofence": (1, 1, 1), "done": (1, 0, 1), "done_nofence": (0, 0, 1),
              "gate_only": (1, 0, 1)}
    for signal, (want_fences, want_polls, want_adds) in expect.items():
        for early in (False, True, "last_epilogue"):
            c = _compile(tmp_path / f"{signal}_{early}", head_dim=128, mode="piggyback", signal=signal,
                         early_done=early)
            fences, polls = c.ptx_count(r"fence\.acq_rel\.sys"), c.ptx_count(r"ld\.(relaxed|acquire)\.sys")
            adds = c.ptx_count(r"red\.relaxed\.sys(\.global)?\.add\.u64")
            got = (fences, min(polls, 1), min(adds, 1))
            fenced = signal in (True, "done", "gate_only")
            split = early and signal is not False
            assert got == (want_fences + (split and fenced), want_polls, want_adds), (signal, early, fences, polls,
                                                                                     adds)
            assert c.ptx_count(r"fence\.acq_rel\.gpu") == (split and fenced), (signal, early)
        assert c.ptx_count(r"st\.global\.v4") >= 1
        assert c.ptx_count(r"nanosleep") == 0
    with pytest.raises(ValueError, match="signal"):
        FlashAttentionA2AForward(head_dim=128, mode="piggyback", signal="sometimes")
    # the ready-poll back-off: a nanosleep in the waiting warp's loop, none by default (checked above: the
    # default compiled without one)
    c = _compile(tmp_path / "sleep", head_dim=128, mode="piggyback", ready_poll_ns=500)
    assert c.ptx_count(r"nanosleep\.u32") == 1 and c.ptx_count(r"ld\.relaxed\.sys") >= 1
    # the ready wait's placements: an acquire per poll ("warp_acquire", no fence after), or the storing
    # warpgroups' own acquire waits ("epilogue")
    for where in ("warp_acquire", "epilogue"):
        c = _compile(tmp_path / where, head_dim=128, mode="piggyback", ready_wait=where)
        assert c.ptx_count(r"ld\.acquire\.sys") >= 1 and c.ptx_count(r"ld\.relaxed\.sys") == 0, where
        assert c.ptx_count(r"fence\.acq_rel\.sys") == 1, where
    with pytest.raises(ValueError, match="ready_wait"):
        FlashAttentionA2AForward(head_dim=128, mode="piggyback", ready_wait="anywhere")
    with pytest.raises(ValueError, match="early_done"):
        FlashAttentionA2AForward(head_dim=128, mode="piggyback", early_done="sometime")
    with pytest.raises(ValueError, match="ready_poll_ns"):
        FlashAttentionA2AForward(head_dim=128, mode="piggyback", ready_poll_ns=-1)


def test_paced_stores_issue_inside_the_q_loop(tmp_path):
    """store="paced": the SASS loop that holds a KV block's 16 HGMMAs (QKᵀ and PV, d = 128) also holds a
    128-bit global store and a shared-memory load (a vector of the previous tile's staged rows), while the
    default piggyback loop holds no global store (its tile leaves in one burst after the Q-loop). Bad knobs
    are refused."""
    import re

    from cute_kernels.compile import hgmma_loop
    from flash_a2a.attention import FlashAttentionA2AForward

    loops = {}
    for store in ("st", "paced"):
        text = _sass(_compile(tmp_path / store, head_dim=128, mode="piggyback", store=store, n_dst=2))
        assert "STL" not in text and "LDL" not in text
        loops[store] = hgmma_loop(text, 16)
        assert loops[store] is not None, store
    assert not any(x.startswith(("STG", "@")) and "STG" in x for x in loops["st"])
    assert any("STG.E.128" in x for x in loops["paced"]), loops["paced"]
    assert any(re.search(r"(^|\s)LDS", x) for x in loops["paced"])
    for bad in ({"mode": "completion_coupled"}, {"overlap": False}):
        with pytest.raises(ValueError, match="paced"):
            FlashAttentionA2AForward(head_dim=128, store="paced", n_dst=2, **{"mode": "piggyback", **bad})
    with pytest.raises(ValueError, match="pace_kv"):
        FlashAttentionA2AForward(head_dim=128, mode="piggyback", store="paced", n_dst=2, pace_kv=0)


def test_peeled_paced_stores_leave_the_plain_loop_store_free(tmp_path):
    """store="paced", peel_drip=True: two KV-block loops of 16 HGMMAs each; the one that carries the
    previous tile's vectors holds the 128-bit global store, the plain one none. Without paced stores the
    knob is refused."""
    from cute_kernels.compile import sass_loop
    from flash_a2a.attention import FlashAttentionA2AForward

    text = _sass(_compile(tmp_path, head_dim=128, mode="piggyback", store="paced", peel_drip=True, n_dst=2))
    assert "STL" not in text and "LDL" not in text
    with_store = sass_loop(text, lambda b: sum("HGMMA" in x for x in b) == 16 and any("STG.E.128" in x for x in b))
    plain = sass_loop(text, lambda b: sum("HGMMA" in x for x in b) == 16 and not any("STG" in x for x in b))
    assert with_store is not None and plain is not None
    with pytest.raises(ValueError, match="peel_drip"):
        FlashAttentionA2AForward(head_dim=128, mode="piggyback", n_dst=2, peel_drip=True)


def test_fused_mainloop_schedules_like_local(tmp_path):
    """The fused epilogues must not change how ptxas schedules the shared mainloop: the same count of
    exponentials and FFMAs ahead of the PV wait as in the local kernel. (Holding S/P live across the
    mainloop for the destination row once moved 61 of 66 ahead instead of 51, and the fused kernel lost
    what the pinned mainloop won.)"""
    from cute_kernels.compile import softmax_overlap

    windows = {}
    for mode in ("local", "piggyback", "completion_coupled"):
        windows[mode] = softmax_overlap(_sass(_compile(tmp_path / mode, head_dim=128, mode=mode)))
    assert len(windows["local"]) == 1, windows
    assert windows["piggyback"] == windows["local"] and windows["completion_coupled"] == windows["local"], windows


def test_streaming_store_cache_operator(tmp_path):
    """store_cache="cs" (a measured alternative): the "st" epilogue's 128-bit stores carry the streaming cache
    operator (st.global.cs, STG.E.EF.128 in the SASS: evict-first) and none is plain, while the mainloop keeps
    its schedule; other epilogues refuse it."""
    from cute_kernels.compile import softmax_overlap
    from flash_a2a.attention import FlashAttentionA2AForward

    base = softmax_overlap(_sass(_compile(tmp_path / "wb", head_dim=128, mode="piggyback", n_dst=2)))
    c = _compile(tmp_path / "cs", head_dim=128, mode="piggyback", n_dst=2, store_cache="cs")
    text = _sass(c)
    assert c.ptx_count(r"st\.global\.cs\.v4") >= 1 and c.ptx_count(r"st\.global\.v4") == 0
    assert "STG.E.EF.128" in text and "STG.E.128" not in text
    assert softmax_overlap(text) == base
    with pytest.raises(ValueError, match="store_cache"):
        FlashAttentionA2AForward(head_dim=128, mode="piggyback", n_dst=2, store="tma", store_cache="cs")
    with pytest.raises(ValueError, match="store_cache"):
        FlashAttentionA2AForward(head_dim=128, store_cache="lu")


def test_crossed_walk_and_ready_wait_keep_the_schedules(tmp_path):
    """The crossed tile walk (two 64-row Q loads, per-warpgroup destinations), both early_done placements and
    the walks with the destination turn (``turn_destinations=True``) and remote tiles first (``remote_first``)
    keep the mainloop's schedule, and the fused kernel's ready wait leaves the TMA producer's KV loop as the
    local kernel's: no R2UR in it.
    (A run-time loop over the ranks in the ready wait once put a 64-bit operand of the producer's TMA loads
    in vector registers, 8 R2UR per KV block, and cost ~0.65% of the kernel's time on H200; a 64-bit
    division in the walk once moved the mainloop to 61 of 66 exponentials ahead of the PV wait.)"""
    from cute_kernels.compile import sass_loop, softmax_overlap

    # at pin_softmax="first_row" (51 of 66 ahead of the PV wait): with the default pin 40 the crossed walk's
    # Q loads move ptxas from 52 to 47 (the crossed walk is a measured alternative, off by default)
    texts = {name: _sass(_compile(tmp_path / name, head_dim=128, pin_softmax="first_row", **knobs))
             for name, knobs in (
        ("local", {"mode": "local"}), ("local_cross", {"mode": "local", "cross_halves": True}),
        ("fused", {"mode": "piggyback", "n_dst": 2}),
        # early_done (a slower alternative) keeps 51 with the rescale every block; with rescale_threshold its
        # extra epilogue test moves ptxas to 61 of 66
        ("fused_early", {"mode": "piggyback", "n_dst": 2, "early_done": True, "rescale_threshold": 0.0}),
        ("fused_last_epilogue", {"mode": "piggyback", "n_dst": 2, "early_done": "last_epilogue",
                                 "rescale_threshold": 0.0}),
        ("fused_cross", {"mode": "piggyback", "n_dst": 2, "cross_halves": True}),
        ("fused_turned", {"mode": "piggyback", "n_dst": 2, "turn_destinations": True}),
        ("fused_remote_first", {"mode": "piggyback", "n_dst": 2, "remote_first": True}))}
    windows = {name: softmax_overlap(t) for name, t in texts.items()}
    assert len(set(map(tuple, windows.values()))) == 1, windows
    for name, text in texts.items():
        producer = sass_loop(text, lambda body: sum("UTMALDG" in x for x in body) == 4)
        assert producer is not None, name
        assert not any("R2UR" in x for x in producer), (name, [x for x in producer if "R2UR" in x])
        if name.endswith("cross"):
            assert text.count("UTMALDG") > texts[name[:-6]].count("UTMALDG"), "two Q loads per tile"


def test_pin_softmax_counts():
    """pin_softmax maps to the number of pinned exponentials per thread; ints are counts (1 is one, not True)."""
    from flash_a2a.attention import FlashAttentionA2AForward

    for pin, count in [(True, 64), (False, 0), ("first_row", 32), (1, 1), (40, 40), (64, 64)]:
        k = FlashAttentionA2AForward(pin_softmax=pin)
        assert k.pin_count == count and k.pin_softmax == (count > 0), (pin, k.pin_count)
    assert FlashAttentionA2AForward(pin_softmax=40, overlap=False).pin_count == 0  # plain mainloop: no pinning
    for bad in (0, 65, -1, "all", 1.5):
        with pytest.raises(ValueError, match="pin_softmax"):
            FlashAttentionA2AForward(pin_softmax=bad)


def test_bad_input_rejected_before_launch():
    from flash_a2a.api import check_qkv

    q = torch.zeros(1, 256, 2, 128, dtype=torch.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        check_qkv(q, q, q)
    with pytest.raises(ValueError, match="4-D"):
        check_qkv(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="CUDA"):
        qb = q.to(torch.bfloat16)
        check_qkv(qb, qb, qb)
    from flash_a2a.api import flash_attention

    with pytest.raises(ValueError, match="tile_order_rank"):
        flash_attention(q, q, q, tile_order_world=2, tile_order_rank=2)


def reference_attention(q, k, v, scale=None):
    qf, kf, vf = (t.double().permute(0, 2, 1, 3) for t in (q, k, v))
    scale = scale or q.shape[-1] ** -0.5
    p = torch.softmax((qf @ kf.transpose(-1, -2)) * scale, dim=-1)
    return (p @ vf).permute(0, 2, 1, 3)


def rel_err(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", [((1, 1024, 4, 128), torch.bfloat16), ((2, 2048, 3, 128), torch.bfloat16),
                                         ((1, 384, 1, 128), torch.bfloat16), ((1, 512, 2, 64), torch.bfloat16),
                                         ((1, 1024, 2, 128), torch.float16), ((1, 8192, 2, 128), torch.bfloat16)])
def test_flash_attention_matches_fp64_reference(shape, dtype):
    from flash_a2a.api import flash_attention

    q, k, v = (torch.randn(shape, device="cuda").to(dtype) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    flash_attention(q, k, v, out=out)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "unwritten output elements"
    err = rel_err(out, reference_attention(q, k, v))
    assert err <= 1e-2, err


@pytest.mark.gpu
def test_tile_order_and_mainloop_variants_agree():
    from flash_a2a.api import flash_attention

    q, k, v = (torch.randn(1, 2048, 3, 128, device="cuda").to(torch.bfloat16) for _ in range(3))
    base = flash_attention(q, k, v)
    assert torch.equal(flash_attention(q, k, v, tile_order_world=2), base), "tile order must not change O"
    assert torch.equal(flash_attention(q, k, v, tile_order_world=2, tile_order_rank=1), base)
    for rank in (0, 1):  # the crossed walk: per-warpgroup row blocks of both ranks' slices
        assert torch.equal(flash_attention(q, k, v, tile_order_world=2, tile_order_rank=rank, cross_halves=True),
                           base)
    for variant in ({"lag_v": True}, {"sync_first_block": False}, {"persistent": False}, {"pin_softmax": True},
                    {"pin_softmax": False, "rescale_before_pv": False}, {"pin_softmax": 40}, {"p_first": True},
                    {"store": "bulk"}, {"store": "bulk", "pin_softmax": 34}, {"store": "tma"},
                    {"store": "tma", "pin_softmax": 34}, {"try_wait": True}, {"try_wait": True, "pin_softmax": 36}):
        assert torch.equal(flash_attention(q, k, v, **variant), base), variant
    assert rel_err(flash_attention(q, k, v, overlap=False), reference_attention(q, k, v)) <= 1e-2
    # q_stages=2 (the next tile's Q a tile ahead): its buffers alternate only when a CTA has several tiles,
    # so also at 576 tiles (4.4 rounds on 132 SMs), in the fused order too
    big = [torch.randn(2, 4096, 9, 128, device="cuda").to(torch.bfloat16) for _ in range(3)]
    for qkv in ((q, k, v), big):
        ref = flash_attention(*qkv, tail_split=False)  # q_stages=2 runs unsplit ("auto" splits 576 tiles)
        for variant in ({"q_stages": 2}, {"q_stages": 2, "tile_order_world": 2, "tile_order_rank": 1},
                        {"tile_order_world": 2, "turn_destinations": True, "tail_split": False},  # turned
                        {"tile_order_world": 2, "tile_order_rank": 1, "remote_first": True, "tail_split": False},
                        # K/V multicast to CTA pairs (cluster_kv=2): the same bits, the plain and fused orders
                        {"cluster_kv": 2, "tail_split": False},
                        {"cluster_kv": 2, "tile_order_world": 2, "tile_order_rank": 1, "tail_split": False}):
            out = torch.full_like(ref, float("nan"))
            assert torch.equal(flash_attention(*qkv, out=out, **variant), ref), variant
    # cluster_kv=2 with the split tail's two launches (clustered rounds, unclustered chunks): the split's bits
    split = flash_attention(*big, tail_split="launch")
    out = torch.full_like(split, float("nan"))
    assert torch.equal(flash_attention(*big, out=out, tail_split="launch", cluster_kv=2), split)
    assert torch.equal(flash_attention(*big, cluster_kv=2), split)  # "auto" takes "launch" here
    with pytest.raises(ValueError, match="cluster_kv"):
        flash_attention(*big, cluster_kv=2, tail_split=True)
    # tile_n=160 (KV blocks of 160 rows): another summation order, so against fp64, at a length it divides
    for pin in ("first_row", 36):
        q160 = [torch.randn(2, 2560, 3, 128, device="cuda").to(torch.bfloat16) for _ in range(3)]
        out = torch.full_like(q160[0], float("nan"))
        flash_attention(*q160, out=out, tile_n=160, pin_softmax=pin)
        assert rel_err(out, reference_attention(*q160)) <= 1e-2, pin
    with pytest.raises(ValueError, match="tile_n"):
        flash_attention(q, k, v, tile_n=160)  # 2048 rows: not a multiple of 160
    # rescale_threshold=8 (a row keeps its max until a block raises it by > 2^8): another rounding, so against
    # fp64; also with logits scaled up (q x 8, scale 1) so rows do raise their max by more than that
    for scale_q, scale in ((1.0, None), (8.0, 1.0)):
        qs = (q.float() * scale_q).to(torch.bfloat16)
        out = torch.full_like(q, float("nan"))
        flash_attention(qs, k, v, out=out, softmax_scale=scale, rescale_threshold=8.0)
        assert rel_err(out, reference_attention(qs, k, v, scale)) <= 1e-2, scale_q
    odd = [torch.randn(1, 384, 2, 128, device="cuda").to(torch.bfloat16) for _ in range(3)]  # 3 blocks per head
    with pytest.raises(ValueError, match="cluster_kv=2 needs"):
        flash_attention(*odd, cluster_kv=2)


@pytest.mark.gpu
def test_flash_attention_strided_inputs_and_scale():
    from flash_a2a.api import flash_attention

    qkv = torch.randn(1, 1024, 3, 4, 128, device="cuda").to(torch.bfloat16)  # packed, non-contiguous views
    q, k, v = qkv.unbind(2)
    out = flash_attention(q, k, v, softmax_scale=0.05)
    torch.cuda.synchronize()
    assert rel_err(out, reference_attention(q, k, v, 0.05)) <= 1e-2


def _post_a2a_reference(q, k, v, rank, world, **variant):
    """This rank's expected fused output: our local kernel in this rank's fused tile order (with ``variant``,
    e.g. the same tail_split), gathered from every rank, then the reference All-to-All on the CPU."""
    import torch.distributed as dist
    from flash_a2a.api import flash_attention
    from flash_a2a.mapping import reference_post_a2a

    local = flash_attention(q, k, v, tile_order_world=world, tile_order_rank=rank, **variant)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    return reference_post_a2a([g.cpu() for g in gathered])[rank]


def _check_graph_replays(fused, shape, rank, world, replays: int = 3) -> int:
    """The fused default captured in a CUDA Graph (warmed up outside it) and replayed with fresh inputs
    equals the local default + reference All-to-All bit for bit each time: no stale epoch or counter.
    Returns the number of replays checked."""
    import torch.distributed as dist

    q, k, v = (torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(3))
    fused(q, k, v)
    torch.cuda.synchronize()
    dist.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        graph_out = fused(q, k, v)
    for _ in range(replays):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t, dtype=torch.float32).to(torch.bfloat16))
        ref = _post_a2a_reference(q, k, v, rank, world)
        g.replay()
        torch.cuda.synchronize()
        fused.check()
        assert torch.equal(graph_out.cpu(), ref)
        dist.barrier()
    return replays


def _worker(rank, world, init_file, path):
    from cute_kernels.dist import process_group

    with process_group(rank, world, init_file):
        from flash_a2a.api import FusedAttentionA2A, UlyssesAttention

        fused = FusedAttentionA2A()
        checked = 0
        every = (("piggyback", {}), ("completion_coupled", {}), ("piggyback", {"store": "bulk"}),
                 ("completion_coupled", {"store": "bulk"}), ("piggyback", {"store": "tma"}),
                 ("completion_coupled", {"store": "tma"}), ("piggyback", {"store": "paced"}),
                 ("piggyback", {"store": "paced", "pace_kv": 2}),
                 ("piggyback", {"store": "paced", "peel_drip": True}),
                 ("piggyback", {"cross_halves": True}), ("completion_coupled", {"cross_halves": True}),
                 ("piggyback", {"cross_halves": True, "store": "paced"}),
                 ("piggyback", {"cross_halves": False}), ("piggyback", {"ready_wait": "epilogue"}),
                 ("piggyback", {"ready_wait": "warp_acquire"}), ("piggyback", {"early_done": True}),
                 ("piggyback", {"early_done": "last_epilogue"}), ("piggyback", {"q_stages": 2}),
                 ("piggyback", {"cluster_kv": 2}), ("completion_coupled", {"cluster_kv": 2}))
        # (2, 4096, 3, 128): 192 tiles on 132 SMs, so with early_done CTAs 0..59 have a local tail tile and
        # raise their peers' flags after an earlier tile's stores; the shapes of one round only take its other
        # paths (no tail tile; a tail tile and nothing before it)
        multi_round = (("piggyback", {}), ("piggyback", {"early_done": True}),
                       ("completion_coupled", {"early_done": True}), ("piggyback", {"early_done": "last_epilogue"}),
                       ("piggyback", {"store": "paced"}), ("piggyback", {"store": "paced", "peel_drip": True}),
                       ("piggyback", {"q_stages": 2}), ("completion_coupled", {"q_stages": 2}),
                       ("piggyback", {"cluster_kv": 2}), ("piggyback", {"store": "st"}))
        # (2, 8192, 3, 128): 384 tiles, the first stretch reaches a second round, where turn_destinations turns.
        # At both multi-round shapes the default's store="auto" paces (mapping.paced_store_pays); "st" is the burst.
        turned = (("piggyback", {}), ("piggyback", {"turn_destinations": True}), ("completion_coupled", {}),
                  ("piggyback", {"cross_halves": True}), ("piggyback", {"cluster_kv": 2}),
                  ("piggyback", {"store": "st"}), ("piggyback", {"remote_first": True}))
        for shape, variants in [((1, 1024, 2, 128), every), ((2, 2048, 3, 128), every), ((1, 512, 1, 64), every),
                                ((2, 4096, 3, 128), multi_round), ((2, 8192, 3, 128), turned),
                                ((1, 2560, 2, 128), (("piggyback", {"tile_n": 160}),
                                                     ("completion_coupled", {"tile_n": 160}),
                                                     ("piggyback", {"rescale_threshold": 8.0})))]:
            for mode, knobs in variants:
                for _ in range(2):
                    q, k, v = (torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(3))
                    # unsplit on both sides (the split tail, the default where it pays, is _tail_split_worker's);
                    # the local kernel with the same KV block (tile_n), so the same summation order
                    ref = _post_a2a_reference(q, k, v, rank, world, tail_split=False,
                                              **{n: x for n, x in knobs.items()
                                                 if n in ("tile_n", "rescale_threshold")})
                    fused.state(q).out.fill_(float("nan"))
                    got = fused(q, k, v, mode=mode, tail_split=False, **knobs)
                    torch.cuda.synchronize()
                    fused.check()
                    assert torch.equal(got.cpu(), ref), (shape, mode, knobs)
                    checked += 1
        # CUDA Graph replays with fresh inputs.
        checked += _check_graph_replays(fused, (1, 2048, 2, 128), rank, world)
        # Per-tile instrumentation: one span row per (tile, MMA warpgroup), then one ready row per CTA (the
        # grid is one CTA per tile here: 16 tiles), every one written and ordered.
        q, k, v = (torch.randn(1, 1024, 2, 128, device="cuda").to(torch.bfloat16) for _ in range(3))
        n_rows = (1024 // 128) * 2 * 2 + (1024 // 128) * 2
        with pytest.raises(ValueError, match="ready|one per CTA"):
            fused.launch(q, k, v, spans=torch.zeros(n_rows - 1, 4, dtype=torch.int64, device="cuda"))
        spans = torch.zeros(n_rows, 4, dtype=torch.int64, device="cuda")
        spanned = fused.launch(q, k, v, spans=spans).clone()
        plain = fused.launch(q, k, v).clone()
        torch.cuda.synchronize()
        fused.check()
        sp = spans.cpu()
        spans_ok = bool(torch.equal(spanned, plain) and (sp[:, 0] > 0).all() and (sp[:, 1] >= sp[:, 0]).all()
                        and (sp[:, 3] >= sp[:, 2]).all() and (sp[:, 2] > 0).all())
        # UlyssesAttention on (b, S/P, H, d) against attention of the full sequence on one GPU.
        torch.manual_seed(1234)  # same full inputs on every rank
        full = [torch.randn(1, 2048, 4, 128, device="cuda").to(torch.bfloat16) for _ in range(3)]
        rows = 2048 // world
        mine = [t[:, rank * rows:(rank + 1) * rows].contiguous() for t in full]
        out = UlyssesAttention()(*mine)
        torch.cuda.synchronize()
        ref = reference_attention(*full)[:, rank * rows:(rank + 1) * rows]
        ulysses_err = rel_err(out, ref)
        # The default symmetric-memory pre-attention All-to-All gives the NCCL one's result bit for bit.
        symm_pre_equal = bool(torch.equal(UlyssesAttention(pre_a2a="nccl")(*mine), out))
        # torch.compile sees the custom op as one opaque node and gives the same result.
        compiled = torch.compile(UlyssesAttention(), backend="aot_eager")(*mine)
        torch.cuda.synchronize()
        compiled_equal = bool(torch.equal(compiled, out))
        errors = []
        for kwargs in ({"causal": True}, {"dropout_p": 0.1}):
            try:
                UlyssesAttention()(*mine, **kwargs)
            except NotImplementedError as e:
                errors.append(str(e))
        with open(f"{path}.{rank}", "w") as f:
            json.dump({"checked": checked, "ulysses_err": ulysses_err, "errors": errors, "spans_ok": spans_ok,
                       "compiled_equal": compiled_equal, "symm_pre_equal": symm_pre_equal}, f)


@pytest.mark.multigpu
def test_fused_matches_local_plus_reference_a2a(tmp_path):
    for res in run_ranks(_worker, tmp_path):
        assert res["checked"] == 2 * (3 * 20 + 10 + 7 + 3) + 3  # two draws per (shape, variant), three graph replays
        assert res["ulysses_err"] <= 1e-2, res
        assert len(res["errors"]) == 2
        assert res["spans_ok"], "instrumented launch must match and fill every span row in order"
        assert res["compiled_equal"], "torch.compile(UlyssesAttention) must match eager"
        assert res["symm_pre_equal"], "UlyssesAttention(pre_a2a='nccl') must match the default symmetric pre-attention path"


def _slow_receiver_worker(rank, world, init_file, path):
    """Every rank runs launch e, then launch e + 1 with fresh inputs at once, except the last rank, whose
    stream first spins ~20 ms and then copies its output of launch e. The senders' launch e + 1 must not
    store into that buffer before the slow rank's own launch e + 1 starts (its ready announcement), so the
    copy must still hold launch e's output."""
    import torch.distributed as dist
    from cute_kernels.dist import process_group

    with process_group(rank, world, init_file):
        from flash_a2a.api import FusedAttentionA2A, flash_attention
        from flash_a2a.mapping import reference_post_a2a

        def reference(q, k, v):
            local = flash_attention(q, k, v)
            gathered = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(gathered, local)
            return reference_post_a2a([g.cpu() for g in gathered])[rank]

        fused = FusedAttentionA2A()
        results = []
        for mode, knobs in (("piggyback", {}), ("piggyback", {"store": "tma"}), ("piggyback", {"store": "paced"}),
                            ("completion_coupled", {})):
            shape = (1, 2048, 2, 128)
            q, k, v = (torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(3))
            q2, k2, v2 = (torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(3))
            ref2 = reference(q2, k2, v2)
            out = fused(q, k, v, mode=mode, **knobs)
            expected = out.clone()
            torch.cuda.synchronize()
            dist.barrier()
            snapshot = None
            if rank == world - 1:
                torch.cuda._sleep(40_000_000)  # ~20 ms of this rank's stream before it is done with launch e
                snapshot = out.clone()
            got = fused(q2, k2, v2, mode=mode, **knobs)
            torch.cuda.synchronize()
            fused.check()
            results.append({"mode": mode, "knobs": knobs,
                            "snapshot_kept": bool(snapshot is None or torch.equal(snapshot, expected)),
                            "next_exact": bool(torch.equal(got.cpu(), ref2))})
            dist.barrier()
        with open(f"{path}.{rank}", "w") as f:
            json.dump(results, f)


@pytest.mark.multigpu
def test_fused_waits_for_a_slow_receiver(tmp_path):
    """The ready protocol: no sender stores into a receiver's buffer while the receiver's stream still reads
    the previous launch's output there."""
    for res in run_ranks(_slow_receiver_worker, tmp_path):
        assert len(res) == 4
        for r in res:
            assert r["snapshot_kept"], r
            assert r["next_exact"], r


def test_double_buffered_q_compiles_and_keeps_the_mainloop_schedule(tmp_path):
    """q_stages=2 (the next tile's Q loaded a tile ahead): compiles with WGMMA for local and fused modes,
    with the same softmax window in its KV loop as the single-buffered kernel; combinations whose shared
    memory or Q loads do not fit are refused."""
    from cute_kernels.compile import softmax_overlap
    from flash_a2a.attention import FlashAttentionA2AForward

    windows = {}
    for name, kw in (("one", {}), ("two", {"q_stages": 2})):
        c = _compile(tmp_path / name, head_dim=128, mode="piggyback", n_dst=2, **kw)
        assert c.ptx_count(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16") >= 16
        windows[name] = softmax_overlap(_sass(c))
    assert windows["one"] == windows["two"], windows
    c = _compile(tmp_path / "local", head_dim=64, mode="local", q_stages=2)
    assert c.ptx_count(r"wgmma\.mma_async") >= 8
    for bad in ({"store": "bulk"}, {"store": "tma"}, {"cross_halves": True}, {"q_stages": 3}):
        with pytest.raises(ValueError, match="q_stages"):
            FlashAttentionA2AForward(head_dim=128, mode="piggyback", n_dst=2, **{"q_stages": 2, **bad})
    # try_wait (FA4's probe-then-wait on the K/V stages) puts a second barrier test in the loop
    tw = _sass(_compile(tmp_path / "tw", head_dim=128, mode="local", try_wait=True))
    from cute_kernels.compile import hgmma_loop
    assert sum("SYNCS.PHASECHK" in x for x in hgmma_loop(tw, 16)) >= 2
    # the shared-memory padding control compiles to the same KV loop
    padded = softmax_overlap(_sass(_compile(tmp_path / "pad", head_dim=128, mode="piggyback", n_dst=2,
                                            smem_pad_kib=32)))
    assert padded == windows["one"]
    with pytest.raises(ValueError, match="smem_pad_kib"):
        FlashAttentionA2AForward(head_dim=128, smem_pad_kib=64)


def test_tail_split_compiles_and_refuses_what_it_does_not_cover(tmp_path):
    """tail_split=True (the last round's tiles in KV chunks, combined by the last chunk's CTA) compiles with
    WGMMA and a GPU-scope atomic for the chunk count; other modes, epilogues and knobs are refused."""
    from flash_a2a.attention import FlashAttentionA2AForward

    c = _compile(tmp_path, head_dim=128, mode="local", tail_split=True)
    assert c.ptx_count(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16") >= 16
    assert c.ptx_count(r"atom(\.global)?\.acq_rel(\.gpu)?(\.global)?\.add") >= 1  # gpu scope: the default
    f = _compile(tmp_path / "fused", head_dim=128, mode="piggyback", n_dst=2, tail_split=True)
    assert f.ptx_count(r"atom(\.global)?\.acq_rel(\.gpu)?(\.global)?\.add") >= 1
    for bad in ({"store": "tma"}, {"cross_halves": True}, {"q_stages": 2}, {"instrument": True}, {"head_dim": 64},
                {"mode": "piggyback", "n_dst": 2, "early_done": True}):
        with pytest.raises(ValueError, match="tail_split"):
            FlashAttentionA2AForward(**{"head_dim": 128, "mode": "local", "tail_split": True, **bad})


def test_split_tail_launches_compile_and_keep_the_default_schedule(tmp_path):
    """The split tail in two launches: the rounds kernel (local and fused) compiles to the default's KV-loop
    schedule (the split's slower one is confined to the tail launch), lets its dependent launch early; the
    fused tail kernel waits for the rounds' completion before its flags and runs no ready gate; bad
    combinations are refused."""
    from cute_kernels.compile import softmax_overlap
    from flash_a2a.attention import FlashAttentionA2AForward

    default = softmax_overlap(_sass(_compile(tmp_path / "default", head_dim=128, mode="local")))
    for name, knobs in (("local", {"mode": "local"}), ("fused", {"mode": "piggyback", "n_dst": 2})):
        rounds = _compile(tmp_path / f"rounds_{name}", head_dim=128, walk="rounds", **knobs)
        assert softmax_overlap(_sass(rounds)) == default, name
        assert rounds.ptx_count(r"griddepcontrol\.launch_dependents") >= 1
        assert rounds.ptx_count(r"wgmma\.mma_async") >= 16
    # the fused rounds kernel with TMA stores (the tail launch stores its local chunks in bursts)
    tma_rounds = _compile(tmp_path / "rounds_tma", head_dim=128, walk="rounds", mode="piggyback", n_dst=2, store="tma")
    assert tma_rounds.ptx_count(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared") >= 1
    assert tma_rounds.ptx_count(r"griddepcontrol\.launch_dependents") >= 1
    tail = _compile(tmp_path / "tail", head_dim=128, mode="piggyback", n_dst=2, walk="tail", tail_split=True,
                    signal="done")
    assert tail.ptx_count(r"griddepcontrol\.wait") >= 1
    assert tail.ptx_count(r"atom(\.global)?\.acq_rel(\.gpu)?(\.global)?\.add") >= 1  # the chunk count
    for bad in ({"walk": "tail"}, {"walk": "rounds", "tail_split": True}, {"walk": "sideways"},
                {"walk": "tail", "tail_split": True, "mode": "piggyback", "n_dst": 2},  # with a ready gate
                {"walk": "rounds", "instrument": True}):
        with pytest.raises(ValueError, match="walk"):
            FlashAttentionA2AForward(**{"head_dim": 128, "mode": "local", **bad})


def test_relay_tail_compiles_with_its_copies_in_the_q_loop(tmp_path):
    """relay=True (the fused tail launch sends the rounds kernel's shadowed peer tiles on): 128-bit loads and
    stores beyond the plain tail kernel's, the grid-dependency wait ahead of its first load as well as before the
    flags, no spills; in the KV loop each event takes its addresses from shared memory and no integer division
    (each cost the chunks ~4-5 µs at 3 heads/8K on H200); refused outside the fused tail launch."""
    from cute_kernels.compile import hgmma_loop, ptxas_resource_usage
    from flash_a2a.attention import FlashAttentionA2AForward

    tail = {"head_dim": 128, "mode": "piggyback", "n_dst": 2, "walk": "tail", "tail_split": True, "signal": "done"}
    plain = _compile(tmp_path / "plain", **tail)
    relay = _compile(tmp_path / "relay", **tail, relay=True)
    for pat in (r"ld\.global\.v4", r"st\.global\.v4"):
        assert relay.ptx_count(pat) > plain.ptx_count(pat), pat
    assert relay.ptx_count(r"griddepcontrol\.wait") > plain.ptx_count(r"griddepcontrol\.wait") >= 1
    assert relay.ptx_count(r"wgmma\.mma_async") >= 16
    loop = hgmma_loop(_sass(relay), 16)
    assert loop is not None, "no KV loop of 16 HGMMAs"
    text = "\n".join(loop)
    assert "LDG.E.128" in text and "STG.E.128" in text, "the relay's load and store sit in the KV loop"
    assert "LDS.64" in text and "LDG.E.64" not in text, "addresses from shared memory, not global"
    assert "MUFU.RCP" not in text and "I2F" not in text, "no integer division in the KV loop"
    usage = ptxas_resource_usage(relay.ptx, "sm_90a")
    if usage is not None:
        for name, u in usage.items():
            assert u.spill_stores == 0 and u.spill_loads == 0, (name, u)
    for bad in ({"walk": "all", "tail_split": True}, {"mode": "completion_coupled"}, {"n_dst": 1},
                {"relay": "yes"}):
        with pytest.raises(ValueError, match="relay"):
            FlashAttentionA2AForward(**{**tail, "relay": True, **bad})


@pytest.mark.gpu
@pytest.mark.parametrize("option", [True, "launch"])
@pytest.mark.parametrize("shape", [(1, 8192, 3, 128), (1, 8192, 1, 128), (2, 4096, 9, 128), (1, 4096, 13, 128)])
def test_tail_split_matches_the_reference_and_the_default(shape, option):
    """The split tail in one launch (True) and in a second launch ("launch": the whole rounds, then the
    chunks with programmatic dependent launch) at shapes whose last round is split in 2 (192 tiles), 2 (576
    tiles) and 6 chunks (416 tiles), and at 64 tiles (one CTA per tile: nothing to split): against fp64
    (relative error <= 1e-2) and the unsplit kernel (<= 1e-2), three times with fresh inputs and a poisoned
    output (the chunk counters must be back at zero after each launch)."""
    from flash_a2a.api import flash_attention

    for _ in range(3):
        q, k, v = (torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(3))
        out = torch.full_like(q, float("nan"))
        flash_attention(q, k, v, out=out, tile_order_world=2, tail_split=option)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), "unwritten output elements"
        assert rel_err(out, reference_attention(q, k, v)) <= 1e-2
        assert rel_err(out, flash_attention(q, k, v, tile_order_world=2, tail_split=False)) <= 1e-2


@pytest.mark.gpu
def test_split_tail_launch_replays_in_a_cuda_graph():
    """The default ("auto": two launches at 192 tiles, the second a programmatic dependent launch) captured in a
    CUDA Graph and replayed with fresh inputs gives the eager result bit for bit each time."""
    from flash_a2a.api import flash_attention

    q, k, v = (torch.randn(1, 8192, 3, 128, device="cuda").to(torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    flash_attention(q, k, v, out=out)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        flash_attention(q, k, v, out=out)
    for _ in range(3):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t, dtype=torch.float32).to(torch.bfloat16))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, flash_attention(q, k, v, tail_split="launch"))
        assert rel_err(out, reference_attention(q, k, v)) <= 1e-2


def _tail_split_worker(rank, world, init_file, path):
    from cute_kernels.dist import process_group

    with process_group(rank, world, init_file):
        from flash_a2a.api import FusedAttentionA2A

        fused = FusedAttentionA2A()

        def check(shape, mode, option, **knobs) -> int:
            """Fresh inputs, poisoned output: the fused split equals the local kernel with the same split (each
            rank's own fused order, so both split the same last-round tiles in the same chunks) and the
            reference All-to-All, bit for bit."""
            q, k, v = (torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(3))
            ref = _post_a2a_reference(q, k, v, rank, world, tail_split=option)
            fused.state(q).out.fill_(float("nan"))
            got = fused(q, k, v, mode=mode, tail_split=option, **knobs)
            torch.cuda.synchronize()
            fused.check()
            assert torch.equal(got.cpu(), ref), (shape, mode, option, knobs)
            return 1

        checked = 0
        # 192 tiles (last round of 60 tiles in 2 chunks), 576 (48 in 2, two batches) and 416 (20 in 6), both
        # modes, one launch (True), two ("launch") and the default ("auto", two launches at all three), twice each
        for option in (True, "launch", "auto"):
            for shape in ((2, 4096, 3, 128), (2, 4096, 9, 128), (1, 4096, 13, 128)):
                for mode in ("piggyback", "completion_coupled"):
                    checked += check(shape, mode, option) + check(shape, mode, option)
        # cluster_kv=2: the clustered rounds kernel, then the unclustered chunks, the same bits as the split
        for mode in ("piggyback", "completion_coupled"):
            checked += check((2, 4096, 9, 128), mode, "launch", cluster_kv=2)
        # remote_first (every peer tile before any local one): the split's last-round tiles are the same local
        # tiles as the default walk's, so the same bits, in one launch and in two
        for option in (True, "launch"):
            for shape in ((2, 4096, 9, 128), (1, 4096, 13, 128)):
                checked += check(shape, "piggyback", option, remote_first=True)
        # store="paced" with the default split ("auto": two launches here): the rounds kernel paces its peer
        # stores, the tail launch stores its local chunks in bursts (api._tail_knobs); 192 tiles (one round, then
        # the chunks) and 576
        for knobs in ({"store": "paced", "pace_kv": 2}, {"store": "paced", "peel_drip": True}):
            for shape in ((2, 4096, 3, 128), (2, 4096, 9, 128)):
                checked += check(shape, "piggyback", "auto", **knobs)
        # store="tma" / "bulk" in the rounds kernel of the launch split (its peer tiles through the TMA engine),
        # the tail launch's local chunks in bursts
        for knobs in ({"store": "tma"}, {"store": "bulk"}):
            for shape in ((2, 4096, 3, 128), (2, 4096, 9, 128)):
                checked += check(shape, "piggyback", "launch", **knobs)
        # relay: the default relays at 192 tiles (one round before the tail launch, above); here its counterpart
        # (relay=False) there, and relay=True forced at 576 tiles (four rounds: every peer tile through the
        # shadow, several units per CTA) and 416 (six chunks per tile: chunks of 5-6 KV blocks, most events
        # after the loop), with the paced rounds kernel too, and with the self-store control's pointers
        for shape, knobs in (((2, 4096, 3, 128), {"relay": False}), ((2, 4096, 9, 128), {"relay": True}),
                             ((1, 4096, 13, 128), {"relay": True}),
                             ((2, 4096, 9, 128), {"relay": True, "store": "paced", "pace_kv": 2})):
            checked += check(shape, "piggyback", "auto", **knobs) + check(shape, "piggyback", "auto", **knobs)
        for shape in ((2, 4096, 3, 128), (2, 4096, 9, 128)):
            assert fused.decided[(*shape, torch.bfloat16)]["tail_split"] == "launch"
        fused(*(torch.randn(2, 4096, 3, 128, device="cuda").to(torch.bfloat16) for _ in range(3)))
        assert fused.decided[(2, 4096, 3, 128, torch.bfloat16)]["relay"] is True, "the default relays at 192 tiles"
        fused(*(torch.randn(2, 4096, 9, 128, device="cuda").to(torch.bfloat16) for _ in range(3)))
        assert fused.decided[(2, 4096, 9, 128, torch.bfloat16)]["relay"] is False
        q, k, v = (torch.randn(2, 4096, 3, 128, device="cuda").to(torch.bfloat16) for _ in range(3))
        fused.launch(q, k, v, wait=False, self_store=True, signal=False, relay=True)  # the control's relay runs
        torch.cuda.synchronize()
        fused.check()
        # The default (two launches at 192 tiles, relayed) in a CUDA Graph, replayed with fresh inputs.
        checked += _check_graph_replays(fused, (2, 4096, 3, 128), rank, world)
        with open(f"{path}.{rank}", "w") as f:
            json.dump({"checked": checked}, f)


@pytest.mark.multigpu
def test_fused_tail_split_matches_local_split_plus_reference_a2a(tmp_path):
    for res in run_ranks(_tail_split_worker, tmp_path):
        assert res["checked"] == 3 * 12 + 2 + 4 + 4 + 4 + 8 + 3


def test_cluster_kv_compiles_with_multicast_and_refuses_what_it_does_not_pair(tmp_path):
    """cluster_kv=2 (CTA pairs share each K/V block): the K/V loads are TMA multicasts to the pair, the
    stages are released on both CTAs' barriers (remote arrives), the launch has a 2-CTA cluster, both modes
    still run WGMMA; the split kernel, the crossed walk and the tail launch are refused."""
    from flash_a2a.attention import FlashAttentionA2AForward

    for name, knobs in (("local", {"mode": "local"}), ("fused", {"mode": "piggyback", "n_dst": 2}),
                        ("rounds", {"mode": "local", "walk": "rounds"})):
        c = _compile(tmp_path / name, head_dim=128, cluster_kv=2, **knobs)
        assert c.ptx_count(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global\.tile\.mbarrier::complete_tx"
                           r"::bytes\.multicast::cluster") >= 2, name
        assert c.ptx_count(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16") >= 16, name
        sass = _sass(c)
        assert "SYNCS.ARRIVE.TRANS64.RED" in sass, "a stage release must reach the peer CTA's barrier"
    plain = _compile(tmp_path / "plain", head_dim=128, mode="local")
    assert plain.ptx_count(r"multicast::cluster") == 0
    for bad in ({"tail_split": True}, {"cross_halves": True}, {"overlap": False}, {"cluster_kv": 4}):
        with pytest.raises(ValueError, match="cluster_kv"):
            FlashAttentionA2AForward(**{"head_dim": 128, "mode": "local", "cluster_kv": 2, **bad})


def test_tile_n_160_compiles_to_its_kv_loop_and_refuses_the_rest(tmp_path):
    """tile_n=160: the KV loop holds 18 HGMMA (8 for S = Q Kᵀ at n = 160, 10 for O += P V at k = 160) and 82
    exponentials (80 + 2 row scales); the default's SASS is untouched; other epilogues/knobs are refused."""
    from cute_kernels.compile import hgmma_loop, softmax_overlap
    from flash_a2a.attention import FlashAttentionA2AForward

    for mode, extra in (("local", {}), ("piggyback", {"n_dst": 2})):
        text = _sass(_compile(tmp_path / mode, head_dim=128, mode=mode, tile_n=160, **extra))
        loop = hgmma_loop(text, 18)
        assert loop is not None, mode
        assert sum("MUFU.EX2" in x for x in loop) == 82, mode
        assert len(softmax_overlap(text)) == 1
    for bad in ({"tile_n": 192}, {"tile_n": 160, "store": "tma"}, {"tile_n": 160, "head_dim": 64},
                {"tile_n": 160, "q_stages": 2}):
        with pytest.raises(ValueError, match="tile_n"):
            FlashAttentionA2AForward(**{"head_dim": 128, "mode": "local", **bad})


def test_kv_loop_outline_keeps_every_instruction_of_the_loop(tmp_path):
    """loop_outline (benchmarks/kv_loop_sass.py's view of a KV loop): the default loop's 16 HGMMA, its one
    scheduler-barrier wait and arrival, both warpgroup waits in order (S ready, then PV done), and all 66
    exponentials counted between them; nothing dropped."""
    from cute_kernels.compile import hgmma_loop, loop_outline

    body = hgmma_loop(_sass(_compile(tmp_path, head_dim=128, mode="local")), 16)
    outline = loop_outline(body)
    syncs = [x for kind, x in outline if kind == "sync"]
    assert sum("HGMMA" in x for x in syncs) == 16
    assert sum("BAR.SYNC" in x for x in syncs) == 1 and sum("BAR.ARV" in x for x in syncs) == 1
    waits = [x for x in syncs if "WARPGROUP.DEPBAR" in x]
    assert waits == [w for w in waits if "0x1" in w] + [w for w in waits if "0x0" in w] and len(waits) == 2
    assert sum(ops.get("MUFU", 0) for kind, ops in outline if kind == "ops") == 66
    assert len(syncs) + sum(sum(ops.values()) for kind, ops in outline if kind == "ops") == len(body)


def test_rescale_threshold_skips_the_o_rescale_in_a_branch(tmp_path):
    """rescale_threshold=8 (the default): the KV loop's 64 O-rescale FMULs sit behind a warp-uniform branch (a
    VOTE and a predicated BRA ahead of them), the QKᵀ HGMMAs issue back to back, the exponential window stays
    first_row's 51 (52 with the default pin 40); the loop without the threshold has no VOTE; bad values are
    refused."""
    from cute_kernels.compile import hgmma_loop, loop_outline, softmax_overlap
    from flash_a2a.attention import FlashAttentionA2AForward

    default = _sass(_compile(tmp_path / "default", head_dim=128, mode="local"))
    assert any("VOTE" in x for x in hgmma_loop(default, 16)) and softmax_overlap(default) == [(52, 66)]
    text = _sass(_compile(tmp_path / "th", head_dim=128, mode="local", rescale_threshold=8.0,
                          pin_softmax="first_row"))
    body = hgmma_loop(text, 16)
    assert any("VOTE" in x for x in body) and softmax_overlap(text) == [(51, 66)]
    outline = loop_outline(body)
    qk = [i for i, (kind, x) in enumerate(outline) if kind == "sync" and "HGMMA" in x and "tnspB" not in x]
    assert len(qk) == 8 and qk[-1] - qk[0] <= 2 * 7, "QK HGMMAs interleaved with other work"
    fmul_block = [ops for kind, ops in outline if kind == "ops" and ops.get("FMUL", 0) == 64]
    assert len(fmul_block) == 1, "the 64 rescale FMULs as one skippable block"
    every_block = hgmma_loop(_sass(_compile(tmp_path / "every", head_dim=128, mode="local", rescale_threshold=0.0)),
                             16)
    assert not any("VOTE" in x for x in every_block)
    for bad in (-1.0, 17.0, "8"):
        with pytest.raises(ValueError, match="rescale_threshold"):
            FlashAttentionA2AForward(head_dim=128, rescale_threshold=bad)
