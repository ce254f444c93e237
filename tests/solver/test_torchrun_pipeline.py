"""The emitted torchrun script runs pipeline plans through torch.distributed.pipelining (issue 13): a tiny Llama's
plan with pp=2, emitted and trained for two steps on two gloo CPU processes, holds on each rank what the plan
prices.

What is compared, per rank, during the second (steady-state) step: the peak bytes of the distinct storages autograd
holds (saved-tensor hooks over the whole schedule step: parameters, buffers and the batch excluded; a storage saved
by several nodes once; released with its last saved copy), against
- `costmodels.pipeline.held_activation_bytes` in the torch action order of the plan's schedule, fed per global stage
  with the lowering's saved bytes of that stage's slice of the layer graph (`pipeline_stages.rank_slices`, the plan's
  split and checkpoint modes; `check.saved_activation_bytes`), and with the loss's saved bytes as what a zero-bubble
  input step frees on the last stage: exact bytes;
- the moments the plan's memory composes (`pipeline.rank_moments` of the plan's rank slices): the most, over the
  forwards, of the running stage's saved bytes plus what the other in-flight micro-batches of each stage hold
  (their saved bytes, less the loss's after a zero-bubble input step): exact bytes for every schedule; and the
  plan's in-flight count, the most stage sets those moments hold.
Parameters and AdamW states per rank equal the plan's per-rank memory breakdown exactly (fp32 on CPU). The stages
themselves are checked against the whole model: cut from a checkpoint, they compose to its logits, and a run's
first loss is transformers' loss of the same tokens.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pytest

from costmodels import Workload
from costmodels.pipeline import StageActivations, held_activation_bytes, rank_moments, sets_in_flight
from costmodels.pipeline_schedule import Schedule, stage_ranks
from costmodels.pipeline_stages import rank_config, rank_slices
from graphs import FitplanError, Role
from graphs.architectures import flagged
from solver import solve
from solver.cli.commands import emit_files
from solver.hardware.check import plan_config, plan_graph, saved_activation_bytes
from tests.gloo import torchrun
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

RANKS = 2
SEQ_LEN, GLOBAL_BATCH = 32, 8
# Two sequences per micro-batch: with one, transformers' `labels[..., 1:].contiguous()` keeps a view of the padded
# labels (a size-1 batch dimension is contiguous), 8 bytes more than the shifted labels the lowering's fit counts.
MICRO_BATCH = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_config(tmp_path_factory.mktemp("tiny-llama"), {**tiny_values("llama"), "num_hidden_layers": 4})


def pipeline_plan(model_dir: Path, schedule: Schedule, **pins):
    return solve(str(model_dir), f"{RANKS}xCPU", seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, time_limit=5, pp=2,
                 pp_schedule=schedule, micro_batch=MICRO_BATCH, launcher="torchrun", **pins)


def run_script(plan, model_dir: Path, folder: Path, ranks: int = RANKS) -> tuple[list[dict], list[float]]:
    emit_files(plan, "torchrun", folder)
    report = folder / "report"
    done = torchrun(folder / "train_fitplan.py", "--model", str(model_dir), "--from-config", "--steps", "2",
                    "--report", str(report), ranks=ranks)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    reports = [json.loads((report / f"rank{rank}.json").read_text()) for rank in range(ranks)]
    return reports, [float(x) for x in re.findall(r"loss (\S+)", done.stdout)]


def stage_saved_bytes(plan, global_batch: int = GLOBAL_BATCH) -> tuple[list[StageActivations], list[int]]:
    """Per global stage, the lowering's saved bytes of one micro-batch (the loss's as freed by an input step on the
    last stage); per pipeline rank, the most its plan's moments hold of them (`moment_bytes`)."""
    config = plan_config(plan)
    graph = plan_graph(plan, config)
    slices = rank_slices(graph, Workload(seq_len=SEQ_LEN, global_batch=global_batch), config)
    stages: dict[int, StageActivations] = {}
    for slice_ in slices:
        for local, stage in enumerate(slice_.stages):
            sub = slice_.stage_graphs[local]
            loss = sum(node.cost().saved(config.micro_batch, SEQ_LEN, 1) for node in sub.nodes()
                       if node.role is Role.LOSS)
            stages[stage] = StageActivations(saved=saved_activation_bytes(sub, rank_config(config, slice_,
                                                                                           stage=local),
                                                                          seq_len=SEQ_LEN), freed_by_input=loss)
    per_rank = [moment_bytes(slice_.moments, [stages[s] for s in slice_.stages]) for slice_ in slices]
    return [stages[s] for s in sorted(stages)], per_rank


def moment_bytes(moments, stages: list[StageActivations]) -> int:
    """The most bytes a rank holds just after one of its forwards: the running stage's, plus per local stage its
    other micro-batches' (after an input step, less what it freed)."""
    return max(stages[moment.stage].saved + sum(f * stage.saved + a * (stage.saved - stage.freed_by_input)
                                                for f, a, stage in zip(moment.full, moment.after_input, stages,
                                                                       strict=True))
               for moment in moments if moment.forward)


def check_run(plan, reports: list[dict], losses: list[float]) -> None:
    d = plan.decisions
    ranks = stage_ranks(d.pp_schedule, d.pp, d.pp_virtual)
    assert [r["stages"] for r in reports] == [[s for s, r in enumerate(ranks) if r == rank] for rank in range(d.pp)]
    assert len(losses) == 2 and all(math.isfinite(x) and 5 < x < 7 for x in losses)  # ln(512) = 6.24 at random
    assert reports[0]["grad_norms"] == pytest.approx(reports[1]["grad_norms"])  # one global norm over the stages
    stages, priced = stage_saved_bytes(plan)
    measured = tuple(r["held_saved_peak_bytes"] for r in reports)
    assert measured == held_activation_bytes(d.pp_schedule, d.pp, d.grad_accum, v=d.pp_virtual, stages=stages)
    assert [r["held_saved_left_bytes"] for r in reports] == [0] * d.pp  # the peak is a steady state
    assert list(measured) == priced
    moments = rank_moments(d.pp_schedule, d.pp, d.grad_accum, v=d.pp_virtual)
    assert [rank.in_flight for rank in plan.estimate.pipeline.ranks] == [sets_in_flight(m) for m in moments]
    for report, rank in zip(reports, plan.estimate.pipeline.ranks, strict=True):
        assert report["param_bytes"] == rank.memory.parameters
        assert report["optimizer_bytes"] == rank.memory.optimizer_states


FAST = [(Schedule.ONE_F_ONE_B, {}), (Schedule.ZBV, {})]
SLOW = [(Schedule.GPIPE, {}), (Schedule.INTERLEAVED_1F1B, {}), (Schedule.INTERLEAVED_ZB, {}),
        (Schedule.ONE_F_ONE_B, {"checkpoint": "full"}), (Schedule.INTERLEAVED_1F1B, {"checkpoint": "selective"}),
        (Schedule.ONE_F_ONE_B, {"precision": ("bf16-mixed",)}), (Schedule.ZBV, {"precision": ("bf16",)})]


def case_id(value: object) -> str:
    if not isinstance(value, dict):
        return str(value)
    return "-".join(str(v[0] if isinstance(v, tuple) else v) for v in value.values()) or "plain"


@pytest.mark.distributed
@pytest.mark.parametrize(("schedule", "pins"), [*FAST, *(pytest.param(*c, marks=pytest.mark.slow) for c in SLOW)],
                         ids=case_id)
def test_emitted_pipeline_holds_the_activations_the_plan_prices(schedule, pins, model_dir, tmp_path):
    plan = pipeline_plan(model_dir, schedule, **pins)
    d = plan.decisions
    assert (d.pp, d.pp_schedule, d.micro_batch, d.grad_accum, d.dp) == (2, schedule, MICRO_BATCH, 4, 1)
    assert {str(m) for m in d.checkpoint} == {pins.get("checkpoint", "none")}
    assert str(d.precision) == pins.get("precision", ("fp32",))[0]  # fp32: the CPU plan's own choice
    assert "torchrun" in plan.launchers
    reports, losses = run_script(plan, model_dir, tmp_path / "out")
    check_run(plan, reports, losses)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("schedule", [Schedule.ONE_F_ONE_B, Schedule.ZBV], ids=str)
def test_data_parallel_pipeline_replicas_average_their_gradients(schedule, model_dir, tmp_path):
    """pp=2 x dp=2 on four processes: each stage in DDP over its data-parallel group (1F1B), or its gradients
    averaged after the step (ZB-V's split backward, which DDP's reducer does not follow); the replicas see different
    tokens, so one gradient norm on all four ranks means the gradients were averaged. Each replica holds what the
    plan prices for its pipeline rank."""
    plan = solve(str(model_dir), "4xCPU", seq_len=SEQ_LEN, global_batch=2 * GLOBAL_BATCH, time_limit=5, pp=2, tp=1,
                 pp_schedule=schedule, micro_batch=MICRO_BATCH, engine="ddp", launcher="torchrun")
    assert (plan.decisions.pp, plan.decisions.dp, plan.decisions.grad_accum) == (2, 2, 4)
    reports, losses = run_script(plan, model_dir, tmp_path / "out", ranks=4)
    assert len(losses) == 2 and len({tuple(r["grad_norms"]) for r in reports}) == 1
    first = [r["losses"][0] for r in reports if r["losses"]]  # the two replicas' last stages: different data
    assert len(first) == 2 and first[0] != first[1]
    stages, _ = stage_saved_bytes(plan, global_batch=2 * GLOBAL_BATCH)
    held = held_activation_bytes(schedule, 2, 4, v=plan.decisions.pp_virtual, stages=stages)
    assert [r["held_saved_peak_bytes"] for r in reports] == [held[0], held[0], held[1], held[1]]  # pp outermost


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("schedule", [Schedule.ONE_F_ONE_B, Schedule.ZBV], ids=str)
def test_tensor_parallel_stages_hold_the_plan_and_train_as_one_rank_per_stage(schedule, model_dir, tmp_path):
    """pp=2 x tp=2 on four processes (DTensor TP inside each stage, the tied head's shards summed with the
    embedding's): every rank holds the saved bytes the plan prices for its pipeline rank at tp=2, and the
    parameters and AdamW states of its shards; the losses and the global gradient norm equal the tp=1 pipeline's."""
    plan = solve(str(model_dir), "4xCPU", seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, time_limit=5, pp=2, tp=2,
                 pp_schedule=schedule, micro_batch=MICRO_BATCH, sequence_parallel="off", launcher="torchrun")
    d = plan.decisions
    assert (d.pp, d.tp, d.dp, d.grad_accum, d.sequence_parallel) == (2, 2, 1, 4, False)
    reports, losses = run_script(plan, model_dir, tmp_path / "tp2", ranks=4)
    stages, _ = stage_saved_bytes(plan)
    held = held_activation_bytes(schedule, 2, 4, v=d.pp_virtual, stages=stages)
    assert [r["held_saved_peak_bytes"] for r in reports] == [held[0], held[0], held[1], held[1]]  # pp outermost
    ranks = plan.estimate.pipeline.ranks
    assert [r["param_bytes"] for r in reports] == [ranks[i // 2].memory.parameters for i in range(4)]
    assert [r["optimizer_bytes"] for r in reports] == [ranks[i // 2].memory.optimizer_states for i in range(4)]
    # run at the same split (the script draws each stage's weights from its own seed)
    tp1 = pipeline_plan(model_dir, schedule)
    tp1 = replace(tp1, decisions=replace(tp1.decisions, pp_split=d.pp_split))
    single, single_losses = run_script(tp1, model_dir, tmp_path / "tp1")
    assert losses == single_losses
    assert all(r["grad_norms"] == pytest.approx(single[0]["grad_norms"], rel=1e-5) for r in reports)


@pytest.mark.distributed
def test_pipeline_stages_load_the_checkpoint_and_compute_the_models_loss(tmp_path):
    """Stages read their own tensors from the safetensors checkpoint (a tied head from the embedding) and together
    compute the whole model's loss: the first step's printed loss equals transformers' loss of the same tokens."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {**tiny_values("llama"), "num_hidden_layers": 4}
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    assert config.tie_word_embeddings
    model.save_pretrained(tmp_path / "model")
    plan = pipeline_plan(tmp_path / "model", Schedule.ONE_F_ONE_B)
    emit_files(plan, "torchrun", tmp_path / "out")
    done = torchrun(tmp_path / "out" / "train_fitplan.py", "--model", str(tmp_path / "model"), "--steps", "1",
                    ranks=RANKS)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    printed = float(re.findall(r"loss (\S+)", done.stdout)[0])
    # the script's tokens for data-parallel rank 0 (`pipeline_batches`), in the schedule's micro-batches
    ids = torch.randint(0, 512, (MICRO_BATCH * 4, SEQ_LEN), generator=torch.Generator().manual_seed(1000))
    with torch.no_grad():
        expected = sum(model(input_ids=chunk, labels=chunk).loss.item() for chunk in ids.chunk(4)) / 4
    assert printed == pytest.approx(expected, abs=1e-4)


def test_registry_runs_torchrun_pipelines_and_names_what_it_refuses():
    from costmodels import Config, Engine, Precision
    from solver.plan.capability import unsupported

    pipe = {"pp": 2, "grad_accum": 4, "engine": Engine.DDP, "zero": 0}
    assert unsupported("torchrun", Config(**pipe)) == []
    assert unsupported("torchrun", Config(**pipe, dp=2)) == []  # DDP over each stage's data-parallel group
    assert unsupported("torchrun", Config(**pipe, dp=2, pp_schedule=Schedule.ZBV, pp_virtual=2)) == []
    assert unsupported("torchrun", Config(**pipe, tp=2)) == []  # DTensor TP inside the stages
    refused = {"sequence parallelism inside pipeline stages": Config(**pipe, tp=2, sequence_parallel=True),
               "tensor parallelism with DDP": Config(**pipe, tp=2, dp=2),
               "FSDP2 with pipeline parallelism": Config(**{**pipe, "engine": Engine.FSDP2, "zero": 2}),
               "fp16-mixed with pipeline parallelism": Config(**pipe, precision=Precision.FP16_MIXED),
               "context parallelism": Config(**pipe, cp=2)}
    for reason, config in refused.items():
        assert any(reason in p for p in unsupported("torchrun", config)), (reason, unsupported("torchrun", config))


def test_pipeline_of_a_model_the_script_cannot_cut_is_refused(tmp_path):
    # Gemma 2 scales its embeddings inside the decoder: a stage fed hidden states would scale them again.
    model = write_config(tmp_path / "gemma2", tiny_values("gemma2"))
    plan = solve(str(model), f"{RANKS}xCPU", seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH, time_limit=5, pp=2,
                 micro_batch=MICRO_BATCH)
    assert "torchrun" not in plan.launchers
    with pytest.raises(FitplanError, match="cuts stages from"):
        emit_files(plan, "torchrun", tmp_path / "out")


@pytest.fixture(scope="module")
def script(tmp_path_factory, model_dir):
    """The emitted pipeline script's namespace (its functions share the PLAN dict, which a test may edit)."""
    import runpy

    folder = tmp_path_factory.mktemp("pipeline-script")
    emit_files(pipeline_plan(model_dir, Schedule.ONE_F_ONE_B), "torchrun", folder)
    return runpy.run_path(str(folder / "train_fitplan.py"), run_name="fitplan_emitted")


@pytest.mark.parametrize("arch", [*flagged("pipeline_stages"), "gemma2"])
def test_stages_cut_from_a_checkpoint_compose_to_the_whole_model(arch, script, tmp_path):
    """The script's two stages (its own `stage_model` and `StageModule`, loading the checkpoint by name) give the
    whole model's logits for every architecture it cuts (the architecture table's `pipeline_stages`); Gemma 2,
    which it refuses, scales the embeddings inside the decoder, so its second stage would scale hidden states
    again: the control that shows the check can fail."""
    import argparse

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {**tiny_values(arch), "num_hidden_layers": 4}
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    attention = "eager" if arch == "gemma2" else "sdpa"  # transformers 5.24 runs Gemma 2 eagerly only
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention).eval()
    model.save_pretrained(tmp_path / arch)
    plan = script["PLAN"]
    listed = type(model).__name__ in plan["pipeline"]["architectures"]
    assert listed == (arch != "gemma2")
    plan["pipeline"]["architectures"].append(type(model).__name__)
    plan["decisions"]["attention"], planned = attention, plan["decisions"]["attention"]
    try:
        args = argparse.Namespace(model=str(tmp_path / arch), from_config=False)
        stages = [script["stage_model"](args, s, torch.device("cpu"))[0].eval() for s in (0, 1)]
    finally:
        plan["pipeline"]["architectures"].pop()
        plan["decisions"]["attention"] = planned
    ids = torch.randint(0, 512, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = script["StageModule"](stages[0], first=True, last=False)(ids)
        logits = script["StageModule"](stages[1], first=False, last=True)(hidden)
        whole = model(input_ids=ids).logits
    assert torch.allclose(logits, whole, atol=1e-5) == listed


@pytest.mark.distributed
@pytest.mark.slow
def test_fitplan_check_runs_a_pipeline_plan_and_every_row_is_exact(model_dir, tmp_path):
    """`fitplan check` runs a pipeline plan on pp processes and compares each pipeline rank's parameters,
    optimizer states and held saved activations with the plan: every byte row exact on CPU."""
    from solver.hardware.check import check_plan

    plan = pipeline_plan(model_dir, Schedule.ZBV)
    (tmp_path / "plan.json").write_text(json.dumps(plan.to_json()))
    report = check_plan(tmp_path / "plan.json", steps=2, device="cpu")
    assert report.ranks == RANKS
    rows = [row for row in report.rows if row.exact]
    assert len(rows) == 3 * RANKS and all(row.measured == row.estimated for row in rows), rows
