"""Per-rank activation memory of real torch.distributed.pipelining schedules over gloo against `pipeline`.

One launch runs this file as PP worker processes. Each builds its stages of a tiny residual MLP (uneven: a
different number of blocks per stage) and runs two training steps of each schedule. During the second, after
every compute action, it takes the union of the tensors autograd has saved (saved-tensor hooks), the stages'
receive buffers and the outputs they cache for backward, and writes the peak of their bytes; the tests compare
it with the cost model exactly.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from costmodels.pipeline import StageActivations, activation_bytes, held_activation_bytes
from costmodels.pipeline_schedule import TORCH_CLASS, Schedule, stage_ranks
from tests.gloo import run_ranks
from tests.saved_tensors import SavedBytes, after

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
PP = 3
HIDDEN, MICRO_BATCH = 16, 2
FLOAT_BYTES = 4
# Residual blocks of global stage s (up to PP * 2 stages): uneven on purpose.
BLOCKS = (2, 1, 3, 1, 2, 2)
# Ample for one tiny step per schedule on two shared cores; a hung p2p fails the launch, not the suite.
LAUNCH_TIMEOUT = 180


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One real step: a schedule, its micro-batches and stages per rank."""

    schedule: Schedule
    m: int
    v: int = 1

    @property
    def name(self) -> str:
        return f"{self.schedule}-m{self.m}-v{self.v}"


CASES = [
    Case(schedule=Schedule.ONE_F_ONE_B, m=5),
    Case(schedule=Schedule.GPIPE, m=4),
    Case(schedule=Schedule.INTERLEAVED_1F1B, m=6, v=2),
    Case(schedule=Schedule.INTERLEAVED_ZB, m=6, v=2),
    Case(schedule=Schedule.ZBV, m=5, v=2),
]


TENSOR_BYTES = MICRO_BATCH * HIDDEN * FLOAT_BYTES


def predicted_stages(count: int) -> list[StageActivations]:
    """What one micro-batch of each stage holds. Saved: per block its input (Linear keeps it for the weight
    gradient) and its Tanh output, less the stage input of a non-first stage (its receive buffer); the last stage
    adds the loss's target (the loss's input is the stage output). Output: the residual sum leaving the stage,
    saved by nobody in it. A zero-bubble input step frees what follows the last Linear: its Tanh output, and the
    loss's target on the last stage."""
    return [StageActivations(saved=(2 * BLOCKS[s] - (s > 0) + (s == count - 1)) * TENSOR_BYTES,
                             output=TENSOR_BYTES, freed_by_input=(1 + (s == count - 1)) * TENSOR_BYTES)
            for s in range(count)]


# --- the reference: real processes --------------------------------------------------------------------------


class Block(nn.Module):
    """x + tanh(W x + b): a residual block, shaped like a transformer layer's saved tensors at small scale."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def stage_module(stage: int) -> nn.Sequential:
    torch.manual_seed(stage)
    return nn.Sequential(*(Block() for _ in range(BLOCKS[stage])))


def key(tensor: torch.Tensor) -> tuple[int, int]:
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


def stage_tensors(stage: PipelineStage) -> set[tuple[int, int]]:
    """The stage's receive buffers (inputs and output gradients, one per micro-batch) and the outputs it keeps
    for backward (`fwd_cache` until B or I, `backward_state` from I to W)."""
    infos = [info for table in (stage.args_recv_info, stage.grad_recv_info) for chunk in table.values()
             for info in chunk if info.buffer is not None]
    outputs = [t for output, _ in stage.fwd_cache.values() for t in output]
    outputs += [t for *_, output, _ in stage.backward_state.values() for t in output]
    return {key(info.buffer) for info in infos} | {key(t) for t in outputs if isinstance(t, torch.Tensor)}


def watch(sched: object, stages: list[PipelineStage], tracker: SavedBytes, peak: list[int]) -> None:
    """After each compute action of a stage and each loss, raise `peak[0]` to the bytes of everything the stages
    and autograd hold."""
    def snapshot() -> None:
        held = tracker.live().union(*(stage_tensors(stage) for stage in stages))
        peak[0] = max(peak[0], sum(nbytes for _, nbytes in held))

    for stage in stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, name, after(getattr(stage, name), snapshot))
    # The schedule computes the loss after the last stage's forward returns.
    sched._maybe_compute_loss = after(sched._maybe_compute_loss, snapshot)


def run_case(case: dict, rank: int) -> dict[str, int]:
    """One measured step of `case` on this rank: the peak saved bytes, the peak of everything held, and the
    saved bytes still held after the step."""
    schedule, m, v = Schedule(case["schedule"]), case["m"], case["v"]
    ranks = stage_ranks(schedule, PP, v)
    mine = [s for s, r in enumerate(ranks) if r == rank]
    stages = [PipelineStage(stage_module(s), s, len(ranks), torch.device("cpu"), group=dist.group.WORLD)
              for s in mine]
    cls = getattr(torch_schedules, TORCH_CLASS[schedule])
    sched = cls(stages[0] if len(stages) == 1 else stages, m, loss_fn=nn.functional.mse_loss)
    torch.manual_seed(100)
    inputs, target = torch.randn(m * MICRO_BATCH, HIDDEN), torch.randn(m * MICRO_BATCH, HIDDEN)
    args = (inputs,) if 0 in mine else ()
    kwargs = {"target": target} if len(ranks) - 1 in mine else {}
    # The first step also infers shapes and warms up p2p: measure the second, steady-state step.
    sched.step(*args, return_outputs=False, **kwargs)
    tracker = SavedBytes([p for stage in stages for p in stage.submod.parameters()])
    everything = [0]
    watch(sched, stages, tracker, everything)
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        sched.step(*args, return_outputs=False, **kwargs)
    return {"saved": tracker.peak, "all": everything[0], "left": tracker.held}


def worker(spec_path: str, rank: int) -> None:
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=PP,
                            timeout=timedelta(seconds=120))
    try:
        results = {case["name"]: run_case(case, rank) for case in spec["cases"]}
    finally:
        dist.destroy_process_group()
    (Path(spec_path).parent / f"rank{rank}.json").write_text(json.dumps(results))


def launch(folder: Path) -> list[dict]:
    """Run every case on PP gloo ranks (this file as a script) and return each rank's peaks."""
    spec = folder / "spec.json"
    spec.write_text(json.dumps({"store": str(folder / "store"),
                                "cases": [{**asdict(c), "name": c.name} for c in CASES]}))
    return run_ranks("tests.costmodels.test_pipeline_gloo", [str(spec)], world=PP, folder=folder,
                     timeout=LAUNCH_TIMEOUT)


# --- the tests ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict]:
    return launch(tmp_path_factory.mktemp("pipeline-gloo"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_activation_bytes_equal_real_schedule_peaks_on_gloo(case, measured):
    """Receive buffers plus in-flight saved tensors and outputs; exact bytes: both sides count whole fp32
    tensors of the same shapes."""
    stages = predicted_stages(len(stage_ranks(case.schedule, PP, case.v)))
    expected = activation_bytes(case.schedule, PP, case.m, v=case.v, stages=stages)
    assert tuple(rank[case.name]["all"] for rank in measured) == expected


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_held_saved_bytes_equal_real_schedule_peaks_on_gloo(case, measured):
    """Autograd's saved tensors alone, counted as they are packed: the stage input and the loss's input (the
    stage output) now count as saved, and no outputs are cached."""
    count = len(stage_ranks(case.schedule, PP, case.v))
    last = count - 1
    stages = [StageActivations(saved=stage.saved + ((s > 0) + (s == last)) * TENSOR_BYTES,
                               freed_by_input=stage.freed_by_input + (s == last) * TENSOR_BYTES)
              for s, stage in enumerate(predicted_stages(count))]
    expected = held_activation_bytes(case.schedule, PP, case.m, v=case.v, stages=stages)
    assert tuple(rank[case.name]["saved"] for rank in measured) == expected


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_real_schedule_step_releases_every_saved_tensor_on_gloo(case, measured):
    """Nothing saved during a step outlives it (else the peak above would not be a steady state)."""
    assert [rank[case.name]["left"] for rank in measured] == [0] * PP


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]))
