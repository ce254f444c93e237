"""Which outer configurations some allowed launcher runs as emitted, and how those launchers checkpoint their
layers (per layer, or one mode for every layer): the launcher registry's rules asked once per family of knobs."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields, replace

from costmodels import Config
from costmodels.estimator import model_refusals
from graphs import Checkpoint, LayerGraph
from solver.plan.capability import REGISTRY, op_selective_runners, runnable_by, selective_runners, whole_pipeline_groups
from solver.search.outer import Outer, mode_runs
from solver.search.pins import KNOBS, Pins

_CONFIG_DEFAULTS = {f.name: f.default for f in fields(Config) if f.default is not MISSING}
# The marks of every family asked so far, by what else decides them (the allowed and pipelining launchers, the
# searched modes, the model's adapters): launcher rules read no cluster, so the spaces of other GPUs (`choose`'s
# sweep) ask them once. Emptied past `_MARKS_LIMIT` families.
_MARKS: dict[tuple[object, ...], dict[tuple[object, ...], tuple[Marks, ...]]] = {}
_MARKS_LIMIT = 2**16


class Runnable:
    """Builds the outers at least one allowed launcher runs as emitted (`--launcher` allows one, else any), each
    marked with whether selective and op-level selective recompute stay runnable, and that `Config` and the model
    accept (`estimate.model_refusals`: e.g. a fused loss it has no kernel for). Where only launchers that apply one
    checkpoint policy to every layer run a configuration, it becomes one outer per mode they run, each `uniform`
    (so the search never mixes modes no launcher runs mixed). Launcher rules do not depend on the micro-batch size,
    and of the accumulation steps only on whether a pipeline's degree divides them
    (`capability.whole_pipeline_groups`), so each is asked once per family, and a family no launcher runs builds
    no more outers."""

    _KEYS = tuple(name for name in KNOBS if name not in ("micro_batch", "grad_accum"))

    def __init__(self, graph: LayerGraph, pins: Pins, modes: tuple[Checkpoint, ...], *, launchers: tuple[str, ...],
                 pipeline_launchers: tuple[str, ...]) -> None:
        self.graph = graph
        self.allowed = (pins.launcher,) if pins.launcher else launchers
        self.pipelined = tuple(name for name in self.allowed if name in pipeline_launchers)
        self.modes, self.lora = modes, graph.lora
        if sum(map(len, _MARKS.values())) > _MARKS_LIMIT:
            _MARKS.clear()
        self.memo = _MARKS.setdefault((self.allowed, self.pipelined, self.modes, self.lora), {})

    def __call__(self, values: dict[str, object]) -> list[Outer]:
        """The outers of `values`, marked, or none where no launcher runs it or `Config` or the model refuses it."""
        known = {**_CONFIG_DEFAULTS, **values}
        pp, grad_accum = known["pp"], known["grad_accum"]
        key = (*(known[name] for name in self._KEYS), pp > 1 and whole_pipeline_groups(pp, grad_accum))
        asked = key in self.memo
        if asked and not self.memo[key]:
            return []
        try:
            outer = Outer(**values, **(self.memo[key][0].fields() if asked else {}))
        except ValueError:
            return []
        if not asked:
            self.memo[key] = self._marks(outer)
            if not self.memo[key]:
                return []
            outer = replace(outer, **self.memo[key][0].fields())
        # the first marks are built in already (a rebuilt frozen record re-runs `Config`'s checks)
        outers = [outer, *(replace(outer, **marks.fields()) for marks in self.memo[key][1:])]
        return [] if not outers or model_refusals(self.graph, outers[0], modes_decided=False) else outers

    def _marks(self, outer: Outer) -> tuple[Marks, ...]:
        """How the launchers that run `outer` checkpoint its layers: per layer (one `Marks`), one mode for every
        layer (one `Marks` per mode they run), or not at all (none)."""
        runners = runnable_by(outer, lora=self.lora, launchers=self.pipelined if outer.pp > 1 else self.allowed)
        if not runners:
            return ()
        # a pinned mode is one mode for every layer already; a pipeline's assignments `pipeline_search` asks each
        if any(REGISTRY[name].per_layer for name in runners) or len(self.modes) == 1 or outer.pp > 1:
            pinned = self.modes[0] if len(self.modes) == 1 else None
            marks = [Marks(selective=bool(selective_runners(runners, all_layers=pinned is Checkpoint.SELECTIVE)),
                           op_selective=bool(op_selective_runners(runners,
                                                                  all_layers=pinned is Checkpoint.OP_SELECTIVE)))]
        else:
            marks = [Marks(selective=mode is Checkpoint.SELECTIVE, op_selective=mode is Checkpoint.OP_SELECTIVE,
                           uniform=mode) for mode in self.modes if _uniform_runs(runners, mode)]
        return tuple(m for m in marks if any(m.runs(mode, outer.activation_offload) for mode in self.modes))


@dataclass(frozen=True, slots=True)
class Marks:
    """What an outer's launchers run of the checkpoint modes (`Outer.selective`, `op_selective`, `uniform`)."""

    selective: bool
    op_selective: bool
    uniform: Checkpoint | None = None

    def fields(self) -> dict[str, object]:
        return {"selective": self.selective, "op_selective": self.op_selective, "uniform": self.uniform}

    def runs(self, mode: Checkpoint, activation_offload: bool) -> bool:
        return mode_runs(mode, activation_offload=activation_offload, selective=self.selective,
                         op_selective=self.op_selective, uniform=self.uniform)


def _uniform_runs(runners: tuple[str, ...], mode: Checkpoint) -> bool:
    """Whether one of `runners` runs `mode` on every layer (no recompute and full recompute all do)."""
    if mode is Checkpoint.SELECTIVE:
        return bool(selective_runners(runners, all_layers=True))
    if mode is Checkpoint.OP_SELECTIVE:
        return bool(op_selective_runners(runners, all_layers=True))
    return True


