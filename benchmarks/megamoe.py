"""``xstage bench megamoe``: the MegaMoE benchmark's place. Not built yet (issue 28): the command exists so its
flags land here, and until then it says so and exits 2."""
from __future__ import annotations

from calibrate.cli import UsageError


def add_arguments(p) -> None:
    """No options yet: the benchmark's flags come with it (issue 28)."""


def run(args) -> int:
    raise UsageError("bench megamoe is not implemented yet (issue 28)")
