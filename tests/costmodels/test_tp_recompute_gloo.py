"""Which forward TP collectives a checkpointed layer runs again in backward, against a real 2-rank gloo run.

One launch runs this file as two worker processes (tests/gloo.torchrun). Each shards the tiny Llama with its HF TP
plan (plain Colwise/RowwiseParallel, as the generated torchrun script does), takes one forward and backward per
checkpoint mode (none; full; op-level SAC with `graphs.sac`'s policy, torchtitan's) and counts the functional
collectives DTensor issues. What a mode adds to the backward over no checkpointing is what its recompute reran.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

from costmodels.tensor_parallel import backward_allreduces, forward_allreduces, recomputed_allreduces
from graphs import Checkpoint, lower
from tests.gloo import torchrun
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
MODES = ("none", "full", "op_selective")
LAYERS = 3  # tiny_values("llama")
ROWWISE = 2  # o_proj and down_proj per layer


def worker(out: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    from transformers import AutoConfig, AutoModelForCausalLM

    from graphs.sac import op_sac_policy

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    values = dict(tiny_values("llama"))
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    counts: dict[str, int] = {}

    def counting(name: str):
        original = getattr(funcol, name)

        def counted(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return original(*args, **kwargs)
        return counted

    for name in ("all_reduce", "all_gather_single", "reduce_scatter_single"):  # DTensor's redistributions
        setattr(funcol, name, counting(name))
    styles = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(),
              "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
              "colwise_gather_output": ColwiseParallel(output_layouts=Replicate())}
    result = {}
    for mode in MODES:
        model = copy.deepcopy(base)
        model.train()
        plan = {}
        for pattern, style in model._tp_plan.items():  # as train_fitplan.py's apply_tensor_parallel
            for name, _ in model.named_modules():
                parts, names = pattern.split("."), name.split(".")
                if len(parts) == len(names) and all(p in ("*", n) for p, n in zip(parts, names, strict=True)):
                    plan[name] = styles[style]
        parallelize_module(model, mesh, plan)
        kwargs = {"use_reentrant": False}
        if mode == "op_selective":
            kwargs["context_fn"] = lambda: create_selective_checkpoint_contexts(op_sac_policy())
        if mode != "none":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        counts.clear()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        forward = dict(counts)
        counts.clear()
        loss.backward()
        result[mode] = {"forward": forward, "backward": dict(counts)}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def counts(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tp") / "counts.json"
    # gloo ranks sometimes abort at teardown on a loaded machine: `torchrun` relaunches such a run once
    done = torchrun(Path(__file__), str(out), ranks=2, cwd=REPO)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads(out.read_text())


def test_forward_all_reduces_are_one_per_rowwise_module(counts):
    for mode in MODES:  # checkpointing changes nothing in forward; the embedding's row-wise all-reduce is the +1
        assert counts[mode]["forward"] == {"all_reduce": LAYERS * ROWWISE + 1, "all_gather_single": 1}


def test_modelled_all_reduces_per_step_equal_the_real_run_without_checkpointing(counts, tmp_path):
    # Every node of the lowered tiny Llama: forward (row-wise outputs, the embedding) and backward (each HF
    # column-wise module's input gradient, the LM head's included) against what DTensor issued.
    graph = lower(str(write_config(tmp_path / "tiny-llama", tiny_values("llama"))))
    assert graph.runtime == "hf"
    assert sum(forward_allreduces(layer) for layer in graph.nodes()) == counts["none"]["forward"]["all_reduce"]
    assert sum(backward_allreduces(graph, layer) for layer in graph.nodes()) == \
        counts["none"]["backward"]["all_reduce"]


@pytest.mark.parametrize("mode", [Checkpoint.FULL, Checkpoint.OP_SELECTIVE])
def test_recomputed_allreduces_equal_what_the_backward_reran(counts, mode):
    rerun = counts[mode.value]["backward"]["all_reduce"] - counts["none"]["backward"]["all_reduce"]
    assert rerun == LAYERS * recomputed_allreduces(ROWWISE, mode, sequence_parallel=False)
    assert set(counts[mode.value]["backward"]) == set(counts["none"]["backward"]) == {"all_reduce"}


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
