"""`fitplan check plan.json`: run the plan's own emitted torchrun script for a few steps on this machine (random
weights from the model's config, a synthetic batch of the planned shape) and set what it measures beside the plan's
estimate. On CPU (gloo) the state and saved-activation bytes must equal the estimate's exactly."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from costmodels import Config, Offload, Workload, activation_offload, shared_lowering
from costmodels.activations import evaluate
from costmodels.config import Loss
from costmodels.knobs import declared
from costmodels.lowering import liger_lowering
from costmodels.memory import memory_terms
from costmodels.pipeline import StageActivations, held_activation_bytes
from costmodels.pipeline_stages import rank_config, rank_slices
from costmodels.states import model_states
from costmodels.terms import ModelStates
from graphs import Checkpoint, FitplanError, LayerGraph, LoraSpec, Role, resolve
from graphs.lowering import lower_resolved
from solver.hardware.limits import MAX_CPU_RANKS
from solver.plan.record import Plan, load_plan

# A few steps of a real model on GPUs take minutes (model build, NCCL set-up); beyond this the run is stuck.
RUN_TIMEOUT = 1800


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One measured quantity beside the plan's estimate (bytes or seconds)."""

    name: str
    measured: float
    estimated: float
    unit: str
    """"bytes" or "s"."""
    exact: bool
    """True when the two must be equal (state and saved-activation bytes on CPU)."""

    @property
    def error(self) -> float:
        """(measured - estimated) / estimated; 0 when both are 0."""
        if self.estimated == 0:
            return 0.0 if self.measured == 0 else float("inf")
        return (self.measured - self.estimated) / self.estimated


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckReport:
    """What `fitplan check` found: one row per quantity, for the rank with the largest shard (rank 0)."""

    plan: str
    device: str
    ranks: int
    steps: int
    rows: tuple[Row, ...]

    @property
    def exact_ok(self) -> bool:
        """True when every row that must be exact is."""
        return all(row.measured == row.estimated for row in self.rows if row.exact)

    def to_json(self) -> dict[str, object]:
        return {"plan": self.plan, "device": self.device, "ranks": self.ranks, "steps": self.steps,
                "exact_ok": self.exact_ok,
                "rows": [{"name": r.name, "measured": r.measured, "estimated": r.estimated, "unit": r.unit,
                          "error": r.error, "exact": r.exact} for r in self.rows]}


def check_plan(path: Path, *, steps: int = 5, device: str = "auto", nproc: int | None = None,
               validate: Callable[[Plan], object] | None = None) -> CheckReport:
    """Run the plan at `path` for `steps` steps on `nproc` local ranks and compare with its estimate; `validate`
    (the CLI's check against the plan's model and cluster) runs after the rank checks and before any process."""
    import torch

    plan = load_plan(path)
    if plan.post_training is not None:
        raise FitplanError(f"{path} plans TRL's {plan.post_training.task} trainer; check runs the plan's torchrun "
                           "script, a supervised step with none of the task's reference, loss or generation.",
                           "Run the emitted hf files (TRL's trainer) and compare with `fitplan estimate --config "
                           f"{path}`, which prices the task's step as solve did.")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    ranks = _ranks(plan, device, nproc, steps)  # before any lowering: an edited dp is refused at once
    if validate is not None:
        validate(plan)
    with tempfile.TemporaryDirectory(prefix="fitplan-check-") as folder:
        reports = run_plan(plan, Path(folder), device=device, ranks=ranks, steps=steps)
    return CheckReport(plan=str(path), device=device, ranks=ranks, steps=steps,
                       rows=tuple(compare(plan, reports, device=device)))


def _ranks(plan: Plan, device: str, nproc: int | None, steps: int) -> int:
    import torch

    d = plan.decisions
    world = d.tp * d.cp * d.pp * d.dp
    if steps < 1:
        raise FitplanError(f"--steps {steps} must be at least 1.", "e.g. --steps 5")
    if plan.inputs.cluster.nodes > 1:
        raise FitplanError(f"The plan spans {plan.inputs.cluster.nodes} nodes; check runs one node.",
                           "Check a one-node plan of the same model (e.g. solve --gpus 8xH100).")
    if nproc is not None and nproc != world:
        raise FitplanError(f"--nproc {nproc}: the plan runs tp={d.tp} x cp={d.cp} x pp={d.pp} x dp={d.dp} = "
                           f"{world} ranks.", "Check runs the plan as planned: one process per rank.")
    if device == "cpu" and world > MAX_CPU_RANKS:  # one process per rank: refuse before starting any
        raise FitplanError(f"The plan runs tp={d.tp} x cp={d.cp} x pp={d.pp} x dp={d.dp} = {world:,} ranks; a CPU "
                           f"check starts at most {MAX_CPU_RANKS} processes.",
                           f"Check a plan of at most {MAX_CPU_RANKS} GPUs on CPU, or run it on its GPUs.")
    if device == "cuda" and torch.cuda.device_count() < world:
        raise FitplanError(f"The plan needs {world} GPUs; this machine has {torch.cuda.device_count()}.",
                           "Plan for the local GPUs (--gpus auto) or check on CPU with --device cpu.")
    if device not in ("cuda", "cpu"):
        raise FitplanError(f"--device {device!r} must be cpu, cuda or auto.", "e.g. --device cpu")
    return world


def run_plan(plan: Plan, folder: Path, *, device: str, ranks: int, steps: int) -> list[dict]:
    """Emit the plan's torchrun script into `folder`, run it on `ranks` processes, return each rank's report."""
    from solver.plan.launchers import emit

    model_dir = folder / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(resolve(plan.inputs.model).as_dict()))
    for name, text in emit(plan, "torchrun").items():
        (folder / name).write_text(text)
    report = folder / "report"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    if device == "cpu":  # gloo on CPU even where GPUs exist; one thread per rank on shared cores
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               str(folder / "train_fitplan.py"), "--model", str(model_dir), "--from-config", "--steps", str(steps),
               "--report", str(report)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False)
    except subprocess.TimeoutExpired as error:
        raise FitplanError(f"The plan's run did not finish in {RUN_TIMEOUT} s.", "Try fewer --steps.") from error
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-2000:]
        raise FitplanError(f"The plan's torchrun script failed (exit {done.returncode}):\n{tail}",
                           "An out-of-memory error here means the plan does not fit this machine.")
    return [json.loads((report / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def plan_config(plan: Plan) -> Config:
    """The costmodels configuration a plan's decisions describe."""
    return Config(**{name: getattr(plan.decisions, name) for name in declared(Config)})


def plan_graph(plan: Plan, config: Config) -> LayerGraph:
    """The plan's model lowered as its configuration runs it (cached after the first time)."""
    lora = plan.decisions.lora
    spec = None if lora is None else LoraSpec(rank=lora.rank, alpha=lora.alpha, targets=lora.targets,
                                              dropout=lora.dropout)
    dtype, autocast = shared_lowering(config, lora=spec is not None)
    return lower_resolved(resolve(plan.inputs.model), dtype=dtype, autocast=autocast,
                          attention=plan.decisions.attention, lora=spec,
                          op_selective=Checkpoint.OP_SELECTIVE in plan.decisions.checkpoint,
                          liger=liger_lowering(config))


def saved_activation_bytes(graph: LayerGraph, config: Config, *, seq_len: int, savers: bool = False) -> int:
    """Bytes autograd saves in one micro-batch's forward, as saved-tensor hooks see them: every node's saved
    tensors in its mode, plus the tensors layers share (rotary tables), seen once when some layer is not
    checkpointed whole (a whole checkpointed layer keeps them in its recompute closure, outside the hooks; selective
    recompute checkpoints only the attention core, after the rotary multiplications). With `savers`, each node's
    bytes come from `memory_terms`, which replaces the configured loss's and the offloaded nodes' own (what stays on
    the device)."""
    modes = iter(config.layer_modes(len(graph.decoder_layers())))
    shape = {"b": config.micro_batch, "s": seq_len, "tp": config.tp, "sequence_parallel": config.sequence_parallel}
    priced = iter(memory_terms(graph, Workload(seq_len=seq_len, global_batch=config.micro_batch), config).nodes) \
        if savers else None
    total, any_plain = 0, False
    for node in graph.nodes():
        mode = next(modes) if node.role is Role.DECODER else Checkpoint.NONE
        any_plain |= node.role is Role.DECODER and mode in (Checkpoint.NONE, Checkpoint.SELECTIVE)
        total += dict(next(priced))[mode].saved if priced else evaluate(node.cost(mode).saved, **shape)
    return total + (evaluate(graph.shared, **shape) if any_plain else 0)


def pipeline_held_bytes(plan: Plan, config: Config, graph: LayerGraph) -> tuple[int, ...]:
    """Per pipeline rank, the peak bytes autograd holds over one step of the plan's schedule, as saved-tensor hooks
    see them: `held_activation_bytes` in torch's action order, fed per global stage with its slice's saved bytes of
    one micro-batch (`saved_activation_bytes`), the loss's being what a zero-bubble input step frees."""
    workload = Workload(seq_len=plan.inputs.seq_len, global_batch=plan.inputs.global_batch)
    stages: dict[int, StageActivations] = {}
    for slice_ in rank_slices(graph, workload, config):
        for local, stage in enumerate(slice_.stages):
            sub, own = slice_.stage_graphs[local], rank_config(config, slice_, stage=local)
            loss = sum(evaluate(node.cost().saved, b=config.micro_batch, s=plan.inputs.seq_len, tp=config.tp,
                                sequence_parallel=config.sequence_parallel)
                       for node in sub.nodes() if node.role is Role.LOSS)
            stages[stage] = StageActivations(saved=saved_activation_bytes(sub, own, seq_len=plan.inputs.seq_len),
                                             freed_by_input=loss)
    return held_activation_bytes(config.pp_schedule, config.pp, config.grad_accum, v=config.pp_virtual,
                                 stages=[stages[s] for s in sorted(stages)])


def _pipeline_rows(plan: Plan, reports: list[dict], *, cpu: bool) -> list[Row]:
    """Per pipeline rank (the first replica's ranks: the pipeline is the outermost dimension), its parameters,
    optimizer states and the saved bytes its stages held at the step's peak."""
    config = plan_config(plan)
    held = pipeline_held_bytes(plan, config, plan_graph(plan, config))
    rows = []
    for rank, priced in enumerate(plan.estimate.pipeline.ranks):
        report = reports[rank * config.tp * config.cp * config.dp]
        rows += [Row(name=f"pipeline rank {rank}: parameters", measured=report["param_bytes"],
                     estimated=priced.memory.parameters, unit="bytes", exact=cpu),
                 Row(name=f"pipeline rank {rank}: optimizer states", measured=report["optimizer_bytes"],
                     estimated=priced.memory.optimizer_states, unit="bytes", exact=cpu),
                 Row(name=f"pipeline rank {rank}: held saved activations", measured=report["held_saved_peak_bytes"],
                     estimated=held[rank], unit="bytes", exact=cpu)]
    return rows


def compare(plan: Plan, reports: list[dict], *, device: str) -> list[Row]:
    """Rows for rank 0 (the largest FSDP shard), or per pipeline rank; step time is the slowest rank's median after
    the first step."""
    memory, first = plan.estimate.memory, reports[0]
    cpu = device == "cpu"
    if plan.decisions.pp > 1:
        return [*_pipeline_rows(plan, reports, cpu=cpu), _step_row(plan, reports)]
    config = plan_config(plan)
    graph = plan_graph(plan, config)
    # the chunked loss's and offload's own saved bytes (memory_terms), not the plain lowering's
    saved = saved_activation_bytes(graph, config, seq_len=plan.inputs.seq_len,
                                   savers=config.loss is Loss.CHUNKED or config.activation_offload)
    states, where = stored_states(graph, config)
    rows = [Row(name=f"parameters{where}", measured=first["param_bytes"], estimated=states.params, unit="bytes",
                exact=cpu),
            # what a backward leaves in .grad (not DDP's flat reduce buckets, nor the part landed by the peak)
            Row(name=f"gradients{where}", measured=first["grad_bytes"], estimated=states.accumulating_grads,
                unit="bytes", exact=cpu),
            Row(name=f"optimizer states{where}", measured=first["optimizer_bytes"],
                estimated=states.master + states.optimizer, unit="bytes", exact=cpu),
            # the chunked loss also saves 0-dim scalars (each chunk's total_weight, the token count) fitplan omits
            Row(name="saved activations (one micro-batch)", measured=first["saved_activation_bytes"],
                estimated=saved, unit="bytes", exact=cpu and config.loss is not Loss.CHUNKED)]
    if config.activation_offload and first.get("offloaded_activation_bytes") is not None:
        # the hooks copy each saved tensor: a tensor saved twice (the final norm's input) moves twice, and the
        # token ids move too, which the priced transfer leaves out
        moved = sum(activation_offload.moved_bytes(graph, config, b=config.micro_batch, s=plan.inputs.seq_len))
        rows.append(Row(name="activations offloaded to the host (one micro-batch)",
                        measured=first["offloaded_activation_bytes"], estimated=moved, unit="bytes", exact=False))
    if first.get("peak_allocated_bytes") is not None:
        rows += [Row(name="peak allocated", measured=max(r["peak_allocated_bytes"] for r in reports),
                     estimated=memory.allocated_peak, unit="bytes", exact=False),
                 Row(name="peak reserved", measured=max(r["peak_reserved_bytes"] for r in reports),
                     estimated=memory.reserved_peak, unit="bytes", exact=False)]
    rows.append(_step_row(plan, reports))
    return rows


def stored_states(graph: LayerGraph, config: Config) -> tuple[ModelStates, str]:
    """Rank 0's parameter, gradient and optimizer-state bytes wherever they live, and where that is in words. The
    script counts a tensor's bytes on whichever device holds it; an offloaded plan keeps the same shards on the host
    (FSDP2's CPUOffloadPolicy), which the device breakdown prices at 0 bytes. So the states are those of the same
    configuration kept on the device, and the rows say they are on the host."""
    if config.optimizer_offload is Offload.NONE and config.param_offload is Offload.NONE:
        return model_states(graph, config), ""
    on_device = replace(config, optimizer_offload=Offload.NONE, optimizer_offload_fraction=1.0,
                        param_offload=Offload.NONE)
    return model_states(graph, on_device), " (on the host)"


def _step_row(plan: Plan, reports: list[dict]) -> Row:
    timed = [r["step_seconds"][1:] or r["step_seconds"] for r in reports]  # the first step warms up
    return Row(name="step time", measured=max(statistics.median(t) for t in timed),
               estimated=plan.estimate.time.step_time, unit="s", exact=False)


def check_lines(report: CheckReport) -> list[str]:
    """The report as text lines: one per quantity, measured beside estimated with the error."""
    lines = [f"Checked {report.plan}: {report.steps} steps on {report.ranks} {report.device} rank(s) "
             "(random weights, synthetic batch); rank 0 shown, step time of the slowest rank"]
    for row in report.rows:
        exact = (" exact" if row.measured == row.estimated else " DIFFERS") if row.exact else ""
        lines.append(f"  {row.name:<36} measured {_amount(row.measured, row.unit):>14}   estimated "
                     f"{_amount(row.estimated, row.unit):>14}   error {row.error:+8.1%}{exact}")
    if report.device == "cpu":
        lines.append("  (CPU: bytes must match exactly; peaks are CUDA-only, and step time on CPU says nothing "
                     "about GPUs)")
    return lines


def _amount(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value:.4f} s"
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value:,.0f} B"
