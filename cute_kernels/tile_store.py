"""TileStoreKernel: copy a (M, N) tensor tile by tile with 128-bit loads and stores, recording each CTA's
store span on both clocks. The destination may be local or a peer mapping, which makes this the plain
"SM copy into the peer mapping" anchor of the calibration as well as the smallest end-to-end kernel.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass.cute.runtime import make_fake_tensor

from . import timers
from .remote_store import elems_per_vec128, vec128_atom


class TileStoreKernel:
    """One CTA per (tile_m, tile_n) tile; ``threads`` threads each move 128 bits per instruction."""

    def __init__(self, dtype=cutlass.BFloat16, tile_m: int = 64, tile_n: int = 128, threads: int = 128):
        vec = elems_per_vec128(dtype)
        if tile_n % vec:
            raise ValueError(f"tile_n={tile_n} must be a multiple of {vec} elements (128 bits)")
        lanes_n = tile_n // vec
        if threads % lanes_n or tile_m % (threads // lanes_n):
            raise ValueError(f"threads={threads} must tile the {tile_m}x{tile_n} tile in 128-bit vectors")
        self.dtype, self.tile_m, self.tile_n, self.threads = dtype, tile_m, tile_n, threads
        self.vec, self.lanes_n = vec, lanes_n

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return (m // self.tile_m, n // self.tile_n, 1)

    def fake_args(self):
        """Fake (src, dst, spans) for compiling without a GPU: any M, N a multiple of tile_n, 16-byte rows."""
        m, n = cute.sym_int64(), cute.sym_int64(divisibility=self.tile_n)
        ld = cute.sym_int64(divisibility=self.vec)
        src = make_fake_tensor(self.dtype, (m, n), stride=(ld, 1), assumed_align=16)
        dst = make_fake_tensor(self.dtype, (m, n), stride=(cute.sym_int64(divisibility=self.vec), 1), assumed_align=16)
        spans = make_fake_tensor(cutlass.Int64, (cute.sym_int64(), len(timers.SPAN_FIELDS)),
                                 stride=(len(timers.SPAN_FIELDS), 1), assumed_align=16)
        return src, dst, spans

    @cute.jit
    def __call__(self, src: cute.Tensor, dst: cute.Tensor, spans: cute.Tensor, stream: cuda.CUstream):
        atom = vec128_atom(self.dtype)
        thr_layout = cute.make_ordered_layout((self.threads // self.lanes_n, self.lanes_n), order=(1, 0))
        val_layout = cute.make_layout((1, self.vec))
        tiled_copy = cute.make_tiled_copy_tv(atom, thr_layout, val_layout)
        grid_m = cute.size(src, mode=[0]) // self.tile_m
        grid_n = cute.size(src, mode=[1]) // self.tile_n
        self.kernel(src, dst, spans, tiled_copy).launch(
            grid=(grid_m, grid_n, 1), block=(self.threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, src: cute.Tensor, dst: cute.Tensor, spans: cute.Tensor, tiled_copy: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        bm, bn, _ = cute.arch.block_idx()
        _, grid_n, _ = cute.arch.grid_dim()
        g_src = cute.local_tile(src, (self.tile_m, self.tile_n), (bm, bn))
        g_dst = cute.local_tile(dst, (self.tile_m, self.tile_n), (bm, bn))
        thr = tiled_copy.get_slice(tidx)
        t_src = thr.partition_S(g_src)
        t_dst = thr.partition_D(g_dst)
        frag = cute.make_fragment_like(t_src)
        cute.copy(tiled_copy, t_src, frag)
        # The span covers the whole CTA's store issue: barrier before the start and after the last store.
        cute.arch.sync_threads()
        gt0, ck0 = timers.now()
        cute.copy(tiled_copy, frag, t_dst)
        cute.arch.sync_threads()
        gt1, ck1 = timers.now()
        if tidx == 0:
            timers.write_span(spans, bm * grid_n + bn, gt0, gt1, ck0, ck1)


_COMPILED: dict = {}


def compile_tile_store(kernel: TileStoreKernel, arch: str = "sm_90a", dump_dir: str | None = None):
    """Compile ``kernel`` on fake tensors (works with or without a GPU); TVM-FFI host entry on torch's stream."""
    from cutlass.runtime import make_fake_stream

    from .compile import compile_kernel

    return compile_kernel(kernel, *kernel.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True),
                          arch=arch, dump_dir=dump_dir)


def tile_copy(src, dst, tile_m: int = 64, tile_n: int = 128, threads: int = 128):
    """Copy torch tensor ``src`` (M, N) into ``dst`` (local or a peer mapping) with 128-bit stores.

    Returns the per-CTA span records, an int64 tensor (num_tiles, 4): globaltimer start/end (ns) and
    clock64 start/end (cycles) around each CTA's store issue.
    """
    import torch

    from .runtime import TORCH_TO_CUTLASS

    if src.dtype != dst.dtype or src.dtype not in TORCH_TO_CUTLASS:
        raise ValueError(f"src and dst must share a dtype among {sorted(map(str, TORCH_TO_CUTLASS))}; "
                         f"got {src.dtype} and {dst.dtype}")
    if src.dim() != 2 or src.shape != dst.shape:
        raise ValueError(f"src and dst must be 2-D of one shape, got {tuple(src.shape)} and {tuple(dst.shape)}")
    m, n = src.shape
    if m % tile_m or n % tile_n:
        raise ValueError(f"shape {(m, n)} must be a multiple of the tile ({tile_m}, {tile_n}); pad the tensor")
    for name, t in (("src", src), ("dst", dst)):
        if not t.is_cuda or t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            raise ValueError(f"{name} must be a CUDA tensor with unit-stride rows, 16-byte aligned rows and base")
    key = (src.dtype, tile_m, tile_n, threads)
    if key not in _COMPILED:
        _COMPILED[key] = compile_tile_store(TileStoreKernel(TORCH_TO_CUTLASS[src.dtype], tile_m, tile_n, threads))
    spans = torch.zeros((m // tile_m) * (n // tile_n), 4, dtype=torch.int64, device=src.device)
    _COMPILED[key](src, dst, spans)
    return spans
