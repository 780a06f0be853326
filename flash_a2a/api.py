"""Python API of the fused FlashAttention + Ulysses All-to-All.

- ``flash_attention(q, k, v)``: our persistent Hopper attention alone (the FA-only column), one GPU.
- ``fused_attention_a2a(q, k, v, group)``: q/k/v head-partitioned (b, S, H/P, d) on each rank; returns this
  rank's (b, S/P, H, d) output, complete and safe to read on the current stream. The output lives in a
  symmetric buffer reused by the next call of the same shape: consume or clone it before then.
- ``FusedAttentionA2A(group).launch(...)``: the same with the options a benchmark needs (sender-side timing,
  spans, the self-store control, the per-shape choices forced).

Every entry validates its input and raises ``ValueError`` (or ``NotImplementedError`` for options we do
not support) before any launch. Kernels launch on torch's current stream and are CUDA-Graph capturable
once warmed up outside capture. What each shape runs (split tail, paced store, relay) is decided once by
``flash_a2a.config.resolve_config``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cute_kernels.dist import meet_after_compile
from cute_kernels.runtime import TORCH_TO_CUTLASS, check_error_word
from flash_a2a.a2a import SymmetricOutput
from flash_a2a.attention import MODES, FlashAttentionA2AForward
from flash_a2a.tiling import PARTIAL_FLOATS, TILE_N, WG_THREADS
from flash_a2a.config import AttentionConfig, query_tile_rows, resolve_config
from flash_a2a.mapping import check_ulysses_shapes, relay_share, ulysses_tiles
from flash_a2a.spans import SPAN_FIELDS, dump_rows

_KERNELS: dict = {}
DEFAULT_TIMEOUT_NS = 2_000_000_000


def _kernel(dtype, head_dim: int, mode: str, n_dst: int = 1, instrument: bool = False, **launch):
    """The compiled kernel, once per (dtype, head_dim, mode, n_dst, instrument, walk, store, relay)."""
    key = (dtype, head_dim, mode, n_dst, instrument, tuple(sorted(launch.items())))
    if key not in _KERNELS:
        from cutlass.runtime import make_fake_stream

        from cute_kernels.compile import compile_kernel

        k = FlashAttentionA2AForward(TORCH_TO_CUTLASS[dtype], head_dim, mode, n_dst=n_dst, instrument=instrument,
                                     **launch)
        _KERNELS[key] = compile_kernel(k, *k.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True))
    return _KERNELS[key]


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, world: int = 1) -> None:
    """ValueError naming the fix for anything the kernel does not take; nothing is launched."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, seqlen, heads, head_dim)")
        if t.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"{name} must be bfloat16 or float16, got {t.dtype}")
        if not t.is_cuda:
            raise ValueError(f"{name} must be a CUDA tensor")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (head_dim); call .contiguous()")
        if any((st * t.element_size()) % 16 for st in t.stride()[:-1]) or t.data_ptr() % 16:
            raise ValueError(f"{name} strides and base must be 16-byte aligned; call .contiguous()")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device) or q.device.index != torch.cuda.current_device():
        raise ValueError(f"q, k, v must all live on the current device cuda:{torch.cuda.current_device()}")
    check_shapes(tuple(q.shape), tuple(k.shape), tuple(v.shape), world)


def check_shapes(q_shape: tuple, k_shape: tuple, v_shape: tuple, world: int = 1) -> None:
    """ValueError naming the fix unless q (b, S, H, d) and k, v (b, S_kv, H_kv, d) are shapes the kernel takes:
    H a multiple of H_kv, d 64 or 128, S and S_kv >= 1 (any length; the fused tile orders, ``world`` > 1, need
    S divisible by the world size, as Ulysses does)."""
    b, s, h, d = q_shape
    if k_shape != v_shape or k_shape[0] != b or k_shape[3] != d:
        raise ValueError(f"k and v must share one shape (b, S_kv, H_kv, d) with q's batch and head_dim, got q "
                         f"{q_shape}, k {k_shape}, v {v_shape}")
    s_kv, h_kv = k_shape[1], k_shape[2]
    if h % h_kv:
        raise ValueError(f"q's {h} heads must be a multiple of k/v's {h_kv} (GQA/MQA: H_q divisible by H_kv)")
    if d not in (64, 128):
        raise ValueError(f"head_dim must be 64 or 128, got {d}")
    if s < 1 or s_kv < 1:
        raise ValueError(f"sequence lengths must be positive, got S={s}, S_kv={s_kv}")
    if world > 1 and s % world:
        raise ValueError(f"sequence length {s} is not divisible by the world size {world}: Ulysses splits the "
                         f"sequence evenly over the ranks; use a length divisible by {world}")


def _partial_tiles(s: int, world: int, tile_m: int, s_kv: int) -> tuple[bool, bool]:
    """(masked_q, masked_kv): a partial last Q tile (of S, or in the Ulysses order of each rank's S/P slice)
    and a partial last KV block."""
    return bool((s // world) % tile_m), bool(s_kv % TILE_N)


def check_spans(spans, n_tiles: int, device, grid: int = 0) -> None:
    """The instrumentation buffer (flash_a2a.spans): int64 (dump_rows(n_tiles, grid), 4) on the kernel's device,
    one row per (tile, MMA warpgroup), then the fused kernel's one per CTA of its ``grid`` (0: FA-only)."""
    if spans is None:
        return
    rows = dump_rows(n_tiles, grid)
    if (not isinstance(spans, torch.Tensor) or spans.dtype != torch.int64 or spans.device != device
            or spans.dim() != 2 or spans.shape[0] < rows or spans.shape[1] != len(SPAN_FIELDS)
            or not spans.is_contiguous()):
        raise ValueError(f"spans must be a contiguous int64 tensor of shape ({rows}, 4) on {device} "
                         f"(one row per tile and MMA warpgroup, then one per CTA of the fused kernel); allocate "
                         f"torch.zeros({rows}, 4, dtype=torch.int64)")


def _scale(softmax_scale, d):
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)


def _grid(n_tiles: int, device) -> int:
    """Persistent: one CTA per SM (the kernel walks its tiles)."""
    return max(1, min(n_tiles, torch.cuda.get_device_properties(device).multi_processor_count))


class _LocalArgs:
    """What the local kernel takes but never reads: it shares the fused kernel's argument list (the flag
    protocol's buffers, the destination table) so that FA-only is the fused kernel's code minus the protocol,
    and the spans buffer when not instrumented. One small set per device."""

    def __init__(self, device):
        self.dst_ptrs = torch.zeros(1, dtype=torch.int64, device=device)
        self.flag_ptrs = torch.zeros(1, dtype=torch.int64, device=device)
        self.flags = torch.zeros(1, dtype=torch.int64, device=device)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)
        self.counter = torch.zeros(4, dtype=torch.int32, device=device)
        self.errors = torch.zeros(4, dtype=torch.int32, device=device)
        self.spans = torch.zeros(1, 4, dtype=torch.int64, device=device)


_LOCAL_ARGS: dict = {}


def _local_args(device) -> _LocalArgs:
    if device not in _LOCAL_ARGS:
        _LOCAL_ARGS[device] = _LocalArgs(device)
    return _LOCAL_ARGS[device]


@dataclass
class SplitTailBuffers:
    """The split tail's run-time state for one shape: the chunks' float32 partials, one Int32 counter per
    split tile (zero between launches: the k-th chunk resets it) and the chunk count. Allocated once, so
    CUDA-Graph capture and replay see the same buffers; launches of one shape on two streams at once must be
    ordered (an event) or run with tail_split=False, as the fused op's symmetric output already requires."""

    workspace: torch.Tensor
    counters: torch.Tensor
    k: int

    @staticmethod
    def allocate(device, config: AttentionConfig) -> "SplitTailBuffers":
        tail = config.n_tiles % config.grid
        floats = max(1, tail * config.split_k * 2 * WG_THREADS * PARTIAL_FLOATS)
        return SplitTailBuffers(torch.empty(floats, dtype=torch.float32, device=device),
                                torch.zeros(max(1, tail), dtype=torch.int32, device=device), config.split_k)


_SPLIT_BUFFERS: dict = {}


def _split_buffers(device, config: AttentionConfig) -> SplitTailBuffers:
    key = (device, config.n_tiles, config.grid, config.n_kv)
    if key not in _SPLIT_BUFFERS:
        _SPLIT_BUFFERS[key] = SplitTailBuffers.allocate(device, config)
    return _SPLIT_BUFFERS[key]


def _kernels_of(config: AttentionConfig, dtype, head_dim: int, mode: str, n_dst: int, instrument: bool,
                split: SplitTailBuffers | None, dst_ptrs, relay_ptrs=None, separate_kv: bool = False,
                lse: bool = False, masked_q: bool = False, masked_kv: bool = False,
                ranked: bool = False) -> list[tuple]:
    """The config's kernels in launch order, each with its arguments beyond the shared ones: (compiled kernel,
    destinations, (split workspace, counters, k), relay shadows). With a split the whole rounds go first (to
    ``dst_ptrs``, or with the relay to the local shadows), then the chunks; ``relay_ptrs`` =
    (the real destinations, the rounds kernel's table, the shadows to send on). ``separate_kv``: k/v of
    another shape than q (cross-attention, GQA); ``lse``: the kernel writes the log-sum-exp too; ``masked_q`` /
    ``masked_kv``: S / S_kv not a multiple of the tile's rows / the KV block; ``ranked``: the tile order's rank
    slices not multiples of the tile (``ulysses_tiles``)."""
    kernels = []
    for launch in config.launches():
        ptrs, work, shadows = dst_ptrs, (None, None, 1), None
        if launch["walk"] == "rounds" and config.relay:
            ptrs = relay_ptrs[1]  # the peer tiles to local shadows (this rank's own tiles to its buffer)
        if launch["walk"] == "tail":
            work = (split.workspace, split.counters, split.k)
            if config.relay:
                ptrs, shadows = relay_ptrs[0], relay_ptrs[2]
        flags = {"separate_kv": separate_kv, "lse": lse, "masked_q": masked_q, "masked_kv": masked_kv,
                 "ranked": ranked}
        variant = {**launch, **{name: True for name, on in flags.items() if on}}
        kernels.append((_kernel(dtype, head_dim, mode, n_dst, instrument, **variant), ptrs, work, shadows))
    return kernels


def flash_attention(q, k, v, softmax_scale=None, out=None, spans=None, tail_split="auto", tile_order_world: int = 1,
                    tile_order_rank: int = 0, return_lse: bool = False):
    """Non-causal attention softmax(q kᵀ · scale) v on one GPU: q (b, S, H, d), k and v (b, S_kv, H_kv, d) (cross-
    attention where S_kv != S; GQA/MQA where H_kv divides H), out (b, S, H, d).

    ``tail_split`` (flash_a2a.config.resolve_config): "auto" (the default) runs the persistent walk's last,
    partly empty round as KV chunks in a second, programmatic dependent launch where that pays; True wherever
    some split shortens it; False never. A split tile differs from the unsplit kernel's in the last bits
    (another summation order) and is the same bit for bit in the fused kernel with the same split.
    ``tile_order_world=P`` walks the tiles in the fused kernel's order for P ranks (destination rank fastest;
    ``tile_order_rank``'s own tiles end the walk) without changing the result, so FA-only and fused runs can be
    compared on the same schedule. ``spans``: per-tile instrumentation (``check_spans``). ``return_lse``: also
    return each row's softmax log-sum-exp, float32 (b, H, S), natural log of the scaled logits (flash-attn's
    ``softmax_lse``), as ``(out, lse)``; such a launch runs unsplit."""
    if not (isinstance(tile_order_world, int) and tile_order_world >= 1):
        raise ValueError(f"tile_order_world must be an int >= 1, got {tile_order_world!r}")
    if not 0 <= tile_order_rank < tile_order_world:
        raise ValueError(f"tile_order_rank must be in [0, {tile_order_world}) (a rank of the tile order's "
                         f"world), got {tile_order_rank}")
    check_qkv(q, k, v, tile_order_world)
    b, s, h, d = q.shape
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError("out must be a contiguous tensor of q's shape and dtype")
    tile_m = query_tile_rows(d, spans is not None)
    n_tiles = ulysses_tiles(s, tile_order_world, tile_m) * h * b
    masked_q, masked_kv = _partial_tiles(s, tile_order_world, tile_m, k.shape[1])
    ranked = masked_q and tile_order_world > 1  # rows counted from each rank's slice
    if return_lse and ranked:
        raise ValueError(f"return_lse=True with tile_order_world > 1 needs S/P a multiple of {tile_m}; pass "
                         "tile_order_world=1 (the same values)")
    check_spans(spans, n_tiles, q.device)
    grid = _grid(n_tiles, q.device)
    config = resolve_config("local", n_tiles, grid, -(-k.shape[1] // TILE_N), 1, head_dim=d,
                            instrument=spans is not None, lse=bool(return_lse), masked=masked_q or masked_kv,
                            tail_split=tail_split, tile_m=tile_m)
    la = _local_args(q.device)
    split = _split_buffers(q.device, config) if config.tail_split else None
    lse = torch.empty(b, h, s, dtype=torch.float32, device=q.device) if return_lse else None
    head = (la.flag_ptrs, la.flags, la.epoch, la.counter, la.errors, spans if spans is not None else la.spans)
    tail = (_scale(softmax_scale, d), tile_order_rank, tile_order_world, grid, DEFAULT_TIMEOUT_NS)
    for fn, ptrs, work, shadows in _kernels_of(config, q.dtype, d, "local", 1, spans is not None, split,
                                               la.dst_ptrs, separate_kv=k.shape != q.shape, lse=lse is not None,
                                               masked_q=masked_q, masked_kv=masked_kv, ranked=ranked):
        fn(q, k, v, out, ptrs, *head, *tail, *work, shadows, lse)
    return (out, lse) if return_lse else out


class FusedAttentionA2A:
    """Holds the symmetric output buffers of one process group (one per shape and dtype)."""

    def __init__(self, group=None, timeout_s: float = 2.0):
        self.group = group or dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.timeout_ns = int(timeout_s * 1e9)
        self.states: dict = {}
        self.decided: dict = {}  # (b, S, H/P, d, dtype) -> the AttentionConfig of the last launch of that shape

    def state(self, q) -> SymmetricOutput:
        b, s, h_loc, d = q.shape
        key = (b, s, h_loc, d, q.dtype)
        if key not in self.states:
            self.states[key] = SymmetricOutput(self.group, (b, s // self.world, h_loc * self.world, d), q.dtype,
                                               q.device)
        return self.states[key]

    def config(self, q, mode: str = "piggyback", spans=None, tail_split="auto", store="auto", relay="auto",
               k_len: int | None = None) -> AttentionConfig:
        """What ``launch`` with these arguments runs for q's shape (no launch, no allocation); ``k_len``: the
        key/value length (q's by default)."""
        k_len = q.shape[1] if k_len is None else k_len
        b, s, h_loc, d = q.shape
        tile_m = query_tile_rows(d, spans is not None)
        n_tiles = ulysses_tiles(s, self.world, tile_m) * h_loc * b
        vectors = relay_share(0, 1, self.world, b, s // self.world, h_loc, d * q.element_size() // 16)[2]
        masked = any(_partial_tiles(s, self.world, tile_m, k_len))
        return resolve_config(mode, n_tiles, _grid(n_tiles, q.device), -(-k_len // TILE_N), self.world,
                              head_dim=d, instrument=spans is not None, masked=masked, relay_vectors=vectors,
                              tile_m=tile_m, tail_split=tail_split, store=store, relay=relay)

    def launch(self, q, k, v, softmax_scale=None, mode: str = "piggyback", wait: bool = True, spans=None,
               self_store: bool = False, tail_split="auto", store="auto", relay="auto"):
        """Attention kernel (it advances the epoch itself), then the receiver's wait for every sender's data
        (``wait=False`` leaves it out, for sender-side timing; ``settle`` later covers every earlier epoch).
        ``self_store=True`` (the paper's local-store control, the output is garbage): every tile goes to this
        rank's own buffer at its destination offset, so the same fused kernel runs without NVLink traffic.
        ``tail_split``, ``store``, ``relay``: "auto" (the defaults) decide per shape
        (flash_a2a.config.resolve_config); an explicit value is kept where the kernel takes it. With a split
        the rounds kernel sends every peer tile and the tail kernel (local tiles only) raises the flags once the
        rounds kernel is complete. What the launch ran is ``self.decided[(b, S, H/P, d, dtype)]``."""
        if mode not in MODES[1:]:
            raise ValueError(f"mode must be 'piggyback' or 'completion_coupled', got {mode!r}")
        check_qkv(q, k, v, self.world)
        check_ulysses_shapes(q.shape[1], q.shape[2] * self.world, self.world)
        b, s, h_loc, d = q.shape
        config = self.config(q, mode, spans, tail_split, store, relay, k.shape[1])
        n_tiles, grid = config.n_tiles, config.grid
        # a partial last tile per rank slice (its rows counted from the slice: ranked), a partial KV block
        masked_q, masked_kv = _partial_tiles(s, self.world, config.tile_m, k.shape[1])
        ranked = masked_q
        check_spans(spans, n_tiles, q.device, grid)
        st = self.state(q)
        self.decided[(b, s, h_loc, d, q.dtype)] = config
        dst_ptrs = st.self_ptrs if self_store else st.out_ptrs
        split = relay_ptrs = None
        if config.tail_split:
            key = ("tail", self_store, n_tiles, grid)
            if key not in st.extra:  # its own workspace and counters (not shared with flash_attention's)
                st.extra[key] = SplitTailBuffers.allocate(q.device, config)
            split = st.extra[key]
            if config.relay:
                relay_ptrs = self._relay_ptrs(st, self_store, n_tiles, grid, dst_ptrs)
        head = (st.flag_ptrs, st.flags, st.epoch, st.counter, st.errors,
                spans if spans is not None else _local_args(q.device).spans)
        tail = (_scale(softmax_scale, d), self.rank, self.world, grid, self.timeout_ns)
        compiled = len(_KERNELS)
        kernels = _kernels_of(config, q.dtype, d, mode, self.world, spans is not None, split, dst_ptrs, relay_ptrs,
                              separate_kv=k.shape != q.shape, masked_q=masked_q, masked_kv=masked_kv, ranked=ranked)
        meet_after_compile(compiled, len(_KERNELS), self.group)  # a rank that compiled: start together
        for fn, ptrs, work, shadows in kernels:
            fn(q, k, v, q, ptrs, *head, *tail, *work, shadows, None)
        if wait:
            st.wait(self.world, self.timeout_ns)
        return st.out

    def _relay_ptrs(self, st: SymmetricOutput, self_store: bool, n_tiles: int, grid: int, dst_ptrs):
        """relay: (the tail kernel's destinations, the rounds kernel's: this rank's own buffer and a local shadow
        (b, S/P, H, d) for each peer, the tail kernel's shadows: each peer's, 0 for this rank). The shadows are
        allocated once per shape, like the split's workspace, so graph replays see the same addresses."""
        key = ("relay", self_store, n_tiles, grid)
        if key not in st.extra:
            bases = [st.out.data_ptr()] * self.world if self_store else list(st.handles[0].buffer_ptrs)
            shadows = {j: torch.empty(st.out.shape, dtype=st.out.dtype, device=st.out.device)
                       for j in range(self.world) if j != self.rank}
            rounds = torch.tensor([shadows[j].data_ptr() if j in shadows else bases[j] for j in range(self.world)],
                                  dtype=torch.int64, device=st.out.device)
            shadow_ptrs = torch.tensor([shadows[j].data_ptr() if j in shadows else 0 for j in range(self.world)],
                                       dtype=torch.int64, device=st.out.device)
            st.extra[key] = (dst_ptrs, rounds, shadow_ptrs, shadows)
        return st.extra[key][:3]

    def settle(self, q) -> None:
        """Wait (on the current stream) for the data of every launch so far with q's shape."""
        self.state(q).wait(self.world, self.timeout_ns)

    __call__ = launch

    def check(self) -> None:
        """Raise if any launch so far hit a bounded-wait timeout (synchronizes)."""
        for st in self.states.values():
            check_error_word(st.errors, f"fused attention + All-to-All on rank {self.rank}")


_FUSED: dict = {}


def fused_attention_a2a(q, k, v, group=None, softmax_scale=None, mode: str = "piggyback") -> torch.Tensor:
    """(b, S, H/P, d) per rank -> this rank's (b, S/P, H, d) attention output after the Ulysses All-to-All."""
    group = group or dist.group.WORLD
    if group not in _FUSED:
        _FUSED[group] = FusedAttentionA2A(group)
    return _FUSED[group](q, k, v, softmax_scale, mode)
