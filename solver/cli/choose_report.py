"""Human output of `fitplan choose`: the Pareto front, the two recommendations, the minimum GPUs per type, and
the time/cost plot. Rendering only; every number comes from the `Choice` it is given."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from graphs import FitplanError
from solver.choose import Choice, Point

# Solve's diagnosis names what binds; "pins" there means no configuration survives the divisibility rules.
_BINDINGS = {"pins": "no configuration passes the pins and divisibility rules (global batch, heads)",
             "time limit": "no plan within the time limit"}


def hours_text(hours: float) -> str:
    """"45 min", "7.5 h" or "3.2 d": the unit a reader plans with."""
    if hours < 1:
        return f"{hours * 60:.0f} min"
    return f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.1f} d"


def usd_text(usd: float) -> str:
    """Whole dollars, or cents below $100."""
    return f"{usd:,.2f}" if usd < 100 else f"{usd:,.0f}"


def _label(p: Point) -> str:
    return f"{p.gpus} x {p.gpu_name}"


def front_table(choice: Choice) -> Table:
    """One row per front point, fastest first; the plans follow as numbered lines (they are long)."""
    table = Table(title=f"Time against cost: the Pareto front ({len(choice.front)} of "
                        f"{sum(p.feasible for p in choice.points)} feasible clusters)", show_edge=False)
    for column in ("#", "cluster", "time", "cost USD", "$/GPU-h", "tokens/s", "MFU"):
        table.add_column(column, justify="left" if column == "cluster" else "right", overflow="fold")
    for number, p in enumerate(choice.front, start=1):
        table.add_row(str(number), _label(p), hours_text(p.hours), usd_text(p.cost_usd),
                      f"{p.usd_per_gpu_hour:.2f}" + (" spot" if p.price_kind == "spot" else ""),
                      f"{p.tokens_per_second:,.0f}", f"{p.mfu:.0%}")
    return table


def recommendation_lines(choice: Choice) -> list[str]:
    """The cheapest plan within the deadline and the fastest within the budget, in words."""
    deadline = "" if choice.deadline_hours is None else \
        f" that meets the deadline of {hours_text(choice.deadline_hours)}"
    budget = "" if choice.budget_usd is None else f" within the budget of ${usd_text(choice.budget_usd)}"
    lines = []
    for title, point, condition in (("Cheapest", choice.cheapest, deadline), ("Fastest", choice.fastest, budget)):
        if point is None:
            lines.append(f"[bold]{title}{condition}:[/] none of the clusters.")
            continue
        lines.append(f"[bold]{title}{condition or ' overall'}:[/] {_label(point)}, {hours_text(point.hours)}, "
                     f"${usd_text(point.cost_usd)} ({point.summary})")
    return lines


def minimum_lines(choice: Choice) -> list[str]:
    """"Minimum GPUs of type T for this model at this context", per type, with why other counts fail."""
    lines = []
    for gpu, least in choice.minimum_gpus.items():
        tried = [p for p in choice.points if p.gpu == gpu]
        failed: dict[str, list[str]] = {}
        for p in tried:
            if not p.feasible:
                failed.setdefault(_BINDINGS.get(p.binding, p.binding or p.status), []).append(str(p.gpus))
        why = "; ".join(f"{', '.join(counts)} GPUs: {cause}" for cause, counts in failed.items())
        found = f"{least} GPU{'s' * (least > 1)}" if least else f"nothing fits up to {tried[-1].gpus} GPUs"
        lines.append(f"{tried[0].gpu_name}: {found}" + (f" (no plan on {why})" if why else ""))
    return lines


def render_choice(choice: Choice, console: Console) -> None:
    """The front, the recommendations, the minimum GPUs per type and the notes."""
    context = next((f" at {p.seq_len} tokens per sequence" for p in choice.points if p.feasible), "")
    console.print(f"[bold]{choice.model}[/], {choice.tokens:,.0f} tokens{context}: "
                  f"{len(choice.points)} clusters solved in {choice.wall_seconds:.1f} s")
    if choice.front:
        console.print(front_table(choice))
        for number, p in enumerate(choice.front, start=1):
            console.print(f"  {number}. {_label(p)}: {p.summary}")
    for line in recommendation_lines(choice):
        console.print(line)
    console.print("[bold]Minimum GPUs for this model at this context:[/]")
    for line in minimum_lines(choice):
        console.print(f"  {line}")
    console.print("[bold]Prices (USD per GPU-hour):[/]")
    names = {p.gpu: p.gpu_name for p in choice.points}
    for gpu, price in choice.prices.items():
        spot = "" if price.spot_usd_per_gpu_hour is None else f", spot ${price.spot_usd_per_gpu_hour:.4g}"
        console.print(f"[dim]  {names.get(gpu, gpu)}: ${price.usd_per_gpu_hour:.4g}{spot}: {price.source}[/]")
    for note in choice.notes:
        console.print(f"[dim]{note}[/]")


def plot_choice(choice: Choice, path: Path) -> None:
    """Cost against time for every feasible cluster, one colour per GPU type, the front as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError as error:
        raise FitplanError("--plot needs matplotlib", "pip install 'fitplan[plot]'") from error
    fig, axis = plt.subplots(figsize=(9, 5.5))
    for gpu, least in choice.minimum_gpus.items():
        mine = [p for p in choice.points if p.gpu == gpu and p.feasible]
        name = next(p.gpu_name for p in choice.points if p.gpu == gpu)
        if least is None:  # an infeasible type still gets a legend entry, marked
            axis.scatter([], [], marker="x", color="grey", label=f"{name}: does not fit")
            continue
        dots = axis.scatter([p.hours for p in mine], [p.cost_usd for p in mine], s=36, label=name)
        for p in mine:
            axis.annotate(str(p.gpus), (p.hours, p.cost_usd), fontsize=7, xytext=(3, 3), textcoords="offset points",
                          color=dots.get_facecolor()[0])
    front = choice.front
    axis.plot([p.hours for p in front], [p.cost_usd for p in front], color="black", linewidth=1, label="Pareto front")
    for point, marker, label in ((choice.cheapest, "s", "cheapest"), (choice.fastest, "D", "fastest")):
        if point is not None:
            axis.scatter([point.hours], [point.cost_usd], s=140, marker=marker, facecolors="none",
                         edgecolors="black", label=f"{label}: {point.gpus} x {point.gpu_name}")
    if choice.deadline_hours is not None:
        axis.axvline(choice.deadline_hours, color="red", linestyle="--", linewidth=1, label="deadline")
    if choice.budget_usd is not None:
        axis.axhline(choice.budget_usd, color="blue", linestyle="--", linewidth=1, label="budget")
    axis.set_xscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")
    axis.xaxis.set_major_formatter(plain)
    spread = [p.hours for p in choice.points if p.feasible]
    if spread and max(spread) < 10 * min(spread):  # under a decade the minor ticks are the only labels
        axis.xaxis.set_minor_formatter(plain)
    axis.set_xlabel("time to train, hours (log)")
    axis.set_ylabel("cost, USD")
    examples = any(p.source.startswith("example:") for p in choice.prices.values())
    axis.set_title(f"{choice.model}: {choice.tokens:,.0f} tokens (labels: GPU count"
                   + ("; dated example prices)" if examples else ")"), fontsize=10)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
