"""Our attention on one H200 against an fp64 reference (fresh seeded inputs, poisoned outputs): every shape and
dtype, the fused tile orders (the same bits), strided inputs, the split tail (its own launch pair, against the
reference and the unsplit kernel) and its CUDA-Graph replay. Tolerance: relative Frobenius error <= 1e-2 against
fp64 (bf16 output rounding is ~4e-3)."""
from __future__ import annotations

import pytest
import torch
from tests_reference import reference_attention, rel_err

TOL = 1e-2


def randn(shape, dtype=torch.bfloat16, n=3):
    return [torch.randn(shape, device="cuda").to(dtype) for _ in range(n)]


@pytest.fixture
def seeded(request):
    seed = sum(map(ord, request.node.name)) % 10_000
    print(f"seed={seed}")
    torch.manual_seed(seed)
    return seed


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", [((1, 1024, 4, 128), torch.bfloat16), ((2, 2048, 3, 128), torch.bfloat16),
                                         ((1, 384, 1, 128), torch.bfloat16), ((1, 512, 2, 64), torch.bfloat16),
                                         ((1, 1024, 2, 128), torch.float16), ((1, 8192, 2, 128), torch.bfloat16),
                                         ((2, 4096, 6, 64), torch.float16)])
def test_flash_attention_matches_fp64_reference(seeded, shape, dtype):
    from flash_a2a.api import flash_attention

    q, k, v = randn(shape, dtype)
    out = torch.full_like(q, float("nan"))
    flash_attention(q, k, v, out=out)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "unwritten output elements"
    err = rel_err(out, reference_attention(q, k, v))
    assert err <= TOL, (seeded, err)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 2048, 3, 128), (2, 4096, 9, 128), (1, 1024, 2, 64)])
def test_fused_tile_orders_give_the_same_bits(seeded, shape):
    """The fused kernel's tile order for P = 2 and 4 (each rank's own) changes only which CTA computes a tile,
    never its bits; unsplit on both sides (the split is another summation order, tested below)."""
    from flash_a2a.api import flash_attention

    q, k, v = randn(shape)
    base = flash_attention(q, k, v, tail_split=False)
    for world in (2, 4):
        if shape[1] % (world * 128):
            continue
        for rank in range(world):
            out = torch.full_like(base, float("nan"))
            flash_attention(q, k, v, out=out, tail_split=False, tile_order_world=world, tile_order_rank=rank)
            assert torch.equal(out, base), (seeded, world, rank)


@pytest.mark.gpu
def test_flash_attention_strided_inputs_and_scale(seeded):
    from flash_a2a.api import flash_attention

    qkv = torch.randn(1, 1024, 3, 4, 128, device="cuda").to(torch.bfloat16)  # packed, non-contiguous views
    q, k, v = qkv.unbind(2)
    out = flash_attention(q, k, v, softmax_scale=0.05)
    torch.cuda.synchronize()
    assert rel_err(out, reference_attention(q, k, v, 0.05)) <= TOL
    # logits scaled up (q x 8, scale 1): rows raise their max by more than the rescale threshold's 2^8
    big = (q.float() * 8).to(torch.bfloat16).contiguous()
    out = flash_attention(big, k.contiguous(), v.contiguous(), softmax_scale=1.0)
    assert rel_err(out, reference_attention(big, k, v, 1.0)) <= TOL, seeded


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 8192, 3, 128), (2, 4096, 9, 128), (1, 4096, 13, 128), (1, 8192, 1, 128)])
def test_split_tail_matches_the_reference_and_the_unsplit_kernel(seeded, shape):
    """The split tail (the whole rounds, then the last round's chunks in a programmatic dependent launch) at
    shapes whose last round splits in 2 (192 and 576 tiles) and 6 chunks (416 tiles), and at 64 tiles (one
    round: nothing to split), three times with fresh inputs and a poisoned output (the chunk counters must be
    back at zero after each launch)."""
    from flash_a2a.api import _grid, flash_attention
    from flash_a2a.config import resolve_config

    n_tiles = (shape[1] // 128) * shape[2] * shape[0]
    config = resolve_config("local", n_tiles, _grid(n_tiles, torch.device("cuda")), shape[1] // 128,
                            tail_split=True)
    assert config.tail_split == (n_tiles > 132), config
    for _ in range(3):
        q, k, v = randn(shape)
        out = torch.full_like(q, float("nan"))
        flash_attention(q, k, v, out=out, tile_order_world=2, tail_split=True)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), "unwritten output elements"
        assert rel_err(out, reference_attention(q, k, v)) <= TOL, seeded
        assert rel_err(out, flash_attention(q, k, v, tile_order_world=2, tail_split=False)) <= TOL, seeded


@pytest.mark.gpu
def test_split_tail_launch_pair_replays_in_a_cuda_graph(seeded):
    """The default at 192 tiles (two launches, the second a programmatic dependent launch) captured in a CUDA
    Graph and replayed with fresh inputs gives the eager result bit for bit each time."""
    from flash_a2a.api import flash_attention

    q, k, v = randn((1, 8192, 3, 128))
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
        assert torch.equal(out, flash_attention(q, k, v, tail_split=True)), seeded
        assert rel_err(out, reference_attention(q, k, v)) <= TOL, seeded


@pytest.mark.gpu
def test_spans_fill_one_row_per_tile_and_warpgroup(seeded):
    """Instrumented FA-only (unsplit: "auto" does not split an instrumented launch): the same output, and every
    (tile, warpgroup) row written with ordered timestamps on both clocks."""
    from flash_a2a.api import flash_attention

    q, k, v = randn((1, 2048, 2, 128))
    n_rows = (2048 // 128) * 2 * 2
    with pytest.raises(ValueError, match="spans"):
        flash_attention(q, k, v, spans=torch.zeros(n_rows - 1, 4, dtype=torch.int64, device="cuda"))
    spans = torch.zeros(n_rows, 4, dtype=torch.int64, device="cuda")
    out = flash_attention(q, k, v, spans=spans)
    torch.cuda.synchronize()
    assert torch.equal(out, flash_attention(q, k, v, tail_split=False)), seeded
    sp = spans.cpu()
    assert (sp[:, 0] > 0).all() and (sp[:, 1] >= sp[:, 0]).all()
    assert (sp[:, 2] > 0).all() and (sp[:, 3] >= sp[:, 2]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("q_shape,kv_shape", [((1, 2048, 8, 128), (1, 2048, 2, 128)),  # GQA
                                              ((1, 1024, 6, 128), (1, 1024, 1, 128)),  # MQA
                                              ((1, 8192, 4, 128), (1, 512, 4, 128)),  # cross: short prompt
                                              ((2, 1024, 4, 64), (2, 4096, 2, 64)),  # cross + GQA, d = 64
                                              ((1, 8192, 3, 128), (1, 1024, 3, 128))])  # split tail with cross
def test_cross_attention_and_gqa_match_fp64(seeded, q_shape, kv_shape):
    """K/V of their own length and heads: query head h attends K/V head h // (H / H_kv), against fp64 with the
    K/V heads repeated; the output poisoned first."""
    from flash_a2a.api import flash_attention

    q = torch.randn(q_shape, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(kv_shape, device="cuda").to(torch.bfloat16) for _ in range(2))
    out = torch.full_like(q, float("nan"))
    flash_attention(q, k, v, out=out)
    torch.cuda.synchronize()
    group = q_shape[2] // kv_shape[2]
    ref = reference_attention(q, k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2))
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) <= TOL, (seeded, q_shape, kv_shape)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,kv_shape", [((1, 2048, 4, 128), None), ((2, 1024, 3, 64), None),
                                            ((1, 8192, 3, 128), None), ((1, 2048, 8, 128), (1, 512, 2, 128))])
def test_return_lse_matches_fp64_logsumexp(seeded, shape, kv_shape):
    """return_lse: float32 (b, H, S), the natural log-sum-exp of the scaled logits, within 1e-3 absolute of fp64;
    the output within 1e-3 (relative) of the lse-free unsplit launch's (the same arithmetic; ptxas schedules the
    two kernels apart) and of fp64 as every output is."""
    from flash_a2a.api import flash_attention

    q = torch.randn(shape, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(kv_shape or shape, device="cuda").to(torch.bfloat16) for _ in range(2))
    out, lse = flash_attention(q, k, v, return_lse=True)
    torch.cuda.synchronize()
    assert lse.shape == (shape[0], shape[2], shape[1]) and lse.dtype == torch.float32
    group = shape[2] // k.shape[2]
    logits = (q.double().permute(0, 2, 1, 3) @ k.repeat_interleave(group, 2).double().permute(0, 2, 3, 1))
    ref = torch.logsumexp(logits * shape[3] ** -0.5, dim=-1)
    assert (lse.double() - ref).abs().max().item() <= 1e-3, seeded
    assert rel_err(out, flash_attention(q, k, v, tail_split=False).double()) <= 1e-3, seeded
    group_ref = reference_attention(q, k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2))
    assert rel_err(out, group_ref) <= TOL, seeded


def _reference_chunked(q, k, v, rows: int = 4096):
    """reference_attention over query rows in chunks (long sequences: the fp64 logits of all rows do not fit)."""
    return torch.cat([reference_attention(q[:, i:i + rows], k, v) for i in range(0, q.shape[1], rows)], dim=1)


@pytest.mark.gpu
@pytest.mark.parametrize("s,s_kv,h,d", [(1, 1, 2, 128), (127, 127, 3, 128), (129, 129, 2, 64), (1000, 1000, 4, 128),
                                        (4095, 4095, 2, 64), (32760, 32760, 1, 64), (1000, 77, 4, 128),
                                        (130, 4100, 2, 128), (8192, 300, 3, 64)])
def test_any_sequence_length_matches_fp64(seeded, s, s_kv, h, d):
    """Lengths that are not multiples of 128 (the last Q tile's rows past S are not stored, the last KV block's
    columns past S_kv take no softmax mass), self- and cross-attention, with the LSE too: against fp64. The
    output is a view into a larger poisoned buffer, whose rows past S must stay poisoned."""
    from flash_a2a.api import flash_attention

    q = torch.randn(1, s, h, d, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(1, s_kv, h, d, device="cuda").to(torch.bfloat16) for _ in range(2))
    big = torch.full((1, s + 256, h, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = big[:, :s]
    _, lse = flash_attention(q, k, v, out=out, return_lse=True)
    torch.cuda.synchronize()
    assert torch.isnan(big[:, s:]).all(), "rows past S were written"
    assert not torch.isnan(out).any(), "unwritten output rows"
    assert rel_err(out, _reference_chunked(q, k, v)) <= TOL, (seeded, s, s_kv)
    logits_max = max(int(1e8 // (s_kv * h)), 1)
    rows = slice(0, min(s, logits_max))
    ref_lse = torch.logsumexp((q[:, rows].double().permute(0, 2, 1, 3) @ k.double().permute(0, 2, 3, 1)) * d ** -0.5,
                              dim=-1)
    assert (lse[:, :, rows].double() - ref_lse).abs().max().item() <= 1e-3, seeded
    plain = flash_attention(q, k, v)  # without the LSE: the same arithmetic
    assert rel_err(plain, out.double()) <= 1e-3
