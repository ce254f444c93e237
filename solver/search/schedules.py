"""The pipeline schedules a plan could have run: the chosen configuration's layout and recompute priced under the
other schedules the search had for it, and at the FLOP-balanced split, so `explain` can say why the schedule and
the split won."""

from __future__ import annotations

from dataclasses import fields, replace

from costmodels.breakdown import Estimate
from costmodels.cluster import Cluster
from costmodels.config import Config, Workload
from costmodels.estimator import estimate
from costmodels.pipeline_stages import SCHEDULE_FIELDS, stage_layers
from costmodels.verdict import fits
from graphs import Checkpoint, LayerGraph
from solver.plan.record import ScheduleOption
from solver.search.space import Outer, Space


def schedule_options(space: Space, outer: Outer, modes: tuple[Checkpoint, ...], graph: LayerGraph,
                      cluster: Cluster, workload: Workload, headroom: float,
                      chosen: Estimate) -> tuple[ScheduleOption, ...]:
    """The chosen pipeline configuration's layout and per-layer recompute priced under every other schedule the
    search had for it (each with its own balanced split), the chosen one first, then, where the search chose
    another split, the chosen schedule at the FLOP-balanced split: why the schedule and the split won."""
    def option(config: Config, priced: Estimate, *, is_chosen: bool) -> ScheduleOption:
        split = priced.pipeline.stage_layers if priced.pipeline is not None else ()
        return ScheduleOption(schedule=str(config.pp_schedule), virtual=config.pp_virtual, split=split,
                              step_time=priced.time.step_time, bubble=priced.time.bubble,
                              device_peak=priced.memory.device_peak, fits=fits(priced, cluster, headroom).fits,
                              chosen=is_chosen)

    options = [option(outer.config(modes), chosen, is_chosen=True)]
    balanced = replace(outer, pp_split=()).config(modes)
    if stage_layers(graph, workload, balanced) != outer.pp_split:
        options.append(option(balanced, estimate(graph, cluster, workload, balanced), is_chosen=False))
    chosen_layout = layout(outer)
    for other in space.pipelines:
        if (other.pp_schedule, other.pp_virtual) != (outer.pp_schedule, outer.pp_virtual) and \
                layout(other) == chosen_layout:
            config = other.config(modes)
            options.append(option(config, estimate(graph, cluster, workload, config), is_chosen=False))
    return tuple(options)


_LAYOUT_FIELDS = tuple(f.name for f in fields(Outer) if f.name not in SCHEDULE_FIELDS)


def layout(outer: Outer) -> tuple[object, ...]:
    """Every knob of `outer` but its schedule, stages per rank and split: what two schedules of one layout share
    (read field by field; a `replace` would validate a new configuration for each of a space's thousands)."""
    return tuple(getattr(outer, name) for name in _LAYOUT_FIELDS)
