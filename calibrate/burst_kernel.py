"""BurstGapKernel: the X-Stage remote-store microbenchmark (paper sec. 3.1) in CuTe DSL.

K producer CTAs (one per SM: the dynamic shared memory request keeps a second CTA off the SM) each write
B bytes per burst with 128-bit stores into a destination buffer, then run a producer-side gap that issues no
stores. Destinations come as a pointer table (``dst_ptrs``, with completion flags ``done_ptrs``): producer
k writes into entry k mod n. One entry is a pair (a peer GPU's symmetric buffer) or the local-HBM control;
P - 1 entries are all-to-all injection, the producers spread over every peer at once.

- ``gap_kind="fma"``: a register-resident FMA loop of ``gap`` iterations (it occupies the SM as a mainloop
  does; its duration is measured, not assumed);
- ``gap_kind="spin"``: a ``%globaltimer`` spin of ``gap`` nanoseconds.

``isolated=False`` (periodic): bursts back to back after one grid-wide start barrier.
``isolated=True``: before every burst a grid barrier, and after it every thread's ``fence.acq_rel.sys``,
which returns only once the thread's stores are performed: X-Stage is checked empty before the next burst,
and the fence's return time is the burst's completion time.

Each burst writes values encoding (run tag, burst, producer, vector index) into its own ring slot, so the
receiver can verify every byte. One record row per (producer, burst), written by thread 0 after the gap
(fields ``RECORD_FIELDS``), then one delivery row per producer (globaltimer, clock64 after its final
``fence.acq_rel.sys``: every byte it wrote is performed).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.runtime import make_fake_tensor

from cute_kernels import flags, timers
from cute_kernels.remote_store import STORE_BYTES, vec128_atom

RECORD_FIELDS = ("gt_start", "gt_issue_end", "ck_start", "ck_issue_end",
                 "gt_drained", "ck_drained", "gt_gap_end", "ck_gap_end")
WORDS_PER_VEC = 4  # one 128-bit store = 4 x 32-bit words
FMA_CHAINS = 8     # independent FMA chains: the gap loop is latency-bound, not issue-bound
SYNC_WORDS = 4     # sync[0]: grid arrival counter


class BurstGapKernel:
    def __init__(self, threads: int = 128, gap_kind: str = "fma", isolated: bool = False,
                 smem_bytes: int = 120 * 1024):
        if gap_kind not in ("fma", "spin"):
            raise ValueError(f"gap_kind must be 'fma' or 'spin', got {gap_kind!r}")
        if threads % 32 or not 32 <= threads <= 1024:
            raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {threads}")
        self.threads, self.gap_kind, self.isolated, self.smem_bytes = threads, gap_kind, isolated, smem_bytes

    @property
    def bytes_per_thread_store(self) -> int:
        return STORE_BYTES

    def fake_args(self):
        dst_ptrs = make_fake_tensor(Int64, (cute.sym_int64(),), stride=(1,), assumed_align=8)
        done_ptrs = make_fake_tensor(Int64, (cute.sym_int64(),), stride=(1,), assumed_align=8)
        records = make_fake_tensor(Int64, (cute.sym_int64(), len(RECORD_FIELDS)),
                                   stride=(len(RECORD_FIELDS), 1), assumed_align=16)
        sync = make_fake_tensor(Int32, (cute.sym_int64(),), stride=(1,), assumed_align=4)
        errors = make_fake_tensor(Int32, (cute.sym_int64(),), stride=(1,), assumed_align=4)
        sink = make_fake_tensor(Float32, (cute.sym_int64(),), stride=(1,), assumed_align=4)
        scalars = (Int32(1), Int32(1), Int32(1), Int32(1), Int32(0), Int32(0), Int64(1))
        return (dst_ptrs, done_ptrs, records, sync, errors, sink) + scalars

    @cute.jit
    def __call__(self, dst_ptrs: cute.Tensor, done_ptrs: cute.Tensor, records: cute.Tensor, sync: cute.Tensor,
                 errors: cute.Tensor, sink: cute.Tensor, producers: Int32, vec_per_thread: Int32,
                 n_bursts: Int32, slots: Int32, gap: Int32, run_tag: Int32, timeout_ns: Int64,
                 stream: cuda.CUstream):
        self.kernel(dst_ptrs, done_ptrs, records, sync, errors, sink, vec_per_thread, n_bursts, slots, gap,
                    run_tag, timeout_ns).launch(grid=(producers, 1, 1), block=(self.threads, 1, 1),
                                       smem=self.smem_bytes, stream=stream)

    @cute.kernel
    def kernel(self, dst_ptrs: cute.Tensor, done_ptrs: cute.Tensor, records: cute.Tensor, sync: cute.Tensor,
               errors: cute.Tensor, sink: cute.Tensor, vec_per_thread: Int32, n_bursts: Int32, slots: Int32,
               gap: Int32, run_tag: Int32, timeout_ns: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        producers, _, _ = cute.arch.grid_dim()
        # This producer's destination: entry bidx mod n of the table (consecutive producers, different peers).
        dest = Int32(bidx) % Int32(cute.size(dst_ptrs, mode=[0]))
        n_vec_region = vec_per_thread * self.threads * Int32(producers) * slots
        dst = cute.make_tensor(cute.make_ptr(Int32, dst_ptrs[dest], cute.AddressSpace.gmem, assumed_align=16),
                               cute.make_layout((n_vec_region, WORDS_PER_VEC), stride=(WORDS_PER_VEC, 1)))
        done = cute.make_tensor(cute.make_ptr(Int32, done_ptrs[dest], cute.AddressSpace.gmem, assumed_align=4),
                                cute.make_layout(1))
        atom = vec128_atom(Int32)
        vals = cute.make_rmem_tensor(cute.make_layout((WORDS_PER_VEC,)), Int32)
        acc = cute.make_rmem_tensor(cute.make_layout((FMA_CHAINS,)), Float32)
        for c in cutlass.range_constexpr(FMA_CHAINS):
            acc[c] = Float32(tidx) * Float32(1.0e-3) + Float32(c)
        vec_per_cta = vec_per_thread * self.threads

        # Align the producers' first bursts: one bounded grid barrier (start skew is recorded).
        if tidx == 0:
            flags.grid_arrive_and_wait(sync, Int32(0), Int32(producers), timeout_ns, errors, Int32(bidx))
        cute.arch.sync_threads()

        for b in cutlass.range(n_bursts, unroll=1):
            if cutlass.const_expr(self.isolated):
                if tidx == 0:
                    flags.grid_arrive_and_wait(sync, Int32(0), Int32(producers) * (b + 2), timeout_ns, errors,
                                               Int32(bidx))
            vals[0] = run_tag
            vals[1] = b
            vals[2] = Int32(bidx)
            base = ((b % slots) * Int32(producers) + Int32(bidx)) * vec_per_cta + Int32(tidx)
            cute.arch.sync_threads()
            gt0, ck0 = timers.now()
            for j in cutlass.range(vec_per_thread, unroll=4):
                vals[3] = j * self.threads + Int32(tidx)
                cute.copy(atom, vals, dst[base + j * self.threads, None])
            cute.arch.sync_threads()
            gt1, ck1 = timers.now()
            gt2, ck2 = gt1, ck1
            if cutlass.const_expr(self.isolated):
                # Returns once this thread's stores are performed system-wide: the burst has drained.
                cute.arch.fence_acq_rel_sys()
                cute.arch.sync_threads()
                gt2, ck2 = timers.now()
            if cutlass.const_expr(self.gap_kind == "fma"):
                for _ in cutlass.range(gap, unroll=1):
                    for c in cutlass.range_constexpr(FMA_CHAINS):
                        acc[c] = acc[c] * Float32(0.999) + Float32(0.5)
            else:
                deadline = gt2 + Int64(gap)
                while cute.arch.globaltimer() < deadline:
                    pass
            cute.arch.sync_threads()
            gt3, ck3 = timers.now()
            if tidx == 0:
                row = Int32(bidx) * n_bursts + b
                records[row, 0] = gt0
                records[row, 1] = gt1
                records[row, 2] = ck0
                records[row, 3] = ck1
                records[row, 4] = gt2
                records[row, 5] = ck2
                records[row, 6] = gt3
                records[row, 7] = ck3

        # Keep the FMA chains alive (one store per thread after the timed loop).
        total = Float32(0.0)
        for c in cutlass.range_constexpr(FMA_CHAINS):
            total = total + acc[c]
        sink[Int32(bidx) * self.threads + Int32(tidx)] = total
        # Completion for the receiver: every thread's stores performed, then one release-add per producer
        # on the receiver's flag at system scope.
        cute.arch.fence_acq_rel_sys()
        cute.arch.sync_threads()
        if tidx == 0:
            # Delivery record after the burst rows: when this producer's last byte was performed.
            gtf, ckf = timers.now()
            records[Int32(producers) * n_bursts + Int32(bidx), 0] = gtf
            records[Int32(producers) * n_bursts + Int32(bidx), 1] = ckf
            flags.signal_add(done, 0, 1, "sys")


class FlagWaitKernel:
    """One thread waits (acquire, system scope, bounded) until ``flag[0] >= target``: the receiver's side of
    a completion flag. On timeout it writes the error word instead of hanging."""

    def fake_args(self):
        flag = make_fake_tensor(Int32, (cute.sym_int64(),), stride=(1,), assumed_align=4)
        errors = make_fake_tensor(Int32, (cute.sym_int64(),), stride=(1,), assumed_align=4)
        return flag, errors, Int32(1), Int64(1)

    @cute.jit
    def __call__(self, flag: cute.Tensor, errors: cute.Tensor, target: Int32, timeout_ns: Int64,
                 stream: cuda.CUstream):
        self.kernel(flag, errors, target, timeout_ns).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, flag: cute.Tensor, errors: cute.Tensor, target: Int32, timeout_ns: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            flags.wait_geq(flag, Int32(0), target, timeout_ns, errors, Int32(flags.ERR_FLAG_TIMEOUT), Int32(0),
                           "sys")
