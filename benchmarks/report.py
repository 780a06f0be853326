"""A ``xstage bench flash-a2a`` result as the README's Markdown table and as its figure, with what each row is
held against: the model's two prior predictions (section 4.3) and the slope test (section 5.3). No GPU."""
from __future__ import annotations

import json

import math

from benchmarks.hiding import row_interval

HEADER = ("| heads/rank | M | ours FA | FA4 | cuDNN | ours/FA4 | post A2A NCCL / symm | pre A2A NCCL / symm "
          "| serial ours+NCCL | serial FA4+NCCL | fused | E_res (% of T_FA) | fused_cc − fused | H [95% interval] "
          "| speedup vs serial ours / FA4 (target) [pairs: T_fused / T_FA4, target ≤ 1.020] |")


def _us(row: dict, name: str) -> str:
    t = row.get(name + "_us")
    if t is None:
        return "–"
    tf = row.get(name + "_tflops")
    return f"{t:.0f} ({tf:.0f})" if tf else f"{t:.0f}"


def _pair(row: dict, a: str, b: str) -> str:
    x, y = row.get(a + "_us"), row.get(b + "_us")
    return f"{x:.0f} / {y:.0f}" if x is not None and y is not None else "–"


def _hiding_cell(row: dict) -> str:
    """H to 3 places (0.898 is not 0.9) and, where the row kept its pairs, the bootstrap interval (as the bench
    stored it, else computed from the pairs: results saved before the bench stored it)."""
    h = row.get("hiding_ratio")
    if h is None:
        return "–"
    interval = row.get("hiding_ratio_ci95") or row_interval(row)
    if not interval:
        return f"{h:.3f}"
    lo, hi = ("−inf" if x is None or x == float("-inf") else f"{x:.2f}" for x in interval)
    return f"{h:.3f} [{lo}–{hi}]"


def table_cells(row: dict) -> list[str]:
    """One row of the table, cell by cell ("–" where the run has no such column)."""
    t_fa = row.get("fa_ours_us")
    e_res = row.get("fused_E_res_us")
    e_txt = "–"
    if e_res is not None and t_fa:
        e_txt = f"{e_res:+.1f} ({100 * e_res / t_fa:+.2f}%)"
        if row.get("fused_E_res_round_paired_us") is not None:  # alternated launches; round-paired beside it
            e_txt += f" [rounds {row['fused_E_res_round_paired_us']:+.0f}]"
    ratio = f"{row['fa4_us'] / t_fa:.3f}" if "fa4_us" in row and t_fa else "–"
    if row.get("fa4_over_ours_paired") is not None:  # from adjacent alternating launches, beside it
        ratio += f" [pairs {row['fa4_over_ours_paired']:.3f}]"
    cc = row.get("fused_cc_minus_fused_us")
    target = (0.98 * row["serial_fa4_nccl_us"] / row["fa4_us"]
              if "serial_fa4_nccl_us" in row and "fa4_us" in row else None)
    s_ours = row.get("speedup_fused_over_serial_ours_nccl")
    s_fa4 = row.get("speedup_fused_over_serial_fa4_nccl")
    speed = (f"{s_ours:.3f} / {s_fa4:.3f}" if s_ours and s_fa4 else "–") + (f" ({target:.3f})" if target else "")
    if row.get("fused_over_fa4_paired") is not None:  # drift-free form of the FA4 target: T_fused/T_FA4 <= 1/0.98
        speed += f" [pairs T_fused/T_FA4 {row['fused_over_fa4_paired']:.3f}]"
    elif row.get("speedup_fused_over_serial_fa4_nccl_paired") is not None:  # adjacent pairs, beside the rounds'
        speed += f" [pairs {row['speedup_fused_over_serial_fa4_nccl_paired']:.3f}]"
    m = row["seq_len"]
    cells = [str(row["heads_per_rank"]), f"{m // 1024}K" if m % 1024 == 0 else str(m), _us(row, "fa_ours"),
             _us(row, "fa4"), _us(row, "cudnn"), ratio, _pair(row, "a2a_nccl", "a2a_symm"),
             _pair(row, "pre_a2a_nccl", "pre_a2a_symm"), _us(row, "serial_ours_nccl"), _us(row, "serial_fa4_nccl"),
             _us(row, "fused"), e_txt, f"{cc:+.0f}" if cc is not None else "–",
             _hiding_cell(row), speed]
    return cells


def table_row(row: dict) -> str:
    return "| " + " | ".join(table_cells(row)) + " |"


def markdown_table(result: dict) -> str:
    """``result``: the JSON object ``xstage bench flash-a2a`` writes. ours/FA4 is T_FA4 / T_ours (1 = parity)."""
    header = [c.strip() for c in HEADER.strip("|").split("|")]
    rows = [table_cells(r) for r in result["rows"]]
    # columns no row of this run has (a one-GPU run has no All-to-All, serial or fused column) are left out
    keep = [i for i in range(len(header)) if any(cells[i] not in ("–", "– (0.980)") for cells in rows)]
    lines = ["| " + " | ".join(header[i] for i in keep) + " |", "|" + " --- |" * len(keep)]
    lines += ["| " + " | ".join(cells[i] for i in keep) + " |" for cells in rows]
    return "\n".join(lines)


def markdown_table_file(path: str) -> str:
    with open(path) as f:
        return markdown_table(json.load(f))


def model_predictions(row: dict, profile, sm_count: int) -> dict:
    """The two prior predictions of section 4.3 for one row, from the platform profile and the row's
    measured Q-loop time per KV tile (sigma), without refitting: the X-Stage drain residual
    E_drain = N_t [dt(M) - G_QK]+ (eqs. 18-19; zero for M >= M*_ub) and the completion-coupled
    counterfactual E_cc = N_t [V/R + T_lat - T_cover]+ (eq. 17), for the worst case of aligned output waves
    (V = K x 32 KiB at d = 128, K = grid). N_t: output-tile waves per CTA; G_QK = T_cover: one QK GEMM of a KV step,
    taken as half of sigma (QK and PV are equal GEMMs)."""
    from calibrate import model

    s, h_loc, d = row["seq_len"], row["heads_per_rank"], row.get("head_dim", 128)
    sigma = row["sigma_us_per_kv_tile"]
    n_tiles = (s // 128) * h_loc
    grid = min(n_tiles, sm_count)
    n_waves = n_tiles / grid
    v = grid * 128 * d * 2  # one bf16 output tile per CTA
    r = profile.drain_rate
    t0 = float(profile.t_iss0(grid, v))
    g_qk = sigma / 2
    g_qloop = float(model.qloop_gap_lower_bound(s, sigma, 128))
    stall = float(model.piggyback_stall(g_qloop, v, t0, r))
    out = {"model_G_star_us": float(model.recovery_gap(v, t0, r)),
           "model_M_star_ub": float(model.m_star_ub(v, t0, r, sigma, 128)),
           "model_E_drain_us": float(model.drain_residual(n_waves, stall, g_qk))}
    t_lat = (profile.fit_quality or {}).get("completion_latency_us")
    if t_lat is not None:
        dt_cc = float(model.completion_coupled_stall(v, r, t_lat, g_qk))
        out.update(model_T_lat_us=float(t_lat),
                   model_E_cc_us=float(model.completion_coupled_exposure(n_waves, dt_cc)))
    return out


def _fit_line(xs, ys):
    """Least-squares slope and intercept, with the slope's standard error (None below 3 points)."""
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    icpt = my - slope * mx
    resid = sum((y - icpt - slope * x) ** 2 for x, y in zip(xs, ys))
    return {"slope": slope, "intercept": icpt, "slope_stderr": math.sqrt(resid / (n - 2) / sxx)}


def slope_test(rows) -> dict:
    """Section 5.3's slope test, per head load: regress the completion-coupled extra cost (T_cc − T_fused,
    paired within rounds) and the piggybacked residual E_res on the tiles each CTA issues (the number of
    per-tile completion waits). Completion coupling pays a round trip per tile, so its slope is positive;
    piggybacking pays none, so E_res does not grow with it."""
    out = {}
    for h_loc in sorted({r["heads_per_rank"] for r in rows}):
        sel = [r for r in rows if r["heads_per_rank"] == h_loc and r.get("tiles_per_cta")
               and r.get("fused_cc_minus_fused_us") is not None and r.get("fused_E_res_us") is not None]
        xs = [r["tiles_per_cta"] for r in sel]
        out[str(h_loc)] = {"tiles_per_cta": xs,
                           "cc_minus_fused_us": _fit_line(xs, [r["fused_cc_minus_fused_us"] for r in sel]),
                           "fused_E_res_us": _fit_line(xs, [r["fused_E_res_us"] for r in sel])}
    return out


def plot(result: dict, path: str) -> None:
    """Figure 11 style: E_res / T_FA vs M for piggybacked and completion-coupled fusion."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, h_loc in zip(axes, sorted({r["heads_per_rank"] for r in result["rows"]})):
        rows = sorted((r for r in result["rows"] if r["heads_per_rank"] == h_loc), key=lambda r: r["seq_len"])
        m = [r["seq_len"] for r in rows]
        for key, label, style in (("fused", "piggyback (X-Stage)", "o-"),
                                  ("fused_cc", "completion-coupled", "s-"),
                                  ("fused_visible", "piggyback, remote-visible", "^:")):
            ys = [r[key + "_E_res_us"] / r["fa_ours_us"] * 100
                  if r.get(key + "_E_res_us") is not None and r.get("fa_ours_us") else math.nan for r in rows]
            ax.plot(m, ys, style, label=label)
        for key, label, color in (("model_E_drain_us", "X-Stage prediction, drain residual (eqs. 18-19)", "tab:blue"),
                                  ("model_E_cc_us", "completion-coupled prediction (eq. 17)", "tab:orange")):
            ys = [r[key] / r["fa_ours_us"] * 100 if r.get(key) is not None and r.get("fa_ours_us") else math.nan
                  for r in rows]
            if any(not math.isnan(y) for y in ys):
                ax.plot(m, ys, "--", lw=1.2, color=color, alpha=0.8, label=label)
        serial = [(r.get("serial_ours_nccl_excess_us") or math.nan) / r["fa_ours_us"] * 100 for r in rows]
        ax.plot(m, serial, "k--", lw=0.8, label="serial (ours + NCCL A2A) − FA")
        mstar = [r.get("model_M_star_ub") for r in rows if r.get("model_M_star_ub")]
        if mstar:
            ax.axvline(mstar[0], color="gray", ls=":", label=f"model M*_ub = {mstar[0]:.0f}")
        ax.axhline(0, color="gray", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length M (tokens)")
        ax.set_ylabel("E_res / T_FA (%)")
        ax.set_title(f"{h_loc} heads per rank, P = {rows[0]['world']}, d = {rows[0].get('head_dim', 128)}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("FlashAttention–A2A residual beyond FA alone (sender-side), with the two prior model predictions")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
