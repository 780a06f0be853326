"""The ``xstage`` command line (``xstage.cli``): the package above every other one, which it imports downward."""
