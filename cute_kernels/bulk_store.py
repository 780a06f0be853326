"""Row stores through the TMA unit: ``cp.async.bulk.global.shared::cta`` of one shared-memory row to any global
address (this GPU's HBM or a peer's symmetric buffer), issued by one thread and drained asynchronously.

The issuing thread hands a staged row to the copy engine and goes on; the row leaves shared memory without
registers, and the thread waits only when it must: ``wait_read`` before the staging row is overwritten,
``wait_done`` before a flag or barrier tells a reader the data is there. Bulk groups are per thread, so the
thread that issues is the one that waits. (Plain functions, not a dataclass: a DSL loop would try to carry a
dataclass's dtype field.)"""
from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int64
from cutlass.cute.nvgpu import cpasync


def row_atom(dtype, elems: int):
    """The copy atom of one row of ``elems`` elements of ``dtype`` (a multiple of 16 bytes)."""
    nbytes = elems * dtype.width // 8
    if nbytes % 16:
        raise ValueError(f"a bulk row store moves a multiple of 16 bytes, got {nbytes}")
    return cute.make_copy_atom(cpasync.CopyBulkS2GOp(), dtype, num_bits_per_copy=elems * dtype.width)


def issue_row(atom, src, dst_addr: Int64, elems: int) -> None:
    """Copy the row at shared-memory pointer ``src`` (16-byte aligned) to global address ``dst_addr``."""
    dst = cute.make_ptr(src.dtype, dst_addr, cute.AddressSpace.gmem, assumed_align=16)
    cute.copy(atom, cute.make_tensor(src, cute.make_layout(elems)), cute.make_tensor(dst, cute.make_layout(elems)))


def commit() -> None:
    cute.arch.cp_async_bulk_commit_group()


def wait_read() -> None:
    """This thread's committed rows have been read out of shared memory (the staging may be reused)."""
    cute.arch.cp_async_bulk_wait_group(0, read=True)


def wait_done() -> None:
    """This thread's committed rows are written and visible to it; the fence then orders them with its later
    generic-proxy accesses (a release that publishes them)."""
    cute.arch.cp_async_bulk_wait_group(0)
    cute.arch.fence_proxy("async.global")
