"""Run BurstGapKernel points on GPUs: one sender writes into a receiver's symmetric buffer (or its own HBM
for the local control); the receiver waits on the completion flag (bounded) and verifies every byte.

Every rank of the group walks the same list of (sender, receiver, point) in lock step, so the code is
the same for any world size; ranks not in the pair only take part in the per-point agreement.

All-to-all injection (``run_all_peers``): every rank sends at once, its producers spread over all P - 1
peers (producer k to the k mod (P-1)-th peer after itself); sender r writes into region r of each
receiver's buffer and adds to the receiver's flag word 1 + r, and every receiver verifies every sender.
The ranks start together to within a host barrier (tens of µs); bursts are aligned within a rank, which is
what the sender-side quantities (T_iss, the delivered period, the isolated knee) need.
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


def expected_mismatches(words: torch.Tensor, tag: int, p: Point, producers=None) -> int:
    """Count wrong 32-bit words in the region a run wrote: (tag, burst, producer, vector index) each;
    ``producers`` (a list of producer indices) restricts the check to the producers that wrote here."""
    vec = p.bytes_per_producer // 16
    v = words[: p.bursts * p.producers * vec * WORDS_PER_VEC].view(p.bursts, p.producers, vec, WORDS_PER_VEC)
    dev = words.device
    bad = (v[..., 0] != tag)
    bad |= v[..., 1] != torch.arange(p.bursts, device=dev, dtype=torch.int32)[:, None, None]
    bad |= v[..., 2] != torch.arange(p.producers, device=dev, dtype=torch.int32)[None, :, None]
    bad |= v[..., 3] != torch.arange(vec, device=dev, dtype=torch.int32)[None, None, :]
    if producers is not None:
        bad = bad[:, torch.as_tensor(producers, device=dev, dtype=torch.long)]
    return int(bad.sum())


def peer_order(rank: int, world: int) -> list[int]:
    """The peers of ``rank`` in the order producers are dealt to them: rank + 1, rank + 2, ... (mod P)."""
    return [(rank + 1 + i) % world for i in range(world - 1)]


def producers_to(sender: int, receiver: int, producers: int, world: int) -> list[int]:
    """Producer indices of ``sender`` that write to ``receiver`` under all-to-all injection."""
    peers = peer_order(sender, world)
    return [k for k in range(producers) if peers[k % len(peers)] == receiver]


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
        # One region of buffer_bytes per sender, so all-to-all injection never overlaps (pairs use region 0).
        self.buf = symm_mem.empty(words * self.world, dtype=torch.int32, device=self.device)
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
        self.a2a_expected = [0] * self.world  # per sender: producers that have signalled flag word 1 + sender
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

    def _ptrs(self, *addresses: int) -> torch.Tensor:
        return torch.tensor(addresses, dtype=torch.int64, device=self.device)

    def _launch(self, p: Point, dst_ptrs, done_ptrs, tag: int):
        self.sync.zero_()
        self.errors.zero_()
        rec = self.records[: p.producers * (p.bursts + 1)]
        rec.zero_()
        vec_per_thread = p.bytes_per_producer // (16 * self.threads)
        self.kernel(p.mode == "isolated", p.gap_kind)(
            dst_ptrs, done_ptrs, rec, self.sync, self.errors, self.sink, p.producers, vec_per_thread, p.bursts,
            p.bursts, p.gap, tag, self.timeout_ns)
        return rec

    def _metrics(self, p: Point, rec) -> dict:
        check_error_word(self.errors, f"burst kernel {p}")
        host = rec.cpu().numpy()
        n = p.producers * p.bursts
        records = host[:n].reshape(p.producers, p.bursts, len(RECORD_FIELDS))
        return run_metrics(records, p.bytes_per_producer, isolated=p.mode == "isolated",
                           delivered=host[n:, :2]).to_dict()

    def _next_tag(self, p: Point, buffer_bytes: int) -> int:
        """Validate ``p`` for a destination region of ``buffer_bytes`` and return the run's fresh tag."""
        validate_point(p, self.sm_count, buffer_bytes, self.threads)
        if p.bursts > self.max_bursts:
            raise ValueError(f"bursts={p.bursts} exceeds max_bursts={self.max_bursts}")
        self.tag += 1
        return self.tag

    def _receive(self, flag: torch.Tensor, expected: int, words: torch.Tensor, tag: int, p: Point, sender: int,
                 producers=None) -> str:
        """Receiver side: wait (bounded) until ``flag[0]`` reaches ``expected``, then verify the words the
        sender's ``producers`` (all by default) wrote. Returns the failure, or "" when all arrived intact."""
        errors = new_error_word(self.device)
        self.flag_wait(flag, errors, expected, self.timeout_ns)
        torch.cuda.synchronize()
        try:
            check_error_word(errors, f"completion flag from rank {sender}")
            bad = expected_mismatches(words, tag, p, producers)
        except XStageKernelError as e:
            return str(e)
        return f"receiver {self.rank} found {bad} wrong words from sender {sender}" if bad else ""

    def _agree(self, failure: str, what: str) -> None:
        """Every rank learns whether any rank failed (all ranks call this once per run, in lock step)."""
        status = torch.tensor([1 if failure else 0], device=self.device)
        dist.all_reduce(status, group=self.group)
        if failure:
            raise RuntimeError(f"{what}: {failure}")
        if int(status.item()):
            raise RuntimeError(f"{what} failed on another rank")

    def run_all_peers(self, p: Point) -> dict:
        """All-to-all injection: every rank sends ``p`` at once, its producers dealt over all its peers.
        Returns this rank's measurement (as a sender); raises on any rank's failure."""
        if p.target != "all_peers":
            raise ValueError(f"run_all_peers takes target='all_peers' points, got {p.target!r}")
        if self.world < 2:
            raise ValueError("all-to-all injection needs two or more ranks")
        region = self.buffer_bytes
        tag = self._next_tag(p, region)
        peers = peer_order(self.rank, self.world)
        dst = self._ptrs(*(self.buf_hdl.buffer_ptrs[j] + self.rank * region for j in peers))
        done = self._ptrs(*(self.flag_hdl.buffer_ptrs[j] + 4 * (1 + self.rank) for j in peers))
        dist.barrier(group=self.group)
        rec = self._launch(p, dst, done, tag)
        failure, result = "", None
        torch.cuda.synchronize()
        try:
            result = {**p.to_dict(), "sender": self.rank, "receiver": -1, "peers": peers, "tag": tag,
                      "metrics": self._metrics(p, rec)}
        except (XStageKernelError, RecordError) as e:
            failure = str(e)
        # Receive: wait for every sender's producers that target this rank, then verify their words.
        for sender in range(self.world):
            if sender == self.rank or failure:
                continue
            mine = producers_to(sender, self.rank, p.producers, self.world)
            if not mine:
                continue
            self.a2a_expected[sender] += len(mine)
            failure = self._receive(self.flag[1 + sender:], self.a2a_expected[sender],
                                    self.buf[sender * region // 4:(sender + 1) * region // 4], tag, p, sender, mine)
        self._agree(failure, f"{p} all-to-all on rank {self.rank}")
        return result

    def run_point(self, p: Point, sender: int, receiver: int) -> dict | None:
        """Run one point; returns the sender's measurement dict (None on other ranks)."""
        tag = self._next_tag(p, self.buffer_bytes)
        remote = p.target == "remote"
        result = None
        failure = ""
        if self.rank == sender:
            if remote:
                dst = self._ptrs(self.buf_hdl.buffer_ptrs[receiver])
                done = self._ptrs(self.flag_hdl.buffer_ptrs[receiver])
            else:
                dst, done = self._ptrs(self.local.data_ptr()), self._ptrs(self.local_flag.data_ptr())
            rec = self._launch(p, dst, done, tag)
            torch.cuda.synchronize()
            try:
                result = {**p.to_dict(), "sender": sender, "receiver": receiver if remote else sender,
                          "tag": tag, "metrics": self._metrics(p, rec)}
            except (XStageKernelError, RecordError) as e:
                failure = str(e)
            if not remote:
                self.local_flag_expected += p.producers
                bad = expected_mismatches(self.local, tag, p)
                if bad:
                    failure = failure or f"local control lost {bad} words"
        if remote and self.rank == receiver:
            self.flag_expected += p.producers
            failure = self._receive(self.flag, self.flag_expected, self.buf, tag, p, sender)
        self._agree(failure, f"{p} from rank {sender} to {receiver}")
        return result
