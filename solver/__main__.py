"""`python -m solver ARGS`: the `fitplan` command without its console script (e.g. from a checkout)."""

from solver.cli.app import main

main()
