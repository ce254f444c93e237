"""Per-rank activation memory of megatron-core's own pipeline schedules (1F1B, interleaved) over gloo against
`pipeline`.

Megatron-LM runs its pipelines with megatron-core's schedules, not torch.distributed.pipelining: its
`P2PCommunicator` makes a tensor for each message it receives (`_communicate`), the schedule keeps a received stage
input with its micro-batch until that backward and drops an output gradient once used, and Megatron-LM frees each
stage output's data once sent (`deallocate_pipeline_outputs`, which its arguments.py sets). So a rank holds its
in-flight micro-batches and one output gradient (interleaved, up to four messages), not torch's receive buffer per
micro-batch.

One launch runs this file as PP worker processes. Each runs megatron-core 0.16.1's
`forward_backward_pipelining_without_interleaving` (and `_with_interleaving`, two stages per rank) on its stages of a
tiny residual MLP for two steps; during the
second, as each backward starts and after each stage output is freed, it takes the union of the tensors autograd
has saved (saved-tensor hooks) and the received tensors still alive, and writes the peak of their bytes. The
runtime is CPU-only here: a torch function mode sends the tensors megatron-core makes on "cuda" to the CPU.
"""

from __future__ import annotations

import contextlib
import json
import sys
import weakref
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from costmodels.pipeline import StageActivations, held_activation_bytes, receive_buffer_bytes
from costmodels.pipeline_schedule import Schedule
from tests.gloo import run_ranks
from tests.saved_tensors import SavedBytes, after, before

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PP = 3
HIDDEN, MICRO_BATCH, SEQ = 16, 2, 3
FLOAT_BYTES = 4
TENSOR_BYTES = SEQ * MICRO_BATCH * HIDDEN * FLOAT_BYTES  # Megatron's [s, b, h] hidden states
BLOCKS = (2, 1, 3, 1, 2, 2)  # residual blocks of global stage s (up to PP x 2 stages): uneven on purpose
# (stages per rank, micro-batches): a steady phase; none (as many micro-batches as stages); fewer micro-batches than
# stages, which megatron-core's 1F1B runs and torch's refuses; interleaved, two lengths
CASES = ((1, 5), (1, 3), (1, 2), (2, 6), (2, 9))
LAUNCH_TIMEOUT = 240


def schedule_of(v: int) -> Schedule:
    return Schedule.ONE_F_ONE_B if v == 1 else Schedule.INTERLEAVED_1F1B


def predicted_saved(stage: int, stages: int) -> int:
    """What one micro-batch of a stage keeps until its backward: per block its input (Linear keeps it for the weight
    gradient; the first block's is the stage input, received or the batch) and its Tanh output; the last stage's
    loss also keeps the stage output (the square's input)."""
    return (2 * BLOCKS[stage] + (stage == stages - 1)) * TENSOR_BYTES


def predicted(v: int, m: int) -> tuple[int, ...]:
    """Per rank: in-flight micro-batches (their outputs freed once sent) plus the messages the runtime holds:
    one output gradient, interleaved four messages (`pipeline.receive_buffer_bytes`)."""
    count = PP * v
    held = held_activation_bytes(schedule_of(v), PP, m, v=v,
                                 stages=[StageActivations(saved=predicted_saved(s, count)) for s in range(count)])
    boundary = [StageActivations(saved=0, output=TENSOR_BYTES if s < count - 1 else 0) for s in range(count)]
    received = receive_buffer_bytes(schedule_of(v), PP, m, v=v, stages=boundary, per_message=True)
    return tuple(h + r for h, r in zip(held, received, strict=True))


# --- the reference: real processes --------------------------------------------------------------------------


class OnCpu(TorchFunctionMode):
    """Tensors megatron-core makes on device "cuda" (its token counters) made on the CPU; its receive tensors
    ask `torch.cuda.current_device()`, patched to answer "cpu" beside it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def stage_model(stage: int, config: object) -> nn.Module:
    """Global stage `stage` as megatron-core drives a model chunk: `config`, `model_type`, and `set_input_tensor`
    for the received stage input (stage 0 reads the batch instead)."""
    from megatron.core.enums import ModelType

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(stage)
            self.blocks = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(BLOCKS[stage]))
            self.config, self.model_type, self.input_tensor = config, ModelType.encoder_or_decoder, None

        def set_input_tensor(self, tensor: object) -> None:
            self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

        def forward(self, batch: torch.Tensor | None) -> torch.Tensor:
            x = batch if stage == 0 else self.input_tensor
            for linear in self.blocks:
                x = x + torch.tanh(linear(x))
            return x

    return Stage()


def run_case(v: int, m: int, rank: int) -> dict[str, int]:
    """Two steps of megatron-core's 1F1B (interleaved over `v` stages per rank when v > 1) with `m` micro-batches;
    the second measured: the peak of everything held at the points the schedule holds most, and the saved bytes
    still held after it."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    # As Megatron-LM's arguments.py configures them: deallocate_pipeline_outputs; --overlap-p2p-communication on
    # (its default) for the interleaved schedule, off without one, and batch_p2p_comm = not overlap_p2p_comm.
    # batch_p2p_sync only adds a torch.cuda.synchronize() after a batched p2p (a CPU build has none).
    config = TransformerConfig(num_layers=PP * v, hidden_size=HIDDEN, num_attention_heads=1,
                               pipeline_dtype=torch.float32, pipeline_model_parallel_size=PP,
                               virtual_pipeline_model_parallel_size=v if v > 1 else None,
                               deallocate_pipeline_outputs=True, overlap_p2p_comm=v > 1, batch_p2p_comm=v == 1,
                               batch_p2p_sync=False)
    chunks = [stage_model(k * PP + rank, config) for k in range(v)]  # Megatron's chunk k of rank r: stage k PP + r
    own = [dist.new_group(ranks=[r]) for r in range(PP)][rank]  # tp, cp, dp: this rank alone
    groups = ProcessGroupCollection()
    groups.tp, groups.cp, groups.dp_cp, groups.pp, groups.embd, groups.pos_embd = own, own, own, dist.group.WORLD, \
        None, None
    p2p = P2PCommunicator(pp_group=dist.group.WORLD, config=config)
    received: list[weakref.ref] = []
    communicate = p2p._communicate

    def recording(**kwargs):
        prev, nxt, reqs = communicate(**kwargs)
        received.extend(weakref.ref(t) for t in (prev, nxt) if t is not None)
        return prev, nxt, reqs

    p2p._communicate = recording
    torch.manual_seed(100)
    batches = [torch.randn(SEQ, MICRO_BATCH, HIDDEN) for _ in range(m)]

    def forward_step(data: object, stage: nn.Module) -> tuple[torch.Tensor, object]:
        output = stage(next(data) if data is not None else None)

        def loss(out: torch.Tensor) -> tuple[torch.Tensor, dict]:
            value = (out ** 2).mean()
            return value, {"loss": value.detach()}
        return output, loss

    def step(tracker: SavedBytes | None) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack) if tracker \
            else contextlib.nullcontext()
        run = schedules.forward_backward_pipelining_without_interleaving if v == 1 else \
            schedules.forward_backward_pipelining_with_interleaving
        data = iter(batches) if v == 1 else [iter(batches) if k == 0 else None for k in range(v)]
        with OnCpu(), mock.patch.object(torch.cuda, "current_device", lambda: "cpu"), hooks:
            run(forward_step_func=forward_step, data_iterator=data, model=chunks, num_microbatches=m, seq_length=SEQ,
                micro_batch_size=MICRO_BATCH, p2p_communicator=p2p, pg_collection=groups)

    step(None)
    tracker, everything = SavedBytes([p for chunk in chunks for p in chunk.parameters()]), [0]

    def snapshot() -> None:
        alive = {(t.data_ptr(), t.numel() * t.element_size()) for t in (ref() for ref in received) if t is not None}
        everything[0] = max(everything[0], sum(nbytes for _, nbytes in tracker.live() | alive))

    originals = schedules.backward_step, schedules.deallocate_output_tensor
    schedules.backward_step = before(originals[0], snapshot)
    schedules.deallocate_output_tensor = after(originals[1], snapshot)
    try:
        step(tracker)
    finally:
        schedules.backward_step, schedules.deallocate_output_tensor = originals
    return {"all": everything[0], "left": tracker.held}


def worker(spec_path: str, rank: int) -> None:
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=PP,
                            timeout=timedelta(seconds=120))
    try:
        results = {f"v{v}-m{m}": run_case(v, m, rank) for v, m in spec["cases"]}
    finally:
        dist.destroy_process_group()
    (Path(spec_path).parent / f"rank{rank}.json").write_text(json.dumps(results))


def launch(folder: Path) -> list[dict]:
    spec = folder / "spec.json"
    spec.write_text(json.dumps({"store": str(folder / "store"), "cases": list(CASES)}))
    return run_ranks("tests.costmodels.test_megatron_pipeline_gloo", [str(spec)], world=PP, folder=folder,
                     timeout=LAUNCH_TIMEOUT)


# --- the tests ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict]:
    pytest.importorskip("megatron.core")
    return launch(tmp_path_factory.mktemp("megatron-pipeline-gloo"))


@pytest.mark.parametrize(("v", "m"), CASES, ids=lambda value: str(value))
def test_megatron_schedule_holds_in_flight_sets_and_its_messages_on_gloo(v, m, measured):
    """Exact bytes (both sides count whole fp32 tensors of the same shapes) with one stage per rank. Interleaved,
    the model prices on every rank the four messages the schedule held on the last rank at its peak (exact there),
    two above what the other ranks held at theirs."""
    got, priced = tuple(rank[f"v{v}-m{m}"]["all"] for rank in measured), predicted(v, m)
    if v == 1:
        assert got == priced
    else:
        assert all(0 <= p - g <= 2 * TENSOR_BYTES for p, g in zip(priced, got, strict=True)), (got, priced)
        assert got[-1] == priced[-1]


@pytest.mark.parametrize(("v", "m"), CASES, ids=lambda value: str(value))
def test_megatron_schedule_step_releases_every_saved_tensor_on_gloo(v, m, measured):
    assert [rank[f"v{v}-m{m}"]["left"] for rank in measured] == [0] * PP


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]))
