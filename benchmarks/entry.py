"""The ``python -m benchmarks.X`` entry shared by the benchmarks whose options live in ``add_arguments`` /
``run`` (the same functions ``xstage bench ...`` forwards to): parse, run, and turn a UsageError into one
``xstage: error:`` line and exit status 2, as the CLI does."""
from __future__ import annotations

import argparse
import sys

from calibrate.cli import UsageError


def module_main(prog: str, description: str, add_arguments, run, argv=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(p)
    try:
        return run(p.parse_args(argv))
    except UsageError as e:
        print(f"xstage: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
