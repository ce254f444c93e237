"""The CP-SAT model: one-hot outer configuration, per-layer checkpoint booleans, step time and memory.

Build, solve, decode (OR-Tools sample layout). Memory constraints replay the activation timeline of
`costmodels.activations.walk` exactly: every node's forward and backward event, for each micro-batch
timeline, as linear expressions over per-kind prefix counts of checkpointed layers; on a pipeline rank, per stage,
beside the most its other in-flight micro-batches hold at the schedule's moments (`memory.allocated_peak`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from ortools.sat.python import cp_model

from costmodels.terms import MemoryTerms
from graphs import Checkpoint, FitplanError
from solver.search.space import CHECKPOINTED
from solver.search.tables import TICK_SECONDS, Table, rank_step, recompute_weight, tie_weight

# CP-SAT validates that no linear expression can exceed int64 (ortools cp_model_checker).
_INT64_LIMIT = 2**63 - 1

_PEAK = {True: "bwd_peak_fresh", False: "bwd_peak"}


@dataclass
class PlanModel:
    """The CpModel and its variables, keyed like the plan."""

    model: cp_model.CpModel
    tables: list[Table]
    kinds: list[int]
    use_config: dict[int, cp_model.IntVar]
    ckpt: dict[Checkpoint, list[cp_model.IntVar | int]]
    """Per checkpointed mode (`space.CHECKPOINTED`), one boolean per layer: `full_ckpt[p]`,
    `selective_ckpt[p]`, `op_selective_ckpt[p]` (0 where the mode is not allowed)."""
    count: dict[Checkpoint, dict[int, cp_model.LinearExpr]]
    """Per mode and kind, the layers in that mode."""
    prefix: dict[Checkpoint, dict[int, list[cp_model.IntVar]]]
    """Per mode and kind, the layers in that mode among the first p layers."""
    step_time: cp_model.IntVar
    weight: int


@dataclass(frozen=True, slots=True)
class SolveResult:
    status: str
    """OPTIMAL, FEASIBLE, INFEASIBLE or UNKNOWN."""
    objective: int | None
    bound: int | None
    wall_seconds: float
    table: int | None
    modes: tuple[Checkpoint, ...]


def build_model(tables: list[Table], kinds: list[int], modes: tuple[Checkpoint, ...], *, weight: int | None = None,
                hint: tuple[int, tuple[Checkpoint, ...]] | None = None) -> PlanModel:
    """The joint model over `tables`; `weight` (`tables.tie_weight` of the whole space) scales time above the
    tie-break so objectives compare across models."""
    m = cp_model.CpModel()
    weight = weight or tie_weight(tables, len(kinds))
    use = {k: m.new_bool_var(f"use_config[{k}]") for k in range(len(tables))}
    m.add_exactly_one(use.values())
    ckpt = _add_layer_modes(m, kinds, modes)
    count = {mode: _counts(kinds, flags) for mode, flags in ckpt.items()}
    prefix = {mode: _add_prefix_counts(m, kinds, flags, f"{mode}") for mode, flags in ckpt.items()}
    horizon = max(t.time_of(tuple(Checkpoint.NONE for _ in kinds)) + sum(max(v for _, v in o) for o in t.layer_ticks)
                  for t in tables)
    _check_range(horizon, weight)
    step = m.new_int_var(0, horizon, "step_time")
    pm = PlanModel(m, tables, kinds, use, ckpt, count, prefix, step, weight)
    for k, table in enumerate(tables):
        add_step_time(pm, k, table)
        add_memory_limit(pm, k, table)
    add_bound_cuts(pm)
    m.minimize(_objective(pm))
    if hint is not None:
        _add_hint(pm, *hint)
    return pm


def _objective(pm: PlanModel) -> cp_model.LinearExpr:
    """Step ticks times the tie weight, then the configuration's rank, then the recomputed layers."""
    rank_terms = [pm.use_config[k] * (table.rank * rank_step(len(pm.kinds))) for k, table in enumerate(pm.tables)]
    recomputed = [recompute_weight(mode) * sum(pm.count[mode].values()) for mode in CHECKPOINTED]
    return pm.step_time * pm.weight + sum(rank_terms) + sum(recomputed)


def add_objective_cutoff(pm: PlanModel, below: int) -> None:
    """Only plans whose objective is below `below` (the best found in another model) are wanted: a model that
    cannot beat it is proved infeasible, mostly by its linear relaxation, without being solved to its optimum."""
    pm.model.add(_objective(pm) <= below - 1)


def _check_range(horizon: int, weight: int) -> None:
    """Refuse step times whose weighted objective could overflow CP-SAT's int64 arithmetic (it would reject the
    model as MODEL_INVALID); only absurd workloads (weeks per step) come near."""
    if (horizon + 1) * weight * 4 >= _INT64_LIMIT:
        raise FitplanError(f"Some configurations take up to {horizon * TICK_SECONDS:.3g} s per optimizer step, more "
                           "than the solver's integer model can represent.",
                           "Plan a smaller workload (--seq-len, --global-batch) or more GPUs.")


def _add_layer_modes(m: cp_model.CpModel, kinds: list[int], modes: tuple[Checkpoint, ...]
                     ) -> dict[Checkpoint, list[cp_model.IntVar | int]]:
    """One boolean per layer and checkpointed mode, at most one true per layer; within a kind the checkpointed
    layers come first, in the order of `space.CHECKPOINTED` (the canonical order, `space.canonical_modes`)."""
    ckpt: dict[Checkpoint, list[cp_model.IntVar | int]] = {mode: [] for mode in CHECKPOINTED}
    for p in range(len(kinds)):
        flags = [m.new_bool_var(f"{mode}_ckpt[{p}]") if mode in modes else 0 for mode in CHECKPOINTED]
        m.add(sum(flags) <= 1)
        if Checkpoint.NONE not in modes:
            m.add(sum(flags) == 1)
        for mode, flag in zip(CHECKPOINTED, flags, strict=True):
            ckpt[mode].append(flag)
    previous: dict[int, int] = {}
    for p, kind in enumerate(kinds):
        if kind in previous:
            q = previous[kind]
            for depth in range(1, len(CHECKPOINTED) + 1):  # a layer's mode never comes before its predecessor's
                leading = CHECKPOINTED[:depth]
                m.add(sum(ckpt[x][q] for x in leading) >= sum(ckpt[x][p] for x in leading))
        previous[kind] = p
    return ckpt


def _counts(kinds: list[int], flags: list[cp_model.IntVar | int]) -> dict[int, cp_model.LinearExpr]:
    return {kind: sum(f for f, k in zip(flags, kinds, strict=True) if k == kind) for kind in sorted(set(kinds))}


def _add_prefix_counts(m: cp_model.CpModel, kinds: list[int], flags: list[cp_model.IntVar | int], name: str
                       ) -> dict[int, list[cp_model.IntVar]]:
    """prefix[kind][p]: flagged layers of `kind` among the first p layers (a chain, so each use is O(1))."""
    prefix = {}
    for kind in sorted(set(kinds)):
        chain = [m.new_constant(0)]
        for p, flag in enumerate(flags):
            if kinds[p] == kind and not isinstance(flag, int):
                var = m.new_int_var(0, p + 1, f"{name}_before[{kind},{p + 1}]")
                m.add(var == chain[-1] + flag)
                chain.append(var)
            else:
                chain.append(chain[-1])
        prefix[kind] = chain
    return prefix


def add_step_time(pm: PlanModel, k: int, table: Table) -> None:
    """If configuration k is used, the step takes its fixed ticks plus each layer's ticks in its mode."""
    expr = table.fixed_ticks
    for kind, (none, deltas) in _kind_deltas(pm.kinds, table.layer_ticks).items():
        expr += pm.kinds.count(kind) * none + sum(d * pm.count[mode][kind] for mode, d in deltas.items())
    pm.model.add(pm.step_time >= expr).only_enforce_if(pm.use_config[k])
    for mode in CHECKPOINTED:
        if not table.outer.runs(mode) and any(not isinstance(f, int) for f in pm.ckpt[mode]):
            # no launcher that runs this configuration expresses this mode
            pm.model.add(sum(pm.count[mode].values()) == 0).only_enforce_if(pm.use_config[k])
    if not table.outer.runs(Checkpoint.NONE):  # activation offload, or one checkpointed mode for every layer
        checkpointed = sum(flag for mode in CHECKPOINTED for flag in pm.ckpt[mode])
        if isinstance(checkpointed, int):  # no checkpointed mode allowed at all: this configuration cannot run
            pm.model.add(pm.use_config[k] == 0)
        else:
            pm.model.add(checkpointed == len(pm.kinds)).only_enforce_if(pm.use_config[k])


def _kind_deltas(kinds: list[int], per_layer: tuple[tuple[tuple[Checkpoint, int], ...], ...]
                 ) -> dict[int, tuple[int, dict[Checkpoint, int]]]:
    """Per kind: (value in NONE, each checkpointed mode minus NONE); layers of one kind cost the same."""
    result = {}
    for options, kind in zip(per_layer, kinds, strict=True):
        if kind not in result:
            values = dict(options)
            none = values.get(Checkpoint.NONE, 0)
            result[kind] = (none, {mode: values.get(mode, none) - none for mode in CHECKPOINTED})
    return result


def add_memory_limit(pm: PlanModel, k: int, table: Table) -> None:
    """If configuration k is used, every forward and backward event of every micro-batch timeline, plus the
    persistent states, stays within the configuration's allocated-byte budget."""
    terms = table.memory
    sums = {attr: _Sums(pm, terms, attr) for attr in _ATTRS}
    held = _held(terms, sums)
    others = _others(pm, k, terms, held)
    for fresh, before in terms.walks:
        limit = table.budget - terms.states.gpu_total - before
        for expr in _events(terms, sums, fresh, others, [full for full, _ in held]):
            pm.model.add(expr <= limit).only_enforce_if(pm.use_config[k])


_ATTRS = ("fwd_net", "fwd_peak", "released_after_forward", "bwd_net", "bwd_peak", "bwd_peak_fresh", "grads")


class _Sums:
    """Range sums of one per-node quantity: NONE values from a cumulative array, plus per-kind deltas times
    the prefix counts of checkpointed layers, so that any range costs O(kinds) terms."""

    def __init__(self, pm: PlanModel, terms: MemoryTerms, attr: str) -> None:
        self.pm = pm
        self.cumulative = [0]
        self.deltas: dict[int, dict[Checkpoint, int]] = {}
        self.position = [0]  # decoder layers before node i
        for options in terms.nodes:
            values = {mode: getattr(node, attr) for mode, node in options}
            none = values[Checkpoint.NONE]
            self.cumulative.append(self.cumulative[-1] + none)
            is_decoder = options[0][1].decoder
            if is_decoder:
                kind = pm.kinds[self.position[-1]]
                self.deltas.setdefault(kind, {mode: values.get(mode, none) - none for mode in CHECKPOINTED})
            self.position.append(self.position[-1] + is_decoder)

    def over(self, start: int, stop: int) -> cp_model.LinearExpr:
        """Sum over nodes start..stop-1."""
        total: cp_model.LinearExpr = self.cumulative[stop] - self.cumulative[start]
        first, last = self.position[start], self.position[stop]
        for kind, deltas in self.deltas.items():
            for mode, delta in deltas.items():
                if delta:
                    chain = self.pm.prefix[mode][kind]
                    total += delta * (chain[last] - chain[first])
        return total

    def at(self, i: int) -> cp_model.LinearExpr:
        """The value of node i in its own mode."""
        return self.over(i, i + 1)


def _held(terms: MemoryTerms, sums: dict[str, _Sums]) -> list[tuple[cp_model.LinearExpr, cp_model.LinearExpr]]:
    """Per stage, what one micro-batch keeps after its forward and after a zero-bubble input step
    (`memory.held_by_stage`)."""
    def kept(first: int, stop: int) -> cp_model.LinearExpr:
        return sums["fwd_net"].over(first, stop) - sums["released_after_forward"].over(first, stop)

    held = []
    for span in terms.stage_spans():
        full = terms.kept_base(span) + kept(span.first, span.stop)
        held.append((full, full - kept(span.input_frees_from, span.stop)))
    return held


def _others(pm: PlanModel, k: int, terms: MemoryTerms, held: list[tuple[cp_model.LinearExpr, cp_model.LinearExpr]]
            ) -> dict[tuple[int, bool], cp_model.LinearExprT]:
    """Per (running stage, forward), the bytes the other in-flight micro-batches hold plus the step's buffers
    (`memory.others_at_most`): the moment's sum where one moment gives it, else a variable at least each
    moment's, which the events then bound."""
    ranges = [(_held_range(terms, span.first, span.stop, terms.kept_base(span)),
               _held_range(terms, span.first, span.input_frees_from, terms.kept_base(span)))
              for span in terms.stage_spans()]
    groups: dict[tuple[int, bool], list[tuple[cp_model.LinearExprT, int, int]]] = {}
    for moment in terms.moment_list():
        expr: cp_model.LinearExprT = terms.buffers
        low = high = terms.buffers
        for f, a, (full, after), ((full_low, full_high), (after_low, after_high)) in zip(
                moment.full, moment.after_input, held, ranges, strict=True):
            expr += f * full + a * after
            low += f * full_low + a * after_low
            high += f * full_high + a * after_high
        groups.setdefault((moment.stage, moment.forward), []).append((expr, low, high))
    others: dict[tuple[int, bool], cp_model.LinearExprT] = {}
    for (stage, forward), options in groups.items():
        if len(options) == 1:
            others[stage, forward] = options[0][0]
            continue
        most = pm.model.new_int_var(max(low for _, low, _ in options), max(high for _, _, high in options),
                                    f"others_{k}_{stage}_{'f' if forward else 'b'}")
        for expr, _, _ in options:
            pm.model.add(most >= expr).only_enforce_if(pm.use_config[k])
        others[stage, forward] = most
    return others


def _held_range(terms: MemoryTerms, first: int, stop: int, base: int) -> tuple[int, int]:
    """The least and most bytes nodes first..stop-1 keep after their forward, over their modes, plus `base`."""
    low = high = base
    for options in terms.nodes[first:stop]:
        values = [node.fwd_net - node.released_after_forward for _, node in options]
        low, high = low + min(values), high + max(values)
    return low, high


def _events(terms: MemoryTerms, sums: dict[str, _Sums], fresh: bool,
            others: dict[tuple[int, bool], cp_model.LinearExprT],
            live_ends: list[cp_model.LinearExpr]) -> list[cp_model.LinearExpr]:
    """The walk's events as linear expressions (see costmodels.activations.walk_phases), per stage of the
    terms, each with the other in-flight micro-batches of its moments (`_others`); `live_ends` are what each
    stage's micro-batch keeps at the end of its forward (`_held`)."""
    kept = [0]
    for extra in terms.extra:
        kept.append(kept[-1] + extra[1])
    events = []
    for t, span in enumerate(terms.stage_spans()):
        first, stop = span.first, span.stop
        decoders = [i for i in range(first, stop) if terms.nodes[i][0][1].decoder]
        last = decoders[-1] if decoders else -1
        grads, live_end = (span.other_grads if fresh else 0), live_ends[t]
        if (t, True) in others:
            for i in range(first, stop):
                drop = span.forward_only if i > last >= 0 else 0
                events.append(span.start - drop + sums["fwd_net"].over(first, i) + sums["fwd_peak"].at(i)
                              + terms.extra[i][0] + kept[i] - kept[first] + others[t, True] + grads)
        if (t, False) in others:
            for i in reversed(range(first, stop)):
                later = sums["bwd_net"].over(i + 1, stop) + (sums["grads"].over(i + 1, stop) if fresh else 0)
                events.append(live_end + later + sums[_PEAK[fresh]].at(i) + terms.extra[i][2] + kept[i + 1]
                              - kept[first] + others[t, False] + grads)
    return events


def add_bound_cuts(pm: PlanModel) -> None:
    """The step takes at least the chosen configuration's time without recompute (feasibility study §6: the
    cut that lets CP-SAT prove optimality quickly)."""
    lower = []
    for k, table in enumerate(pm.tables):
        base = table.fixed_ticks + sum(min(v for _, v in options) for options in table.layer_ticks)
        lower.append(pm.use_config[k] * base)
    pm.model.add(pm.step_time >= sum(lower))


def _add_hint(pm: PlanModel, table: int, modes: tuple[Checkpoint, ...]) -> None:
    for k, var in pm.use_config.items():
        pm.model.add_hint(var, k == table)
    for p, mode in enumerate(modes):
        for flag_mode, flags in pm.ckpt.items():
            if not isinstance(flags[p], int):
                pm.model.add_hint(flags[p], mode is flag_mode)


# Under --deterministic, CP-SAT's budget per model in deterministic seconds (its count of work, independent of
# load and machine; about a second of one core each); None: the wall-clock limit the caller passes.
WORK_BUDGET: ContextVar[float | None] = ContextVar("WORK_BUDGET", default=None)


@contextmanager
def work_budget(deterministic_seconds: float | None) -> Iterator[None]:
    """Within the block, every CP-SAT solve runs on one worker for at most `deterministic_seconds` of work, with no
    wall-clock limit: the same model then gets the same answer under any load (None: wall-clock limits)."""
    token = WORK_BUDGET.set(deterministic_seconds)
    try:
        yield
    finally:
        WORK_BUDGET.reset(token)


def solve(pm: PlanModel, *, time_limit: float, workers: int = 2, seed: int = 0) -> SolveResult:
    solver = cp_model.CpSolver()
    budget = WORK_BUDGET.get()
    if budget is None:
        solver.parameters.max_time_in_seconds = max(0.01, time_limit)
        solver.parameters.num_workers = workers
    else:  # several workers race each other, so only one is deterministic (CP-SAT's parameters documentation)
        solver.parameters.max_deterministic_time = budget
        solver.parameters.num_workers = 1
    solver.parameters.random_seed = seed
    status = solver.solve(pm.model)
    name = solver.status_name(status)
    match status:
        case cp_model.OPTIMAL | cp_model.FEASIBLE:
            table, modes = decode(pm, solver)
            return SolveResult(name, round(solver.objective_value), round(solver.best_objective_bound),
                               solver.wall_time, table, modes)
        case cp_model.INFEASIBLE | cp_model.UNKNOWN:
            return SolveResult(name, None, None, solver.wall_time, None, ())
        case _:
            raise RuntimeError(f"CP-SAT rejected the planning model ({name}): a bug in fitplan")


def decode(pm: PlanModel, solver: cp_model.CpSolver) -> tuple[int, tuple[Checkpoint, ...]]:
    """The chosen configuration index and per-layer modes (plain Python values)."""
    table = next(k for k, var in pm.use_config.items() if solver.boolean_value(var))
    modes = []
    for p in range(len(pm.kinds)):
        chosen = [mode for mode, flags in pm.ckpt.items() if not isinstance(flags[p], int)
                  and solver.boolean_value(flags[p])]
        modes.append(chosen[0] if chosen else Checkpoint.NONE)
    return table, tuple(modes)
