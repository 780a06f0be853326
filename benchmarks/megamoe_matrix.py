"""``xstage bench megamoe --matrix``: the configuration matrix of the paper's section 5.2.1 (Figure 8) on one GPU,
ours under the wave schedule against ours under the interleaved schedule: the same layer instance (one
kernel), the same inputs, only the schedule argument of the call differs (issue 30, item 2).

Configurations: --shapes (the seven PRESETS of benchmarks/megamoe.py, MODELS order) x --precision x --routing
(balanced, and skewed: Zipf-like expert popularity (1 + rank)^-s, s = --skew, recorded per configuration) x
--tokens (per rank) x --world (1; P > 1: P ranks emulated on the one GPU, each over SMs / P CTAs on its own
stream with its stores local, the paper's local-store control; or, by --ranks, P real ranks on P GPUs, one
process each, as benchmarks/megamoe_ep.py runs them, keyed .../EP<P>; the result records which).
Precisions (PRECISIONS; what MegaMoE(dtype=...) is passed: benchmarks.megamoe.API_DTYPES, tried in order):
  bf16   bf16 weights and activations                                     dtype=torch.bfloat16
  w8a8   e4m3 weights (128x128 block scales), e4m3 activations (1x128)    dtype="w8a8", else torch.float8_e4m3fn
  w4a8   E2M1 weights (UE8M0 scale per 32), activations as w8a8           dtype="w4a8"
Every precision's layer is loaded from the same bf16 weights (load_weights quantizes) and takes bf16 x. A
precision the API does not build yet (its constructor raises) is recorded as {"status": "skipped",
"skip_kind": "precision", "reason": ...}; it runs untouched once the API accepts it.
Memory: a configuration whose weights and buffers do not fit (memory_estimate: the bf16 weights of all
experts, which the harness holds, plus the layer's transformed copy, counted at bf16 size for every precision,
plus the ranks' buffers, inputs, outputs and reference temporaries, plus RESERVE_GB) is skipped with that
arithmetic and never attempted. The unfused baselines are not run here (they would add their own copies).
Method (section 5.1): per configuration one untimed eager call per schedule (checked against
megamoe.reference under the same precision), CUDA graphs of --calls-per-graph calls, then --trials trials of
both schedules in rotated order (benchmarks.timing.measure_rounds, order="rotate": with two columns each runs
first in every other trial, and the first of trial 0 alternates between configurations); every trial starts
barrier-aligned (a host barrier, then a one-element all-reduce on the stream) between two CUDA events; per
trial the max over ranks (the process group's all-reduce; at emulated P both ranks' launches lie between the
same two events); the median of the trials. Speedup = T_wave / T_interleaved (> 1: interleaved is faster).
Output: --out JSON (every configuration, measured or skipped or not run with why, per-trial times,
provenance per run), --md (table and summary: geometric mean, median, min and max of the speedup overall and
by model, precision, routing, world, tokens) and --png (Figure 8-style bars). The JSON is rewritten after
every configuration; --max-minutes stops before a configuration that would end past the limit (estimated),
keeping what ran; --resume FILE keeps FILE's measured configurations and runs the rest; --plan prints the
configurations, the memory verdicts and the time estimate without a GPU; --replot FILE rewrites --md and
--png from a result file. --dump FILE (opt-in): per layer, after its timed configurations, the instrumented
layer (benchmarks/megamoe_matrix_dump.py says how) and per measured configuration one instrumented launch per
schedule, FILE.npz + FILE.json as bench megamoe --dump writes them, read by benchmarks/megamoe_analysis.py.
Time on one H200 (--plan, at bf16 rates, which bound the quantized kernels from above): the default matrix is
168 configurations, ~3 min of device work per precision plus ~45 s start-up: one 10-minute device call for
bf16 and w8a8, two for all three: --max-minutes 8.5, then --resume the same file (w4a8 alone at f3649cd: its 56
configurations in 4.6 minutes). The command's runner: benchmarks/megamoe_cli.py.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from benchmarks import megamoe as mb
from benchmarks.megamoe_matrix_dump import MatrixDump
from benchmarks.megamoe_matrix_report import (GROUPS, MODELS, PRECISIONS, markdown, plot,  # noqa: F401 - re-exported
                                              speedup_stats, summarize, write_json, write_markdown)
from benchmarks.megamoe_ranks import add_ranks_argument, ep_stats, merge_columns, ranks_record
from calibrate.cli import UsageError

SCHEDULES = mb.SCHEDULES  # ("wave", "interleaved"): the two timed columns
WORLDS = (1, 2, 4, 8)
DEFAULT_TOKENS = (4096, 8192)
DEFAULT_OUT = "benchmarks/results/h200/megamoe_matrix.json"
H200_GB = 141.0  # nominal HBM of one H200 (the planner's capacity where no GPU is visible)
RESERVE_GB = 4.0  # CUDA context, cuBLAS workspace, allocator slack
# The time model's rates (conservative for bf16 on one H200: ours reached 336-511 TFLOP/s at 8192 tokens at
# 23d93b3; the small-token rows are weight-bound), and the fixed costs of a run.
EST = {"tflops": 330.0, "hbm_tb_s": 3.6, "reference_tflops": 20.0, "startup_s": 45.0, "layer_s": 3.0,
       "config_s": 0.5, "weights_s_per_gb": 0.02, "dump_s": 0.5}  # dump_s: a configuration's records to the host
KIND = "xstage megamoe matrix"


# --- arguments ------------------------------------------------------------------------------------------------

def add_arguments(p) -> None:
    models = "; ".join(f"{n}: {mb.PRESETS[n].hidden}/{mb.PRESETS[n].intermediate}, {mb.PRESETS[n].num_experts} "
                       f"experts, top-{mb.PRESETS[n].top_k}" for n in MODELS)
    p.add_argument("--matrix", action="store_true", help="this mode (the flag that selects it)")
    p.add_argument("--shapes", type=mb._shapes, default=[mb.PRESETS[n] for n in MODELS], metavar="LIST",
                   help=f"comma-separated models ({models}); default all seven")
    p.add_argument("--precision", type=lambda t: mb._comma_list(t, "precision", PRECISIONS),
                   default=list(PRECISIONS), metavar="LIST",
                   help="comma-separated, of bf16, w8a8, w4a8 (default all; one the API does not build is skipped)")
    p.add_argument("--routing", type=lambda t: mb._comma_list(t, "routing", mb.ROUTINGS),
                   default=["balanced", "skewed"], metavar="LIST",
                   help=f"comma-separated, of {', '.join(mb.ROUTINGS)} (default balanced,skewed)")
    p.add_argument("--skew", type=float, default=None, metavar="S",
                   help="the skewed routing's Zipf exponent (default megamoe.reference.SKEW_EXPONENT, 1.2)")
    p.add_argument("--tokens", type=mb._tokens, default=list(DEFAULT_TOKENS), metavar="LIST",
                   help="tokens per rank, comma-separated (default 4096,8192)")
    p.add_argument("--world", type=lambda t: mb._comma_list(t, "world size", WORLDS, int), default=[1, 2],
                   metavar="LIST", help="ranks, comma-separated; P > 1 emulated on the one GPU or real (--ranks); "
                                        "default 1,2")
    add_ranks_argument(p)
    p.add_argument("--trials", type=int, default=20, help="timed trials per configuration (default 20)")
    p.add_argument("--calls-per-graph", type=int, default=2, help="calls per captured graph (default 2)")
    p.add_argument("--max-minutes", type=float, default=None, metavar="M",
                   help="stop before a configuration that would end past M minutes from the start (estimated), "
                        "keeping what ran; leave a minute of a device call for start-up")
    p.add_argument("--resume", default=None, metavar="JSON",
                   help="keep this result file's measured configurations and run the rest (default --out: it)")
    p.add_argument("--out", default=None, help=f"result JSON, rewritten after every configuration "
                                               f"(default {DEFAULT_OUT}, or the --resume file)")
    p.add_argument("--md", default=None, help="the markdown table (default: the JSON's name with .md)")
    p.add_argument("--png", default=None, help="the figure (default: the JSON's name with .png)")
    p.add_argument("--memory-gb", type=float, default=None,
                   help=f"the GPU memory a configuration must fit (default: the GPU's; {H200_GB:g} with no GPU)")
    p.add_argument("--auto", action="store_true",
                   help="a third timed column, schedule='auto', its graph replayed until the kernel's trial "
                        "settled (megamoe.trial); per configuration its in-run regret against the better of the two "
                        "schedules (trials then in shuffled order)")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights, inputs and routing (as bench megamoe)")
    p.add_argument("--tmp", default="/tmp", help="where the one-rank process group's rendezvous file goes")
    p.add_argument("--dump", default=None, metavar="FILE",
                   help="per-tile records of every measured configuration, one instrumented launch per schedule: "
                        "FILE.npz and FILE.json (python -m benchmarks.megamoe_analysis FILE.json); costs a second "
                        "compile per layer")
    p.add_argument("--plan", action="store_true",
                   help="print the configurations, memory verdicts and estimated time; no GPU, nothing written")
    p.add_argument("--replot", default=None, metavar="JSON", help="rewrite --md and --png from a result file")


def resolve(args):
    """Fill the defaults that depend on other flags (idempotent)."""
    from megamoe.reference import SKEW_EXPONENT

    if args.skew is None:
        args.skew = SKEW_EXPONENT
    if args.out is None:
        args.out = args.resume or args.replot or DEFAULT_OUT
    stem = os.path.splitext(args.out)[0]
    args.md = args.md or stem + ".md"
    args.png = args.png or stem + ".png"
    return args


# --- the configurations ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    preset: mb.Preset
    precision: str
    routing: str
    tokens: int  # per rank
    world: int
    skew: float | None  # the skewed routing's exponent, None otherwise
    real: bool = False  # world > 1 as real ranks, one GPU each (else emulated on one)
    auto: bool = False  # also the schedule="auto" column (--auto); not part of the key

    @property
    def routing_label(self) -> str:
        return f"skewed@{self.skew:g}" if self.routing == "skewed" else self.routing

    @property
    def key(self) -> str:
        return (f"{self.preset.name}/{self.precision}/{self.routing_label}/T{self.tokens}/"
                f"{'EP' if self.real else 'P'}{self.world}")


def configurations(args) -> list[Config]:
    """Every configuration, in run order: model, world, tokens, precision, routing (one layer per model,
    world, tokens and precision; the routings reuse it)."""
    modes = getattr(args, "rank_modes", None) or {}
    return [Config(p, d, r, t, w, args.skew if r == "skewed" else None, modes.get(w) == "real",
                   bool(getattr(args, "auto", False)))
            for p in args.shapes for w in args.world for t in args.tokens for d in args.precision
            for r in args.routing]


def memory_estimate(preset: mb.Preset, world: int, tokens: int, calls_per_graph: int, real: bool = False) -> dict:
    """GB (1e9 B) one configuration holds at its peak on a GPU, by part (module docstring; the same for every
    precision: the layer's copy is counted at bf16 size, an upper bound for the quantized layers, which may
    stage their bf16 transform). ``real``: one rank's GPU (its experts' copy, its buffers, its tokens' outputs
    and reference; every rank draws all P*T inputs)."""
    e, k, h, i = preset.num_experts, preset.top_k, preset.hidden, preset.intermediate
    elems = e * 3 * h * i
    total = world * tokens
    mine = tokens if real else total  # the tokens this GPU computes
    rows = world * tokens * k + (e // world) * 128  # one rank's pool rows (megamoe.api._RankState)
    slots = tokens * k
    per_rank = rows * (h * 2 + i * 2 + 8) + slots * (h * 2 + 4) + (rows // 128) * 4
    outputs = mine * h * 2 * (1 + 2 * calls_per_graph)  # the eager y and each graph's outputs per schedule
    reference = mine * h * 4 * 2 + 3 * h * i * 4 + mine * 2 * i * 4 * 2  # fp32 y, one expert, its rows
    parts = {"weights_bf16": 2 * elems, "layer_copy": 2 * elems // (world if real else 1),
             "buffers": (1 if real else world) * per_rank,
             "inputs": total * (h * 2 + k * 8), "outputs": outputs, "reference": reference}
    gb = {n: v / 1e9 for n, v in parts.items()}
    gb["reserve"] = RESERVE_GB
    gb["total"] = sum(gb.values())
    return {n: round(v, 3) for n, v in gb.items()}


def memory_verdict(mem: dict, capacity_gb: float) -> str | None:
    """None where ``mem`` fits, else the skip reason with the arithmetic."""
    if mem["total"] <= capacity_gb:
        return None
    parts = " + ".join(f"{n.replace('_', ' ')} {mem[n]:.1f}" for n in mem if n != "total")
    return f"memory: needs {mem['total']:.1f} GB ({parts}) > {capacity_gb:.1f} GB"


def kernel_seconds(preset: mb.Preset, world: int, tokens: int, real: bool = False) -> float:
    """The time model's one call: max(FLOPs at EST's rate, all experts' bf16 weights at its bandwidth); at
    real ranks one GPU's share (1/P of both)."""
    from benchmarks.moe_baselines import moe_flops

    share = world if real else 1
    flops = moe_flops(preset, world * tokens * preset.top_k) / share
    return max(flops / (EST["tflops"] * 1e12), preset.num_experts * 3 * preset.hidden * preset.intermediate * 2
               / share / (EST["hbm_tb_s"] * 1e12))


def config_seconds(cfg: Config, trials: int, calls: int, dump: bool = False) -> float:
    """One configuration: inputs, the fp32 reference, both schedules' eager call, capture warm-up and trials;
    ``dump``: its inputs again, an instrumented launch per schedule and its records to the host; ``cfg.auto``:
    the auto column's settling calls, eager call and trials too."""
    from benchmarks.moe_baselines import moe_flops
    from megamoe.auto import TRIAL_SETTLE

    mine = cfg.tokens if cfg.real else cfg.world * cfg.tokens  # the reference's tokens on one GPU
    ref = moe_flops(cfg.preset, mine * cfg.preset.top_k) / (EST["reference_tflops"] * 1e12)
    launches = len(SCHEDULES) * (2 + trials * calls + (1 if dump else 0))
    if cfg.auto:
        launches += TRIAL_SETTLE + calls + 2 + trials * calls
    return (EST["config_s"] + ref + (EST["dump_s"] if dump else 0.0)
            + launches * kernel_seconds(cfg.preset, cfg.world, cfg.tokens, cfg.real))


def setup_seconds(cfg: Config, new_shape: bool, dump: bool = False) -> float:
    """Building the layer (compile, buffers, weight transform), with ``dump`` its instrumented twin too (a
    second compile), and the model's weights where they are new."""
    gb = cfg.preset.num_experts * 3 * cfg.preset.hidden * cfg.preset.intermediate * 2 / 1e9
    return EST["layer_s"] * (2 if dump else 1) + (0.5 + EST["weights_s_per_gb"] * gb if new_shape else 0.0)


# --- statistics -----------------------------------------------------------------------------------------------

# --- one configuration ----------------------------------------------------------------------------------------

def reference_for(precision: str, x, idx, wts, w1, w2, h_block: int = 64):
    """(the reference output, what it is), or (None, why there is none) for ``precision``; ``h_block``: the
    quantized layer's intermediate scale run (benchmarks.megamoe.fp8_h_block)."""
    import torch

    import megamoe.reference as ref

    if precision == "bf16":
        return (ref.reference_moe(x, idx, wts, w1, w2, intermediate_dtype=torch.bfloat16,
                                  combine_dtype=torch.bfloat16), "fp32, h and expert rows rounded to bf16")
    if precision == "w8a8":
        return (ref.reference_moe_fp8(x, idx, wts, w1, w2, l2_block=h_block, combine_dtype=torch.bfloat16),
                f"fp32, the same W8A8 quantization (h in 1x{h_block} runs)")
    return (ref.reference_moe_w4a8(x, idx, wts, w1, w2, l2_block=h_block, combine_dtype=torch.bfloat16),
            f"fp32, the same W4A8 recipe (h in 1x{h_block} runs)")


def describe(cfg: Config) -> dict:
    """The configuration's fields in its result entry."""
    p = cfg.preset
    mode = ("one GPU" if cfg.world == 1 else
            f"real: {cfg.world} ranks, one GPU each (MegaMoE over symmetric memory; per trial the max over ranks)"
            if cfg.real else
            f"emulated: {cfg.world} ranks concurrent on one GPU (SMs split), local stores (the local-store control)")
    return {"key": cfg.key, "model": p.name, "hidden": p.hidden, "intermediate": p.intermediate,
            "num_experts": p.num_experts, "top_k": p.top_k, "precision": cfg.precision, "routing": cfg.routing,
            "zipf_exponent": cfg.skew, "tokens_per_rank": cfg.tokens, "world": cfg.world, "world_mode": mode,
            "ranks": "one GPU" if cfg.world == 1 else "real" if cfg.real else "emulated",
            "tokens": cfg.world * cfg.tokens}


def config_inputs(ctx, cfg: Config) -> tuple:
    """(x, topk_idx, topk_weights, seed, routing stats) of a configuration: the seeds of bench megamoe's rows
    (the same x and routing for every precision); at real ranks (ctx.ranks) this rank's slice of the P*T
    tokens, the per-rank routing in the stats (benchmarks.megamoe_ranks.ep_stats)."""
    import torch

    from megamoe.reference import make_routing, routing_stats

    p, total = cfg.preset, cfg.world * cfg.tokens
    seed = mb.row_seed(ctx.args.seed, p.name, cfg.world, cfg.tokens, cfg.routing)
    gen = torch.Generator(device=ctx.device).manual_seed(seed)
    x = torch.randn(total, p.hidden, generator=gen, device=ctx.device).to(torch.bfloat16)
    kw = {"skew": cfg.skew} if cfg.skew is not None else {}
    idx, wts = make_routing(total, p.num_experts, p.top_k, cfg.routing, seed, ctx.device, **kw)
    stats = routing_stats(idx, p.num_experts)
    ranks = ctx.ranks if cfg.real else None
    if ranks is not None:
        stats.update(ep_stats(idx, p.num_experts, cfg.world))
        mine = slice(ranks.rank * cfg.tokens, (ranks.rank + 1) * cfg.tokens)
        x, idx, wts = (a[mine].clone() for a in (x, idx, wts))
    return x, idx, wts, seed, stats


def trial_order(cfg_or_args) -> str:
    """The columns' order per trial: rotated with the two schedules (section 5.1's alternation); shuffled with
    the auto column too (rotating three columns would give each a fixed predecessor: benchmarks.timing)."""
    return "shuffle" if getattr(cfg_or_args, "auto", False) else "rotate"


def measure_config(ctx, cfg: Config, layer, w1, w2, index: int) -> dict:
    """One configuration: its inputs (config_inputs), both schedules through megamoe.run_columns, the speedup;
    at real ranks every rank's check is kept (the max over ranks)."""
    from benchmarks.timing import round_order

    x, idx, wts, seed, stats = config_inputs(ctx, cfg)
    ranks = ctx.ranks if cfg.real else None
    refs = {}

    def reference(_name):  # one per configuration, for both schedules
        if not refs:
            refs["r"] = reference_for(cfg.precision, x, idx, wts, w1, w2, mb.fp8_h_block(layer))
        return refs["r"]

    calls = {s: (lambda s=s: layer.forward(x, idx, wts, schedule=s)) for s in SCHEDULES}
    settled = {}
    capture = ctx.capture
    if cfg.auto:  # its captured graph replayed until the kernel's trial settled, before the timed trials
        from benchmarks.megamoe_auto import settle_auto

        calls["auto"] = lambda: layer.forward(x, idx, wts, schedule="auto")

        def capture(fn):
            graph, how = ctx.capture(fn)
            if fn is calls["auto"]:
                settled.update(settle_auto(graph, fn, layer, ctx.calls_per_graph))
            return graph, how
    cols, times = mb.run_columns(calls, reference, capture, lambda live: ctx.timer(live, index),
                                 agree=ranks.agree if ranks is not None else None)
    if ranks is not None:
        cols = merge_columns(ranks.gather(cols))
    if settled and "auto" in cols:
        cols["auto"].update(settled)
    entry = {"seed": seed, **stats, **cols,
             "trial_times_us": {n: [round(t, 3) for t in ts] for n, ts in times.items()},
             "first_in_trial_0": round_order(list(calls), 0, trial_order(cfg), index)[0]}
    wave, inter = (cols[s].get("us") for s in SCHEDULES)
    entry["speedup"] = wave / inter if wave and inter else None
    if entry["speedup"] and cols.get("auto", {}).get("us"):
        # in-run regret: the auto column's own time, and its pick's time in the two schedules' columns
        best, order = min(wave, inter), cols["auto"].get("order")
        entry["auto_regret"] = cols["auto"]["us"] / best - 1.0
        entry["auto_pick_regret"] = cols[order]["us"] / best - 1.0 if order in SCHEDULES else None
    entry["status"] = "measured" if entry["speedup"] else "failed"
    if entry["status"] == "failed":
        entry["reason"] = "; ".join(f"{s}: {cols[s]['failed']}" for s in SCHEDULES if "failed" in cols[s])
    refs.clear()
    return entry


# --- a run ----------------------------------------------------------------------------------------------------

class _OutOfTime(Exception):
    pass


def load_resume(path: str, args) -> tuple[list[dict], list[dict]]:
    """(the measured configurations of result file ``path``, its runs' provenance); refuses a file of other
    seeds, trials or calls per graph (its times would not be comparable)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"--resume {path}: {mb._reason(e)}") from None
    if data.get("kind") != KIND:
        raise UsageError(f"--resume {path}: not a bench megamoe --matrix result")
    for k in ("seed", "trials", "calls_per_graph", "skew"):
        if data["args"].get(k) != getattr(args, k):
            raise UsageError(f"--resume {path}: it was run with {k} = {data['args'].get(k)}, this run has "
                             f"{getattr(args, k)}")
    return [e for e in data["configurations"] if e["status"] == "measured"], data.get("runs", [])


def run_matrix(args, group, *, device="cuda", capture=None, timer=None, api=None, capacity_gb=None,
               clock=time.monotonic, worlds=None, start=None, phase=None, ranks=None) -> dict:
    """Every configuration of ``args`` (add_arguments' namespace), written to args.out after each and to
    args.md / args.png at the end (also when stopped). The keyword arguments replace the GPU parts for a
    test: ``capture(fn)`` -> (graph or None, how), ``timer(columns, index)`` -> (medians µs, per-trial times),
    ``api`` as load_api returns, ``capacity_gb``, ``clock`` (seconds). A phase of a run with real ranks
    (benchmarks.megamoe_ep.run_matrix): ``worlds``, the worlds this call runs (the others' entries are kept);
    ``start``, the run's clock at its start (--max-minutes counts from it); ``phase``, the result the phase
    before wrote (its entries and runs continue; --resume was read by the first phase); ``ranks``, this
    rank's megamoe_ranks.Ranks at real P (every rank decides alike; rank 0 writes)."""
    from types import SimpleNamespace

    import torch

    from benchmarks.timing import capture_graph, measure_rounds
    from cute_kernels.runtime import provenance

    resolve(args)
    start = clock() if start is None else start
    writer = ranks is None or ranks.writer
    torch.set_grad_enabled(False)
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays fp32
    ctx = SimpleNamespace(args=args, device=device, ranks=ranks)
    ctx.capture = capture or (lambda fn: capture_graph(fn, args.calls_per_graph, group))
    ctx.calls_per_graph = args.calls_per_graph
    ctx.timer = timer or (lambda cols, i: measure_rounds(cols, args.calls_per_graph, args.trials, group,
                                                         order=trial_order(args), start=i))
    api = api or mb.load_api()
    if phase is not None:
        kept, runs = phase["configurations"], phase["runs"]
    else:
        kept, runs = load_resume(args.resume, args) if args.resume else ([], [])
        argv = mb._argv()
        command = "xstage bench megamoe " + " ".join(argv if "--matrix" in argv else ["--matrix", *argv])
        runs = [*runs, provenance(command)]
    run_index = len(runs) - 1
    capacity = capacity_gb or args.memory_gb or (torch.cuda.get_device_properties(device).total_memory / 1e9
                                                 if torch.cuda.is_available() and str(device) != "cpu" else H200_GB)
    configs = configurations(args)
    entries = {c.key: {**describe(c), "status": "not_run", "reason": "not reached"} for c in configs}
    entries.update({e["key"]: e for e in kept})
    result = {"kind": KIND, "provenance": runs[-1], "runs": runs,
              "method": METHOD + (AUTO_METHOD if getattr(args, "auto", False) else ""), "precisions": PRECISION_NOTES,
              "speedup": "T_wave / T_interleaved (> 1: interleaved is faster)",
              "args": {"shapes": [p.name for p in args.shapes], "precision": args.precision,
                       "routing": args.routing, "skew": args.skew, "tokens": args.tokens, "world": args.world,
                       "trials": args.trials, "calls_per_graph": args.calls_per_graph, "seed": args.seed,
                       "max_minutes": args.max_minutes, "resume": args.resume,
                       "ranks": getattr(args, "ranks", None), "dump": getattr(args, "dump", None),
                       "auto": bool(getattr(args, "auto", False))},
              **ranks_record(getattr(args, "ranks", None),
                             getattr(args, "rank_modes", None) or {w: "one GPU" if w == 1 else "emulated"
                                                                   for w in args.world},
                             getattr(args, "gpus", None)),
              "capacity_gb": capacity, "api_unavailable": api[1],
              "resumed": phase["resumed"] if phase is not None else len(kept), "stopped": None}

    dumper = None
    if getattr(args, "dump", None):
        dumper = MatrixDump(args.dump, writer, resume=phase is not None or bool(args.resume), draw=config_inputs,
                            describe=describe)

    def save(final=False):
        if not writer:
            return
        result["configurations"] = list(entries.values())
        result["summary"] = summarize(result["configurations"])
        write_json(result, args.out)
        if final:
            write_markdown(result, args.md)
            plot(result, args.png)
            if dumper is not None:
                dumper.write(result["provenance"].get("command") or KIND, args.out)

    def budget(seconds: float, what: str):
        over = args.max_minutes is not None and clock() - start + seconds > args.max_minutes * 60
        if ranks is not None:
            over = not ranks.agree(not over)  # every rank stops together
        if over:
            raise _OutOfTime(f"--max-minutes {args.max_minutes:g}: stopped before {what} (estimated {seconds:.0f} s "
                             f"more, {clock() - start:.0f} s elapsed)")

    layers = {}
    for c in configs:
        layers.setdefault((c.preset.name, c.world, c.tokens, c.precision), []).append(c)
    done_shapes = set()
    try:
        for (name, world, tokens, precision), todo in layers.items():
            todo = [c for c in todo if entries[c.key]["status"] != "measured"]
            if not todo or (worlds is not None and world not in worlds) or (todo[0].real and ranks is None):
                continue  # done, or another phase's (a real world runs only in its ranks' phase)
            preset = todo[0].preset
            mem = memory_estimate(preset, world, tokens, args.calls_per_graph, todo[0].real)
            why = memory_verdict(mem, capacity)
            if why:
                for c in todo:
                    entries[c.key] = {**describe(c), "status": "skipped", "skip_kind": "memory", "reason": why,
                                      "memory": mem}
                save()
                continue
            dump = dumper is not None
            budget(setup_seconds(todo[0], name not in done_shapes, dump)
                   + config_seconds(todo[0], args.trials, args.calls_per_graph, dump), todo[0].key)
            if name not in done_shapes:
                w1 = w2 = None
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                w1, w2 = mb.make_weights(preset, mb.row_seed(args.seed, name, "weights"), device)
                done_shapes = {name}
            built = mb.build_ours(api, group, preset, world, tokens, w1, w2, [precision], real=todo[0].real)
            layer = (ranks.agreed_layers(built) if todo[0].real else built)[precision]
            del built  # the layer's only other reference: freed before the instrumented one is built
            measured, stop = [], None
            if isinstance(layer, str) and writer:
                print(f"{name}/{precision}/T{tokens}/P{world}: {len(todo)} configurations not built ({layer})",
                      flush=True)
            for c in todo:
                index = configs.index(c)
                base = {**describe(c), "memory": mem, "run": run_index,
                        "estimated_s": round(config_seconds(c, args.trials, args.calls_per_graph, dump), 2)}
                if isinstance(layer, str):
                    kind = "api" if api[0] is None else ("precision" if precision != "bf16" else None)
                    entries[c.key] = {**base, "status": "skipped" if kind else "failed", "reason": layer,
                                      **({"skip_kind": kind} if kind else {})}
                    continue
                try:
                    budget(config_seconds(c, args.trials, args.calls_per_graph, dump), c.key)
                except _OutOfTime as e:  # the configurations measured so far are still dumped (budgeted)
                    stop = e
                    break
                t0 = clock()
                try:
                    entries[c.key] = {**base, **measure_config(ctx, c, layer, w1, w2, index)}
                except Exception as e:  # noqa: BLE001 - e.g. the inputs' allocation: recorded, the rest still runs
                    entries[c.key] = {**base, "status": "failed", "reason": mb._reason(e)}
                entries[c.key]["wall_s"] = round(clock() - t0, 2)
                save()
                if writer:
                    print(summary_line(entries[c.key]), flush=True)
                if entries[c.key]["status"] == "measured":
                    measured.append((c, index))
            del layer
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if dumper is not None and measured:
                dumper.dump_layer(ctx, api, group, measured, w1, w2, entries)
            save()
            if stop is not None:
                raise stop
    except _OutOfTime as e:
        result["stopped"] = str(e)
        for entry in entries.values():
            if entry["status"] == "not_run":
                entry["reason"] = str(e)
        if writer:
            print(result["stopped"], flush=True)
    finally:
        result["wall_s"] = round(clock() - start, 1)
        save(final=True)
    return result


def summary_line(e: dict) -> str:
    if e["status"] != "measured":
        return f"{e['key']}: {e['status']} ({e.get('reason')})"
    return (f"{e['key']}: wave {e['wave']['us']:.0f} µs, interleaved {e['interleaved']['us']:.0f} µs, "
            f"speedup {e['speedup']:.3f}" + (f", auto {e['auto']['us']:.0f} µs ({e['auto'].get('order')}, "
                                            f"{100 * e['auto_regret']:+.1f}%)" if e.get("auto_regret") is not None
                                            else "") + f" ({e.get('wall_s', 0):.1f} s)")


METHOD = ("one layer per (model, world, tokens, precision); per configuration the seeded inputs of bench megamoe's "
          "row, one eager call per schedule checked against megamoe.reference, CUDA graphs of calls_per_graph "
          "calls, then `trials` barrier-aligned CUDA-event trials of both schedules in rotated order (the first "
          "alternates per trial and, in trial 0, per configuration); per trial the max over ranks; the median of "
          "the trials (benchmarks.timing.measure_rounds, order='rotate'); world P > 1: P ranks emulated on one GPU "
          "with local stores, or real ranks (world_mode says which; benchmarks/megamoe_ep.py: each rank its slice of "
          "the P*T tokens, checks the max over ranks); speedup = T_wave / T_interleaved")
AUTO_METHOD = ("; --auto: a third column, schedule='auto', its captured graph replayed back to back "
               "(benchmarks.megamoe_auto.settle_replays) until the kernel's trial slot for the configuration's "
               "inputs settled (megamoe.trial: warm-up, then both orders timed), the three columns' "
               "trials in a fresh shuffled order each; auto_regret = T_auto / min(T_wave, T_interleaved) - 1, "
               "auto_pick_regret the same with the column of the order auto settled on")
PRECISION_NOTES = {"bf16": "bf16 weights and activations; MegaMoE(dtype=torch.bfloat16)",
                   "w8a8": "e4m3 weights with 128x128 block scales, e4m3 activations per 1x128; MegaMoE(dtype='w8a8'), "
                           "else dtype=torch.float8_e4m3fn",
                   "w4a8": "E2M1 weights with a UE8M0 scale per 32, activations as w8a8; MegaMoE(dtype='w4a8')"}


# --- the command ----------------------------------------------------------------------------------------------

def plan(args, capacity_gb: float | None = None) -> dict:
    """What a run would do: per configuration its memory verdict and estimated seconds (its layer's and its
    model's weights' setup counted with the first configuration that needs them); the total with every
    precision running, and each precision's run alone, start-up included in each; with --dump, what dumping
    adds to the whole ("dump": the instrumented layers' compiles and launches)."""
    resolve(args)
    capacity = capacity_gb or args.memory_gb or H200_GB
    dumping = bool(getattr(args, "dump", None))

    def simulate(configs, dump=dumping):
        rows, layers, shapes, total = [], set(), set(), EST["startup_s"]
        for c in configs:
            mem = memory_estimate(c.preset, c.world, c.tokens, args.calls_per_graph, c.real)
            why = memory_verdict(mem, capacity)
            secs = 0.0
            if not why:
                layer = (c.preset.name, c.world, c.tokens, c.precision)
                if layer not in layers:
                    secs += setup_seconds(c, c.preset.name not in shapes, dump)
                    layers.add(layer)
                    shapes.add(c.preset.name)
                secs += config_seconds(c, args.trials, args.calls_per_graph, dump)
            total += secs
            rows.append({"key": c.key, "memory_gb": mem["total"], "skip": why, "estimated_s": round(secs, 2)})
        return rows, total

    configs = configurations(args)
    rows, total = simulate(configs)
    alone = {d: round(simulate([c for c in configs if c.precision == d])[1]) for d in args.precision}
    extra = {"dump": round(total - simulate(configs, False)[1])} if dumping else {}
    return {"capacity_gb": capacity, "configurations": rows, "estimated_s": {"all": round(total), **alone, **extra}}


def replot(args) -> int:
    try:
        with open(args.replot) as f:
            result = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"--replot {args.replot}: {mb._reason(e)}") from None
    if result.get("kind") != KIND:
        raise UsageError(f"--replot {args.replot}: not a bench megamoe --matrix result")
    result["summary"] = summarize(result["configurations"])
    write_markdown(result, args.md)
    plot(result, args.png)
    print(f"wrote {args.md} and {args.png}", flush=True)
    return 0
