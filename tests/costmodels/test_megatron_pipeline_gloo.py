"""Per-rank activation memory of megatron-core's own 1F1B pipeline schedule over gloo against `pipeline`.

Megatron-LM runs its pipelines with megatron-core's schedules, not torch.distributed.pipelining: its
`P2PCommunicator` makes a tensor for each message it receives (`_communicate`), the schedule keeps a received stage
input with its micro-batch until that backward and drops an output gradient once used, and Megatron-LM frees each
stage output's data once sent (`deallocate_pipeline_outputs`, which its arguments.py sets). So a rank holds its
in-flight micro-batches and one output gradient, not torch's receive buffer per micro-batch.

One launch runs this file as PP worker processes. Each runs megatron-core 0.16.1's
`forward_backward_pipelining_without_interleaving` on its stage of a tiny residual MLP for two steps; during the
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
from tests.saved_tensors import SavedBytes

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PP = 3
HIDDEN, MICRO_BATCH, SEQ = 16, 2, 3
FLOAT_BYTES = 4
TENSOR_BYTES = SEQ * MICRO_BATCH * HIDDEN * FLOAT_BYTES  # Megatron's [s, b, h] hidden states
BLOCKS = (2, 1, 3)  # residual blocks per stage: uneven on purpose
MICRO_BATCHES = (5, 3)  # a steady phase, and none (as many micro-batches as stages)
LAUNCH_TIMEOUT = 240


def predicted_saved(stage: int) -> int:
    """What one micro-batch of a stage keeps until its backward: per block its input (Linear keeps it for the weight
    gradient; the first block's is the stage input, received or the batch) and its Tanh output; the last stage's
    loss also keeps the stage output (the square's input)."""
    return (2 * BLOCKS[stage] + (stage == PP - 1)) * TENSOR_BYTES


def predicted(m: int) -> tuple[int, ...]:
    """Per rank: in-flight micro-batches (their outputs freed once sent) plus one output gradient per message."""
    held = held_activation_bytes(Schedule.ONE_F_ONE_B, PP, m,
                                 stages=[StageActivations(saved=predicted_saved(s)) for s in range(PP)])
    boundary = [StageActivations(saved=0, output=TENSOR_BYTES if s < PP - 1 else 0) for s in range(PP)]
    received = receive_buffer_bytes(Schedule.ONE_F_ONE_B, PP, m, stages=boundary, per_message=True)
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
    """The stage as megatron-core drives a model: `config`, `model_type`, and `set_input_tensor` for the received
    stage input (the first stage reads the batch instead)."""
    from megatron.core.enums import ModelType

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(stage)
            self.blocks = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(BLOCKS[stage]))
            self.config, self.model_type, self.input_tensor = config, ModelType.encoder_or_decoder, None

        def set_input_tensor(self, tensor: object) -> None:
            self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

        def forward(self, batch: torch.Tensor) -> torch.Tensor:
            x = batch if stage == 0 else self.input_tensor
            for linear in self.blocks:
                x = x + torch.tanh(linear(x))
            return x

    return Stage()


def run_case(m: int, rank: int) -> dict[str, int]:
    """Two steps of megatron-core's 1F1B with `m` micro-batches; the second measured: the peak of everything
    held at the points the schedule holds most, and the saved bytes still held after it."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    # Megatron-LM's arguments.py sets deallocate_pipeline_outputs; batch_p2p_sync only adds a
    # torch.cuda.synchronize() after the batched p2p (a CPU build has none)
    config = TransformerConfig(num_layers=PP, hidden_size=HIDDEN, num_attention_heads=1, pipeline_dtype=torch.float32,
                               pipeline_model_parallel_size=PP, deallocate_pipeline_outputs=True,
                               batch_p2p_sync=False)
    model = stage_model(rank, config)
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
        output = stage(next(data))

        def loss(out: torch.Tensor) -> tuple[torch.Tensor, dict]:
            value = (out ** 2).mean()
            return value, {"loss": value.detach()}
        return output, loss

    def step(tracker: SavedBytes | None, peak: list[int]) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack) if tracker \
            else contextlib.nullcontext()
        with OnCpu(), mock.patch.object(torch.cuda, "current_device", lambda: "cpu"), hooks:
            schedules.forward_backward_pipelining_without_interleaving(
                forward_step_func=forward_step, data_iterator=iter(batches), model=[model], num_microbatches=m,
                seq_length=SEQ, micro_batch_size=MICRO_BATCH, p2p_communicator=p2p, pg_collection=groups)

    step(None, [0])
    tracker, everything = SavedBytes(list(model.parameters())), [0]

    def snapshot() -> None:
        alive = {(t.data_ptr(), t.numel() * t.element_size()) for t in (ref() for ref in received) if t is not None}
        everything[0] = max(everything[0], sum(nbytes for _, nbytes in tracker.live() | alive))

    def after(run):
        def wrapped(*args, **kwargs):
            result = run(*args, **kwargs)
            snapshot()
            return result
        return wrapped

    def before(run):
        def wrapped(*args, **kwargs):
            snapshot()
            return run(*args, **kwargs)
        return wrapped

    originals = schedules.backward_step, schedules.deallocate_output_tensor
    schedules.backward_step, schedules.deallocate_output_tensor = before(originals[0]), after(originals[1])
    try:
        step(tracker, everything)
    finally:
        schedules.backward_step, schedules.deallocate_output_tensor = originals
    return {"all": everything[0], "left": tracker.held}


def worker(spec_path: str, rank: int) -> None:
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=PP,
                            timeout=timedelta(seconds=120))
    try:
        results = {str(m): run_case(m, rank) for m in spec["micro_batches"]}
    finally:
        dist.destroy_process_group()
    (Path(spec_path).parent / f"rank{rank}.json").write_text(json.dumps(results))


def launch(folder: Path) -> list[dict]:
    spec = folder / "spec.json"
    spec.write_text(json.dumps({"store": str(folder / "store"), "micro_batches": list(MICRO_BATCHES)}))
    return run_ranks("tests.costmodels.test_megatron_pipeline_gloo", [str(spec)], world=PP, folder=folder,
                     timeout=LAUNCH_TIMEOUT)


# --- the tests ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict]:
    pytest.importorskip("megatron.core")
    return launch(tmp_path_factory.mktemp("megatron-pipeline-gloo"))


@pytest.mark.parametrize("m", MICRO_BATCHES)
def test_megatron_schedule_holds_in_flight_sets_and_one_gradient_message_on_gloo(m, measured):
    """Exact bytes: both sides count whole fp32 tensors of the same shapes."""
    assert tuple(rank[str(m)]["all"] for rank in measured) == predicted(m)


@pytest.mark.parametrize("m", MICRO_BATCHES)
def test_megatron_schedule_step_releases_every_saved_tensor_on_gloo(m, measured):
    assert [rank[str(m)]["left"] for rank in measured] == [0] * PP


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]))
