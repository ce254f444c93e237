"""Plans with Megatron's partial optimizer offload: the search's fraction is the fastest that fits (checked by
pricing every fraction), and the plan's files say it as Megatron-LM reads it."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from costmodels import Config, parse_cluster
from costmodels.partial_offload import FRACTIONS
from costmodels.verdict import fits
from solver import solve
from solver.api import estimate
from solver.plan.launchers import emit

MODEL, GPUS = "Qwen/Qwen2.5-1.5B", "1xL4"
PINS = {"seq_len": 2048, "global_batch": 16, "launcher": "megatron", "offload": "cpu", "checkpoint": "full",
        "micro_batch": 2, "precision": "bf16-mixed", "optimizers": "adamw", "time_limit": 10}


@pytest.fixture(scope="module")
def plan():
    return solve(MODEL, GPUS, **PINS)


def test_the_search_keeps_the_fastest_fraction_that_fits(plan):
    """Everything else pinned, the fraction is the search's only choice: it must be the fastest of the fractions
    that fit, as `estimate` prices each."""
    cluster, d = parse_cluster(GPUS), plan.decisions
    config = {f.name: getattr(d, f.name) for f in dataclasses.fields(Config)}
    priced = {f: estimate(MODEL, cluster, {**config, "optimizer_offload_fraction": f}, seq_len=PINS["seq_len"],
                          global_batch=PINS["global_batch"], attention=d.attention, launcher="megatron")
              for f in FRACTIONS}
    fitting = {f: e.time.step_time for f, e in priced.items() if fits(e, cluster, headroom=plan.inputs.headroom).fits}
    assert len(fitting) < len(FRACTIONS), "a case where some shares do not fit"
    assert plan.decisions.optimizer_offload_fraction == min(fitting, key=fitting.get)
    assert plan.estimate.time.step_time == pytest.approx(fitting[plan.decisions.optimizer_offload_fraction])


def test_megatron_files_carry_the_fraction(plan):
    flags = shlex.split(emit(plan, "megatron")["megatron_args.txt"])
    fraction = flags[flags.index("--optimizer-offload-fraction") + 1]
    assert float(fraction) == plan.decisions.optimizer_offload_fraction
    assert {"--optimizer-cpu-offload", "--use-precision-aware-optimizer", "--overlap-cpu-optimizer-d2h-h2d",
            "--use-distributed-optimizer"} <= set(flags)
