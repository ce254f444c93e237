"""Human output: rich tables, a memory bar per GPU, the time breakdown and the alternatives.

Rendering only; every number comes from the plan or estimate it is given.
"""

from __future__ import annotations

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from costmodels import Estimate
from costmodels.verdict import Verdict, fits
from solver.plan.advice import memory_savers
from solver.plan.capability import engine_setting
from solver.plan.record import Plan

GIB = 2**30
_COLORS = {"parameters": "cyan", "gradients": "magenta", "optimizer states": "yellow", "activations": "green",
           "temporary": "red", "allocator + overhead": "grey50", "free": "grey23"}


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def _capital(sentence: str) -> str:
    return sentence[:1].upper() + sentence[1:]


def memory_parts(estimate: Estimate) -> list[tuple[str, int]]:
    m = estimate.memory
    return [("parameters", m.parameters), ("gradients", m.gradients), ("optimizer states", m.optimizer_states),
            ("activations", m.activations), ("temporary", m.temporary),
            ("allocator + overhead", m.device_peak - m.allocated_peak)]


def memory_bar(estimate: Estimate, capacity: int, width: int = 60) -> Text:
    """One bar per GPU: each category's share of the device memory, then what is left free."""
    bar = Text()
    used = 0
    for name, nbytes in memory_parts(estimate):
        cells = round(width * nbytes / capacity) if capacity else 0
        bar.append("█" * cells, style=_COLORS[name])
        used += cells
    bar.append("░" * max(0, width - used), style=_COLORS["free"])
    return bar


def memory_table(estimate: Estimate, capacity: int, verdict: Verdict | None = None) -> Table:
    table = Table(title="Memory per GPU (binary GiB)", show_edge=False)
    table.add_column("category")
    table.add_column("GiB", justify="right")
    for name, nbytes in memory_parts(estimate):
        table.add_row(Text(name, style=_COLORS[name]), f"{nbytes / GIB:.2f}")
    m = estimate.memory
    table.add_row("allocated peak", f"{m.allocated_peak / GIB:.2f}", style="bold")
    table.add_row("reserved peak (caching allocator)", f"{m.reserved_peak / GIB:.2f}")
    table.add_row("device peak (reserved + context/NCCL)", f"{m.device_peak / GIB:.2f}", style="bold")
    table.add_row("device capacity", f"{capacity / GIB:.2f}")
    if verdict is not None:
        table.add_row(f"usable (less {verdict.headroom * 100:g}% headroom)", f"{verdict.usable / GIB:.2f}")
    if m.cpu_bytes_per_node:
        table.add_row("host RAM per node (offload)", f"{m.cpu_bytes_per_node / GIB:.2f}")
    if m.nvme_bytes_per_node:
        table.add_row("NVMe per node (offload)", f"{m.nvme_bytes_per_node / GIB:.2f}")
    return table


def time_table(estimate: Estimate) -> Table:
    t = estimate.time
    table = Table(title="Time per optimizer step", show_edge=False)
    table.add_column("part")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    for name, seconds in (("compute", t.compute), ("recompute", t.recompute),
                          ("communication (exposed)", t.communication), ("offload", t.offload),
                          ("optimizer step", t.optimizer)):
        table.add_row(name, f"{seconds:.3f}", f"{seconds / t.step_time:.0%}" if t.step_time else "-")
    table.add_row("step", f"{t.step_time:.3f}", "100%", style="bold")
    table.add_row("communication (total, incl. hidden)", f"{t.communication_total:.3f}", "")
    table.add_row("tokens/s (cluster)", f"{estimate.tokens_per_second:,.0f}", "")
    table.add_row("MFU", f"{estimate.mfu:.1%}", "")
    return table


def decisions_table(plan: Plan) -> Table:
    d = plan.decisions
    table = Table(title="Plan", show_header=False, show_edge=False)
    table.add_column("knob", style="bold")
    table.add_column("value")
    modes = {m: sum(c.value == m for c in d.checkpoint) for m in ("none", "selective", "op_selective", "full")}
    op_level = f", op-level selective {modes['op_selective']}" if modes["op_selective"] else ""
    share = f" ({d.optimizer_offload_fraction:.0%} of its states)" if d.optimizer_offload_fraction != 1 else ""
    rows = [
        ("model", f"{plan.inputs.model} ({plan.inputs.model_source})"),
        ("cluster", f"{plan.inputs.cluster.nodes}x{plan.inputs.cluster.gpus_per_node} {plan.inputs.cluster.gpu_name}"),
        ("workload", f"seq {plan.inputs.seq_len}, {plan.inputs.global_batch} sequences/step "
                     f"({plan.inputs.tokens_per_step:,} tokens)"),
        ("parallelism", d.layout() + (" +sequence-parallel" if d.sequence_parallel else "")),
        ("engine", engine_setting(d.engine, d.zero)),
        ("offload", f"optimizer={d.optimizer_offload}{share} params={d.param_offload}"),
        ("batch", f"micro-batch {d.micro_batch} x grad-accum {d.grad_accum} x dp {d.dp}"),
        ("checkpointing", f"full {modes['full']}, selective {modes['selective']}{op_level}, none {modes['none']} "
                          f"of {len(d.checkpoint)} layers (first layers first)"),
        ("precision / optimizer", f"{d.precision} / {d.optimizer}"),
        ("memory savers", ", ".join(memory_savers(d)) or "none"),
        ("LoRA", f"r={d.lora.rank} alpha={d.lora.alpha} targets={','.join(d.lora.targets)}" if d.lora else "no"),
        ("launchers", ", ".join(plan.launchers) or "none as emitted"),
        ("solver", plan.solver.summary()),
    ]
    for knob, value in rows:
        table.add_row(knob, value)
    return table


def alternatives_table(plan: Plan) -> Table:
    table = Table(title="Next-best alternatives", show_edge=False)
    table.add_column("configuration")
    table.add_column("step s", justify="right")
    table.add_column("device GiB", justify="right")
    table.add_column("why it loses")
    for alt in plan.alternatives:
        table.add_row(alt.decisions, f"{alt.step_time:.3f}" if alt.step_time else "-",
                      f"{alt.device_peak / GIB:.1f}", alt.why)
    return table


def render_plan(plan: Plan, console: Console) -> None:
    capacity = plan.inputs.cluster.gpu_memory_bytes
    verdict = fits(plan.estimate, capacity, plan.inputs.headroom)
    parts = [decisions_table(plan), Text(""), Text(_capital(verdict.sentence), style="bold"),
             Text("Memory bar per GPU (of device memory):"),
             memory_bar(plan.estimate, capacity), memory_table(plan.estimate, capacity, verdict), Text(""),
             time_table(plan.estimate), Text(""), alternatives_table(plan), Text(f"Binding: {plan.binding}")]
    if plan.post_training is not None:
        from solver.cli.post_render import post_training_lines

        parts += [Text(""), *post_training_lines(plan.post_training)]
    if plan.advice:
        parts.append(Text("Guide methods: " + " | ".join(plan.advice)))
    parts.append(Text("Assumed: " + "; ".join(plan.inputs.assumed + plan.inputs.cluster.assumptions), style="dim"))
    console.print(Panel(Group(*parts), title="fitplan"))


def render_estimate(estimate: Estimate, verdict: Verdict, console: Console, *, title: str) -> None:
    """The verdict (the same rule `solve` fits its plans to), then where the memory and the time go."""
    capacity = verdict.capacity
    line = Text(f"{_capital(verdict.sentence)}; allocated peak {gib(estimate.memory.allocated_peak)} at "
                f"{estimate.memory.peak_at}", style="bold green" if verdict.fits else "bold red")
    console.print(Panel(Group(line, memory_bar(estimate, capacity), memory_table(estimate, capacity, verdict),
                              Text(""),
                              time_table(estimate), Text("Notes: " + "; ".join(estimate.notes), style="dim")),
                        title=title))
