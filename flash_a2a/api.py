"""Python API of the fused FlashAttention + Ulysses All-to-All.

- ``flash_attention(q, k, v)``: our persistent Hopper attention alone (the FA-only column), one GPU.
- ``fused_attention_a2a(q, k, v, group)``: q/k/v head-partitioned (b, S, H/P, d) on each rank; returns this
  rank's (b, S/P, H, d) output, complete and safe to read on the current stream. The output lives in a
  symmetric buffer reused by the next call of the same shape: consume or clone it before then.
- ``UlyssesAttention(group)``: drop-in for yunchang's ``UlyssesAttention`` (q/k/v in (b, S/P, H, d)).

Every entry validates its input and raises ``ValueError`` (or ``NotImplementedError`` for options we do
not support) before any launch. Kernels launch on torch's current stream and are CUDA-Graph capturable
once warmed up outside capture.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from cute_kernels.dist import meet_after_compile
from cute_kernels.runtime import TORCH_TO_CUTLASS, check_error_word
from flash_a2a.a2a import SymmetricOutput
from flash_a2a.attention import MODES, PARTIAL_FLOATS, TILE_M, TILE_N, FlashAttentionA2AForward
from flash_a2a.mapping import (PACE_KV, RELAY_THREADS, check_ulysses_shapes, choose_tail_split, cluster_walk_pairs,
                              paced_store_pays, relay_pays, relay_share, resolve_tail_split)

_KERNELS: dict = {}
DEFAULT_TIMEOUT_NS = 2_000_000_000


def _kernel(dtype, head_dim: int, mode: str, instrument: bool = False, overlap: bool = True, **variant):
    key = (dtype, head_dim, mode, instrument, overlap, tuple(sorted(variant.items())))
    if key not in _KERNELS:
        from cutlass.runtime import make_fake_stream

        from cute_kernels.compile import compile_kernel

        k = FlashAttentionA2AForward(TORCH_TO_CUTLASS[dtype], head_dim, mode, instrument=instrument,
                                     overlap=overlap, **variant)
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
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have one shape (self-attention, no GQA), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, s, h, d = q.shape
    if d not in (64, 128):
        raise ValueError(f"head_dim must be 64 or 128, got {d}")
    if s % (world * TILE_M):
        raise ValueError(f"sequence length {s} must be a multiple of {world * TILE_M} "
                         f"({world} rank(s) x {TILE_M}-row tiles); pad the sequence")


def check_spans(spans, n_tiles: int, device, extra_rows: int = 0) -> None:
    """The instrumentation buffer: int64 (n_tiles x 2 MMA warpgroups + ``extra_rows``, 4) on the kernel's
    device: per tile row the remote-store span (globaltimer start, end; clock64 start, end); the fused kernel
    adds one row per CTA (``extra_rows`` = its grid) for the ready protocol (flash_a2a.spans.ready_rows)."""
    if spans is None:
        return
    rows = n_tiles * (TILE_M // 64) + extra_rows
    if (not isinstance(spans, torch.Tensor) or spans.dtype != torch.int64 or spans.device != device
            or spans.dim() != 2 or spans.shape[0] < rows or spans.shape[1] != 4 or not spans.is_contiguous()):
        raise ValueError(f"spans must be a contiguous int64 tensor of shape ({rows}, 4) on {device} "
                         f"(one row per tile and MMA warpgroup, then one per CTA of the fused kernel); allocate "
                         f"torch.zeros({rows}, 4, dtype=torch.int64)")


def _scale(softmax_scale, d):
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)


def _grid(n_tiles: int, device, persistent: bool = True) -> int:
    """Persistent: one CTA per SM (the kernel walks its tiles); otherwise one CTA per tile, scheduled by the
    hardware as SMs free up (FA4's SM90 launch)."""
    if not persistent:
        return max(1, n_tiles)
    return max(1, min(n_tiles, torch.cuda.get_device_properties(device).multi_processor_count))


class _Dummy:
    """Small placeholders for arguments a variant does not read (kept so every variant has one signature)."""

    def __init__(self, device):
        self.i64 = torch.zeros(1, dtype=torch.int64, device=device)
        self.i32 = torch.zeros(4, dtype=torch.int32, device=device)
        self.spans = torch.zeros(1, 4, dtype=torch.int64, device=device)


_DUMMIES: dict = {}


def _dummy(device) -> _Dummy:
    if device not in _DUMMIES:
        _DUMMIES[device] = _Dummy(device)
    return _DUMMIES[device]


# The fused kernel's tile walk, used by every FusedAttentionA2A launch unless a variant names its own (and by
# the benchmark's FA-only control, so both walk the same tiles): see flash_a2a.mapping.tile_halves.
FUSED_WALK = {"cross_halves": False}


def flash_attention(q, k, v, softmax_scale=None, out=None, spans=None, overlap: bool = True,
                    tile_order_world: int = 1, persistent: bool = True, tile_order_rank: int = 0,
                    **variant) -> torch.Tensor:
    """Non-causal attention softmax(q kᵀ · scale) v on one GPU, (b, S, H, d) in and out.

    ``overlap=False`` selects the plain mainloop (no intra-warpgroup overlap, no ping-pong).
    ``tile_order_world=P`` walks the tiles in the fused kernel's order for P ranks (destination rank fastest)
    without changing the result, so FA-only and fused runs can be compared on the same schedule;
    ``tile_order_rank`` names the rank whose order that is (its own tiles end the walk).
    ``variant`` passes mainloop knobs of ``FlashAttentionA2AForward`` (``lag_v``, ``sync_first_block``,
    ``pin_softmax``, ``cross_halves``: the crossed walk, with ``tile_order_world``) for
    side-by-side benchmarks; ``persistent=False`` launches one CTA per tile instead of one per SM.
    ``tail_split`` (the persistent walk's last, partly empty round in KV chunks over the CTAs that would idle;
    ``mapping.resolve_tail_split``): "auto" (the default) takes "launch", the whole rounds in the default
    kernel and then the chunks in a second, programmatic dependent launch, wherever the last round splits;
    True/"kernel" splits inside the one launch (its KV loop then schedules slower, every tile); False never.
    A split tile differs from the unsplit kernel's in the last bits (another summation order) and is the
    same bit for bit in the fused kernel with the same option. The split's workspace is per shape: calls of
    one shape on concurrent streams must be ordered (or pass tail_split=False)."""
    if not 0 <= tile_order_rank < tile_order_world:
        raise ValueError(f"tile_order_rank must be in [0, {tile_order_world}) (a rank of the tile order's "
                         f"world), got {tile_order_rank}")
    check_qkv(q, k, v, tile_order_world)
    b, s, h, d = q.shape
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError("out must be a contiguous tensor of q's shape and dtype")
    n_tiles = (s // TILE_M) * h * b
    n_kv = _kv_blocks(s, variant)
    check_spans(spans, n_tiles, q.device)
    dm = _dummy(q.device)
    grid = _grid(n_tiles, q.device, persistent)
    knobs = {"head_dim": d, "mode": "local", "overlap": overlap, "instrument": spans is not None, **variant}
    plan, variant = _split_plan(variant, knobs, n_tiles, grid, n_kv, 1, persistent)
    _check_cluster(variant, plan, n_tiles, grid, tile_order_world, tile_order_rank, s // tile_order_world // TILE_M,
                   h)
    args = (q, k, v, out)
    rest = (dm.i64, dm.i64, dm.i64, dm.i32, dm.i32, spans if spans is not None else dm.spans, (out,),
            _scale(softmax_scale, d), tile_order_rank, tile_order_world, grid, DEFAULT_TIMEOUT_NS)
    if plan == "launch":  # the whole rounds, then the last round's chunks (programmatic dependent launch)
        _kernel(q.dtype, d, "local", False, overlap, walk="rounds", **variant)(*args, dm.i64, *rest)
        _kernel(q.dtype, d, "local", False, overlap, walk="tail", tail_split=True, **_tail_knobs(variant, False))(
            *args, _tail_split_args(q.device, n_tiles, grid, n_kv), *rest)
        return out
    out_ptrs = dm.i64
    if plan == "kernel":
        variant = {**variant, "tail_split": True}
        out_ptrs = _tail_split_args(q.device, n_tiles, grid, n_kv)
    _kernel(q.dtype, d, "local", spans is not None, overlap, **variant)(*args, out_ptrs, *rest)
    return out


def _split_plan(variant: dict, knobs: dict, n_tiles: int, grid: int, n_kv: int, world: int,
                persistent: bool = True):
    """(plan, variant without ``tail_split``): the ``tail_split`` knob (default "auto") decided for this walk
    (mapping.resolve_tail_split: False, "kernel" or "launch"). ``knobs``: the kernel's other constructor
    arguments. "auto" falls back to no split where the split kernel does not take them (spans, head_dim 64,
    a non-persistent launch, another epilogue or walk); an explicit split raises ValueError naming them."""
    option = variant.get("tail_split", "auto")
    rest = {k: v for k, v in variant.items() if k != "tail_split"}
    plan = resolve_tail_split(option, n_tiles, grid, n_kv, world)
    if not plan:
        return False, rest
    # cluster_kv applies to the rounds kernel of a "launch" split only (_check_cluster), not to the split kernel
    split_knobs = (_tail_knobs(knobs, knobs.get("mode", "local") != "local") if plan == "launch"
                   else _unclustered(knobs))
    why = "persistent=False" if not persistent else _split_refusal(split_knobs)
    if why is not None:
        if option == "auto":
            return False, rest
        raise ValueError(f"tail_split={option!r} splits the persistent walk's last round, which these options "
                         f"exclude ({why}): drop them or pass tail_split=False")
    return plan, rest


def _kv_blocks(s: int, variant: dict) -> int:
    """KV blocks per tile for the variant's ``tile_n`` (default TILE_N); ValueError unless they tile the
    sequence (the kernel has no masked block)."""
    tile_n = variant.get("tile_n", TILE_N)
    if s % tile_n:
        raise ValueError(f"tile_n={tile_n} needs a sequence length that is a multiple of it, got {s}: use "
                         f"tile_n={TILE_N} (the default)")
    return s // tile_n


def _unclustered(knobs: dict) -> dict:
    """The knobs without ``cluster_kv``: the split tail's launch runs unclustered (its CTAs' chunks differ)."""
    return {k: v for k, v in knobs.items() if k != "cluster_kv"}


def _tail_knobs(knobs: dict, fused: bool) -> dict:
    """The tail launch's knobs (tail_split="launch"): unclustered, and for a ``fused`` kernel with the burst
    epilogue whatever store its rounds kernel uses (paced, bulk, TMA): the fused tail's tiles are all local
    (mapping.launch_split), so how a peer store leaves (paced under a next tile, which a chunk does not have,
    or handed to the TMA engine) changes nothing there, and the split kernel stores in bursts only."""
    knobs = _unclustered(knobs)
    if fused and knobs.get("store", "st") != "st":
        # the default burst ("st"), by the default's own key: one compiled kernel
        knobs = {k: v for k, v in knobs.items() if k not in ("store", "pace_kv", "peel_drip")}
    return knobs


def _check_cluster(variant: dict, plan, n_tiles: int, grid: int, world: int, rank: int, n_mb_per_rank: int,
                   h_loc: int) -> None:
    """ValueError unless the walk of a ``cluster_kv=2`` launch pairs its CTAs (mapping.cluster_walk_pairs):
    the kernel, or with the "launch" split its whole rounds, every step two tiles of one head."""
    if variant.get("cluster_kv", 1) == 1:
        return
    if plan == "kernel":
        raise ValueError("cluster_kv=2 pairs whole tiles; the in-kernel split (tail_split=True/'kernel') does "
                         "not: use tail_split='launch' (or 'auto', False) or cluster_kv=1")
    n_walk = n_tiles // grid * grid if plan == "launch" else n_tiles
    if not cluster_walk_pairs(n_walk, grid, world, n_mb_per_rank, h_loc, rank, n_tiles,
                              bool(variant.get("turn_destinations", False))):
        raise ValueError(f"cluster_kv=2 needs an even grid and a walk whose CTA pairs take tiles of one head "
                         f"at every step ({n_tiles} tiles over {grid} CTAs, {n_mb_per_rank} row blocks per rank "
                         f"do not): use an even number of {TILE_M}-row blocks per head and rank, or cluster_kv=1")


_REFUSALS: dict = {}


def _refusal(knobs: dict):
    """Why FlashAttentionA2AForward does not take these constructor knobs (its ValueError), or None; once per
    knob set (every eager call asks)."""
    key = tuple(sorted(knobs.items()))
    if key not in _REFUSALS:
        try:
            FlashAttentionA2AForward(**knobs)
            _REFUSALS[key] = None
        except ValueError as e:
            _REFUSALS[key] = str(e)
    return _REFUSALS[key]


def _split_refusal(knobs: dict):
    """Why the split kernel does not take these constructor knobs, or None."""
    return _refusal({**knobs, "tail_split": True, "walk": "all"})


def _store_choice(variant: dict, knobs: dict, plan, n_tiles: int, grid: int, n_kv: int) -> dict:
    """The fused variant with its ``store`` knob decided: "auto" (the default) takes the paced epilogue
    (store="paced", pace_kv=mapping.PACE_KV unless given) where ``mapping.paced_store_pays`` for this walk and
    the paced kernel takes the other knobs, else the burst (the default kernel's own key: no ``store``).
    An explicit store is kept as given."""
    store = variant.get("store", "auto")
    if store != "auto":
        return variant
    rest = {k: v for k, v in variant.items() if k != "store"}
    if knobs.get("mode") != "piggyback" or not paced_store_pays(n_tiles, grid, n_kv, plan):
        return rest
    paced = {"store": "paced", "pace_kv": rest.get("pace_kv", PACE_KV)}
    trial = {**{k: v for k, v in knobs.items() if k != "store"}, **paced}
    trial.pop("tail_split", None)
    trial.update({"tail_split": True} if plan == "kernel" else {"walk": "rounds"} if plan == "launch" else {})
    if _refusal(trial) is not None:
        return rest
    return {**rest, **paced}


RELAYS = ("auto", True, False)


def _relay_choice(option, mode: str, plan, variant: dict, n_tiles: int, grid: int, n_kv: int, world: int,
                  relay_vectors: int) -> bool:
    """Whether this fused launch relays (``relay``): "auto" (the default) where ``mapping.relay_pays`` (a
    one-round rounds kernel of the launch split) with the burst epilogue; True wherever a launch split runs
    piggyback (ValueError otherwise); False never. ``relay_vectors``: the relay's 16 B vectors (its indices
    are 32-bit)."""
    if option not in RELAYS:
        raise ValueError(f"relay must be one of {RELAYS}, got {option!r}")
    if option is False:
        return False
    fits = relay_vectors + RELAY_THREADS < 2 ** 31
    if option == "auto":
        return (mode == "piggyback" and variant.get("store", "st") == "st" and fits
                and not variant.get("remote_first", False) and relay_pays(n_tiles, grid, n_kv, world, plan))
    if mode != "piggyback" or plan != "launch" or world < 2:
        raise ValueError("relay=True sends the rounds kernel's peer tiles on from the split tail's launch: it needs "
                         "mode='piggyback', a world of 2 or more and a launch split (tail_split='launch', or 'auto' "
                         f"where the last round splits; this walk's plan is {plan!r})")
    if variant.get("store", "st") not in ("st", "paced"):
        raise ValueError(f"relay=True redirects the rounds kernel's pointer-addressed stores (store='st' or 'paced'); "
                         f"store={variant['store']!r} writes through its own tensor maps: drop one of them")
    if not fits:
        raise ValueError(f"relay=True indexes its {relay_vectors} vectors with 32-bit integers: too many; "
                         "pass relay=False")
    return True


_TAIL_ARGS: dict = {}


def _tail_split_args(device, n_tiles: int, grid: int, n_kv: int) -> torch.Tensor:
    """tail_split's run-time arguments, in the local kernel's out_ptrs: [unused, float32 workspace address,
    Int32 counters' address (one per split tile, zero between launches), chunk count k]. Allocated once per
    (device, tiles, grid, KV blocks), so CUDA-Graph capture and replay see the same buffers. Launches of one
    shape share them: split launches of the same shape on two streams at once must be ordered (an event) or
    run with tail_split=False, as the fused op's symmetric output already requires."""
    key = (device, n_tiles, grid, n_kv)
    if key not in _TAIL_ARGS:
        _TAIL_ARGS[key] = _new_tail_split_args(device, n_tiles, grid, n_kv)
    return _TAIL_ARGS[key][0]


def _new_tail_split_args(device, n_tiles: int, grid: int, n_kv: int):
    """(arguments, workspace, counters): the buffers live as long as the arguments that name them."""
    k = choose_tail_split(n_tiles, grid, n_kv)
    tail = n_tiles % grid if k > 1 else 0
    work = torch.empty(max(1, tail * k * 2 * 128 * PARTIAL_FLOATS), dtype=torch.float32, device=device)
    counts = torch.zeros(max(1, tail), dtype=torch.int32, device=device)
    args = torch.tensor([0, work.data_ptr(), counts.data_ptr(), k], dtype=torch.int64, device=device)
    return args, work, counts


class FusedAttentionA2A:
    """Holds the symmetric output buffers of one process group (one per shape and dtype)."""

    def __init__(self, group=None, timeout_s: float = 2.0):
        self.group = group or dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.timeout_ns = int(timeout_s * 1e9)
        self.states: dict = {}
        self.decided: dict = {}  # (b, S, H/P, d, dtype) -> the last launch's tail_split, store and relay

    def state(self, q) -> SymmetricOutput:
        b, s, h_loc, d = q.shape
        key = (b, s, h_loc, d, q.dtype)
        if key not in self.states:
            self.states[key] = SymmetricOutput(self.group, (b, s // self.world, h_loc * self.world, d), q.dtype,
                                               q.device)
        return self.states[key]

    def launch(self, q, k, v, softmax_scale=None, mode: str = "piggyback", wait: bool = True, spans=None,
               self_store: bool = False, **variant):
        """Attention kernel (it advances the epoch itself), then the receiver's wait for every sender's data
        (``wait=False`` leaves it out, for sender-side timing; ``settle`` later covers every earlier epoch).
        ``variant``: mainloop knobs of ``FlashAttentionA2AForward``, for side-by-side benchmarks.
        ``self_store=True`` (a benchmark control, the output is garbage): every tile goes to this rank's own
        buffer at its destination offset, so the same fused kernel runs without NVLink traffic.
        ``signal`` other than True (controls too, with ``wait=False``): the kernel without the flag protocol
        (False) or with a part of it left out ("nofence", "done", "done_nofence"; see ``FlashAttentionA2AForward``).
        ``tail_split`` as in ``flash_attention`` ("auto" by default); with "launch" the rounds kernel sends every
        peer tile and the tail kernel (local tiles only) raises the flags once the rounds kernel is complete.
        ``store``: "auto" (the default) paces the peer stores over the next tile's Q-loop where that pays
        (``mapping.paced_store_pays``: short kernels with at least two tiles per CTA), else the burst ("st").
        ``relay``: "auto" (the default) relays where ``mapping.relay_pays`` (a one-round rounds kernel of the
        launch split): its peer tiles go to a local shadow of each peer's buffer and the tail launch's MMA threads
        copy them on under their chunks' Q-loops; True forces it on a launch split, False never.
        What the launch decided is in ``self.decided[(b, S, H/P, d, dtype)]`` (tail_split, store, relay)."""
        if mode not in MODES[1:]:
            raise ValueError(f"mode must be 'piggyback' or 'completion_coupled', got {mode!r}")
        if variant.get("signal", True) is not True and wait:
            raise ValueError(f"signal={variant['signal']!r} (a benchmark control) never completes the output "
                             "safely: pass wait=False")
        check_qkv(q, k, v, self.world)
        check_ulysses_shapes(q.shape[1], q.shape[2] * self.world, self.world, TILE_M)
        if variant.get("store") == "auto":  # the default, decided per walk below (_store_choice)
            variant = {k: v for k, v in variant.items() if k != "store"}
        relay_option = variant.get("relay", "auto")  # decided below (_relay_choice), once the walk is known
        relay_knobs = {k: variant[k] for k in ("relay_start", "relay_wait") if k in variant}  # the tail kernel's
        if relay_knobs.get("relay_wait", True) is not True and wait:
            raise ValueError("relay_wait=False (a benchmark control) may send the shadow before it is written: pass "
                             "wait=False")
        variant = {k: v for k, v in variant.items() if k not in ("relay", "relay_start", "relay_wait")}
        st = self.state(q)
        b, s, h_loc, d = q.shape
        n_tiles = (s // TILE_M) * h_loc * b
        n_kv = _kv_blocks(s, variant)
        check_spans(spans, n_tiles, q.device, _grid(n_tiles, q.device))
        dm = _dummy(q.device)
        out_ptrs = st.self_ptrs if self_store else st.out_ptrs
        grid = _grid(n_tiles, q.device)
        knobs = {"head_dim": d, "mode": mode, "instrument": spans is not None, "n_dst": self.world,
                 **FUSED_WALK, **variant}
        plan, variant = _split_plan(variant, knobs, n_tiles, grid, n_kv, self.world)
        if plan and n_tiles < grid:  # one round: every CTA's first tile carries the ready gate; nothing split
            plan = False
        variant = _store_choice(variant, knobs, plan, n_tiles, grid, n_kv)
        relay = _relay_choice(relay_option, mode, plan, variant, n_tiles, grid, n_kv, self.world,
                              relay_share(0, 1, self.world, b, s // self.world, h_loc, d * q.element_size() // 16)[2])
        self.decided[(b, s, h_loc, d, q.dtype)] = {"tail_split": plan or False,
                                                   "store": variant.get("store", "st"), "relay": relay}
        _check_cluster(variant, plan, n_tiles, grid, self.world, self.rank, s // self.world // TILE_M, h_loc)
        dsts = (st.out,) * self.world if self_store else st.peer_outs  # tensor maps of store="tma"
        rest = (st.flag_ptrs, st.flags, st.epoch, st.counter, st.errors, spans if spans is not None else dm.spans,
                dsts, _scale(softmax_scale, d), self.rank, self.world, grid, self.timeout_ns)
        if plan:  # the destinations, then the split's workspace, counters and chunk count
            key = ("tail", self_store, n_tiles, grid)
            if key not in st.extra:  # its own workspace and counters (not shared with flash_attention's)
                args, work, counts = _new_tail_split_args(q.device, n_tiles, grid, n_kv)
                st.extra[key] = (torch.cat([out_ptrs, args[1:]]), work, counts)
            split_ptrs = st.extra[key][0]
        walk = {**FUSED_WALK, **variant}
        compiled = len(_KERNELS)
        if plan == "launch":
            # The whole rounds (ready gate, every peer tile, no flag), then the local chunks, whose kernel
            # waits for the rounds' completion and raises the flags (FlashAttentionA2AForward's ``walk``).
            signal = variant.get("signal", True)
            tail_signal = False if signal is False else ("done_nofence" if signal in ("nofence", "done_nofence")
                                                         else "done")
            rounds_ptrs, tail_ptrs, tail_relay = out_ptrs, split_ptrs, {}
            if relay:  # the rounds kernel's peer tiles to local shadows, sent on by the tail kernel
                rounds_ptrs, tail_ptrs = self._relay_ptrs(st, self_store, n_tiles, grid, split_ptrs)
                tail_relay = {"relay": True, **relay_knobs}
            launches = ((_kernel(q.dtype, d, mode, False, n_dst=self.world, walk="rounds", **walk), rounds_ptrs),
                        (_kernel(q.dtype, d, mode, False, n_dst=self.world, walk="tail", tail_split=True,
                                 **{**_tail_knobs(walk, True), "signal": tail_signal, **tail_relay}), tail_ptrs))
        else:
            if plan == "kernel":
                walk, out_ptrs = {**walk, "tail_split": True}, split_ptrs
            launches = ((_kernel(q.dtype, d, mode, spans is not None, n_dst=self.world, **walk), out_ptrs),)
        meet_after_compile(compiled, len(_KERNELS), self.group)  # a rank that compiled: start together
        for kernel, ptrs in launches:
            kernel(q, k, v, q, ptrs, *rest)
        if wait:
            st.wait(self.world, self.timeout_ns)
        return st.out

    def _relay_ptrs(self, st: SymmetricOutput, self_store: bool, n_tiles: int, grid: int, split_ptrs):
        """relay: (the rounds kernel's destinations: this rank's own buffer, and a local shadow (b, S/P, H, d)
        for each peer; the tail kernel's: split_ptrs, then every shadow's address, 0 for this rank). The shadows
        are allocated once per shape, like the split's workspace, so graph replays see the same addresses."""
        key = ("relay", self_store, n_tiles, grid)
        if key not in st.extra:
            bases = [st.out.data_ptr()] * self.world if self_store else list(st.handles[0].buffer_ptrs)
            shadows = {j: torch.empty(st.out.shape, dtype=st.out.dtype, device=st.out.device)
                       for j in range(self.world) if j != self.rank}
            rounds = torch.tensor([shadows[j].data_ptr() if j in shadows else bases[j] for j in range(self.world)],
                                  dtype=torch.int64, device=st.out.device)
            shadow_ptrs = torch.tensor([shadows[j].data_ptr() if j in shadows else 0 for j in range(self.world)],
                                       dtype=torch.int64, device=st.out.device)
            st.extra[key] = (rounds, torch.cat([split_ptrs, shadow_ptrs]), shadows)
        return st.extra[key][0], st.extra[key][1]

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


_SYMM_A2A: dict = {}


def pre_attention_a2a(x: torch.Tensor, group=None, method: str = "nccl", slot: int = 0) -> torch.Tensor:
    """Ulysses pre-attention All-to-All: (b, S/P, H, d) -> (b, S, H/P, d).

    ``method="nccl"``: all_to_all_single with yunchang's permutes (a fresh tensor). ``method="symm"``: our
    device-initiated scatter into a symmetric buffer (``slot`` picks the buffer, e.g. 0/1/2 for q/k/v; the
    next call with the same slot and shape reuses it)."""
    group = group or dist.group.WORLD
    if method == "symm":
        from flash_a2a.a2a import SymmetricUlyssesA2A

        if group not in _SYMM_A2A:
            _SYMM_A2A[group] = SymmetricUlyssesA2A(group)
        return _SYMM_A2A[group].pre(x, slot)
    if method != "nccl":
        raise ValueError(f"method must be 'nccl' or 'symm', got {method!r}")
    world = dist.get_world_size(group)
    b, s_loc, h, d = x.shape
    send = x.reshape(b, s_loc, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, world * s_loc, h // world, d)


class UlyssesAttention(torch.nn.Module):
    """Drop-in for yunchang's ``UlyssesAttention``: forward(query, key, value, ...) with q/k/v in
    (b, S/P, H, d) returns (b, S/P, H, d). Pre-attention All-to-All through our symmetric-memory scatter
    (``pre_a2a="symm"``, the default: 1.9-2.3x faster than NCCL on 2xH200; ``"nccl"``: yunchang's), then our fused
    attention + post-attention All-to-All, called through the ``xstage::fused_attention_a2a`` custom op so
    torch.compile sees an opaque op. The result is a fresh tensor (safe to keep)."""

    def __init__(self, sequence_process_group=None, scatter_idx: int = 2, gather_idx: int = 1,
                 use_sync: bool = False, mode: str = "piggyback", pre_a2a: str = "symm"):
        super().__init__()
        if (scatter_idx, gather_idx) != (2, 1):
            raise NotImplementedError("only scatter_idx=2, gather_idx=1 (the (b, s, h, d) layout) is supported")
        if pre_a2a not in ("nccl", "symm"):
            raise ValueError(f"pre_a2a must be 'nccl' or 'symm', got {pre_a2a!r}")
        self.group = sequence_process_group or dist.group.WORLD
        self.mode = mode
        self.pre_a2a = pre_a2a
        self.world = dist.get_world_size(self.group)

    def forward(self, query, key, value, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *args):
        unsupported = {"dropout_p": dropout_p != 0.0, "causal": bool(causal),
                       "window_size": tuple(window_size) != (-1, -1), "softcap": softcap != 0.0,
                       "alibi_slopes": alibi_slopes is not None, "return_attn_probs": bool(return_attn_probs)}
        bad = [name for name, on in unsupported.items() if on]
        if bad:
            raise NotImplementedError(f"UlyssesAttention does not support {', '.join(bad)} "
                                      "(non-causal full attention without dropout only)")
        world = self.world
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() != 4 or t.shape[2] % world:
                raise ValueError(f"{name} must be (b, S/P, H, d) with H divisible by the group size {world}, "
                                 f"got {tuple(t.shape)}")
        q, k, v = (pre_attention_a2a(t.contiguous(), self.group, self.pre_a2a, slot)
                   for slot, t in enumerate((query, key, value)))
        from flash_a2a import ops  # noqa: F401 - registers torch.ops.xstage.*

        return torch.ops.xstage.fused_attention_a2a(q, k, v, self.group.group_name, softmax_scale, self.mode)
