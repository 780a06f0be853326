"""A2A-only column of the FlashAttention-A2A benchmark: the post-attention Ulysses All-to-All alone, NCCL
the yunchang way (permute copies around all_to_all_single) against our device-initiated symmetric-memory
scatter, on every GPU of the machine (one process each). Each timing is the median of CUDA-event-timed
calls after warm-up, all ranks barrier-aligned before every call; the reported time is the max over ranks.

    python -m benchmarks.a2a_only --out benchmarks/results/h200x2/a2a_only.json
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

SEQ_LENS = (8192, 16384, 32768, 49152, 65536)
HEADS_PER_RANK = (3, 12)


def _time(fn, iters, group):
    import torch
    import torch.distributed as dist

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    t = torch.tensor(sorted(times)[len(times) // 2], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def _worker(rank, world, init_file, args):
    import torch
    import torch.distributed as dist

    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        from cute_kernels.runtime import provenance
        from flash_a2a.a2a import SymmetricUlyssesA2A, nccl_post_a2a

        a2a = SymmetricUlyssesA2A()
        rows = []
        for h_loc in HEADS_PER_RANK:
            for s in SEQ_LENS:
                o = torch.randn(1, s, h_loc, 128, device="cuda").to(torch.bfloat16)
                ref = nccl_post_a2a(o)
                got = a2a(o)
                torch.cuda.synchronize()
                a2a.check()
                ok = bool(torch.equal(got, ref))
                x = torch.empty(world, 1, s // world, h_loc, 128, device="cuda", dtype=torch.bfloat16)
                y = torch.empty_like(x)
                t_nccl = _time(lambda: nccl_post_a2a(o), args.iters, None)
                t_nccl_raw = _time(lambda: dist.all_to_all_single(y, x), args.iters, None)
                t_symm = _time(lambda: a2a(o), args.iters, None)
                nbytes = o.numel() * o.element_size()
                rows.append({"seq_len": s, "heads_per_rank": h_loc, "world": world, "bytes_per_rank": nbytes,
                             "nccl_yunchang_us": t_nccl, "nccl_all_to_all_single_us": t_nccl_raw,
                             "symmetric_scatter_us": t_symm, "bit_exact_vs_nccl": ok})
                if rank == 0:
                    print(f"H/P={h_loc:2d} M={s:6d}: NCCL+permutes {t_nccl:8.1f} us, NCCL a2a {t_nccl_raw:8.1f} us, "
                          f"symmetric scatter {t_symm:8.1f} us, exact={ok}", flush=True)
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"provenance": provenance("python -m benchmarks.a2a_only"), "rows": rows}, f, indent=1)
    finally:
        dist.destroy_process_group()


def main():
    import torch
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/h200x2/a2a_only.json")
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    world = torch.cuda.device_count()
    if world < 2:
        raise SystemExit("needs 2 or more GPUs with peer access")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "pg"), args), nprocs=world, join=True)


if __name__ == "__main__":
    main()
