"""MegaMoE: the fused expert-parallel MoE layer (``megamoe.kernel.MegaMoEForward``) behind a torch API.

    moe = MegaMoE(group, num_experts=256, top_k=6, hidden=4096, intermediate=2048, max_tokens_per_rank=8192)
    moe.load_weights(w1, w2)        # (E, 2I, H) gate rows then up rows, and (E, H, I), bf16, all experts
    y = moe.forward(x, topk_idx, topk_weights)   # (T, H) bf16, (T, top_k) int32, (T, top_k) float32

Expert e lives on rank e // (num_experts / world). ``topk_idx`` entries of -1 are skipped (that slot adds
nothing to y); other ids must be in [0, num_experts). y[t] = sum_k w[t, k] * FFN_{e_k}(x[t]), with
FFN(x) = (silu(x W_gate^T) * (x W_up^T)) W_2^T; the router weight multiplies the SwiGLU output (bf16)
before Linear-2. Buffers (symmetric memory for world > 1) are allocated once, in the constructor, for
``max_tokens_per_rank``; ``forward`` allocates only y and is CUDA-Graph capturable (no host sync while
capturing: the expert-id range check then runs in the kernel, which records it in the error word).

Weights layout (``load_weights``): this rank's experts, W1 as (E_local * 2I, H) whose 128-row block n holds
gate rows [64n, 64n + 64) then up rows [64n, 64n + 64) (an L1 tile's SwiGLU pairs stay in one thread), W2 as
(E_local * H, I). W8A8: e4m3 in that layout with fp32 128 x 128 block scales of the original layout. W4A8
(``dtype="w4a8"``): E2M1 codes packed two per byte in that layout, each 128 x 128 block's scale 2^e_max and
each 32-run's shift below it (``w4a8_kernel_weights``).

Emulated ranks (``EmulatedMoE``): P ranks on one GPU, each a launch over SMs / P CTAs on its own stream,
with pointer tables into each other's buffers: the cross-rank protocol without a second GPU.
"""
from __future__ import annotations

import math

import torch

from megamoe import schedule as sched
from megamoe import tile_stream as ts
from megamoe.trial import TRIAL_OFF, TRIAL_OWN, TRIAL_READ


SCHEDULES = (*ts.ORDERS, "auto")
AUTO_KEYS = 64  # schedule="auto"'s trial slots per layer (decision keys); later keys run the rule's pick untried
TIMEOUT_NS = 2_000_000_000
_KERNELS: dict = {}


PRECISIONS = {torch.bfloat16: "bf16", "bf16": "bf16", torch.float8_e4m3fn: "w8a8", "w8a8": "w8a8", "fp8": "w8a8",
              "w4a8": "w4a8"}
if hasattr(torch, "float4_e2m1fn_x2"):
    PRECISIONS[torch.float4_e2m1fn_x2] = "w4a8"


def precision_of(dtype) -> str:
    """The kernel precision a ``dtype`` names: bf16, W8A8 (torch.float8_e4m3fn, "w8a8" or "fp8") or W4A8
    (E2M1 weights with UE8M0 scales per 32, activations as W8A8: "w4a8" or torch.float4_e2m1fn_x2)."""
    try:
        return PRECISIONS[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"dtype {dtype!r} is not supported: use torch.bfloat16, torch.float8_e4m3fn (W8A8) or "
                         "\"w4a8\"") from None


def _compiled(hidden, intermediate, top_k, num_local, instrument, precision="bf16", block_n=sched.BLOCK_N):
    key = (hidden, intermediate, top_k, num_local, instrument, precision, block_n)
    if key not in _KERNELS:
        import cutlass.cute as cute  # noqa: F401  (the DSL only when a kernel is built)
        from cutlass.runtime import make_fake_stream

        from cute_kernels.compile import compile_kernel
        from megamoe.kernel import MegaMoEForward

        k = MegaMoEForward(hidden, intermediate, top_k, num_local, instrument=instrument, precision=precision,
                           block_n=block_n)
        _KERNELS[key] = compile_kernel(k, *k.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True))
    return _KERNELS[key]


def _check_layer(num_experts, top_k, hidden, intermediate, world, max_tokens):
    for name, v in (("num_experts", num_experts), ("top_k", top_k), ("hidden", hidden),
                    ("intermediate", intermediate), ("max_tokens_per_rank", max_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if hidden % sched.BLOCK_N or intermediate % sched.BLOCK_N:
        raise ValueError(f"hidden ({hidden}) and intermediate ({intermediate}) must be multiples of "
                         f"{sched.BLOCK_N} (the tile); pad the layer's weights")
    if num_experts % world:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the world size ({world})")
    if top_k > num_experts or top_k > 32:
        raise ValueError(f"top_k ({top_k}) must be <= num_experts ({num_experts}) and <= 32")
    if world > 8:
        raise ValueError(f"world size {world} > 8: the kernel is built for at most 8 ranks")


class _RankState:
    """One rank's buffers: the symmetric ones (peers write them) in one allocation, then the local ones."""

    # the kernel's peer table rows (megamoe.phases.PEER_KINDS; a test checks they agree)
    SYMMETRIC = ("pool", "pool_src", "pool_w", "combine", "counts", "barrier", "pool_scale")

    def __init__(self, hidden, intermediate, top_k, num_local, world, max_tokens, grid, device, group=None,
                 fp8=False):
        # each expert's rows start on a BLOCK_M boundary
        self.rows = world * max_tokens * top_k + num_local * sched.BLOCK_M
        from megamoe.phases import SCALE_PAIR, scale_units

        # the FP8 activation scales: per 128-row block, unit-major inside it (megamoe.phases.scale_index), as
        # rows of a stage's pair of units (the kernel's TMA view); bf16: one unused row
        scale_rows = (-(-self.rows // sched.BLOCK_M) * sched.BLOCK_M * scale_units(hidden, intermediate) // SCALE_PAIR
                      if fp8 else 1)
        slots = max_tokens * top_k
        ab = torch.float8_e4m3fn if fp8 else torch.bfloat16  # the GEMM operands
        shapes = {"pool": ((self.rows, hidden), ab), "pool_src": ((self.rows,), torch.int32),
                  "pool_w": ((self.rows,), torch.float32), "combine": ((slots, hidden), torch.bfloat16),
                  "counts": ((2 * num_local,), torch.int32), "barrier": ((1,), torch.int64),
                  "pool_scale": ((scale_rows, SCALE_PAIR), torch.float32)}
        offsets, total = {}, 0
        for name in self.SYMMETRIC:
            shape, dtype = shapes[name]
            offsets[name] = total
            total += -(-math.prod(shape) * dtype.itemsize // 256) * 256
        if group is not None and torch.distributed.get_world_size(group) > 1:
            import torch.distributed._symmetric_memory as symm_mem

            self.arena = symm_mem.empty(total, dtype=torch.uint8, device=device)
            self.handle = symm_mem.rendezvous(self.arena, group)
            self.bases = list(self.handle.buffer_ptrs)
        else:
            self.arena = torch.empty(total, dtype=torch.uint8, device=device)
            self.handle, self.bases = None, None
        self.arena.zero_()
        self.offsets = offsets
        for name in self.SYMMETRIC:
            shape, dtype = shapes[name]
            n = math.prod(shape)
            view = self.arena[offsets[name]:offsets[name] + n * dtype.itemsize].view(dtype).view(shape)
            setattr(self, name, view)
        self.inter = torch.empty(self.rows, intermediate, dtype=ab, device=device)
        self.inter_scale = torch.zeros(scale_rows, SCALE_PAIR, dtype=torch.float32, device=device)
        self.tok_slot = torch.zeros(slots, dtype=torch.int32, device=device)
        self.l1_done = torch.zeros(self.rows // sched.BLOCK_M, dtype=torch.int32, device=device)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)
        self.done = torch.zeros(1, dtype=torch.int32, device=device)
        self.errors = torch.zeros(4, dtype=torch.int32, device=device)

    def addresses(self) -> list[int]:
        """This rank's address of every symmetric buffer, in SYMMETRIC order (the peer table's rows)."""
        return [getattr(self, n).data_ptr() for n in self.SYMMETRIC]

    def peer_addresses(self, world) -> list[int]:
        """The peer table (SYMMETRIC x world) from symmetric memory's rendezvous."""
        return [self.bases[j] + self.offsets[n] for n in self.SYMMETRIC for j in range(world)]


class RoutingHistory:
    """The previous launch's rows per local expert for schedule="auto", without a host sync: after a launch, an
    asynchronous copy of ``counts`` into pinned memory and an event; ``latest`` reads it once the event has
    passed. The kernel leaves a launch's counts in the half of its epoch's parity and zeroes the other half at
    its start, so the halves' sum is the histogram (at real ranks a peer's next launch may already count into
    the other half: a blend of two launches, which only steers the heuristic). Not recorded while a CUDA graph
    is captured (a replayed graph runs the order resolved at capture)."""

    def __init__(self, counts: torch.Tensor):
        self.counts = counts
        self.host = torch.zeros(counts.numel(), dtype=counts.dtype, pin_memory=counts.is_cuda)
        self.event = torch.cuda.Event() if counts.is_cuda else None
        self.pending_tokens = None
        self.rows, self.tokens = None, None

    def capturing(self) -> bool:
        return self.counts.is_cuda and torch.cuda.is_current_stream_capturing()

    def record(self, tokens: int) -> None:
        """After a launch of ``tokens`` rows on the current stream (skipped while the last copy is in flight)."""
        if self.capturing():
            return
        self.latest()
        if self.pending_tokens is not None:
            return
        self.host.copy_(self.counts, non_blocking=self.counts.is_cuda)
        if self.event is not None:
            self.event.record()
        self.pending_tokens = int(tokens)

    def latest(self) -> tuple[tuple[int, ...] | None, int | None]:
        """(rows per local expert, the launch's tokens) of the newest landed copy, or (None, None)."""
        # no event query while a graph is captured (CUDA forbids it there; torch's allocator defers its own too)
        if self.pending_tokens is not None and not self.capturing() and (self.event is None or self.event.query()):
            half = self.host.numel() // 2
            self.rows = tuple((self.host[:half] + self.host[half:]).tolist())
            self.tokens, self.pending_tokens = self.pending_tokens, None
        return self.rows, self.tokens


def peer_table(states: list[_RankState], device) -> torch.Tensor:
    """The (SYMMETRIC x world) Int64 address table of ranks whose buffers are in one process (emulation)."""
    cols = [s.addresses() for s in states]
    return torch.tensor([cols[j][i] for i in range(len(_RankState.SYMMETRIC)) for j in range(len(states))],
                        dtype=torch.int64, device=device)


def stage_weight_scales(s1: torch.Tensor, s2: torch.Tensor, num_local: int, hidden: int, intermediate: int,
                        block_n: int = sched.BLOCK_N):
    """The weights' 128 x 128 block scales (``s1`` (E_l, 2I/128, H/128): gate blocks then up blocks; ``s2``
    (E_l, H/128, I/128); any shape of those elements) as the kernel's producer loads them with each stage, 16
    bytes per K block: w1 (E_l * I/128, H/128 * 4), per 256 interleaved rows (a 128 x 128 tile pair, or one
    128 x 256 tile) the gate and the up block's scale then two zeros; w2 per L2 N block of ``block_n`` rows:
    128 x 128 tiles (E_l * H/128, I/128 * 4) the block's scale twice then two zeros, 128 x 256 tiles
    (E_l * H/256, I/128 * 4) its two blocks' scales then two zeros."""
    e, h, i = num_local, hidden // 128, intermediate // 128
    g = s1.reshape(e, 2, i, h).float()
    w1 = torch.zeros(e, i, h, 4, dtype=torch.float32, device=s1.device)
    w1[..., 0], w1[..., 1] = g[:, 0], g[:, 1]
    b = s2.reshape(e, h, i).float()
    per = block_n // sched.BLOCK_N  # weight blocks per L2 N block: 1 (its scale twice) or 2
    w2 = torch.zeros(e, h // per, i, 4, dtype=torch.float32, device=s2.device)
    w2[..., 0], w2[..., 1] = b[:, 0::per], b[:, per - 1::per]
    return w1.view(e * i, h * 4), w2.view(e * h // per, i * 4)


def interleave_gate_up(l1: torch.Tensor) -> torch.Tensor:
    """(E, 2I, C) gate rows then up rows -> (E * 2I, C) whose 128-row block n holds gate rows [64n, 64n + 64)
    then up rows [64n, 64n + 64), for any per-row payload C (weights, packed codes, scale runs)."""
    e, two_i, c = l1.shape
    i = two_i // 2
    gate = l1[:, :i].reshape(e, i // 64, 64, c)
    up = l1[:, i:].reshape(e, i // 64, 64, c)
    return torch.stack((gate, up), dim=2).reshape(e * two_i, c).contiguous()


def transform_weights(w1: torch.Tensor, w2: torch.Tensor, experts: range) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout of experts ``experts`` (module docstring)."""
    w1t = interleave_gate_up(w1[experts.start:experts.stop])
    w2t = w2[experts.start:experts.stop]
    return w1t, w2t.reshape(-1, w2t.shape[-1]).contiguous()


def w4a8_shift_blocks(shift: torch.Tensor) -> torch.Tensor:
    """W4A8 run shifts (rows, K/32) in the kernel's order -> (rows/128, K/128 * 256) uint16: each 128 x 128
    block's 512 bytes together (row-major 128 rows x 4 runs, one TMA box per pipeline stage), clamped to
    megamoe.reference.W4A8_SHIFT_MAX."""
    from megamoe.reference import W4A8_SHIFT_MAX

    rows, runs = shift.shape
    d = shift.clamp(0, W4A8_SHIFT_MAX).to(torch.uint8).reshape(rows // 128, 128, runs // 4, 4)
    return d.permute(0, 2, 1, 3).contiguous().view(rows // 128, runs * 128).view(torch.uint16)


def w4a8_kernel_weights(w: torch.Tensor, gate_up: bool, device, chunk: int = 8):
    """W4A8 weights (E, N, K) bf16 in the kernel's layout (megamoe.reference's recipe): (the packed E2M1 codes
    (E * N, K / 2) uint8, two per byte, the even K index low; the shift blocks (w4a8_shift_blocks); each 128 x 128
    block's scale 2^e_max, fp32 flat (E, N / 128, K / 128): W8A8's scale slot). ``gate_up``: W1, whose rows
    (codes and shifts) are interleaved as the other precisions'. ``chunk`` experts at a time bound the fp32
    temporaries."""
    from megamoe.reference import quantize_mxfp4_weights, w4a8_block_shifts

    packed, shifts, scales = [], [], []
    for e0 in range(0, w.shape[0], chunk):
        p, ue8m0 = quantize_mxfp4_weights(w[e0:e0 + chunk].to(device))
        d, block_scale = w4a8_block_shifts(ue8m0)
        packed.append(p)
        shifts.append(d)
        scales.append(block_scale)
    p, d = torch.cat(packed), torch.cat(shifts)
    if gate_up:
        p, d = interleave_gate_up(p), interleave_gate_up(d)
    else:
        p, d = p.reshape(-1, p.shape[-1]).contiguous(), d.reshape(-1, d.shape[-1])
    return p, w4a8_shift_blocks(d), torch.cat(scales).contiguous().view(-1)


class MegaMoE:
    """One MoE layer on one rank of ``group`` (None: world size 1). ``schedule``: "interleaved" (Algorithm 1),
    "wave" (expert waves) or "auto" (megamoe.auto picks one from the model and the previous call's routing
    histogram, then the kernel times both orders and keeps the faster: megamoe.trial; ``auto_trial`` reads it),
    also per call; ``lead``: Algorithm 1's D in rows (None: schedule.d_lead, eq. 16's knee widened by the L2/L1
    mainloop ratio);
    ``instrument``: per-tile records (``last_dump``); ``num_sms``: CTAs of the persistent grid (default: every
    SM; it must be even for the interleaved order's CTA pairs)."""

    def __init__(self, group, num_experts: int, top_k: int, hidden: int, intermediate: int,
                 dtype=torch.bfloat16, schedule: str = "interleaved", lead: float | None = None,
                 max_tokens_per_rank: int = 8192, instrument: bool = False, num_sms: int | None = None,
                 device=None, _rank_world=None):
        self.precision = precision_of(dtype)
        self.fp8 = self.precision != "bf16"  # FP8 activations (W8A8, W4A8)
        if _rank_world is not None:
            self.rank, self.world = _rank_world
        elif group is None:
            self.rank, self.world = 0, 1
        else:
            self.rank, self.world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        _check_layer(num_experts, top_k, hidden, intermediate, self.world, max_tokens_per_rank)
        self.check_schedule(schedule)
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.num_experts, self.top_k, self.hidden, self.intermediate = num_experts, top_k, hidden, intermediate
        self.num_local = num_experts // self.world
        self.max_tokens, self.schedule, self.instrument = max_tokens_per_rank, schedule, bool(instrument)
        props = torch.cuda.get_device_properties(self.device)
        sms = props.multi_processor_count
        grid = sms if num_sms is None else int(num_sms)
        if not 2 <= grid <= sms:
            raise ValueError(f"num_sms must be in 2..{sms} (one CTA per SM), got {num_sms}")
        self.grid = grid - grid % 2
        # the kernel's tile, from the rows a local expert expects at capacity
        self.shape = sched.layer_shape(hidden, intermediate, self.precision, num_experts, top_k, self.world,
                                       max_tokens_per_rank)
        self.lead = sched.d_lead(self.shape, self.grid) if lead is None else float(lead)
        self.lead_rows = ts.lead_rows(self.lead)
        self.m_group = sched.row_group_size(self.precision)  # the walk's row groups (RankWork.raster)
        self.state = _RankState(hidden, intermediate, top_k, self.num_local, self.world, max_tokens_per_rank,
                                self.grid, self.device, group if _rank_world is None else None, self.fp8)
        # schedule="auto": ranks emulated on one GPU share its L2 (megamoe.auto's locality cost)
        self.ranks_per_gpu = self.world if _rank_world is not None else 1
        from megamoe.auto import L2_BYTES

        self.l2_bytes = float(getattr(props, "L2_cache_size", 0) or L2_BYTES)
        self.history = RoutingHistory(self.state.counts)
        # schedule="auto": per decision key a trial slot (megamoe.trial), zeroed once here, so a key first seen
        # while a graph is captured needs no initialising copy in it
        from megamoe.auto import TRIAL_WORDS

        self.trial_slots = torch.zeros(AUTO_KEYS, TRIAL_WORDS, dtype=torch.int64, device=self.device)
        self.auto_keys: dict = {}  # decision key -> (slot row or None, the rule's pick)
        self.auto_key = None  # the key of the last order resolved for "auto"
        self.peer_ptrs = None
        if self.state.bases is not None:
            self.peer_ptrs = torch.tensor(self.state.peer_addresses(self.world), dtype=torch.int64,
                                          device=self.device)
        elif self.world == 1:
            self.peer_ptrs = peer_table([self.state], self.device)
        self.rec_cap = 0
        self.records = torch.zeros(8, dtype=torch.int64, device=self.device)
        self.w1 = self.w2 = None
        from megamoe.kernel import MegaMoEForward

        # the weight scales as the kernel's stages take them (stage_weight_scales); one unused row for bf16
        self.w1_scale, self.w2_scale = (torch.zeros(1, k // 128 * 4, dtype=torch.float32, device=self.device)
                                        for k in (hidden, intermediate))
        # W4A8's shift blocks (load_weights); the other kernels take one unused row
        self.w1_shift, self.w2_shift = (torch.zeros(1, MegaMoEForward.shift_cols(k), dtype=torch.uint16,
                                                    device=self.device) for k in (hidden, intermediate))
        self.kernel = _compiled(hidden, intermediate, top_k, self.num_local, self.instrument, self.precision,
                                self.shape.block_n)
        from megamoe import ops

        self.handle = ops.register(self)  # torch.ops.xstage.megamoe names the layer by it

    @staticmethod
    def check_schedule(schedule):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")

    @property
    def experts(self) -> range:
        return range(self.rank * self.num_local, (self.rank + 1) * self.num_local)

    def load_weights(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        """``w1`` (E, 2I, H): gate rows [0, I) then up rows [I, 2I); ``w2`` (E, H, I); bf16, all E experts (this
        rank keeps its own, transformed once)."""
        E, H, I = self.num_experts, self.hidden, self.intermediate
        for name, w, shape in (("w1", w1, (E, 2 * I, H)), ("w2", w2, (E, H, I))):
            if not isinstance(w, torch.Tensor) or tuple(w.shape) != shape:
                raise ValueError(f"{name} must be a tensor of shape {shape}, got "
                                 f"{tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__}")
            if w.dtype != torch.bfloat16:
                raise ValueError(f"{name} must be bfloat16, got {w.dtype}")
        if not self.fp8:
            self.w1, self.w2 = (t.to(self.device) for t in transform_weights(w1, w2, self.experts))
            return
        if self.precision == "w4a8":
            self._load_w4a8(w1, w2)
            return
        # W8A8: 128 x 128 block scales in the weights' own layout (megamoe.reference's recipe), then the same
        # gate/up interleave on the e4m3 bytes; the kernel reads a tile's gate and up scales separately
        from megamoe.reference import quantize_fp8_blockwise_weights

        local = slice(self.experts.start, self.experts.stop)
        q1, s1 = quantize_fp8_blockwise_weights(w1[local].to(self.device))
        q2, s2 = quantize_fp8_blockwise_weights(w2[local].to(self.device))
        q1t, q2t = transform_weights(q1.view(torch.uint8), q2.view(torch.uint8), range(self.num_local))
        self.w1, self.w2 = q1t.view(torch.float8_e4m3fn), q2t.view(torch.float8_e4m3fn)
        self.w1_scale, self.w2_scale = stage_weight_scales(s1, s2, self.num_local, H, I, self.shape.block_n)

    def _load_w4a8(self, w1, w2):
        local = slice(self.experts.start, self.experts.stop)
        self.w1, self.w1_shift, s1 = w4a8_kernel_weights(w1[local], True, self.device)
        self.w2, self.w2_shift, s2 = w4a8_kernel_weights(w2[local], False, self.device)
        self.w1_scale, self.w2_scale = stage_weight_scales(s1, s2, self.num_local, self.hidden, self.intermediate)

    def check_inputs(self, x, topk_idx, topk_weights):
        if self.w1 is None:
            raise ValueError("no weights: call load_weights(w1, w2) first")
        for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, the layer on {self.device}: move it there")
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous (call .contiguous())")
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be (tokens, hidden={self.hidden}), got {tuple(x.shape)}")
        if x.dtype != torch.bfloat16:
            raise ValueError(f"x must be bfloat16, got {x.dtype}")
        T = x.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"{T} tokens > max_tokens_per_rank={self.max_tokens}: build the layer with a larger "
                             "max_tokens_per_rank")
        if tuple(topk_idx.shape) != (T, self.top_k) or tuple(topk_weights.shape) != (T, self.top_k):
            raise ValueError(f"topk_idx and topk_weights must be (tokens={T}, top_k={self.top_k}), got "
                             f"{tuple(topk_idx.shape)} and {tuple(topk_weights.shape)}")
        if topk_idx.dtype != torch.int32:
            raise ValueError(f"topk_idx must be int32, got {topk_idx.dtype} (use .to(torch.int32))")
        if topk_weights.dtype != torch.float32:
            raise ValueError(f"topk_weights must be float32, got {topk_weights.dtype}")
        if T and not torch.cuda.is_current_stream_capturing():
            lo, hi = int(topk_idx.min()), int(topk_idx.max())
            if lo < -1 or hi >= self.num_experts:
                raise ValueError(f"expert ids must be in [0, {self.num_experts}) or -1 (skip), got range "
                                 f"[{lo}, {hi}]")

    def experts_per_wave(self, tokens: int) -> int:
        """The wave heuristic (schedule.expert_wave_size) at the expected rows per local expert."""
        mean = tokens * self.top_k * self.world / self.num_experts
        return sched.expert_wave_size(self.num_local, mean, self.shape.l1_n_blocks, sched.BLOCK_M, self.grid)

    def enable_records(self, tiles_per_cta: int) -> None:
        """Room for ``tiles_per_cta`` records per CTA (instrument=True); forward grows it as needed."""
        if self.instrument and tiles_per_cta > self.rec_cap:
            self.rec_cap = tiles_per_cta
            from megamoe.epilogue import PHASE_FIELDS, REC_FIELDS

            # every CTA's tile records, then every CTA's phase stamps
            self.records = torch.zeros(self.grid * (tiles_per_cta * REC_FIELDS + PHASE_FIELDS), dtype=torch.int64,
                                       device=self.device)

    def resolve_schedule(self, tokens: int, schedule: str | None = None, peers=None) -> str:
        """The order a launch of ``tokens`` is given: ``schedule`` or the layer's; for "auto" the rule's pick
        (megamoe.auto.choose_schedule) from the previous launch's routing histogram of this rank (or of every
        layer in ``peers``: ranks emulated together decide together) from ``RoutingHistory`` (no host sync;
        before the first, the expected one), once per token bucket and histogram class (``auto.skew_class``),
        and ``auto_key`` names the key whose trial slot the launch hands the kernel (megamoe.trial: the kernel
        runs the rule's pick through the warm-up, then times both orders and keeps the faster)."""
        name = schedule or self.schedule
        self.auto_key = None
        if name != "auto":
            return name
        from megamoe import auto

        bucket = auto.token_bucket(tokens)
        seen = [p.history.latest() for p in (peers or [self])]
        if any(rows is None for rows, _ in seen):
            key, rank_rows = (bucket, None), None
        else:
            key = (bucket, tuple(auto.skew_class(rows) for rows, _ in seen))
            rank_rows = tuple(auto.scaled_rows(rows, t, bucket) for rows, t in seen)
        if key not in self.auto_keys:
            slot = len(self.auto_keys) if len(self.auto_keys) < AUTO_KEYS else None
            self.auto_keys[key] = (slot, auto.choose_schedule(
                self.hidden, self.intermediate, self.num_experts, self.top_k, self.world, bucket, self.grid,
                self.precision, rank_rows, self.ranks_per_gpu, self.l2_bytes))
        self.auto_key = key
        return self.auto_keys[key][1]

    def auto_trial(self, key=None) -> dict | None:
        """The trial of decision ``key`` (default: the last launch's; None if it had none), read from the device
        (synchronizes): megamoe.auto.read_trial's launches, prior, decided, times_us."""
        from megamoe import auto

        key = self.auto_key if key is None else key
        if key not in self.auto_keys:
            return None
        slot, prior = self.auto_keys[key]
        if slot is None:
            return {"launches": None, "prior": prior, "decided": None, "times_us": {}}
        return auto.read_trial(self.trial_slots[slot].tolist(), ts.ORDERS[prior])

    def trial_args(self, mode: int = TRIAL_OWN) -> tuple:
        """(slot, megamoe.trial mode) the kernel takes for the last resolved order: the auto key's slot in
        ``mode``, or (an unused row, TRIAL_OFF) where that order was given or its key got no slot."""
        slot = self.auto_keys[self.auto_key][0] if self.auto_key is not None else None
        return (self.trial_slots[0], TRIAL_OFF) if slot is None else (self.trial_slots[slot], mode)

    def launch(self, x, topk_idx, topk_weights, y, schedule=None, peer_ptrs=None, trial=None):
        """One launch on the current stream (no checks, no allocation: ``forward`` checks). ``trial``: (slot,
        megamoe.trial mode) for an auto launch another layer resolved (EmulatedMoE), ``schedule`` then its
        prior. An auto launch leaves its routing histogram for the next decision."""
        st = self.state
        if trial is None:
            name = self.resolve_schedule(x.shape[0], schedule)
            auto_launch = self.auto_key is not None
            trial = self.trial_args()
        else:
            name, auto_launch = schedule, True
        if self.instrument:
            rows = (self.world * self.max_tokens * self.top_k) // sched.BLOCK_M + self.num_local
            self.enable_records(2 * (-(-rows * (self.shape.l1_n_blocks + self.shape.l2_n_blocks) // self.grid))
                                + 64)
            self.records.zero_()
        self.kernel(x, topk_idx, topk_weights, self.w1, self.w2, y, st.pool, st.inter, st.pool_src, st.pool_w,
                    st.combine, st.counts, st.tok_slot, st.l1_done, st.barrier,
                    self.peer_ptrs if peer_ptrs is None else peer_ptrs, st.epoch, st.done, st.errors, self.records,
                    trial[0], st.pool_scale, st.inter_scale, self.w1_scale, self.w2_scale, self.w1_shift,
                    self.w2_shift, self.rank, self.world, self.max_tokens, ts.ORDERS[name], trial[1],
                    self.experts_per_wave(x.shape[0]), self.lead_rows, self.m_group, self.grid, TIMEOUT_NS,
                    self.rec_cap)
        if auto_launch:
            self.history.record(x.shape[0])

    def forward(self, x, topk_idx, topk_weights, schedule: str | None = None) -> torch.Tensor:
        if schedule is not None:
            self.check_schedule(schedule)
        if self.peer_ptrs is None:
            raise ValueError("this rank has no peer table: build it through EmulatedMoE or a process group")
        self.check_inputs(x, topk_idx, topk_weights)
        y = torch.empty_like(x)
        self.launch(x, topk_idx, topk_weights, y, schedule)
        return y

    def __call__(self, x, topk_idx, topk_weights, schedule: str | None = None) -> torch.Tensor:
        """``forward`` through the ``torch.ops.xstage.megamoe`` custom op (opaque to torch.compile / FX)."""
        return torch.ops.xstage.megamoe(x, topk_idx, topk_weights, self.handle, schedule or self.schedule)

    def check_errors(self) -> None:
        """Raise if a bounded wait of the kernel timed out or an expert id was out of range (synchronizes)."""
        from cute_kernels.runtime import check_error_word
        import megamoe.kernel  # noqa: F401  (registers the kernel's error names)

        check_error_word(self.state.errors, f"MegaMoE rank {self.rank}")

    def last_dump(self) -> dict:
        """The last launch's per-tile records (instrument=True) as numpy arrays, one entry per tile run:
        cta, kind (1 = L1, 2 = L2), expert, m, n (N blocks of ``shape.block_n`` columns), sm, t_entry, t_data
        (first K block in: the wait at tile entry ends), t_mma_end, t_end (the tile staged for its store warp;
        globaltimer ns), t_staging_wait (ns the MMA side waited for the staging rows at the epilogue: the
        counterpart of the paper's tmem_empty wait) and
        t_rs (L2: the store warp's span from issuing the Combine rows to their read-out, clock64 cycles),
        t_store_begin / t_store_end (globaltimer ns: the store warp took the staged rows / its wait for them
        returned: read out for L2, written for L1), load_wait_cycles (clock64 cycles warpgroup 0 waited on full
        stages in the mainloop: the tile's wait on its loads), mainloop_cycles (its clock64 cycles from t_entry to
        t_mma_end: over that span, the SM clock); and ``phase_stamps`` (CTAs x megamoe.epilogue.PHASES,
        globaltimer ns): each CTA's start, B1 and B2 passed, walk done, last rows written, B3 passed, sums done."""
        if not self.instrument:
            raise ValueError("build the layer with instrument=True to record tiles")
        import numpy as np

        from megamoe.epilogue import PHASE_FIELDS, REC_FIELDS

        tiles = self.grid * self.rec_cap * REC_FIELDS
        rec = self.records[:tiles].view(self.grid, self.rec_cap, REC_FIELDS).cpu().numpy()
        phases = self.records[tiles:].view(self.grid, PHASE_FIELDS).cpu().numpy()
        used = rec[:, :, 4] != 0
        cta = np.nonzero(used)[0]
        r = rec[used]
        packed = r[:, 0]
        return {"cta": cta, "slot": np.nonzero(used)[1], "kind": packed >> 56, "expert": (packed >> 40) & 0xFFFF,
                "m": (packed >> 20) & 0xFFFFF, "n": packed & 0xFFFFF, "sm": r[:, 1], "t_entry": r[:, 2],
                "t_data": r[:, 3], "t_mma_end": r[:, 4], "t_end": r[:, 5], "t_rs": r[:, 6],
                "t_staging_wait": r[:, 7], "t_store_begin": r[:, 8], "t_store_end": r[:, 9],
                "load_wait_cycles": r[:, 10], "mainloop_cycles": r[:, 11],
                "phase_stamps": phases}


class EmulatedMoE:
    """P ranks of one layer on one GPU: rank r is a MegaMoE over ``sms // P`` CTAs (even), the P launches
    run concurrently on P streams, with pointer tables into each other's buffers."""

    def __init__(self, world: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
                 max_tokens_per_rank: int = 4096, schedule: str = "interleaved", lead=None, instrument=False,
                 device=None, dtype=torch.bfloat16):
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        sms = torch.cuda.get_device_properties(device or torch.cuda.current_device()).multi_processor_count
        per = (sms // world) - (sms // world) % 2
        self.ranks = [MegaMoE(None, num_experts, top_k, hidden, intermediate, dtype=dtype, schedule=schedule, lead=lead,
                              max_tokens_per_rank=max_tokens_per_rank, instrument=instrument, num_sms=per,
                              device=device, _rank_world=(r, world)) for r in range(world)]
        table = peer_table([m.state for m in self.ranks], self.ranks[0].device)
        for m in self.ranks:
            m.peer_ptrs = table
        self.streams = [torch.cuda.Stream(self.ranks[0].device) for _ in range(world)]

    def load_weights(self, w1, w2):
        for m in self.ranks:
            m.load_weights(w1, w2)

    def forward(self, xs, idxs, weights, schedule=None) -> list[torch.Tensor]:
        """Every rank's layer at once: ``xs[r]`` etc. are rank r's inputs; returns each rank's y."""
        if not len(xs) == len(idxs) == len(weights) == len(self.ranks):
            raise ValueError(f"give one x, topk_idx and topk_weights per rank ({len(self.ranks)})")
        for m, x, i, w in zip(self.ranks, xs, idxs, weights):
            m.check_inputs(x, i, w)
        ys = [torch.empty_like(x) for x in xs]
        trials = [None] * len(self.ranks)
        if (schedule or self.ranks[0].schedule) == "auto":
            # one order for all ranks: the lead resolves it from all their histograms, its launch times itself
            # into its slot (megamoe.trial) and the other ranks' launches read the same slot
            lead = self.ranks[0]
            schedule = lead.resolve_schedule(max(x.shape[0] for x in xs), "auto", peers=self.ranks)
            trials = [lead.trial_args(TRIAL_OWN if r == 0 else TRIAL_READ) for r in range(len(self.ranks))]
        main = torch.cuda.current_stream()
        for m, s, x, i, w, y, t in zip(self.ranks, self.streams, xs, idxs, weights, ys, trials):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                m.launch(x, i, w, y, schedule, trial=t)
        for s in self.streams:
            main.wait_stream(s)
        return ys

    def check_errors(self):
        for m in self.ranks:
            m.check_errors()
