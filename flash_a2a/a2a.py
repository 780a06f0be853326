"""Host side of the device-initiated Ulysses All-to-Alls (symmetric memory, any world size).

``SymmetricUlyssesA2A(group)(o)`` takes this rank's attention output (b, S, H/P, d) and returns its
(b, S/P, H, d) slice of the All-to-All, complete and safe to read on the current stream;
``.pre(x, slot)`` is the pre-attention direction, (b, S/P, H, d) -> (b, S, H/P, d). The returned
tensor lives in a symmetric buffer reused by the next call of the same shape: consume or clone it before
then. Buffers are allocated once per shape (collectively: every rank must call with the same shapes in the
same order); both kernels launch on torch's current stream and are CUDA-Graph capturable.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from cute_kernels.dist import meet_after_compile
from cute_kernels.runtime import check_error_word, new_error_word
from flash_a2a.mapping import check_ulysses_shapes
from cute_kernels.epoch import MAX_GRID
from flash_a2a.scatter import UlyssesScatterKernel, EpochWaitKernel

_KERNELS: dict = {}


def _compiled(kind, *key):
    """Compiled kernels by kind: "scatter" (vec_per_row, tile_m, threads, direction) or "wait" ()."""
    if (kind, key) not in _KERNELS:
        from cutlass.runtime import make_fake_stream

        from cute_kernels.compile import compile_kernel

        k = UlyssesScatterKernel(*key) if kind == "scatter" else EpochWaitKernel()
        _KERNELS[(kind, key)] = compile_kernel(k, *k.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True))
    return _KERNELS[(kind, key)]


class SymmetricOutput:
    """A (b, S/P, H, d) symmetric output buffer with its flags, pointer tables and device epoch."""

    def __init__(self, group, shape, dtype, device):
        b, s_loc, h, d = shape
        world = dist.get_world_size(group)
        self.out = symm_mem.empty(shape, dtype=dtype, device=device)
        hdl = symm_mem.rendezvous(self.out, group)
        self.flags = symm_mem.empty(2 * world, dtype=torch.int64, device=device)
        fhdl = symm_mem.rendezvous(self.flags, group)
        self.flags.zero_()
        self.out_ptrs = torch.tensor(list(hdl.buffer_ptrs), dtype=torch.int64, device=device)
        # every rank's buffer as a tensor on this device (the peer mappings), for kernels that need tensor maps
        self.peer_outs = tuple(hdl.get_buffer(j, shape, dtype) for j in range(world))
        self.self_ptrs = torch.full_like(self.out_ptrs, self.out.data_ptr())  # the self-store control's table
        self.flag_ptrs = torch.tensor(list(fhdl.buffer_ptrs), dtype=torch.int64, device=device)
        self.epoch = torch.zeros(1, dtype=torch.int64, device=device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.errors = new_error_word(device)
        self.handles = (hdl, fhdl)
        self.extra: dict = {}  # per-variant argument tables built once (tail_split's out_ptrs), for graph replay
        self.world = world
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every rank's flags are zero before anyone signals


    def wait(self, world: int, timeout_ns: int) -> None:
        """Launch the receiver's wait for every sender's data of the current epoch (bounded)."""
        _compiled("wait")(self.flags, self.epoch, self.errors, world, timeout_ns)


SCATTER_TILE_M = 128  # rows of S/P per scatter tile: the symmetric All-to-All takes S/P multiples of it


class SymmetricUlyssesA2A:
    def __init__(self, group=None, tile_m: int = SCATTER_TILE_M, timeout_s: float = 2.0, ctas_per_sm: int = 2):
        self.group = group or dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.tile_m, self.timeout_ns, self.ctas_per_sm = tile_m, int(timeout_s * 1e9), ctas_per_sm
        self.states: dict = {}

    @staticmethod
    def _check_tensor(t, name: str, layout: str) -> None:
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor {layout}")
        if t.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"{name} must be bfloat16 or float16, got {t.dtype}")
        if not t.is_cuda or t.device.index != torch.cuda.current_device():
            raise ValueError(f"{name} must live on the current CUDA device (cuda:{torch.cuda.current_device()})")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous {layout}; call .contiguous()")
        if (t.shape[3] * t.element_size()) % 16:
            raise ValueError(f"head dim {t.shape[3]} must make rows of 16-byte multiples")

    def validate(self, o: torch.Tensor) -> None:
        self._check_tensor(o, "o", "(b, S, H/P, d)")
        b, s, h_loc, d = o.shape
        check_ulysses_shapes(s, h_loc * self.world, self.world, self.tile_m)

    def validate_pre(self, x: torch.Tensor) -> None:
        self._check_tensor(x, "x", "(b, S/P, H, d)")
        b, s_loc, heads, d = x.shape
        check_ulysses_shapes(s_loc * self.world, heads, self.world, self.tile_m)

    def _scatter(self, x: torch.Tensor, key, out_shape, direction: str, seq: int, h_loc: int, n_tiles: int):
        """Launch the scatter of ``x`` in ``direction`` into the buffer of ``key`` (allocated on first use),
        then the receiver's bounded wait; returns the buffer."""
        if key not in self.states:
            self.states[key] = SymmetricOutput(self.group, out_shape, x.dtype, x.device)
        st = self.states[key]
        vec_per_row = x.shape[3] * x.element_size() // 16
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        grid = min(n_tiles, self.ctas_per_sm * sms)
        if grid > MAX_GRID:
            raise ValueError(f"grid {grid} exceeds the epoch protocol's {MAX_GRID} CTAs; lower ctas_per_sm")
        cached = len(_KERNELS)
        scatter = _compiled("scatter", vec_per_row, self.tile_m, 128, direction)
        _compiled("wait")
        meet_after_compile(cached, len(_KERNELS), self.group)  # its ready gate waits for every rank's launch
        scatter(
            x.view(torch.int32).view(-1, 4), st.out_ptrs, st.flag_ptrs, st.flags, st.epoch, st.counter, st.errors,
            x.shape[0], seq, h_loc, self.rank, self.world, grid, self.timeout_ns)
        st.wait(self.world, self.timeout_ns)
        return st.out

    def __call__(self, o: torch.Tensor) -> torch.Tensor:
        self.validate(o)
        b, s, h_loc, d = o.shape
        return self._scatter(o, (b, s, h_loc, d, o.dtype), (b, s // self.world, h_loc * self.world, d), "post",
                             s, h_loc, (s // self.tile_m) * h_loc * b)

    def pre(self, x: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """The pre-attention All-to-All: this rank's (b, S/P, H, d) -> its (b, S, H/P, d) heads of the whole
        sequence. ``slot`` picks one of several buffers of the same shape (q, k, v: 0, 1, 2), each reused by
        the next call with that slot and shape."""
        self.validate_pre(x)
        b, s_loc, heads, d = x.shape
        h_loc = heads // self.world
        return self._scatter(x, ("pre", slot, b, s_loc, heads, d, x.dtype), (b, s_loc * self.world, h_loc, d),
                             "pre", s_loc, h_loc, (s_loc // self.tile_m) * heads * b)

    def check(self) -> None:
        """Raise if any launch so far hit a bounded-wait timeout (synchronizes)."""
        for st in self.states.values():
            check_error_word(st.errors, f"Ulysses All-to-All on rank {self.rank}")


def nccl_post_a2a(o: torch.Tensor, group=None) -> torch.Tensor:
    """The yunchang-style post-attention All-to-All through NCCL (permute copies around all_to_all_single):
    (b, S, H/P, d) -> (b, S/P, H, d). The baseline our kernels are measured against."""
    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    b, s, h_loc, d = o.shape
    x = o.reshape(b, world, s // world, h_loc, d).permute(1, 0, 2, 3, 4).contiguous()
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x, group=group)
    return y.permute(1, 2, 0, 3, 4).reshape(b, s // world, world * h_loc, d).contiguous()
