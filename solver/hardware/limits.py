"""How much a local run (`fitplan check`, `fitplan measure`) may start; `solver.search.bounds` lists them with the
ranges of every other option."""

# `check --steps`: a few steps compare a plan with its estimate; a thousand is already a training run.
MAX_CHECK_STEPS = 1000
# Processes a CPU run (`check --device cpu`, `measure --device cpu`) starts: each rank is a Python process holding
# torch and the model (~0.5 GiB for the tiny models a CPU check is for), and gloo on shared cores slows with each.
MAX_CPU_RANKS = 16
