"""FlashAttentionA2AForward: a persistent Hopper FlashAttention forward (non-causal, bf16/fp16, d = 64 or
128) whose epilogue either writes O locally or piggybacks the Ulysses post-attention All-to-All.

CTA = 3 warpgroups. Warpgroup 0 is the producer (one warp issues the TMA loads of Q and of the K/V
pipeline); warpgroups 1 and 2 are the MMA warpgroups, 64 query rows each: S = Q Kᵀ with WGMMA from shared
memory, online softmax in registers, O += P V with P from registers. The grid is persistent: CTA c walks
tiles c, c + grid, ... of ``tile_order``.

Epilogue (compile-time ``mode``), per MMA warpgroup, on its own 64-row half of the output tile:
- ``local``: O to this rank's (b, S, H/P, d) tensor;
- ``piggyback``: the same 128-bit stores, into the destination rank's symmetric (b, S/P, H, d) buffer
  (flash_a2a.mapping), then straight on to the next tile's Q-loop: no communication warp, no wait;
- ``completion_coupled``: as piggyback, but the warpgroup waits for its stores to be performed at system
  scope (fence.acq_rel.sys) before going on: the paper's counterfactual (eq. 17).
Each warpgroup owns its 64-row half and stores it without waiting for the other (ping-pong already
offsets the two), so a tile boundary is two 16 KiB bursts per SM rather than one 32 KiB burst. Every
tile costs the same, so the persistent CTAs' boundaries stay aligned round after round: each round boundary
sends ~66 remote tiles (2.1 MiB at P = 2) at once, above Q(66) = 1.46 MiB, and every burst then has a whole
Q-loop (≥ 100 µs ≫ G* = 11 µs) to drain in. What NVLink adds to the residual (fused − the self-store
control) is per round boundary on H200: 3.6-10 µs at M = 8K/16K; store="paced" (the stores spread over the
next Q-loop) removes it, but its Q-loop code costs the mainloop more (see ``store``).

Tile order (flash_a2a.mapping.tile_coords): the destination rank varies fastest, then the row block within
that rank, then the head, then the batch, so concurrently running tiles spread their bursts over every link
and a wave's remote share is (P-1)/P of it, and neighbouring CTAs share a head (K/V stay hot in L2); the
last round of the persistent walk holds local tiles only, because a remote burst issued there has no
compute left to drain under.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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
from quack.cute_dsl_utils import ParamsBase

from cute_kernels.flags import nanosleep
from flash_a2a.epoch import announce_ready, await_all_ready, await_ready_here, publish_done, publish_peers_done
from flash_a2a.mapping import (RELAY_PACE_KV, RELAY_START_KV, RELAY_THREADS, early_done_arrival,  # the kernel's
                              relay_advance, relay_cursor, relay_events_in_loop, relay_offset, relay_share,
                              tile_coords,  # walks,
                              tile_halves, tail_split_units, unit_work)  # shared with the host

MODES = ("local", "piggyback", "completion_coupled")
STORES = ("st", "bulk", "tma", "paced")
O_PAD = 8  # elements of padding per row of the "bulk" output buffer: a 272 B pitch keeps stmatrix conflict-free
TILE_M = 128
TILE_N = 128
WG_THREADS = 128
EPILOGUE_BARRIER = 1  # named barriers 1, 2: one per MMA warpgroup (0 is __syncthreads)
SCHEDULER_BARRIER = 4  # 4, 5: warpgroup ping-pong on GEMM issue
SIGNALS = (True, False, "nofence", "done", "done_nofence", "gate_only")
READY_WAITS = ("warp", "warp_acquire", "epilogue")
WALKS = ("all", "rounds", "tail")
DONE_BARRIER = 6  # fused modes: the MMA warpgroups' last stores and the announcing warp, before publish_done
DONE_THREADS = (TILE_M // 64) * WG_THREADS + 32
EARLY_BARRIER = 7  # early_done: the MMA warpgroups' last stores to peers and the publishing warp
TAIL_BARRIER = 3  # tail_split: both MMA warpgroups around a split unit's partial and its arrival count
PARTIAL_FLOATS = 68  # tail_split: per thread, 64 unnormalized O values, then its two rows' max and sum


@cute.jit
def row_max_ilp(s_mn: cute.Tensor, r: cutlass.Constexpr[int]) -> Float32:
    """Max of row ``r`` with four independent fmax chains (a single chain is latency-bound)."""
    n = cute.size(s_mn, mode=[1])
    m0, m1, m2, m3 = s_mn[r, 0], s_mn[r, 1], s_mn[r, 2], s_mn[r, 3]
    for c in cutlass.range_constexpr(4, n, 4):
        m0 = cute.arch.fmax(m0, s_mn[r, c])
        m1 = cute.arch.fmax(m1, s_mn[r, c + 1])
        m2 = cute.arch.fmax(m2, s_mn[r, c + 2])
        m3 = cute.arch.fmax(m3, s_mn[r, c + 3])
    return cute.arch.fmax(cute.arch.fmax(m0, m1), cute.arch.fmax(m2, m3))


@cute.jit
def scale_rows(o_mn: cute.Tensor, row_scale: cute.Tensor):
    """Row r of O (an (M, N) view of the accumulator) times row_scale[r]."""
    for r in cutlass.range_constexpr(cute.size(row_scale)):
        o_mn[r, None].store(o_mn[r, None].load() * row_scale[r])


@dataclass
class OnlineSoftmax(ParamsBase):
    """Row max / row sum of one MMA warpgroup's rows, each row spread over a quad of threads. A ParamsBase
    dataclass so it can be carried through the DSL's run-time loops."""

    scale_log2: Float32
    row_max: cute.Tensor
    row_sum: cute.Tensor

    @staticmethod
    def create(scale_log2, num_rows: int) -> "OnlineSoftmax":
        return OnlineSoftmax(scale_log2, cute.make_rmem_tensor(num_rows, Float32),
                             cute.make_rmem_tensor(num_rows, Float32))

    @cute.jit
    def update(self, acc_s: cute.Tensor, is_first: cutlass.Constexpr[bool],
               threshold: cutlass.Constexpr[float] = 0.0) -> cute.Tensor:
        """Exponentiate S in place (P = exp2(S·scale − max·scale)); return each row's rescale factor.
        ``threshold`` > 0: keep the row's max unless the new one exceeds it by more than that (log2 units), so
        P stays below 2^threshold and most blocks rescale nothing (factor exactly 1)."""
        s_mn = layout_utils.reshape_acc_to_mn(acc_s)
        row_scale = cute.make_fragment_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            row = s_mn[r, None].load()
            cur = row_max_ilp(s_mn, r)
            if const_expr(not is_first):
                cur = cute.arch.fmax(cur, self.row_max[r])
            cur = cute.arch.warp_reduction_max(cur, threads_in_group=4)
            if const_expr(threshold > 0.0 and not is_first):
                if (cur - self.row_max[r]) * self.scale_log2 <= Float32(threshold):
                    cur = self.row_max[r]
            cur_scaled = cur * self.scale_log2
            p = cute.math.exp2(row * self.scale_log2 - cur_scaled, fastmath=True)
            if const_expr(is_first):
                row_scale[r] = Float32(1.0)
                self.row_sum[r] = p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            else:
                row_scale[r] = cute.math.exp2((self.row_max[r] - cur) * self.scale_log2, fastmath=True)
                self.row_sum[r] = p.reduce(cute.ReductionOp.ADD, self.row_sum[r] * row_scale[r], 0)
            self.row_max[r] = cur
            s_mn[r, None].store(p)
        return row_scale

    @cute.jit
    def finalize(self) -> cute.Tensor:
        """1 / row sum (quad-reduced), the factor that normalizes O."""
        inv = cute.make_fragment_like(self.row_sum, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            inv[r] = cute.arch.rcp_approx(total)
        return inv

    @cute.jit
    def rescale(self, acc_o: cute.Tensor, row_scale: cute.Tensor, skip_unit: cutlass.Constexpr[bool] = False):
        """O *= each row's factor. ``skip_unit``: a warp none of whose rows changed its max (every factor
        exactly 1, the rescale threshold) skips the multiplies (a warp-uniform branch)."""
        o_mn = layout_utils.reshape_acc_to_mn(acc_o)
        if const_expr(skip_unit):
            changed = row_scale[0] != Float32(1.0)
            for r in cutlass.range_constexpr(1, cute.size(row_scale)):
                changed = changed | (row_scale[r] != Float32(1.0))
            if cute.arch.vote_any_sync(changed):
                scale_rows(o_mn, row_scale)
        else:
            scale_rows(o_mn, row_scale)


class FlashAttentionA2AForward:
    def __init__(self, dtype=cutlass.BFloat16, head_dim: int = 128, mode: str = "local", num_stages: int = 2,
                 instrument: bool = False, overlap: bool = True, lag_v: bool = False,
                 sync_first_block: bool = True, pin_softmax: bool | int | str = 40,
                 p_first: bool = False, rescale_before_pv: bool = True, store: str = "st", signal: bool | str = True,
                 n_dst: int = 1, ready_poll_ns: int = 0, pace_kv: int = 1, ready_delay_ns: int = 0,
                 cross_halves: bool = False, ready_wait: str = "warp", early_done: bool | str = False,
                 peel_drip: bool = False, q_stages: int = 1, smem_pad_kib: int = 0, try_wait: bool = False,
                 tail_split: bool = False, walk: str = "all", turn_destinations: bool = False,
                 remote_first: bool = False,
                 cluster_kv: int = 1, tile_n: int = TILE_N, rescale_threshold: float = 8.0, relay: bool = False,
                 relay_start: int = RELAY_START_KV, relay_wait: bool = True, store_cache: str = "wb"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if head_dim not in (64, 128):
            raise ValueError(f"head_dim must be 64 or 128, got {head_dim}")
        if dtype not in (cutlass.BFloat16, cutlass.Float16):
            raise ValueError("dtype must be BFloat16 or Float16")
        if store not in STORES:
            raise ValueError(f"store must be one of {STORES}, got {store!r}")
        # store: how a warpgroup's 64 output rows leave shared memory. "st": its 128 threads load them back and
        # issue 128-bit stores (the LSU carries them to HBM or NVLink); "bulk": 64 of its threads each hand one
        # row to the TMA engine (cp.async.bulk, 256 B per row), which streams it out while the warpgroup goes
        # on; the row buffer is then unswizzled and padded (conflict-free stmatrix, contiguous rows); "tma":
        # one thread issues a TMA tensor store of the whole 64-row half from the swizzled buffer (FA3/FA4's
        # epilogue), through one tensor map per destination (``n_dst`` of them: 1 local, P fused), so no
        # register holds output data once the store is issued; "paced" (piggyback, overlapped mainloop; the
        # API's store="auto" takes it with pace_kv=2 in short kernels, mapping.paced_store_pays): the rows wait
        # in sO and leave as "st" does, one 16 B vector per thread every ``pace_kv`` KV blocks of the
        # warpgroup's next tile, issued under its GEMMs, the rest (and the CTA's last tile) at the next
        # epilogue, so a tile boundary injects 2 KiB per warpgroup per KV block instead of a 16 KiB burst. On
        # 2 x H200 that removes what NVLink adds to the fused residual (fused - self-store control: 0.2-0.4 µs
        # against 3.6-10 µs at M = 8K/16K), but the Q-loop's code moves ptxas's schedule and costs the mainloop
        # a share of its time (2-3% at pin 34, fused_paced_ccab14f.json; 0.4-0.9% with pace_kv=2 at pin 40,
        # fused_paced_all_7c35388.json), more than it saves in long kernels. Halving the burst at the boundary
        # instead (half the vectors under the next tile's first GEMM, Q-loop untouched) left the NVLink part
        # as it was and moved the schedule all the same (fused_paced_split_405a9d8.json).
        self.store = store
        # store_cache (a measured knob, store="st" only): the output stores' cache operator. "wb" (the default,
        # plain st.global); "cs" (st.global.cs, streaming: evict-first in L2), so the output lines, which this
        # kernel never reads again, leave L2 before the K/V blocks that later tiles read.
        if store_cache not in ("wb", "cs"):
            raise ValueError(f"store_cache must be 'wb' or 'cs', got {store_cache!r}")
        if store_cache == "cs" and store != "st":
            raise ValueError("store_cache='cs' sets the cache operator of the 'st' epilogue's stores: use store='st'")
        self.store_cache = store_cache
        if store == "paced" and (mode != "piggyback" or not overlap):
            raise ValueError("store='paced' spreads a tile's stores over the next tile's overlapped Q-loop: "
                             "use it with mode='piggyback' and overlap=True")
        if not (isinstance(pace_kv, int) and 1 <= pace_kv <= 8):
            raise ValueError(f"pace_kv must be an int in 1..8 (KV blocks per stored vector), got {pace_kv!r}")
        self.pace_kv = pace_kv
        # peel_drip (store="paced"): run the KV blocks that carry a vector of the previous tile in a loop of
        # their own before the plain overlapped loop, instead of predicating a store inside the one loop
        # (whose code moved ptxas's schedule of the whole mainloop).
        if peel_drip and store != "paced":
            raise ValueError("peel_drip=True peels the paced stores' KV blocks: use it with store='paced'")
        self.peel_drip = bool(peel_drip)
        # q_stages: Q buffers in shared memory. 1: the next tile's Q loads once both MMA warpgroups are done
        # with this tile's last QKᵀ, so a warpgroup that finishes its epilogue first may wait for it at the tile
        # boundary; 2: the producer loads the next tile's Q a tile ahead (192 KiB + 32 KiB of shared memory,
        # so only with the "st"/"paced" epilogues' unpadded sO, not the crossed walk's two 64-row Q loads).
        if q_stages not in (1, 2):
            raise ValueError(f"q_stages must be 1 or 2, got {q_stages!r}")
        if q_stages == 2 and (store not in ("st", "paced") or cross_halves):
            raise ValueError("q_stages=2 needs store='st' or 'paced' and cross_halves=False (shared memory and "
                             "the 128-row Q load)")
        self.q_stages = q_stages
        # smem_pad_kib (a benchmark control): unused shared memory added to the CTA's, which moves the SM's
        # shared-memory/L1 split (192 KiB of buffers take the 196 KB carveout, 60 KB of L1 left; past ~195 KiB
        # the 228 KB one, 28 KB of L1), to tell what a larger footprint costs apart from what fills it.
        if not (isinstance(smem_pad_kib, int) and 0 <= smem_pad_kib <= 32):
            raise ValueError(f"smem_pad_kib must be an int in 0..32, got {smem_pad_kib!r}")
        self.smem_pad_kib = smem_pad_kib
        # try_wait (a mainloop-order knob): each K/V wait of the Q-loop first probes the stage's barrier
        # (mbarrier.try_wait, FA4's consumer_try_wait token) and only then blocks, as FA4's SM90 loop does.
        self.try_wait = bool(try_wait)
        # tail_split: the tiles of the persistent walk's last, partly empty round are split into k
        # KV chunks (flash_a2a.mapping.tail_split_units / unit_work; k at run time, out_ptrs[n_dst + 2]), so
        # the CTAs that would idle through that round take a share. Each chunk leaves its unnormalized O and
        # its rows' max and sum in a float32 workspace (out_ptrs[n_dst]); the CTA whose arrival on the tile's
        # counter (out_ptrs[n_dst + 1]) is the k-th combines them and stores the tile, then resets the counter.
        # No CTA waits for another. In the fused walk the last round holds local tiles only (and the host
        # splits nothing when the tiles fit in one round, so every CTA's first unit, the ready gate's, is whole).
        if tail_split not in (True, False):
            raise ValueError(f"tail_split must be True or False here, got {tail_split!r} (the API resolves 'auto')")
        if tail_split and (store != "st" or cross_halves or early_done or instrument or q_stages != 1
                           or not overlap or head_dim != 128):
            raise ValueError("tail_split=True is built for head_dim=128, store='st', the overlapped mainloop, "
                             "q_stages=1 and no cross_halves/early_done/instrument")
        self.tail_split = bool(tail_split)
        # walk: which part of the persistent walk this launch takes. "all": every tile. The split tail in a
        # second launch (tail_split="launch" in the API) is two kernels: "rounds", the whole rounds only
        # (tiles [0, n_tiles // grid * grid), the default kernel's code otherwise, so its KV loop keeps the
        # default's schedule; it lets its dependent launch early, griddepcontrol.launch_dependents), then
        # "tail" (tail_split=True), the last round's KV chunks only, launched with programmatic dependent launch
        # so its CTAs take the SMs as the rounds' CTAs exit. Fused: "rounds" runs the ready gate and sends
        # every peer tile but raises no flag; "tail" (signal="done": its tiles are all local, no gate) waits
        # for the rounds kernel's completion (griddepcontrol.wait, its stores performed) and then raises every
        # flag and advances the epoch, so the last remote round drains under the tail's compute.
        if walk not in WALKS:
            raise ValueError(f"walk must be one of {WALKS}, got {walk!r}")
        if walk == "rounds" and tail_split:
            raise ValueError("walk='rounds' takes the whole rounds, unsplit: use tail_split=False with it")
        if walk == "tail" and not tail_split:
            raise ValueError("walk='tail' takes the split last round: use tail_split=True with it")
        if walk == "tail" and mode != "local" and signal not in ("done", "done_nofence", False):
            raise ValueError("walk='tail' stores local tiles only and runs no ready gate: use signal='done'")
        if walk != "all" and (early_done or instrument):
            raise ValueError("walk='rounds'/'tail' (the split tail's two launches) take no early_done/instrument")
        self.walk = walk
        # relay (fused tail launch; the API's relay="auto", mapping.relay_pays): the rounds kernel has stored its
        # peer tiles into a local shadow of each peer's buffer (out_ptrs of the rounds launch point there), and
        # this kernel's MMA threads copy them on to the peers (shadow addresses at out_ptrs[n_dst + 3 + j]), one
        # 16 B vector each every RELAY_PACE_KV KV blocks of their first chunk's Q-loop (mapping.relay_share,
        # relay_slot), before the flags it raises. A one-round rounds kernel has no next tile to pace its peer
        # tiles under; this way the burst goes to local HBM and the NVLink stores drip under the tail's compute.
        # What an event costs the chunk's Q-loop is what decides (3 heads/8K on 2 x H200, fused - FA-only with
        # 32 adjacent pairs, flash_a2a_variants/fused_relay_*.json): with two divisions per address, +7.3-7.5 µs
        # against the burst's +6.3-7.0, its self-store control +7.2-7.4 (the burst's +2.1): NVLink's part gone,
        # the event's code in its place; a division-free cursor (mapping.relay_advance), +3.7 against +7.0,
        # self-store +3.7 against +2.1.
        if relay not in (True, False):
            raise ValueError(f"relay must be True or False, got {relay!r}")
        if relay and (walk != "tail" or mode != "piggyback" or n_dst < 2):
            raise ValueError("relay=True copies the rounds kernel's peer tiles on from the fused tail launch: use it "
                             "with walk='tail', mode='piggyback' and n_dst >= 2")
        self.relay = bool(relay)
        # relay_start: the KV block of the chunk's Q-loop at which the first relay event (its grid-dependency wait
        # and first load) runs; a measured knob.
        if not (isinstance(relay_start, int) and 1 <= relay_start <= 64):
            raise ValueError(f"relay_start must be an int in 1..64 (KV blocks), got {relay_start!r}")
        self.relay_start = relay_start
        # relay_wait=False (a benchmark control, never for real output: the shadow may not be written yet): the
        # relay without its grid-dependency wait, to price that wait.
        self.relay_wait = bool(relay_wait)
        # cross_halves: the "crossed" tile walk (flash_a2a.mapping.tile_halves): the two MMA warpgroups of a tile
        # take 64-row blocks of different ranks' slices (Q comes in two 64-row TMA loads), so a tile sends at
        # most half of itself to a peer, and the remote tiles are spread evenly over the rounds before the
        # local tail. Its stores are the "st"/"paced" ones (the TMA-store epilogues address a 128-row tile).
        if cross_halves and store not in ("st", "paced"):
            raise ValueError("cross_halves=True works with store='st' or 'paced' (the TMA-store epilogues "
                             "write whole 128-row tiles): use one of those")
        self.cross_halves = bool(cross_halves)
        # turn_destinations (a measured alternative): the walk's first stretch turns each CTA's destination
        # rank by one per round (flash_a2a.mapping.tile_coords), so every CTA takes its share of the remote
        # bursts instead of, at an even grid, the same CTAs taking all of them. It did not change the fused
        # residual on H200 (fa_turn_c0c3b00.json). Either walk covers every tile once, the same bits.
        self.turn_destinations = bool(turn_destinations)
        # remote_first (a measured alternative): the walk sends every remote tile before any local one
        # (mapping.tile_coords), so the links idle in the kernel's last (1/P) instead of carrying a trickle of
        # stores all kernel long. At the H200's power cap the fused kernel loses SM clock to its NVLink stores;
        # this walk did not win it back (+18 to +236 µs over the default, fused_clocks_remote_first_d8a07f6.json),
        # so it is off. Whole tiles only: not with the crossed walk or the relay's shadows.
        if remote_first and (cross_halves or relay or turn_destinations or cluster_kv > 1):
            raise ValueError("remote_first orders whole tiles by destination: use it without cross_halves, "
                             "relay, turn_destinations and cluster_kv=2")
        self.remote_first = bool(remote_first)
        # cluster_kv: CTAs per cluster sharing each K/V block (FA3's cluster for d >= 128 non-causal; FA4's SM90
        # port has none). At 2 each CTA of a pair loads half of every K and V block and the TMA engine multicasts
        # it into both CTAs' shared memory, so L2 serves each block once per pair: half the L2->SM traffic of
        # the KV loop. The pair runs in lockstep (a stage is refilled once both CTAs released it), so the walk
        # must give CTAs 2c and 2c+1 tiles of one (head, batch) at every step and the same count
        # (mapping.cluster_walk_pairs; the host checks it); the grid is even. Measured on H200 it is 0.8-1.8%
        # slower than the default at every unsplit shape (flash_a2a_variants/fa_cluster_ec15b51.json; its KV
        # loop keeps 46 of 66 exponentials ahead of the PV wait, and other pins are slower still), so it is off.
        if cluster_kv not in (1, 2):
            raise ValueError(f"cluster_kv must be 1 or 2, got {cluster_kv!r}")
        if cluster_kv > 1 and (tail_split or cross_halves or walk == "tail" or not overlap):
            raise ValueError("cluster_kv=2 pairs whole tiles of one head: use it with the overlapped mainloop and "
                             "no tail_split/cross_halves (the split tail launch runs unclustered)")
        self.cluster_kv = cluster_kv
        # tile_n: KV rows per block (a measured alternative; FA3 takes 176 at d = 128 non-causal, FA4's SM90 port
        # 128). 160 is the largest that fits two K/V stages beside Q and sO (224 KiB); the sequence length must
        # then be a multiple of it (no masked block). Measured on H200: 6-9% slower than the default
        # (flash_a2a_variants/fa_t160_92638e2.json), so it is off.
        if tile_n not in (TILE_N, 160):
            raise ValueError(f"tile_n must be {TILE_N} or 160, got {tile_n!r}")
        if tile_n != TILE_N and (head_dim != 128 or store != "st" or q_stages != 1 or smem_pad_kib
                                 or not overlap):
            raise ValueError("tile_n=160 is built for head_dim=128, store='st', q_stages=1, no smem_pad_kib and the "
                             "overlapped mainloop")
        self.tile_n = tile_n
        # rescale_threshold (FA4's SM100 trick; 8.0, the default since ea6408f): a row keeps its running max
        # unless a block raises it by more than this many powers of two, so P < 2^threshold and in most blocks
        # no row of a warp changes: its 64 O-rescale multiplies are skipped. 0: the max follows every block.
        # 8.0 measured 2.5-3.2% faster than 0 on H200 at 3/12 heads, 16K/32K (flash_a2a_variants/
        # fa_th_8b972ce.json); the full run at ea6408f (flash_a2a_run_ea6408f.json) has it ahead of FA4 at every shape.
        if not (isinstance(rescale_threshold, (int, float)) and 0.0 <= rescale_threshold <= 16.0):
            raise ValueError(f"rescale_threshold must be a number in [0, 16], got {rescale_threshold!r}")
        self.rescale_threshold = float(rescale_threshold) if overlap else 0.0  # the plain loop rescales each block
        if mode == "local" and n_dst != 1:
            raise ValueError("the local kernel has one destination (n_dst=1)")
        if n_dst < 1:
            raise ValueError(f"n_dst must be >= 1, got {n_dst}")
        self.n_dst = n_dst
        # signal (fused modes): True runs the whole flag protocol. The other values are benchmark controls that
        # price its parts (the output is never announced, or announced without the ordering guarantee): False,
        # no protocol; "nofence", all but the completion fence; "done", the completion flags without the ready
        # wait; "done_nofence", neither the ready wait nor the fence; "gate_only", the ready gate's barrier
        # arrival without the wait before it. Every value but False advances the epoch and adds the data
        # flags, so the receivers' waits stay consistent across columns.
        if signal not in SIGNALS:
            raise ValueError(f"signal must be one of {SIGNALS}, got {signal!r}")
        self.signal = signal
        fused = mode != "local"
        self.flags_on = fused and signal is not False  # epoch advance and data flags
        self.publish = self.flags_on and walk != "rounds"  # "rounds": the tail launch raises the flags
        self.ready_on = fused and signal in (True, "nofence", "gate_only")
        self.ready_poll = signal != "gate_only"
        # ready_poll_ns: back-off between the ready-flag polls of the waiting warp (0: a tight loop).
        if not (isinstance(ready_poll_ns, int) and 0 <= ready_poll_ns <= 1_000_000):
            raise ValueError(f"ready_poll_ns must be an int in 0..1000000, got {ready_poll_ns!r}")
        self.ready_poll_ns = ready_poll_ns
        # ready_delay_ns (a benchmark control): the waiting warp announces, then idles this long before its
        # first poll, so the poll finds the flag already set (the first remote store is a Q-loop away).
        if not (isinstance(ready_delay_ns, int) and 0 <= ready_delay_ns <= 10_000_000):
            raise ValueError(f"ready_delay_ns must be an int in 0..10000000, got {ready_delay_ns!r}")
        self.ready_delay_ns = ready_delay_ns
        # ready_wait (where the ready wait runs; the same guarantee): "warp" (the default), an idle warp of the
        # producer warpgroup polls with relaxed system-scope loads from the kernel's start, then one acquire
        # fence, and arrives on the storing warpgroups' gate; "warp_acquire", the same with an acquire load per
        # poll (an L1 invalidation each, CCTL.IVALL): measured ~0.6% slower over the whole kernel at every
        # shape on H200, the ready wait's whole cost (flash_a2a_variants/fused_ready_wait_a8f9d40.json);
        # "epilogue", no waiting warp: thread 0 of each storing warpgroup waits (acquire) before its first
        # tile's stores, its epilogue barrier ordering the others after it (as slow as "warp_acquire").
        if ready_wait not in READY_WAITS:
            raise ValueError(f"ready_wait must be one of {READY_WAITS}, got {ready_wait!r}")
        self.ready_wait = ready_wait
        self.done_fence = fused and signal in (True, "done", "gate_only")
        # early_done (fused, store="st"; a measured alternative, off by default): a CTA whose last tile is in
        # the walk's local tail has sent all its peer data once its last tile before the tail is stored
        # (mapping.early_done_tile); the idle warp then fences at system scope and raises the peers' data flags
        # under the tail tile's compute, and the kernel's last path keeps a GPU-scope fence and this rank's own
        # flag. Same mainloop SASS, bit-exact on H200, but slower: fused - FA-only +5.3/+11.5/+14.0/+15.8 µs
        # against +5.3/+9.8/+12.6/+3.9 with every flag at the end (3 heads/rank 8K, 16K; 12 heads 8K, 16K;
        # 48 adjacent pairs each, flash_a2a_variants/fused_early_89dce51.json), and the same without NVLink
        # (self-store: +1.5/+2.7/+2.4/+10.1 against +2.0/+1.7/+1.6/+0.6): the system fence (MEMBAR.SYS +
        # CCTL.IVALL) under a running Q-loop costs that Q-loop more than the last path saves. True is that
        # placement ("pre_tail"); "last_epilogue" waits until the CTA's final (tail) tile has left its Q-loop:
        # the idle warp fences and raises the peers' flags while the warpgroups run that tile's epilogue, so
        # the fence overlaps no Q-loop. Slower still (fused_early_0eeed06.json: +6.6/+14.9/+16.2/+31.1 µs
        # against the default's +4.9/+9.7/+11.8/+6.0; self-store +3.2/+7.8/+6.4/+27.9 against
        # +1.8/+2.2/+1.5/+2.0): a system fence is cheapest where nothing else runs, at the end. Never with the
        # paced/bulk/tma epilogues (their stores are still in flight after the epilogue) or the crossed walk
        # (the extra epilogue test moved ptxas's mainloop schedule there to 61 of 66).
        if early_done is True:
            early_done = "pre_tail"
        if early_done not in (False, "pre_tail", "last_epilogue"):
            raise ValueError(f"early_done must be False, True ('pre_tail') or 'last_epilogue', got {early_done!r}")
        on = self.flags_on and store == "st" and not cross_halves
        self.early_done = early_done if on else False
        self.dtype, self.head_dim, self.mode, self.num_stages = dtype, head_dim, mode, num_stages
        self.instrument = instrument
        # overlap: issue block n's QKᵀ with block n-1's PV inside a warpgroup, and ping-pong GEMM issue between
        # the two MMA warpgroups so one's softmax runs under the other's GEMMs (as FA3 does).
        self.overlap = overlap
        # lag_v: producer order K[n+1] before V[n] (the overlapped consumer's order, as FA3/FA4 load; only with
        # overlap). sync_first_block: also ping-pong the first (S-only) GEMM of a tile (FA3/FA4 leave it free).
        # The defaults (K[n], V[n] paired; first GEMM ping-ponged) measured 0.5-1% faster on H200 at M = 8K
        # side by side (benchmarks/results/h200x2/flash_a2a_run_48d1e66.json, column fa_ours_lag_v).
        self.lag_v = lag_v and overlap
        self.sync_first_block = sync_first_block
        # pin_softmax: keep exponentials ahead of the PV wait in the SASS (see q_loop_overlapped). An int n pins
        # the first n of the 2 x 32 a thread computes per KV block (row-major); True pins all 64, "first_row"
        # the first 32 (3-6% faster than unpinned on H200, all 64 3% slower; the default until rescale_threshold).
        # 40, the default: with rescale_threshold=8, 0.7-1.1% faster than "first_row" in FA-only, and the
        # fused kernel's residual over FA-only falls from ~1.5% of T_FA to 0.15-1.7%
        # (flash_a2a_variants/fa_thtune_7167ecc.json, fa_thp40_b40d52b.json: 3/12 heads, 16K/32K); in the full
        # run as the default (7a73b1b, flash_a2a_run_7a73b1b.json) E_res at most 1.91% of T_FA at every M >= 16K.
        # (identity checks: True == 1 and False == 0, so a dict or `in` lookup would read pin_softmax=1 as True)
        if pin_softmax is True or pin_softmax is False:
            pin_count = tile_n // 2 if pin_softmax else 0
        elif pin_softmax == "first_row":
            pin_count = tile_n // 4  # a thread holds tile_n / 4 columns of each of its two rows
        elif isinstance(pin_softmax, int) and 0 < pin_softmax <= tile_n // 2:
            pin_count = pin_softmax
        else:
            raise ValueError(f"pin_softmax must be False, True, 'first_row' or an int in 1..{tile_n // 2}, "
                             f"got {pin_softmax!r}")
        self.pin_count = pin_count if overlap else 0
        self.pin_softmax = self.pin_count > 0
        # p_first: after the PV wait convert P before rescaling O (FA4's order). rescale_before_pv: rescale O by
        # the previous block's factor while this block's QKᵀ runs, before the PV GEMM is issued (FA4 does this
        # only for head_dim > 128); on by default: with first_row another 0.1-2.6% on H200.
        # p_first gives the same SASS as the default. Mainloop-order knobs, overlapped mainloop only.
        self.p_first = p_first
        self.rescale_before_pv = rescale_before_pv and overlap
        self.num_mma_wg = TILE_M // 64
        self.num_threads = WG_THREADS * (self.num_mma_wg + 1)
        self.vec = 128 // dtype.width  # elements per 128-bit store

    # ---------------------------------------------------------------- host
    def fake_args(self):
        d = self.head_dim
        b, s, h = cute.sym_int64(), cute.sym_int64(divisibility=TILE_M), cute.sym_int64()

        def qkv():
            return make_fake_tensor(self.dtype, (b, s, h, d), stride=(cute.sym_int64(divisibility=self.vec),
                                                                       cute.sym_int64(divisibility=self.vec),
                                                                       cute.sym_int64(divisibility=self.vec), 1),
                                    assumed_align=16)

        i64 = make_fake_tensor(Int64, (cute.sym_int64(),), stride=(1,), assumed_align=8)
        i64b = make_fake_tensor(Int64, (cute.sym_int64(),), stride=(1,), assumed_align=8)
        flags, epoch = (make_fake_tensor(Int64, (cute.sym_int64(),), stride=(1,), assumed_align=8) for _ in range(2))
        counter, errors = (make_fake_tensor(Int32, (cute.sym_int64(),), stride=(1,), assumed_align=4) for _ in range(2))
        spans = make_fake_tensor(Int64, (cute.sym_int64(), 4), stride=(4, 1), assumed_align=16)

        def dst():  # a destination (b, rows, heads, d): the local output, or one rank's post-A2A buffer
            return make_fake_tensor(self.dtype, (cute.sym_int64(), cute.sym_int64(divisibility=64), cute.sym_int64(),
                                                 d),
                                    stride=(cute.sym_int64(divisibility=self.vec), cute.sym_int64(divisibility=self.vec),
                                            cute.sym_int64(divisibility=self.vec), 1), assumed_align=16)

        dsts = tuple(dst() for _ in range(self.n_dst))
        return (qkv(), qkv(), qkv(), qkv(), i64, i64b, flags, epoch, counter, errors, spans, dsts,
                Float32(1.0), Int32(0), Int32(1), Int32(1), Int64(1))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 out_ptrs: cute.Tensor, flag_ptrs: cute.Tensor, flags: cute.Tensor, epoch: cute.Tensor,
                 counter: cute.Tensor, errors: cute.Tensor, spans: cute.Tensor, dsts: tuple, softmax_scale: Float32,
                 rank: Int32, world: Int32, grid: Int32, timeout_ns: Int64, stream: cuda.CUstream):
        d = self.head_dim
        # (b, s, h, d) -> (s, d, h, b): TMA tiles over (rows, head dim) of one (head, batch).
        sel = [1, 3, 2, 0]
        mQt, mKt, mVt = [layout_utils.select(t, sel) for t in (mQ, mK, mV)]
        tiled_mma_qk = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.num_mma_wg, 1, 1), tiler_mn=(64, self.tile_n))
        tiled_mma_pv = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32,
            atom_layout_mnk=(self.num_mma_wg, 1, 1), tiler_mn=(64, d), a_source=warpgroup.OperandSource.RMEM)
        if const_expr(self.q_stages > 1):
            sQ_layout = sm90_utils.make_smem_layout(self.dtype, LayoutEnum.ROW_MAJOR, (TILE_M, d), self.q_stages)
            sQ_one = cute.select(sQ_layout, mode=[0, 1])
        else:
            sQ_layout = sm90_utils.make_smem_layout(self.dtype, LayoutEnum.ROW_MAJOR, (TILE_M, d))
            sQ_one = sQ_layout
        sK_layout = sm90_utils.make_smem_layout(self.dtype, LayoutEnum.ROW_MAJOR, (self.tile_n, d), self.num_stages)
        sV_layout = sm90_utils.make_smem_layout(self.dtype, LayoutEnum.ROW_MAJOR, (self.tile_n, d), self.num_stages)
        if const_expr(self.store == "bulk"):
            sO_layout = cute.make_layout((TILE_M, d), stride=(d + O_PAD, 1))
        else:
            sO_layout = sm90_utils.make_smem_layout(self.dtype, LayoutEnum.ROW_MAJOR, (TILE_M, d))
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        if const_expr(self.cross_halves):  # two 64-row loads per tile, one per warpgroup's row block
            tma_q, gQ_tma = cpasync.make_tiled_tma_atom(
                load_op, mQt, sm90_utils.make_smem_layout(self.dtype, LayoutEnum.ROW_MAJOR, (64, d)), (64, d))
        else:
            tma_q, gQ_tma = cpasync.make_tiled_tma_atom(load_op, mQt, sQ_one, (TILE_M, d))
        kv_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.cluster_kv > 1) else load_op
        tma_k, gK_tma = cpasync.make_tiled_tma_atom(kv_op, mKt, cute.select(sK_layout, mode=[0, 1]),
                                                    (self.tile_n, d), self.cluster_kv)
        tma_v, gV_tma = cpasync.make_tiled_tma_atom(kv_op, mVt, cute.select(sV_layout, mode=[0, 1]),
                                                    (self.tile_n, d), self.cluster_kv)
        tma_os, gO_tmas = None, None
        if const_expr(self.store == "tma"):
            sO_half = sm90_utils.make_smem_layout(self.dtype, LayoutEnum.ROW_MAJOR, (64, d))
            made = [cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), layout_utils.select(t, sel),
                                                sO_half, (64, d)) for t in dsts]
            tma_os, gO_tmas = tuple(m[0] for m in made), tuple(m[1] for m in made)
        tx_q = cute.size_in_bytes(self.dtype, sQ_one)
        tx_kv = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[Int64, 2 * self.q_stages]
            mbar_k: cute.struct.MemRange[Int64, 2 * self.num_stages]
            mbar_v: cute.struct.MemRange[Int64, 2 * self.num_stages]
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

        if const_expr(self.smem_pad_kib > 0):
            @cute.struct
            class PaddedStorage:
                main: SharedStorage
                pad: cute.struct.Align[cute.struct.MemRange[cutlass.Int8, self.smem_pad_kib * 1024], 1024]

            Storage = PaddedStorage
        else:
            Storage = SharedStorage

        scale_log2 = softmax_scale * Float32(math.log2(math.e))
        self.kernel(gQ_tma, gK_tma, gV_tma, mO, out_ptrs, flag_ptrs, flags, epoch, counter, errors, spans,
                    tma_os, gO_tmas, tma_q, tma_k, tma_v, sQ_layout, sK_layout, sV_layout, sO_layout, tiled_mma_qk,
                    tiled_mma_pv, tx_q, tx_kv, scale_log2, rank, world, timeout_ns, Storage).launch(
            grid=(grid, 1, 1), block=(self.num_threads, 1, 1), stream=stream, min_blocks_per_mp=1,
            use_pdl=self.walk == "tail", **({"cluster": [self.cluster_kv, 1, 1]} if self.cluster_kv > 1 else {}))

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               out_ptrs: cute.Tensor, flag_ptrs: cute.Tensor, flags: cute.Tensor, epoch: cute.Tensor,
               counter: cute.Tensor, errors: cute.Tensor, spans: cute.Tensor, tma_os, gO_tmas,
               tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sO_layout, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               tx_q: cutlass.Constexpr, tx_kv: cutlass.Constexpr, scale_log2: Float32, rank: Int32,
               world: Int32, timeout_ns: Int64, SharedStorage: cutlass.Constexpr):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)
        if const_expr(self.walk == "rounds"):
            cute.arch.griddepcontrol_launch_dependents()  # the tail launch's CTAs may take SMs as these exit

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        if const_expr(self.smem_pad_kib > 0):
            storage = storage.main
        s_relay = None
        if const_expr(self.relay):
            s_relay = storage.relay_ptrs.get_tensor(cute.make_layout(2 * self.n_dst))
            storage = storage.main
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        mma_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_wg * 4)
        pipe_q = pipeline.PipelineTmaAsync.create(barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.q_stages,
                                                  producer_group=one_thread, consumer_group=mma_warps,
                                                  tx_count=tx_q, defer_sync=True)
        # cluster_kv: a K/V stage is refilled (into both CTAs) once every MMA warp of the pair released it: lane c
        # of each warp arrives on CTA c's empty barrier
        kv_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_wg * 4 * self.cluster_kv)
        kv_cluster = cute.make_layout((1, self.cluster_kv, 1, 1)) if const_expr(self.cluster_kv > 1) else None
        pipe_k = pipeline.PipelineTmaAsync.create(barrier_storage=storage.mbar_k.data_ptr(),
                                                  num_stages=self.num_stages, producer_group=one_thread,
                                                  consumer_group=kv_warps, tx_count=tx_kv,
                                                  cta_layout_vmnk=kv_cluster, defer_sync=True)
        pipe_v = pipeline.PipelineTmaAsync.create(barrier_storage=storage.mbar_v.data_ptr(),
                                                  num_stages=self.num_stages, producer_group=one_thread,
                                                  consumer_group=kv_warps, tx_count=tx_kv,
                                                  cta_layout_vmnk=kv_cluster, defer_sync=True)
        cluster_mn = cute.make_layout((self.cluster_kv, 1)) if const_expr(self.cluster_kv > 1) else None
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_mn, is_relaxed=True)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        if const_expr(self.store == "bulk"):
            sO = storage.sO.get_tensor(sO_layout)
        else:
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        pipeline.pipeline_init_wait(cluster_shape_mn=cluster_mn)

        seq = Int32(cute.size(mQ, mode=[0]))
        h_loc = Int32(cute.size(mQ, mode=[2]))
        batch = Int32(cute.size(mQ, mode=[3]))
        n_kv = seq // self.tile_n
        rows_per_rank = seq // world
        n_mb_per_rank = rows_per_rank // TILE_M
        n_tiles = n_mb_per_rank * world * h_loc * batch
        tail_k = None
        if const_expr(self.tail_split):
            tail_k = Int32(out_ptrs[self.n_dst + 2])  # the chunk count of the last round's tiles

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(24)
            if const_expr(self.flags_on):
                if warp_idx == 1:  # idle otherwise: system-scope fences and flag polls cost no MMA time here
                    if const_expr(self.ready_on):
                        t_start = cute.arch.globaltimer()
                        e_next = epoch[0] + 1
                        announce_ready(flag_ptrs, rank, world, e_next, tidx % 32, bidx)
                        if const_expr(self.ready_delay_ns > 0):
                            while cute.arch.globaltimer() - t_start < Int64(self.ready_delay_ns):
                                nanosleep(1000)
                        if const_expr(self.ready_wait != "epilogue"):
                            await_all_ready(flags, world, e_next, timeout_ns, errors, tidx % 32, bidx,
                                            [EPILOGUE_BARRIER + wg for wg in range(self.num_mma_wg)],
                                            WG_THREADS + 32, self.ready_poll, self.ready_poll_ns, self.n_dst,
                                            self.ready_wait == "warp")
                        if const_expr(self.instrument):
                            if tidx % 32 == 0:  # the CTA's ready row, after the per-tile rows
                                row = n_tiles * self.num_mma_wg + bidx
                                spans[row, 0] = t_start
                                spans[row, 1] = cute.arch.globaltimer()
                    if const_expr(self.early_done):
                        early, tile = early_done_arrival(bidx, grid, n_tiles, world,
                                                         self.early_done == "last_epilogue")
                        if early != 0:
                            if tile >= 0:  # the MMA warpgroups arrive at that tile (early_done_arrival)
                                cute.arch.barrier(barrier_id=EARLY_BARRIER, number_of_threads=DONE_THREADS)
                            publish_peers_done(flag_ptrs, rank, world, grid, bidx, tidx % 32, self.done_fence)
                    if const_expr(self.publish):
                        # the CTA's completion waits for this warp too: it must read the epoch before it advances
                        cute.arch.barrier_arrive(barrier_id=DONE_BARRIER, number_of_threads=DONE_THREADS)
            if warp_idx == 0:
                self.producer(mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k, pipe_v, n_tiles,
                              n_kv, n_mb_per_rank, h_loc, rank, world, bidx, grid, tail_k)
        else:
            cute.arch.setmaxregister_increase(240)
            self.consumer(mO, out_ptrs, flag_ptrs, flags, epoch, counter, errors, spans, tma_os, gO_tmas,
                          sQ, sK, sV,
                          sO, tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k, pipe_v, scale_log2, rank, world,
                          timeout_ns, n_tiles, n_kv, n_mb_per_rank, h_loc, seq, tidx - WG_THREADS,
                          bidx, grid, tail_k, s_relay)

    def walk_bounds(self, n_tiles, grid, tail_k):
        """(first unit, units walked, whole tiles, chunks per split tile) of the persistent walk, the same for
        the producer and the consumer: every tile whole unless tail_split (mapping.tail_split_units); ``walk``
        "rounds" stops before the last, partly empty round, "tail" takes only its chunks."""
        if const_expr(self.tail_split):
            k_split = Int32(tail_k)
            full, n_walk = tail_split_units(n_tiles, Int32(grid), k_split)
            first = Int32(0)
            if const_expr(self.walk == "tail"):
                first = full
            return first, n_walk, full, k_split
        if const_expr(self.walk == "rounds"):
            whole = n_tiles // Int32(grid) * Int32(grid)
            return Int32(0), whole, whole, Int32(1)
        return Int32(0), n_tiles, n_tiles, Int32(1)

    @cute.jit
    def producer(self, mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k, pipe_v, n_tiles, n_kv,
                 n_mb_per_rank, h_loc, rank, world, bidx, grid, tail_k=None):
        d = self.head_dim
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        first, n_walk, full, k_split = self.walk_bounds(n_tiles, grid, tail_k)
        for u in cutlass.range(first + Int32(bidx), n_walk, Int32(grid), unroll=1):
            t = u
            kv0, kv1 = None, None
            if const_expr(self.tail_split):
                t, kv0, kv1, _, _ = unit_work(u, full, k_split, n_kv)
            if const_expr(self.cross_halves):
                hb0, hb1, h, bb, _, _ = tile_halves(t, world, n_mb_per_rank, h_loc, rank, n_tiles, Int32(grid),
                                                    True, self.turn_destinations)
                load_q = self.q_halves_loader(tma_q, mQ[None, None, h, bb], sQ, hb0, hb1)
            else:
                m_block, h, bb, _ = tile_coords(t, world, n_mb_per_rank, h_loc, rank, n_tiles, Int32(grid),
                                                     self.turn_destinations, self.remote_first)
                if const_expr(self.q_stages > 1):  # a Q buffer per stage: the load names its block and buffer
                    gQ = cute.local_tile(mQ[None, None, h, bb], (TILE_M, d), (None, 0))
                    load_q_staged, _, _ = copy_utils.tma_get_copy_fn(tma_q, 0, cute.make_layout(1), gQ, sQ)

                    def load_q(tma_bar_ptr):
                        load_q_staged(src_idx=m_block, dst_idx=q_state.index, tma_bar_ptr=tma_bar_ptr)
                else:
                    gQ = cute.local_tile(mQ[None, None, h, bb], (TILE_M, d), (m_block, 0))
                    load_q, _, _ = copy_utils.tma_get_copy_fn(tma_q, 0, cute.make_layout(1), gQ, sQ,
                                                              single_stage=True)
            gK = cute.local_tile(mK[None, None, h, bb], (self.tile_n, d), (None, 0))
            gV = cute.local_tile(mV[None, None, h, bb], (self.tile_n, d), (None, 0))
            if const_expr(self.cluster_kv > 1):  # this CTA's share of each block, multicast to the pair
                pair_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
                mask = cutlass.Int16((1 << self.cluster_kv) - 1)
                pair = cute.make_layout(self.cluster_kv)
                load_k, _, _ = copy_utils.tma_get_copy_fn(tma_k, pair_rank, pair, gK, sK, mcast_mask=mask)
                load_v, _, _ = copy_utils.tma_get_copy_fn(tma_v, pair_rank, pair, gV, sV, mcast_mask=mask)
            else:
                load_k, _, _ = copy_utils.tma_get_copy_fn(tma_k, 0, cute.make_layout(1), gK, sK)
                load_v, _, _ = copy_utils.tma_get_copy_fn(tma_v, 0, cute.make_layout(1), gV, sV)
            if const_expr(self.lag_v):
                # The overlapped consumer reads K[n] before V[n-1]: load in that order (K[n+1] ahead of V[n]),
                # so a K load never queues behind a V slot that is still being read.
                pipe_k.producer_acquire(kv_state)
                load_k(src_idx=0, dst_idx=kv_state.index, tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
                pipe_q.producer_acquire(q_state)
                load_q(tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
                q_state.advance()
                for n in cutlass.range(1, n_kv, unroll=1):
                    kv_prev = kv_state.clone()
                    kv_state.advance()
                    pipe_k.producer_acquire(kv_state)
                    load_k(src_idx=n, dst_idx=kv_state.index, tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
                    pipe_v.producer_acquire(kv_prev)
                    load_v(src_idx=n - 1, dst_idx=kv_prev.index, tma_bar_ptr=pipe_v.producer_get_barrier(kv_prev))
                pipe_v.producer_acquire(kv_state)
                load_v(src_idx=n_kv - 1, dst_idx=kv_state.index, tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
                kv_state.advance()
            else:
                pipe_q.producer_acquire(q_state)
                load_q(tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
                q_state.advance()
                if const_expr(self.tail_split):
                    for n in cutlass.range(kv0, kv1, unroll=1):
                        pipe_k.producer_acquire(kv_state)
                        load_k(src_idx=n, dst_idx=kv_state.index, tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
                        pipe_v.producer_acquire(kv_state)
                        load_v(src_idx=n, dst_idx=kv_state.index, tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
                        kv_state.advance()
                else:
                    for n in cutlass.range(n_kv, unroll=1):
                        pipe_k.producer_acquire(kv_state)
                        load_k(src_idx=n, dst_idx=kv_state.index, tma_bar_ptr=pipe_k.producer_get_barrier(kv_state))
                        pipe_v.producer_acquire(kv_state)
                        load_v(src_idx=n, dst_idx=kv_state.index, tma_bar_ptr=pipe_v.producer_get_barrier(kv_state))
                        kv_state.advance()
        if const_expr(self.cluster_kv > 1):  # the peer's last releases land on this CTA's K barriers too
            pipe_k.producer_tail(kv_state.clone())
        pipe_v.producer_tail(kv_state)

    def q_halves_loader(self, tma_q, mQ_hb, sQ, hb0, hb1):
        """cross_halves: a Q loader issuing the two 64-row TMA loads (row blocks hb0, hb1 of one head and
        batch) into the warpgroups' halves of sQ, both on the tile's Q barrier (their bytes sum to tx_q)."""
        d = self.head_dim
        loads = []
        for w, hb in ((0, hb0), (1, hb1)):
            gQ = cute.local_tile(mQ_hb, (64, d), (hb, 0))
            sQ_w = cute.local_tile(sQ, (64, d), (w, 0))
            fn, _, _ = copy_utils.tma_get_copy_fn(tma_q, 0, cute.make_layout(1), gQ, sQ_w, single_stage=True)
            loads.append(fn)

        def load_q(tma_bar_ptr):
            loads[0](tma_bar_ptr=tma_bar_ptr)
            loads[1](tma_bar_ptr=tma_bar_ptr)
        return load_q

    @cute.jit
    def kv_block(self, is_first: cutlass.Constexpr[bool], softmax: OnlineSoftmax, acc_o, tOrP, tSrQ, tSrK,
                 tOrVt, tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, kv_state):
        """One KV block of the Q-loop: S = Q Kᵀ, online softmax, O = O·rescale + P V."""
        pipe_k.consumer_wait(kv_state)
        acc_s = sm90_utils.gemm_zero_init(tiled_mma_qk, (TILE_M, self.tile_n), tSrQ, tSrK, B_idx=kv_state.index,
                                          wg_wait=0)
        pipe_k.consumer_release(kv_state)
        row_scale = softmax.update(acc_s, is_first)
        if const_expr(not is_first):
            softmax.rescale(acc_o, row_scale)
        tOrP.store(layout_utils.reshape_acc_to_frgA(acc_s).load().to(self.dtype))
        pipe_v.consumer_wait(kv_state)
        sm90_utils.gemm_w_idx(tiled_mma_pv, acc_o, tOrP, tOrVt, zero_init=is_first, B_idx=kv_state.index,
                              wg_wait=0)
        pipe_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    @cute.jit
    def pinned_sum(self, softmax: OnlineSoftmax, acc_s) -> Float32:
        """Sum of the first ``pin_count`` exponentials of this thread (row-major over its rows): whole rows
        through their row sums (free), a partial row element by element."""
        p_mn = layout_utils.reshape_acc_to_mn(acc_s)
        n_rows = cute.size(softmax.row_sum)
        n_cols = cute.size(p_mn, mode=[1])
        total = Float32(0.0)
        for r in cutlass.range_constexpr(n_rows):
            if const_expr(self.pin_count >= (r + 1) * n_cols):
                total = total + softmax.row_sum[r]
            elif const_expr(self.pin_count > r * n_cols):
                for c in cutlass.range_constexpr(self.pin_count - r * n_cols):
                    total = total + p_mn[r, c]
        return total

    @cute.jit
    def store_chunk(self, g_copy, thr_g, tGsO, addr: Int64, heads, chunk):
        """store="paced": vector ``chunk`` of this thread's share of a warpgroup's 64 staged rows (sO) to
        the destination rows at global address ``addr`` of a (b, S/P, heads, d) buffer."""
        row_stride = cute.assume(heads * self.head_dim, divby=self.head_dim)
        ptr = cute.make_ptr(self.dtype, addr, cute.AddressSpace.gmem, assumed_align=16)
        g_dst = cute.make_tensor(ptr, cute.make_layout((64, self.head_dim), stride=(row_stride, 1)))
        src = tGsO[None, chunk, None]
        vec = cute.make_fragment_like(src)
        cute.autovec_copy(src, vec)
        cute.copy(g_copy, vec, thr_g.partition_D(g_dst)[None, chunk, None])

    @cute.jit
    def relay_event(self, n, relay):
        """relay=True: event ``n`` of this thread's share (mapping.relay_events_in_loop; events run once each, in
        order): the vector loaded at event n - 1 goes to its peer, then the next is loaded from the shadow, the
        first after griddepcontrol.wait (the rounds kernel complete, its shadow stores visible). A load's latency
        passes under the KV blocks up to the next event. The thread's vector steps on by RELAY_THREADS through a
        cursor (mapping.relay_advance: no division per event) and the addresses come from shared memory."""
        ptrs, n_steps, total, world, rank, h_loc, run_len, runs, row_step, w_step, rv, cur, pending = relay
        if const_expr(self.relay_wait):
            if n == 0:
                cute.arch.griddepcontrol_wait()
        if n >= 1:
            if cur[4] >= 0:  # the peer of the vector loaded last (-1: none)
                dst = cute.make_ptr(self.dtype, ptrs[cur[4]], cute.AddressSpace.gmem, assumed_align=16)
                cute.autovec_copy(rv, cute.make_tensor(dst + cute.assume(pending[0], divby=self.vec),
                                                       cute.make_layout(self.vec)))
        cur[4] = Int32(-1)
        if n < n_steps:
            v, i, row, w = cur[0], cur[1], cur[2], cur[3]
            if v < total:
                j = rank + 1 + i
                j = j - world * cutlass.min(Int32(1), cutlass.max(Int32(0), j - world + 1))  # (rank + 1 + i) % P
                off = relay_offset(Int64(row), w, world, rank, h_loc, self.head_dim, self.vec)
                src = cute.make_ptr(self.dtype, ptrs[self.n_dst + j], cute.AddressSpace.gmem, assumed_align=16)
                cute.autovec_copy(cute.make_tensor(src + cute.assume(off, divby=self.vec), cute.make_layout(self.vec)),
                                  rv)
                cur[4] = j
                pending[0] = off
            i, row, w = relay_advance(i, row, w, run_len, runs, row_step, w_step)
            cur[0] = v + RELAY_THREADS
            cur[1] = i
            cur[2] = row
            cur[3] = w

    def wait_stage(self, pipe, state):
        """Wait for a K or V stage of the overlapped Q-loop (``try_wait``: probe first, FA4's pattern)."""
        if const_expr(self.try_wait):
            pipe.consumer_wait(state, pipe.consumer_try_wait(state))
        else:
            pipe.consumer_wait(state)

    @cute.jit
    def overlapped_block(self, softmax: OnlineSoftmax, acc_o, tOrP, tSrQ, tSrK, tOrVt, pending_scale,
                         tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, kv_state, wg, drip=None, block=None,
                         n_groups=None, relay=None, relay_end=None):
        """One KV block n >= 1 of the overlapped Q-loop: S = Q Kₙᵀ issued with block n-1's O += P V.
        ``drip`` (store="paced"): on every pace_kv-th ``block`` (counted from 0) of the first n_groups·pace_kv,
        also store the next vector of the previous tile's rows from sO. ``relay`` (relay=True): on every
        RELAY_PACE_KV-th ``block`` from ``relay_start`` below ``relay_end``, the next relay event."""
        other = 1 - wg
        kv_v = kv_state.clone()
        kv_state.advance()
        self.wait_stage(pipe_k, kv_state)
        cute.arch.barrier(barrier_id=SCHEDULER_BARRIER + wg, number_of_threads=2 * WG_THREADS)
        acc_s = sm90_utils.gemm_zero_init(tiled_mma_qk, (TILE_M, self.tile_n), tSrQ, tSrK, B_idx=kv_state.index,
                                          wg_wait=-1)
        if const_expr(self.rescale_before_pv):
            softmax.rescale(acc_o, pending_scale, self.rescale_threshold > 0)
        self.wait_stage(pipe_v, kv_v)
        sm90_utils.gemm_w_idx(tiled_mma_pv, acc_o, tOrP, tOrVt, zero_init=False, B_idx=kv_v.index, wg_wait=-1)
        cute.arch.barrier_arrive(barrier_id=SCHEDULER_BARRIER + other, number_of_threads=2 * WG_THREADS)
        if const_expr(drip is not None):
            # one 16 B vector per thread of the previous tile's rows, issued while this block's GEMMs run
            if block < n_groups * self.pace_kv:
                if const_expr(self.pace_kv == 1):
                    self.store_chunk(*drip, block)
                elif block % self.pace_kv == 0:
                    self.store_chunk(*drip, block // self.pace_kv)
        if const_expr(relay is not None):
            if block >= self.relay_start and block < relay_end:
                if (block - self.relay_start) % RELAY_PACE_KV == 0:
                    self.relay_event((block - self.relay_start) // RELAY_PACE_KV, relay)
        warpgroup.wait_group(1)  # S ready; PV may still run
        if const_expr(not self.pin_softmax):
            pipe_k.consumer_release(kv_state)
        row_scale = softmax.update(acc_s, False, self.rescale_threshold)
        if const_expr(self.pin_softmax):
            # ptxas sinks the exponentials below the PV wait (they are consumed after it), which takes the
            # softmax off this warpgroup's own PV GEMM. Releasing K under a predicate that reads the pinned
            # exponentials (always true: sums of exp2 are never below zero, and NaN compares false) makes
            # them precede the release, and ptxas keeps the release ahead of the wait.
            total = self.pinned_sum(softmax, acc_s)
            if not (total < Float32(0.0)):
                pipe_k.consumer_release(kv_state)
        warpgroup.wait_group(0)  # PV done: O and P may change
        pipe_v.consumer_release(kv_v)
        if const_expr(self.p_first):
            tOrP.store(layout_utils.reshape_acc_to_frgA(acc_s).load().to(self.dtype))
        if const_expr(self.rescale_before_pv):
            pending_scale.store(row_scale.load())
        else:
            softmax.rescale(acc_o, row_scale, self.rescale_threshold > 0)
        if const_expr(not self.p_first):
            tOrP.store(layout_utils.reshape_acc_to_frgA(acc_s).load().to(self.dtype))
        return kv_state

    @cute.jit
    def q_loop_overlapped(self, softmax: OnlineSoftmax, acc_o, tOrP, tSrQ, tSrK, tOrVt, tiled_mma_qk,
                          tiled_mma_pv, pipe_q, q_state, pipe_k, pipe_v, kv_state, n_kv, wg, drip=None,
                          n_groups=None, n_pending=None, relay=None, n_relay=None):
        """The whole Q-loop of one tile with intra-warpgroup overlap and warpgroup ping-pong.

        Block n's S = Q Kₙᵀ is issued together with block n-1's O += P V; softmax of block n runs while the
        PV GEMM drains, and the other warpgroup's GEMMs run under this warpgroup's softmax. store="paced":
        ``drip`` = (copy, thread slice, staged rows, destination address, heads) of the previous tile, whose
        vectors [0, n_groups) go out in the loop and [n_groups, n_pending) after it. relay=True: ``relay`` (the
        relay_event state), whose events [0, n_relay) run in the loop."""
        other = 1 - wg
        # first block: S only
        self.wait_stage(pipe_k, kv_state)
        if const_expr(self.sync_first_block):
            cute.arch.barrier(barrier_id=SCHEDULER_BARRIER + wg, number_of_threads=2 * WG_THREADS)
        acc_s0 = sm90_utils.gemm_zero_init(tiled_mma_qk, (TILE_M, self.tile_n), tSrQ, tSrK, B_idx=kv_state.index,
                                           wg_wait=-1)
        if const_expr(self.sync_first_block):
            cute.arch.barrier_arrive(barrier_id=SCHEDULER_BARRIER + other, number_of_threads=2 * WG_THREADS)
        warpgroup.wait_group(0)
        pipe_k.consumer_release(kv_state)
        softmax.update(acc_s0, True)
        tOrP.store(layout_utils.reshape_acc_to_frgA(acc_s0).load().to(self.dtype))
        acc_o.fill(0.0)
        pending_scale = cute.make_fragment_like(softmax.row_max, Float32)  # rescale_before_pv: not yet applied
        pending_scale.fill(1.0)
        if const_expr(drip is not None and self.peel_drip):
            # store="paced", peeled: the blocks that carry a vector run in a loop of their own, so the rest of
            # the Q-loop is the plain overlapped loop (no store in its body, its own ptxas schedule)
            n_drip = n_groups * self.pace_kv
            for i in cutlass.range(n_drip, unroll=1):
                kv_state = self.overlapped_block(softmax, acc_o, tOrP, tSrQ, tSrK, tOrVt, pending_scale,
                                                 tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, kv_state, wg,
                                                 drip, i, n_groups)
            for _ in cutlass.range(n_drip, n_kv - 1, unroll=1):
                kv_state = self.overlapped_block(softmax, acc_o, tOrP, tSrQ, tSrK, tOrVt, pending_scale,
                                                 tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, kv_state, wg)
            for c in cutlass.range(n_groups, n_pending, unroll=1):  # what the loop had too few blocks for
                self.store_chunk(*drip, c)
        elif const_expr(drip is not None):
            # store="paced": the previous tile's rows leave sO one vector per thread every pace_kv blocks
            for i in cutlass.range(n_kv - 1, unroll=1):
                kv_state = self.overlapped_block(softmax, acc_o, tOrP, tSrQ, tSrK, tOrVt, pending_scale,
                                                 tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, kv_state, wg,
                                                 drip, i, n_groups)
            for c in cutlass.range(n_groups, n_pending, unroll=1):  # what the loop had too few blocks for
                self.store_chunk(*drip, c)
        elif const_expr(relay is not None):
            # relay=True: the events under a predicate in the one loop (peeled into a loop of their own, as
            # peel_drip does, ptxas scheduled the plain loop's softmax worse: 47 of 66 exponentials ahead of the
            # PV wait instead of the tail kernel's 53; in the one loop it keeps 53)
            relay_end = cutlass.min(Int32(1), n_relay) * (self.relay_start + RELAY_PACE_KV * (n_relay - 1) + 1)
            for i in cutlass.range(n_kv - 1, unroll=1):
                kv_state = self.overlapped_block(softmax, acc_o, tOrP, tSrQ, tSrK, tOrVt, pending_scale,
                                                 tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, kv_state, wg,
                                                 block=i, relay=relay, relay_end=relay_end)
        else:
            for _ in cutlass.range(n_kv - 1, unroll=1):
                kv_state = self.overlapped_block(softmax, acc_o, tOrP, tSrQ, tSrK, tOrVt, pending_scale,
                                                 tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, kv_state, wg)
        if const_expr(self.rescale_before_pv):
            softmax.rescale(acc_o, pending_scale, self.rescale_threshold > 0)
        # Q is no longer read: let the producer load the next tile's Q under the last PV and the epilogue.
        pipe_q.consumer_release(q_state)
        # last block's PV
        self.wait_stage(pipe_v, kv_state)
        sm90_utils.gemm_w_idx(tiled_mma_pv, acc_o, tOrP, tOrVt, zero_init=False, B_idx=kv_state.index, wg_wait=0)
        pipe_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    @cute.jit
    def partial_view(self, ws, tail_tile, chunk, k, thr):
        """This thread's share of chunk ``chunk``'s partial of split tile ``tail_tile`` in the workspace:
        PARTIAL_FLOATS // 4 16-byte vectors, vector-major over the CTA's MMA threads, so a warp's access to one
        vector index is 512 contiguous bytes (thread-major, each warp load/store touched 32 lines and the
        combining CTA's reads cost more than its chunk's compute)."""
        n_thr = self.num_mma_wg * WG_THREADS
        off = (Int64(tail_tile) * k + chunk) * (n_thr * PARTIAL_FLOATS) + Int64(thr) * 4
        return cute.make_tensor(ws + cute.assume(off, divby=4),
                                cute.make_layout((4, PARTIAL_FLOATS // 4), stride=(1, 4 * n_thr)))

    @cute.jit
    def tail_partial(self, acc_o, softmax: OnlineSoftmax, out_ptrs, tail_tile, chunk, split, k, wg, tidx, sO) -> Int32:
        """tail_split, after a unit's Q-loop: a whole tile is normalized (returns 1: store it). A chunk of a
        split tile leaves this thread's unnormalized O and its two rows' max and (quad-summed) sum in the
        workspace, fenced; both MMA warpgroups meet, one thread counts the chunk on the tile's counter (the k-th
        arrival resets it), and its CTA (returns 1) reads the chunks back in chunk order, once each, and combines
        them into acc_o online: m = max(m, m_i), O = O 2^((m_old - m) s) + O_i 2^((m_i - m) s), the same for
        the sum l, then O / l (chunk order, not arrival order: the result does not depend on which CTA combines);
        otherwise returns 0."""
        store_tile = Int32(1)
        if split == 0:
            softmax.rescale(acc_o, softmax.finalize())
        else:
            n_o = cute.size(acc_o)
            n_rows = cute.size(softmax.row_max)
            ws = cute.make_ptr(Float32, out_ptrs[self.n_dst], cute.AddressSpace.gmem, assumed_align=16)
            thr = wg * WG_THREADS + tidx % WG_THREADS
            part = cute.make_rmem_tensor((4, PARTIAL_FLOATS // 4), Float32)
            for i in cutlass.range_constexpr(n_o):
                part[i] = acc_o[i]
            for r in cutlass.range_constexpr(n_rows):
                part[n_o + r] = softmax.row_max[r]
                part[n_o + n_rows + r] = cute.arch.warp_reduction_sum(softmax.row_sum[r], threads_in_group=4)
            cute.autovec_copy(part, self.partial_view(ws, tail_tile, chunk, k, thr))
            cute.arch.fence_acq_rel_gpu()  # this thread's partial before the count (CUDA's threadfence pattern)
            cute.arch.barrier(barrier_id=TAIL_BARRIER, number_of_threads=self.num_mma_wg * WG_THREADS)
            flag = cute.make_tensor(cute.recast_ptr(sO.iterator, dtype=Int32), cute.make_layout(1))
            if tidx == 0:
                counter = cute.make_ptr(Int32, out_ptrs[self.n_dst + 1], cute.AddressSpace.gmem, assumed_align=4)
                old = cute.arch.atomic_add((counter + tail_tile).llvm_ptr, Int32(1), sem="acq_rel", scope="gpu")
                last = Int32(old == k - 1)
                if last != 0:
                    (counter + tail_tile).store(Int32(0))  # every chunk has counted: ready for the next launch
                flag[0] = last
            cute.arch.barrier(barrier_id=TAIL_BARRIER, number_of_threads=self.num_mma_wg * WG_THREADS)
            store_tile = flag[0]
            if store_tile != 0:
                cute.arch.fence_acq_rel_gpu()  # the other chunks' partials after their counts
                acc_mn = layout_utils.reshape_acc_to_mn(acc_o)
                part_o = cute.make_fragment_like(acc_o, Float32)
                part_mn = layout_utils.reshape_acc_to_mn(part_o)
                row_m = cute.make_rmem_tensor(n_rows, Float32)
                row_l = cute.make_rmem_tensor(n_rows, Float32)
                cute.autovec_copy(self.partial_view(ws, tail_tile, 0, k, thr), part)  # chunk 0 starts the sums
                for j in cutlass.range_constexpr(n_o):
                    acc_o[j] = part[j]
                for r in cutlass.range_constexpr(n_rows):
                    row_m[r] = part[n_o + r]
                    row_l[r] = part[n_o + n_rows + r]
                for i in cutlass.range(1, k, unroll=1):
                    cute.autovec_copy(self.partial_view(ws, tail_tile, i, k, thr), part)
                    for j in cutlass.range_constexpr(n_o):
                        part_o[j] = part[j]
                    for r in cutlass.range_constexpr(n_rows):
                        m_new = cute.arch.fmax(row_m[r], part[n_o + r])
                        c_old = cute.math.exp2((row_m[r] - m_new) * softmax.scale_log2, fastmath=True)
                        c_new = cute.math.exp2((part[n_o + r] - m_new) * softmax.scale_log2, fastmath=True)
                        row_m[r] = m_new
                        row_l[r] = row_l[r] * c_old + part[n_o + n_rows + r] * c_new
                        acc_mn[r, None].store(acc_mn[r, None].load() * c_old + part_mn[r, None].load() * c_new)
                for r in cutlass.range_constexpr(n_rows):
                    inv = cute.arch.rcp_approx(row_l[r])
                    acc_mn[r, None].store(acc_mn[r, None].load() * inv)
        return store_tile

    @cute.jit
    def tma_store_half(self, tma_o: cute.CopyAtom, gO_tma: cute.Tensor, sO_wg: cute.Tensor, head, bb, row_blk):
        """One thread: TMA-store this warpgroup's 64 x d half (swizzled sO rows) to rows 64 * row_blk.. of
        (head, batch) in one destination's (rows, d, heads, batch) tensor map."""
        gO = cute.local_tile(gO_tma[None, None, head, bb], (64, self.head_dim), (row_blk, 0))
        store, _, _ = copy_utils.tma_get_copy_fn(tma_o, 0, cute.make_layout(1), sO_wg, gO, single_stage=True)
        store()

    @cute.jit
    def consumer(self, mO, out_ptrs, flag_ptrs, flags, epoch, counter, errors, spans, tma_os, gO_tmas,
                 sQ, sK, sV,
                 sO, tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k, pipe_v, scale_log2, rank, world, timeout_ns,
                 n_tiles, n_kv, n_mb_per_rank, h_loc, seq, tidx, bidx, grid, tail_k=None, s_relay=None):
        d = self.head_dim
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        wg_layout = cute.make_layout(self.num_mma_wg, stride=WG_THREADS)
        wg_mma_qk = tiled_mma_qk.get_slice(wg_layout(wg))
        wg_mma_pv = tiled_mma_pv.get_slice(wg_layout(wg))
        _, tSrQ, tSrK = sm90_utils.partition_fragment_ABC(wg_mma_qk, (TILE_M, self.tile_n, d), sQ, sK)
        sVt = layout_utils.transpose_view(sV)
        acc_o, tOrP, tOrVt = sm90_utils.partition_fragment_ABC(wg_mma_pv, (TILE_M, d, self.tile_n), None, sVt)
        # Epilogue: registers -> sO (stmatrix) -> 128-bit stores by this warpgroup's 128 threads.
        st_atom = copy_utils.get_smem_store_atom(self.dtype)
        thr_st = cute.make_tiled_copy_C(st_atom, tiled_mma_pv).get_slice(tidx)
        tOsO = thr_st.partition_D(sO)
        lanes_d = d // self.vec
        g_copy = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128),
            cute.make_ordered_layout((WG_THREADS // lanes_d, lanes_d), order=(1, 0)),
            cute.make_layout((1, self.vec)))
        thr_g = g_copy.get_slice(tidx % WG_THREADS)
        sO_wg = cute.local_tile(sO, (64, d), (wg, 0))
        tGsO = thr_g.partition_S(sO_wg)
        tGrO = cute.make_fragment_like(tGsO)
        heads = h_loc * world
        e_next = epoch[0] + 1
        bar_id = EPILOGUE_BARRIER + wg
        paced = self.store == "paced"
        chunks = cute.size(tGsO, mode=[1])  # 16 B vectors per thread in a warpgroup's 64 rows
        if const_expr(paced):
            pend = Int32(0)  # the previous tile's rows wait in sO for their stores (store="paced")
            pend_addr = Int64(0)  # their destination
        if const_expr(self.overlap):
            if wg == 0:  # the first warpgroup issues first
                cute.arch.barrier_arrive(barrier_id=SCHEDULER_BARRIER, number_of_threads=2 * WG_THREADS)

        peers_done = Int32(0)
        early_tile = Int32(-1)
        if const_expr(self.early_done):
            peers_done, early_tile = early_done_arrival(Int32(bidx), Int32(grid), n_tiles, world,
                                                        self.early_done == "last_epilogue")
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        first, n_walk, full, k_split = self.walk_bounds(n_tiles, grid, tail_k)
        if const_expr(self.relay):
            r_rows = n_mb_per_rank * TILE_M  # S/P
            n_batch = n_tiles // (n_mb_per_rank * world * h_loc)
            r_first, r_steps, r_total = relay_share(Int32(bidx), Int32(grid), world, n_batch, r_rows, h_loc,
                                                    d // self.vec)
            # The destinations and shadows into shared memory once, so no event waits for a dependent global
            # load (alone this measured no faster; the divisions were the cost, see relay_cursor below).
            if tidx < 2 * self.n_dst:
                s_relay[tidx] = out_ptrs[tidx + (tidx // self.n_dst) * 3]  # [n_dst + 3, 2 n_dst + 3): shadows
            cute.arch.barrier(barrier_id=TAIL_BARRIER, number_of_threads=self.num_mma_wg * WG_THREADS)
            # the thread's cursor (mapping.relay_cursor, stepped by relay_advance: no division per event; two per
            # address cost ~4 µs at 3 heads/8K): (next vector, its peer index, row, w, the pending vector's peer or -1), and the
            # pending vector's element offset
            cur = cute.make_rmem_tensor(5, Int32)
            rc_v = r_first * RELAY_THREADS + tidx
            rc_i, rc_row, rc_w = relay_cursor(rc_v, n_batch, r_rows, h_loc, d // self.vec)
            cur[0] = rc_v
            cur[1] = rc_i
            cur[2] = rc_row
            cur[3] = rc_w
            cur[4] = Int32(-1)
            pending = cute.make_rmem_tensor(1, Int64)
            pending[0] = Int64(0)
            run_len = h_loc * (d // self.vec)
            relay = (s_relay, r_steps, r_total, world, rank, h_loc, run_len, n_batch * r_rows,
                     RELAY_THREADS // run_len, RELAY_THREADS % run_len, cute.make_rmem_tensor(self.vec, self.dtype),
                     cur, pending)
            r_done = Int32(0)  # 1 once this CTA's share is out (in its first unit's Q-loop and right after it)
        for u in cutlass.range(first + Int32(bidx), n_walk, Int32(grid), unroll=1):
            t = u
            n_this = n_kv
            if const_expr(self.tail_split):
                t, kv0, kv1, chunk, split = unit_work(u, full, k_split, n_kv)
                n_this = kv1 - kv0
            if const_expr(self.cross_halves):
                hb0, hb1, h, bb, dest0, dest1 = tile_halves(t, world, n_mb_per_rank, h_loc, rank, n_tiles,
                                                            Int32(grid), True, self.turn_destinations)
                hb = hb0 + wg * (hb1 - hb0)  # this warpgroup's 64-row block and its destination
                dest = dest0 + wg * (dest1 - dest0)
            else:
                m_block, h, bb, dest = tile_coords(t, world, n_mb_per_rank, h_loc, rank, n_tiles, Int32(grid),
                                                     self.turn_destinations, self.remote_first)
            softmax = OnlineSoftmax.create(scale_log2, cute.size(layout_utils.reshape_acc_to_mn(acc_o), mode=[0]))
            pipe_q.consumer_wait(q_state)
            tSrQ_t = tSrQ
            if const_expr(self.q_stages > 1):
                tSrQ_t = tSrQ[None, None, None, q_state.index]
            if const_expr(paced):
                n_groups = cutlass.min(Int32(chunks), (n_kv - 1) // self.pace_kv) * pend  # vectors sent in the loop
                kv_state = self.q_loop_overlapped(softmax, acc_o, tOrP, tSrQ_t, tSrK, tOrVt, tiled_mma_qk,
                                                  tiled_mma_pv, pipe_q, q_state, pipe_k, pipe_v, kv_state, n_kv,
                                                  wg, (g_copy, thr_g, tGsO, pend_addr, heads), n_groups,
                                                  pend * chunks)
            elif const_expr(self.relay):
                n_relay = (relay_events_in_loop(n_this, r_steps, self.relay_start)
                           * (1 - cutlass.min(Int32(1), r_done)))
                kv_state = self.q_loop_overlapped(softmax, acc_o, tOrP, tSrQ_t, tSrK, tOrVt, tiled_mma_qk,
                                                  tiled_mma_pv, pipe_q, q_state, pipe_k, pipe_v, kv_state, n_this,
                                                  wg, relay=relay, n_relay=n_relay)
            elif const_expr(self.overlap):
                kv_state = self.q_loop_overlapped(softmax, acc_o, tOrP, tSrQ_t, tSrK, tOrVt, tiled_mma_qk,
                                                  tiled_mma_pv, pipe_q, q_state, pipe_k, pipe_v, kv_state, n_this,
                                                  wg)
            else:
                kv_state = self.kv_block(True, softmax, acc_o, tOrP, tSrQ_t, tSrK, tOrVt, tiled_mma_qk,
                                         tiled_mma_pv, pipe_k, pipe_v, kv_state)
                for _ in cutlass.range(n_kv - 1, unroll=1):
                    kv_state = self.kv_block(False, softmax, acc_o, tOrP, tSrQ_t, tSrK, tOrVt, tiled_mma_qk,
                                             tiled_mma_pv, pipe_k, pipe_v, kv_state)
                pipe_q.consumer_release(q_state)
            q_state.advance()
            if const_expr(self.relay):
                if r_done == 0:  # what the first Q-loop had too few blocks for
                    for n in cutlass.range(n_relay, r_steps + 1, unroll=1):
                        self.relay_event(n, relay)
                    r_done = Int32(1)
            store_tile = 1  # tail_split: whether this unit stores its tile (a whole tile, or the last chunk)
            if const_expr(self.tail_split):
                store_tile = self.tail_partial(acc_o, softmax, out_ptrs, t - full, chunk, split, k_split, wg, tidx,
                                               sO)
            else:
                softmax.rescale(acc_o, softmax.finalize())
            if const_expr(self.early_done == "last_epilogue"):
                if t == early_tile:  # the final tile's Q-loop is done, every earlier tile's stores issued
                    cute.arch.barrier_arrive(barrier_id=EARLY_BARRIER, number_of_threads=DONE_THREADS)

            if store_tile != 0:  # a Python 1 (static) unless tail_split
                # ---- epilogue of this warpgroup's 64 rows
                r_o = cute.make_fragment_like(acc_o, self.dtype)
                r_o.store(acc_o.load().to(self.dtype))
                ltid = tidx % WG_THREADS
                if const_expr(self.store == "bulk"):
                    if ltid < 64:  # the TMA engine has read the previous tile's row out of sO
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                if const_expr(self.store == "tma"):
                    if ltid == 0:  # the TMA engine has read the previous tile's half out of sO
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                if const_expr(self.ready_on and self.ready_wait == "epilogue"):
                    if t == Int32(bidx):
                        if ltid == 0:
                            await_ready_here(flags, world, e_next, timeout_ns, errors, Int32(bidx), self.n_dst)
                    cute.arch.barrier(barrier_id=bar_id, number_of_threads=WG_THREADS)  # sO rows free again
                elif const_expr(self.ready_on):
                    # The ready gate: on this CTA's first tile, the warp that waited for every receiver's ready
                    # flag also arrives on this barrier (await_all_ready; the barrier's first use in the kernel, so
                    # its count is 160 there and 128 after), so no store goes out before the announcements. No
                    # wait, poll or acquire in the loop for later tiles. (The mbarrier test before every tile's
                    # stores it replaces held the destination pointer's load back until after it, in the SASS. On
                    # H200 at 12 heads/8K the ready wait still cost +2.9 µs with remote stores, +4.4 with the
                    # self-store control, fused_parts_bf4aabc.json: the acquire load per poll, ~0.6% of the kernel
                    # at any M; relaxed polls and one fence, ready_wait="warp", remove it.)
                    gate = Int32(WG_THREADS) + Int32(32) * Int32(t == Int32(bidx))
                    if const_expr(self.instrument):
                        gt_gate = cute.arch.globaltimer()
                    cute.arch.barrier(barrier_id=bar_id, number_of_threads=gate)  # sO rows free again
                    if const_expr(self.instrument):
                        if t == Int32(bidx):
                            if tidx == 0:  # first warpgroup, first tile: when it reached the gate and passed it
                                spans[n_tiles * self.num_mma_wg + bidx, 2] = gt_gate
                                spans[n_tiles * self.num_mma_wg + bidx, 3] = cute.arch.globaltimer()
                else:
                    cute.arch.barrier(barrier_id=bar_id, number_of_threads=WG_THREADS)  # sO rows free again
                cute.copy(st_atom, thr_st.retile(r_o), tOsO)
                if const_expr(self.store in ("bulk", "tma")):
                    cute.arch.fence_proxy("async.shared", space="cta")  # stmatrix writes -> the TMA engine's reads
                cute.arch.barrier(barrier_id=bar_id, number_of_threads=WG_THREADS)
                if const_expr(self.store == "st"):
                    cute.autovec_copy(tGsO, tGrO)
                if const_expr(self.cross_halves):
                    row0 = hb * 64
                else:
                    row0 = m_block * TILE_M + wg * 64
                if const_expr(self.mode == "local"):
                    base = mO.iterator + cute.assume(((Int64(bb) * seq + row0) * h_loc + h) * d, divby=self.vec)
                    row_stride = cute.assume(h_loc * d, divby=d)
                else:
                    # Destination row from block counts, not from S/P: holding S/P live across the mainloop (a
                    # division ptxas keeps in a register) changed its schedule (61 of 66 exponentials ahead of the
                    # PV wait instead of local's 51; tests/test_flash_attention.py checks they now agree).
                    rows_per_rank = n_mb_per_rank * TILE_M
                    if const_expr(self.cross_halves):
                        drow = row0 - dest * rows_per_rank
                    else:
                        drow = (m_block - dest * n_mb_per_rank) * TILE_M + wg * 64
                    peer = cute.make_ptr(self.dtype, out_ptrs[dest], cute.AddressSpace.gmem, assumed_align=16)
                    base = peer + cute.assume(((Int64(bb) * rows_per_rank + drow) * heads + rank * h_loc + h) * d,
                                              divby=self.vec)
                    row_stride = cute.assume(heads * d, divby=d)
                gt0, ck0 = cute.arch.globaltimer(), cute.arch.clock64()
                if const_expr(paced):
                    pend_addr = base.toint()
                    pend = Int32(1)
                elif const_expr(self.store == "tma"):
                    if ltid == 0:
                        if const_expr(self.mode == "local"):
                            self.tma_store_half(tma_os[0], gO_tmas[0], sO_wg, h, bb, m_block * 2 + wg)
                        else:
                            drow_blk = (m_block - dest * n_mb_per_rank) * 2 + wg
                            for j in cutlass.range_constexpr(self.n_dst):
                                if dest == j:
                                    self.tma_store_half(tma_os[j], gO_tmas[j], sO_wg, rank * h_loc + h, bb, drow_blk)
                        cute.arch.cp_async_bulk_commit_group()
                        if const_expr(self.mode == "completion_coupled"):
                            cute.arch.cp_async_bulk_wait_group(0)  # the half's writes are complete
                            cute.arch.fence_proxy("async.global")
                            cute.arch.fence_acq_rel_sys()
                elif const_expr(self.store == "bulk"):
                    if ltid < 64:
                        row_src = sO.iterator + (wg * 64 + ltid) * (d + O_PAD)
                        copy_utils.cpasync_bulk_s2g(row_src, base + Int64(ltid) * row_stride, d * self.dtype.width // 8)
                        cute.arch.cp_async_bulk_commit_group()
                        if const_expr(self.mode == "completion_coupled"):
                            cute.arch.cp_async_bulk_wait_group(0)  # the row's writes are complete
                            cute.arch.fence_proxy("async.global")
                            cute.arch.fence_acq_rel_sys()
                else:
                    g_dst = cute.make_tensor(base, cute.make_layout((64, d), stride=(row_stride, 1)))
                    if const_expr(self.store_cache == "cs"):
                        tGgO = thr_g.partition_D(g_dst)
                        for c in cutlass.range_constexpr(chunks):
                            words = cute.recast_tensor(tGrO[None, c, None], Int32).load()
                            cute.arch.store(tGgO[None, c, None].iterator, words, cop="cs")
                    else:
                        cute.copy(g_copy, tGrO, thr_g.partition_D(g_dst))
                    if const_expr(self.mode == "completion_coupled"):
                        cute.arch.fence_acq_rel_sys()  # returns once this thread's stores are performed remotely
                if const_expr(self.early_done == "pre_tail"):
                    if t == early_tile:  # the last tile with peer stores: the idle warp raises their flags now
                        cute.arch.barrier_arrive(barrier_id=EARLY_BARRIER, number_of_threads=DONE_THREADS)
                if const_expr(self.instrument):
                    cute.arch.barrier(barrier_id=bar_id, number_of_threads=WG_THREADS)
                    if tidx % WG_THREADS == 0:
                        row = t * self.num_mma_wg + wg  # one row per (tile, warpgroup)
                        spans[row, 0] = gt0
                        spans[row, 1] = cute.arch.globaltimer()
                        spans[row, 2] = ck0
                        spans[row, 3] = cute.arch.clock64()

        if const_expr(self.relay):
            if r_done == 0:  # a CTA without a unit in the tail walk: its whole share now
                for n in cutlass.range(r_steps + 1, unroll=1):
                    self.relay_event(n, relay)
        if const_expr(paced):
            if pend != 0:  # the CTA's last tile (local in the fused order's last round): all of it now
                for c in cutlass.range_constexpr(chunks):
                    self.store_chunk(g_copy, thr_g, tGsO, pend_addr, heads, c)
        if const_expr(self.store in ("bulk", "tma")):
            issuers = 64 if self.store == "bulk" else 1
            if tidx % WG_THREADS < issuers:  # the issuing threads: every write complete, sO read before exit
                cute.arch.cp_async_bulk_wait_group(0)
                cute.arch.fence_proxy("async.global")
        if const_expr(self.publish):
            cute.arch.barrier(barrier_id=DONE_BARRIER, number_of_threads=DONE_THREADS)
            if const_expr(self.walk == "tail"):
                cute.arch.griddepcontrol_wait()  # the rounds kernel is complete, its stores performed
            publish_done(flag_ptrs, counter, epoch, rank, world, e_next, Int32(grid), Int32(bidx), tidx,
                         self.done_fence, peers_done)
