"""`fitplan choose`: which GPU type, how many, how long and at what cost. One `solve()` per (type, count);
time = tokens / the plan's tokens per second, cost = hours x GPUs x price per GPU-hour; then the Pareto front.

Each point is exactly what `solve()` gives for that cluster. The clusters are solved in parallel worker processes,
after the smallest cluster of each GPU type has been solved here: its lowerings (a model's variants differ little
between GPU types) are then in the disk cache that every worker reads. Per-provider node shapes are not modelled:
a count above one node is whole nodes.
"""

from __future__ import annotations

import concurrent.futures
import gc
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from costmodels import GPU, find_gpu
from graphs import FitplanError, resolve
from graphs.workers import spawn_context
from solver.hardware.prices import GpuPrice, bundled_note, bundled_prices, load_prices
from solver.search.bounds import MAX_DEADLINE_HOURS

# Counts tried inside one node before whole nodes: the usual rentable shapes (1, 2, 4 or 8 GPUs per VM).
WITHIN_NODE_COUNTS = (1, 2, 4, 8)
DEFAULT_GPU_TYPES = ("H100", "A100-80GB", "L40S", "A10G")
DEFAULT_MAX_GPUS = 64
_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|sec|m|min|h|hr|hours?|d|days?)?\s*", re.IGNORECASE)
_HOURS_PER_UNIT = {"s": 1 / 3600, "m": 1 / 60, "h": 1.0, "d": 24.0}


@dataclass(frozen=True, slots=True, kw_only=True)
class Point:
    """One cluster of the sweep: the plan `solve()` found for it (or why none), its time and its cost."""

    gpu: str
    """Catalog GPU id."""
    gpu_name: str
    gpus: int
    """GPUs in the cluster."""
    spec: str
    """The cluster string given to `solve()`, e.g. "16xh100-sxm-80gb"."""
    feasible: bool
    status: str
    """The solver's status (OPTIMAL, FEASIBLE), or infeasible, no plan in time, error."""
    reason: str = ""
    """Why nothing runs on this cluster (solve's message)."""
    binding: str = ""
    """What rules the cluster out, from solve's diagnosis: GPU memory, host RAM, pins (divisibility)..."""
    usd_per_gpu_hour: float
    price_kind: str
    """on-demand or spot."""
    step_seconds: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    seq_len: int | None = None
    """Tokens per sequence of the plan (the context the minimum GPU count is for)."""
    global_batch: int | None = None
    """Sequences per optimizer step of the plan."""
    hours: float | None = None
    """Time to train the requested tokens."""
    cost_usd: float | None = None
    """hours x GPUs x price per GPU-hour."""
    summary: str = ""
    """The plan's decisions in one line."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    """The sweep's answer: every point, the time/cost Pareto front and the two recommendations."""

    model: str
    tokens: float
    points: tuple[Point, ...]
    front: tuple[Point, ...]
    """Feasible points no other point beats on both time and cost, fastest first."""
    cheapest: Point | None
    """Cheapest plan that meets the deadline (cheapest overall without one)."""
    fastest: Point | None
    """Fastest plan within the budget (fastest overall without one)."""
    minimum_gpus: dict[str, int | None]
    """Fewest GPUs of each type on which the model fits at this context (None: none up to max_gpus)."""
    deadline_hours: float | None
    budget_usd: float | None
    spot: bool
    prices: dict[str, GpuPrice]
    notes: tuple[str, ...]
    """Assumptions and caveats, in words (prices are dated examples, spot fallbacks, defaults)."""
    wall_seconds: float

    def to_json(self) -> dict[str, Any]:
        """The answer as plain JSON data (points in sweep order; front and picks repeat their points)."""
        return {"kind": "fitplan-choose", "version": 1, **asdict(self)}


def gpu_counts(gpus_per_node: int, max_gpus: int) -> list[int]:
    """1, 2, 4, 8 GPUs within a node (up to its size), then whole nodes, all up to `max_gpus`."""
    inside = [c for c in WITHIN_NODE_COUNTS if c <= min(gpus_per_node, max_gpus)]
    return inside + [n * gpus_per_node for n in range(2, max_gpus // gpus_per_node + 1)]


def clusters(gpu_types: Sequence[str], max_gpus: int) -> list[tuple[GPU, int]]:
    """(GPU, count) for every point of the sweep, in the order given; unknown names are errors (exit 2)."""
    if isinstance(max_gpus, bool) or not isinstance(max_gpus, int) or max_gpus < 1:
        raise FitplanError(f"--max-gpus must be a positive integer, got {max_gpus!r}", "e.g. --max-gpus 64")
    gpus = list({gpu.id: gpu for gpu in (find_gpu(name) for name in gpu_types if name.strip())}.values())
    if not gpus:
        raise FitplanError("No GPU types given.", f"e.g. --gpu-types {','.join(DEFAULT_GPU_TYPES)}")
    return [(gpu, count) for gpu in gpus for count in gpu_counts(_per_node(gpu), max_gpus)]


def _per_node(gpu: GPU) -> int:
    return gpu.typical_node.gpus_per_node if gpu.typical_node is not None else 1


def train_hours(tokens: float, tokens_per_second: float) -> float:
    """Hours to process `tokens` at `tokens_per_second`."""
    return tokens / tokens_per_second / 3600.0


def cost_usd(hours: float, gpus: int, usd_per_gpu_hour: float) -> float:
    """USD for `gpus` GPUs rented for `hours` at `usd_per_gpu_hour` each."""
    return hours * gpus * usd_per_gpu_hour


def pareto_front(points: Sequence[Point]) -> tuple[Point, ...]:
    """Feasible points that no other point matches or beats on both hours and cost (one strictly), fastest first.

    Sorted by (hours, cost), a point is kept when it is cheaper than every faster one; an exact duplicate of a
    kept point is kept too (neither dominates the other).
    """
    ranked = sorted((p for p in points if p.feasible), key=lambda p: (p.hours, p.cost_usd))
    front: list[Point] = []
    for p in ranked:
        if not front or p.cost_usd < front[-1].cost_usd or \
                (p.hours, p.cost_usd) == (front[-1].hours, front[-1].cost_usd):
            front.append(p)
    return tuple(front)


def cheapest_within(points: Sequence[Point], deadline_hours: float | None) -> Point | None:
    """The cheapest feasible point finishing within the deadline (ties: faster, then fewer GPUs)."""
    meeting = [p for p in points if p.feasible and (deadline_hours is None or p.hours <= deadline_hours)]
    return min(meeting, key=lambda p: (p.cost_usd, p.hours, p.gpus), default=None)


def fastest_within(points: Sequence[Point], budget_usd: float | None) -> Point | None:
    """The fastest feasible point costing at most the budget (ties: cheaper, then fewer GPUs)."""
    affordable = [p for p in points if p.feasible and (budget_usd is None or p.cost_usd <= budget_usd)]
    return min(affordable, key=lambda p: (p.hours, p.cost_usd, p.gpus), default=None)


def minimum_gpus(points: Sequence[Point]) -> dict[str, int | None]:
    """Fewest GPUs with a plan, per GPU type in sweep order (None where no count fits)."""
    found: dict[str, int | None] = {}
    for p in points:
        found.setdefault(p.gpu, None)
        if p.feasible and (found[p.gpu] is None or p.gpus < found[p.gpu]):
            found[p.gpu] = p.gpus
    return found


def parse_duration(text: str) -> float:
    """Hours in "24h", "90m", "2d", "3600s" or a bare number of hours."""
    match = _DURATION.fullmatch(str(text))
    if match is None or float(match.group(1)) <= 0:
        raise FitplanError(f"Cannot read the duration {text!r}.", "Write e.g. 24h, 90m, 2d or 3600s (positive).")
    unit = (match.group(2) or "h")[0].lower()
    hours = float(match.group(1)) * _HOURS_PER_UNIT[unit]
    if hours > MAX_DEADLINE_HOURS:
        raise FitplanError(f"The duration {text!r} is out of range: at most {MAX_DEADLINE_HOURS:,.0f} hours.",
                           "Write e.g. 24h, 90m, 2d or 3600s.")
    return hours


def price_table(prices: str | Path | dict[str, GpuPrice] | None) -> dict[str, GpuPrice]:
    """The bundled example prices, overridden GPU by GPU by the user's file or table."""
    table = bundled_prices()
    if prices is not None:
        table.update(prices if isinstance(prices, dict) else load_prices(prices))
    return table


def unit_price(price: GpuPrice, *, spot: bool) -> tuple[float, str]:
    """(USD per GPU-hour, "spot" or "on-demand"): spot where asked and known, else on-demand."""
    if spot and price.spot_usd_per_gpu_hour is not None:
        return price.spot_usd_per_gpu_hour, "spot"
    return price.usd_per_gpu_hour, "on-demand"


def plan_point(model: str, gpu: GPU, count: int, *, tokens: float, price: GpuPrice, spot: bool,
               **solve_options: Any) -> Point:
    """Solve one cluster with `solve()` and price it; a cluster where nothing runs becomes an infeasible point."""
    # The search (OR-Tools, the cost models) is imported where a cluster is solved: a sweep's own process only
    # starts the workers that solve them, without first paying their imports.
    from solver.api import solve
    from solver.search.diagnose import Infeasible

    usd, kind = unit_price(price, spot=spot)
    spec = f"{count}x{gpu.id}"
    base = {"gpu": gpu.id, "gpu_name": gpu.name, "gpus": count, "spec": spec, "usd_per_gpu_hour": usd,
            "price_kind": kind}
    try:
        plan = solve(model, spec, alternatives_count=0, **solve_options)
    except Infeasible as why:
        return Point(**base, feasible=False, status="infeasible", reason=why.message,
                     binding=str(why.diagnosis.get("binding", "")))
    except FitplanError as why:  # a time limit that ends the search before any plan proves nothing infeasible
        timed_out = getattr(why, "diagnosis", {}).get("binding") == "time limit"
        return Point(**base, feasible=False, status="no plan in time" if timed_out else "error", reason=why.message)
    hours = train_hours(tokens, plan.estimate.tokens_per_second)
    return Point(**base, feasible=True, status=plan.solver.status, step_seconds=plan.estimate.time.step_time,
                 tokens_per_second=plan.estimate.tokens_per_second, mfu=plan.estimate.mfu,
                 seq_len=plan.inputs.seq_len, global_batch=plan.inputs.global_batch, hours=hours,
                 cost_usd=cost_usd(hours, count, usd), summary=plan.decisions.summary())


def choose(model: str, tokens: float, *, gpu_types: Sequence[str] = DEFAULT_GPU_TYPES,
           max_gpus: int = DEFAULT_MAX_GPUS, prices: str | Path | dict[str, GpuPrice] | None = None,
           spot: bool = False, deadline_hours: float | None = None, budget_usd: float | None = None,
           progress: Callable[[Point], None] | None = None, workers: int | None = None,
           **solve_options: Any) -> Choice:
    """Solve every (GPU type, count) of the sweep and pick the front, the cheapest in time, the fastest in budget.

    `solve_options` go to `solve()` unchanged (seq_len, global_batch, time_limit, lora, allow_lora, allow_savers,
    pins). `workers`: processes solving clusters at once (default: the CPUs; 1 solves them here, in order).
    """
    started = time.perf_counter()
    _check_request(tokens, deadline_hours, budget_usd)
    resolved = resolve(model)  # an unknown model is one error, not one per point
    sweep = clusters(gpu_types, max_gpus)
    table = price_table(prices)
    missing = sorted({gpu.name for gpu, _ in sweep if gpu.id not in table})
    if missing:
        raise FitplanError(f"No price for {', '.join(missing)}.",
                           f"Give one with --prices FILE (e.g. a line '{missing[0]}: 1.50' in USD per GPU-hour).")
    points = solve_sweep(resolved.id, sweep, tokens=tokens, table=table, spot=spot, progress=progress,
                         workers=workers, **solve_options)
    _raise_if_only_errors(points)
    used = {gpu.id: table[gpu.id] for gpu, _ in sweep}
    return Choice(model=resolved.id, tokens=tokens, points=tuple(points), front=pareto_front(points),
                  cheapest=cheapest_within(points, deadline_hours), fastest=fastest_within(points, budget_usd),
                  minimum_gpus=minimum_gpus(points), deadline_hours=deadline_hours, budget_usd=budget_usd,
                  spot=spot, prices=used, notes=tuple(_notes(used, spot, solve_options)),
                  wall_seconds=time.perf_counter() - started)


def solve_sweep(model: str, sweep: Sequence[tuple[GPU, int]], *, tokens: float, table: dict[str, GpuPrice],
                spot: bool, progress: Callable[[Point], None] | None, workers: int | None,
                **solve_options: Any) -> list[Point]:
    """Every cluster's point, in sweep order: the first cluster of each GPU type submitted first, then the others,
    largest first, in `workers` processes where the caller allows them. A lowering is made once: a process that
    needs one another is making waits for it and reads it from the disk cache (`graphs.cache.cached_or_lowered`).
    The largest clusters have the most layouts and pipeline splits to search: started first, they leave the quick
    small ones to fill the workers at the end, instead of one long solve running alone."""
    first = {gpu.id: (gpu, count) for gpu, count in reversed(sweep)}  # the smallest count of each type
    rest = sorted(((gpu, count) for gpu, count in sweep if first[gpu.id] != (gpu, count)), key=lambda p: -p[1])
    workers = min(len(sweep), workers or os.cpu_count() or 1)
    context = spawn_context()
    found: dict[tuple[str, int], Point] = {}

    def record(gpu_id: str, count: int, point: Point) -> None:
        found[gpu_id, count] = point
        if progress is not None:
            progress(point)

    options = dict(tokens=tokens, spot=spot, **solve_options)
    if workers <= 1 or context is None:
        for gpu, count in [*first.values(), *rest]:
            record(gpu.id, count, plan_point(model, gpu, count, price=table[gpu.id], **options))
    else:
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context,
                                                    initializer=_lower_in_process) as pool:
            futures = {pool.submit(plan_point, model, gpu, count, price=table[gpu.id], **options):
                       (gpu.id, count) for gpu, count in [*first.values(), *rest]}
            for future in concurrent.futures.as_completed(futures):
                record(*futures[future], future.result())
    return [found[gpu.id, count] for gpu, count in sweep]


def _lower_in_process() -> None:
    """A sweep worker lowers in its own process: the sweep's workers already fill the cores
    (`graphs.variant.lowering_workers`). Its cyclic garbage collector is paused, as the command's own
    (`solver.cli.app.run`): the searches' short-lived records are freed by reference counting."""
    os.environ["FITPLAN_LOWERING_WORKERS"] = "1"
    gc.disable()


def _check_request(tokens: float, deadline_hours: float | None, budget_usd: float | None) -> None:
    for name, value, example in (("--tokens", tokens, "2e9"), ("--deadline", deadline_hours, "24h"),
                                 ("--budget", budget_usd, "5000")):
        if value is None and name != "--tokens":
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value < math.inf):
            raise FitplanError(f"{name} must be a positive number, got {value!r}", f"e.g. {name} {example}")


def _raise_if_only_errors(points: Sequence[Point]) -> None:
    """Input that no cluster accepts (e.g. an unknown pin) is bad input, not a sweep of failures."""
    if points and all(p.status == "error" for p in points):
        raise FitplanError(points[0].reason, "Every cluster rejected the request; check the options.")


def _notes(used: dict[str, GpuPrice], spot: bool, options: dict[str, Any]) -> list[str]:
    notes = []
    if any(p.source.startswith("example:") for p in used.values()):
        notes.append(f"Prices: {bundled_note()}")
    if spot:
        notes += [f"no spot price for {find_gpu(gpu).name}: on-demand used" for gpu, p in used.items()
                  if p.spot_usd_per_gpu_hour is None]
    if options.get("global_batch") is None and options.get("tokens_per_step") is None:
        notes.append("global batch not given: each cluster uses solve's default (64 sequences, or one per GPU "
                     "when there are more GPUs)")
    return notes
