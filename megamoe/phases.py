"""The MegaMoE kernel's phases around its expert GEMMs (``megamoe.kernel``): Count, the cross-rank barrier,
Dispatch (bf16 rows, or FP8 rows quantized on the way with 1 x 128 scales), and the final Combine. A mixin of
``MegaMoEForward``: they read its shape attributes (hidden, top_k, num_local_experts, fp8)."""
from __future__ import annotations

import enum

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from cute_kernels import flags as fl
from megamoe.schedule import BLOCK_M
from megamoe.trial import close_trial

NUM_THREADS = 384
WG_THREADS = 128
# rows of the peer pointer table: every rank's address of each symmetric buffer
PEER_KINDS = ("pool", "pool_src", "pool_w", "combine", "counts", "barrier", "pool_scale")
ERR_BAD_EXPERT = 5
fl.ERROR_NAMES.setdefault(ERR_BAD_EXPERT, "an expert id is out of range (valid: 0 <= id < num_experts, or -1)")
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4  # scale = max(amax, floor) / 448: megamoe.reference's recipe (DeepGEMM's floor)
DISPATCH_BATCH = 8  # 16 B vectors per lane in flight in Dispatch's row copies (and its FP8 runs per half-warp)
DISPATCH_FANOUT = 8  # a token's destinations per read of its row (top_k above it reads the row again)


SCALE_PAIR = 2 * BLOCK_M  # fp32 scales a stage brings: units 2i, 2i + 1 of a 128-row block (the buffers' row)


def scale_units(hidden: int, intermediate: int) -> int:
    """Scale slots per row of both activation scale buffers: the pool's H/128 runs and the intermediate's I/64
    share one layout (``scale_index``); even, so a stage's pair of units (units 2i, 2i + 1 of a 128-row block) is
    one 1 KiB TMA box."""
    units = max(hidden // 128, intermediate // 64)
    return units + units % 2


def scale_index(row, unit, units: int):
    """Where the activation scale of pool or intermediate ``row`` for K unit ``unit`` (of ``units`` =
    ``scale_units`` slots per row) lives: per 128-row block, unit-major inside it. Dispatch and the L1 epilogue
    store there; the producer's TMA takes units 2i and 2i + 1 of a block, 1 KiB, with a stage (megamoe.kernel)."""
    return (row // BLOCK_M) * (units * BLOCK_M) + unit * BLOCK_M + row % BLOCK_M


class NamedBarrierMoE(enum.IntEnum):
    """Named barriers (0 is __syncthreads). Staging pairs: MMA warpgroup w and its store warp (128 + 32)."""
    MmaGroups = 1  # both MMA warpgroups: the end of the walk and the combine
    StagingFull = 2  # 2, 3: warpgroup w's rows are staged (it arrives, its store warp syncs)
    StagingFree = 4  # 4, 5: the store warp has read them out (it arrives, warpgroup w syncs before restaging)
    StoresDone = 6  # the store warps' last stores are complete (they arrive, the MMA warpgroups sync before B3)
    DequantFull = 7  # W4A8: both MMA warpgroups converted their halves of a stage's B block (megamoe.w4a8_dequant)


class DispatchCombineMixin:
    @staticmethod
    def peer(peer_ptrs, kind: str, j, world, dtype, align):
        """Rank ``j``'s address of symmetric buffer ``kind`` (the table is PEER_KINDS x world)."""
        return cute.make_ptr(dtype, peer_ptrs[PEER_KINDS.index(kind) * world + j], cute.AddressSpace.gmem,
                             assumed_align=align)

    @cute.jit
    def count(self, mIdx, counts, tok_slot, l1_done, peer_ptrs, errors, parity, world, tidx, bidx, grid):
        """Zero this launch's local counters and the other parity's counts; take a slot per routed (t, k)."""
        E = self.num_local_experts
        k = self.top_k
        gtid = bidx * NUM_THREADS + tidx
        gstride = grid * NUM_THREADS
        for i in cutlass.range(gtid, Int32(cute.size(l1_done)), gstride, unroll=1):
            l1_done[i] = Int32(0)
        for i in cutlass.range(gtid, E, gstride, unroll=1):
            counts[(1 - parity) * E + i] = Int32(0)
        num_tokens = Int32(cute.size(mIdx, mode=[0]))
        for q in cutlass.range(gtid, num_tokens * k, gstride, unroll=1):
            e = mIdx[q // k, q % k]
            if e >= 0 and e < world * E:
                owner = e // E
                cnt = self.peer(peer_ptrs, "counts", owner, world, Int32, 4)
                tok_slot[q] = cute.arch.atomic_add((cnt + (parity * E + e - owner * E)).llvm_ptr, Int32(1),
                                                   sem="relaxed", scope="sys")
            elif e != -1:
                fl.record_error(errors, Int32(ERR_BAD_EXPERT), bidx, e)

    @cute.jit
    def cross_rank_barrier(self, barrier, peer_ptrs, target: Int64, world, errors, timeout_ns, tidx, bidx,
                           barrier_id: cutlass.Constexpr = None, num_threads: cutlass.Constexpr = NUM_THREADS,
                           stamp: cutlass.Constexpr = None, arrive_stamp: cutlass.Constexpr = None):
        """The CTA's threads taking part (all of them, or ``num_threads`` on named barrier ``barrier_id``): their
        stores so far are performed at system scope before any rank passes. Thread 0 fences (cumulative after
        the CTA barrier), adds one arrival on every rank's monotone counter and waits (bounded) for this
        launch's ``target`` on its own. Instrumented: ``stamp`` = (records, index) takes the release time,
        ``arrive_stamp`` the CTA's arrival (its threads' work before the barrier done)."""
        self.sync(barrier_id, num_threads)
        if tidx == 0:
            if const_expr(arrive_stamp is not None):
                arrive_stamp[0][arrive_stamp[1]] = cute.arch.globaltimer()
            cute.arch.fence_acq_rel_sys()
            for j in cutlass.range(world, unroll=1):
                ptr = self.peer(peer_ptrs, "barrier", j, world, Int64, 8)
                cute.arch.red(ptr.llvm_ptr, Int64(1), op="add", dtype="u64", sem="release", scope="sys")
            fl.wait_geq(barrier, Int32(0), target, timeout_ns, errors, Int32(fl.ERR_GRID_BARRIER_TIMEOUT), bidx,
                        "sys", 0, True)
            if const_expr(stamp is not None):  # (records, index): when every rank's arrivals were seen
                stamp[0][stamp[1]] = cute.arch.globaltimer()
        self.sync(barrier_id, num_threads)

    @staticmethod
    def sync(barrier_id, num_threads):
        if const_expr(barrier_id is None):
            cute.arch.sync_threads()
        else:
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)

    @cute.jit
    def dispatch(self, mX, mIdx, mWgt, tok_slot, peer_ptrs, s_owner, s_row_off, s_ntok, parity, rank, world,
                 max_tokens, tidx, bidx, grid):
        """Every owner's expert row offsets into shared memory, then one warp per token pushes its row (W8A8:
        quantized once) into the pool rows of its top_k experts' owners, with each row's source slot and
        router weight."""
        E = self.num_local_experts
        k = self.top_k
        H = self.hidden
        for i in cutlass.range(tidx, world * E, NUM_THREADS, unroll=1):
            owner = i // E
            cnt = self.peer(peer_ptrs, "counts", owner, world, Int32, 4)
            s_owner[i] = cute.arch.load((cnt + (parity * E + i - owner * E)).llvm_ptr, Int32, sem="relaxed",
                                        scope="sys")
        cute.arch.sync_threads()
        # per owner, one thread turns counts into exclusive row offsets (rows of BLOCK_M): E adds, a few us
        for owner in cutlass.range(tidx, world, NUM_THREADS, unroll=1):
            run = Int32(0)
            for e in cutlass.range(E, unroll=1):
                n = s_owner[owner * E + e]
                if owner == rank:
                    s_ntok[e] = n
                    s_row_off[e] = run
                s_owner[owner * E + e] = run
                run = run + (n + BLOCK_M - 1) // BLOCK_M
            if owner == rank:
                s_row_off[E] = run
        cute.arch.sync_threads()
        lane = tidx % 32
        gwarp = bidx * (NUM_THREADS // 32) + tidx // 32
        gwarps = grid * (NUM_THREADS // 32)
        num_tokens = Int32(cute.size(mIdx, mode=[0]))
        elem = 1 if const_expr(self.fp8) else 2  # bytes per pool element
        fan = min(k, DISPATCH_FANOUT)
        # one warp per token: its row read (W8A8: quantized) once per DISPATCH_FANOUT destinations, not once per
        # routed (t, k); a token row is read top_k times otherwise (8x its bytes at top-8)
        for t in cutlass.range(gwarp, num_tokens, gwarps, unroll=1):
            src = mX.iterator + cute.assume(Int64(t) * H, divby=8)
            for g0 in cutlass.range_constexpr(0, k, fan):
                n_dst = min(fan, k - g0)
                dst = cute.make_rmem_tensor(cute.make_layout(n_dst), Int64)  # pool row addresses; 0: not routed
                dst_scale = cute.make_rmem_tensor(cute.make_layout(n_dst), Int64)  # W8A8: the row's scales
                for j in cutlass.range_constexpr(n_dst):
                    q = t * k + g0 + j
                    e = mIdx[t, g0 + j]
                    dst[j] = Int64(0)
                    dst_scale[j] = Int64(0)
                    if e >= 0 and e < world * E:
                        owner = e // E
                        row = s_owner[e] * BLOCK_M + tok_slot[q]
                        dst[j] = (peer_ptrs[PEER_KINDS.index("pool") * world + owner]
                                  + Int64(row) * (H * elem))
                        if const_expr(self.fp8):
                            # run r's scale r * BLOCK_M floats on (scale_index)
                            dst_scale[j] = (peer_ptrs[PEER_KINDS.index("pool_scale") * world + owner]
                                            + Int64(scale_index(row, 0, scale_units(H, self.intermediate))) * 4)
                        if lane == 0:
                            ps = self.peer(peer_ptrs, "pool_src", owner, world, Int32, 4)
                            pw = self.peer(peer_ptrs, "pool_w", owner, world, Float32, 4)
                            cute.arch.store((ps + row).llvm_ptr, Int32(rank * max_tokens * k + q))
                            cute.arch.store((pw + row).llvm_ptr, Float32(mWgt[t, g0 + j]))
                if const_expr(self.fp8):
                    self.push_row_fp8(src, dst, dst_scale, lane)
                else:
                    self.push_row_bf16(src, dst, lane)

    @cute.jit
    def push_row_bf16(self, src, dst, lane):
        """One warp: the bf16 token row at ``src`` into each pool row address of ``dst`` (0: none). A batch of
        vectors per lane is loaded before any is stored: 4 KB of the row in flight (one load at a time left the
        copy latency-bound, well under the HBM rate)."""
        H = self.hidden
        vec = 8  # bf16 per 128-bit access
        copy_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        frags = cute.make_rmem_tensor(cute.make_layout((vec, DISPATCH_BATCH)), self.dtype)
        for b in cutlass.range(0, H // vec, 32 * DISPATCH_BATCH, unroll=1):
            for i in cutlass.range_constexpr(DISPATCH_BATCH):
                v = b + i * 32 + lane
                if v < H // vec:
                    off = cute.assume(v * vec, divby=vec)
                    cute.copy(copy_atom, cute.make_tensor(src + off, cute.make_layout(vec)), frags[None, i])
            for j in cutlass.range_constexpr(cute.size(dst)):
                if dst[j] != 0:
                    row = cute.make_ptr(self.dtype, dst[j], cute.AddressSpace.gmem, assumed_align=16)
                    for i in cutlass.range_constexpr(DISPATCH_BATCH):
                        v = b + i * 32 + lane
                        if v < H // vec:
                            off = cute.assume(v * vec, divby=vec)
                            cute.copy(copy_atom, frags[None, i], cute.make_tensor(row + off, cute.make_layout(vec)))

    @cute.jit
    def push_row_fp8(self, src, dst, dst_scale, lane):
        """One warp: the bf16 token row at ``src`` quantized in 1 x 128 runs (megamoe.reference's recipe:
        scale = max(amax, 1e-4) / 448, q = x * (1 / scale)) into each FP8 pool row address of ``dst`` (0: none)
        and its scales at ``dst_scale`` (run r's at ``r * BLOCK_M`` floats on). Each half-warp takes one run per
        step (16 lanes x 8 elements), its amax
        by shuffles within the half."""
        H = self.hidden
        runs = H // 128
        half, sub = lane % 16, lane // 16
        ld = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        st = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.ab_dtype, num_bits_per_copy=64)
        steps = (runs + 1) // 2  # the odd count's last step: both halves take the last run, one stores
        x8 = cute.make_rmem_tensor(cute.make_layout((8, DISPATCH_BATCH)), self.dtype)
        q = cute.make_rmem_tensor(cute.make_layout(8), Float32)
        q8 = cute.make_rmem_tensor(cute.make_layout(8), self.ab_dtype)
        for b in cutlass.range(0, steps, DISPATCH_BATCH, unroll=1):
            for i in cutlass.range_constexpr(DISPATCH_BATCH):  # the batch's loads first, all in flight
                if b + i < steps:
                    col = cutlass.min(2 * (b + i) + sub, Int32(runs - 1)) * 128 + half * 8
                    cute.copy(ld, cute.make_tensor(src + cute.assume(col, divby=8), cute.make_layout(8)),
                              x8[None, i])
            for i in cutlass.range_constexpr(DISPATCH_BATCH):
                if b + i < steps:  # warp-uniform: the shuffles below see every lane
                    run = cutlass.min(2 * (b + i) + sub, Int32(runs - 1))
                    col = run * 128 + half * 8
                    q.store(x8[None, i].load().to(Float32))
                    amax = Float32(0.0)
                    for j in cutlass.range_constexpr(8):
                        amax = cute.arch.fmax(amax, cutlass.max(q[j], -q[j]))
                    for off in cutlass.range_constexpr(4):  # xor 8, 4, 2, 1: within the half-warp
                        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, 8 >> off))
                    scale = cute.arch.fmax(amax, Float32(AMAX_FLOOR)) / Float32(FP8_MAX)
                    inv = Float32(1.0) / scale
                    for j in cutlass.range_constexpr(8):
                        q[j] = cutlass.min(cutlass.max(q[j] * inv, Float32(-FP8_MAX)), Float32(FP8_MAX))
                    q8.store(q.load().to(self.ab_dtype))
                    if 2 * (b + i) + sub < runs:
                        for d in cutlass.range_constexpr(cute.size(dst)):
                            if dst[d] != 0:
                                row = cute.make_ptr(self.ab_dtype, dst[d], cute.AddressSpace.gmem, assumed_align=16)
                                cute.copy(st, q8, cute.make_tensor(row + cute.assume(col, divby=8),
                                                                   cute.make_layout(8)))
                                if half == 0:
                                    sc = cute.make_ptr(Float32, dst_scale[d], cute.AddressSpace.gmem, assumed_align=4)
                                    cute.arch.store((sc + run * BLOCK_M).llvm_ptr, scale)

    # ---------------------------------------------------------------- phase 4: combine
    @cute.jit
    def finish(self, mIdx, mY, mComb, barrier, peer_ptrs, epoch, done, errors, target, e_launch, world,
               timeout_ns, tidx, bidx, grid, trial_args, stamps: cutlass.Constexpr = None):
        """The MMA warpgroups after their walk: barrier B3 over every rank, then y = sum_k combine rows (one warp
        per token), then the last CTA advances the epoch and closes the launch's auto trial (``trial_args``: the
        slot, the order run, the prior, the mode; megamoe.trial.close_trial). ``stamps`` (instrument): (records,
        index of B3's phase stamp; the next is the end of this CTA's sums)."""
        self.cross_rank_barrier(barrier, peer_ptrs, target, world, errors, timeout_ns, tidx, bidx,
                                NamedBarrierMoE.MmaGroups, 2 * WG_THREADS, stamps)
        k = self.top_k
        H = self.hidden
        vec = 8
        lane = tidx % 32
        gwarp = bidx * 8 + tidx // 32
        num_tokens = Int32(cute.size(mIdx, mode=[0]))
        copy_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        # u vectors per lane at a time, each with its k rows' loads in flight before the sum (about 16 loads)
        u = max(1, min(4, 16 // k))
        frags = cute.make_rmem_tensor(cute.make_layout((vec, k, u)), self.dtype)
        total = cute.make_rmem_tensor(cute.make_layout(vec), Float32)
        out = cute.make_rmem_tensor(cute.make_layout(vec), self.dtype)
        routed = cute.make_rmem_tensor(cute.make_layout(k), Int32)
        for t in cutlass.range(gwarp, num_tokens, grid * 8, unroll=1):
            for j in cutlass.range_constexpr(k):
                routed[j] = mIdx[t, j]
            for b in cutlass.range(0, H // vec, 32 * u, unroll=1):
                for i in cutlass.range_constexpr(u):
                    v = b + i * 32 + lane
                    for j in cutlass.range_constexpr(k):
                        if v < H // vec and routed[j] >= 0:
                            src = mComb.iterator + cute.assume((Int64(t) * k + j) * H + v * vec, divby=vec)
                            cute.copy(copy_atom, cute.make_tensor(src, cute.make_layout(vec)), frags[None, j, i])
                for i in cutlass.range_constexpr(u):
                    v = b + i * 32 + lane
                    if v < H // vec:
                        total.fill(0.0)
                        for j in cutlass.range_constexpr(k):
                            if routed[j] >= 0:
                                total.store(total.load() + frags[None, j, i].load().to(Float32))
                        out.store(total.load().to(self.dtype))
                        dst = mY.iterator + cute.assume(Int64(t) * H + v * vec, divby=vec)
                        cute.copy(copy_atom, out, cute.make_tensor(dst, cute.make_layout(vec)))
        if const_expr(stamps is not None):
            if tidx == 0:  # thread 0's own sums done (before the barrier: a read after it could run early)
                stamps[0][stamps[1] + 1] = cute.arch.globaltimer()
        cute.arch.barrier(barrier_id=NamedBarrierMoE.MmaGroups, number_of_threads=2 * WG_THREADS)
        if tidx == 0:
            arrived = cute.arch.atomic_add(fl.elem_ptr(done, 0), Int32(1), sem="relaxed", scope="gpu")
            if arrived == grid - 1:
                epoch[0] = e_launch + 1
                done[0] = Int32(0)
                close_trial(*trial_args)
