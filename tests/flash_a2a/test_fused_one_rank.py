"""The fused launch path on one GPU, at world size 1 (a one-rank NCCL group with symmetric memory): every tile
is this rank's own, so the fused output must equal FA-only with the same split bit for bit. This runs the whole
host side (config, symmetric buffers, flags and epochs, the split's typed arguments, the self-store control,
spans, CUDA-Graph replay) and the fused kernels' protocol on hardware where no second GPU is lent; the
cross-rank checks are test_fused_multigpu.py's."""
from __future__ import annotations

import pytest
import torch

SEED = 7


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    from cute_kernels.dist import process_group

    init = str(tmp_path_factory.mktemp("pg") / "init")
    with process_group(0, 1, init):
        from flash_a2a import FusedAttentionA2A

        yield FusedAttentionA2A()


def _randn(shape):
    return [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(3)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 1024, 2, 128), (1, 8192, 3, 128), (2, 4096, 9, 128), (1, 2048, 4, 64),
                                   (1, 2304, 4, 64), (1, 1000, 2, 128), (2, 300, 3, 64)])
@pytest.mark.parametrize("mode,opts", [("piggyback", {}), ("piggyback", {"store": "st"}),
                                       ("piggyback", {"store": "paced"}), ("completion_coupled", {}),
                                       ("piggyback", {"tail_split": False})])
def test_one_rank_fused_equals_fa_only(fused, shape, mode, opts):
    from flash_a2a import flash_attention
    from flash_a2a.config import query_tile_rows

    # d = 64 runs 192-row tiles: 2048 is a partial tile there, 2304 whole ones
    if shape[1] % query_tile_rows(shape[3]) and opts.get("store") == "paced":
        with pytest.raises(ValueError, match="paced"):
            fused(*_randn(shape), mode=mode, **opts)
        return

    torch.manual_seed(SEED)
    print(f"seed={SEED}")
    for _ in range(2):
        q, k, v = _randn(shape)
        fused.state(q).out.fill_(float("nan"))
        got = fused(q, k, v, mode=mode, **opts).clone()
        torch.cuda.synchronize()
        fused.check()
        config = fused.decided[(*shape, torch.bfloat16)]
        ref = flash_attention(q, k, v, tail_split=config.tail_split)
        assert torch.equal(got, ref), (shape, mode, opts, config)


@pytest.mark.gpu
def test_one_rank_split_self_store_spans_and_graph(fused):
    """The split default (192 tiles) decided and recorded; the self-store control and an instrumented launch run
    and leave the error word clean; the default replays in a CUDA Graph with fresh inputs, bit for bit."""
    from flash_a2a import flash_attention

    torch.manual_seed(SEED + 1)
    q, k, v = _randn((1, 8192, 3, 128))
    fused(q, k, v)
    c = fused.decided[(1, 8192, 3, 128, torch.bfloat16)]
    assert c.tail_split and c.split_k == 2 and not c.relay, c  # one rank: nothing to relay
    fused.launch(q, k, v, wait=False, self_store=True)
    n_rows = (8192 // 128) * 3 * 2 + min(192, torch.cuda.get_device_properties(0).multi_processor_count)
    spans = torch.zeros(n_rows, 4, dtype=torch.int64, device="cuda")
    spanned = fused.launch(q, k, v, spans=spans).clone()
    torch.cuda.synchronize()
    fused.check()
    assert torch.equal(spanned, flash_attention(q, k, v, tail_split=False)), "instrumented launches run unsplit"
    sp = spans.cpu()
    assert (sp[:, 0] > 0).all() and (sp[:, 1] >= sp[:, 0]).all() and (sp[:, 3] >= sp[:, 2]).all()
    fused(q, k, v)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fused(q, k, v)
    for _ in range(3):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t, dtype=torch.float32).to(torch.bfloat16))
        g.replay()
        torch.cuda.synchronize()
        fused.check()
        assert torch.equal(out, flash_attention(q, k, v, tail_split=True))


@pytest.mark.gpu
@pytest.mark.parametrize("q_shape,kv_shape", [((1, 2048, 8, 128), (1, 2048, 2, 128)),
                                              ((1, 8192, 3, 128), (1, 1024, 3, 128))])
def test_one_rank_fused_cross_and_gqa_equal_fa_only(fused, q_shape, kv_shape):
    from flash_a2a import flash_attention

    torch.manual_seed(SEED + 2)
    q = torch.randn(q_shape, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(kv_shape, device="cuda").to(torch.bfloat16) for _ in range(2))
    got = fused(q, k, v).clone()
    torch.cuda.synchronize()
    fused.check()
    config = fused.decided[(*q_shape, torch.bfloat16)]
    assert torch.equal(got, flash_attention(q, k, v, tail_split=config.tail_split)), config
