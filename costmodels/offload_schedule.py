"""FSDP2's CPU-offload copies as its streams run them: what the per-unit host-to-device parameter copies and
device-to-host gradient copies add to a micro-batch beyond the compute and collectives they run beside.

Read from torch's `torch/distributed/fsdp/_fully_shard/` (2.13):
- `_fsdp_param.FSDPParam.all_gather_inputs` copies the host shard to the device (`non_blocking=True`, from pinned
  memory) inside `_fsdp_collectives.foreach_all_gather`'s copy-in, on the all-gather copy-in stream; the all-gather
  stream then `wait_stream`s it and runs the collective.
- `_fsdp_param_group.FSDPParamGroup.wait_for_unshard`: the default stream waits the all-gather's event, copies out
  and records an event; the copy-in and all-gather streams wait that copy-out event, in forward deferred to the next
  unit's wait (implicit prefetch: a unit's copy-in may start once the unit two before has copied out), in backward
  at once, before `_backward_prefetch` unshards the next unit (one unit of lookahead).
- `post_backward`: the default stream first waits the oldest kept reduce-scatter event (one input buffer kept:
  `reduce_scatter_max_input_buffers`), then `foreach_reduce` reduce-scatters on its stream after the backward and
  copies the gradient shard to the host on that same stream: `non_blocking` only from pinned memory, with no grad to
  accumulate into and no post-accumulate hook; otherwise the copy blocks the host thread until it lands.
- `finalize_backward` waits every post-reduce event and synchronises the gradients' copy events: the host optimizer
  step runs after all of them (priced apart, `offload`).
The host thread is taken to run ahead of the device (kernels are queued before they run) except where it blocks.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Unit:
    """Seconds of one FSDP2 unit (a decoder layer) in one micro-batch."""

    forward: float
    backward: float
    gather: float
    """One all-gather of its parameters (0 in backward when not resharded after forward)."""
    reduce: float
    """Its gradients' reduce-scatter (with the replicas' all-reduce under hybrid sharding)."""
    up: float
    """Host-to-device copy of its parameter shard (each pass that gathers it)."""
    down: float
    """Device-to-host copy of its gradient shard."""


def forward_seconds(units: Sequence[Unit], *, lead: float = 0.0) -> float:
    """End of the last unit's forward on the default stream; `lead` seconds of compute run before the first unit
    (the root's embedding), beside its copy-in."""
    copied = gathered = 0.0  # ends of the copy-in and all-gather streams
    compute = lead  # end of the default stream
    starts: list[float] = []  # each unit's copy-out (the start of its compute)
    for i, unit in enumerate(units):
        copied = max(copied, starts[i - 2] if i >= 2 else 0.0) + unit.up
        gathered = max(gathered, copied) + unit.gather
        starts.append(max(compute, gathered))
        compute = starts[-1] + unit.forward
    return compute


def backward_seconds(units: Sequence[Unit], *, lead: float = 0.0, tail: float = 0.0,
                     blocking: bool = False) -> float:
    """End of backward with `units` in backward order: the default stream after `tail` (the embedding's backward)
    or the reduce-scatter stream's last copy, whichever is later. `lead` seconds of compute (head, norm, loss) run
    first, beside the first unit's prefetch; `blocking` gradient copies hold the host until they land, so nothing
    issued after them starts earlier."""
    copied = gathered = reduced = 0.0  # ends of the copy-in, all-gather and reduce-scatter streams
    compute = lead
    starts: list[float] = []
    scattered: list[float] = []  # each unit's reduce-scatter end
    landed: list[float] = []  # each unit's gradient copy end
    for k, unit in enumerate(units):
        # prefetched in the previous unit's pre-backward, after its copy-out (and, blocking, two units' copies)
        copied = max(copied, starts[k - 1] if k else 0.0, landed[k - 2] if blocking and k >= 2 else 0.0) + unit.up
        gathered = max(gathered, copied) + unit.gather
        starts.append(max(compute, gathered, scattered[k - 2] if k >= 2 else 0.0,
                          landed[k - 1] if blocking and k else 0.0))
        compute = starts[-1] + unit.backward
        scattered.append(max(reduced, compute) + unit.reduce)
        reduced = scattered[-1] + unit.down
        landed.append(reduced)
    # the embedding's backward queues behind the last post-backward's wait (and, blocking, its copy)
    compute = max(compute, scattered[-2] if len(units) >= 2 else 0.0, landed[-1] if blocking and landed else 0.0)
    return max(compute + tail, reduced)


def exposed_copy_seconds(units: Sequence[Unit], *, forward_lead: float = 0.0, backward_lead: float = 0.0,
                         backward_tail: float = 0.0, blocking: bool = False, regather: bool = True) -> float:
    """Seconds the copies add to one micro-batch's forward and backward (`units` in forward order): the schedule
    with them against the same schedule without (no copies, nothing blocking). A copy hides behind the compute of
    the unit before it; the first unit's copy-in and whatever outlasts the compute stays exposed. Without
    `regather` (not resharded after forward) backward neither gathers nor copies parameters in."""
    return _exposed(tuple(units), forward_lead, backward_lead, backward_tail, blocking, regather)


@functools.lru_cache(maxsize=2**12)
def _exposed(units: tuple[Unit, ...], forward_lead: float, backward_lead: float, backward_tail: float,
             blocking: bool, regather: bool) -> float:
    """`exposed_copy_seconds`, cached: the solver prices the same layers under many configurations."""
    backward = list(reversed(units)) if regather else _replaced(reversed(units), up=0.0, gather=0.0)
    bare, bare_backward = _replaced(units, up=0.0, down=0.0), _replaced(backward, up=0.0, down=0.0)
    return (forward_seconds(units, lead=forward_lead) - forward_seconds(bare, lead=forward_lead)
            + backward_seconds(backward, lead=backward_lead, tail=backward_tail, blocking=blocking)
            - backward_seconds(bare_backward, lead=backward_lead, tail=backward_tail))


def _replaced(units: Iterable[Unit], **changes: float) -> list[Unit]:
    """`replace` over `units`, once per distinct one (a model's layers are mostly the same few units)."""
    made: dict[int, Unit] = {}
    out = []
    for unit in units:
        if id(unit) not in made:
            made[id(unit)] = replace(unit, **changes)
        out.append(made[id(unit)])
    return out
