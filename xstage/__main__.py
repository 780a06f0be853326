"""``python -m xstage``: the ``xstage`` command."""
from xstage.cli import main

raise SystemExit(main())
