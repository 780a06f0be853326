"""A saved ``xstage bench flash-a2a`` result as a Markdown table (the README's), without a GPU."""
from __future__ import annotations

import json

from flash_a2a.hiding import row_interval

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


def table_row(row: dict) -> str:
    t_fa = row.get("fa_ours_us")
    e_res = row.get("fused_E_res_us")
    e_txt = "–"
    if e_res is not None and t_fa:
        e_txt = f"{e_res:+.1f} ({100 * e_res / t_fa:+.2f}%)"
        if row.get("fused_E_res_round_paired_us") is not None:  # alternated launches; round-paired beside it
            e_txt += f" [rounds {row['fused_E_res_round_paired_us']:+.0f}]"
    ratio = f"{row['fa4_us'] / t_fa:.3f}" if "fa4_us" in row and t_fa else "–"
    if row.get("fa4_over_ours_paired") is not None:  # long kernels: adjacent alternating launches beside it
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
    return "| " + " | ".join(cells) + " |"


def markdown_table(result: dict) -> str:
    """``result``: the JSON object ``xstage bench flash-a2a`` writes. ours/FA4 is T_FA4 / T_ours (1 = parity)."""
    lines = [HEADER, "|" + " --- |" * (HEADER.count("|") - 1)]
    lines += [table_row(r) for r in result["rows"]]
    return "\n".join(lines)


def markdown_table_file(path: str) -> str:
    with open(path) as f:
        return markdown_table(json.load(f))


SPLIT_PARTS = (("epilogue code", "fused_self_nosig", None),
               ("flag protocol", "fused_self", "fused_self_nosig"),
               ("NVLink stores", "fused", "fused_self"),
               ("NVLink stores, no flags", "fused_nosig", "fused_self_nosig"),
               # the protocol's parts (``faparts``), measured on the self-store control: the ready wait, the
               # completion fence, and the data flags with the CTA's last barrier
               ("ready wait", "fused_self", "fused_self_done"),
               ("completion fence", "fused_self_done", "fused_self_donenf"),
               ("data flags", "fused_self_donenf", "fused_self_nosig"))


def residual_split(row: dict) -> dict:
    """The fused residual of one row taken apart by the control columns of ``benchmarks/device/h200x2.sh
    fadiag`` (each residual is over ``fa_ours``): the fused kernel's epilogue code alone (every tile stored
    locally, no flags), what the flag protocol adds, and what sending the tiles over NVLink adds (with and
    without flags); with ``faparts``'s columns also the protocol's parts (ready wait, completion fence, data
    flags). Parts whose columns are missing are left out; values in µs."""
    out = {}
    for name, col, base in SPLIT_PARTS:
        e = row.get(col + "_E_res_us")
        b = 0.0 if base is None else row.get(base + "_E_res_us")
        if e is not None and b is not None:
            out[name] = e - b
    if row.get("fused_E_res_us") is not None:
        out["total"] = row["fused_E_res_us"]
    return out


def residual_split_text(result: dict) -> str:
    lines = []
    for r in result["rows"]:
        parts = residual_split(r)
        lines.append(f"{r['heads_per_rank']} heads/rank, M = {r['seq_len']}: "
                     + ", ".join(f"{k} {v:+.1f} µs" for k, v in parts.items()))
    return "\n".join(lines)
