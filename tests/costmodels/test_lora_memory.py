"""LoRA memory against the model fitplan's own torchrun script builds and trains.

The reference is the emitted `train_fitplan.py` itself: its `build` (transformers' `from_config` in the plan's
dtype, PEFT's `get_peft_model` as the script calls it) run on CPU tensors, and one forward under the script's
autocast, with torch's `saved_tensors_hooks` attributing each saved storage to the decoder layer that first saved
it (the model's parameters and the batch left out, as the script's own `saved_bytes` does). On a lent H200 the
script's construction as it stood (fp32 frozen base, PEFT's fp32 adapters) measured 103.2 GiB allocated for
Llama-3.2-3B LoRA at 4 x 4096 tokens against 80.7 GiB estimated (benchmarks/data/gpu/h200_plans.json).
"""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
import torch
import transformers.masking_utils as masking_utils

from costmodels import shared_lowering
from graphs import LoraSpec, lower
from solver import solve
from solver.cli.commands import emit_files
from solver.hardware.check import plan_config
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

pytestmark = pytest.mark.slow

B, S = 3, 40  # the lowering's probes use b in {2, 4} and s in {32, 64, 96}
LORA = LoraSpec(rank=8, alpha=16)


def _script(folder: Path, model_dir: Path, precision: str) -> types.ModuleType:
    """The torchrun script of a one-GPU DDP LoRA plan for the model in `model_dir`, imported as a module."""
    plan = solve(str(model_dir), "1xCPU", seq_len=32, global_batch=2, time_limit=5, lora=LORA, engine="ddp",
                 precision=(precision,), micro_batch=2, checkpoint="none")
    emit_files(plan, "torchrun", folder)
    spec = importlib.util.spec_from_file_location("train_fitplan", folder / "train_fitplan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.plan = plan
    return module


def _saved_per_layer(script: types.ModuleType, model: torch.nn.Module, vocab: int) -> list[int]:
    """Bytes each decoder layer saves for backward in one forward of (B, S) tokens under the script's autocast."""
    layers = script.decoder_layers(model)
    current: list[int | None] = [None]
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None))
    ids = torch.randint(0, vocab, (B, S))
    owned = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers(), ids)}
    first: dict[int, tuple[int | None, int]] = {}
    kept = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in owned and storage._cdata not in first:
            first[storage._cdata] = (current[0], storage.nbytes())
            kept.append(storage)
        return tensor

    # the script's `main`: DDP under mixed precision runs forward under torch.autocast in the 16-bit dtype
    half = {"bf16-mixed": torch.bfloat16}.get(script.PLAN["decisions"]["precision"])
    autocast = torch.autocast("cpu", dtype=half) if half else torch.autocast("cpu", enabled=False)
    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None  # as the lowering traces (graphs.fake)
    try:
        with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            script.forward_loss(model, ids, ids)
    finally:
        masking_utils.find_packed_sequence_indices = original
    return [sum(n for layer, n in first.values() if layer == i) for i in range(len(layers))]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_lora_saved_activations_equal_the_torchrun_scripts_own_model(arch, precision, tmp_path):
    values = tiny_values(arch)
    model_dir = write_config(tmp_path / "model", values)
    script = _script(tmp_path / "out", model_dir, precision)
    torch.manual_seed(0)
    model = script.build(types.SimpleNamespace(model=str(model_dir), from_config=True), torch.device("cpu"))
    model.train()
    measured = _saved_per_layer(script, model, values["vocab_size"])
    dtype, autocast = shared_lowering(plan_config(script.plan), lora=True)
    graph = lower(str(model_dir), dtype=dtype, autocast=autocast, lora=LORA, attention="sdpa", use_cache=False)
    priced = [layer.cost().saved(B, S) for layer in graph.decoder_layers()]
    # Every layer after the first saves exactly what the lowering prices. The first one's input comes from the
    # frozen embedding and needs no gradient, so what only the input's gradient needs is not kept: its input
    # norm's fp32 copy of the input and rstd, and under autocast the 16-bit casts of the q/k/v adapters' fp32
    # lora_A weights (one (rank, hidden) each). The lowering prices it as any other layer, that much above; rotary
    # cos/sin, saved by every layer, are the graph's shared bytes (the hooks book them on the first layer).
    assert priced[1:] == measured[1:]
    hidden = values["hidden_size"]
    casts = 3 * LORA.rank * hidden * 2 if autocast else 0
    skipped = B * S * hidden * 4 + B * S * 4 + casts
    assert priced[0] + graph.shared(B, S) - measured[0] == skipped


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed", "bf16"])
def test_lora_parameters_equal_the_torchrun_scripts_own_model(precision, tmp_path):
    # The frozen base is loaded in the 16-bit compute dtype (no master copy to keep), the adapters in fp32 under
    # mixed precision (PEFT's default upcast, cast per use by autocast) and in bf16 under pure bf16.
    model_dir = write_config(tmp_path / "model", tiny_values("llama"))
    script = _script(tmp_path / "out", model_dir, precision)
    model = script.build(types.SimpleNamespace(model=str(model_dir), from_config=True), torch.device("cpu"))
    built = sum(p.numel() * p.element_size() for p in model.parameters())
    assert script.plan.estimate.memory.parameters == built
