"""Optimizer-in-backward: each parameter is stepped, and its gradient freed, as soon as backward has produced it.

torchtune's `optimizer_in_bwd: True` (torchtune 0.6.1 training/memory.py `register_optim_in_bwd_hooks`) builds one
optimizer per parameter and registers `param.register_post_accumulate_grad_hook(optim_step)`, where `optim_step`
calls that optimizer's `step()` then `zero_grad()` (set_to_none). No gradient persists between steps: a
parameter's gradient lives from the moment autograd accumulates it until its hook has stepped, on top of what the
backward of its node holds anyway. Under FSDP2 the hooks run after the unit's reduce-scatter
(torch `_fsdp_collectives.foreach_reduce` calls `_post_accumulate_grad_hooks`), and the unit's sharded gradients
are views of one reduce-scatter output, freed together once all of them have stepped.
"""

from __future__ import annotations

from dataclasses import replace

from graphs import LayerGraph

from . import optimizers, precision
from .config import Config
from .engines import rules_of
from .terms import MemoryTerms, ModelStates
from .zero import local_elements, local_shape, shard_ranks


def refusals(config: Config, *, clip_grad_norm: bool) -> list[str]:
    """Why `config` cannot step its optimizer in backward (empty when it can; `Config.in_backward_refusals`)."""
    return config.in_backward_refusals(clip_grad_norm=clip_grad_norm)


def in_backward_states(graph: LayerGraph, config: Config, states: ModelStates) -> ModelStates:
    """No persistent or accumulating gradients; one optimizer per parameter tensor (bitsandbytes keeps
    quantisation maps per optimizer instance).

    Each step's temporary is one tensor's (a one-tensor foreach step). It exists only while that tensor's
    gradient is alive, a moment inside its node's backward window but not at that node's peak (measured:
    adding it to the node's backward peak overshoots MemTracker by the temporary); it stays a candidate peak
    of its own above the persistent states, as the whole-list step is for ordinary optimizers.
    """
    tensors = sum(n for _, n in graph.tensor_groups(trainable=True))
    extra_maps = (tensors - 1) * optimizers.fixed_state_bytes(config.optimizer) if states.optimizer else 0
    itemsize = precision.state_itemsize(config.precision)
    temp = max((optimizers.step_temp_bytes(config.optimizer, [local_shape(t, tp=config.tp, dp=shard_ranks(config),
                                                                          engine=config.engine, ep=config.ep)],
                                                    itemsize)
                for t, _ in graph.tensor_groups(trainable=True)), default=0)
    return replace(states, grads=0, accumulating_grads=0, step_temp=temp, optimizer=states.optimizer + extra_maps)


def node_backward_extra(graph: LayerGraph, config: Config) -> list[int]:
    """Per node, bytes added to its backward transient: under FSDP2, the unit's sharded gradients (the
    reduce-scatter output, in the reduce dtype) that stay allocated until every hook of the unit has run."""
    if not rules_of(config.engine).reduces_before_grad_hooks:
        return [0] * len(graph.nodes())
    reduce = 4 if precision.is_mixed(config.precision) else precision.compute_itemsize(config.precision)
    return [reduce * local_elements([t for t in layer.params if t.trainable], tp=config.tp, dp=shard_ranks(config),
                                    engine=config.engine, sharded=True, ep=config.ep) for layer in graph.nodes()]


def in_backward_terms(graph: LayerGraph, config: Config, terms: MemoryTerms) -> MemoryTerms:
    """`memory_terms(graph, workload, config)` as an optimizer-in-backward run allocates them: one timeline in
    which each node's new gradients are handed off at once (to the hook, which steps and frees them)."""
    return replace(in_backward_timeline(graph, config, terms), states=in_backward_states(graph, config, terms.states))


def in_backward_timeline(graph: LayerGraph, config: Config, terms: MemoryTerms) -> MemoryTerms:
    """`terms` with the activation timeline of an optimizer-in-backward run (its states left as they are:
    `states.model_states` already applies `in_backward_states` when the knob is on)."""
    extra = tuple((fwd, kept, bwd + add) for (fwd, kept, bwd), add
                  in zip(terms.extra, node_backward_extra(graph, config), strict=True))
    return replace(terms, extra=extra, walks=((False, 0),))
