"""Module buffers on a pipeline rank against torchtitan's own pipeline split: torchtitan's Llama keeps a RoPE cache
of `training.seq_len` positions in every attention layer (a buffer, built once), and `_split_module` leaves each
stage only its own layers. A rank therefore holds its stages' caches once for the run, however many micro-batches
its schedule keeps in flight (it was priced as a model-wide tensor of every layer, once per in-flight set: 11 GiB
on rank 0 of Llama-3.1-405B at pp 8 with interleaved 1F1B)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from costmodels import Config, Engine, Precision, Workload
from costmodels.memory import allocated_peak, memory_terms, pipelined_gathered
from costmodels.pipeline_schedule import TORCH_CLASS, Schedule
from costmodels.pipeline_stages import rank_config, rank_memory_terms, rank_slices
from graphs import Checkpoint, resolve
from graphs.poly import ZERO
from graphs.titan import lower_titan

MODEL = "meta-llama/Llama-3.1-8B"  # 32 layers, untied (torchtitan refuses pipelines of tied embeddings)
SEQ = 1024
CASES = [(Schedule.INTERLEAVED_1F1B, 2, 4, 2), (Schedule.ONE_F_ONE_B, 4, 8, 1), (Schedule.ZBV, 2, 4, 2)]


@pytest.fixture(scope="module")
def graph():
    return lower_titan(MODEL)


def config_of(schedule: Schedule, pp: int, m: int, v: int) -> Config:
    return Config(pp=pp, pp_schedule=schedule, pp_virtual=v, grad_accum=m, micro_batch=1, dp=2, engine=Engine.FSDP2,
                  zero=2, precision=Precision.BF16_MIXED, checkpoint=(Checkpoint.FULL,) * 32)


def torchtitan_rank_buffers(graph, config: Config, workload: Workload) -> list[int]:
    """Per pipeline rank, the bytes of the buffers its stage modules hold: torchtitan's model built for
    `training.seq_len` (its own `update_from_config`), cut by its `_split_module` into fitplan's stages and
    assigned to ranks by its `_get_pp_rank_to_stage_indices_mapping`."""
    from torchtitan.distributed.pipeline_parallel import _get_pp_rank_to_stage_indices_mapping, _split_module
    from torchtitan.trainer import Trainer

    from graphs.architectures import titan_family
    from graphs.measure import transformers_config
    from graphs.titan import build_titan, titan_config

    resolved = resolve(MODEL)
    hf = transformers_config(resolved)
    model_config = titan_config(hf, family=titan_family(resolved.model_type), layers=hf.num_hidden_layers)
    trainer = Trainer.Config()
    trainer.training.seq_len = workload.seq_len
    trainer.parallelism.pipeline_parallel_degree = config.pp
    model_config.update_from_config(config=trainer)
    model = build_titan(model_config)
    split = sorted((stage, n) for s in rank_slices(graph, workload, config)
                   for stage, n in zip(s.stages, (len(g.decoder_layers()) for g in s.stage_graphs), strict=True))
    starts = [sum(n for _, n in split[:k]) for k in range(len(split))]
    names = [[f"layers.{i}" for i in range(start, start + n)] for start, (_, n) in zip(starts, split, strict=True)]
    assert starts[-1] + split[-1][1] == hf.num_hidden_layers
    schedule = TORCH_CLASS[config.pp_schedule].removeprefix("Schedule")
    return [sum(b.nbytes for stage in _get_pp_rank_to_stage_indices_mapping(rank, config.pp, schedule, len(names))
                for b in _split_module(model, names[stage]).buffers())
            for rank in range(config.pp)]


@pytest.mark.parametrize(("schedule", "pp", "m", "v"), CASES, ids=str)
def test_a_rank_holds_its_own_layers_rope_caches_once_beside_its_states(graph, schedule, pp, m, v):
    config = config_of(schedule, pp, m, v)
    workload = Workload(seq_len=SEQ, global_batch=m * config.dp)
    expected = torchtitan_rank_buffers(graph, config, workload)
    for slice_ in rank_slices(graph, workload, config):
        terms = rank_memory_terms(slice_, workload, config)
        own = terms.buffers - slice_.buffers - pipelined_gathered(slice_.graph, rank_config(config, slice_))
        assert own == expected[slice_.rank], slice_.rank


@pytest.mark.parametrize(("schedule", "pp", "m", "v"), CASES, ids=str)
def test_module_buffers_add_to_a_rank_peak_once_whatever_its_micro_batches_in_flight(graph, schedule, pp, m, v):
    config = config_of(schedule, pp, m, v)
    workload = Workload(seq_len=SEQ, global_batch=m * config.dp)
    expected = torchtitan_rank_buffers(graph, config, workload)
    bare = replace(graph, layer_buffers=ZERO, _memo={})
    for slice_, without in zip(rank_slices(graph, workload, config), rank_slices(bare, workload, config), strict=True):
        own = rank_config(config, slice_).layer_modes(len(slice_.layers))
        with_buffers, _, _ = allocated_peak(rank_memory_terms(slice_, workload, config), own)
        plain, _, _ = allocated_peak(rank_memory_terms(without, workload, config), own)
        assert slice_.in_flight > 1 or schedule is Schedule.ONE_F_ONE_B
        assert with_buffers - plain == expected[slice_.rank], slice_.rank


def test_one_micro_batch_of_a_whole_model_keeps_no_module_buffer(graph):
    """Without a pipeline the caches are priced once as before, now beside the states (the optimizer step too)."""
    config = Config(micro_batch=1, precision=Precision.BF16_MIXED)
    terms = memory_terms(graph, Workload(seq_len=SEQ, global_batch=1), config)
    assert terms.buffers == 32 * SEQ * 64 * 8  # 32 layers' complex64 [seq, head_dim / 2]
    assert graph.shared(1, SEQ) == 0
