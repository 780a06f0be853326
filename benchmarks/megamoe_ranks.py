"""The rank mode of ``xstage bench megamoe`` and its ``--matrix`` (one GPU, P ranks emulated on it, or P real
ranks, one GPU each: benchmarks/megamoe_ep.py runs those), and what keeps real ranks' decisions and records
alike: the pieces the bench, the matrix and the real-rank runner share, below all three."""
from __future__ import annotations

from calibrate.cli import UsageError

RANKS = ("emulated", "real")
ONE_GPU = "one GPU"
METHOD = ("world P with ranks real: P processes, one GPU each, one NCCL group; each rank's T tokens are its slice "
          "of the emulated row's P*T (same seed); ours MegaMoE(group) over symmetric memory; unfused_nccl_* as "
          "benchmarks.moe_nccl (split sizes exchanged once per row, untimed; nccl_splits_exchange_us is that "
          "exchange alone, eager, host wall clock, rank max, median); every round barrier- and device-aligned, its "
          "time the max over ranks; errors the max over ranks, each rank against the reference on its tokens; "
          "roofline per rank (its experts' rows and touched weights, its x and y; NVLink not counted), the "
          "slowest rank's")


# --- the rank mode -------------------------------------------------------------------------------------------

def add_ranks_argument(p) -> None:
    p.add_argument("--ranks", choices=RANKS, default=None,
                   help="world > 1 as P ranks emulated on one GPU, or as P real ranks, one GPU each (P processes, "
                        "NCCL); default: real where torch.cuda.device_count() >= the world, else emulated")


def rank_modes(requested: str | None, worlds, gpus: int, check: bool = True) -> dict:
    """{world: "one GPU" | "emulated" | "real"}: ``requested`` (None: real where ``gpus`` >= the world, else
    emulated). ``check``: a real world with fewer GPUs visible is a UsageError (False: --plan, no GPU needed)."""
    if requested not in (None, *RANKS):
        raise UsageError(f"--ranks must be one of {', '.join(RANKS)}, got {requested!r}")
    out = {}
    for w in worlds:
        if w == 1:
            out[w] = ONE_GPU
        elif requested is None:
            out[w] = "real" if gpus >= w else "emulated"
        else:
            if requested == "real" and check and gpus < w:
                raise UsageError(f"--ranks real --world {w} needs {w} GPUs, {gpus} visible (--ranks emulated runs "
                                 "it on one)")
            out[w] = requested
    return out


def ranks_record(requested: str | None, modes: dict, gpus: int | None) -> dict:
    """What the JSON says about the rank mode."""
    rule = (f"--ranks {requested}" if requested else
            f"default: real where torch.cuda.device_count() ({gpus}) >= the world, else emulated")
    return {"ranks": requested or "auto", "ranks_rule": rule, "ranks_by_world": {str(w): m for w, m in modes.items()}}


# --- agreement across ranks ----------------------------------------------------------------------------------

class Ranks:
    """This rank's place in ``group`` and the collectives that keep every rank's decisions alike."""

    def __init__(self, group, device):
        import torch.distributed as dist

        self.group, self.device = group, device
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    @property
    def writer(self) -> bool:
        return self.rank == 0

    def agree(self, ok: bool) -> bool:
        """True where ``ok`` holds on every rank."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([0 if ok else 1], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item()) == 0

    def gather(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def agreed_layers(self, layers: dict) -> dict:
        """build_ours' {dtype: layer or reason}, alike on every rank: one not built on some rank is skipped on
        every rank, with that rank's reason."""
        whys = self.gather({d: (v if isinstance(v, str) else None) for d, v in layers.items()})
        out = {}
        for d, v in layers.items():
            bad = [(r, w[d]) for r, w in enumerate(whys) if w.get(d)]
            out[d] = one_reason(bad, self.world) if bad else v
        return out


def one_reason(pairs: list, world: int) -> str:
    """The reason of [(rank, reason)]: as it is where every rank gave it, else the first rank's, named."""
    reasons = {why for _, why in pairs}
    if len(pairs) == world and len(reasons) == 1:
        return pairs[0][1]
    return f"rank {pairs[0][0]}: {pairs[0][1]}"


def merge_columns(by_rank: list[dict]) -> dict:
    """run_columns' columns of every rank -> one: errors the max over ranks (finite on all), a failure with the
    reason of a rank where it happened (not "failed on another rank"), graph or eager per rank where they differ."""
    out = {}
    for name, first in by_rank[0].items():
        cols = [c[name] for c in by_rank]
        c = dict(first)
        if "failed" in c:
            own = [(r, x["failed"]) for r, x in enumerate(cols) if x.get("failed") not in (None, OTHER_RANK)]
            c = {"failed": one_reason(own, len(cols)) if own else c["failed"]}
        if "error" in c:
            errs = [x["error"] for x in cols if "error" in x]
            e = dict(errs[0])
            for key in ("max_abs", "max_rel"):
                vals = [x.get(key) for x in errs if x.get(key) is not None]
                if key in e:
                    e[key] = max(vals) if vals else None
            e["finite"] = all(x.get("finite", True) for x in errs)
            e["over"] = f"max over {len(cols)} ranks, each against the reference on its tokens"
            c["error"] = e
        timings = [x.get("timing") for x in cols]
        if "timing" in c and len(set(timings)) > 1:
            c["timing"] = timings
        out[name] = c
    return out


OTHER_RANK = "failed on another rank"


# --- a real row's routing --------------------------------------------------------------------------------------

def ep_stats(topk_idx_all, num_experts: int, world: int) -> dict:
    """Per-rank routing of the P*T stacked tokens (rank j's are rows [jT, (j+1)T)): rows each rank's experts
    receive, experts touched per rank, and dispatch_rows[j][d], the rows rank j sends to rank d (d = j: stays)."""
    import torch

    from megamoe.reference import expert_counts

    local = num_experts // world
    flat = topk_idx_all.reshape(world, -1).long()
    dest = torch.where(flat >= 0, torch.div(flat, local, rounding_mode="floor"), world)
    dispatch = [[int((dest[j] == d).sum()) for d in range(world)] for j in range(world)]
    counts = expert_counts(topk_idx_all, num_experts).view(world, local)
    total = sum(map(sum, dispatch))
    remote = total - sum(dispatch[j][j] for j in range(world))
    return {"tokens_by_rank": [flat.shape[1] // topk_idx_all.shape[1]] * world,
            "rows_by_rank": counts.sum(1).tolist(), "experts_touched_by_rank": (counts > 0).sum(1).tolist(),
            "dispatch_rows": dispatch, "remote_fraction": remote / total if total else 0.0}
