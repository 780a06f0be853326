"""``xstage bench megamoe --matrix --dump FILE``: the per-tile records of every measured configuration, for the
stall test, span distributions and timelines of benchmarks/megamoe_analysis.py (issue 30, items 3-4; issue 31,
item 4 at real EP).

Per layer (model, world, tokens, precision), once its timed configurations are done: the timed layer is freed,
its instrumented twin built in its place (MegaMoE(..., instrument=True): the records are compiled in, a second
compile; built after, not beside, so a configuration that fits the matrix's memory verdict fits its dump too:
two copies of DeepSeek-V4-Pro's experts beside the harness's bf16 weights do not fit one H200), and per measured
configuration its seeded inputs drawn again (the same x and routing as its trials) and one instrumented launch
per schedule, each followed by the layer's last_dump(). At real ranks every rank launches on its own slice and
the records are gathered to rank 0 (benchmarks.megamoe.GatheredProbe: concatenated, a ``rank`` array tags
each record with its rank); emulated ranks come tagged the same way (benchmarks.megamoe.RankLists).

The file is bench megamoe --dump's (benchmarks.megamoe.store_dump and _write_dump): FILE.npz holds
``r<row>.<column>.<array>``, row the configuration's index in the matrix's run order and column
``ours_<precision>_<schedule>``; FILE.json the entries, each with row, column, key_prefix, shape, world, ranks,
tokens_per_rank, routing, zipf_exponent, seed, precision, schedule, key (the configuration's matrix key) and
what each array is. Written by rank 0 when the run ends (also when stopped); a run that continues another
(--resume, or a real world's phase after the one-GPU one) continues its dump, a configuration dumped again
replacing its old records. The result file's configuration entry says where its records are ("dump").
"""
from __future__ import annotations

from benchmarks import megamoe as mb

METHOD = ("per layer after its timed configurations: the timed layer freed, MegaMoE(..., instrument=True) built "
          "in its place; per measured configuration its inputs drawn again from its seed and one instrumented "
          "launch per schedule (records: MegaMoE.last_dump; real ranks: every rank's, gathered, tagged by rank)")


class MatrixDump:
    """The dump a matrix run builds (module docstring). ``writer``: this process writes the file (rank 0);
    ``resume``: continue the dump already at ``path``, if there is one; ``draw(ctx, cfg)`` and ``describe(cfg)``:
    the matrix's seeded inputs of a configuration and its entry's description (benchmarks.megamoe_matrix's
    config_inputs and describe, handed down: the matrix imports this module)."""

    def __init__(self, path: str, writer: bool, resume: bool = False, *, draw, describe):
        self.path, self.writer = path, writer
        self.draw, self.describe = draw, describe
        self.dumps, self.entries = mb.load_dump(path) if resume and writer else ({}, [])

    def dump_layer(self, ctx, api, group, measured: list, w1, w2, entries: dict) -> None:
        """The instrumented layer of ``measured`` [(Config, index)] (one layer's configurations), one launch per
        schedule of each; entries[key]["dump"] says what came of it, per schedule."""
        import torch

        cfg = measured[0][0]
        built = mb.build_ours(api, group, cfg.preset, cfg.world, cfg.tokens, w1, w2, [cfg.precision],
                              instrument=True, real=cfg.real)
        probe = (ctx.ranks.agreed_layers(built) if cfg.real else built)[cfg.precision]
        del built
        if cfg.real and not isinstance(probe, str):
            probe = mb.GatheredProbe(probe, ctx.ranks)
        for c, index in measured:
            entries[c.key]["dump"] = self.dump_config(ctx, c, probe, index)
        del probe
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def dump_config(self, ctx, cfg, probe, index: int) -> dict:
        """One configuration's launches: {schedule: {"key_prefix", "arrays"} or {"skipped"} or {"failed"}}."""
        import torch

        if isinstance(probe, str):
            return {s: {"skipped": f"no instrumented layer: {probe}"} for s in mb.SCHEDULES}
        x, idx, wts, seed, _ = self.draw(ctx, cfg)
        ranks = ctx.ranks if cfg.real else None
        desc = self.describe(cfg)
        row = self.row_of(cfg.key, index)
        out = {}
        for s in mb.SCHEDULES:
            why = None
            try:
                probe.forward(x, idx, wts, schedule=s)
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - recorded in the configuration's entry
                why = mb._reason(e)
            if ranks is not None and not ranks.agree(why is None):  # last_dump gathers: every rank or none
                why = why or "failed on another rank"
            if why is None:
                try:
                    arrays = probe.last_dump()
                except Exception as e:  # noqa: BLE001 - at real ranks raised alike on every rank
                    why = mb._reason(e)
            if why is not None:
                out[s] = {"failed": why}
                continue
            column = f"ours_{cfg.precision}_{s}"
            prefix = f"r{row}.{column}"
            meta = {"row": row, "column": column, "shape": cfg.preset.name, "world": cfg.world,
                    "ranks": desc["ranks"], "tokens_per_rank": cfg.tokens, "routing": cfg.routing,
                    "zipf_exponent": cfg.skew, "seed": seed, "precision": cfg.precision, "schedule": s,
                    "key": cfg.key}
            if self.writer:
                out[s] = mb.store_dump(self.dumps, self.entries, prefix, arrays, meta)
            else:
                out[s] = {"key_prefix": prefix, "arrays": mb.dump_summary(arrays)}
            del arrays
        return out

    def row_of(self, key: str, index: int) -> int:
        """The row number of configuration ``key`` (its index in the run order): its old records, if this dump
        continues one that holds them, are dropped; a row another configuration holds (a dump continued
        across other flags) gives the next free number."""
        old = {e["key_prefix"] for e in self.entries if e.get("key") == key}
        self.entries = [e for e in self.entries if e["key_prefix"] not in old]
        self.dumps = {k: v for k, v in self.dumps.items() if k.rsplit(".", 1)[0] not in old}
        taken = {e["row"] for e in self.entries}
        return index if index not in taken else max(taken) + 1

    def write(self, command: str, result_path: str) -> None:
        """FILE.npz and FILE.json (rank 0 only)."""
        import os

        if self.writer:
            mb._write_dump(self.path, self.dumps, self.entries, command,
                           {"source": "xstage bench megamoe --matrix", "result": os.path.basename(result_path),
                            "method": METHOD})
