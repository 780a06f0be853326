"""What our MegaMoE kernel is measured against on one GPU: the unfused MoE a user writes in torch (bf16, and
the best FP8 grouped path torch has), the dense ceilings and HBM bandwidth measured in the same run, and the
roofline built from them. Importable without a GPU (torch is imported inside the functions that need it);
the unfused paths also run on the CPU where torch implements their ops there (``torch._grouped_mm`` does).

The unfused paths take the layer as ``megamoe.reference`` defines it (w1 (E, 2I, H) gate rows then up rows,
w2 (E, H, I), the router weight applied to the SwiGLU output before Linear-2, -1 expert ids skipped) and are
CUDA-Graph capturable: no host synchronisation (no ``.item()``, ``.tolist()``, ``bincount`` or boolean
indexing) and every shape fixed by (T, k), so a captured graph replays correctly on new routing.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

FP8_MAX = 448.0
SCALE_BLOCK = 128  # the kernel's FP8 recipe: 128x128 weight scales (counted in the roofline's bytes)
FP4_SCALE_BLOCK = 32  # W4A8: one UE8M0 byte per 32 weights (megamoe.reference.FP4_BLOCK)


# --- routing to rows sorted by expert ------------------------------------------------------------------------

class SortedRows(NamedTuple):
    """The (token, slot) entries of topk_idx in expert order, fixed size T*k: ``order`` (entry ids, -1 entries
    last), ``token`` (the source row to gather), ``dest`` (the output row: T, a dummy row, for -1 entries),
    ``weight`` (fp32) and ``offs`` (int32 (E,), cumulative row counts: expert e's rows end at offs[e])."""

    order: object
    token: object
    dest: object
    weight: object
    offs: object


def sort_by_expert(topk_idx, topk_weights, num_experts: int) -> SortedRows:
    """Sort the routed entries by expert without a host sync. -1 entries get the key num_experts, so they sort
    after every expert's rows: the grouped GEMMs ignore rows past offs[-1] (their outputs there are left
    uninitialised) and the scatter sends them to the dummy row T, which is dropped."""
    import torch

    t, k = topk_idx.shape
    flat = topk_idx.reshape(-1).to(torch.int64)
    key = torch.where(flat >= 0, flat, num_experts)
    sorted_key, order = torch.sort(key, stable=True)
    # offs[e] = entries with key <= e, from the sorted keys (bincount would read its max back to the host)
    offs = torch.searchsorted(sorted_key, torch.arange(num_experts, device=flat.device), right=True).to(torch.int32)
    token = torch.div(order, k, rounding_mode="floor")
    dest = torch.where(sorted_key < num_experts, token, t)
    return SortedRows(order, token, dest, topk_weights.reshape(-1).float()[order], offs)


def _swiglu_times_weight(gu, weight):
    """silu(gate) * up * router weight (gu (n, 2I), gate columns first) in bf16 elementwise ops, as a user
    writes it (one bf16 rounding per op; fp32 math would add passes over 4-byte temporaries)."""
    import torch
    import torch.nn.functional as F

    inter = gu.shape[1] // 2
    return F.silu(gu[:, :inter]) * gu[:, inter:] * weight.to(torch.bfloat16)[:, None]


def _combine(out_rows, dest, num_tokens: int):
    """y (T, H) bf16: each expert output row added into its token's row (``index_add_``); -1 entries land in
    the dummy row T."""
    import torch

    y = torch.zeros(num_tokens + 1, out_rows.shape[1], dtype=torch.bfloat16, device=out_rows.device)
    y.index_add_(0, dest, out_rows)
    return y[:num_tokens]


def unfused_bf16_moe(x, topk_idx, topk_weights, w1, w2):
    """The bf16 MoE a user writes: sort the (token, k) entries by expert, gather their rows,
    ``torch._grouped_mm`` for Linear-1 (gate and up at once), SwiGLU times the router weight,
    ``torch._grouped_mm`` for Linear-2, ``index_add_`` into y. x (T, H) bf16; w1 (E, 2I, H), w2 (E, H, I) bf16;
    returns y (T, H) bf16 (the notes measured 8.36 ms this way at DSv4-Flash shapes, 8192 tokens)."""
    import torch

    rows = sort_by_expert(topk_idx, topk_weights, w1.shape[0])
    xs = x.index_select(0, rows.token)
    gu = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=rows.offs)
    h = _swiglu_times_weight(gu, rows.weight)
    out = torch._grouped_mm(h, w2.transpose(-2, -1), offs=rows.offs)
    return _combine(out, rows.dest, x.shape[0])


# --- FP8 with row-wise scales (torch._scaled_grouped_mm) ------------------------------------------------------

class Fp8RowwiseWeights(NamedTuple):
    """Weights for ``unfused_fp8_moe``: e4m3 with one fp32 scale per output channel of each expert (the
    row-wise recipe torch's grouped FP8 GEMM takes; not the kernel's 128x128 blocks)."""

    w1: object  # (E, 2I, H) e4m3
    s1: object  # (E, 2I) fp32
    w2: object  # (E, H, I) e4m3
    s2: object  # (E, H) fp32


def quantize_rowwise(x):
    """(q e4m3, scale fp32 (...,)): one scale per row over the last dimension, scale = max(amax, 1e-4) / 448.
    Three passes: the amax as one reduction (vector_norm with ord=inf, no |x| temporary), the scaled row in
    fp32, its cast. No clamp: |x| / scale exceeds 448 by rounding only, far below 480, where e4m3fn casts
    stop rounding to 448."""
    import torch

    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1, dtype=torch.float32)
    scale = amax.clamp_(min=1e-4) / FP8_MAX
    return (x * scale.reciprocal()[..., None]).to(torch.float8_e4m3fn), scale


def fp8_rowwise_weights(w1, w2) -> Fp8RowwiseWeights:
    """Quantize the bf16 weights once (outside any timed region), expert by expert to bound the fp32 temporary."""
    import torch

    def per_expert(w):
        parts = [quantize_rowwise(w[e]) for e in range(w.shape[0])]
        return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])

    (q1, s1), (q2, s2) = per_expert(w1), per_expert(w2)
    return Fp8RowwiseWeights(q1, s1, q2, s2)


def _scaled_grouped(a, scale_a, w, scale_w, offs):
    import torch

    # mat_b must be column-major (E, K, N): the transpose of the contiguous (E, N, K) weights is
    return torch._scaled_grouped_mm(a, w.transpose(-2, -1), scale_a, scale_w, offs=offs, out_dtype=torch.bfloat16)


def unfused_fp8_moe(x, topk_idx, topk_weights, weights: Fp8RowwiseWeights):
    """The unfused path in FP8: x quantized per token row (before the gather, T rows rather than T*k),
    ``torch._scaled_grouped_mm`` with row-wise scales for Linear-1, SwiGLU times the router weight, h
    re-quantized per row, ``torch._scaled_grouped_mm`` for Linear-2, ``index_add_``. Returns y (T, H) bf16.
    The recipe is row-wise (per token and per output channel), the only scaling torch's grouped FP8 GEMM
    offers on Hopper (``fp8_grouped_unavailable`` says whether it runs here)."""
    rows = sort_by_expert(topk_idx, topk_weights, weights.w1.shape[0])
    xq, sx = quantize_rowwise(x)
    gu = _scaled_grouped(xq.index_select(0, rows.token), sx.index_select(0, rows.token), weights.w1, weights.s1,
                         rows.offs)
    hq, sh = quantize_rowwise(_swiglu_times_weight(gu, rows.weight))
    out = _scaled_grouped(hq, sh, weights.w2, weights.s2, rows.offs)
    return _combine(out, rows.dest, x.shape[0])


@functools.cache
def fp8_grouped_unavailable(device: str = "cuda") -> str | None:
    """Why ``unfused_fp8_moe`` cannot run on ``device`` (a missing op, no GPU, a GPU without FP8 grouped GEMM,
    or a trial on uneven groups, one of them empty, that fails or disagrees with the dequantized product),
    or None where it can."""
    try:
        import torch
    except ImportError as e:
        return f"ImportError: {e}"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return "torch._scaled_grouped_mm needs a CUDA GPU (it has no CPU kernel)"
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    if major != 9:
        return f"torch._scaled_grouped_mm row-wise FP8 runs on sm_90 only; this GPU is sm_{major}{minor}"
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(40, 128, device=device, generator=gen)
        w = torch.randn(3, 256, 128, device=device, generator=gen)
        qa, sa = quantize_rowwise(a)
        qw, sw = (torch.stack(p) for p in zip(*(quantize_rowwise(w[e]) for e in range(3))))
        offs = torch.tensor([17, 17, 40], dtype=torch.int32, device=device)  # 17 rows, none, 23 rows
        got = _scaled_grouped(qa, sa, qw, sw, offs).float()
        deq_a, deq_w = qa.float() * sa[:, None], qw.float() * sw[..., None]
        want = torch.cat([deq_a[:17] @ deq_w[0].T, deq_a[17:] @ deq_w[2].T])
        err = float((got - want).abs().max() / want.abs().max())
    except Exception as e:  # noqa: BLE001 - the reason is the answer
        return f"torch._scaled_grouped_mm trial failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if not err < 2e-2:
        return f"torch._scaled_grouped_mm trial disagrees with the dequantized product (relative error {err:.3g})"
    return None


# --- ceilings and the roofline --------------------------------------------------------------------------------

def dense_products(n: int, gen) -> dict:
    """The n^3 products the ceilings are measured on, as calls on random operands drawn from ``gen``: "bf16"
    (``torch.mm``), "fp8_fast_accum" and "fp8" (``torch._scaled_mm``, e4m3, tensor scales)."""
    import torch

    a = torch.randn(n, n, device="cuda", generator=gen).to(torch.bfloat16)
    b = torch.randn(n, n, device="cuda", generator=gen).to(torch.bfloat16)
    c = torch.empty_like(a)
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm's mat2 must be
    one = torch.ones((), device="cuda")
    return {"bf16": lambda: torch.mm(a, b, out=c),
            "fp8_fast_accum": lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16, use_fast_accum=True),
            "fp8": lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)}


def measure_ceilings(group=None, *, n: int = 8192, copy_bytes: int = 1 << 31, replays: int = 10,
                     calls: int = 4) -> dict:
    """Dense n^3 bf16 (``torch.mm``) and FP8 (``torch._scaled_mm``, tensor scales, with and without fast
    accumulation: the ceiling is the faster) TFLOP/s on random data, and HBM bandwidth of ``copy_bytes``
    copied (read + write bytes counted; copy_ and an elementwise kernel, the faster), each the median over
    ``replays`` interleaved rounds of ``calls``-call CUDA graphs (benchmarks.timing). ``group``: the process
    group the timing aligns on (None: the default group, which must exist)."""
    import torch
    import torch.distributed as dist

    from benchmarks.timing import capture_graph, measure_rounds

    group = group if group is not None else dist.group.WORLD
    gen = torch.Generator(device="cuda").manual_seed(0)
    fns = dense_products(n, gen)
    src = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_(generator=gen)
    dst = torch.empty_like(src)
    # Both copies: in a graph, copy_ becomes a memcpy node that the copy engines run (2.7 TB/s on one H200),
    # while an elementwise kernel streams through the SMs as the MoE kernels do (4.3 TB/s).
    fns.update({"copy": lambda: dst.copy_(src), "stream": lambda: torch.neg(src, out=dst)})
    columns = {name: (fn, capture_graph(fn, calls, group)[0]) for name, fn in fns.items()}
    us, _ = measure_rounds(columns, calls, replays, group)
    flops = 2.0 * n ** 3
    fp8 = {name: flops / us[name] / 1e6 for name in ("fp8", "fp8_fast_accum")}
    hbm = {name: 2.0 * src.nbytes / us[name] / 1e6 for name in ("copy", "stream")}
    return {"bf16_tflops": flops / us["bf16"] / 1e6, "fp8_tflops": max(fp8.values()),
            "fp8_tflops_by_accum": fp8, "hbm_tb_s": max(hbm.values()), "hbm_tb_s_by_way": hbm,
            "us": us, "method": f"{n}^3 torch.mm (bf16) and torch._scaled_mm (e4m3, tensor scales, with and "
                                f"without fast accumulation: the faster); a {copy_bytes / 2 ** 30:.3g} GiB copy_ "
                                "and torch.neg(out=) (read + write bytes: the faster); median over "
                                f"{replays} interleaved rounds of {calls}-call CUDA graphs"}


def _dtype_name(dtype) -> str:
    name = str(dtype).replace("torch.", "")
    if name in ("bf16", "bfloat16"):
        return "bf16"
    if name in ("fp8", "float8_e4m3fn"):
        return "fp8"
    if name == "w4a8":
        return "w4a8"
    raise ValueError(f"the roofline knows bf16, fp8 (e4m3) and w4a8, got {dtype!r}")


def moe_flops(shape, rows: int) -> float:
    """2 * rows * (H * 2I + I * H): Linear-1 (gate and up) and Linear-2 over the routed rows."""
    return 2.0 * rows * (shape.hidden * 2 * shape.intermediate + shape.intermediate * shape.hidden)


def roofline_terms(shape, tokens: int, top_k: int, dtype, ceilings: dict, *, rows: int | None = None,
                   experts_touched: int | None = None) -> dict:
    """The layer's roofline and what it is made of. ``shape`` has hidden, intermediate and num_experts;
    ``rows``: routed (token, expert) rows (default tokens * top_k, pass the count without the -1 entries);
    ``experts_touched``: experts that received a row (default all: pass the routing's count). Bytes are what
    any implementation must move: the touched experts' weights once (1 B per element and the 128x128 fp32
    block scales for fp8, 2 B for bf16, half a byte and a UE8M0 byte per 32 for w4a8) plus x read and y written
    in bf16; FLOPs at the dense ceiling of the dtype (``ceilings``: bf16_tflops, fp8_tflops, hbm_tb_s, as
    measure_ceilings returns; w4a8 multiplies in FP8)."""
    kind = _dtype_name(dtype)
    rows = tokens * top_k if rows is None else rows
    touched = shape.num_experts if experts_touched is None else experts_touched
    h, i = shape.hidden, shape.intermediate
    weight_bytes = touched * 3 * h * i * {"fp8": 1.0, "bf16": 2.0, "w4a8": 0.5 + 1.0 / FP4_SCALE_BLOCK}[kind]
    if kind == "fp8":
        blocks = (2 * i // SCALE_BLOCK) * (h // SCALE_BLOCK) + (h // SCALE_BLOCK) * (i // SCALE_BLOCK)
        weight_bytes += touched * 4 * blocks
    act_bytes = 2 * tokens * h * 2
    flops = moe_flops(shape, rows)
    compute_s = flops / (ceilings[f"{'fp8' if kind == 'w4a8' else kind}_tflops"] * 1e12)
    memory_s = (weight_bytes + act_bytes) / (ceilings["hbm_tb_s"] * 1e12)
    return {"dtype": kind, "rows": rows, "experts_touched": touched, "flops": flops, "weight_bytes": weight_bytes,
            "activation_bytes": act_bytes, "compute_s": compute_s, "memory_s": memory_s,
            "seconds": max(compute_s, memory_s), "bound": "compute" if compute_s >= memory_s else "memory"}


def roofline_seconds(shape, tokens: int, top_k: int, dtype, ceilings: dict, *, rows: int | None = None,
                     experts_touched: int | None = None) -> float:
    """max(FLOPs / dense ceiling, bytes / HBM bandwidth) in seconds (``roofline_terms`` says which bytes)."""
    return roofline_terms(shape, tokens, top_k, dtype, ceilings, rows=rows, experts_touched=experts_touched)["seconds"]
