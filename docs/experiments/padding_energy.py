"""Experiment driver (docs/experiments/pad_zero.patch): does the data in an expert's padding rows cost energy, and does pad_zero.patch win it
back? Pool and intermediate rows past an expert's tokens in its last 64-row run are multiplied by the Tensor
Cores and thrown away. old = main's kernel (old_megamoe on PYTHONPATH), new = the patched tree (zeroes those
rows each launch). 'zero': the padding rows hold zeros (a fresh arena); 'data': random values there (stale rows
of earlier launches, as in serving). J and us per call from sustained replays (benchmarks.power_probe)."""
import json
import sys

import torch

from benchmarks.megamoe_old_vs_new import case_inputs, fill_stale_rows, parse_case
from benchmarks.moe_baselines import moe_flops
from benchmarks.power_probe import Nvml, run_case
from megamoe.api import MegaMoE as NewMoE
from megamoe.reference import routing_stats
from old_megamoe.api import MegaMoE as OldMoE

SEED = 0
print("seed", SEED)
out = sys.argv[1]
secs = float(sys.argv[2]) if len(sys.argv) > 2 else 3.0
specs = sys.argv[3:] or ["dsv4-flash:8192:balanced:w8a8:wave", "qwen3-moe:4096:balanced:w8a8:wave",
                         "dsv4-flash:8192:balanced:bf16:wave"]
nvml = Nvml(torch.cuda.current_device())
res = {"seed": SEED, "seconds": secs, "cases": {}}


def fill(layer, mode, seed):
    """'zero': the pool and intermediate all zeros (a fresh arena); 'data': megamoe_old_vs_new's stale rows."""
    if mode == "data":
        fill_stale_rows([layer], seed)
        return
    for t in (layer.state.pool, layer.state.inter):
        t.zero_()


for spec in specs:
    case = parse_case(spec)
    preset, seed, w1, w2, x, idx, wts, dtype = case_inputs(case, SEED)
    flops = moe_flops(preset, routing_stats(idx, preset.num_experts)["rows"])
    layers = {}
    for name, cls in (("old", OldMoE), ("new", NewMoE)):
        layers[name] = cls(None, preset.num_experts, preset.top_k, preset.hidden, preset.intermediate, dtype=dtype,
                           schedule=case["schedule"], max_tokens_per_rank=case["tokens"])
        layers[name].load_weights(w1, w2)
    del w1, w2
    runs, ys = {}, {}
    for side, mode in (("old", "zero"), ("old", "data"), ("new", "data"), ("new", "data"), ("old", "data"),
                       ("old", "zero")):
        layer = layers[side]
        fill(layer, mode, seed)
        f = (lambda lay: lambda: lay.forward(x, idx, wts))(layer)
        y = f().clone()
        torch.cuda.synchronize()
        layer.check_errors()
        ys.setdefault(f"{side}_{mode}", y)
        assert torch.equal(ys[f"{side}_{mode}"], y)
        r = run_case(f, nvml, seconds=secs, settle_s=1.2, calls_per_graph=2, flops=flops)
        runs.setdefault(f"{side}_{mode}", []).append(r)
        print(spec, side, mode, json.dumps(r), flush=True)
    same = {k: bool(torch.equal(v, ys["old_zero"])) for k, v in ys.items()}
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)
    summ = {m: {k: mean(rs, k) for k in ("joules_per_call", "us_per_call", "watts", "sm_mhz")} for m, rs in runs.items()}
    for m in ("old_data", "new_data"):
        summ[f"{m}_over_old_zero_J"] = summ[m]["joules_per_call"] / summ["old_zero"]["joules_per_call"]
        summ[f"{m}_over_old_zero_us"] = summ[m]["us_per_call"] / summ["old_zero"]["us_per_call"]
    summ["new_data_over_old_data_us"] = summ["new_data"]["us_per_call"] / summ["old_data"]["us_per_call"]
    res["cases"][spec] = {"runs": runs, "summary": summ, "same_y_bits_as_old_zero": same}
    print("SUMMARY", spec, json.dumps(summ), "same bits", same, flush=True)
    del layers
    torch.cuda.empty_cache()
    with open(out, "w") as fh:
        json.dump(res, fh, indent=1)
