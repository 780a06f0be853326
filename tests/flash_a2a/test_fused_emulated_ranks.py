"""The fused kernel's cross-rank protocol on ONE GPU: P ranks emulated as concurrent launches on P streams, each
over SMs / P CTAs, each rank's output buffer, flags and epoch in the same GPU's memory, the pointer tables into
each other's (the kernel takes rank, world, grid and the tables at run time). Checks, with fresh seeded inputs
and poisoned outputs over two epochs: every rank's output equals the local kernel (in that rank's fused order)
followed by the reference All-to-All, bit for bit unsplit (within 1e-3 with the split tail: another summation
order of the last round's tiles); every data flag and epoch advanced once per epoch; no error word set. The
real multi-GPU tests are test_fused_multigpu.py's."""
from __future__ import annotations

import math

import pytest
import torch

SEED = 11
TIMEOUT_NS = 2_000_000_000


class EmulatedRanks:
    """One GPU's stand-in for P ranks' symmetric buffers: rank r's (b, S/P, H, d) output, its 2P flags, epoch,
    arrival counter and error word; the destination and flag pointer tables every rank shares."""

    def __init__(self, world: int, out_shape, dtype):
        dev = torch.device("cuda")
        self.world = world
        self.outs = [torch.full(out_shape, float("nan"), dtype=dtype, device=dev) for _ in range(world)]
        self.flags = [torch.zeros(2 * world, dtype=torch.int64, device=dev) for _ in range(world)]
        self.epochs = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
        self.counters = [torch.zeros(1, dtype=torch.int32, device=dev) for _ in range(world)]
        self.errors = [torch.zeros(4, dtype=torch.int32, device=dev) for _ in range(world)]
        self.dst_ptrs = torch.tensor([o.data_ptr() for o in self.outs], dtype=torch.int64, device=dev)
        self.flag_ptrs = torch.tensor([f.data_ptr() for f in self.flags], dtype=torch.int64, device=dev)
        self.shadows = [{j: torch.empty_like(self.outs[0]) for j in range(world) if j != r} for r in range(world)]

    def relay_ptrs(self, r):
        """(real destinations, rank r's rounds table: its own buffer and its shadows, the shadows to send on)."""
        dev = self.dst_ptrs.device
        rounds = torch.tensor([self.shadows[r][j].data_ptr() if j != r else self.outs[r].data_ptr()
                               for j in range(self.world)], dtype=torch.int64, device=dev)
        shadow = torch.tensor([self.shadows[r][j].data_ptr() if j != r else 0 for j in range(self.world)],
                              dtype=torch.int64, device=dev)
        return self.dst_ptrs, rounds, shadow


def _launch_all_ranks(ranks: EmulatedRanks, qkv, mode: str, tail_split, store, relay, splits):
    """Every rank's kernels on its own stream, all launched before any is waited for (the ready protocol needs
    them co-resident: grid = SMs / P each). Returns each rank's config."""
    from flash_a2a.api import SplitTailBuffers, _kernels_of, _local_args
    from flash_a2a.config import query_tile_rows, resolve_config
    from flash_a2a.mapping import relay_share, ulysses_tiles

    world = ranks.world
    q0 = qkv[0][0]
    b, s, h_loc, d = q0.shape
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tile_m = query_tile_rows(d)
    n_tiles = ulysses_tiles(s, world, tile_m) * h_loc * b
    masked_q, masked_kv = bool((s // world) % tile_m), bool(s % 128)  # partial tiles per rank slice, KV blocks
    grid = min(n_tiles, sms // world)
    vectors = relay_share(0, 1, world, b, s // world, h_loc, d * q0.element_size() // 16)[2]
    config = resolve_config(mode, n_tiles, grid, -(-s // 128), world, head_dim=d, masked=masked_q or masked_kv,
                            relay_vectors=vectors, tile_m=tile_m, tail_split=tail_split, store=store, relay=relay)
    spans = _local_args(q0.device).spans
    streams = [torch.cuda.Stream() for _ in range(world)]
    launches = []
    for r in range(world):
        if config.tail_split and r not in splits:
            splits[r] = SplitTailBuffers.allocate(q0.device, config)
        kernels = _kernels_of(config, q0.dtype, d, mode, world, False, splits.get(r), ranks.dst_ptrs,
                              ranks.relay_ptrs(r) if config.relay else None, masked_q=masked_q,
                              masked_kv=masked_kv, ranked=masked_q)
        launches.append(kernels)
    torch.cuda.synchronize()  # every kernel compiled before any rank launches
    for r in range(world):
        q, k, v = qkv[r]
        with torch.cuda.stream(streams[r]):
            for fn, ptrs, work, shadows in launches[r]:
                fn(q, k, v, q, ptrs, ranks.flag_ptrs, ranks.flags[r], ranks.epochs[r], ranks.counters[r],
                   ranks.errors[r], spans, 1.0 / math.sqrt(d), r, world, grid, TIMEOUT_NS, *work, shadows, None)
    torch.cuda.synchronize()
    return config


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("shape,mode,opts", [((1, 2048, 4, 128), "piggyback", {"store": "st"}),
                                             ((2, 4096, 6, 128), "piggyback", {"store": "paced", "tail_split": False}),
                                             ((1, 2048, 4, 128), "completion_coupled", {}),
                                             ((2, 4096, 6, 128), "piggyback", {}),  # the defaults: split, relay
                                             ((2, 4096, 6, 128), "piggyback", {"relay": False}),
                                             ((1, 1024, 8, 64), "piggyback", {}),
                                             # d = 64: whole 192-row tiles per rank slice, paced and coupled
                                             ((1, 4608, 4, 64), "piggyback", {"store": "paced", "tail_split": False}),
                                             ((1, 4608, 8, 64), "completion_coupled", {}),
                                             # S/P not a multiple of 128: partial tiles end each rank's slice
                                             ((1, 2000, 4, 128), "piggyback", {}),
                                             ((2, 1500, 8, 64), "completion_coupled", {}),
                                             ((1, 4100, 4, 128), "piggyback", {})])
def test_emulated_ranks_match_local_plus_reference_a2a(world, shape, mode, opts):
    """``shape`` is the full (b, S, H, d); each emulated rank holds its H/P heads. Two epochs per case."""
    from flash_a2a import flash_attention
    from flash_a2a.mapping import reference_post_a2a
    from cute_kernels.epoch import SHARE_TOTAL

    b, s, h, d = shape
    if h % world or s % world:
        pytest.skip(f"{shape} does not split over {world} ranks")
    torch.manual_seed(SEED + world)
    print(f"seed={SEED + world}")
    ranks = EmulatedRanks(world, (b, s // world, h, d), torch.bfloat16)
    splits: dict = {}
    opts = {"tail_split": "auto", "store": "auto", "relay": "auto", **opts}
    for epoch in (1, 2):
        full = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _ in range(3)]
        h_loc = h // world
        qkv = [[t[:, :, r * h_loc:(r + 1) * h_loc].contiguous() for t in full] for r in range(world)]
        for o in ranks.outs:
            o.fill_(float("nan"))
        config = _launch_all_ranks(ranks, qkv, mode, opts["tail_split"], opts["store"], opts["relay"], splits)
        for r in range(world):
            assert int(ranks.errors[r][0]) == 0, (r, ranks.errors[r].tolist(), config)
            assert int(ranks.epochs[r][0]) == epoch, (r, config)
            assert ranks.flags[r][:world].tolist() == [epoch * SHARE_TOTAL] * world, (r, ranks.flags[r].tolist())
        # the local kernel unsplit: each emulated rank walks SMs / P CTAs, so its split tail chunks other tiles
        # than a one-GPU launch would; unsplit the bits agree whatever the grid, split only the last ones
        local = [flash_attention(*qkv[r], tile_order_world=world, tile_order_rank=r, tail_split=False)
                 for r in range(world)]
        ref = reference_post_a2a([t.cpu() for t in local])
        for r in range(world):
            got = ranks.outs[r].cpu()
            assert not torch.isnan(got).any(), (r, config, "a tile never arrived")
            if config.tail_split:
                err = float((got.double() - ref[r].double()).norm() / ref[r].double().norm())
                assert err <= 1e-3, (world, shape, mode, opts, config, epoch, r, err)
            else:
                assert torch.equal(got, ref[r]), (world, shape, mode, opts, config, epoch, r)
