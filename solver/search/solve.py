"""One search, from a request and its pins to a plan: the space the allowed launchers run, the lowerings its
configurations are priced on (lowered before the clock starts), the whole-model and pipeline searches under the
time limit, then the plan assembled from a fresh estimate of the winner."""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, replace

from costmodels.cluster import node_view
from costmodels.config import Config, Offload
from costmodels.estimator import estimate
from costmodels.identity_memo import IdentityMemo
from costmodels.lowering import shared_lowering
from costmodels.pipeline_stages import stage_layers
from costmodels.timing import TimeTerms
from graphs import Checkpoint, FitplanError, LayerGraph
from graphs.variant import Variant, lower_all
from solver.plan import capability
from solver.plan.advice import advise
from solver.plan.launchers.support import (
    USER_SCRIPT_LAUNCHERS,
    model_launchers,
    model_problems,
    pipeline_launchers,
    runnable_by,
)
from solver.plan.record import Inputs, LoraDecision, Plan, SolverStats, decisions_of
from solver.search.alternatives import alternatives
from solver.search.diagnose import Infeasible, NoPlanInTime, diagnose
from solver.search.model import SolveResult, work_budget
from solver.search.pin_rules import check_memory_savers
from solver.search.pins import Pins
from solver.search.pipeline_search import PipelineMemos, PipelineResult, pipeline_infeasible, pipeline_search
from solver.search.request import Request, plan_inputs
from solver.search.route import TITAN_LOSSES, Lowerings, Route
from solver.search.schedules import schedule_options
from solver.search.space import Outer, Space, outer_space, virtual_variants
from solver.search.table_search import SearchResult, build_tables, search
from solver.search.tables import TICK_SECONDS


@dataclass(frozen=True, slots=True)
class Prepared:
    """A search's fixed parts: the request, its pins, what the plan records of its inputs, the launchers that may
    run it, the lowerings that price it and the space of configurations."""

    request: Request
    pins: Pins
    inputs: Inputs
    launchers: tuple[str, ...]
    lowerings: Lowerings
    space: Space

    @property
    def any_graph(self) -> LayerGraph:
        return self.lowerings(Outer())


@dataclass(frozen=True, slots=True)
class Searched:
    """What the searches found, when they began (the time limit's clock starts there, after every lowering) and
    how long the lowering before them took."""

    found: SearchResult
    tables: list
    piped: PipelineResult | None
    pipeline_status: str | None
    began: float
    """perf_counter() when the search began."""
    lowering_seconds: float


def solve_request(request: Request, pins: Pins) -> Plan:
    """The fastest configuration of `request` within `pins` that fits (`Infeasible` with a diagnosis when none
    does, `NoPlanInTime` when the limit cut the search before any plan)."""
    started = time.perf_counter()
    prepared = prepare(request, pins)  # lowers the model's base variant
    lower_needed(prepared)
    searched = run_searches(prepared, lowering_seconds=time.perf_counter() - started)
    outer, modes, result = decide(prepared, searched)
    return assemble(prepared, searched, outer, modes, result)


# The spaces of recent searches: a plan's side searches (other headrooms, `risk`) search the same space again.
_SPACES: IdentityMemo[Space] = IdentityMemo(limit=16)


@dataclass(frozen=True, slots=True)
class SpaceCosts:
    """What pricing a space computes whatever the memory budget: the tables' time terms by (graph, config), the
    pipeline search's compute bounds and slices (`PipelineMemos`), and whether its variants are lowered. A plan's
    side searches (other headrooms, `risk`) search the same space object, so they reuse these instead of pricing
    every configuration again."""
    time_terms: dict[tuple[LayerGraph, Config], TimeTerms]
    pipeline: PipelineMemos
    lowered: dict[Route, bool]
    """Routes whose variants are lowered, with whether megatron-core's layers built the model."""


_COSTS: IdentityMemo[SpaceCosts] = IdentityMemo(limit=4)
# The pipeline search's compute by setting (`PipelineMemos.fastest`, `.edges`), by the cluster's `node_view`: a
# setting's micro-batch compute has no data-parallel degree in it (`pipeline_search.compute_key`), so the clusters
# of a sweep that differ only in their node count (`fitplan choose`) share it.
_COMPUTE: IdentityMemo[PipelineMemos] = IdentityMemo(limit=16)


def space_costs(prepared: Prepared) -> SpaceCosts:
    """The shared costs of `prepared`'s space under its cluster and workload (fresh for a new space, but for the
    compute of its pipeline settings, which any cluster of the same nodes shares)."""
    request, space = prepared.request, prepared.space
    return _COSTS.get((space,), (request.cluster, request.workload), lambda: SpaceCosts({}, PipelineMemos(
        fastest=(compute := compute_memos(prepared)).fastest, edges=compute.edges), {}))


def compute_memos(prepared: Prepared) -> PipelineMemos:
    """The pipeline compute of `prepared`'s settings priced so far on clusters of the same nodes: what it depends
    on beyond the setting (`pipeline_search.compute_signature`) is the route that picks each setting's lowering,
    the searched modes, the workload and a node's GPUs and links."""
    request = prepared.request
    return _COMPUTE.get((node_view(request.cluster),), (request.workload, prepared.lowerings.route,
                                                         prepared.space.modes), PipelineMemos)


def prepare(request: Request, pins: Pins) -> Prepared:
    """The inputs, launchers, lowerings and space of a search; `Infeasible` when pins and divisibility leave no
    configuration at all."""
    # The model's facts and launchers come from its HF lowering: the one the search prices (all launchers allowed
    # so far), else, under torchtitan, a lowering of its own (torchtitan's graph records its own attention).
    lowerings = Lowerings(runtime_route(request, pins, (pins.launcher,) if pins.launcher else capability.LAUNCHERS))
    hf = lowerings if not lowerings.route.titan else \
        Lowerings(Route(resolved=request.resolved, lora=request.lora, attention=request.attention))
    hf_graph = hf(Outer())
    inputs = plan_inputs(request, pins, hf_graph)
    launchers = model_launchers(inputs, hf_graph.attention)
    if request.kbit_preparation:  # only a script of the user's own prepares the base so
        launchers = tuple(name for name in launchers if name in USER_SCRIPT_LAUNCHERS)
    if pins.launcher is not None and pins.launcher not in launchers:
        raise FitplanError(f"The {pins.launcher} launcher cannot run this model: "
                           f"{'; '.join(model_problems(pins.launcher, inputs, hf_graph.attention))}.",
                           f"Launchers that can: {', '.join(launchers)}.")
    any_graph = lowerings(Outer())
    pipelined = pipeline_launchers(inputs, launchers)
    space = _SPACES.get((any_graph,), (request.cluster, request.workload, pins, launchers, pipelined),
                        lambda: outer_space(any_graph, request.cluster, request.workload, pins, launchers, pipelined))
    if any_graph.runtime == "torchtitan":
        space = titan_priced(space, lora=request.lora is not None)
    if not space.outers and not space.pipelines:
        check_memory_savers(pins, any_graph, (pins.launcher,) if pins.launcher else launchers)
        raise Infeasible(*diagnose(None, inputs, pins, space, rebuild=lambda relaxed: outer_space(
            any_graph, request.cluster, request.workload, relaxed, launchers, pipelined)))
    return Prepared(request, pins, inputs, launchers, lowerings, space)


def runtime_route(request: Request, pins: Pins, launchers: tuple[str, ...]) -> Route:
    """The route the allowed launchers' runtimes price on: torchtitan's code when it is pinned, else HF's with
    op-level SAC traced where an allowed launcher runs it and the checkpoint pin allows it, and a 4-bit base as
    axolotl's loader prepares it where axolotl is the launcher."""
    titan = pins.launcher == "torchtitan"
    allowed = (pins.launcher,) if pins.launcher else launchers
    wanted = not titan and pins.allows("checkpoint", Checkpoint.OP_SELECTIVE) and bool(capability.op_selective_runners(
        allowed, all_layers=pins.value("checkpoint") is Checkpoint.OP_SELECTIVE))
    return Route(resolved=request.resolved, lora=None if titan else request.lora,
                 attention=None if titan else request.attention, titan=titan, op_selective=wanted,
                 axolotl=allowed == ("axolotl",), peft_kbit=request.kbit_preparation)


def titan_priced(space: Space, *, lora: bool) -> Space:
    """The configurations torchtitan's lowering prices: without FSDP2, torchtitan runs mixed precision under
    torch.autocast (train.py maybe_enable_amp), which its trace (parameters in the compute dtype) does not run; and
    only the losses torchtitan has (`route.TITAN_LOSSES`: no fused linear cross-entropy)."""
    def priced(outers: tuple[Outer, ...]) -> tuple[Outer, ...]:
        return tuple(o for o in outers if o.config().loss in TITAN_LOSSES)

    def cast(outers: tuple[Outer, ...]) -> tuple[Outer, ...]:
        return tuple(o for o in outers if shared_lowering(o.config(), lora=lora)[1] is None)

    outers, pipelines = priced(space.outers), priced(space.pipelines)
    kept, kept_pipelines = cast(outers), cast(pipelines)
    note = "DDP with mixed precision left out (torchtitan autocasts it; its lowering traces FSDP2's casting)"
    dropped = len(kept) < len(outers) or len(kept_pipelines) < len(pipelines)
    return replace(space, outers=kept, pipelines=kept_pipelines,
                   notes=(*space.notes, note) if dropped else space.notes)


def lower_needed(prepared: Prepared) -> None:
    """Lower every variant the space's configurations are priced on, before the time limit starts (a compiled
    configuration's table may keep it eager, `tables.build_table`, so its eager variant too)."""
    space, lowerings = prepared.space, prepared.lowerings
    lowered = space_costs(prepared).lowered
    if lowerings.route in lowered:  # a side search of a plan whose variants are lowered: they load on first use
        lowerings.megatron = lowered[lowerings.route]
        return
    megatron = lowerings.megatron
    first: dict[Variant, Outer] = {}  # one configuration per variant lowers it for all
    # An outer is the `Config` of its knobs (no variant reads its undecided checkpoint modes): asked directly, the
    # space's thousands of outers need no validated `Config` of their own here.
    for outer in (*space.outers, *space.pipelines):
        first.setdefault(lowerings.variant(outer), outer)
    if space.compile_auto:
        # a compiled variant's eager twin differs from it in `compiled` alone, so one configuration's twin stands
        # for every configuration of that variant
        for outer in [o for o in first.values() if o.compile]:
            eager = replace(outer, compile=False)
            first.setdefault(lowerings.variant(eager), eager)
    fresh = [v for v in first if v not in lowerings.graphs]
    if len(fresh) > 1:
        prepared.request.progress(f"Lowering {prepared.inputs.model}: {len(fresh)} variants")
        lower_all(prepared.request.resolved, fresh)
    for outer in first.values():
        lowerings(outer)
    if lowerings.megatron != megatron:  # megatron-core refused the model: the HF code prices those configurations
        lower_needed(prepared)
    lowered[lowerings.route] = lowerings.megatron


def run_searches(prepared: Prepared, *, lowering_seconds: float) -> Searched:
    """The whole-model search, then the pipeline search against its plan. Of the limit, table building gets half,
    the searches run until 85%, and the rest is for the report (alternatives stop at the limit). Deterministic, no
    wall clock cuts anything: every table is built and searched, each CP-SAT model within the work budget."""
    request, space = prepared.request, prepared.space
    request.progress(f"Searching {len(space.outers) + len(space.pipelines):,} configurations")
    begin = time.perf_counter()
    with work_budget(request.time_limit if request.deterministic else None):
        return _searches(prepared, begin=begin, lowering_seconds=lowering_seconds)


def _searches(prepared: Prepared, *, begin: float, lowering_seconds: float) -> Searched:
    """`run_searches` from `begin`, its clock's start."""
    request, space, pins = prepared.request, prepared.space, prepared.pins
    limit = math.inf if request.deterministic else request.time_limit  # the work budget bounds CP-SAT instead
    costs = space_costs(prepared)
    tables = build_tables(space, prepared.lowerings, request.cluster, request.workload, headroom=request.headroom,
                          deadline=begin + 0.5 * limit, memo=costs.time_terms)
    kinds = [layer.kind for layer in prepared.any_graph.decoder_layers()]
    found = search(tables, kinds, space.modes, time_limit=max(0.01, begin + 0.85 * limit - time.perf_counter()),
                   configurations=len(space.outers))
    adapters = LoraDecision.of(request.lora) if request.lora is not None else None
    attention = prepared.any_graph.attention

    def runs(config: Config) -> bool:  # the launchers the plan will list run it (its model's limits included)
        d = decisions_of(config, config.checkpoint, lora=adapters, attention=attention)
        return any(pins.launcher in (None, name) for name in runnable_by(d, prepared.inputs))

    piped = None
    if space.pipelines:
        result = found.result
        incumbent = result.objective // found.weight if result.objective is not None else None
        piped = pipeline_search(space.pipelines, prepared.lowerings, request.cluster, request.workload,
                                headroom=request.headroom, modes=space.modes, incumbent=incumbent,
                                deadline=begin + 0.85 * limit, runs=runs, memos=costs.pipeline,
                                variants=functools.partial(virtual_variants, pins=pins,
                                                           layers=len(prepared.any_graph.decoder_layers())))
    return Searched(found, tables, piped, piped.status if piped else None, begin, lowering_seconds)


def decide(prepared: Prepared, searched: Searched) -> tuple[Outer, tuple[Checkpoint, ...], SolveResult]:
    """The winner of the two searches, or the reason there is none."""
    request, space, result = prepared.request, prepared.space, searched.found.result
    piped, status = searched.piped, searched.pipeline_status
    configurations = len(space.outers) + len(space.pipelines)
    no_pipeline = piped is None or piped.outer is None
    if not space.outers and piped is not None and piped.outer is None and status == "INFEASIBLE":
        raise Infeasible(*pipeline_infeasible(space.pipelines, prepared.lowerings, request.cluster,
                                              request.workload, headroom=request.headroom,
                                              model=prepared.inputs.model, gpus=prepared.inputs.cluster.spec))
    if no_pipeline and result.table is None and result.status == "INFEASIBLE" and status in ("INFEASIBLE", None):
        lora = request.lora
        message, hint, diagnosis = diagnose(searched.found, prepared.inputs, prepared.pins, space,
                                            lora=lora is not None,
                                            quantized=lora is not None and lora.quantization is not None,
                                            tp_degrees=prepared.any_graph.tp_degrees)
        raise Infeasible(message, hint, {**diagnosis, "explored": len(searched.tables),
                                         "configurations": configurations})
    if no_pipeline and result.table is None:
        raise NoPlanInTime(request.time_limit, len(searched.tables), configurations)
    if not no_pipeline:  # a pipeline configuration beats every whole-model one
        assert piped is not None and piped.outer is not None
        won = "OPTIMAL" if result.status in ("OPTIMAL", "INFEASIBLE") and piped.status == "OPTIMAL" else "FEASIBLE"
        return piped.outer, piped.modes, SolveResult(won, piped.step_ticks * searched.found.weight, None,
                                                     result.wall_seconds, None, piped.modes)
    if status not in (None, "OPTIMAL", "INFEASIBLE") and result.status == "OPTIMAL":
        result = replace(result, status="FEASIBLE")  # a pipeline configuration left unsearched might be faster
    return searched.tables[result.table].outer, result.modes, result


def assemble(prepared: Prepared, searched: Searched, outer: Outer, modes: tuple[Checkpoint, ...],
             result: SolveResult) -> Plan:
    """The plan of the winner: a fresh, unscaled estimate (the self-consistency check of the tables), the guide's
    advice, the solver's statistics, the alternatives and, for pipelines, the other schedules."""
    request, pins = prepared.request, prepared.pins
    cluster, workload = request.cluster, request.workload
    graph = prepared.lowerings(outer)
    if outer.pp > 1:  # the plan records the split it was priced with
        outer = replace(outer, pp_split=stage_layers(graph, workload, outer.config()))
    config = outer.config(modes)
    priced = estimate(graph, cluster, workload, config)
    guide = advise(graph, cluster, workload, config, priced, compile_pin=pins.value("compile"),
                   input_tokens_per_s=request.input_tokens_per_s,
                   allowed_optimizers=pins.allowed("optimizer") or (Config().optimizer,), lora=request.lora is not None,
                   savers_allowed=len(pins.allowed("loss") or ()) > 1
                   or len(pins.allowed("activation_offload") or ()) > 1, headroom=request.headroom)
    if guide.compile != config.compile:  # not expected: the tables decide "auto" (tables.build_table)
        priced = estimate(graph, cluster, workload, replace(config, compile=guide.compile))
    note = prepared.lowerings.route.kbit_note()  # what the user's script does to the 4-bit base, as priced
    if note is not None:
        priced = replace(priced, notes=(*priced.notes, note))
    adapters = LoraDecision.of(request.lora, kbit_preparation=request.kbit_preparation) \
        if request.lora is not None else None
    decisions = replace(decisions_of(outer, modes, lora=adapters, attention=graph.attention),
                        compile=guide.compile, dataloader_num_workers=guide.workers)
    runners = runnable_by(decisions, prepared.inputs)  # a plan priced on torchtitan's code runs there only
    if not runners:  # the space keeps only what some allowed launcher runs (`runnable.Runnable`)
        raise FitplanError(f"No launcher runs the chosen configuration as emitted: {decisions.summary()}.",
                           "This is a fitplan bug; please report it with the command line.")
    alts = alternatives(searched.found, [layer.kind for layer in prepared.any_graph.decoder_layers()],
                        prepared.space.modes, prepared.lowerings, cluster, workload, chosen=result.table,
                        pipeline=(outer, priced.time.step_time) if searched.piped is not None else None,
                        count=request.alternatives,
                        deadline=None if request.deterministic else searched.began + request.time_limit)
    schedules = schedule_options(prepared.space, outer, modes, graph, cluster, workload, request.headroom, priced) \
        if outer.pp > 1 else ()
    return Plan(inputs=prepared.inputs, decisions=decisions, estimate=priced,
                solver=solver_stats(prepared, searched, result, priced.time.step_time), alternatives=alts,
                schedules=schedules, launchers=runners, binding=binding(outer, modes), advice=guide.lines)


def solver_stats(prepared: Prepared, searched: Searched, result: SolveResult, step_time: float) -> SolverStats:
    """The search's status, objective and bound in seconds, and its time (tables, searches and alternatives: what
    the time limit bounds) apart from the lowering's."""
    weight = searched.found.weight
    objective = result.objective // weight * TICK_SECONDS if result.objective is not None else step_time
    bound = result.bound // weight * TICK_SECONDS if result.bound is not None else None
    return SolverStats(status=result.status, objective_seconds=objective, bound_seconds=bound,
                       gap=None if bound is None or objective == 0 else max(0.0, (objective - bound) / objective),
                       wall_seconds=time.perf_counter() - searched.began, lowering_seconds=searched.lowering_seconds,
                       configurations=len(prepared.space.outers) + len(prepared.space.pipelines),
                       considered=len(searched.found.candidates), time_limit_seconds=prepared.request.time_limit,
                       deterministic=prepared.request.deterministic,
                       explored=len(searched.tables))


def binding(outer: Outer, modes: tuple[Checkpoint, ...]) -> str:
    """What limits the plan: nothing (the fastest settings fit) or device memory."""
    fastest_fits = all(m is Checkpoint.NONE for m in modes) and outer.optimizer_offload is Offload.NONE \
        and outer.param_offload is Offload.NONE
    return "none: the fastest settings already fit" if fastest_fits else \
        "device memory: faster settings (less recompute, less sharding or offload) do not fit"
