"""Each data-parallel engine's rules, one module each (ddp, deepspeed, fsdp2, megatron): what it shards at each
ZeRO stage, which collectives it runs and when, the dtypes it keeps under mixed precision, what it offloads and
compiles.
Cost modules ask `rules_of(engine)` instead of testing which engine runs."""

from __future__ import annotations

from ..choices import Engine
from . import ddp, deepspeed, fsdp2, megatron
from .base import DataParallelTraffic, EngineRules, GradientSizes, UnitBytes

# In order of simplicity: the search breaks ties toward the first (solver/search/space.ENGINE_STAGES).
RULES: dict[Engine, EngineRules] = {rules.engine: rules for rules in (ddp.RULES, deepspeed.RULES, fsdp2.RULES,
                                                                       megatron.RULES)}


def rules_of(engine: Engine) -> EngineRules:
    return RULES[engine]


__all__ = ["RULES", "DataParallelTraffic", "EngineRules", "GradientSizes", "UnitBytes", "rules_of"]
