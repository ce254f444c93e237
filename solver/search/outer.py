"""An outer configuration: a `Config` whose per-layer checkpoint modes the inner search decides, marked with which
modes the launchers that run it can put layers in (`runnable.Runnable` marks them)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from costmodels import Config
from graphs import Checkpoint
from solver.search.pins import KNOBS

# The knobs declared part of the strategy (`Knob.strategy`): tp, cp, pp, ep, engine, zero and the offloads.
STRATEGY = tuple(name for name, declared in KNOBS.items() if declared.knob.strategy)


@dataclass(frozen=True, slots=True, kw_only=True)
class Outer(Config):
    """One outer configuration: a `Config` whose per-layer checkpoint modes the inner search decides."""

    selective: bool = True
    """Whether a launcher that runs this configuration can also run selective recompute on the layers the
    search picks (`capability.selective_runners`); without one the search leaves SELECTIVE out."""
    op_selective: bool = True
    """The same for op-level selective checkpointing (`capability.op_selective_runners`, OP_SELECTIVE)."""
    uniform: Checkpoint | None = None
    """The one mode every layer takes where only launchers that apply one policy to every layer run this
    configuration (torchtitan, axolotl: `Launcher.per_layer`); the space holds one outer per such mode. None: the
    search decides per layer."""

    def runs(self, mode: Checkpoint) -> bool:
        """Whether a launcher that runs this configuration can put layers in checkpoint `mode` (`mode_runs`)."""
        return mode_runs(mode, activation_offload=self.activation_offload, selective=self.selective,
                         op_selective=self.op_selective, uniform=self.uniform)

    def config(self, checkpoint: tuple[Checkpoint, ...] = ()) -> Config:
        """The `Config` of these knobs with per-layer `checkpoint` modes (one validated instance per outer: the
        search asks for it many times)."""
        return _config(self, tuple(checkpoint))

    @property
    def family(self) -> tuple[object, ...]:
        """What makes two configurations distinct alternatives: the parallel, sharding and offload strategy, the
        knobs declared `Knob.strategy` (micro-batch, checkpointing and same-cost precision/optimizer variants
        aside)."""
        return tuple(getattr(self, name) for name in STRATEGY)


def mode_runs(mode: Checkpoint, *, activation_offload: bool, selective: bool, op_selective: bool,
              uniform: Checkpoint | None = None) -> bool:
    """Whether layers can take checkpoint `mode` where a launcher runs selective / op-level selective recompute
    or not (activation offload runs only with every layer fully checkpointed: torchtune refuses it otherwise), and,
    where only one-policy launchers run the configuration, whether `mode` is its `uniform` one (a mode that every
    layer then takes: the searches give every layer a mode that runs)."""
    if activation_offload:
        return mode is Checkpoint.FULL and uniform in (None, Checkpoint.FULL)
    if uniform is not None:
        return mode is uniform
    return {Checkpoint.SELECTIVE: selective, Checkpoint.OP_SELECTIVE: op_selective}.get(mode, True)


@functools.lru_cache(maxsize=2**16)
def _config(outer: Outer, checkpoint: tuple[Checkpoint, ...]) -> Config:
    return Config(**{name: getattr(outer, name) for name in KNOBS if name != "checkpoint"}, checkpoint=checkpoint)


