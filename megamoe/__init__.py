"""MegaMoE (issue 28). Built so far: the tile schedules, their dependency checks and D_knee (``megamoe.schedule``)
and their CPU replay against the Burst-Gap model (``megamoe.simulate``); the kernel and its API are not built yet."""
