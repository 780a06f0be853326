"""Bandwidth anchors measured in the same run as the calibration, so R is read against the machine's
ceiling: copy-engine and SM-store peer writes (one direction and both at once) and local HBM copy, plus
the NVLink nominal figure from NVML."""
from __future__ import annotations

import torch
import torch.distributed as dist

from cute_kernels.tile_store import tile_copy

# NVML's nvmlNvlinkVersion enum -> (generation, GB/s per link per direction).
# NVLink4 on H100/H200: 18 links x 25 GB/s = 450 GB/s each way.
NVML_NVLINK_VERSIONS = {1: ("1.0", 20.0), 2: ("2.0", 25.0), 3: ("2.2", 25.0), 4: ("3.0", 25.0),
                        5: ("3.1", 25.0), 6: ("4.0", 25.0), 7: ("5.0", 50.0)}


def time_us(fn, warmup: int = 3, iters: int = 20) -> float:
    """Median µs of ``fn`` over ``iters`` CUDA-event-timed calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


def nvlink_nominal(device_index: int = 0) -> dict:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        active, version = 0, None
        for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED:
                    active += 1
                    version = version or pynvml.nvmlDeviceGetNvLinkVersion(h, link)
            except pynvml.NVMLError:
                break
        generation, per_link = NVML_NVLINK_VERSIONS.get(version, (None, None))
        return {"active_links": active, "nvml_nvlink_version": version, "nvlink_generation": generation,
                "per_link_GBps_per_direction": per_link,
                "nominal_GBps_per_direction": active * per_link if per_link else None}
    except Exception as e:  # noqa: BLE001 - NVML is optional: report why it is missing
        return {"error": f"NVML unavailable: {e}"}


def measure_anchors(bench, sender: int = 0, receiver: int = 1, nbytes: int = 256 << 20) -> dict:
    """All ranks call this together; returns the anchors (GB/s) on every rank."""
    rank, dev, group = bench.rank, bench.device, bench.group
    n = nbytes // 2
    rows = 4096
    src = torch.randn(n, device=dev).to(torch.bfloat16)
    local_dst = torch.empty_like(src)
    out = {}

    def peer_view(peer):
        return bench.buf_hdl.get_buffer(peer, (n,), torch.bfloat16)

    def run_ops(active_ranks, tag):
        dist.barrier(group=group)
        res = torch.zeros(3, device=dev, dtype=torch.float64)
        if rank in active_ranks:
            peer = receiver if rank == sender else sender
            pv = peer_view(peer)
            res[0] = nbytes / time_us(lambda: pv.copy_(src)) / 1e3
            res[1] = nbytes / time_us(lambda: tile_copy(src.view(rows, -1), pv.view(rows, -1))) / 1e3
            res[2] = nbytes / time_us(lambda: torch.mul(src, 1, out=pv)) / 1e3
        dist.all_reduce(res, group=group)
        k = len(active_ranks)
        out[f"copy_engine_peer_write_{tag}_GBps"] = float(res[0] / k)
        out[f"sm_store_peer_write_{tag}_GBps"] = float(res[1] / k)
        out[f"torch_elementwise_peer_write_{tag}_GBps"] = float(res[2] / k)

    run_ops({sender}, "unidirectional")
    run_ops({sender, receiver}, "bidirectional_per_direction")
    dist.barrier(group=group)
    if rank == sender:
        t = time_us(lambda: local_dst.copy_(src))
        out["local_hbm_copy_GBps"] = nbytes / t / 1e3
        out["local_hbm_copy_read_plus_write_GBps"] = 2 * nbytes / t / 1e3
    obj = [out]
    dist.broadcast_object_list(obj, src=sender, group=group)
    result = obj[0]
    result["nvlink"] = nvlink_nominal(0)
    result["bytes"] = nbytes
    return result
