"""The configuration matrix's report (benchmarks/megamoe_matrix.py): the speedup statistics by model, precision,
routing, world and tokens, the auto column's in-run regret, the JSON, the markdown table and the Figure 8-style
PNG. No GPU: ``xstage bench megamoe --matrix --replot JSON`` rewrites the table and figure from a result."""
from __future__ import annotations

import json
import math
import os
import statistics

MODELS = ("dit-moe", "qwen3-moe", "hunyuan", "mimo", "glm", "dsv4-flash", "dsv4-pro")  # Figure 8's order
PRECISIONS = ("bf16", "w8a8", "w4a8")


def speedup_stats(pairs: list[tuple[str, float]]) -> dict:
    """n, geometric mean, median, min and max (with the configurations that hold them) of (key, speedup)."""
    vals = [v for _, v in pairs]
    if not vals:
        return {"n": 0}
    lo, hi = min(pairs, key=lambda p: p[1]), max(pairs, key=lambda p: p[1])
    return {"n": len(vals), "geomean": math.exp(sum(math.log(v) for v in vals) / len(vals)),
            "median": statistics.median(vals), "min": lo[1], "max": hi[1], "min_config": lo[0],
            "max_config": hi[0], "faster": sum(v > 1 for v in vals)}


GROUPS = {"model": "model", "precision": "precision", "routing": "routing", "world": "world",
          "tokens": "tokens_per_rank"}


def summarize(entries: list[dict]) -> dict:
    """Speedup statistics overall and by model, precision, routing, world and tokens; counts by status."""
    measured = [e for e in entries if e.get("speedup")]
    out = {"overall": speedup_stats([(e["key"], e["speedup"]) for e in measured])}
    for name, field in GROUPS.items():
        values = list(dict.fromkeys(e[field] for e in measured))
        if name == "model":
            values.sort(key=lambda m: MODELS.index(m) if m in MODELS else len(MODELS))
        out[f"by_{name}"] = {str(v): speedup_stats([(e["key"], e["speedup"]) for e in measured if e[field] == v])
                             for v in values}
    out["counts"] = {s: sum(e["status"] == s for e in entries) for s in ("measured", "failed", "skipped", "not_run")}
    with_auto = [e for e in measured if e.get("auto_regret") is not None]
    if with_auto:
        out["auto"] = {"overall": auto_stats(with_auto), "by_precision": {
            d: auto_stats([e for e in with_auto if e["precision"] == d])
            for d in dict.fromkeys(e["precision"] for e in with_auto)}}
    return out


def round_regret(entry: dict) -> float | None:
    """The auto column's regret by rounds: the median over trials of T_auto / T_better in the same trial, minus
    1 (better: the schedule with the lower median). The three columns of a trial run back to back in a shuffled
    order, so a clock step between trials (the chip settling into its power limit) moves all three alike; the
    medians of whole columns can land on either side of such a step (None: no per-trial times)."""
    t = entry.get("trial_times_us") or {}
    if not t.get("auto") or not entry.get("speedup"):
        return None
    better = "wave" if entry["wave"]["us"] <= entry["interleaved"]["us"] else "interleaved"
    return statistics.median(a / b for a, b in zip(t["auto"], t[better])) - 1.0


def auto_stats(entries: list[dict]) -> dict:
    """The auto column's in-run regret over configurations (benchmarks/megamoe_matrix.py --auto): its own time
    against the better schedule's, and its settled order's column against it (the same kernel and order, so the
    difference between the two is the run's noise), with the worst configuration."""
    reg = [e["auto_regret"] for e in entries]
    pick = [e["auto_pick_regret"] for e in entries if e.get("auto_pick_regret") is not None]
    worst = max(entries, key=lambda e: e["auto_regret"])
    rounds = [r for r in (round_regret(e) for e in entries) if r is not None]
    return {"n": len(reg), "max_regret": max(reg), "median_regret": statistics.median(reg),
            "round_max_regret": max(rounds) if rounds else None,
            "round_over_3pct": sum(r > 0.03 for r in rounds),
            "over_3pct": sum(r > 0.03 for r in reg), "worst_config": worst["key"],
            "picks_the_better": sum(e.get("auto", {}).get("order") == min(("wave", "interleaved"),
                                                                          key=lambda s: e[s]["us"])
                                    for e in entries),
            "pick_max_regret": max(pick) if pick else None, "pick_over_3pct": sum(r > 0.03 for r in pick)}


def write_json(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)  # a run killed mid-write leaves the previous file whole (for --resume)


def _f(v, nd=3) -> str:
    return "—" if v is None else f"{v:.{nd}f}"


def markdown(result: dict) -> str:
    prov, s = result["provenance"], result["summary"]
    title = (f"# MegaMoE configuration matrix: interleaved vs wave ({prov.get('device', 'no GPU')}, "
             f"{prov.get('git_commit')})")
    lines = [title, "", f"`{prov.get('command')}`", "",
             f"Speedup = {result['speedup']}. Method: {result['method']}.", "",
             "Counts: " + ", ".join(f"{n} {v}" for n, v in s["counts"].items())
             + (f". Stopped: {result['stopped']}" if result.get("stopped") else "") + ".", "",
             "## Summary", "", "| group | | n | geomean | median | min | max | interleaved faster |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def stat_row(group, value, st):
        if not st.get("n"):
            return f"| {group} | {value} | 0 | | | | | |"
        return (f"| {group} | {value} | {st['n']} | {_f(st['geomean'])} | {_f(st['median'])} | {_f(st['min'])} | "
                f"{_f(st['max'])} | {st['faster']} |")

    lines.append(stat_row("all", "", s["overall"]))
    for name in GROUPS:
        lines += [stat_row(name, v, st) for v, st in s[f"by_{name}"].items()]
    if "auto" in s:
        lines += ["", "## schedule=\"auto\", in-run regret", "",
                  "T_auto / min(T_wave, T_interleaved) - 1 per configuration (the columns' medians); by rounds: the "
                  "median over trials of T_auto / T_better in the same trial - 1; the pick's regret: the column of "
                  "the order auto settled on, against the same minimum.", "",
                  "| precision | n | max | median | > 3% | by rounds max | by rounds > 3% | picks the better | "
                  "pick max | pick > 3% | worst |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, st in (("all", s["auto"]["overall"]), *s["auto"]["by_precision"].items()):
            lines.append(f"| {name} | {st['n']} | {100 * st['max_regret']:.1f}% | {100 * st['median_regret']:.1f}% | "
                         f"{st['over_3pct']} | "
                         + (f"{100 * st['round_max_regret']:.1f}%" if st.get("round_max_regret") is not None else "—")
                         + f" | {st.get('round_over_3pct', '—')} | {st['picks_the_better']} | "
                         + (f"{100 * st['pick_max_regret']:.1f}%" if st["pick_max_regret"] is not None else "—")
                         + f" | {st['pick_over_3pct']} | {st['worst_config']} |")
    auto = any(e.get("auto_regret") is not None for e in result["configurations"])
    head = ("| model | H / I | experts | top-k | precision | routing | tok/rank | P | wave µs | interleaved µs | "
            "speedup |" + (" auto µs | auto order | auto regret |" if auto else ""))
    lines += ["", "## Configurations", "", head, "| --- " * (14 if auto else 11) + "|"]
    shown = [e for e in result["configurations"] if e["status"] in ("measured", "failed")]
    for e in shown:
        routing = e["routing"] + (f" (s = {e['zipf_exponent']:g})" if e.get("zipf_exponent") is not None else "")
        lines.append(f"| {e['model']} | {e['hidden']} / {e['intermediate']} | {e['num_experts']} | {e['top_k']} | "
                     f"{e['precision']} | {routing} | {e['tokens_per_rank']} | "
                     f"{e['world']}{' (real)' if e.get('ranks') == 'real' else ''} | "
                     f"{_f(e.get('wave', {}).get('us'), 0)} | {_f(e.get('interleaved', {}).get('us'), 0)} | "
                     + (_f(e["speedup"]) if e["status"] == "measured" else f"failed: {e.get('reason')}") + " |"
                     + (f" {_f(e.get('auto', {}).get('us'), 0)} | {e.get('auto', {}).get('order') or '—'} | "
                        + (f"{100 * e['auto_regret']:+.1f}%" if e.get("auto_regret") is not None else "—") + " |"
                        if auto else ""))
    why = {}
    for e in result["configurations"]:
        if e["status"] in ("skipped", "not_run"):
            why.setdefault((e["status"], e.get("reason")), []).append(e["key"])
    if why:
        lines += ["", "## Not measured", "", "| status | configurations | reason | e.g. |", "| --- | --- | --- | --- |"]
        lines += [f"| {st} | {len(keys)} | {r} | {keys[0]} |" for (st, r), keys in why.items()]
    return "\n".join(lines) + "\n"


def write_markdown(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(markdown(result))


HATCH = {"balanced": "", "skewed": "//", "one_expert": "xx"}


def plot(result: dict, path: str) -> None:
    """Figure 8's role: per world size a panel of speedup bars, grouped by model, one slot per (precision,
    routing, tokens) (colour: precision; hatch: routing; shade: tokens; an empty slot was not measured), a
    line at 1; and a panel of the geometric means by model, precision and routing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    confs = result["configurations"]
    models = [m for m in MODELS if any(e["model"] == m for e in confs)]
    models += list(dict.fromkeys(e["model"] for e in confs if e["model"] not in models))
    worlds = sorted({e["world"] for e in confs}) or [1]
    slots = [(d, r, t) for d in PRECISIONS for r in dict.fromkeys(e["routing"] for e in confs)
             for t in sorted({e["tokens_per_rank"] for e in confs})]
    colors = dict(zip(PRECISIONS, ("tab:blue", "tab:orange", "tab:green")))
    tokens = sorted({t for _, _, t in slots})
    size = (max(10.0, 1.9 * max(1, len(models)) + 2), 3.3 * (len(worlds) + 1))
    fig, axes = plt.subplots(len(worlds) + 1, 1, figsize=size, squeeze=False)
    width = 0.85 / max(1, len(slots))
    by_key = {(e["model"], e["world"], e["precision"], e["routing"], e["tokens_per_rank"]): e for e in confs}
    for ax, w in zip(axes[:-1, 0], worlds):
        top, low, n_meas = 1.1, 0.8, 0
        for mi, m in enumerate(models):
            for si, (d, r, t) in enumerate(slots):
                e = by_key.get((m, w, d, r, t))
                if not e or not e.get("speedup"):
                    continue
                n_meas += 1
                alpha = 0.45 + 0.55 * (tokens.index(t) + 1) / len(tokens)
                ax.bar(mi - 0.425 + (si + 0.5) * width, e["speedup"], width, color=colors.get(d, "gray"),
                       alpha=alpha, hatch=HATCH.get(r, ""), edgecolor="k", linewidth=0.3)
                top, low = max(top, e["speedup"]), min(low, 0.95 * e["speedup"])
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_xticks(range(len(models)), models)
        ax.set_xlim(-0.5, len(models) - 0.5)
        ax.set_ylim(low if n_meas else 0, 1.08 * top)
        ax.set_ylabel("T_wave / T_interleaved")
        skipped = sum(1 for e in confs if e["world"] == w and not e.get("speedup"))
        real = any(e.get("ranks") == "real" for e in confs if e["world"] == w)
        mode = "one GPU" if w == 1 else f"EP = {w} on {w} GPUs" if real else f"P = {w} emulated on one GPU"
        ax.set_title(f"world {w} ({mode}): {n_meas} measured, {skipped} not (skipped, failed or not run)")
    handles = [Patch(color=colors[d], label=d) for d in PRECISIONS]
    handles += [Patch(facecolor="white", edgecolor="k", hatch=HATCH.get(r, ""), label=r)
                for r in dict.fromkeys(e["routing"] for e in confs)]
    handles += [Patch(color="gray", alpha=0.45 + 0.55 * (i + 1) / len(tokens), label=f"{t} tok/rank")
                for i, t in enumerate(tokens)]
    axes[0, 0].legend(handles=handles, fontsize=7, ncol=len(handles), loc="upper left")
    ax = axes[-1, 0]
    s = result["summary"]
    labels, vals, shades = [], [], []
    for name, shade in (("model", "tab:gray"), ("precision", "tab:purple"), ("routing", "tab:brown")):
        for v, st in s[f"by_{name}"].items():
            labels.append(str(v))
            vals.append(st.get("geomean", 0.0))
            shades.append(shade)
    bars = ax.bar(range(len(vals)), vals, color=shades)
    ax.bar_label(bars, [f"{v:.3f}" for v in vals], fontsize=7)
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(range(len(vals)), labels, rotation=30, fontsize=8)
    ax.set_ylim(min([0.8, *(0.95 * v for v in vals)]) if vals else 0, 1.08 * max([1.1, *vals]))
    o = s["overall"]
    ax.set_title("geometric mean by model, precision, routing" + (
        f"; overall {o['geomean']:.3f} (median {o['median']:.3f}, min {o['min']:.3f}, max {o['max']:.3f}, "
        f"n {o['n']})" if o.get("n") else ": nothing measured"))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
