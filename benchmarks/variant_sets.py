"""``--variants``: extra benchmark columns as named knob sets, read from a JSON string or a .json file.

A variant whose knobs hold a ``"mode"`` is a fused column (``fused_<name>``, ``FusedAttentionA2A.launch``
with those knobs, sender-side like ``fused``); any other is an FA-only column (``fa_ours_<name>``,
``flash_attention`` in the fused kernel's tile order with those knobs). Only the options the kernels keep
are accepted, so a knob set written for a removed option fails here, by name, instead of in every rank.
"""
from __future__ import annotations

import json

FA_KNOBS = ("tail_split",)
FUSED_KNOBS = ("mode", "self_store", "tail_split", "store", "relay")


def parse_variants(text: str, built_in=()) -> dict:
    """{name: knobs} from ``text``: a JSON object, or the path of a .json file holding one. Refuses a name
    given twice (plain json.loads keeps the last one silently: a run once lost a column so), a knob the
    kernels do not take, and a column name that a built-in column (``built_in``) already has. ValueError
    (OSError for an unreadable file) naming the problem."""
    def no_duplicates(pairs):
        names = [k for k, _ in pairs]
        twice = sorted({k for k in names if names.count(k) > 1})
        if twice:
            raise ValueError(f"names {twice} more than once: give every variant its own name")
        return dict(pairs)

    source = text
    if text.lstrip()[:1] not in ("{", "["):  # not JSON text: the path of a file of variants
        with open(text) as f:
            source = f.read()
    variants = json.loads(source, object_pairs_hook=no_duplicates)
    if not isinstance(variants, dict) or not all(isinstance(kn, dict) for kn in variants.values()):
        raise ValueError('expected {"name": {knob: value, ...}, ...}')
    for name, knobs in variants.items():
        fused = "mode" in knobs
        allowed = FUSED_KNOBS if fused else FA_KNOBS
        unknown = sorted(set(knobs) - set(allowed))
        if unknown:
            raise ValueError(f"variant {name!r}: {', '.join(unknown)} not an option of the "
                             f"{'fused' if fused else 'FA-only'} kernel (options: {', '.join(allowed)})")
        column = variant_column(name, knobs)
        if column in built_in:
            raise ValueError(f"variant {name!r} would replace the built-in column {column!r}: rename it")
    return variants


def variant_column(name: str, knobs: dict) -> str:
    """The column a variant adds: fused_<name> where its knobs hold a mode, else fa_ours_<name>."""
    return ("fused_" if "mode" in knobs else "fa_ours_") + name
