"""FlashAttentionA2AForward: a persistent Hopper FlashAttention forward (non-causal, bf16/fp16, d = 64 or
128) whose epilogue either writes O locally or piggybacks the Ulysses post-attention All-to-All.

CTA = 3 warpgroups (4 for the 192-row tiles of d = 64). Warpgroup 0 is the producer (one warp issues the TMA
loads of Q and of the K/V pipeline; in the fused modes another of its warps runs the flag protocol); the others
are the MMA warpgroups, 64 query rows each: S = Q Kᵀ with WGMMA from shared memory, online softmax in registers,
O += P V with P from registers. Block n's QKᵀ is issued with block n-1's PV inside a warpgroup, and GEMM issue
ping-pongs round robin between the MMA warpgroups so one's softmax runs under the others' GEMMs (as FA3 does). The
grid is persistent (cute_kernels.tile_scheduler): CTA c walks units c, c + grid, ... in the Ulysses tile order.

Epilogue (compile-time ``mode``), per MMA warpgroup, on its own 64-row half of the output tile:
- ``local``: O to this rank's (b, S, H/P, d) tensor;
- ``piggyback``: the same 128-bit stores, into the destination rank's symmetric (b, S/P, H, d) buffer
  (flash_a2a.mapping), then straight on to the next tile's Q-loop: no communication warp, no wait;
- ``completion_coupled``: as piggyback, but the warpgroup waits for its stores to be performed at system
  scope (fence.acq_rel.sys) before going on: the paper's counterfactual (eq. 17).
Each warpgroup owns its 64-row half and stores it without waiting for the other (ping-pong already offsets
the two), so a tile boundary is two 16 KiB bursts per SM rather than one 32 KiB burst. ``store="paced"``
(piggyback) keeps a tile's rows in shared memory and sends them one 16 B vector per thread every PACE_KV KV
blocks of the warpgroup's next tile, so a tile boundary injects no burst into NVLink.

The split tail (``walk``): with 128-row tiles the persistent walk's last round is partly empty. "rounds" runs
the whole rounds (the default kernel's KV loop; its dependent launch may start early), "tail" runs the last
round's tiles in k KV chunks in a second, programmatic dependent launch: each chunk leaves its unnormalized O
and row max and sum in a float32 workspace, and the CTA whose count on the tile's counter is the k-th combines
them in chunk order and stores the tile. In the fused kernel the last round holds local tiles only: "rounds"
runs the ready gate and sends every peer tile but raises no flag; "tail" waits for the rounds kernel's
completion (griddepcontrol.wait) and then raises the flags. ``relay`` (fused "tail" only): the rounds kernel
stored its peer tiles into local shadows, and this kernel's MMA threads send them on under their chunks'
Q-loops. Which of these a shape gets is decided once, by flash_a2a.config.resolve_config.

The measured alternatives to every choice made here are in docs/FINDINGS.md (with the commit that has their
code).
"""
from __future__ import annotations

import enum
import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.runtime import make_fake_tensor
from cutlass.utils import LayoutEnum
from quack import copy_utils, layout_utils, sm90_utils

from cute_kernels import timers
from cute_kernels.epoch import FlagProtocol, announce_ready, await_all_ready, publish_done
from cute_kernels.tile_epilogue import WarpgroupTileStore
from cute_kernels.tile_scheduler import WALKS, PersistentTileScheduler, UlyssesTileOrder
from flash_a2a.mapping import RELAY_PACE_KV, RELAY_START_KV, ranked_tile_rows, relay_events_in_loop
from flash_a2a.softmax import OnlineSoftmax
from flash_a2a.tail_launch import TailLaunchMixin
from flash_a2a.tiling import TILE_M, TILE_M_D64, TILE_N, WG_THREADS
from flash_a2a.walk import WalkShape

MODES = ("local", "piggyback", "completion_coupled")
STORES = ("st", "paced")
KV_STAGES = 2
# Exponentials of the 2 x 32 a thread computes per KV block kept ahead of the PV wait in the SASS (see
# overlapped_block): 40 measured fastest with RESCALE_THRESHOLD (docs/FINDINGS.md, pin_softmax).
PINNED_EXPONENTIALS = 40
# The 192-row d = 64 kernel (three MMA warpgroups, whose GEMMs fill the Tensor Cores under one warpgroup's softmax)
# wants few: 8 measured fastest where the last KV block is whole (1x65536x12 24248 us against 40's 24744, 8192x12
# 363.0 against 379.2, 4096x16 134.4 against 139.2): benchmarks/results/h200/d64_pins_d50ac05.json, medians of 8
# rounds. The same 8 with the masked partial KV block since its producer peels that block's load: at S_kv = 32760
# 8 against 12 and 16 (12 heads 5968.9 / 5965.5 / 6030.2 us, 16 heads 7923.5 / 7953.1 / 7973.2, 24 heads
# 12069.6 / 12142.0 / 12213.5): benchmarks/results/h200/hdim64_sweep_2540665.json.
PINNED_EXPONENTIALS_D64 = 8
# A row keeps its running max unless a block raises it by more than 2^8 (FA4's SM100 trick), so most blocks
# rescale nothing: 2.5-3.2% faster than following every block on H200 (docs/FINDINGS.md, rescale_threshold).
RESCALE_THRESHOLD = 8.0
PACE_KV = 2  # store="paced": KV blocks per stored vector (1 measured slower, docs/FINDINGS.md)


class NamedBarrierFwd(enum.IntEnum):
    """Named barriers (0 is __syncthreads), room for three MMA warpgroups."""
    Epilogue = 1  # 1-3: one per MMA warpgroup, around its sO rows (and the fused kernel's ready gate)
    TailSplit = 4  # split tail: both MMA warpgroups around a chunk's partial and its count; the relay's setup
    WarpSchedulerWG1 = 5  # 5-7: warpgroup ping-pong on GEMM issue, round robin
    WarpSchedulerWG2 = 6
    WarpSchedulerWG3 = 7
    Done = 8  # fused: the MMA warpgroups' last stores and the flag warp, before publish_done


# Query rows per tile and the register split: 128 rows (two MMA warpgroups, 240 registers each), or 192 (three,
# 160 each: FA4's SM90 configuration for d = 64) for the one-launch kernels at d = 64, local or fused
# (flash_a2a.config.query_tile_rows decides).
TILE_ROWS = (TILE_M, TILE_M_D64)
REGISTER_SPLIT = {2: (24, 240), 3: (32, 160)}  # MMA warpgroups -> (producer, MMA) registers per thread


class FlashAttentionA2AForward(TailLaunchMixin):
    """``mode``: the epilogue (MODES). ``n_dst``: destination ranks (1 local; the world size fused).
    ``walk``: "all", or the split tail's "rounds" / "tail" launches. ``store``: "st" (burst) or "paced"
    (piggyback). ``relay``: the fused tail launch relays the rounds kernel's peer tiles. ``instrument``:
    per-tile span records (compiled out otherwise). ``separate_kv``: K/V of their own length and heads
    (cross-attention, GQA). ``lse``: also write each row's softmax log-sum-exp (float32 (b, H, S)). ``masked_q``
    / ``masked_kv``: S not a multiple of the tile's rows (the last Q tile partial) / S_kv not one of 128 (the
    last KV block partial). ``ranked``: the tile order's rank slices of S/P rows are not multiples of the tile
    (the fused kernel, or FA-only in its order, at S/P not a multiple of 128): a tile's rows are counted from
    its destination rank's slice, and its rows past the slice are not stored. ``tile_m``: query rows
    per tile (TILE_ROWS: 192 for the d = 64 one-launch local kernel only)."""

    pinned_exponentials = PINNED_EXPONENTIALS
    tail_barrier = NamedBarrierFwd.TailSplit

    def __init__(self, dtype=cutlass.BFloat16, head_dim: int = 128, mode: str = "local", n_dst: int = 1,
                 walk: str = "all", store: str = "st", relay: bool = False, instrument: bool = False,
                 separate_kv: bool = False, lse: bool = False, masked_q: bool = False, masked_kv: bool = False,
                 tile_m: int = TILE_M, q_stages: int = 1, kv_stages: int = KV_STAGES, ranked: bool = False):
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise ValueError("dtype must be BFloat16 or Float16")
        if head_dim not in (64, 128):
            raise ValueError(f"head_dim must be 64 or 128, got {head_dim}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if n_dst < 1 or (mode == "local" and n_dst != 1):
            raise ValueError(f"n_dst must be 1 for the local kernel and >= 1 fused, got {n_dst}")
        if walk not in WALKS:
            raise ValueError(f"walk must be one of {WALKS}, got {walk!r}")
        if store not in STORES:
            raise ValueError(f"store must be one of {STORES}, got {store!r}")
        if store == "paced" and (mode != "piggyback" or walk == "tail"):
            raise ValueError("store='paced' spreads a tile's peer stores over the next tile's Q-loop: use it with "
                             "mode='piggyback' and walk 'all' or 'rounds' (the tail launch stores local chunks)")
        if walk != "all" and (instrument or head_dim != 128):
            raise ValueError("the split tail's launches (walk='rounds'/'tail') are built for head_dim=128 "
                             "without instrumentation")
        if relay and (walk != "tail" or mode != "piggyback" or n_dst < 2):
            raise ValueError("relay=True copies the rounds kernel's peer tiles on from the fused tail launch: use "
                             "it with walk='tail', mode='piggyback' and n_dst >= 2")
        if lse and (mode != "local" or walk != "all"):
            raise ValueError("lse=True writes the softmax log-sum-exp of the one-launch local kernel: use it with "
                             "mode='local' and walk='all'")
        self.dtype, self.head_dim, self.mode, self.n_dst = dtype, head_dim, mode, n_dst
        self.walk, self.store, self.relay, self.instrument = walk, store, bool(relay), instrument
        # separate_kv: K and V have a length and head count of their own (cross-attention, GQA/MQA): the KV loop
        # runs over K's blocks and query head h reads K/V head h // (H_q / H_kv); off, they share q's shape
        self.separate_kv, self.lse = bool(separate_kv), bool(lse)
        # masked_q / masked_kv: any sequence length; the last Q tile's rows past S are not stored, the last KV
        # block's columns past S_kv are masked out of the softmax (no padding of the user's tensors: TMA
        # zero-fills the loads). One launch (walk "all") with the burst store: no split, paced store or relay.
        if (masked_q or masked_kv) and (walk != "all" or store != "st" or relay):
            raise ValueError("masked_q/masked_kv (a length that is not a multiple of the tiles) are built for one "
                             "launch (walk='all') with the burst store (store='st')")
        if ranked and (not masked_q or lse):
            raise ValueError("ranked=True (rank slices that are not multiples of the tile) needs masked_q=True and "
                             "no lse")
        if mode != "local" and masked_q and not ranked:
            raise ValueError("a fused kernel's partial tiles end rank slices: masked_q needs ranked=True there")
        self.masked_q, self.masked_kv, self.ranked = bool(masked_q), bool(masked_kv), bool(ranked)
        self.split = walk == "tail"  # the last round's tiles in KV chunks
        fused = mode != "local"
        self.flags_on = fused  # epoch advance and data flags
        self.ready_on = fused and walk != "tail"  # the tail launch stores local tiles only: no ready gate
        self.publish = fused and walk != "rounds"  # "rounds": the tail launch raises the flags
        if tile_m not in TILE_ROWS:
            raise ValueError(f"tile_m must be one of {TILE_ROWS}, got {tile_m}")
        if tile_m != TILE_M and (head_dim != 64 or walk != "all" or instrument):
            raise ValueError(f"tile_m={tile_m} (three MMA warpgroups) is built for one launch (walk='all') at "
                             "head_dim=64 without instrumentation; use tile_m=128")
        self.tile_m = tile_m
        # q_stages 2: the next tile's Q loads under this tile's loop, so the producer runs on into its K/V blocks
        # (a tile boundary's bubble: what pays where tiles have few KV blocks, flash_a2a.config.resolve_config)
        if q_stages not in (1, 2) or kv_stages not in (2, 3):
            raise ValueError(f"q_stages must be 1 or 2 and kv_stages 2 or 3, got {q_stages}, {kv_stages}")
        if (q_stages, kv_stages) != (1, KV_STAGES) and (mode != "local" or walk != "all"):
            raise ValueError("q_stages=2 / kv_stages=3 are built for the one-launch local kernel: use the defaults")
        smem = (self.tile_m * (q_stages + 1) + 2 * TILE_N * kv_stages) * head_dim * dtype.width // 8
        if smem > 228 * 1024:
            raise ValueError(f"q_stages={q_stages}, kv_stages={kv_stages} need {smem} B of shared memory at "
                             f"head_dim={head_dim}, over the SM's 228 KiB; use fewer stages")
        self.q_stages, self.kv_stages = q_stages, kv_stages
        self.num_mma_wg = tile_m // 64
        # the producer warpgroup gives its registers to the MMA warpgroups
        self.num_producer_regs, self.num_mma_regs = REGISTER_SPLIT[self.num_mma_wg]
        if tile_m == TILE_M_D64:
            self.pinned_exponentials = PINNED_EXPONENTIALS_D64
        self.done_threads = self.num_mma_wg * WG_THREADS + 32  # NamedBarrierFwd.Done: MMA warpgroups, flag warp
        self.num_threads = WG_THREADS * (self.num_mma_wg + 1)
        self.vec = 128 // dtype.width  # elements per 128-bit store

    # ---------------------------------------------------------------- host
    def fake_args(self):
        d = self.head_dim
        s_div = 1 if self.masked_q else self.tile_m
        if not (self.separate_kv or self.masked_kv):  # K/V share q's length: whole KV blocks too
            s_div = math.lcm(s_div, TILE_N)
        b, s, h = cute.sym_int64(), cute.sym_int64(divisibility=s_div), cute.sym_int64()

        def qkv(rows=s, heads=h):
            return make_fake_tensor(self.dtype, (b, rows, heads, d), stride=(cute.sym_int64(divisibility=self.vec),
                                                                             cute.sym_int64(divisibility=self.vec),
                                                                             cute.sym_int64(divisibility=self.vec), 1),
                                    assumed_align=16)

        kv = ((cute.sym_int64(divisibility=1 if self.masked_kv else TILE_N), cute.sym_int64()) if self.separate_kv
              else (s, h))

        i64 = make_fake_tensor(Int64, (cute.sym_int64(),), stride=(1,), assumed_align=8)
        i64b = make_fake_tensor(Int64, (cute.sym_int64(),), stride=(1,), assumed_align=8)
        flags, epoch = (make_fake_tensor(Int64, (cute.sym_int64(),), stride=(1,), assumed_align=8) for _ in range(2))
        counter, errors = (make_fake_tensor(Int32, (cute.sym_int64(),), stride=(1,), assumed_align=4) for _ in range(2))
        spans = make_fake_tensor(Int64, (cute.sym_int64(), 4), stride=(4, 1), assumed_align=16)
        split = (None, None)
        if self.split:
            split = (make_fake_tensor(Float32, (cute.sym_int64(),), stride=(1,), assumed_align=16),
                     make_fake_tensor(Int32, (cute.sym_int64(),), stride=(1,), assumed_align=4))
        shadows = make_fake_tensor(Int64, (cute.sym_int64(),), stride=(1,), assumed_align=8) if self.relay else None
        lse = (make_fake_tensor(Float32, (b, h, s), stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
               if self.lse else None)
        return (qkv(), qkv(*kv), qkv(*kv), qkv(), i64, i64b, flags, epoch, counter, errors, spans,
                Float32(1.0), Int32(0), Int32(1), Int32(1), Int64(1), *split, Int32(1), shadows, lse)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 dst_ptrs: cute.Tensor, flag_ptrs: cute.Tensor, flags: cute.Tensor, epoch: cute.Tensor,
                 counter: cute.Tensor, errors: cute.Tensor, spans: cute.Tensor, softmax_scale: Float32,
                 rank: Int32, world: Int32, grid: Int32, timeout_ns: Int64, split_workspace: cute.Tensor,
                 split_counters: cute.Tensor, split_k: Int32, relay_shadows: cute.Tensor, mLSE: cute.Tensor,
                 stream: cuda.CUstream):
        """``dst_ptrs``: the destinations' base addresses (Int64 [n_dst]: this rank's or each rank's symmetric
        (b, S/P, H, d) buffer, or the relay's local shadows). The split tail (walk "tail"): ``split_workspace``
        (float32, the chunks' partials), ``split_counters`` (Int32, one per split tile, zero between launches)
        and ``split_k`` (chunks per tile); ``relay_shadows`` (Int64 [n_dst], relay): the shadows to send on
        (0 for this rank). ``mLSE`` (lse=True): float32 (b, H, S). Other kernels pass None for them; every other
        argument keeps its place, so the default kernels' code does not depend on these."""
        d = self.head_dim
        # (b, s, h, d) -> (s, d, h, b): TMA tiles over (rows, head dim) of one (head, batch).
        sel = [1, 3, 2, 0]
        mQt, mKt, mVt = [layout_utils.select(t, sel) for t in (mQ, mK, mV)]
        tiled_mma_qk = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.num_mma_wg, 1, 1), tiler_mn=(64, TILE_N))
        tiled_mma_pv = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32,
            atom_layout_mnk=(self.num_mma_wg, 1, 1), tiler_mn=(64, d), a_source=warpgroup.OperandSource.RMEM)
        q_staged = self.q_stages > 1
        sQ_layout = sm90_utils.make_smem_layout(self.dtype, LayoutEnum.ROW_MAJOR, (self.tile_m, d),
                                                self.q_stages if q_staged else None)
        sK_layout = sm90_utils.make_smem_layout(self.dtype, LayoutEnum.ROW_MAJOR, (TILE_N, d), self.kv_stages)
        sV_layout = sm90_utils.make_smem_layout(self.dtype, LayoutEnum.ROW_MAJOR, (TILE_N, d), self.kv_stages)
        sO_layout = sm90_utils.make_smem_layout(self.dtype, LayoutEnum.ROW_MAJOR, (self.tile_m, d))
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        sQ_box = cute.select(sQ_layout, mode=[0, 1]) if const_expr(q_staged) else sQ_layout
        tma_q, gQ_tma = cpasync.make_tiled_tma_atom(load_op, mQt, sQ_box, (self.tile_m, d))
        tma_k, gK_tma = cpasync.make_tiled_tma_atom(load_op, mKt, cute.select(sK_layout, mode=[0, 1]), (TILE_N, d), 1)
        tma_v, gV_tma = cpasync.make_tiled_tma_atom(load_op, mVt, cute.select(sV_layout, mode=[0, 1]), (TILE_N, d), 1)
        tx_q = cute.size_in_bytes(self.dtype, sQ_box)
        tx_kv = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[Int64, 2 * self.q_stages]
            mbar_k: cute.struct.MemRange[Int64, 2 * self.kv_stages]
            mbar_v: cute.struct.MemRange[Int64, 2 * self.kv_stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sO_layout)], 1024]

        if const_expr(self.relay):
            @cute.struct
            class RelayStorage:
                main: SharedStorage
                # the relay's destinations and shadows, read from shared memory at each event
                relay_ptrs: cute.struct.Align[cute.struct.MemRange[Int64, 2 * self.n_dst], 16]

            SharedStorage = RelayStorage

        scale_log2 = softmax_scale * Float32(math.log2(math.e))
        self.kernel(gQ_tma, gK_tma, gV_tma, mO, dst_ptrs, flag_ptrs, flags, epoch, counter, errors, spans,
                    tma_q, tma_k, tma_v, sQ_layout, sK_layout, sV_layout, sO_layout, tiled_mma_qk,
                    tiled_mma_pv, tx_q, tx_kv, scale_log2, rank, world, timeout_ns, split_workspace, split_counters,
                    split_k if const_expr(self.split) else None, relay_shadows, mLSE, SharedStorage).launch(
            grid=(grid, 1, 1), block=(self.num_threads, 1, 1), stream=stream, min_blocks_per_mp=1,
            use_pdl=self.walk == "tail")

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               dst_ptrs: cute.Tensor, flag_ptrs: cute.Tensor, flags: cute.Tensor, epoch: cute.Tensor,
               counter: cute.Tensor, errors: cute.Tensor, spans: cute.Tensor,
               tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sO_layout, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               tx_q: cutlass.Constexpr, tx_kv: cutlass.Constexpr, scale_log2: Float32, rank: Int32,
               world: Int32, timeout_ns: Int64, split_workspace, split_counters, split_k, relay_shadows, mLSE,
               SharedStorage: cutlass.Constexpr):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)
        if const_expr(self.walk == "rounds"):
            cute.arch.griddepcontrol_launch_dependents()  # the tail launch's CTAs may take SMs as these exit
        storage, s_relay, pipe_q, pipe_k, pipe_v = self.shared_storage_and_pipelines(SharedStorage, tx_q, tx_kv)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        pipeline.pipeline_init_wait(cluster_shape_mn=None)

        shape = WalkShape.create(mQ, rank, world, bidx, grid, mK if const_expr(self.separate_kv) else None,
                                 self.masked_q, self.masked_kv, self.tile_m)
        protocol = FlagProtocol(flag_ptrs, flags, epoch, counter, errors, timeout_ns)
        pipes = (pipe_q, pipe_k, pipe_v)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.num_producer_regs)
            if const_expr(self.flags_on):
                if warp_idx == 1:  # idle otherwise: system-scope fences and flag polls cost no MMA time here
                    self.flag_warp(protocol, spans, shape, tidx)
            if warp_idx == 0:
                self.load(mQ, mK, mV, (sQ, sK, sV), (tma_q, tma_k, tma_v), pipes, shape, split_k)
        else:
            cute.arch.setmaxregister_increase(self.num_mma_regs)
            self.mma(mO, dst_ptrs, protocol, spans, (sQ, sK, sV, sO), tiled_mma_qk, tiled_mma_pv, pipes, scale_log2,
                     shape, tidx - WG_THREADS, (split_workspace, split_counters, split_k), relay_shadows, s_relay, mLSE)

    def shared_storage_and_pipelines(self, SharedStorage, tx_q, tx_kv):
        """The CTA's shared storage (and the relay's pointer table), and the Q, K and V TMA pipelines: one Q
        stage, ``kv_stages`` K/V stages, each consumed by every MMA warp."""
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        s_relay = None
        if const_expr(self.relay):
            s_relay = storage.relay_ptrs.get_tensor(cute.make_layout(2 * self.n_dst))
            storage = storage.main
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        mma_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_wg * 4)
        pipe_q = pipeline.PipelineTmaAsync.create(barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.q_stages,
                                                  producer_group=one_thread, consumer_group=mma_warps,
                                                  tx_count=tx_q, defer_sync=True)
        kv_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_wg * 4)
        pipe_k = pipeline.PipelineTmaAsync.create(barrier_storage=storage.mbar_k.data_ptr(),
                                                  num_stages=self.kv_stages, producer_group=one_thread,
                                                  consumer_group=kv_warps,
                                                  tx_count=tx_kv, cta_layout_vmnk=None, defer_sync=True)
        pipe_v = pipeline.PipelineTmaAsync.create(barrier_storage=storage.mbar_v.data_ptr(),
                                                  num_stages=self.kv_stages, producer_group=one_thread,
                                                  consumer_group=kv_warps,
                                                  tx_count=tx_kv, cta_layout_vmnk=None, defer_sync=True)
        pipeline.pipeline_init_arrive(cluster_shape_mn=None, is_relaxed=True)
        return storage, s_relay, pipe_q, pipe_k, pipe_v

    def walk_policies(self, shape: WalkShape, split_k) -> tuple[PersistentTileScheduler, UlyssesTileOrder]:
        """This launch's walk and tile order (the same for the producer and the MMA warpgroups)."""
        sched = PersistentTileScheduler.create(self.walk, shape.n_tiles, shape.grid, Int32(shape.bidx), shape.n_kv,
                                               split_k, Int32)
        order = UlyssesTileOrder(shape.world, shape.n_mb_per_rank, shape.h_loc, shape.rank, shape.n_tiles,
                                 Int32(shape.grid))
        return sched, order

    @cute.jit
    def flag_warp(self, protocol: FlagProtocol, spans, shape: WalkShape, tidx):
        """Fused modes, an idle producer warp: announce this rank ready for the next epoch and wait (bounded)
        for every receiver's announcement, then open the MMA warpgroups' ready gate (their first tile's
        epilogue barrier), so no store reaches a receiver still reading its previous output. Where this
        launch raises the flags, the CTA's completion also waits for this warp (it reads the epoch before the
        last CTA advances it)."""
        if const_expr(self.ready_on):
            t_start = cute.arch.globaltimer()
            e_next = protocol.epoch[0] + 1
            announce_ready(protocol.flag_ptrs, shape.rank, shape.world, e_next, tidx % 32, shape.bidx)
            await_all_ready(protocol.flags, shape.world, e_next, protocol.timeout_ns, protocol.errors, tidx % 32,
                            shape.bidx, [NamedBarrierFwd.Epilogue + wg for wg in range(self.num_mma_wg)],
                            WG_THREADS + 32, self.n_dst)
            if const_expr(self.instrument):
                if tidx % 32 == 0:  # the CTA's ready row, after the per-tile rows
                    row = shape.n_tiles * self.num_mma_wg + shape.bidx
                    spans[row, 0] = t_start
                    spans[row, 1] = cute.arch.globaltimer()
        if const_expr(self.publish):
            cute.arch.barrier_arrive(barrier_id=NamedBarrierFwd.Done, number_of_threads=self.done_threads)

    @cute.jit
    def load(self, mQ, mK, mV, smem, tmas, pipes, shape: WalkShape, split_k=None):
        """The producer warp: per unit, the tile's Q, then its K/V blocks (K[n] and V[n] paired)."""
        d = self.head_dim
        sQ, sK, sV = smem
        tma_q, tma_k, tma_v = tmas
        pipe_q, pipe_k, pipe_v = pipes
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
        sched, order = self.walk_policies(shape, split_k)
        for u in cutlass.range(sched.initial(), sched.end, sched.stride, unroll=1):
            t = u
            kv0, kv1 = None, None
            if const_expr(self.split):
                t, kv0, kv1, _, _ = sched.work(u)
            m_block, h, bb, dest = order.coords(t)
            mQ_hb = mQ[None, None, h, bb]
            q_block = m_block
            if const_expr(self.ranked):  # the tile's rows start in its destination rank's slice
                mQ_hb = cute.domain_offset((self.tile_rows(shape, m_block, dest)[0], 0), mQ_hb)
                q_block = 0
            if const_expr(self.q_stages == 1):
                gQ = cute.local_tile(mQ_hb, (self.tile_m, d), (q_block, 0))
                load_q, _, _ = copy_utils.tma_get_copy_fn(tma_q, 0, cute.make_layout(1), gQ, sQ, single_stage=True)
            else:
                gQ = cute.local_tile(mQ_hb, (self.tile_m, d), (None, 0))
                load_q, _, _ = copy_utils.tma_get_copy_fn(tma_q, 0, cute.make_layout(1), gQ, sQ)
            h_kv = h
            if const_expr(self.separate_kv):
                h_kv = h // shape.kv_group
            gK = cute.local_tile(mK[None, None, h_kv, bb], (TILE_N, d), (None, 0))
            gV = cute.local_tile(mV[None, None, h_kv, bb], (TILE_N, d), (None, 0))
            load_k, _, _ = copy_utils.tma_get_copy_fn(tma_k, 0, cute.make_layout(1), gK, sK)
            load_v, _, _ = copy_utils.tma_get_copy_fn(tma_v, 0, cute.make_layout(1), gV, sV)
            pipe_q.producer_acquire(q_state)
            if const_expr(self.q_stages == 1):
                load_q(tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            else:
                load_q(src_idx=q_block, dst_idx=q_state.index, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            q_state.advance()
            if const_expr(self.split):
                for n in cutlass.range(kv0, kv1, unroll=1):
                    pipe_k.producer_acquire(kv_state)
                    load_k(src_idx=n, dst_idx=kv_state.index, tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
                    pipe_v.producer_acquire(kv_state)
                    load_v(src_idx=n, dst_idx=kv_state.index, tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
                    kv_state.advance()
            else:
                # masked_kv: the partial last block first (the Q-loop masks it), then 0.. in order. This loop's form
                # moves ptxas's schedule of the MMA warpgroups' KV loop: at d = 64 (192-row tiles) the in-loop index
                # n - 1 + n_kv·[n == 0] left 12 of 66 exponentials ahead of the PV wait (19 unmasked), peeled is 1.0%
                # faster; at d = 128 peeled was 1.2% slower (masked_kv_old_vs_new_2540665.json, docs/FINDINGS.md).
                peel = self.masked_kv and self.tile_m == TILE_M_D64
                n_loop = shape.n_kv
                if const_expr(peel):
                    n_loop = shape.n_kv - 1
                    pipe_k.producer_acquire(kv_state)
                    load_k(src_idx=n_loop, dst_idx=kv_state.index, tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
                    pipe_v.producer_acquire(kv_state)
                    load_v(src_idx=n_loop, dst_idx=kv_state.index, tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
                    kv_state.advance()
                for n in cutlass.range(n_loop, unroll=1):
                    src = n
                    if const_expr(self.masked_kv and not peel):
                        src = n - 1 + shape.n_kv * Int32(n == 0)
                    pipe_k.producer_acquire(kv_state)
                    load_k(src_idx=src, dst_idx=kv_state.index, tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
                    pipe_v.producer_acquire(kv_state)
                    load_v(src_idx=src, dst_idx=kv_state.index, tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
                    kv_state.advance()
        pipe_v.producer_tail(kv_state)

    # ---------------------------------------------------------------- MMA warpgroups: the Q-loop
    def tile_rows(self, shape: WalkShape, m_block, dest):
        """(first q row of tile ``m_block`` in this rank's (b, S, H/P, d) input, rows of its destination slice from
        there on): ranked, counted from rank ``dest``'s slice of S/P rows; else from row 0 of S."""
        if const_expr(self.ranked):
            return ranked_tile_rows(m_block, dest, shape.n_mb_per_rank, shape.rows_per_rank, self.tile_m)
        return m_block * self.tile_m, shape.seq - m_block * self.tile_m

    def next_wg(self, wg):
        """The MMA warpgroup whose GEMMs issue after ``wg``'s (the ping-pong's round robin)."""
        if const_expr(self.num_mma_wg == 2):
            return 1 - wg
        return (wg + 1) % self.num_mma_wg

    @cute.jit
    def pinned_sum(self, softmax: OnlineSoftmax, acc_s) -> Float32:
        """Sum of the first ``pinned_exponentials`` exponentials of this thread (row-major over its rows): whole
        rows through their row sums (free), a partial row element by element."""
        p_mn = layout_utils.reshape_acc_to_mn(acc_s)
        n_rows = cute.size(softmax.row_sum)
        n_cols = cute.size(p_mn, mode=[1])
        total = Float32(0.0)
        for r in cutlass.range_constexpr(n_rows):
            if const_expr(self.pinned_exponentials >= (r + 1) * n_cols):
                total = total + softmax.row_sum[r]
            elif const_expr(self.pinned_exponentials > r * n_cols):
                for c in cutlass.range_constexpr(self.pinned_exponentials - r * n_cols):
                    total = total + p_mn[r, c]
        return total

    @cute.jit
    def overlapped_block(self, softmax: OnlineSoftmax, acc_o, tOrP, tSrQ, tSrK, tOrVt, pending_scale,
                         tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, kv_state, wg, drip=None, block=None,
                         n_groups=None, relay=None, relay_end=None):
        """One KV block n >= 1 of the Q-loop: S = Q Kₙᵀ issued with block n-1's O += P V.
        ``drip`` (store="paced"): on every PACE_KV-th ``block`` (counted from 0) of the first n_groups·PACE_KV,
        also store the next vector of the previous tile's rows from sO. ``relay``: on every RELAY_PACE_KV-th
        ``block`` from RELAY_START_KV below ``relay_end``, the next relay event."""
        other = self.next_wg(wg)
        kv_v = kv_state.clone()
        kv_state.advance()
        pipe_k.consumer_wait(kv_state)
        cute.arch.barrier(barrier_id=NamedBarrierFwd.WarpSchedulerWG1 + wg, number_of_threads=2 * WG_THREADS)
        acc_s = sm90_utils.gemm_zero_init(tiled_mma_qk, (self.tile_m, TILE_N), tSrQ, tSrK, B_idx=kv_state.index,
                                          wg_wait=-1)
        # O times the previous block's factor while this block's QKᵀ runs, before the PV GEMM is issued
        softmax.rescale(acc_o, pending_scale, True)
        pipe_v.consumer_wait(kv_v)
        sm90_utils.gemm_w_idx(tiled_mma_pv, acc_o, tOrP, tOrVt, zero_init=False, B_idx=kv_v.index, wg_wait=-1)
        cute.arch.barrier_arrive(barrier_id=NamedBarrierFwd.WarpSchedulerWG1 + other,
                                 number_of_threads=2 * WG_THREADS)
        if const_expr(drip is not None):
            # one 16 B vector per thread of the previous tile's rows, issued while this block's GEMMs run
            if block < n_groups * PACE_KV:
                if block % PACE_KV == 0:
                    self.store_chunk(drip, block // PACE_KV)
        if const_expr(relay is not None):
            if block >= RELAY_START_KV and block < relay_end:
                if (block - RELAY_START_KV) % RELAY_PACE_KV == 0:
                    self.relay_event((block - RELAY_START_KV) // RELAY_PACE_KV, relay)
        warpgroup.wait_group(1)  # S ready; PV may still run
        row_scale = softmax.update(acc_s, False, RESCALE_THRESHOLD)
        # ptxas sinks the exponentials below the PV wait (they are consumed after it), which takes the softmax
        # off this warpgroup's own PV GEMM. Releasing K under a predicate that reads the pinned exponentials
        # (always true: sums of exp2 are never below zero, and NaN compares false) makes them precede the
        # release, and ptxas keeps the release ahead of the wait.
        total = self.pinned_sum(softmax, acc_s)
        if not (total < Float32(0.0)):
            pipe_k.consumer_release(kv_state)
        warpgroup.wait_group(0)  # PV done: O and P may change
        pipe_v.consumer_release(kv_v)
        pending_scale.store(row_scale.load())
        tOrP.store(layout_utils.reshape_acc_to_frgA(acc_s).load().to(self.dtype))
        return kv_state

    @cute.jit
    def q_loop(self, softmax: OnlineSoftmax, acc_o, tOrP, tSrQ, tSrK, tOrVt, tiled_mma_qk, tiled_mma_pv, pipe_q,
               q_state, pipe_k, pipe_v, kv_state, n_kv, wg, drip=None, n_groups=None, n_pending=None, relay=None,
               n_relay=None, kv_mask=None):
        """The whole Q-loop of one tile (or chunk) with intra-warpgroup overlap and warpgroup ping-pong.

        Block n's S = Q Kₙᵀ is issued together with block n-1's O += P V; softmax of block n runs while the
        PV GEMM drains, and the other warpgroup's GEMMs run under this warpgroup's softmax. store="paced":
        ``drip`` = (the warpgroup's tile store, the previous tile's destination address, heads), whose vectors
        [0, n_groups) go out in the loop and [n_groups, n_pending) after it. relay: ``relay`` (the relay_event
        state), whose events [0, n_relay) run in the loop. ``kv_mask`` (masked_kv): (thread 0's S coordinates,
        the partial KV block's valid columns shifted to thread 0's), applied to the loop's first block: the
        producer loads the partial last block first (softmax is order-free), so the KV loop is the unmasked
        kernel's (a uniform branch in the loop kept 47 of 66 exponentials ahead of the PV wait, not 52, and at
        160 registers it spilled)."""
        other = self.next_wg(wg)
        # first block: S only (ping-ponged too: measured faster than leaving it free, as FA3/FA4 do)
        pipe_k.consumer_wait(kv_state)
        cute.arch.barrier(barrier_id=NamedBarrierFwd.WarpSchedulerWG1 + wg, number_of_threads=2 * WG_THREADS)
        acc_s0 = sm90_utils.gemm_zero_init(tiled_mma_qk, (self.tile_m, TILE_N), tSrQ, tSrK, B_idx=kv_state.index,
                                           wg_wait=-1)
        cute.arch.barrier_arrive(barrier_id=NamedBarrierFwd.WarpSchedulerWG1 + other,
                                 number_of_threads=2 * WG_THREADS)
        warpgroup.wait_group(0)
        pipe_k.consumer_release(kv_state)
        if const_expr(kv_mask is not None):  # the producer loads the partial last KV block first
            self.mask_columns(acc_s0, kv_mask[0], kv_mask[1])
        softmax.update(acc_s0, True)
        tOrP.store(layout_utils.reshape_acc_to_frgA(acc_s0).load().to(self.dtype))
        acc_o.fill(0.0)
        pending_scale = cute.make_fragment_like(softmax.row_max, Float32)  # the rescale not yet applied to O
        pending_scale.fill(1.0)
        if const_expr(drip is not None):
            # store="paced": the previous tile's rows leave sO one vector per thread every PACE_KV blocks
            for i in cutlass.range(n_kv - 1, unroll=1):
                kv_state = self.overlapped_block(softmax, acc_o, tOrP, tSrQ, tSrK, tOrVt, pending_scale,
                                                 tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, kv_state, wg,
                                                 drip, i, n_groups)
            for c in cutlass.range(n_groups, n_pending, unroll=1):  # what the loop had too few blocks for
                self.store_chunk(drip, c)
        elif const_expr(relay is not None):
            # the relay's events under a predicate in the one loop (peeled into a loop of their own, ptxas
            # scheduled the plain loop's softmax worse: 47 of 66 exponentials ahead of the PV wait, not 53)
            relay_end = cutlass.min(Int32(1), n_relay) * (RELAY_START_KV + RELAY_PACE_KV * (n_relay - 1) + 1)
            for i in cutlass.range(n_kv - 1, unroll=1):
                kv_state = self.overlapped_block(softmax, acc_o, tOrP, tSrQ, tSrK, tOrVt, pending_scale,
                                                 tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, kv_state, wg,
                                                 block=i, relay=relay, relay_end=relay_end)
        else:
            for _ in cutlass.range(n_kv - 1, unroll=1):
                kv_state = self.overlapped_block(softmax, acc_o, tOrP, tSrQ, tSrK, tOrVt, pending_scale,
                                                 tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, kv_state, wg)
        softmax.rescale(acc_o, pending_scale, True)
        # Q is no longer read: let the producer load the next tile's Q under the last PV and the epilogue.
        pipe_q.consumer_release(q_state)
        # last block's PV
        pipe_v.consumer_wait(kv_state)
        sm90_utils.gemm_w_idx(tiled_mma_pv, acc_o, tOrP, tOrVt, zero_init=False, B_idx=kv_state.index, wg_wait=0)
        pipe_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    @cute.jit
    def mask_columns(self, acc_s, coords_mn, valid):
        """S entries of columns >= ``valid`` (of this KV block) to -inf, so they take no softmax mass (TMA
        zero-filled their K rows: unmasked they would score 0). ``coords_mn``: thread 0's S coordinates (compile-
        time constants), ``valid`` shifted by this thread's column offset from thread 0's (one register, not 64
        coordinates held across the Q-loop: at 160 registers those spilled)."""
        s_mn = layout_utils.reshape_acc_to_mn(acc_s)
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                if coords_mn[r, c][1] >= valid:
                    s_mn[r, c] = -Float32.inf

    def store_chunk(self, drip, c):
        """store="paced": vector ``c`` of this thread's share of the previous tile's staged rows to its
        destination rows, ``drip`` = (tile store, destination address, heads of the (b, S/P, H, d) buffer)."""
        tile_store, addr, heads = drip
        tile_store.chunk(addr, cute.assume(heads * self.head_dim, divby=self.head_dim), c)

    # ---------------------------------------------------------------- MMA warpgroups: the walk
    @cute.jit
    def mma(self, mO, dst_ptrs, protocol: FlagProtocol, spans, smem, tiled_mma_qk, tiled_mma_pv, pipes, scale_log2,
            shape: WalkShape, tidx, split_args, relay_shadows=None, s_relay=None, mLSE=None):
        """The two MMA warpgroups: per unit of the walk its Q-loop, then the epilogue of the warpgroup's 64 rows;
        at the end the paced store's last tile, the relay's remainder and the flags. ``split_args`` = (workspace,
        counters, k) of the split tail (None each otherwise)."""
        d = self.head_dim
        sQ, sK, sV, sO = smem
        pipe_q, pipe_k, pipe_v = pipes
        world, h_loc, n_kv = shape.world, shape.h_loc, shape.n_kv
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        wg_layout = cute.make_layout(self.num_mma_wg, stride=WG_THREADS)
        wg_mma_qk = tiled_mma_qk.get_slice(wg_layout(wg))
        wg_mma_pv = tiled_mma_pv.get_slice(wg_layout(wg))
        _, tSrQ, tSrK = sm90_utils.partition_fragment_ABC(wg_mma_qk, (self.tile_m, TILE_N, d), sQ, sK)
        sVt = layout_utils.transpose_view(sV)
        acc_o, tOrP, tOrVt = sm90_utils.partition_fragment_ABC(wg_mma_pv, (self.tile_m, d, TILE_N), None, sVt)
        # Epilogue: registers -> sO (stmatrix) -> 128-bit stores by this warpgroup's 128 threads.
        st_atom = copy_utils.get_smem_store_atom(self.dtype)
        thr_st = cute.make_tiled_copy_C(st_atom, tiled_mma_pv).get_slice(tidx)
        tOsO = thr_st.partition_D(sO)
        tile_store = WarpgroupTileStore.create(self.dtype, cute.local_tile(sO, (64, d), (wg, 0)), d, 64, WG_THREADS,
                                               tidx % WG_THREADS)
        heads = h_loc * world
        e_next = protocol.epoch[0] + 1
        bar_id = NamedBarrierFwd.Epilogue + wg  # this warpgroup's epilogue barrier
        paced = self.store == "paced"
        chunks = tile_store.chunks  # 16 B vectors per thread in a warpgroup's 64 rows
        if const_expr(paced):
            pend = Int32(0)  # the previous tile's rows wait in sO for their stores (store="paced")
            pend_addr = Int64(0)  # their destination
        if wg == 0:  # the first warpgroup issues first
            cute.arch.barrier_arrive(barrier_id=NamedBarrierFwd.WarpSchedulerWG1, number_of_threads=2 * WG_THREADS)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
        sched, order = self.walk_policies(shape, split_args[2])
        kv_mask = None
        if const_expr(self.masked_kv):  # S coordinates, and the last KV block's valid columns (see mask_columns)
            kv_len = shape.seq
            if const_expr(self.separate_kv):
                kv_len = shape.kv_len
            c_s = cute.make_identity_tensor((self.tile_m, TILE_N))
            coords0 = layout_utils.reshape_acc_to_mn(tiled_mma_qk.get_slice(0).partition_C(c_s))
            coords = layout_utils.reshape_acc_to_mn(tiled_mma_qk.get_slice(tidx).partition_C(c_s))
            kv_mask = (coords0, kv_len - (n_kv - 1) * TILE_N - (coords[0, 0][1] - coords0[0, 0][1]))
        if const_expr(self.relay):
            relay = self.relay_state(dst_ptrs, relay_shadows, s_relay, shape, tidx)
            r_steps = relay[1]
            r_done = Int32(0)  # 1 once this CTA's share is out (in its first unit's Q-loop and right after it)
        for u in cutlass.range(sched.initial(), sched.end, sched.stride, unroll=1):
            t = u
            n_this = n_kv
            if const_expr(self.split):
                t, kv0, kv1, chunk, split = sched.work(u)
                n_this = kv1 - kv0
            m_block, h, bb, dest = order.coords(t)
            softmax = OnlineSoftmax.create(scale_log2, cute.size(layout_utils.reshape_acc_to_mn(acc_o), mode=[0]))
            pipe_q.consumer_wait(q_state)
            tSrQ_u = tSrQ  # this unit's Q stage
            if const_expr(self.q_stages > 1):
                tSrQ_u = tSrQ[None, None, None, q_state.index]
            if const_expr(paced):
                n_groups = cutlass.min(Int32(chunks), (n_kv - 1) // PACE_KV) * pend  # vectors sent in the loop
                kv_state = self.q_loop(softmax, acc_o, tOrP, tSrQ_u, tSrK, tOrVt, tiled_mma_qk, tiled_mma_pv, pipe_q,
                                       q_state, pipe_k, pipe_v, kv_state, n_kv, wg, (tile_store, pend_addr, heads),
                                       n_groups, pend * chunks)
            elif const_expr(self.relay):
                n_relay = relay_events_in_loop(n_this, r_steps, RELAY_START_KV) * (1 - cutlass.min(Int32(1), r_done))
                kv_state = self.q_loop(softmax, acc_o, tOrP, tSrQ_u, tSrK, tOrVt, tiled_mma_qk, tiled_mma_pv, pipe_q,
                                       q_state, pipe_k, pipe_v, kv_state, n_this, wg, relay=relay, n_relay=n_relay)
            else:
                kv_state = self.q_loop(softmax, acc_o, tOrP, tSrQ_u, tSrK, tOrVt, tiled_mma_qk, tiled_mma_pv, pipe_q,
                                       q_state, pipe_k, pipe_v, kv_state, n_this, wg, kv_mask=kv_mask)
            q_state.advance()
            if const_expr(self.relay):
                if r_done == 0:  # what the first Q-loop had too few blocks for
                    for n in cutlass.range(n_relay, r_steps + 1, unroll=1):
                        self.relay_event(n, relay)
                    r_done = Int32(1)
            store_tile = 1  # split tail: whether this unit stores its tile (a whole tile, or the last chunk)
            if const_expr(self.split):
                store_tile = self.tail_partial(acc_o, softmax, split_args[:2], t - sched.full, chunk, split,
                                               sched.split_k, wg, tidx, sO)
            elif const_expr(self.lse):
                inv, row_lse = softmax.finalize_with_lse()
                softmax.rescale(acc_o, inv)
            else:
                softmax.rescale(acc_o, softmax.finalize())
            if store_tile != 0:  # a Python 1 (static) unless split
                base, row_stride = self.epilogue(acc_o, (st_atom, thr_st, tOsO, tile_store), mO, dst_ptrs, spans,
                                                 (t, m_block, h, bb, dest), wg, bar_id, tidx, shape, heads)
                if const_expr(paced):
                    pend_addr = base.toint()
                    pend = Int32(1)
                if const_expr(self.lse):
                    self.store_lse(mLSE, row_lse, tiled_mma_pv, tidx, m_block, h, bb)

        if const_expr(self.relay):
            if r_done == 0:  # a CTA without a unit in the tail walk: its whole share now
                for n in cutlass.range(r_steps + 1, unroll=1):
                    self.relay_event(n, relay)
        if const_expr(paced):
            if pend != 0:  # the CTA's last tile (local in the fused order's last round): all of it now
                for c in cutlass.range_constexpr(chunks):
                    self.store_chunk((tile_store, pend_addr, heads), c)
        if const_expr(self.publish):
            cute.arch.barrier(barrier_id=NamedBarrierFwd.Done, number_of_threads=self.done_threads)
            if const_expr(self.walk == "tail"):
                cute.arch.griddepcontrol_wait()  # the rounds kernel is complete, its stores performed
            publish_done(protocol.flag_ptrs, protocol.counter, protocol.epoch, shape.rank, world, e_next,
                         Int32(shape.grid), Int32(shape.bidx), tidx)

    @cute.jit
    def store_lse(self, mLSE, row_lse, tiled_mma_pv, tidx, m_block, h, bb):
        """lse=True: each quad's first thread writes its rows' log-sum-exp to mLSE[b, h, row] (the rows found
        from the accumulator's own layout, as for O)."""
        c_o = cute.make_identity_tensor((self.tile_m, self.head_dim))
        rows = layout_utils.reshape_acc_to_mn(tiled_mma_pv.get_slice(tidx).partition_C(c_o))
        if tidx % 4 == 0:
            for r in cutlass.range_constexpr(cute.size(row_lse)):
                row = m_block * self.tile_m + rows[r, 0][0]
                if const_expr(self.masked_q):
                    if row < cute.size(mLSE, mode=[2]):
                        mLSE[bb, h, row] = row_lse[r]
                else:
                    mLSE[bb, h, row] = row_lse[r]

    @cute.jit
    def epilogue(self, acc_o, staging, mO, dst_ptrs, spans, tile, wg, bar_id, tidx, shape: WalkShape, heads):
        """This warpgroup's 64 rows of tile ``t``: registers -> sO (stmatrix) -> the destination (this rank's
        output, or rank ``dest``'s symmetric buffer), in one burst unless store="paced" (then the rows wait in sO
        and the next tile's Q-loop sends them). ``staging`` = (stmatrix atom, its thread slice, this thread's sO
        view, the tile store); ``tile`` = (index, row block, local head, batch, destination rank); ``heads``: H, the
        destination buffer's heads. Returns the
        destination (pointer, row stride)."""
        d = self.head_dim
        st_atom, thr_st, tOsO, tile_store = staging
        t, m_block, h, bb, dest = tile
        bidx, rank, h_loc, n_mb_per_rank = shape.bidx, shape.rank, shape.h_loc, shape.n_mb_per_rank
        r_o = cute.make_fragment_like(acc_o, self.dtype)
        r_o.store(acc_o.load().to(self.dtype))
        if const_expr(self.ready_on):
            # The ready gate: on this CTA's first tile, the flag warp that waited for every receiver's ready flag
            # also arrives on this barrier (await_all_ready; the barrier's first use in the kernel, so its count
            # is 160 there and 128 after), so no store goes out before the announcements. No wait, poll or
            # acquire in the loop for later tiles.
            gate = Int32(WG_THREADS) + Int32(32) * Int32(t == Int32(bidx))
            if const_expr(self.instrument):
                gt_gate = cute.arch.globaltimer()
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=gate)  # sO rows free again
            if const_expr(self.instrument):
                if t == Int32(bidx):
                    if tidx == 0:  # first warpgroup, first tile: when it reached the gate and passed it
                        spans[shape.n_tiles * self.num_mma_wg + bidx, 2] = gt_gate
                        spans[shape.n_tiles * self.num_mma_wg + bidx, 3] = cute.arch.globaltimer()
        else:
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=WG_THREADS)  # sO rows free again
        cute.copy(st_atom, thr_st.retile(r_o), tOsO)
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=WG_THREADS)
        if const_expr(self.store == "st"):
            tile_store.load_staged()
        q_row0, rows_left = self.tile_rows(shape, m_block, dest)
        if const_expr(self.mode == "local"):
            row0 = q_row0 + wg * 64
            base = mO.iterator + cute.assume(((Int64(bb) * shape.seq + row0) * h_loc + h) * d, divby=self.vec)
            row_stride = cute.assume(h_loc * d, divby=d)
        else:
            # Destination row from block counts, not from S/P: holding S/P live across the mainloop (a division
            # ptxas keeps in a register) changed its schedule (61 of 66 exponentials ahead of the PV wait instead
            # of local's 51; tests/test_flash_attention.py checks they now agree).
            rows_per_rank = shape.rows_per_rank if const_expr(self.ranked) else n_mb_per_rank * self.tile_m
            drow = (m_block - dest * n_mb_per_rank) * self.tile_m + wg * 64
            peer = cute.make_ptr(self.dtype, dst_ptrs[dest], cute.AddressSpace.gmem, assumed_align=16)
            base = peer + cute.assume(((Int64(bb) * rows_per_rank + drow) * heads + rank * h_loc + h) * d,
                                      divby=self.vec)
            row_stride = cute.assume(heads * d, divby=d)
        gt0, ck0 = timers.now()
        if const_expr(self.store == "st"):
            if const_expr(self.masked_q):  # the last tile's rows past S (or past its rank slice) stay unwritten
                tile_store.burst_rows(base, row_stride, rows_left - wg * 64)
            else:
                tile_store.burst(base, row_stride)
            if const_expr(self.mode == "completion_coupled"):
                cute.arch.fence_acq_rel_sys()  # returns once this thread's stores are performed remotely
        if const_expr(self.instrument):
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=WG_THREADS)
            if tidx % WG_THREADS == 0:
                timers.close_span(spans, t * self.num_mma_wg + wg, gt0, ck0)  # one row per (tile, warpgroup)
        return base, row_stride
