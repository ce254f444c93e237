"""The intermediate results the cost modules pass each other: a rank's model states, its matmul weights, and the
memory terms a peak is computed from. Plain data at the bottom of costmodels (each producer imports this module,
never the other way)."""

from __future__ import annotations

from dataclasses import dataclass

from graphs import Checkpoint

from .activations import NodeMemory
from .pipeline import Moment


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelStates:
    """Bytes per rank. `grads` is what persists between steps; unsharded gradients that accumulate during the
    first micro-batch's backward are `accumulating_grads` (they appear in the activation timeline)."""

    params: int
    grads: int
    accumulating_grads: int
    master: int
    optimizer: int
    step_temp: int
    cpu: int
    nvme: int

    @property
    def gpu_total(self) -> int:
        return self.params + self.grads + self.master + self.optimizer


@dataclass(frozen=True, slots=True)
class Gemm:
    """One matmul weight of a layer on one rank: `n` outputs over a reduction of `k`, run on `routed` times the
    tokens (an expert stack's top-k, else 1) and held `copies` times (the experts of a stack, else 1)."""

    n: int
    k: int
    routed: int = 1
    copies: int = 1
    norm_fed: bool = False
    """Reads the block's norm output (a column-parallel linear of a pre-norm block: q, k, v, gate, up), which
    Transformer Engine's fused norm writes in fp8 itself."""


@dataclass(frozen=True, slots=True)
class Span:
    """One stage of a pipeline rank that runs several (interleaved, ZB-V): its nodes in the rank's terms and
    what a micro-batch of it holds beyond its nodes' own bytes."""

    first: int
    stop: int
    """Its nodes are `MemoryTerms.nodes[first:stop]`."""
    start: int
    """Model-wide activation bytes a micro-batch of the stage has before its first node (`model_wide_bytes` of
    the stage as a model of its own: its inputs where it holds the embedding or the loss, the tables each stage's
    forward builds)."""
    forward_only: int
    """Part of `start` gone once the stage's last decoder layer has run."""
    input_frees_from: int
    """First node after the stage's last trainable node: a zero-bubble input step (I) frees what the nodes from
    here on keep, the rest stays for the weight step (W). `stop` when the last node trains."""
    other_grads: int
    """Accumulating gradient bytes of the rank's other stages: already allocated, at most, while this stage's
    first micro-batch produces its own (a fresh walk)."""


_ALONE = (Moment(0, True, (0,), (0,)), Moment(0, False, (0,), (0,)))
"""One micro-batch with nothing else in flight: its forward, then its backward."""


@dataclass(frozen=True, slots=True)
class MemoryTerms:
    """Everything the peak of one configuration depends on, for every choice of per-layer checkpoint modes."""

    states: ModelStates
    start: int
    """Model-wide activation bytes alive before the first node."""
    forward_only: int
    """Part of `start` gone once the last decoder layer has run."""
    nodes: tuple[tuple[tuple[Checkpoint, NodeMemory], ...], ...]
    """Per node in forward order, its memory in each mode it supports (non-decoder nodes: NONE only)."""
    names: tuple[str, ...]
    """Node names, in the same order."""
    extra: tuple[tuple[int, int, int], ...]
    """Per node, the engine's (forward transient, kept to backward, backward transient) bytes."""
    walks: tuple[tuple[bool, int], ...]
    """Micro-batch timelines to check: (gradients produced stay allocated, gradient bytes already there)."""
    spans: tuple[Span, ...] = ()
    """A pipeline rank's stages when it runs several; empty: the nodes are one stage (`start`, `forward_only`)."""
    moments: tuple[Moment, ...] = ()
    """The points of a pipeline rank's schedule that can hold its peak (`pipeline.rank_moments`): which stage
    runs, forward or backward, and the other in-flight micro-batches of each stage; empty: one micro-batch alone."""
    buffers: int = 0
    """Bytes allocated for the whole step outside the timeline (a pipeline rank's receive buffers)."""

    def stage_spans(self) -> tuple[Span, ...]:
        """The stages, one covering every node when the terms are one stage's."""
        n = len(self.nodes)
        return self.spans or (Span(0, n, self.start, self.forward_only, n, 0),)

    def kept_base(self, span: Span) -> int:
        """The model-wide bytes a micro-batch of the stage keeps after its forward: its start, less what is gone
        once its last decoder layer has run (when it has one)."""
        decoders = any(options[0][1].decoder for options in self.nodes[span.first:span.stop])
        return span.start - (span.forward_only if decoders else 0)

    def moment_list(self) -> tuple[Moment, ...]:
        """The moments, a lone micro-batch's forward and backward when none are given."""
        return self.moments or _ALONE

    def single_stage_others(self) -> int | None:
        """Micro-batches holding what their forward kept beside the running one when every moment has the same
        ones (one stage per rank, no zero-bubble split); None otherwise."""
        moments = self.moment_list()
        if self.spans or any(len(m.full) != 1 or m.after_input[0] for m in moments):
            return None
        counts = {m.full[0] for m in moments}
        return counts.pop() if len(counts) == 1 else None


