"""The generated torchrun script runs torchtune's chunked cross-entropy and activation offloading as fitplan prices
them (issue 14): the emitted train_fitplan.py's own functions, on a tiny Llama on the CPU, give transformers' loss
and gradients, and the bytes autograd keeps on the device (and, offloaded, sends to the host) equal the plan's
estimate, with every difference named.

The device-side bytes are the script's own report (`saved_bytes`: every storage saved for backward once, less
parameters, buffers and the batch), as `fitplan check` reads it; the estimate is the plan's activation timeline
(`memory_terms`, with the chunked loss's head node and the offloaded nodes), each node in the plan's mode."""

from __future__ import annotations

import argparse
import dataclasses
import math
import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from costmodels import Workload
from costmodels.activation_offload import MIN_OFFLOAD_BYTES, moved_bytes
from costmodels.activations import evaluate
from costmodels.config import Loss
from costmodels.loss import TORCHTUNE_CHUNKS, HeadShape, chunk_tokens, chunked_loss, net, peak
from costmodels.memory import memory_terms
from graphs import Checkpoint, FitplanError, LoraSpec, Role
from solver import solve
from solver.cli.commands import emit_files
from solver.hardware.check import compare, plan_config, plan_graph
from solver.plan.capability import REGISTRY
from solver.plan.launchers import emit
from solver.plan.launchers.support import unsupported
from tests.costmodels.test_loss import LiveBytes
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values
from tests.solver.test_train_script import run

S = 128  # b * s * 4 >= MIN_OFFLOAD_BYTES: the final norm's reciprocal root is offloaded, as at training shapes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_config(tmp_path_factory.mktemp("tiny-llama"), tiny_values("llama"))


def plan_and_script(model_dir: Path, folder: Path, **pins) -> tuple[object, dict]:
    plan = solve(str(model_dir), "1xCPU", seq_len=S, global_batch=pins["micro_batch"], grad_accum=1, time_limit=5,
                 offload="none", param_offload="none", engine="ddp", **pins)
    folder.mkdir()
    for name, text in emit(plan, "torchrun").items():
        (folder / name).write_text(text)
    assert "fitplan" not in {line.split()[1].split(".")[0] for line in (folder / "train_fitplan.py").read_text()
                             .splitlines() if line.startswith(("import ", "from "))}
    return plan, runpy.run_path(str(folder / "train_fitplan.py"), run_name="fitplan_emitted")


def priced_device_bytes(plan) -> int:
    """Saved activation bytes of one micro-batch the plan keeps on the device: each node's saved bytes in its mode
    after the loss and offload replace theirs, plus the model-wide tensors when some layer is not checkpointed whole
    (`solver.hardware.check.saved_activation_bytes`)."""
    config = plan_config(plan)
    graph = plan_graph(plan, config)
    terms = memory_terms(graph, Workload(seq_len=S, global_batch=config.micro_batch), config)
    modes = iter(config.layer_modes(len(graph.decoder_layers())))
    total, plain = 0, False
    for node, options in zip(graph.nodes(), terms.nodes, strict=True):
        mode = next(modes) if node.role is Role.DECODER else Checkpoint.NONE
        plain |= node.role is Role.DECODER and mode is not Checkpoint.FULL
        total += dict(options)[mode].saved
    shared = evaluate(graph.shared, b=config.micro_batch, s=S, tp=1, sequence_parallel=False)
    return total + (shared if plain else 0)


def loss_scalars(plan) -> int:
    """Bytes of the 0-dim tensors the chunked loss saves, which fitplan's chunked loss leaves out: each chunk's
    `nll_loss` saves its fp32 `total_weight`, and the division by the real tokens saves their int64 count."""
    if plan.decisions.loss is not Loss.CHUNKED:
        return 0
    return len(chunk_tokens(plan.decisions.micro_batch, S, TORCHTUNE_CHUNKS)) * 4 + 8


def run_script(namespace: dict, model_dir: Path, b: int) -> dict:
    """One micro-batch through the script's own model set-up and `forward_loss`, against the same model's
    transformers loss (labels = ids, shifted inside) and gradients on the same batch."""
    d = namespace["PLAN"]["decisions"]
    torch.manual_seed(0)
    model = namespace["build"](argparse.Namespace(model=str(model_dir), from_config=True), torch.device("cpu"))
    model.train()
    namespace["apply_checkpointing"](model)
    ids = torch.randint(0, model.config.vocab_size, (b, S), generator=torch.Generator().manual_seed(1))
    reference = model(input_ids=ids, labels=ids, use_cache=False).loss
    reference.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    if d["loss"] == "chunked":
        namespace["apply_chunked_output"](model)
    offload = namespace["OffloadActivations"](torch.device("cpu")) if d["activation_offload"] else None
    if offload is not None:
        namespace["keep_head_on_device"](model)
    found = [0]
    with namespace["saved_bytes"](model, (ids, ids), found):
        loss = namespace["forward_loss"](model, ids, ids, offload)
    loss.backward()
    return {"loss": loss, "reference": reference, "found": found[0], "offload": offload,
            "grads": {name: p.grad for name, p in model.named_parameters() if p.grad is not None}, "expected": expected}


def assert_same_training(run: dict, dtype: torch.dtype) -> None:
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-3}
    torch.testing.assert_close(run["loss"], run["reference"], **tolerance)
    for name, grad in run["grads"].items():
        torch.testing.assert_close(grad, run["expected"][name], **tolerance, msg=name)


@pytest.mark.parametrize(("precision", "b"), [("fp32", 2), ("bf16", 1), ("bf16", 2)])
def test_chunked_loss_equals_transformers_and_saves_what_is_priced(precision, b, model_dir, tmp_path):
    """Exact but for the loss's 0-dim tensors (`loss_scalars`). b = 1 chunks `h` into views (the head saves one
    storage), b = 2 into strided views that the head copies (one per chunk)."""
    plan, namespace = plan_and_script(model_dir, tmp_path / "out", micro_batch=b, precision=(precision,),
                                      loss="chunked")
    assert plan.decisions.loss is Loss.CHUNKED and not plan.decisions.activation_offload
    assert namespace["CHUNKS"] == TORCHTUNE_CHUNKS
    run = run_script(namespace, model_dir, b)
    assert_same_training(run, torch.float32 if precision == "fp32" else torch.bfloat16)
    assert run["found"] == priced_device_bytes(plan) + loss_scalars(plan)


@pytest.mark.parametrize("offload", [False, True])
def test_chunked_loss_under_lora_saves_what_is_priced(offload, model_dir, tmp_path):
    """LoRA leaves the head frozen: its matmuls need only the weight for the input's gradient and save no input,
    as `chunked_loss` prices a frozen head. The chunked plan's estimate misses what the same plan with transformers'
    loss misses (its final norm's input and reciprocal root without offload, the same in both)."""
    lora = LoraSpec(rank=4, alpha=8, targets=("all-linear",), dropout=0.0)
    gaps = {}
    for loss in ("hf", "chunked"):
        plan, namespace = plan_and_script(model_dir, tmp_path / loss, micro_batch=2, precision=("fp32",), loss=loss,
                                          activation_offload=offload, lora=lora)
        assert plan.decisions.lora is not None and plan.decisions.activation_offload is offload
        run = run_script(namespace, model_dir, 2)
        assert_same_training(run, torch.float32)
        gaps[loss] = run["found"] - priced_device_bytes(plan) - loss_scalars(plan)
    assert gaps["chunked"] == gaps["hf"]
    if offload:  # the final norm's tensors go to the host: transformers' loss is then exact
        assert gaps["hf"] == 0


class StandIn(torch.nn.Module):
    """What `apply_chunked_output` reads of a transformers CausalLM: the decoder under `base_model_prefix`, here
    handing over `pending` (the final norm's output, which then nothing but the head refers to), and the head."""

    base_model_prefix = "model"

    def __init__(self, head: torch.nn.Linear) -> None:
        super().__init__()
        self.lm_head, self.pending = head, []
        self.model = lambda **kwargs: argparse.Namespace(last_hidden_state=self.pending.pop())

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head


@pytest.mark.parametrize(("dtype", "b", "frozen"), [(torch.float32, 2, False), (torch.bfloat16, 2, False),
                                                    (torch.bfloat16, 1, False), (torch.float32, 3, False),
                                                    (torch.float32, 2, True), (torch.bfloat16, 1, True)])
def test_chunked_loss_allocates_and_frees_as_priced(dtype, b, frozen, model_dir, tmp_path):
    """The script's head and loss alone on real CPU tensors, every storage followed from creation to release
    (`LiveBytes`, as tests/costmodels/test_loss.py follows torchtune's code): forward peak, what stays for backward
    and backward peak equal `chunked_loss`'s event sequences, within the loss's scalars (tensors of at most 8b
    bytes)."""
    _, namespace = plan_and_script(model_dir, tmp_path / "out", micro_batch=1, precision=("fp32",), loss="chunked")
    s, hidden, vocab = 96, 128, 2048
    c = torch.tensor([], dtype=dtype).element_size()
    head = torch.nn.Linear(hidden, vocab, bias=False, dtype=dtype).requires_grad_(not frozen)  # LoRA freezes it
    x0 = torch.randn(b, s, hidden, dtype=dtype, requires_grad=True)
    ids = torch.randint(0, vocab, (b, s))
    model = StandIn(head)
    namespace["apply_chunked_output"](model)
    with LiveBytes(head.weight, x0, ids) as mode:
        model.pending.append(x0.clone())  # h: allocated when the head starts, as `chunked_loss` counts from there
        start = mode.reset_peak()
        loss = namespace["forward_loss"](model, ids, ids)
        forward_peak, kept = mode.peak - start, mode.live - start
        before = mode.reset_peak()
        loss.backward()
        backward_peak = mode.peak - before
    memory = chunked_loss(HeadShape(b=b, s=s, hidden=hidden, vocab=vocab, itemsize=c, weight_itemsize=c,
                                    weight_grad=0 if frozen else vocab * hidden * c, tied=False), TORCHTUNE_CHUNKS)
    # what `chunked_loss` leaves out: per chunk its loss, `total_weight` and running sum (4 B each), the ignored
    # label column (8b B) and the count of real tokens (8 B)
    scalars = 12 * len(chunk_tokens(b, s, TORCHTUNE_CHUNKS)) + 8 * b + 8
    assert 0 <= forward_peak - peak(memory.forward) <= scalars
    assert 0 <= kept - (net(memory.forward) - memory.released) <= scalars
    assert peak(memory.backward) == pytest.approx(backward_peak, abs=scalars)
    reference = F.cross_entropy(F.linear(x0, head.weight)[:, :-1].float().reshape(-1, vocab), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, reference, rtol=1e-5 if dtype == torch.float32 else 2e-2, atol=1e-6)


@pytest.mark.parametrize("loss", ["hf", "chunked"])
def test_activation_offload_keeps_on_the_device_what_is_priced(loss, model_dir, tmp_path):
    """Device side, exact: the offloading hooks leave only the head's and the loss's saved tensors (the scalars of
    the chunked loss, `loss_scalars`). Host side: each layer's checkpointed input with its rotary tables, exact per
    `moved_bytes`; the hooks copy each saved tensor, so the final norm's input and reciprocal root, saved twice
    (`pow` and `mul`), go twice where fitplan counts each storage once, and the token ids the embedding saves go
    too (they stay on the device as the batch; fitplan prices no copy of them)."""
    plan, namespace = plan_and_script(model_dir, tmp_path / "out", micro_batch=2, precision=("fp32",), loss=loss,
                                      activation_offload=True)
    d = plan.decisions
    assert d.activation_offload and set(d.checkpoint) == {Checkpoint.FULL}
    run = run_script(namespace, model_dir, 2)
    assert_same_training(run, torch.float32)
    assert run["found"] == priced_device_bytes(plan) + loss_scalars(plan)
    offload = run["offload"]
    assert offload.kept == 0  # at these shapes every non-parameter tensor saved under the hooks is >= 1024 bytes
    config = plan_config(plan)
    hidden, tokens = tiny_values("llama")["hidden_size"], 2 * S
    norm_twice, ids = tokens * hidden * 4 + tokens * 4, tokens * 8
    assert min(tokens * 4, ids) >= MIN_OFFLOAD_BYTES
    assert offload.moved == sum(moved_bytes(plan_graph(plan, config), config, b=2, s=S)) + norm_twice + ids
    assert offload.saved == {}  # backward brought every tensor back


def test_offload_below_the_threshold_stays_on_the_device(model_dir, tmp_path):
    """The hooks' size rule alone: a saved tensor under MIN_OFFLOAD_BYTES stays; one at it is copied."""
    _, namespace = plan_and_script(model_dir, tmp_path / "out", micro_batch=1, precision=("fp32",),
                                   activation_offload=True)
    hooks = namespace["OffloadActivations"](torch.device("cpu"))
    small = torch.ones(MIN_OFFLOAD_BYTES // 4 - 1, requires_grad=True)
    large = torch.ones(MIN_OFFLOAD_BYTES // 4, requires_grad=True)
    with hooks:
        out = (small * small).sum() + (large * large).sum()
    assert (hooks.kept, hooks.moved) == (2 * small.numel() * 4, 2 * large.numel() * 4)
    out.backward()
    torch.testing.assert_close(large.grad, 2 * large.detach())


def test_only_torchrun_runs_torchtune_savers_and_not_in_a_pipeline(model_dir, tmp_path):
    plan, _ = plan_and_script(model_dir, tmp_path / "out", micro_batch=2, precision=("fp32",), loss="chunked",
                              activation_offload=True)
    assert unsupported("torchrun", plan.decisions, plan.inputs) == []
    for launcher in REGISTRY:
        if launcher == "torchrun":
            continue
        problems = unsupported(launcher, plan.decisions, plan.inputs)
        # torchtitan runs a chunked loss of its own (ChunkedLossWrapper, issue 37), not torchtune's offloading
        assert any("chunked cross-entropy" in p for p in problems) is (launcher != "torchtitan"), launcher
        assert any(p.startswith("activation offloading") for p in problems), launcher
    staged = dataclasses.replace(plan.decisions, pp=2, dp=1, grad_accum=2, pp_split=(2, 1))
    problems = unsupported("torchrun", staged, plan.inputs)
    assert any("chunked cross-entropy" in p for p in problems) and any("activation offloading" in p for p in problems)
    sharded = dataclasses.replace(plan.decisions, tp=2, loss=Loss.HF)
    assert any("activation offloading with tp=2" in p for p in unsupported("torchrun", sharded, plan.inputs))
    fused = dataclasses.replace(plan.decisions, loss=Loss.FUSED_LINEAR)
    with pytest.raises(FitplanError, match="Liger's fused linear cross-entropy"):
        emit(dataclasses.replace(plan, decisions=fused), "torchrun")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("engine", "precision"), [("ddp", "fp32"), ("fsdp2", "bf16-mixed")])
def test_emitted_script_trains_with_both_savers_on_two_ranks(engine, precision, model_dir, tmp_path):
    """The whole script under torchrun (2 gloo ranks): chunked loss and activation offload together train, and each
    rank's report holds the device-side saved bytes priced for it and the bytes it sent to the host."""
    plan = solve(str(model_dir), "2xCPU", seq_len=S, global_batch=4, time_limit=5, offload="none",
                 param_offload="none", engine=engine, tp=1, micro_batch=2, grad_accum=1, precision=(precision,),
                 loss="chunked", activation_offload=True)
    emit_files(plan, "torchrun", tmp_path / "out")
    reports, losses = run(tmp_path / "out" / "train_fitplan.py", model_dir, tmp_path / "report", timeout=300)
    assert len(reports) == 2 and len(losses) == 2 and all(math.isfinite(x) for x in losses)
    config = plan_config(plan)
    moved = sum(moved_bytes(plan_graph(plan, config), config, b=2, s=S))
    hidden, tokens = tiny_values("llama")["hidden_size"], 2 * S
    for got in reports:
        assert got["saved_activation_bytes"] == priced_device_bytes(plan) + loss_scalars(plan)
        assert got["offloaded_activation_bytes"] == moved + tokens * hidden * 4 + tokens * 4 + tokens * 8
    # `fitplan check` compares the same numbers: the device-side bytes as priced, the host transfer beside them
    rows = {row.name: row for row in compare(plan, reports, device="cpu")}
    device = rows["saved activations (one micro-batch)"]  # on the device, as priced
    assert (device.estimated, device.measured - device.estimated) == (priced_device_bytes(plan), loss_scalars(plan))
    host = rows["activations offloaded to the host (one micro-batch)"]
    assert (host.estimated, host.measured) == (moved, reports[0]["offloaded_activation_bytes"])
