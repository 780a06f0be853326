"""The attention kernels as built for sm_90a (CPU, fake tensors): WGMMA and 128-bit stores in every variant,
no spills, the flag protocol each walk claims, the KV loop's schedule shared by the local, fused and split
kernels, and the constructor's refusals. Each check asserts that what it compares was found."""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("cutlass")

WGMMA = r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.bf16\.bf16"


def _compile(dump_dir, **knobs):
    """FlashAttentionA2AForward(**knobs) compiled for sm_90a from fake tensors, dumping into ``dump_dir``."""
    from cutlass.runtime import make_fake_stream

    from cute_kernels.compile import compile_kernel
    from flash_a2a.attention import FlashAttentionA2AForward

    dump_dir.mkdir(parents=True, exist_ok=True)
    k = FlashAttentionA2AForward(**knobs)
    return compile_kernel(k, *k.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True), dump_dir=str(dump_dir))


def _sass(compiled) -> str:
    from cute_kernels.compile import sass

    text = sass(compiled.cubin)
    if text is None:
        pytest.skip("no nvdisasm on this machine (it comes with triton): cannot read the SASS")
    return text


def _window(text: str) -> list[tuple[int, int]]:
    """The KV loop's softmax window (exponentials, FFMAs between the S wait and the PV wait): found, once."""
    from cute_kernels.compile import softmax_overlap

    windows = softmax_overlap(text)
    assert len(windows) == 1, f"expected one overlapped KV loop, found {windows}"
    return windows


def _fused(**knobs) -> dict:
    return {"head_dim": 128, "mode": "piggyback", "n_dst": 2, **knobs}


@pytest.mark.parametrize("store", ["st", "paced"])
@pytest.mark.parametrize("mode", ["local", "piggyback", "completion_coupled"])
@pytest.mark.parametrize("head_dim", [128, 64])
def test_variants_compile_with_wgmma_and_128_bit_stores(tmp_path, mode, head_dim, store, no_spills):
    from flash_a2a.attention import FlashAttentionA2AForward

    n_dst = 1 if mode == "local" else 2
    if store == "paced" and mode != "piggyback":
        with pytest.raises(ValueError, match="paced"):
            FlashAttentionA2AForward(head_dim=head_dim, mode=mode, store=store, n_dst=n_dst)
        return
    c = _compile(tmp_path, head_dim=head_dim, mode=mode, store=store, n_dst=n_dst)
    assert c.ptx_count(WGMMA) >= 2 * (head_dim // 16)
    assert c.ptx_count(r"cp\.async\.bulk\.tensor") >= 3, "Q, K, V through TMA"
    assert c.ptx_count(r"st\.global\.v4") >= 1, "128-bit output stores"
    assert c.ptx_count(r"st\.global\.(b16|v2)") == 0, "no narrower output stores (b32/b64: the flag words)"
    assert c.ptx_count(r"setmaxnreg") == 2, "producer/consumer register split"
    assert c.ptx_count(r"ld\.local|st\.local") == 0
    # the ready wait's acquire fence after its relaxed polls, the completion fence (and per tile when coupled)
    assert c.ptx_count(r"fence\.acq_rel\.sys") == {"local": 0, "piggyback": 2, "completion_coupled": 3}[mode]
    assert c.ptx_count(r"fence\.acq_rel\.gpu") == 0
    if mode != "local":
        assert c.ptx_count(r"ld\.relaxed\.sys") >= 1, "bounded wait for the receiver's ready flag"
        assert c.ptx_count(r"ld\.acquire\.sys") == 0, "no acquire (L1 invalidation) per poll"
        assert c.ptx_count(r"%globaltimer") >= 1, "the ready wait is bounded by a deadline"
    no_spills(c.ptx)


def test_flag_protocol_per_walk(tmp_path):
    """Each walk of the fused kernel compiles to exactly its part of the flag protocol: "all" the ready polls
    (relaxed loads, one acquire fence), the completion fence and the data-flag adds; "rounds" (the split's first
    launch) the ready gate only; "tail" no ready gate, the wait for the rounds kernel, then the fence and adds;
    the local kernel none of it."""
    # (system fences, ready polls, data-flag adds, grid-dependency waits)
    expect = {"all": (2, True, True, 0), "rounds": (1, True, False, 0), "tail": (1, False, True, 1)}
    for walk, (fences, polls, adds, waits) in expect.items():
        c = _compile(tmp_path / walk, **_fused(walk=walk))
        got = (c.ptx_count(r"fence\.acq_rel\.sys"), c.ptx_count(r"ld\.relaxed\.sys") > 0,
               c.ptx_count(r"red\.relaxed\.sys(\.global)?\.add\.u64") > 0, c.ptx_count(r"griddepcontrol\.wait"))
        assert got == (fences, polls, adds, waits), (walk, got)
        assert c.ptx_count(r"nanosleep") == 0, walk
    local = _compile(tmp_path / "local", head_dim=128, mode="local")
    assert local.ptx_count(r"\.sys") == 0, "FA-only touches nothing at system scope"


def test_default_kv_loop_window_and_outline(tmp_path):
    """The default KV loop (d = 128): 16 HGMMA, one scheduler-barrier wait and arrival, both warpgroup waits in
    order (S ready, then PV done), all 66 exponentials, 52 of them ahead of the PV wait (PINNED_EXPONENTIALS=40
    plus what ptxas hoists), and the 64 O-rescale FMULs behind a warp-uniform branch (RESCALE_THRESHOLD)."""
    from cute_kernels.compile import hgmma_loop, loop_outline

    text = _sass(_compile(tmp_path, head_dim=128, mode="local"))
    assert "STL" not in text and "LDL" not in text
    assert _window(text) == [(52, 66)]
    body = hgmma_loop(text, 16)
    assert body is not None, "no KV loop of 16 HGMMAs"
    outline = loop_outline(body)
    syncs = [x for kind, x in outline if kind == "sync"]
    assert sum("HGMMA" in x for x in syncs) == 16
    assert sum("BAR.SYNC" in x for x in syncs) == 1 and sum("BAR.ARV" in x for x in syncs) == 1
    waits = [x for x in syncs if "WARPGROUP.DEPBAR" in x]
    assert len(waits) == 2 and "0x1" in waits[0] and "0x0" in waits[1]
    assert sum(ops.get("MUFU", 0) for kind, ops in outline if kind == "ops") == 66
    assert len(syncs) + sum(sum(ops.values()) for kind, ops in outline if kind == "ops") == len(body)
    assert any("VOTE" in x for x in body), "the rescale skip's warp vote"
    assert len([ops for kind, ops in outline if kind == "ops" and ops.get("FMUL", 0) == 64]) == 1


def test_fused_and_split_kernels_keep_the_local_kv_loop(tmp_path):
    """The fused epilogues and the split's rounds kernel must not change how ptxas schedules the shared KV loop
    (holding S/P live across it once moved 61 of 66 exponentials ahead of the PV wait instead of 51); the fused
    ready wait leaves the TMA producer's KV loop without R2UR (a run-time loop over the ranks once put 8 per KV
    block there, ~0.65% of the kernel on H200)."""
    from cute_kernels.compile import sass_loop

    local = _sass(_compile(tmp_path / "local", head_dim=128, mode="local"))
    base = _window(local)
    for name, knobs in (("piggyback", _fused()), ("completion_coupled", _fused(mode="completion_coupled")),
                        ("rounds_local", {"head_dim": 128, "mode": "local", "walk": "rounds"}),
                        ("rounds_fused", _fused(walk="rounds"))):
        c = _compile(tmp_path / name, **knobs)
        text = _sass(c)
        assert _window(text) == base, name
        producer = sass_loop(text, lambda body: sum("UTMALDG" in x for x in body) == 4)
        assert producer is not None, f"{name}: no producer KV loop with its 4 TMA loads"
        assert not any("R2UR" in x for x in producer), (name, [x for x in producer if "R2UR" in x])
        if name.startswith("rounds"):
            assert c.ptx_count(r"griddepcontrol\.launch_dependents") == 1, name


def test_paced_stores_issue_inside_the_q_loop(tmp_path, no_spills):
    """store="paced": the KV loop (16 HGMMAs at d = 128) also holds a 128-bit global store and a shared-memory
    load (a vector of the previous tile's staged rows); the burst's loop holds no global store."""
    from cute_kernels.compile import hgmma_loop

    loops = {}
    for store in ("st", "paced"):
        c = _compile(tmp_path / store, **_fused(store=store))
        text = _sass(c)
        assert "STL" not in text and "LDL" not in text
        loops[store] = hgmma_loop(text, 16)
        assert loops[store] is not None, store
        no_spills(c.ptx)
    assert not any("STG" in x for x in loops["st"])
    assert any("STG.E.128" in x for x in loops["paced"]), loops["paced"]
    assert any(re.search(r"(^|\s)LDS", x) for x in loops["paced"])


def test_split_tail_kernel_counts_chunks_and_waits_for_the_rounds(tmp_path, no_spills):
    """The split's tail launch (walk "tail"): WGMMA, a GPU-scope acq_rel atomic per chunk count, the chunk
    count and buffers from its own typed arguments (no 64-bit global load of an argument table before the
    walk), and in the fused kernel the wait for the rounds kernel before its flags."""
    for name, knobs in (("local", {"head_dim": 128, "mode": "local"}), ("fused", _fused())):
        c = _compile(tmp_path / name, walk="tail", **knobs)
        assert c.ptx_count(WGMMA) >= 16, name
        assert c.ptx_count(r"atom(\.global)?\.acq_rel(\.gpu)?(\.global)?\.add") >= 1, name
        assert c.ptx_count(r"griddepcontrol\.wait") == (1 if name == "fused" else 0), name
        no_spills(c.ptx)


def test_relay_tail_compiles_with_its_copies_in_the_q_loop(tmp_path, no_spills):
    """relay=True (the fused tail launch sends the rounds kernel's shadowed peer tiles on): 128-bit loads and
    stores beyond the plain tail kernel's, the grid-dependency wait ahead of its first load as well as before
    the flags, no spills; in the KV loop each event takes its addresses from shared memory and no integer
    division (each cost the chunks ~4-5 µs at 3 heads/8K on H200)."""
    from cute_kernels.compile import hgmma_loop

    plain = _compile(tmp_path / "plain", **_fused(walk="tail"))
    relay = _compile(tmp_path / "relay", **_fused(walk="tail", relay=True))
    for pat in (r"ld\.global\.v4", r"st\.global\.v4"):
        assert relay.ptx_count(pat) > plain.ptx_count(pat), pat
    assert relay.ptx_count(r"griddepcontrol\.wait") > plain.ptx_count(r"griddepcontrol\.wait") >= 1
    loop = hgmma_loop(_sass(relay), 16)
    assert loop is not None, "no KV loop of 16 HGMMAs"
    text = "\n".join(loop)
    assert "LDG.E.128" in text and "STG.E.128" in text, "the relay's load and store sit in the KV loop"
    assert "LDS.64" in text and "LDG.E.64" not in text, "addresses from shared memory, not global"
    assert "MUFU.RCP" not in text and "I2F" not in text, "no integer division in the KV loop"
    no_spills(relay.ptx)


@pytest.mark.parametrize("bad, match", [
    ({"mode": "sideways"}, "mode"), ({"head_dim": 96}, "head_dim"), ({"store": "tma"}, "store"),
    ({"walk": "backwards"}, "walk"), ({"mode": "local", "n_dst": 2}, "n_dst"),
    ({"mode": "completion_coupled", "store": "paced", "n_dst": 2}, "paced"),
    ({"mode": "piggyback", "n_dst": 2, "walk": "tail", "store": "paced"}, "paced"),
    ({"walk": "rounds", "instrument": True}, "split tail"), ({"walk": "tail", "head_dim": 64}, "split tail"),
    ({"relay": True}, "relay"), ({"mode": "piggyback", "n_dst": 2, "relay": True}, "relay"),
    ({"mode": "piggyback", "n_dst": 1, "walk": "tail", "relay": True}, "relay")])
def test_constructor_refuses_what_it_does_not_build(bad, match):
    import cutlass

    from flash_a2a.attention import FlashAttentionA2AForward

    with pytest.raises(ValueError, match=match):
        FlashAttentionA2AForward(**{"head_dim": 128, "mode": "local", **bad})
    with pytest.raises(ValueError, match="dtype"):
        FlashAttentionA2AForward(dtype=cutlass.Float32)


def test_bad_input_rejected_before_launch():
    from flash_a2a.api import check_qkv, flash_attention

    q = torch.zeros(1, 256, 2, 128, dtype=torch.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        check_qkv(q, q, q)
    with pytest.raises(ValueError, match="4-D"):
        check_qkv(q[0], q[0], q[0])
    qb = q.to(torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        check_qkv(qb, qb, qb)
    with pytest.raises(ValueError, match="tile_order_rank"):
        flash_attention(q, q, q, tile_order_world=2, tile_order_rank=2)
    with pytest.raises(ValueError, match="tile_order_world"):
        flash_attention(q, q, q, tile_order_world=0)


@pytest.mark.parametrize("knobs", [{"separate_kv": True}, {"separate_kv": True, "mode": "piggyback", "n_dst": 2},
                                   {"separate_kv": True, "walk": "rounds"}, {"lse": True},
                                   {"lse": True, "separate_kv": True}, {"masked_kv": True},
                                   {"masked_kv": True, "separate_kv": True}, {"masked_q": True},
                                   {"masked_q": True, "masked_kv": True, "separate_kv": True, "lse": True}])
def test_cross_attention_gqa_lse_and_any_length_keep_the_kv_loop(tmp_path, knobs, no_spills):
    """separate_kv (K/V of their own length and heads: cross-attention, GQA/MQA) changes the K/V head and the
    KV-block count only, outside the KV loop: its softmax window stays the default's. masked_kv loads the
    partial last KV block first and masks it in the Q-loop's peeled first block, masked_q leaves the last tile's
    rows past S unstored: no mask code in the KV loop, all 66 exponentials there. lse=True adds two log2 per
    thread after the loop. Around the loop ptxas then keeps 47 to 52 of 66 exponentials ahead of the PV wait
    (47 with lse: reading the row max after the loop is what moves it). WGMMA, no spills."""
    c = _compile(tmp_path / "v", **{"head_dim": 128, "mode": "local", **knobs})
    assert c.ptx_count(WGMMA) >= 16
    assert c.ptx_count(r"lg2\.approx") == (2 if knobs.get("lse") else 0), "one log2 per row of the thread"
    (ahead, total), = _window(_sass(c))
    assert total == 66 and (ahead == 47 if knobs.get("lse") else 47 <= ahead <= 52), (ahead, total)
    if not any(knobs.get(f) for f in ("lse", "masked_q", "masked_kv")):
        assert ahead == 52
    no_spills(c.ptx)


@pytest.mark.parametrize("knobs", [{}, {"masked_q": True}, {"masked_kv": True, "separate_kv": True},
                                   {"masked_q": True, "masked_kv": True, "separate_kv": True, "lse": True}])
def test_d64_three_warpgroup_tiles_compile(tmp_path, knobs, no_spills):
    """tile_m=192 (d = 64, the local one-launch kernel): three MMA warpgroups at 160 registers and a producer at
    32 (FA4's SM90 split), GEMM issue round robin over three scheduler barriers, a 192-row Q tile through TMA,
    12 HGMMAs per KV block (QKᵀ 64x128x64 in 4 k-steps, PV 64x64x128 in 8), no spills; every variant, since the
    KV mask lives outside the loop."""
    from cute_kernels.compile import hgmma_loop

    c = _compile(tmp_path / "v", **{"head_dim": 64, "mode": "local", "tile_m": 192, "q_stages": 2, "kv_stages": 3,
                                    **knobs})
    assert c.ptx_count(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+32;") == 1
    assert c.ptx_count(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+160;") == 1
    assert c.ptx_count(WGMMA) >= 12
    assert c.ptx_count(r"st\.global\.v4") >= 1 and c.ptx_count(r"st\.global\.(b16|v2)") == 0
    text = _sass(c)
    body = hgmma_loop(text, 12)
    assert body is not None, "no KV loop of 12 HGMMAs"
    assert sum("BAR.SYNC" in x for x in body) == 1 and sum("BAR.ARV" in x for x in body) == 1
    assert len(_window(text)) == 1
    # the ping-pong pairs two warpgroups (256 threads) on the next one's scheduler barrier, a run-time id
    assert any("BAR.ARV" in x and "0x100" in x for x in body) and any("BAR.SYNC" in x and "0x100" in x for x in body)
    no_spills(c.ptx)


def test_d64_masked_kv_peels_the_partial_block_load(tmp_path):
    """On the 192-row d = 64 tiles the producer loads the masked partial KV block in a peeled first load, not with
    an index computed in its loop: with the in-loop index ptxas kept 12 of 66 exponentials of the MMA warpgroups'
    KV loop ahead of the PV wait (the unmasked loop: 19) and S_kv = 32760 ran 2.4% slower than 32768. The
    producer's TMA loop then holds no block-index select, and the Q-loop keeps at least 15 ahead."""
    from cute_kernels.compile import sass_loop

    d64 = {"head_dim": 64, "mode": "local", "tile_m": 192, "q_stages": 2, "kv_stages": 3, "masked_q": True}
    text = _sass(_compile(tmp_path / "masked", **d64, masked_kv=True))
    (ahead, total), = _window(text)
    assert total == 66 and ahead >= 15, (ahead, total)
    def one_k_one_v(body):
        return sum("UTMALDG" in x for x in body) == 2

    loads = sass_loop(text, one_k_one_v)
    assert loads is not None, "no producer loop of one K and one V load"
    plain = sass_loop(_sass(_compile(tmp_path / "whole", **d64)), one_k_one_v)
    assert len(loads) == len(plain), "the masked producer's loop is the whole-block one"


def test_q_double_buffer_keeps_the_kv_loop(tmp_path, no_spills):
    """q_stages=2 (the next tile's Q under this tile's loop): two Q stages, so the Q TMA load takes a stage index,
    and the KV loop's schedule stays the default's (52 of 66 exponentials ahead of the PV wait); no spills."""
    c = _compile(tmp_path / "v", head_dim=128, mode="local", q_stages=2, separate_kv=True)
    assert c.ptx_count(WGMMA) >= 16
    assert _window(_sass(c)) == [(52, 66)]
    no_spills(c.ptx)


@pytest.mark.parametrize("knobs, match", [({"q_stages": 3}, "q_stages must be"),
                                          ({"q_stages": 2, "mode": "piggyback", "n_dst": 2}, "one-launch local"),
                                          ({"q_stages": 2, "walk": "rounds"}, "one-launch local"),
                                          ({"kv_stages": 3}, "shared memory")])
def test_stage_counts_only_where_built(knobs, match):
    from flash_a2a.attention import FlashAttentionA2AForward

    with pytest.raises(ValueError, match=match):
        FlashAttentionA2AForward(**{"head_dim": 128, "mode": "local", **knobs})


@pytest.mark.parametrize("knobs", [{"mode": "piggyback", "n_dst": 2}, {"mode": "piggyback", "n_dst": 2, "store": "paced"},
                                   {"mode": "completion_coupled", "n_dst": 4, "masked_q": True, "masked_kv": True,
                                    "ranked": True}])
def test_fused_d64_three_warpgroup_kernels_compile(tmp_path, knobs, no_spills):
    """The fused kernels on 192-row d = 64 tiles: the flag protocol's fences, WGMMA, 128-bit stores, no spills."""
    c = _compile(tmp_path / "v", **{"head_dim": 64, "tile_m": 192, **knobs})
    assert c.ptx_count(WGMMA) >= 12 and c.ptx_count(r"st\.global\.v4") >= 1
    assert c.ptx_count(r"fence\.acq_rel\.sys") == (3 if knobs["mode"] == "completion_coupled" else 2)
    assert c.ptx_count(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+160;") == 1
    no_spills(c.ptx)


def test_d64_three_warpgroups_only_where_built():
    from flash_a2a.attention import FlashAttentionA2AForward
    from flash_a2a.config import query_tile_rows

    for bad in ({"head_dim": 128}, {"instrument": True}):
        with pytest.raises(ValueError, match="tile_m=192"):
            FlashAttentionA2AForward(**{"head_dim": 64, "mode": "local", "tile_m": 192, **bad})
    with pytest.raises(ValueError, match="tile_m must be one of"):
        FlashAttentionA2AForward(head_dim=64, tile_m=256)
    assert query_tile_rows(64) == 192  # every mode and tile order
    assert query_tile_rows(128) == query_tile_rows(64, instrument=True) == 128


def test_lse_needs_the_local_one_launch_kernel_and_masks_one_launch():
    """lse: the one-launch local kernel only. masked_q/masked_kv: one launch with the burst store (fused too);
    a fused kernel's partial tiles end rank slices (ranked), and ranked needs masked_q and no lse."""
    from flash_a2a.attention import FlashAttentionA2AForward

    for bad in ({"mode": "piggyback", "n_dst": 2}, {"walk": "rounds"}, {"walk": "tail"}):
        with pytest.raises(ValueError, match="lse"):
            FlashAttentionA2AForward(**{"head_dim": 128, "mode": "local", "lse": True, **bad})
    for bad in ({"walk": "rounds"}, {"walk": "tail"}, {"mode": "piggyback", "n_dst": 2, "store": "paced"}):
        for mask in ("masked_q", "masked_kv"):
            with pytest.raises(ValueError, match="masked"):
                FlashAttentionA2AForward(**{"head_dim": 128, "mode": "local", mask: True, "ranked": mask == "masked_q",
                                            **bad})
    with pytest.raises(ValueError, match="ranked=True"):
        FlashAttentionA2AForward(head_dim=128, mode="piggyback", n_dst=2, masked_q=True)
    with pytest.raises(ValueError, match="ranked=True"):
        FlashAttentionA2AForward(head_dim=128, ranked=True)
    with pytest.raises(ValueError, match="ranked=True"):
        FlashAttentionA2AForward(head_dim=128, ranked=True, masked_q=True, lse=True)


@pytest.mark.parametrize("knobs", [{"mode": "piggyback", "n_dst": 2, "masked_q": True, "masked_kv": True,
                                    "ranked": True},
                                   {"mode": "completion_coupled", "n_dst": 4, "masked_q": True, "ranked": True,
                                    "head_dim": 64},
                                   {"masked_q": True, "ranked": True, "q_stages": 2},
                                   {"mode": "piggyback", "n_dst": 2, "masked_q": True, "masked_kv": True,
                                    "ranked": True, "separate_kv": True}])
def test_ranked_kernels_compile(tmp_path, knobs, no_spills):
    """ranked (S/P not a multiple of 128: tiles cut from each rank's slice, the fused kernel and FA-only in its
    order): WGMMA, the Q tile through TMA at its slice's row, 128-bit stores, the KV loop's 66 exponentials, no
    spills."""
    c = _compile(tmp_path / "v", **{"head_dim": 128, "mode": "local", **knobs})
    assert c.ptx_count(WGMMA) >= 2 * (knobs.get("head_dim", 128) // 16)
    assert c.ptx_count(r"cp\.async\.bulk\.tensor") >= 3 and c.ptx_count(r"st\.global\.v4") >= 1
    (ahead, total), = _window(_sass(c))
    assert total == 66 and ahead >= 45, (ahead, total)
    no_spills(c.ptx)


@pytest.mark.parametrize("q_shape,kv_shape,match", [
    ((1, 256, 4, 128), (1, 256, 3, 128), "multiple of k/v's 3"),
    ((1, 256, 4, 128), (2, 256, 4, 128), "share one shape"),
    ((1, 256, 4, 128), (1, 0, 4, 128), "positive"),
    ((1, 256, 4, 64), (1, 256, 4, 128), "share one shape"),
    ((1, 200, 4, 96), (1, 200, 4, 96), "head_dim must be 64 or 128")])
def test_cross_and_grouped_shapes_are_checked_before_launch(q_shape, kv_shape, match):
    from flash_a2a.api import check_shapes

    with pytest.raises(ValueError, match=match):
        check_shapes(q_shape, kv_shape, kv_shape)
    for q_s, kv_s in (((1, 256, 4, 128), (1, 512, 2, 128)), ((1, 1, 4, 128), (1, 1, 4, 128)),
                      ((1, 32760, 12, 64), (1, 77, 12, 64))):  # cross with GQA; any length on one rank
        check_shapes(q_s, kv_s, kv_s)
    with pytest.raises(ValueError, match="not divisible by the world size 2"):
        check_shapes((1, 201, 4, 128), (1, 201, 4, 128), (1, 201, 4, 128), world=2)
    check_shapes((1, 200, 4, 128), (1, 200, 4, 128), (1, 200, 4, 128), world=2)  # S/P = 100: partial tiles
