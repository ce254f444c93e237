"""Launcher emitters: one module per target, each a pure `emit(plan)`; `EMITTERS` maps names to them."""
