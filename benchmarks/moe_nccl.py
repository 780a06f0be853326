"""The unfused expert-parallel MoE a user writes at EP = P in one process group (issue 31, item 3): the routed
token rows dispatched by an NCCL All-to-All, grouped GEMM, SwiGLU, grouped GEMM, the expert outputs sent back by
a second NCCL All-to-All, then the router-weighted sum. bf16, or the row-wise FP8 recipe of
``benchmarks.moe_baselines`` (its quantization and ``torch._scaled_grouped_mm`` call reused; x is quantized per
token row before the dispatch, so the dispatch moves e4m3 rows and their fp32 scales). Importable without a GPU;
every piece also runs on the CPU (gloo) where torch implements it there.

Placement (megamoe.api's): expert e lives on rank e // L, L = E / P. A rank sorts its (token, slot) entries by
expert id (-1 entries last and never sent), so its send buffer holds, for each destination rank in turn, that
rank's local experts' rows in expert order: the split sizes are per-rank sums of the per-expert counts.
The receiver gets source-major, local-expert-minor chunks; ``receive_index`` reorders them expert-major (the
grouped GEMM's order) from the (P, L) received counts on the device, and the same index puts the outputs back
in receive order for the combine. The router weight multiplies each returned row in the weighted sum after the
combine (as Megatron's unpermute does); megamoe.reference applies it to the SwiGLU output before Linear-2,
which is the same in exact arithmetic (the bench checks the output against it).

Split sizes. ``all_to_all_single`` takes its split sizes as host integers, so knowing them costs a counts
All-to-All and a device-to-host copy, a host sync, per call. Here they are exchanged once per routing, outside
the timed call (``plan``: the per-expert counts All-to-All and ``.tolist()``), and the timed ``forward`` uses
them: no host sync, CUDA-Graph capturable, and every row it moves is a routed row. That is the baseline's
best case (a user pays the exchange on every call), so a speedup over it is not flattered; the bench times the
exchange alone (``plan``, eager, host wall clock) and records it beside the columns. A padded fixed-capacity
All-to-All (no host sync) was not taken: at a capacity of T*k rows per peer, the only one that drops no token
under every routing, it moves P times the routed bytes; a smaller capacity drops tokens under skewed routing,
which is another layer.
"""
from __future__ import annotations

from typing import NamedTuple

# --- the index math (pure tensor functions; the CPU tests simulate the All-to-Alls around them) ------------------

def sort_entries(topk_idx, num_experts: int):
    """(sorted_key, order), each (T*k,) int64: the entries sorted by expert id (stable), -1 entries given the key
    num_experts so they come last. Sorted by expert is sorted by destination rank."""
    import torch

    flat = topk_idx.reshape(-1).to(torch.int64)
    key = torch.where(flat >= 0, flat, num_experts)
    return torch.sort(key, stable=True)


def expert_counts(sorted_key, num_experts: int):
    """(E,) int64: rows per expert, from the sorted keys on the device (bincount would read its max back)."""
    import torch

    ends = torch.searchsorted(sorted_key, torch.arange(num_experts, device=sorted_key.device), right=True)
    return torch.diff(ends, prepend=ends.new_zeros(1))


def rank_splits(counts: list[int], world: int) -> list[int]:
    """Per-rank sums of per-expert counts (experts e // L on rank e // L, L = len(counts) / world)."""
    if len(counts) % world:
        raise ValueError(f"{len(counts)} experts do not divide among {world} ranks")
    per = len(counts) // world
    return [sum(counts[r * per:(r + 1) * per]) for r in range(world)]


def receive_index(recv_counts, rows: int):
    """(src (rows,) int64, offs (L,) int32) from ``recv_counts`` (P, L), rows source j sent for local expert l:
    the received rows arrive source-major, local-expert-minor; row q of the expert-major order (expert l's
    rows from source 0, then from source 1, ...) is received row src[q], and offs[l] is the end of expert l's
    rows (torch._grouped_mm's offs). ``rows`` = recv_counts.sum(), known on the host from the split sizes."""
    import torch

    world, local = recv_counts.shape
    flat = recv_counts.reshape(-1).to(torch.int64)
    src_start = torch.cumsum(flat, 0) - flat  # chunk (j, l) at j * L + l, in receive order
    by_expert = recv_counts.t().reshape(-1).to(torch.int64)  # chunk (l, j) at l * P + j, in expert order
    ends = torch.cumsum(by_expert, 0)
    q = torch.arange(rows, device=recv_counts.device)
    chunk = torch.searchsorted(ends, q, right=True)  # empty chunks are skipped: their end equals the previous
    within = q - (ends - by_expert)[chunk]
    src = src_start[(chunk % world) * local + chunk // world] + within
    return src, ends.view(local, world)[:, -1].to(torch.int32)


def swiglu(gu):
    """silu(gate) * up, gu (n, 2I) gate columns first, in bf16 elementwise ops as a user writes it."""
    import torch.nn.functional as F

    inter = gu.shape[1] // 2
    return F.silu(gu[:, :inter]) * gu[:, inter:]


def expert_ffn_bf16(rows, offs, w1, w2):
    """The local experts on their rows in expert order: (R, H) bf16 -> (R, H) bf16; w1 (L, 2I, H), w2 (L, H, I)."""
    import torch

    if rows.shape[0] == 0:
        return rows.new_empty(0, w2.shape[1])
    gu = torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(swiglu(gu), w2.transpose(-2, -1), offs=offs)


def expert_ffn_fp8(rows_q, scales, offs, weights):
    """The same in row-wise FP8 (benchmarks.moe_baselines' recipe): e4m3 rows and their fp32 scales in, h
    re-quantized per row before Linear-2, bf16 out. ``weights``: moe_baselines.Fp8RowwiseWeights of the local
    experts."""
    import torch

    from benchmarks.moe_baselines import _scaled_grouped, quantize_rowwise

    if rows_q.shape[0] == 0:
        return torch.empty(0, weights.w2.shape[1], dtype=torch.bfloat16, device=rows_q.device)
    gu = _scaled_grouped(rows_q, scales, weights.w1, weights.s1, offs)
    hq, sh = quantize_rowwise(swiglu(gu))
    return _scaled_grouped(hq, sh, weights.w2, weights.s2, offs)


def weighted_sum(back, token, weight, num_tokens: int):
    """y (T, H) bf16: each returned row times its router weight, added into its token's row (index_add_)."""
    import torch

    y = torch.zeros(num_tokens, back.shape[1], dtype=torch.bfloat16, device=back.device)
    y.index_add_(0, token, back * weight.to(torch.bfloat16)[:, None])
    return y


def simulate_all_to_all(sends: list, send_splits: list[list[int]]) -> list:
    """The All-to-All on lists, for checks without a process group: rank r receives, from every rank j in
    order, the r-th chunk of j's send buffer (split by send_splits[j])."""
    import torch

    chunks = [list(torch.split(s, splits)) for s, splits in zip(sends, send_splits)]
    return [torch.cat([chunks[j][r] for j in range(len(sends))]) for r in range(len(sends))]


# --- one rank's layer ------------------------------------------------------------------------------------------

class Plan(NamedTuple):
    """What ``forward`` needs on the host for one routing: rows sent and received, the split sizes by peer
    rank, and the received per-(source, local expert) counts (P, L) as a device tensor."""

    sent: int
    received: int
    send_splits: list
    recv_splits: list
    recv_counts: object


class NcclEPMoE:
    """The unfused MoE layer on one rank of ``group`` (module docstring): this rank's experts' weights (views of
    the (E, 2I, H) and (E, H, I) bf16 tensors, quantized once for ``precision`` "fp8"), ``plan(topk_idx)``
    once per routing (collective; host sync), then ``forward(x, topk_idx, topk_weights, plan)`` (collective;
    no host sync, graph capturable: a captured call replays right while the routing is the plan's)."""

    def __init__(self, group, w1, w2, precision: str = "bf16"):
        import torch.distributed as dist

        from benchmarks.moe_baselines import fp8_rowwise_weights

        if precision not in ("bf16", "fp8"):
            raise ValueError(f"precision must be bf16 or fp8, got {precision!r}")
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.num_experts = w1.shape[0]
        if self.num_experts % self.world:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by the world size ({self.world})")
        self.num_local = self.num_experts // self.world
        lo = self.rank * self.num_local
        self.w1, self.w2 = w1[lo:lo + self.num_local], w2[lo:lo + self.num_local]
        self.precision = precision
        self.fp8w = fp8_rowwise_weights(self.w1, self.w2) if precision == "fp8" else None

    def plan(self, topk_idx) -> Plan:
        """The split sizes for this routing: per-expert counts, their All-to-All, ``.tolist()`` (the host sync)."""
        import torch
        import torch.distributed as dist

        sorted_key, _ = sort_entries(topk_idx, self.num_experts)
        counts = expert_counts(sorted_key, self.num_experts)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        sent, got = counts.tolist(), recv.tolist()
        send_splits = rank_splits(sent, self.world)
        recv_splits = rank_splits(got, self.world)
        return Plan(sum(send_splits), sum(recv_splits), send_splits, recv_splits,
                    recv.view(self.world, self.num_local))

    def _all_to_all(self, t, plan: Plan, dispatch: bool):
        import torch.distributed as dist

        rows, out_splits, in_splits = ((plan.received, plan.recv_splits, plan.send_splits) if dispatch
                                       else (plan.sent, plan.send_splits, plan.recv_splits))
        out = t.new_empty((rows, *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                               group=self.group)
        return out

    def forward(self, x, topk_idx, topk_weights, plan: Plan):
        """y (T, H) bf16 for this rank's tokens: sort, gather, dispatch, reorder, the experts, reorder back,
        combine, weighted sum."""
        import torch

        from benchmarks.moe_baselines import quantize_rowwise

        k = topk_idx.shape[1]
        _, order = sort_entries(topk_idx, self.num_experts)
        sel = order[:plan.sent]  # the routed entries, by expert: by destination rank
        token = torch.div(sel, k, rounding_mode="floor")
        weight = topk_weights.reshape(-1).float()[sel]
        src, offs = receive_index(plan.recv_counts, plan.received)
        if self.fp8w is None:
            recv = self._all_to_all(x.index_select(0, token), plan, True)
            out = expert_ffn_bf16(recv.index_select(0, src), offs, self.w1, self.w2)
        else:
            xq, sx = quantize_rowwise(x)  # per token row, before the gather (T rows rather than T*k)
            rq = self._all_to_all(xq.view(torch.uint8).index_select(0, token), plan, True)
            rs = self._all_to_all(sx.index_select(0, token), plan, True)
            out = expert_ffn_fp8(rq.index_select(0, src).view(torch.float8_e4m3fn), rs.index_select(0, src), offs,
                                 self.fp8w)
        back = torch.empty_like(out)
        back.index_copy_(0, src, out)  # receive order again: what each source sent, in its order
        return weighted_sum(self._all_to_all(back, plan, False), token, weight, x.shape[0])


RECIPE = ("unfused_nccl_<dtype>: per rank, entries sorted by expert (= by destination rank), rows gathered, NCCL "
          "all_to_all_single dispatch (fp8: e4m3 rows and fp32 row scales, x quantized per token row first), "
          "received rows reordered expert-major on the device, grouped GEMM (torch._grouped_mm / "
          "torch._scaled_grouped_mm row-wise), SwiGLU, grouped GEMM, reordered back, all_to_all_single combine, "
          "router-weighted index_add_; split sizes from a per-expert counts all_to_all and .tolist() exchanged "
          "once per row outside the timed region (nccl_splits_exchange_us: that exchange alone, eager)")
