"""``xstage bench megamoe``: the MegaMoE layer on one GPU (issue 28, item 7), every column side by side in one
process, each timed by CUDA-Graph replay in interleaved rounds (a fresh random order each round,
``benchmarks.timing.measure_rounds``), with the roofline from ceilings measured in the same run.

Rows: --shapes (presets below) x --world (1, or P ranks: emulated on the one GPU, or real, one GPU each, by
--ranks) x --tokens (per rank) x --routing (megamoe.reference.make_routing). Columns (COLUMNS):
  unfused_bf16           sort by expert, torch._grouped_mm, SwiGLU x weight, torch._grouped_mm, index_add_
  unfused_fp8            the same with torch._scaled_grouped_mm, row-wise scales (benchmarks.moe_baselines)
  ours_<dtype>_<sched>   megamoe.api.MegaMoE, dtype bf16 or fp8 (e4m3 W8A8), schedule wave or interleaved:
                         one instance per dtype, the schedule chosen per call (forward(..., schedule=...)).
  unfused_nccl_<dtype>   real ranks only: NCCL All-to-All dispatch, the grouped GEMMs and SwiGLU of the
                         unfused path, NCCL All-to-All combine, weighted sum (benchmarks.moe_nccl)
--ranks emulated|real (default: real where torch.cuda.device_count() >= the world, else emulated) says what a
world P > 1 is; real ranks run as P processes (benchmarks/megamoe_ep.py says how, and what a real row holds).
At emulated world P every column does the P ranks' work, P x tokens rows of x, on the one GPU: ours as P concurrent
emulated ranks (MegaMoE(..., emulated_ranks=P) on x stacked rank by rank, or the API's EmulatedMoE on per-rank
views of it), the unfused paths as one call over all of it; the roofline counts the same work. A column that
is missing, unsupported or left out by --columns is recorded as {"skipped": reason}, one that raised as
{"failed": reason}: none is silently absent.
Per timed column: µs per call, effective TFLOP/s (2 rows (2IH + IH) / t), roofline efficiency (roofline / t,
the dtype's roofline: benchmarks.moe_baselines.roofline_terms) and, for ours, the speedup over the unfused
path of the same dtype, and the Tensor Cores' rate (mma_tflops: the FLOPs of the row's ``mma_rows``, the routed
rows with the padding of each expert's last 64-row half, megamoe.schedule.mma_rows); the error against
megamoe.reference (fp32, h rounded to bf16 for bf16 columns, the same FP8 quantization for ours_fp8;
unfused_fp8's row-wise recipe against the unquantized reference).
--dump FILE: one instrumented launch per ours column and row (MegaMoE(..., instrument=True).last_dump()),
the arrays in FILE.npz and what they are in FILE.json.
--matrix: the configuration matrix instead (benchmarks/megamoe_matrix.py: the seven PRESETS x precision x
routing x tokens x world, ours wave vs interleaved only), which reuses this file's row runner (run_columns).
The command's runner, above this file, the matrix and the real-rank phases: benchmarks/megamoe_cli.py.
"""
from __future__ import annotations

import json
import os
import sys
import zlib
from dataclasses import asdict, dataclass

from benchmarks.megamoe_ranks import METHOD as METHOD_REAL
from benchmarks.megamoe_ranks import add_ranks_argument, one_reason, ranks_record


@dataclass(frozen=True)
class Preset:
    """A MoE layer: hidden (L1's K, L2's N), intermediate (per expert; L1's N is 2x), experts, top-k."""

    name: str
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int


PRESETS = {p.name: p for p in (Preset("dsv4-flash", 4096, 2048, 256, 6),  # DeepSeek-V4-Flash-like
                               Preset("qwen3-moe", 4096, 1536, 128, 8),  # Qwen3-MoE-like
                               Preset("dit-moe", 1152, 4608, 8, 2),  # DiT-MoE-XL-like
                               Preset("hunyuan", 4096, 1536, 192, 8),  # Hunyuan-like
                               Preset("mimo", 4096, 2048, 256, 8),  # MiMo-like
                               Preset("glm", 6144, 2048, 256, 8),  # GLM-like
                               Preset("dsv4-pro", 7168, 3072, 384, 6))}  # DeepSeek-V4-Pro-like
DEFAULT_SHAPES = ("dsv4-flash", "qwen3-moe", "dit-moe")  # this bench's default; --matrix runs all seven
ROUTINGS = ("balanced", "skewed", "one_expert")  # megamoe.reference.ROUTING_MODES (a test keeps them equal)
SCHEDULES = ("wave", "interleaved")
DTYPES = ("bf16", "fp8", "w4a8")
UNFUSED_DTYPES = ("bf16", "fp8")  # W4A8 has no unfused path on Hopper (no FP4 grouped GEMM): it is judged against fp8's
# What each precision name passes to MegaMoE(dtype=...), tried in order until the constructor accepts one (a
# name that is a torch attribute becomes that torch dtype): a precision the API does not build yet is then a
# skipped column with the constructor's reasons, and runs untouched once the API accepts it.
API_DTYPES = {"bf16": ("bfloat16",), "fp8": ("float8_e4m3fn", "w8a8"), "w8a8": ("w8a8", "float8_e4m3fn"),
              "w4a8": ("w4a8",)}
FP8_H_BLOCK = 64  # h is re-quantized in 1 x 64 runs before Linear-2 in 128 x 128 tiles (wide: fp8_h_block)


def fp8_h_block(layer) -> int:
    """The intermediate's FP8 scale run of a quantized layer: one per L1 tile, N / 2 of its tile (64; 128 in a
    W8A8 layer's 128 x 256 tiles); FP8_H_BLOCK for anything without a ``shape`` (a reason string)."""
    shape = getattr(layer, "shape", None)
    return shape.block_n // 2 if shape is not None else FP8_H_BLOCK
COLUMNS = ("unfused_bf16", "unfused_fp8", *(f"ours_{d}_{s}" for d in DTYPES for s in SCHEDULES),
           *(f"unfused_nccl_{d}" for d in UNFUSED_DTYPES))
WORLDS = (1, 2, 4, 8)
NEEDS_REAL = "needs real ranks (--ranks real, P GPUs): this row is {mode}"
DEFAULT_OUT = "benchmarks/results/h200/megamoe.json"


# --- arguments ------------------------------------------------------------------------------------------------

def _comma_list(text: str, what: str, choices=None, convert=str) -> list:
    import argparse

    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"no {what} given")
    out = []
    for s in items:
        try:
            value = convert(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad {what} {s!r}") from None
        if choices is not None and value not in choices:
            raise argparse.ArgumentTypeError(f"unknown {what} {s!r} (choose from {', '.join(map(str, choices))})")
        out.append(value)
    return list(dict.fromkeys(out))  # order kept, repeats dropped


def _shapes(text):
    return [PRESETS[n] for n in _comma_list(text, "shape", PRESETS)]


def _tokens(text):
    import argparse

    out = _comma_list(text, "token count", convert=int)
    if any(t <= 0 for t in out):
        raise argparse.ArgumentTypeError(f"token counts must be positive, got {text}")
    return out


def add_arguments(p) -> None:
    presets = "; ".join(f"{n}: {s.hidden}/{s.intermediate}, {s.num_experts} experts, top-{s.top_k}"
                        for n, s in PRESETS.items())
    p.add_argument("--shapes", type=_shapes, default=[PRESETS[n] for n in DEFAULT_SHAPES], metavar="LIST",
                   help=f"comma-separated presets ({presets}); default {','.join(DEFAULT_SHAPES)}")
    p.add_argument("--tokens", type=_tokens, default=[1024, 4096, 8192], metavar="LIST",
                   help="tokens per rank, comma-separated (need not be multiples of 128; default 1024,4096,8192)")
    p.add_argument("--routing", type=lambda t: _comma_list(t, "routing", ROUTINGS), default=["balanced", "skewed"],
                   metavar="LIST", help=f"comma-separated, of {', '.join(ROUTINGS)} (default balanced,skewed)")
    p.add_argument("--world", type=lambda t: _comma_list(t, "world size", WORLDS, int), default=[1, 2],
                   metavar="LIST", help="ranks, of 1, 2, 4, 8 (P > 1: emulated on one GPU or real, --ranks); "
                                        "default 1,2")
    p.add_argument("--columns", type=lambda t: _comma_list(t, "column", COLUMNS), default=list(COLUMNS),
                   metavar="LIST", help=f"comma-separated, of {', '.join(COLUMNS)} (default all)")
    add_ranks_argument(p)
    p.add_argument("--replays", type=int, default=10, help="interleaved rounds (default 10)")
    p.add_argument("--calls-per-graph", type=int, default=2, help="calls per captured graph (default 2)")
    p.add_argument("--out", default=DEFAULT_OUT, help="result JSON, rewritten after every row")
    p.add_argument("--png", default=None, help="the figure (default: the JSON's name with .png)")
    p.add_argument("--dump", default=None, metavar="FILE",
                   help="per-tile instrumentation of ours: FILE.npz (arrays) and FILE.json (header)")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights, inputs and routing of every row")
    p.add_argument("--tmp", default="/tmp", help="where the one-rank process group's rendezvous file goes")
    p.add_argument("--matrix", action="store_true",
                   help="the configuration matrix instead, wave vs interleaved over shapes x precision x routing x "
                        "tokens x world (benchmarks/megamoe_matrix.py; --matrix --help lists its options)")


# --- the pieces of a row --------------------------------------------------------------------------------------

def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"


def row_seed(seed: int, *parts) -> int:
    """A row's (or a preset's weights') seed: stable across runs and distinct per row."""
    return zlib.crc32("/".join(map(str, (seed, *parts))).encode()) & 0x7FFFFFFF


def load_api():
    """(the megamoe.api module, None), or (None, why): the API is written beside this benchmark, so it may be
    missing. Used: ``MegaMoE`` and, where MegaMoE takes no ``emulated_ranks`` yet, ``EmulatedMoE``."""
    try:
        import megamoe.api as api  # noqa: PLR0402 - this form consults sys.modules, so a test can hide the API
    except Exception as e:  # noqa: BLE001 - an API that does not import is a skipped column, with why
        return None, f"megamoe.api unavailable ({_reason(e)})"
    return api, None


class RankLists:
    """``EmulatedMoE`` (per-rank lists in and out) behind MegaMoE's one-tensor forward: x (P*T, H) stacked
    rank by rank, split into views per call. forward returns the P outputs as a list (the bench concatenates
    them for the check outside the timed call, so no extra copy is timed); last_dump concatenates the ranks'
    records with a ``rank`` array."""

    def __init__(self, emulated, world: int):
        self.emulated, self.world = emulated, world

    @property
    def shape(self):
        """The ranks' layer shape (one layer: every rank's is the same)."""
        return self.emulated.ranks[0].shape

    def load_weights(self, w1, w2):
        self.emulated.load_weights(w1, w2)

    def forward(self, x, topk_idx, topk_weights, schedule=None):
        t = x.shape[0] // self.world
        parts = [[a[r * t:(r + 1) * t] for r in range(self.world)] for a in (x, topk_idx, topk_weights)]
        return self.emulated.forward(*parts, schedule=schedule)

    def last_dump(self) -> dict:
        import numpy as np

        dumps = [m.last_dump() for m in self.emulated.ranks]
        out = {k: np.concatenate([d[k] for d in dumps]) for k in dumps[0]}
        out["rank"] = np.concatenate([np.full(len(next(iter(d.values()), [])), r) for r, d in enumerate(dumps)])
        return out


class GatheredProbe:
    """An instrumented layer at real P behind dump_row: forward as the layer's, last_dump every rank's records
    (gathered, concatenated) with a ``rank`` array."""

    def __init__(self, layer, ranks):
        self.layer, self.ranks = layer, ranks

    def forward(self, x, idx, wts, schedule=None):
        return self.layer.forward(x, idx, wts, schedule=schedule)

    def last_dump(self) -> dict:
        """Collective: every rank's records, or the same RuntimeError on every rank where one rank's failed."""
        import numpy as np

        try:
            mine = self.layer.last_dump()
        except Exception as e:  # noqa: BLE001 - sent to every rank, so none waits in the gather alone
            mine = _reason(e)
        dumps = self.ranks.gather(mine)
        bad = [(r, d) for r, d in enumerate(dumps) if isinstance(d, str)]
        if bad:
            raise RuntimeError(one_reason(bad, len(dumps)))
        out = {k: np.concatenate([np.asarray(d[k]) for d in dumps]) for k in dumps[0]}
        out["rank"] = np.concatenate([np.full(len(np.asarray(next(iter(d.values()), []))), r)
                                      for r, d in enumerate(dumps)])
        return out


def make_weights(preset: Preset, seed: int, device):
    """w1 (E, 2I, H) and w2 (E, H, I) bf16, N(0, 1/K) so every stage's output stays O(1); drawn expert by
    expert so the fp32 temporary stays one expert's size."""
    import torch

    e, h, i = preset.num_experts, preset.hidden, preset.intermediate
    gen = torch.Generator(device=device).manual_seed(seed)
    w1 = torch.empty(e, 2 * i, h, dtype=torch.bfloat16, device=device)
    w2 = torch.empty(e, h, i, dtype=torch.bfloat16, device=device)
    for x in range(e):
        w1[x] = torch.randn(2 * i, h, generator=gen, device=device) * h ** -0.5
        w2[x] = torch.randn(h, i, generator=gen, device=device) * i ** -0.5
    return w1, w2


def build_ours(api, group, preset: Preset, world: int, tokens: int, w1, w2, dtypes, instrument: bool = False,
               real: bool = False):
    """{dtype: a loaded layer, or the reason there is none}, max_tokens_per_rank = tokens. World P > 1:
    MegaMoE(..., emulated_ranks=P), else the API's EmulatedMoE behind ``RankLists``; ``real``: this rank's
    MegaMoE(group, ...) of a P-rank group. ``dtypes``: names of API_DTYPES, each tried with its candidates in
    order."""
    import torch

    module, why = api
    out = {}
    for d in dtypes:
        if module is None:
            out[d] = why
            continue
        candidates = [getattr(torch, n, n) for n in API_DTYPES.get(d, (d,))]
        whys = []
        for dtype in candidates:
            try:
                out[d] = _build_one(module, group, preset, 1 if real else world, tokens, w1, w2, d, dtype,
                                    instrument)
                break
            except Exception as e:  # noqa: BLE001 - e.g. no emulated ranks yet, or a dtype not built yet
                extra = next((k for k in ("emulated_ranks", "instrument") if k in str(e)), None)
                if extra and isinstance(e, TypeError):
                    out[d] = f"MegaMoE takes no {extra} yet ({_reason(e)})"
                    break
                whys.append((dtype, _reason(e)))
        else:
            unique = list(dict.fromkeys(why for _, why in whys))
            out[d] = f"MegaMoE({d}) unsupported here: " + (unique[0] if len(unique) == 1 else "; ".join(
                f"dtype={t!r}: {why}" for t, why in whys))
    return out


def _build_one(module, group, preset: Preset, world: int, tokens: int, w1, w2, d: str, dtype, instrument: bool):
    """One loaded layer of precision ``d`` built with MegaMoE(dtype=``dtype``), or the constructor's error."""
    import inspect

    kwargs = {"dtype": dtype, "schedule": "interleaved", "lead": None, "max_tokens_per_rank": tokens}
    if instrument:
        kwargs["instrument"] = True
    shape = (preset.num_experts, preset.top_k, preset.hidden, preset.intermediate)
    cls = module.MegaMoE
    params = inspect.signature(cls).parameters
    if world == 1:
        moe = cls(group, *shape, **kwargs)
    elif "emulated_ranks" in params or not hasattr(module, "EmulatedMoE"):
        moe = cls(group, *shape, emulated_ranks=world, **kwargs)
    else:
        emu_params = inspect.signature(module.EmulatedMoE).parameters
        if "dtype" not in emu_params:
            if d != "bf16":
                raise ValueError(f"EmulatedMoE takes no dtype: bf16 only, not {d}")
            kwargs.pop("dtype")
        moe = RankLists(module.EmulatedMoE(world, *shape, **kwargs), world)
    moe.load_weights(w1, w2)
    return moe


def output_error(got, ref) -> dict:
    """Max |got - ref|, that over max |ref| (relative to the output's scale: elementwise ratios are
    meaningless where y crosses 0), and whether every output is finite."""
    import torch

    d = (got.float() - ref.float()).abs()
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    worst = float(d.max()) if d.numel() else 0.0
    return {"max_abs": worst, "max_rel": worst / scale if scale > 0 else None,
            "finite": bool(torch.isfinite(got).all())}


def column_calls(x, idx, wts, w1, w2, fp8w, fp8_why: str | None, ours: dict, wanted, mode: str = "emulated") -> dict:
    """{column: a call, or {"skipped": why}} for one row (one GPU or emulated ranks, ``mode``), every column of
    COLUMNS present (real ranks: benchmarks.megamoe_ep.real_calls)."""
    from benchmarks.moe_baselines import unfused_bf16_moe, unfused_fp8_moe

    cols = {"unfused_bf16": lambda: unfused_bf16_moe(x, idx, wts, w1, w2),
            "unfused_fp8": {"skipped": fp8_why} if fp8_why else (lambda: unfused_fp8_moe(x, idx, wts, fp8w))}
    for d in DTYPES:
        for s in SCHEDULES:
            m = ours.get(d, "not built")
            cols[f"ours_{d}_{s}"] = ({"skipped": m} if isinstance(m, str)
                                     else (lambda m=m, s=s: m.forward(x, idx, wts, schedule=s)))
    for d in UNFUSED_DTYPES:
        cols[f"unfused_nccl_{d}"] = {"skipped": NEEDS_REAL.format(mode=mode)}
    return {n: (c if n in wanted or "unfused_nccl" in n else {"skipped": "left out by --columns"})
            for n, c in cols.items()}


def column_dtype(name: str) -> str:
    return "w4a8" if "w4a8" in name else "fp8" if "fp8" in name else "bf16"


def routed_mma_rows(idx, num_experts: int) -> int:
    """The rows the kernel's Tensor Cores multiply for routing ``idx`` (all ranks'): megamoe.schedule.mma_rows."""
    from megamoe.reference import expert_counts
    from megamoe.schedule import mma_rows

    return mma_rows(expert_counts(idx, num_experts).tolist())


def derive(row: dict, preset) -> None:
    """Speedups over the unfused path of the same dtype (at real ranks the NCCL one, unfused_nccl_<dtype>;
    row["baseline"] names it), interleaved / wave time per dtype, and each of our columns' mma_tflops (the
    FLOPs of row["mma_rows"], padding rows included, per second)."""
    from benchmarks.moe_baselines import moe_flops

    cols = row["columns"]
    mma_flops = moe_flops(preset, row["mma_rows"])
    for name, c in cols.items():
        if name.startswith("ours_") and "us" in c:
            c["mma_tflops"] = mma_flops / c["us"] / 1e6
    row["baseline"] = {}
    for d in DTYPES:
        u = "fp8" if d == "w4a8" else d
        name = next((n for n in (f"unfused_nccl_{u}", f"unfused_{u}") if "us" in cols.get(n, {})), None)
        row["baseline"][d] = name
        base = cols[name]["us"] if name else None
        for s in SCHEDULES:
            c = cols[f"ours_{d}_{s}"]
            if "us" in c and base:
                c["speedup_vs_unfused"] = base / c["us"]
        wave, inter = (cols[f"ours_{d}_{s}"].get("us") for s in SCHEDULES)
        row["interleaved_over_wave"][d] = inter / wave if wave and inter else None


def dump_summary(arrays: dict) -> dict:
    """What each dumped array is (shape, dtype) and, for a non-empty numeric one, its median."""
    import numpy as np

    out = {}
    for name, a in arrays.items():
        a = np.asarray(a)
        entry = {"shape": list(a.shape), "dtype": str(a.dtype)}
        if a.size and np.issubdtype(a.dtype, np.number):
            entry["median"] = float(np.median(a))
        out[name] = entry
    return out


# --- a run ------------------------------------------------------------------------------------------------------

def bench(args, group, *, device="cuda", ceilings=None, capture=None, timer=None, api=None, worlds=None,
          command=None) -> dict:
    """Every row of ``args`` (add_arguments' namespace; --shapes may hold any Preset) at the one-GPU and
    emulated worlds ``worlds`` (default args.world), written to args.out (and its figure) after every row.
    The keyword arguments replace the GPU parts for a test: ``ceilings`` (measure_ceilings' dict),
    ``capture(fn)`` -> (graph or None, how), ``timer(columns)`` -> (medians µs, per-round times) as
    measure_rounds, ``api`` as load_api returns."""
    from types import SimpleNamespace

    import torch

    from benchmarks.moe_baselines import (
        fp8_grouped_unavailable,
        fp8_rowwise_weights,
        measure_ceilings,
    )
    from benchmarks.timing import capture_graph, measure_rounds

    torch.set_grad_enabled(False)
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays fp32
    ctx = SimpleNamespace(args=args, device=device)
    ctx.ceilings = ceilings if ceilings is not None else measure_ceilings(group, replays=args.replays)
    ctx.capture = capture or (lambda fn: capture_graph(fn, args.calls_per_graph, group))
    ctx.timer = timer or (lambda cols: measure_rounds(cols, args.calls_per_graph, args.replays, group))
    api = api or load_api()
    ctx.fp8_why = fp8_grouped_unavailable(str(device)) if "unfused_fp8" in args.columns else None
    ours_dtypes = [d for d in DTYPES if any(f"ours_{d}_{s}" in args.columns for s in SCHEDULES)]
    result = new_result(args, command or "xstage bench megamoe " + " ".join(_argv()), ctx.ceilings, api,
                        ctx.fp8_why)
    result["ceilings_by_world"] = {str(w): ctx.ceilings for w in worlds or args.world}
    ctx.dumps, ctx.dump_entries = {}, []
    try:
        for preset in args.shapes:
            w1, w2 = make_weights(preset, row_seed(args.seed, preset.name, "weights"), device)
            fp8w = fp8_rowwise_weights(w1, w2) if "unfused_fp8" in args.columns and not ctx.fp8_why else None
            for world in worlds or args.world:
                for tokens in args.tokens:
                    ours = build_ours(api, group, preset, world, tokens, w1, w2, ours_dtypes)
                    probes = (build_ours(api, group, preset, world, tokens, w1, w2, ours_dtypes, instrument=True)
                              if args.dump else None)
                    for routing in args.routing:
                        row = measure_row(ctx, preset, world, tokens, routing, (w1, w2, fp8w), ours, probes,
                                          len(result["rows"]))
                        result["rows"].append(row)
                        _write(result, args)
                        print(summary_line(row), flush=True)
                    del ours, probes
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
            del w1, w2, fp8w
    finally:
        if args.dump:
            _write_dump(args.dump, ctx.dumps, ctx.dump_entries, result["command"])
    return result


def new_result(args, command: str, ceilings: dict, api, fp8_why) -> dict:
    """A run's result before its rows (what _write writes beside them)."""
    from benchmarks.moe_nccl import RECIPE

    modes = getattr(args, "rank_modes", None) or {w: "one GPU" if w == 1 else "emulated" for w in args.world}
    return {"command": command, "ceilings": ceilings, "api_unavailable": api[1], "unfused_fp8_unavailable": fp8_why,
            "unfused_fp8_recipe": "row-wise: one scale per token row and per output channel of each expert",
            "unfused_nccl_recipe": RECIPE, **ranks_record(getattr(args, "ranks", None), modes,
                                                          getattr(args, "gpus", None)),
            "presets": {p.name: asdict(p) for p in args.shapes}, "rows": []}


def reference_output(key: str, x, idx, wts, w1, w2, h_block: int = FP8_H_BLOCK):
    """(the reference, what it is) of the bf16 columns (``key`` "bf16"), of ours_fp8 ("fp8") or of ours_w4a8
    ("w4a8"); ``h_block``: the quantized layer's intermediate scale run (fp8_h_block)."""
    import torch

    from megamoe.reference import reference_moe, reference_moe_fp8, reference_moe_w4a8

    if key == "w4a8":
        return (reference_moe_w4a8(x, idx, wts, w1, w2, l2_block=h_block, combine_dtype=torch.bfloat16),
                "fp32, the same W4A8 weight recipe and FP8 activations")
    if key == "fp8":
        return (reference_moe_fp8(x, idx, wts, w1, w2, l2_block=h_block, combine_dtype=torch.bfloat16),
                "fp32, the same FP8 quantization")
    return (reference_moe(x, idx, wts, w1, w2, intermediate_dtype=torch.bfloat16, combine_dtype=torch.bfloat16),
            "fp32, h and expert rows rounded to bf16")


def measure_row(ctx, preset: Preset, world: int, tokens: int, routing: str, weights, ours: dict, probes,
                index: int) -> dict:
    """One row: fresh seeded inputs and routing for world x tokens rows, every column checked once eagerly
    against the reference, then timed together; ``probes`` (instrumented instances, or None) are dumped."""
    import torch

    from benchmarks.moe_baselines import roofline_terms
    from megamoe.reference import make_routing, routing_stats

    w1, w2, fp8w = weights
    total = world * tokens
    seed = row_seed(ctx.args.seed, preset.name, world, tokens, routing)
    gen = torch.Generator(device=ctx.device).manual_seed(seed)
    x = torch.randn(total, preset.hidden, generator=gen, device=ctx.device).to(torch.bfloat16)
    idx, wts = make_routing(total, preset.num_experts, preset.top_k, routing, seed, ctx.device)
    stats = routing_stats(idx, preset.num_experts)
    roof = {d: roofline_terms(preset, total, preset.top_k, d, ctx.ceilings, rows=stats["rows"],
                              experts_touched=stats["experts_touched"]) for d in DTYPES}
    row = {"shape": preset.name, "hidden": preset.hidden, "intermediate": preset.intermediate,
           "num_experts": preset.num_experts, "top_k": preset.top_k, "world": world,
           "ranks": "one GPU" if world == 1 else "emulated", "tokens_per_rank": tokens,
           "tokens": total, "routing": routing, "seed": seed, **stats, "flops": roof["bf16"]["flops"],
           "mma_rows": routed_mma_rows(idx, preset.num_experts),
           "roofline": roof, "columns": {}, "interleaved_over_wave": {}}
    refs = {}

    def reference(name):  # each computed once per row, for the columns that run
        key = {"ours_fp8": "fp8", "ours_w4a8": "w4a8"}.get(name.rsplit("_", 1)[0], "bf16")
        if key not in refs:
            refs[key] = reference_output(key, x, idx, wts, w1, w2, fp8_h_block(ours.get(key)))
        return refs[key][0], refs[key][1] + (" (unquantized: this column's row-wise FP8 is not applied)"
                                             if name == "unfused_fp8" else "")

    calls = column_calls(x, idx, wts, w1, w2, fp8w, ctx.fp8_why, ours, ctx.args.columns, row["ranks"])
    row["columns"], times = run_columns(calls, reference, ctx.capture, ctx.timer)
    for name, c in row["columns"].items():
        if "us" in c:
            us = c["us"]
            c.update(dtype=column_dtype(name), tflops=row["flops"] / us / 1e6,
                     roofline_efficiency=roof[column_dtype(name)]["seconds"] * 1e6 / us)
        elif "timing" in c:
            c["dtype"] = column_dtype(name)
    row["round_times_us"] = {n: [round(t, 3) for t in ts] for n, ts in times.items()}
    derive(row, preset)
    if probes is not None:
        dump_row(ctx, row, index, probes, (x, idx, wts))
    return row


def run_columns(calls: dict, reference, capture, timer, agree=None) -> tuple[dict, dict]:
    """The row runner's core, shared with the matrix: every call of ``calls`` ({name: a call, or {"skipped":
    why}}) once eagerly (the correctness check, and the warm-up that compiles) against ``reference(name)`` ->
    (tensor, what it is) or (None, why there is none), then ``capture(fn)`` -> (graph or None, how); the live
    ones timed together by ``timer({name: (fn, graph)})`` -> (medians µs, per-round times). Returns ({name:
    {"timing", "error", "us"} or {"skipped"} or {"failed": why}}, per-round times): a column that raises is
    recorded as failed and the rest still run. ``agree(ok)`` (real ranks; a collective, called once per call
    after its eager check): True where the check passed on every rank, so every rank captures and times the
    same columns (one failed elsewhere is recorded here as failed on another rank)."""
    import torch

    cols, live = {}, {}
    for name, fn in calls.items():
        if isinstance(fn, dict):
            cols[name] = fn
            continue
        try:
            y = fn()
            y = torch.cat(y) if isinstance(y, (list, tuple)) else y  # RankLists: one output per rank
            ref, what = reference(name)
            err = output_error(y, ref) if ref is not None else {"finite": bool(torch.isfinite(y).all())}
            del y
            cols[name] = {"error": {"reference": what, **err}}
        except Exception as e:  # noqa: BLE001 - one failing column must not hide the others
            cols[name] = {"failed": _reason(e)}
        if agree is not None and not agree("failed" not in cols[name]) and "failed" not in cols[name]:
            cols[name] = {"failed": "failed on another rank"}
        if "failed" in cols[name]:
            continue
        try:
            graph, how = capture(fn)
            live[name] = (fn, graph)
            cols[name] = {"timing": how, **cols[name]}
        except Exception as e:  # noqa: BLE001 - as above
            cols[name] = {"failed": _reason(e)}
        if agree is not None and not agree(name in live) and name in live:
            del live[name]
            cols[name] = {"failed": "failed on another rank"}
    medians, times = timer(live) if live else ({}, {})
    for name, us in medians.items():
        cols[name]["us"] = us
    del live
    return cols, times


def dump_row(ctx, row: dict, index: int, probes: dict, inputs) -> None:
    """One instrumented launch per ours column of the row, on the row's inputs: the arrays go to ctx.dumps
    under r<index>.<column>.<name>, what they are into the row and ctx.dump_entries."""
    import torch

    row["dump"] = {}
    for d in DTYPES:
        for s in SCHEDULES:
            name = f"ours_{d}_{s}"
            probe = probes.get(d, "not built")
            if "skipped" in row["columns"][name] or isinstance(probe, str):
                row["dump"][name] = {"skipped": row["columns"][name].get("skipped") or probe}
                continue
            try:
                probe.forward(*inputs, schedule=s)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                arrays = probe.last_dump()
            except Exception as e:  # noqa: BLE001 - recorded in the row
                row["dump"][name] = {"failed": _reason(e)}
                continue
            meta = {"row": index, "column": name, "precision": d, "schedule": s, "block_n": probe.shape.block_n,
                    **{k: row[k] for k in ("shape", "world", "ranks", "tokens_per_rank", "routing", "seed")}}
            row["dump"][name] = store_dump(ctx.dumps, ctx.dump_entries, f"r{index}.{name}", arrays, meta)


def store_dump(dumps: dict, entries: list, prefix: str, arrays: dict, meta: dict) -> dict:
    """One instrumented launch's records into a dump being built (shared with the matrix's --dump): the arrays
    into ``dumps`` under <prefix>.<name>, its entry (``meta``, the prefix, what each array is) onto ``entries``;
    returns what the result file says of it ({"key_prefix", "arrays"})."""
    dumps.update({f"{prefix}.{k}": v for k, v in arrays.items()})
    record = {"key_prefix": prefix, "arrays": dump_summary(arrays)}
    entries.append({**meta, **record})
    return record


def _dump_paths(path: str) -> tuple[str, str]:
    stem = path[:-4] if path.endswith((".npz", ".json")) else path
    stem = stem.removesuffix(".")
    return stem + ".npz", stem + ".json"


def _write_dump(path: str, dumps: dict, entries: list, command: str, extra: dict | None = None) -> None:
    """FILE.npz (``dumps``) and FILE.json (provenance, the npz's name, ``entries``, and ``extra``'s fields)."""
    import numpy as np

    from cute_kernels.runtime import provenance

    npz, header = _dump_paths(path)
    os.makedirs(os.path.dirname(os.path.abspath(npz)), exist_ok=True)
    np.savez_compressed(npz, **dumps)
    with open(header, "w") as f:
        json.dump({"provenance": provenance(command), "npz": os.path.basename(npz),
                   "key": "<key_prefix>.<array name>, one prefix per (row, column)", **(extra or {}),
                   "entries": entries}, f, indent=1)


def load_dump(path: str) -> tuple[dict, list]:
    """The arrays and entries of a --dump the phase before wrote (none: empty), to continue it."""
    import numpy as np

    npz, header = _dump_paths(path)
    if not (os.path.exists(npz) and os.path.exists(header)):
        return {}, []
    with np.load(npz) as z:
        arrays = {k: z[k] for k in z.files}
    with open(header) as f:
        return arrays, json.load(f)["entries"]


def _argv() -> list[str]:
    argv = sys.argv[1:]
    return argv[2:] if argv[:2] == ["bench", "megamoe"] else argv  # through ``xstage``: already named


METHOD = ("each column's first call eager (checked against megamoe.reference), then CUDA graphs of calls_per_graph "
          "calls; all columns replayed in interleaved rounds, a fresh random order each round "
          "(benchmarks.timing.measure_rounds), median over rounds; roofline = max(FLOPs / the dtype's dense "
          "ceiling, (touched experts' weights + x and y in bf16) / HBM copy bandwidth), ceilings measured at the "
          "start of the same run; roofline_efficiency = roofline / time; at emulated world P all P ranks' tokens on "
          "the one GPU (real ranks: method_real_ranks)")


def _write(result: dict, args) -> None:
    from cute_kernels.runtime import provenance

    out = {"provenance": provenance(result["command"]), "method": METHOD,
           **({"method_real_ranks": METHOD_REAL} if any(r.get("ranks") == "real" for r in result["rows"]) else {}),
           "args": {"shapes": [p.name for p in args.shapes], "tokens": args.tokens, "routing": args.routing,
                    "world": args.world, "ranks": getattr(args, "ranks", None), "columns": args.columns,
                    "replays": args.replays, "calls_per_graph": args.calls_per_graph, "seed": args.seed},
           **{k: v for k, v in result.items() if k != "command"}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    plot(out, args.png or os.path.splitext(args.out)[0] + ".png")


def summary_line(row: dict) -> str:
    cells = []
    for name, c in row["columns"].items():
        if "us" in c:
            rel = c["error"].get("max_rel")
            cells.append(f"{name} {c['us']:.0f} µs ({c['tflops']:.0f} TF, {c['roofline_efficiency']:.2f} roof, "
                         f"rel err {'—' if rel is None else f'{rel:.1e}'})")
        elif "failed" in c:
            cells.append(f"{name} FAILED")
    roof = row["roofline"]
    mode = " real" if row.get("ranks") == "real" else ""
    return (f"{row['shape']} P={row['world']}{mode} T={row['tokens_per_rank']} {row['routing']}: "
            f"roofline bf16 {roof['bf16']['seconds'] * 1e6:.0f} µs / fp8 {roof['fp8']['seconds'] * 1e6:.0f} µs"
            + (f" / w4a8 {roof['w4a8']['seconds'] * 1e6:.0f} µs" if "w4a8" in roof else "") + "; "
            + "; ".join(cells))


def plot(result: dict, path: str) -> None:
    """Bars of effective TFLOP/s per row and column, one panel per (shape, world), each dtype's roofline as a
    marker over its row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = result["rows"]
    groups = list(dict.fromkeys((r["shape"], r["world"]) for r in rows)) or [("no rows", 0)]
    widest = max([sum(1 for r in rows if (r["shape"], r["world"]) == g) for g in groups] + [1])
    fig, axes = plt.subplots(len(groups), 1, figsize=(max(8.0, 2.2 * widest), 3.4 * len(groups)), squeeze=False)
    for ax, g in zip(axes[:, 0], groups):
        mine = [r for r in rows if (r["shape"], r["world"]) == g]
        names = [c for c in COLUMNS if any("tflops" in r["columns"].get(c, {}) for r in mine)]
        xs = np.arange(len(mine))
        width = 0.8 / max(1, len(names))
        for j, c in enumerate(names):
            ax.bar(xs - 0.4 + (j + 0.5) * width, [r["columns"][c].get("tflops", 0.0) for r in mine], width, label=c)
        top = 1.0
        for d, marker in (("bf16", "_"), ("fp8", "x"), ("w4a8", "+")):
            if not all(d in r["roofline"] for r in mine):
                continue
            roof = [r["flops"] / r["roofline"][d]["seconds"] / 1e12 for r in mine]
            ax.scatter(xs, roof, marker=marker, color="k", s=200, zorder=3, label=f"roofline {d}")
            top = max([top, *roof])
        ax.set_ylim(0, 1.3 * top)  # headroom: the legend sits above the markers
        ax.set_xticks(xs, [f"{r['tokens_per_rank']} tok/rank\n{r['routing']}" for r in mine])
        ax.set_ylabel("effective TFLOP/s")
        kind = mine[0].get("ranks") if mine else None
        mode = {"real": f" (EP {g[1]}, real ranks)", "emulated": " (emulated)"}.get(kind, "")
        ax.set_title(f"{g[0]}, world {g[1]}{mode}" + ("" if names else ": no column timed"))
        ax.legend(fontsize=7, ncol=4, loc="upper left")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def local_group(tmp: str, backend: str = "nccl"):
    """The one-rank process group the timing's barriers and all-reduces run in (file:// rendezvous in tmp)."""
    from cute_kernels.dist import process_group

    init_file = os.path.join(tmp, f"megamoe_bench_pg_{os.getpid()}")
    if os.path.exists(init_file):
        os.remove(init_file)  # a stale rendezvous file would hang the file:// init
    return process_group(0, 1, init_file, backend=backend)
