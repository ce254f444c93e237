"""Optimizer-in-backward against real steps: torchtune's per-parameter optimizers stepped from
`register_post_accumulate_grad_hook` (torchtune 0.6.1 training/memory.py `register_optim_in_bwd_hooks`).

A real CPU run checks that no two gradients are alive together; MemTracker over a fake-tensor step checks the
whole allocated peak of `in_backward_terms`.
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import transformers.masking_utils as masking_utils
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import AutoConfig, AutoModelForCausalLM

from costmodels import Config, Engine, Offload, Optimizer, Precision, Workload, lowering_for
from costmodels.memory import allocated_peak, memory_terms
from costmodels.optimizer_in_backward import in_backward_terms, refusals
from graphs import Checkpoint, lower
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

B, S = 2, 64
DTYPES = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16}


def hf_model(values: dict, dtype: torch.dtype, *, checkpoint: bool = False) -> torch.nn.Module:
    fields = dict(values)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype, attn_implementation="sdpa")
    model.train()
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def register_in_backward(model: torch.nn.Module, on_step=None) -> dict:
    """torchtune's `register_optim_in_bwd_hooks`: one AdamW per parameter, stepped and zeroed in its hook."""
    optims = {p: torch.optim.AdamW([p], foreach=True) for p in model.parameters() if p.requires_grad}

    def optim_step(param: torch.nn.Parameter) -> None:
        if on_step is not None:
            on_step(param)
        optims[param].step()
        optims[param].zero_grad()

    for p in optims:
        p.register_post_accumulate_grad_hook(optim_step)
    return optims


def test_a_real_in_backward_step_never_holds_two_gradients():
    """Live gradients are followed by weak references: at each hook, every gradient seen so far that is still
    alive counts. The peak is the largest single gradient, and nothing persists after backward."""
    values = tiny_values("llama")
    torch.manual_seed(0)
    model = hf_model(values, torch.float32)
    seen: list[weakref.ref] = []
    peak = [0]

    def on_step(param: torch.nn.Parameter) -> None:
        seen.append(weakref.ref(param.grad))
        live = [ref() for ref in seen if ref() is not None]
        peak[0] = max(peak[0], sum(g.numel() * g.element_size() for g in live))

    register_in_backward(model, on_step)
    ids = torch.randint(0, values["vocab_size"], (B, S))
    for _ in range(2):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert peak[0] == largest
    assert all(ref() is None for ref in seen)
    assert all(p.grad is None for p in model.parameters())


def memtracker_in_backward_peak(values: dict, dtype: torch.dtype, *, checkpoint: bool) -> int:
    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = hf_model(values, dtype, checkpoint=checkpoint)
            optims = register_in_backward(model)

            def step() -> None:
                ids = torch.randint(0, values["vocab_size"], (B, S))
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

            step()  # creates the states, as any step after the first finds them
            tracker = MemTracker()
            tracker.track_external(model, *optims.values())
            with tracker:
                step()
            return max(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())
    finally:
        masking_utils.find_packed_sequence_indices = original


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("inbwd")


@pytest.mark.slow
@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
@pytest.mark.parametrize("mode", [Checkpoint.NONE, Checkpoint.FULL])
def test_in_backward_allocated_peak_matches_memtracker(precision, mode, folder):
    """Single device, torchtune's setting (pure bf16 or fp32, foreach AdamW per parameter). Same 1% tolerance
    and reasons as tests/costmodels/test_memory_reference.py (host-side step counters, scalars)."""
    values = tiny_values("llama")
    layers = values["num_hidden_layers"]
    config = Config(engine=Engine.DDP, precision=precision, optimizer=Optimizer.ADAMW, micro_batch=B,
                    checkpoint=(mode,) * layers)
    dtype, autocast = lowering_for(config)
    graph = lower(str(write_config(folder / "llama", values)), dtype=dtype, autocast=autocast, attention="sdpa")
    terms = in_backward_terms(graph, config, memory_terms(graph, Workload(seq_len=S, global_batch=B), config))
    predicted, _, _ = allocated_peak(terms, config.layer_modes(layers))
    measured = memtracker_in_backward_peak(values, DTYPES[precision], checkpoint=mode is Checkpoint.FULL)
    assert predicted == pytest.approx(measured, rel=0.01)
    # Below the ordinary step where its peak holds gradients (the optimizer step after full recompute); equal
    # where the peak is at the loss, before any gradient exists.
    plain, at, _ = allocated_peak(memory_terms(graph, Workload(seq_len=S, global_batch=B), config),
                                  config.layer_modes(layers))
    assert predicted < plain if at.at == "optimizer step" else predicted == plain


def test_refusals_name_each_incompatible_setting():
    ok = Config(engine=Engine.FSDP2, zero=3, dp=4, precision=Precision.BF16)
    assert refusals(ok, clip_grad_norm=False) == []
    assert refusals(Config(), clip_grad_norm=False) == []
    cases = {
        "grad_accum=4": (Config(grad_accum=4), False),
        "clipping": (Config(), True),
        "DeepSpeed": (Config(engine=Engine.DEEPSPEED, zero=2, dp=2), False),
        "DDP with dp=2": (Config(dp=2), False),
        "offloaded": (Config(engine=Engine.FSDP2, zero=3, optimizer_offload=Offload.CPU,
                             param_offload=Offload.CPU), False),
        "fp16": (Config(precision=Precision.FP16_MIXED), False),
    }
    for word, (config, clip) in cases.items():
        reasons = refusals(config, clip_grad_norm=clip)
        assert len(reasons) == 1 and word.split()[0].lower() in reasons[0].lower(), (word, reasons)
