"""Run BurstGapKernel points on GPUs: one sender writes into a receiver's symmetric buffer (or its own HBM
for the local control); the receiver waits on the completion flag (bounded) and verifies every byte.

Every rank of the group walks the same list of (sender, receiver, point) in lock step, so the code is
the same for any world size; ranks not in the pair only take part in the per-point agreement.
"""
from __future__ import annotations

import random

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from calibrate.analysis import RecordError, run_metrics
from calibrate.burst_kernel import RECORD_FIELDS, SYNC_WORDS, WORDS_PER_VEC, BurstGapKernel, FlagWaitKernel
from calibrate.sweep import Point, validate_point
from cute_kernels.runtime import XStageKernelError, check_error_word, new_error_word

FLAG_WORDS = 64


def _compile(kernel):
    from cutlass.runtime import make_fake_stream

    from cute_kernels.compile import compile_kernel

    return compile_kernel(kernel, *kernel.fake_args(), make_fake_stream(use_tvm_ffi_env_stream=True))


def expected_mismatches(words: torch.Tensor, tag: int, p: Point) -> int:
    """Count wrong 32-bit words in the region a run wrote: (tag, burst, producer, vector index) each."""
    vec = p.bytes_per_producer // 16
    v = words[: p.bursts * p.producers * vec * WORDS_PER_VEC].view(p.bursts, p.producers, vec, WORDS_PER_VEC)
    dev = words.device
    bad = (v[..., 0] != tag)
    bad |= v[..., 1] != torch.arange(p.bursts, device=dev, dtype=torch.int32)[:, None, None]
    bad |= v[..., 2] != torch.arange(p.producers, device=dev, dtype=torch.int32)[None, :, None]
    bad |= v[..., 3] != torch.arange(vec, device=dev, dtype=torch.int32)[None, None, :]
    return int(bad.sum())


class BurstBench:
    def __init__(self, group=None, threads: int = 128, buffer_bytes: int = 512 << 20, timeout_s: float = 2.0,
                 max_bursts: int = 64):
        self.group = group or dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.threads, self.buffer_bytes, self.max_bursts = threads, buffer_bytes, max_bursts
        self.timeout_ns = int(timeout_s * 1e9)
        for peer in range(self.world):
            if peer != self.rank and not self._peer_ok(peer):
                raise ValueError(f"rank {self.rank} has no peer access to rank {peer}: remote stores need "
                                 "NVLink/PCIe peer access between every pair (check nvidia-smi topo -m)")
        words = buffer_bytes // 4
        self.buf = symm_mem.empty(words, dtype=torch.int32, device=self.device)
        self.buf_hdl = symm_mem.rendezvous(self.buf, self.group)
        self.flag = symm_mem.empty(FLAG_WORDS, dtype=torch.int32, device=self.device)
        self.flag_hdl = symm_mem.rendezvous(self.flag, self.group)
        self.flag.zero_()
        self.local = torch.empty(words, dtype=torch.int32, device=self.device)
        self.local_flag = torch.zeros(FLAG_WORDS, dtype=torch.int32, device=self.device)
        self.records = torch.zeros(self.sm_count * (max_bursts + 1), len(RECORD_FIELDS), dtype=torch.int64,
                                   device=self.device)
        self.sync = torch.zeros(SYNC_WORDS, dtype=torch.int32, device=self.device)
        self.errors = new_error_word(self.device)
        self.sink = torch.zeros(self.sm_count * threads, dtype=torch.float32, device=self.device)
        self.kernels = {}
        self.flag_wait = _compile(FlagWaitKernel())
        self.flag_expected = 0
        self.local_flag_expected = 0
        seed = torch.tensor([random.randrange(1, 1 << 20) if self.rank == 0 else 0], device=self.device)
        dist.broadcast(seed, 0, group=self.group)
        self.tag = int(seed.item()) << 8
        torch.cuda.synchronize()
        dist.barrier(group=self.group)

    def _peer_ok(self, peer: int) -> bool:
        # One process per GPU: device ids are ranks on a single node.
        return torch.cuda.device_count() <= peer or torch.cuda.can_device_access_peer(self.device.index, peer)

    def kernel(self, isolated: bool, gap_kind: str):
        key = (isolated, gap_kind)
        if key not in self.kernels:
            self.kernels[key] = _compile(BurstGapKernel(self.threads, gap_kind, isolated))
        return self.kernels[key]

    def run_point(self, p: Point, sender: int, receiver: int) -> dict | None:
        """Run one point; returns the sender's measurement dict (None on other ranks)."""
        validate_point(p, self.sm_count, self.buffer_bytes, self.threads)
        if p.bursts > self.max_bursts:
            raise ValueError(f"bursts={p.bursts} exceeds max_bursts={self.max_bursts}")
        self.tag += 1
        tag = self.tag
        remote = p.target == "remote"
        result = None
        failure = ""
        if self.rank == sender:
            if remote:
                n_words = self.buffer_bytes // 4
                dst = self.buf_hdl.get_buffer(receiver, (n_words // 4, 4), torch.int32)
                done = self.flag_hdl.get_buffer(receiver, (FLAG_WORDS,), torch.int32)
            else:
                dst, done = self.local.view(-1, 4), self.local_flag
            self.sync.zero_()
            self.errors.zero_()
            rec = self.records[: p.producers * (p.bursts + 1)]
            rec.zero_()
            vec_per_thread = p.bytes_per_producer // (16 * self.threads)
            self.kernel(p.mode == "isolated", p.gap_kind)(
                dst, rec, self.sync, done, self.errors, self.sink, p.producers, vec_per_thread, p.bursts,
                p.bursts, p.gap, tag, self.timeout_ns)
            torch.cuda.synchronize()
            try:
                check_error_word(self.errors, f"burst kernel {p}")
                host = rec.cpu().numpy()
                n = p.producers * p.bursts
                records = host[:n].reshape(p.producers, p.bursts, len(RECORD_FIELDS))
                metrics = run_metrics(records, p.bytes_per_producer, isolated=p.mode == "isolated",
                                      delivered=host[n:, :2])
                result = {**p.to_dict(), "sender": sender, "receiver": receiver if remote else sender,
                          "tag": tag, "metrics": metrics.to_dict()}
            except (XStageKernelError, RecordError) as e:
                failure = str(e)
            if not remote:
                self.local_flag_expected += p.producers
                bad = expected_mismatches(self.local, tag, p)
                if bad:
                    failure = failure or f"local control lost {bad} words"
        if remote and self.rank == receiver:
            self.flag_expected += p.producers
            errors = new_error_word(self.device)
            self.flag_wait(self.flag, errors, self.flag_expected, self.timeout_ns)
            torch.cuda.synchronize()
            try:
                check_error_word(errors, f"completion flag from rank {sender}")
                bad = expected_mismatches(self.buf, tag, p)
                if bad:
                    failure = f"receiver {receiver} found {bad} wrong words from sender {sender}"
            except XStageKernelError as e:
                failure = str(e)
        status = torch.tensor([1 if failure else 0], device=self.device)
        dist.all_reduce(status, group=self.group)
        if failure:
            raise RuntimeError(f"{p} from rank {sender} to {receiver}: {failure}")
        if int(status.item()):
            raise RuntimeError(f"{p} from rank {sender} to {receiver} failed on another rank")
        return result
