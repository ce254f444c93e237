"""The work behind the CLI commands that is not solving: emitting files, plotting, reports, listings."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import ValidationError
from rich.console import Console

from costmodels import Cluster, Estimate, load_gpus
from costmodels.verdict import DEFAULT_HEADROOM, Verdict, fits
from graphs import FitplanError, MalformedConfig, catalog_ids, load_entry
from graphs.files import check_depth, parse_json, parse_yaml, read_text
from graphs.lora import LoraSpec
from solver.plan.record import Plan
from solver.search.pins import KNOBS

if TYPE_CHECKING:
    from solver.search.post_training import PostRequest

GIB = 2**30


def emit_files(plan: Plan, emit: str, folder: Path, *, force: bool = False) -> list[Path]:
    """Write plan.json and the files of each launcher in `emit` that can run the plan into `folder`."""
    from solver.cli.outputs import Targets, launcher_names, write_outputs

    return write_outputs(plan, Targets(launchers=launcher_names(emit), emit_dir=folder), force=force).paths


@dataclass
class EstimateReport:
    estimate: Estimate
    verdict: Verdict
    """`costmodels.verdict.fits` at the requested headroom: the rule `solve` fits its plans to."""
    title: str

    @property
    def capacity(self) -> int:
        return self.verdict.capacity

    @property
    def fits(self) -> bool:
        """The device peak fits the GPU's memory less the headroom (and offloaded states fit the host)."""
        return self.verdict.fits

    def to_json(self) -> dict[str, Any]:
        from pydantic import TypeAdapter

        data = TypeAdapter(Estimate).dump_python(self.estimate, mode="json")
        data["fits"] = self.fits
        data["device_capacity_bytes"] = self.capacity
        data["verdict"] = {"sentence": self.verdict.sentence, "headroom": self.verdict.headroom,
                           "usable_bytes": self.verdict.usable, "margin_bytes": self.verdict.margin,
                           "at_risk": self.verdict.at_risk, "risk_peak_bytes": self.verdict.risk_peak}
        return data

    def render(self, console: Console) -> None:
        from solver.cli.render import render_estimate

        render_estimate(self.estimate, self.verdict, console, title=self.title)


def estimate_report(model: str, gpus: str, config_file: Path | None, flags: dict[str, Any], *, seq_len: int | None,
                    lora: LoraSpec | None = None, headroom: float | None = None,
                    cluster_options: dict[str, Any] | None = None, launcher: str | None = None,
                    post_training: PostRequest | None = None, kbit_preparation: bool = False) -> EstimateReport:
    """`lora`: the adapters of the CLI flags (over a plan's own); `launcher`: price on the lowering
    `solve --launcher` would, and refuse what that launcher cannot run; `post_training`: the TRL task's step, as
    `solve --task` prices it (a colocated vLLM engine's share is kept free beside the headroom, as `solve` keeps
    it). A plan given as the config carries its own task. `kbit_preparation`: the user's script calls PEFT's
    `prepare_model_for_kbit_training` on the 4-bit base."""
    from solver.api import cluster_from, estimate
    from solver.search.post_training import colocated_share

    cluster = cluster_from(gpus, **(cluster_options or {}))
    values = read_config_file(config_file) if config_file else dict(flags)
    plan = _as_plan(values, config_file)
    if plan is not None:  # a plan written by `solve -o` round-trips: its decisions and workload
        report = _plan_report(plan, model, gpus, cluster, seq_len=seq_len, lora=lora, launcher=launcher,
                              kbit_preparation=kbit_preparation)
        return report if headroom is None else replace(report, verdict=fits(report.estimate, cluster, headroom))
    if values.get("dp") is None:
        # the rest of the GPUs; a wrong type is reported by the Config check below, naming the field
        others = [values.get(name, 1) for name in ("tp", "pp", "cp")]
        valid = all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in others)
        values["dp"] = cluster.world_size // math.prod(others) if valid else 1
    split = values.get("pp_split")
    if split is None:
        values.pop("pp_split", None)  # the balanced split
    elif isinstance(split, str):  # --pp-split 9,10,10,3
        values["pp_split"] = tuple(part.strip() for part in split.split(",") if part.strip())
    kept = (DEFAULT_HEADROOM if headroom is None else headroom) + colocated_share(post_training)
    if kept >= 1:
        raise FitplanError(f"--headroom and the colocated vLLM share keep {kept:.0%} of each GPU: nothing is left "
                           "to train.", "Lower --vllm-gpu-memory-utilization or --headroom.")
    result = estimate(model, cluster, values, seq_len=seq_len, lora=lora, launcher=launcher,
                      post_training=post_training, kbit_preparation=kbit_preparation)
    return EstimateReport(result, fits(result, cluster, kept), _title(model, gpus, post_training))


def _title(model: str, gpus: str, post_training: PostRequest | None) -> str:
    """The report's title: model, GPUs and the post-training task with its reference."""
    if post_training is None:
        return f"{model} on {gpus}"
    return f"{model} on {gpus}, task {post_training.task} (reference {post_training.reference})"


def _as_plan(values: dict[str, Any], path: Path | None) -> Plan | None:
    """The plan in a config file written by `solve -o`, or None for a file of Config fields."""
    if not {"schema_version", "decisions"} <= set(values):
        return None
    try:
        return Plan.from_json(values)
    except ValidationError as error:
        raise MalformedConfig(f"{path} looks like a fitplan plan but is not valid: {str(error).splitlines()[0]}",
                              "Write a plan with `solve ... -o plan.json`, or give a file of Config fields.") from error


def _plan_report(plan: Plan, model: str, gpus: str, cluster: Cluster, *, seq_len: int | None,
                 lora: LoraSpec | None = None, launcher: str | None = None,
                 kbit_preparation: bool = False) -> EstimateReport:
    """The estimate of a plan's decisions on `model`/`gpus`; seq_len and adapters given as flags override it (a plan
    for a script that prepares its 4-bit base is priced so)."""
    from solver.api import estimate
    from solver.search.post_training import plan_request

    d = plan.decisions
    config = {name: getattr(d, name) for name in KNOBS}  # every knob the record declares
    kbit_preparation = kbit_preparation or (lora is None and d.lora is not None and d.lora.kbit_preparation)
    lora = lora or (None if d.lora is None else d.lora.spec())
    post_training, examples = plan_request(plan)
    result = estimate(model, cluster, config, seq_len=seq_len or plan.inputs.seq_len, global_batch=examples,
                      lora=lora, attention=d.attention, launcher=launcher, post_training=post_training,
                      kbit_preparation=kbit_preparation)
    return EstimateReport(result, fits(result, cluster, plan.inputs.headroom), _title(model, gpus, post_training))


def read_config_file(path: Path) -> dict[str, Any]:
    """A JSON or YAML object of Config fields (or a plan), from a regular file of at most 16 MiB."""
    text = read_text(path, what="configuration file")
    try:
        data = parse_yaml(text, where=str(path)) if path.suffix.lower() in (".yaml", ".yml") else \
            parse_json(text, where=str(path))
    except (RecursionError, ValueError, yaml.YAMLError) as error:
        raise MalformedConfig(f"Cannot read configuration {path}: {error}",
                              "Give a JSON or YAML object of Config fields (tp, dp, engine, zero, ...).") from error
    check_depth(data, where=str(path))
    if not isinstance(data, dict):
        raise MalformedConfig(f"{path} must hold an object of Config fields", "e.g. {\"tp\": 2, \"zero\": 3}")
    return data


def models_rows(filter_text: str) -> list[dict[str, Any]]:
    rows = []
    for model_id in catalog_ids():
        if filter_text.lower() in model_id.lower():
            entry = load_entry(model_id)
            rows.append({"id": model_id, "model_type": entry.config.get("model_type", "?"),
                         "published_params": entry.published_params})
    return rows


def gpu_rows() -> list[dict[str, Any]]:
    from solver.hardware.measure import stored_profiles

    profiles = stored_profiles()
    rows = []
    for gpu in load_gpus().values():
        bf16, fp8 = gpu.peak_flops("bf16"), gpu.peak_flops("fp8")
        rows.append({"id": gpu.id, "name": gpu.name, "aliases": list(gpu.aliases), "memory_gib": gpu.memory_bytes / GIB,
                     "bf16_tflops": bf16 / 1e12 if bf16 else None, "fp8_tflops": fp8 / 1e12 if fp8 else None,
                     "hbm_gbps": gpu.hbm_bandwidth / 1e9, "intra_node": gpu.intra_node_kind,
                     "profile": str(profiles[gpu.id]) if gpu.id in profiles else None})
    return rows


def pipeline_lines(plan: Plan) -> list[str]:
    """A pipeline plan's stages: each rank's memory and work, the bubble, and the schedules it beat."""
    p, step = plan.estimate.pipeline, plan.estimate.time.step_time
    assert p is not None
    lines = [f"Pipeline: pp={p.pp} {p.schedule}" + (f" with {p.virtual} stages per rank" if p.virtual > 1 else "")
             + f", {p.micro_batches} micro-batches per step; decoder layers per stage {list(p.stage_layers)}; "
             f"bubble {plan.estimate.time.bubble:.3f} s of the {step:.3f} s step ({p.bubble_fraction:.1%} of all "
             "ranks' time idle in the schedule)."]
    for rank in p.ranks:
        m = rank.memory
        states = m.parameters + m.gradients + m.optimizer_states
        stages = ", ".join(map(str, rank.stages))
        sets = "micro-batch(es)" if len(rank.stages) == 1 else "micro-batch stage sets"
        lines.append(f"  rank {rank.rank} (stages {stages}; {rank.layers} layers, {rank.in_flight} {sets} in flight): "
                     f"device peak {m.device_peak / GIB:.2f} GiB (activations {m.activations / GIB:.2f}, "
                     f"states {states / GIB:.2f} GiB), compute {rank.busy:.3f} s, outside the schedule "
                     f"{rank.outside:.3f} s")
    if plan.schedules:
        lines.append("Schedules and splits for this layout and recompute:")
        chosen_split = next((o.split for o in plan.schedules if o.chosen), ())
        for option in plan.schedules:
            name = option.schedule + (f" v={option.virtual}" if option.virtual > 1 else "")
            if option.schedule == p.schedule and option.virtual == p.virtual and option.split != chosen_split:
                name += f" at the FLOP-balanced split {list(option.split)}"
            if option.chosen:
                why = f"chosen: step {option.step_time:.3f} s, bubble {option.bubble:.3f} s"
            elif not option.fits:
                why = f"does not fit (device peak {option.device_peak / GIB:.2f} GiB)"
            else:
                why = (f"{option.step_time / step - 1:+.1%} step time (bubble {option.bubble:.3f} s, device peak "
                       f"{option.device_peak / GIB:.2f} GiB)")
            lines.append(f"  - {name}: {why}")
    return lines


def explain_plan(path: Path) -> list[str]:
    """Why the plan at `path` (checked against its model and cluster first) chose what it did, in lines."""
    from solver.cli.validation import load_valid_plan

    plan = load_valid_plan(path)
    d, e = plan.decisions, plan.estimate
    lines = [f"Plan for {plan.inputs.model} on {plan.inputs.cluster.spec}: {d.summary()}",
             f"Why: fastest configuration under the cost model ({plan.solver.status}; step {e.time.step_time:.3f} s, "
             f"{e.tokens_per_second:,.0f} tokens/s, MFU {e.mfu:.1%}).",
             f"Binding constraint: {plan.binding}.",
             f"Memory per GPU: device peak {e.memory.device_peak / GIB:.2f} GiB of "
             f"{plan.inputs.cluster.gpu_memory_bytes / GIB:.2f} GiB, {plan.inputs.headroom:.0%} of it kept free "
             f"(allocated {e.memory.allocated_peak / GIB:.2f} GiB at {e.memory.peak_at}).",
             f"Solver: {plan.solver.summary()}."]
    if e.pipeline is not None:
        lines += pipeline_lines(plan)
    if plan.post_training is not None:
        from solver.cli.post_render import post_training_lines

        lines += [line.plain for line in post_training_lines(plan.post_training)]
    lines.append("Alternatives:")
    lines += [f"  - {a.decisions}: {a.why}" for a in plan.alternatives] or ["  (none)"]
    if plan.advice:
        lines.append("Guide methods:")
        lines += [f"  - {item}" for item in plan.advice]
    lines.append("Assumed: " + "; ".join(plan.inputs.assumed))
    return lines
