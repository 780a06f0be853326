"""MegaMoE (issue 28): one persistent fused expert-parallel MoE kernel for Hopper (``megamoe.kernel``) behind
``MegaMoE`` / ``EmulatedMoE`` (``megamoe.api``) and ``torch.ops.xstage.megamoe`` (``megamoe.ops``); its tile
schedules in plain Python (``megamoe.schedule``), their device mirror (``megamoe.tile_stream``), their replay
against the Burst-Gap model (``megamoe.simulate``) and the fp32 reference (``megamoe.reference``).

``MegaMoE`` and ``EmulatedMoE`` load on first use, so the schedules and the simulator import without the DSL."""


def __getattr__(name):
    if name in ("MegaMoE", "EmulatedMoE"):
        from megamoe import api

        return getattr(api, name)
    raise AttributeError(f"module 'megamoe' has no attribute {name!r}")
