"""`fitplan estimate` and `solve` give the same verdict for the same configuration (issue 10).

Estimate's verdict comes from `api.estimate` (the memory breakdown) through `costmodels.fits`, as the CLI prints
it; the solver's comes from the integer table it searches: the configuration's allocated peak over its checkpoint
modes against the table's allocated-byte budget, plus the host check. The two paths compute the peak separately.
"""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from costmodels import DEFAULT_HEADROOM, Config, Engine, Optimizer, Precision, Workload, fits, parse_cluster
from costmodels.lowering import shared_lowering
from costmodels.overhead import allocated_budget, reserved_bytes
from costmodels.verdict import usable_bytes
from graphs import Checkpoint
from graphs.lowering import lower_resolved
from graphs.sources import resolve
from solver import api
from solver.cli.app import app
from solver.cli.commands import estimate_report
from solver.search.space import Outer
from solver.search.tables import build_table

SEQ_LEN = 1024
MODELS = ("facebook/opt-125m", "Qwen/Qwen2.5-0.5B")
GPUS = ("1xA10G", "2xL4", "2xRTX4090")
ENGINES = ((Engine.DDP, 0), (Engine.DEEPSPEED, 2), (Engine.FSDP2, 3))
MICRO_BATCHES = (4, 32)
CHECKPOINTS = (Checkpoint.NONE, Checkpoint.SELECTIVE, Checkpoint.FULL)
HEADROOMS = (DEFAULT_HEADROOM, 0.3)


def _solver_fits(model: str, gpus: str, flags: dict, headroom: float) -> bool:
    """The solver's verdict: does this configuration's table admit its checkpoint modes?"""
    cluster = parse_cluster(gpus)
    dtype, autocast = shared_lowering(api.config_from(dict(flags), layers=None))
    graph = lower_resolved(resolve(model), dtype=dtype, autocast=autocast)
    config: Config = api.config_from(dict(flags), layers=len(graph.decoder_layers()))
    workload = Workload(seq_len=SEQ_LEN, global_batch=config.micro_batch * config.grad_accum * config.dp)
    outer = Outer(tp=config.tp, dp=config.dp, engine=config.engine, zero=config.zero,
                  optimizer_offload=config.optimizer_offload, param_offload=config.param_offload,
                  micro_batch=config.micro_batch, grad_accum=config.grad_accum, precision=config.precision,
                  optimizer=config.optimizer)
    table = build_table(graph, cluster, workload, outer, rank=0, headroom=headroom)
    modes = config.layer_modes(len(graph.decoder_layers()))
    return table.host_ok and table.peak_of(modes) <= table.budget


def _cases():
    return itertools.product(MODELS, GPUS, ENGINES, MICRO_BATCHES, CHECKPOINTS)


def test_estimate_and_solver_tables_agree_on_every_configuration_of_a_sweep():
    verdicts = {True: 0, False: 0}
    near = 0  # configurations the old rule (device peak <= full capacity) judged differently
    for model, gpus, (engine, zero), micro_batch, mode in _cases():
        dp = parse_cluster(gpus).world_size
        flags = {"tp": 1, "dp": dp, "engine": engine, "zero": zero, "micro_batch": micro_batch, "grad_accum": 1,
                 "checkpoint": mode.value, "precision": Precision.BF16_MIXED, "optimizer": Optimizer.ADAMW}
        for headroom in HEADROOMS:
            report = estimate_report(model, gpus, None, dict(flags), seq_len=SEQ_LEN,
                                     headroom=headroom)
            solver = _solver_fits(model, gpus, flags, headroom)
            case = f"{model} {gpus} {engine} zero={zero} mb={micro_batch} {mode} headroom={headroom}"
            assert report.fits == solver, f"{case}: {report.verdict.sentence}"
            verdicts[solver] += 1
            near += (report.estimate.memory.device_peak <= report.capacity) != report.fits
    assert verdicts[True] >= 10 and verdicts[False] >= 10, verdicts  # the sweep crosses the boundary both ways
    assert near >= 1  # and reaches the headroom band, where only a shared rule agrees


def test_the_budget_is_the_inverse_of_the_device_rule_byte_for_byte():
    capacity, overhead = 24 * 2**30, 1_700_000_000
    usable = usable_bytes(capacity, DEFAULT_HEADROOM)
    budget = allocated_budget(usable, overhead)
    for allocated in (0, 1, budget - 2**21, budget - 1, budget, budget + 1, budget + 2**21, 2 * budget):
        peak = SimpleNamespace(device_peak=reserved_bytes(allocated) + overhead, fragmentation_risk=0)
        assert fits(peak, capacity, DEFAULT_HEADROOM).fits == (allocated <= budget), allocated


def test_estimate_cli_prints_the_rule_and_exits_3_when_it_does_not_fit():
    runner = CliRunner()
    args = ["estimate", "--model", "facebook/opt-125m", "--gpus", "1xA10G", "--seq-len", str(SEQ_LEN)]
    small = runner.invoke(app, [*args, "--micro-batch", "1"])
    assert small.exit_code == 0, small.output
    assert "Fits with" in small.output and "left: device peak" in small.output and "usable" in small.output
    assert "less 5% headroom" in small.output
    tight = runner.invoke(app, [*args, "--micro-batch", "1", "--headroom", "0.99"])
    assert tight.exit_code == 3, tight.output
    assert "Does NOT fit: device peak" in tight.output and "less 99% headroom" in tight.output


def test_estimate_json_carries_the_verdict_and_its_numbers():
    result = CliRunner().invoke(app, ["estimate", "--model", "facebook/opt-125m", "--gpus", "1xA10G", "--seq-len",
                                      str(SEQ_LEN), "--headroom", "0.1", "--json"])
    data = json.loads(result.stdout)
    verdict = data["verdict"]
    assert verdict["headroom"] == 0.1
    assert verdict["usable_bytes"] == int(23_028 * 2**20 * 0.9)  # the A10G's driver figure less 10%
    assert verdict["margin_bytes"] == verdict["usable_bytes"] - data["memory"]["device_peak"]
    assert data["fits"] is (verdict["margin_bytes"] >= 0)
    assert verdict["sentence"].startswith("fits with ") and "left: device peak" in verdict["sentence"]


@pytest.mark.parametrize("bad", ["1", "-0.1", "nan"])
def test_estimate_rejects_a_headroom_outside_zero_to_one(bad):
    result = CliRunner().invoke(app, ["estimate", "--model", "facebook/opt-125m", "--gpus", "1xA10G",
                                      "--headroom", bad])
    assert result.exit_code == 2
    assert "headroom" in result.output


def test_verdict_checks_host_ram_as_the_solver_does():
    cluster = parse_cluster("1xA10G")
    memory = SimpleNamespace(device_peak=2**30, cpu_bytes_per_node=cluster.cpu_ram_per_node + 1,
                             nvme_bytes_per_node=0, fragmentation_risk=0)
    verdict = fits(memory, cluster)
    assert verdict.device_fits and not verdict.fits
    assert "host RAM" in verdict.sentence and verdict.sentence.startswith("does NOT fit")


def test_solve_renders_the_same_rule_for_its_plan():
    result = CliRunner().invoke(app, ["solve", "--model", "facebook/opt-125m", "--gpus", "1xA10G", "--seq-len",
                                      str(SEQ_LEN), "--global-batch", "8", "--time-limit", "5"])
    assert result.exit_code == 0, result.output
    assert "Fits with" in result.output and "left: device peak" in result.output
    assert "less 5% headroom" in result.output


def test_default_headroom_is_the_one_solve_uses():
    assert api.DEFAULT_HEADROOM == DEFAULT_HEADROOM


def test_guide_advice_judges_other_micro_batches_by_the_same_rule():
    from costmodels import estimate as estimate_graph
    from solver.plan.advice import advise

    cluster = parse_cluster("1xA10G")
    flags = {"tp": 1, "dp": 1, "micro_batch": 2, "grad_accum": 2, "checkpoint": "none"}
    dtype, autocast = shared_lowering(api.config_from(dict(flags), layers=None))
    graph = lower_resolved(resolve("facebook/opt-125m"), dtype=dtype, autocast=autocast)
    config = api.config_from(dict(flags), layers=len(graph.decoder_layers()))
    workload = Workload(seq_len=SEQ_LEN, global_batch=4)
    chosen = estimate_graph(graph, cluster, workload, config)
    doubled = estimate_graph(graph, cluster, workload, api.config_from({**flags, "micro_batch": 4, "grad_accum": 1},
                                                                       layers=len(graph.decoder_layers())))
    assert doubled.memory.device_peak < cluster.gpu.memory_bytes  # fits the whole GPU, so only headroom decides
    tight = 1 - (doubled.memory.device_peak - 4096) / cluster.gpu.memory_bytes  # usable just below its peak

    def batch_line(headroom: float) -> str:
        lines = advise(graph, cluster, workload, config, chosen, compile_pin="off", input_tokens_per_s=None,
                       allowed_optimizers=(Optimizer.ADAMW,), lora=False, headroom=headroom).lines
        return next(line for line in lines if line.startswith("batch size"))

    assert "micro-batch 4 needs" not in batch_line(0.0)
    assert "micro-batch 4 needs" in batch_line(tight) and "(does not fit)" in batch_line(tight)
    assert not fits(doubled, cluster, tight).fits and fits(doubled, cluster, 0.0).fits


def test_a_peak_inside_the_headroom_is_refused_with_the_risk_it_would_take():
    """Issue 35 item 3: axolotl's single-GPU full fine-tune of Llama-3-8B (examples/recipes) peaks at ~47.3 GiB on a
    48 GiB card: the 5% headroom refuses it, and the verdict says it fits the card, with how much left and the
    headroom that accepts it (the rule stays the one solve fits its plans to)."""
    capacity = parse_cluster("1xRTX-A6000").gpu.memory_bytes
    peak = capacity - int(0.0153 * capacity)
    memory = SimpleNamespace(device_peak=peak, fragmentation_risk=0)
    verdict = fits(memory, capacity)
    assert not verdict.fits and verdict.inside_headroom
    assert verdict.left == pytest.approx(0.0153, abs=1e-6)
    assert "fits the card with 1.5% left" in verdict.sentence and "--headroom 0.015 accepts it" in verdict.sentence
    assert fits(memory, capacity, 0.015).fits  # the headroom it names accepts it
    assert not fits(memory, capacity, 0.016).fits
    over = fits(SimpleNamespace(device_peak=capacity + 1, fragmentation_risk=0), capacity)
    assert not over.inside_headroom and "card" not in over.sentence  # past the card is no risk to take
