"""A pipeline rank's allocated peak (`pipeline_stages.rank_memory_terms` through `memory.allocated_peak`) against
a reference that prices each of its stages as a model of its own and walks torch's action order: at every action,
the running stage's forward or backward peak (`activations.walk_phases` of the stage's own terms) plus what every
other in-flight micro-batch of the rank holds (its stage's bytes kept after a forward, less what a zero-bubble
input step freed), the receive buffers, and the persistent states."""

from __future__ import annotations

from dataclasses import replace

import pytest

from costmodels import Config, Engine, Precision, Workload
from costmodels.activations import walk_phases
from costmodels.memory import allocated_peak, held_by_stage, memory_terms, pipelined_gathered
from costmodels.pipeline import Moment
from costmodels.pipeline_schedule import Schedule, schedule_order
from costmodels.pipeline_stages import boundary_bytes, rank_config, rank_memory_terms, rank_slices
from graphs import Checkpoint, resolve
from graphs.lowering import lower_resolved

MODEL = "meta-llama/Llama-3.2-1B"  # 16 layers
WORKLOAD = Workload(seq_len=512, global_batch=8)


@pytest.fixture(scope="module")
def graph():
    return lower_resolved(resolve(MODEL))


def reference_peaks(graph, config: Config) -> list[int]:
    """Per rank, the peak over torch's order with each stage priced alone (see the module docstring)."""
    peaks = []
    for slice_, ops in zip(rank_slices(graph, WORKLOAD, config),
                           schedule_order(config.pp_schedule, config.pp, config.grad_accum, config.pp_virtual),
                           strict=True):
        whole = memory_terms(slice_.graph, WORKLOAD, rank_config(config, slice_))
        # receive buffers, what an engine that syncs once per step keeps gathered all step (FSDP2), and the
        # module buffers of the rank's layers (`LayerGraph.layer_buffers`)
        buffers = whole.buffers + slice_.buffers + pipelined_gathered(slice_.graph, rank_config(config, slice_))
        per_stage = {}
        for local, (stage, sub) in enumerate(zip(slice_.stages, slice_.stage_graphs, strict=True)):
            own = rank_config(config, slice_, stage=local)
            terms = memory_terms(sub, WORKLOAD, own)
            modes = iter(own.layer_modes(len(sub.decoder_layers())))
            nodes = [dict(options)[next(modes)] if options[0][1].decoder else options[0][1]
                     for options in terms.nodes]
            (full, _), = held_by_stage(terms, nodes)
            # a zero-bubble input step frees what the nodes after the stage's last trainable one keep (the loss)
            trains = [i for i, layer in enumerate(sub.nodes()) if any(p.trainable for p in layer.params)]
            after = full - sum(node.fwd_net - node.released_after_forward for node in nodes[trains[-1] + 1:])
            walks = {fresh: walk_phases(nodes, start=terms.start, forward_only=terms.forward_only, fresh_grads=fresh,
                                        extra=terms.extra, names=terms.names) for fresh, _ in whole.walks}
            others = whole.states.accumulating_grads - terms.states.accumulating_grads
            per_stage[stage] = (full, after, walks, others)
        best = whole.states.step_temp + buffers + whole.states.accumulating_grads  # the optimizer step
        for fresh, before in whole.walks:
            live: dict[tuple[int, int], int] = {}
            for op in ops:
                key = (op.stage, op.micro_batch)
                full, after, walks, other_grads = per_stage[op.stage]
                held = sum(v for k, v in live.items() if k != key)
                own = walks[fresh][0 if op.kind == "F" else 1].bytes
                best = max(best, before + held + own + buffers + (other_grads if fresh else 0))
                if op.kind == "F":
                    live[key] = full
                elif op.kind == "I":
                    live[key] = after
                else:
                    live.pop(key, None)
        peaks.append(whole.states.gpu_total + best)
    return peaks


CASES = [
    (Schedule.INTERLEAVED_1F1B, 4, 8, 2, Engine.DDP),
    (Schedule.INTERLEAVED_1F1B, 2, 4, 4, Engine.MEGATRON),
    (Schedule.INTERLEAVED_1F1B, 4, 8, 3, Engine.MEGATRON),  # 12 stages of 16 layers: uneven, rank-balanced
    (Schedule.INTERLEAVED_1F1B, 2, 4, 8, Engine.DDP),  # a layer per stage: the most stages per rank
    (Schedule.INTERLEAVED_ZB, 4, 8, 2, Engine.DDP),
    (Schedule.ZBV, 4, 8, 2, Engine.DDP),
    (Schedule.ZBV, 2, 6, 2, Engine.FSDP2),
    (Schedule.ONE_F_ONE_B, 4, 8, 1, Engine.DDP),
]


@pytest.mark.parametrize(("schedule", "pp", "m", "v", "engine"), CASES, ids=str)
@pytest.mark.parametrize("recompute", ["none", "mixed"])
def test_rank_peak_equals_its_stages_priced_alone_over_torch_order(graph, schedule, pp, m, v, engine, recompute):
    layers = len(graph.decoder_layers())
    modes = () if recompute == "none" else tuple(Checkpoint.FULL if i % 3 == 0 else Checkpoint.NONE
                                                 for i in range(layers))
    config = Config(pp=pp, pp_schedule=schedule, pp_virtual=v, grad_accum=m, micro_batch=1, engine=engine,
                    zero=2 if engine is Engine.FSDP2 else 0, precision=Precision.BF16_MIXED, checkpoint=modes)
    expected = reference_peaks(graph, config)
    for slice_, peak in zip(rank_slices(graph, WORKLOAD, config), expected, strict=True):
        own = rank_config(config, slice_)
        terms = rank_memory_terms(slice_, WORKLOAD, config)
        assert allocated_peak(terms, own.layer_modes(len(slice_.graph.decoder_layers())))[0] == peak


def test_interleaved_rank_0_holds_more_of_its_heavier_stage_than_whole_passes_priced(graph):
    """Rank 0 of interleaved 1F1B (pp=4, v=2, m=8) holds 11 stage sets at most. The earlier rule priced them as
    6 whole passes through both its stages (12 sets), yet that was not an upper bound: while the rank runs a
    backward it holds 7 micro-batches of stage 0 and 3 of stage 4, not 5 and 5, and stage 0 is the heavier (3
    layers to 2: the split gives the last stage, with the head and loss, fewer)."""
    config = Config(pp=4, pp_schedule=Schedule.INTERLEAVED_1F1B, pp_virtual=2, grad_accum=8, micro_batch=1,
                    precision=Precision.BF16_MIXED, pp_split=(3, 2, 2, 2, 2, 2, 2, 1))
    slice_ = rank_slices(graph, WORKLOAD, config)[0]
    assert [len(g.decoder_layers()) for g in slice_.stage_graphs] == [3, 2]
    assert slice_.in_flight == 11
    assert Moment(0, False, (7, 3), (0, 0)) in slice_.moments
    modes = config.layer_modes(len(slice_.graph.decoder_layers()))
    exact = allocated_peak(rank_memory_terms(slice_, WORKLOAD, config), modes)[0]
    passes = replace(memory_terms(slice_.graph, WORKLOAD, config), buffers=slice_.buffers,
                     moments=(Moment(0, True, (5,), (0,)), Moment(0, False, (5,), (0,))))
    assert exact > allocated_peak(passes, modes)[0]


@pytest.mark.parametrize("m", [4, 16])
def test_megatron_ranks_receive_one_gradient_message_torch_ranks_a_buffer_per_micro_batch(graph, m):
    """torch.distributed.pipelining keeps an input and an output-gradient buffer per micro-batch all step;
    megatron-core makes a tensor per message (its gloo test: tests/costmodels/test_megatron_pipeline_gloo.py), so a
    Megatron rank holds one output gradient beside its in-flight micro-batches (which keep their inputs), whatever
    the micro-batches (Llama-2-7B's Mist runs, 64 micro-batches: 2 GiB per middle rank priced before)."""
    per_rank = {}
    for engine in (Engine.MEGATRON, Engine.DDP):
        config = Config(pp=4, pp_schedule=Schedule.ONE_F_ONE_B, grad_accum=m, micro_batch=1, engine=engine,
                        precision=Precision.BF16_MIXED)
        per_rank[engine] = [slice_.buffers for slice_ in rank_slices(graph, WORKLOAD, config)]
    boundary = boundary_bytes(graph, WORKLOAD, Config(micro_batch=1, precision=Precision.BF16_MIXED))
    assert per_rank[Engine.MEGATRON] == [boundary, boundary, boundary, 0]
    assert per_rank[Engine.DDP] == [m * boundary, 2 * m * boundary, 2 * m * boundary, m * boundary]
