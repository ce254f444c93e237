"""The head and loss of each runtime against that runtime's own code.

Hugging Face's loss is what the lowering traces: its event sequence, put in place of the lowered head and loss
nodes, must leave every timeline peak unchanged. torchtune's chunked loss (`CEWithChunkedOutputLoss` and the
recipe's `chunked_output`, quoted below) and liger-kernel's fused linear cross-entropy (its own installed code,
pointed at its CUDA branches, with the Triton kernels replaced by no-ops, since they write in place and allocate
nothing) run a real training step on fake tensors under MemTracker, against `allocated_peak`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import weakref

import pytest
import torch
import torch.nn.functional as F
import transformers.masking_utils as masking_utils
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

from costmodels import Config, Engine, Precision, Workload, lowering_for
from costmodels.activations import walk
from costmodels.loss import (
    HeadShape,
    Loss,
    chunk_tokens,
    chunked_loss,
    head_shape,
    hf_loss,
    liger_chunk_size,
    loss_nodes,
    loss_terms,
    net,
    peak,
    refusals,
    replace_head_nodes,
)
from costmodels.memory import allocated_peak, memory_terms
from graphs import lower
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

B, S = 2, 96
DTYPES = {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16, Precision.BF16_MIXED: torch.float32}
# A vocabulary large enough that the head and loss set the peak, as they do for real LLMs.
VOCAB = 2048


def values_for(arch: str) -> dict:
    return {**tiny_values(arch), "vocab_size": VOCAB}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("loss")


def lowered(folder, arch: str, config: Config):
    dtype, autocast = lowering_for(config)
    return lower(str(write_config(folder / arch, values_for(arch))), dtype=dtype, autocast=autocast,
                 attention="sdpa")


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # tied and untied head
@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
@pytest.mark.parametrize("micro_batch", [1, 2])
def test_hf_sequence_equals_the_lowered_head_and_loss(arch, precision, micro_batch, folder):
    config = Config(engine=Engine.DDP, precision=precision, micro_batch=micro_batch)
    graph = lowered(folder, arch, config)
    terms = memory_terms(graph, Workload(seq_len=S, global_batch=micro_batch), config)
    x = head_shape(graph, config, b=micro_batch, s=S)
    ours = replace_head_nodes(terms, *loss_nodes(hf_loss(x), x))
    modes = config.layer_modes(len(graph.decoder_layers()))
    for fresh in (True, False):
        def nodes(t):
            return [options[0][1] for options in t.nodes]
        before = walk(nodes(terms), start=terms.start, forward_only=terms.forward_only, fresh_grads=fresh,
                      extra=terms.extra, names=terms.names)
        after = walk(nodes(ours), start=ours.start, forward_only=ours.forward_only, fresh_grads=fresh,
                     extra=ours.extra, names=ours.names)
        assert after.bytes == pytest.approx(before.bytes, abs=64), fresh  # scalars (the loss, its sums)
    assert allocated_peak(ours, modes)[0] == pytest.approx(allocated_peak(terms, modes)[0], abs=64)


# torchtune 0.6.1 modules/loss/ce_chunked_output_loss.py, `CEWithChunkedOutputLoss` (docstrings left out).
class CEWithChunkedOutputLoss(torch.nn.Module):
    def __init__(self, num_output_chunks: int = 8, ignore_index: int = -100):
        super().__init__()
        self.num_output_chunks = num_output_chunks
        self.ignore_index = ignore_index

    def compute_cross_entropy(self, logits, labels, normalize=True):
        return F.cross_entropy(logits.float(), labels, ignore_index=self.ignore_index, reduction="sum")

    def forward(self, logits, labels):
        total_elements = (labels != self.ignore_index).sum()
        labels = [target_chunk.reshape(-1) for target_chunk in labels.chunk(self.num_output_chunks, dim=1)]
        logits = [logit_chunk.reshape(-1, logit_chunk.size(-1)) for logit_chunk in logits]
        total_loss = 0.0
        for logits_chunk, labels_chunk in zip(logits, labels, strict=True):
            total_loss += self.compute_cross_entropy(logits_chunk, labels_chunk)
        return total_loss / total_elements


def chunked_step(model, ids, labels, chunks: int):
    """torchtune 0.6.1 recipes/full_finetune_single_device.py `_loss_step` with `TransformerDecoder.chunked_output`
    (modules/transformer.py): the head per `h.chunk(n, dim=1)`, labels shifted by `torch.hstack`, `del logits`."""
    h = model.model(input_ids=ids, use_cache=False).last_hidden_state
    # F.linear is `nn.Linear.forward` (no bias); MemTracker refuses one module called several times in a pass.
    logits = [F.linear(chunk, model.lm_head.weight) for chunk in h.chunk(chunks, dim=1)]
    del h
    ignore = torch.full((labels.shape[0], 1), -100, dtype=labels.dtype)
    labels = torch.hstack((labels[..., 1:], ignore))
    loss = CEWithChunkedOutputLoss(chunks)(logits, labels)
    del logits
    return loss


class _NoKernel:
    """A Triton kernel launch `kernel[grid](...)` that does nothing (the real ones write in place)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.fixture(scope="module")
def liger_loss():
    """`LigerForCausalLMLoss` running liger-kernel's own `fused_linear_cross_entropy_forward` on its CUDA branches
    (device checks read as CUDA sm90, CUDA autocast checks read as CPU autocast)."""
    pytest.importorskip("liger_kernel")
    import liger_kernel.ops.fused_linear_cross_entropy as flce
    import liger_kernel.transformers.functional as functional
    from liger_kernel.transformers.model.loss_utils import LigerForCausalLMLoss

    source = inspect.getsource(flce)
    edits = {'grad_weight.device.type == "cuda"': "True", '_input.device.type != "cuda"': "False",
             "torch.is_autocast_enabled()": 'torch.is_autocast_enabled("cpu")',
             'torch.get_autocast_dtype("cuda")': 'torch.get_autocast_dtype("cpu")'}
    for old, new in edits.items():
        assert old in source, f"liger-kernel changed: {old!r} not found"
        source = source.replace(old, new)
    namespace = {"__name__": flce.__name__}
    exec(compile(source, flce.__file__, "exec"), namespace)
    namespace["liger_cross_entropy_kernel"] = namespace["element_mul_kernel"] = _NoKernel()
    original_item, original_equal = torch.Tensor.item, torch.equal
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(functional, "LigerFusedLinearCrossEntropyFunction",
                      namespace["LigerFusedLinearCrossEntropyFunction"])
        patch.setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: (9, 0))
        # Fake tensors have no values: the token count and the `grad_output == 1` test read none that matter.
        patch.setattr(torch.Tensor, "item",
                      lambda self: 1 if isinstance(self, FakeTensor) else original_item(self))
        patch.setattr(torch, "equal", lambda a, b: False if isinstance(a, FakeTensor) else original_equal(a, b))
        yield LigerForCausalLMLoss


def memtracker_peak(values: dict, dtype: torch.dtype, *, autocast: bool, step) -> int:
    fields = dict(values)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype, attn_implementation="sdpa")
            model.train()
            opt = torch.optim.AdamW(model.parameters(), foreach=True)

            def train_step() -> None:
                ids = torch.randint(0, config.vocab_size, (B, S))
                cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
                with cast:
                    loss = step(model, ids, ids.clone())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            train_step()
            tracker = MemTracker()
            tracker.track_external(model, opt)
            with tracker:
                train_step()
            return max(snapshot["Total"] for snapshot in tracker.get_tracker_snapshot("peak").values())
    finally:
        masking_utils.find_packed_sequence_indices = original


def predicted_peak(folder, arch: str, config: Config, loss: Loss, chunks: int = 8) -> int:
    graph = lowered(folder, arch, config)
    terms = memory_terms(graph, Workload(seq_len=S, global_batch=B), config)
    replaced = loss_terms(graph, config, terms, loss, seq_len=S, chunks=chunks)
    return allocated_peak(replaced, config.layer_modes(len(graph.decoder_layers())))[0]


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops create under the mode and that are still alive, and their peak (the
    storages of `existing` tensors are not new when an op returns a view of them)."""

    def __init__(self, *existing: torch.Tensor) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = {t.untyped_storage()._cdata for t in existing}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage()._cdata not in self.seen:
                storage = tensor.untyped_storage()
                key, size = storage._cdata, storage.nbytes()
                self.seen.add(key)
                self.live += size
                weakref.finalize(storage, self._free, key, size)
        self.peak = max(self.peak, self.live)
        return out

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self.seen.discard(key)

    def reset_peak(self) -> int:
        self.peak = self.live
        return self.live


@pytest.mark.parametrize(("dtype", "b", "chunks"), [(torch.float32, 2, 8), (torch.bfloat16, 2, 8),
                                                   (torch.bfloat16, 1, 5), (torch.float32, 3, 7)])
def test_chunked_sequence_matches_storage_lifetimes(dtype, b, chunks):
    """torchtune's head and loss alone on real CPU tensors, every storage followed from creation to release. Here
    MemTracker reports the backward of the per-chunk head matmuls higher (by up to two chunks of fp32 logits
    gradients) although weak references show each chunk's logits gradient gone before the next chunk's matmul
    runs; the lifetimes are what this test follows."""
    s, hidden, vocab = 96, 128, 2048
    c = torch.tensor([], dtype=dtype).element_size()
    weight = torch.nn.Parameter(torch.randn(vocab, hidden, dtype=dtype))
    x0 = torch.randn(b, s, hidden, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (b, s))
    with LiveBytes(weight, x0, labels) as mode:
        h = x0.clone()  # the final norm's output, which nothing but the head refers to
        start = mode.reset_peak()
        logits = [F.linear(chunk, weight) for chunk in h.chunk(chunks, dim=1)]
        del h
        shifted = torch.hstack((labels[..., 1:], torch.full((b, 1), -100)))
        loss = CEWithChunkedOutputLoss(chunks)(logits, shifted)
        del logits, shifted
        forward_peak, kept = mode.peak - start, mode.live - start
        before = mode.reset_peak()
        loss.backward()
        backward_peak = mode.peak - before
    x = HeadShape(b=b, s=s, hidden=hidden, vocab=vocab, itemsize=c, weight_itemsize=c,
                  weight_grad=vocab * hidden * c, tied=False)
    memory = chunked_loss(x, chunks)
    assert peak(memory.forward) == pytest.approx(forward_peak, abs=64)  # scalars: the loss and its sums
    assert net(memory.forward) - memory.released == pytest.approx(kept, abs=64)
    assert peak(memory.backward) == pytest.approx(backward_peak, abs=64)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "precision", "chunks"),
                         [("llama", Precision.BF16, 8), ("mistral", Precision.BF16, 5)])
def test_chunked_loss_peak_matches_memtracker(arch, precision, chunks, folder):
    config = Config(engine=Engine.DDP, precision=precision, micro_batch=B)
    measured = memtracker_peak(values_for(arch), DTYPES[precision], autocast=False,
                               step=lambda model, ids, labels: chunked_step(model, ids, labels, chunks))
    assert predicted_peak(folder, arch, config, Loss.CHUNKED, chunks) == pytest.approx(measured, rel=0.01)
    assert predicted_peak(folder, arch, config, Loss.CHUNKED, chunks) < predicted_peak(folder, arch, config, Loss.HF)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "precision"), [
    ("llama", Precision.BF16), ("llama", Precision.FP32), ("mistral", Precision.BF16),
    ("llama", Precision.BF16_MIXED), ("mistral", Precision.BF16_MIXED)])
def test_fused_linear_loss_peak_matches_memtracker(arch, precision, folder, liger_loss):
    config = Config(engine=Engine.DDP, precision=precision, micro_batch=B)
    hidden = values_for(arch)["hidden_size"]

    def fused_step(model, ids, labels):
        h = model.model(input_ids=ids, use_cache=False).last_hidden_state
        return liger_loss(h, model.lm_head.weight, labels, hidden, num_items_in_batch=B * S)

    measured = memtracker_peak(values_for(arch), DTYPES[precision], autocast=precision is Precision.BF16_MIXED,
                               step=fused_step)
    assert predicted_peak(folder, arch, config, Loss.FUSED_LINEAR) == pytest.approx(measured, rel=0.01)
    assert predicted_peak(folder, arch, config, Loss.FUSED_LINEAR) < predicted_peak(folder, arch, config, Loss.HF)


def test_liger_chunk_size_follows_its_formula():
    """liger's own worked example (ops/fused_linear_cross_entropy.py comment): BT = 4096*4, V = 32000, H = 4096
    gives inc_factor 8 and chunk_size 2048."""
    assert liger_chunk_size(4096 * 4, 4096, 32000) == 2048
    assert liger_chunk_size(100, 4096, 128256) == 4  # next power of two of ceil(100 / 32)
    assert liger_chunk_size(8, 4096, 4096) == 8  # one chunk covers BT


def test_chunk_tokens_follow_torch_chunk():
    for s, n in [(96, 8), (100, 8), (7, 3), (5, 8)]:
        assert chunk_tokens(2, s, n) == [2 * t.shape[1] for t in torch.zeros(2, s).chunk(n, dim=1)]


def test_refusals(folder):
    config = Config(engine=Engine.DDP, precision=Precision.BF16_MIXED, micro_batch=B)
    graph = lowered(folder, "llama", config)
    assert refusals(Loss.HF, graph, config) == []
    assert refusals(Loss.FUSED_LINEAR, graph, config) == []
    assert "autocast" in refusals(Loss.CHUNKED, graph, config)[0]
    assert refusals(Loss.CHUNKED, lowered(folder, "llama", Config(precision=Precision.BF16)),
                    Config(precision=Precision.BF16)) == []
    gpt2 = lowered(folder, "gpt2", Config(precision=Precision.BF16))
    assert "model type 'gpt2'" in refusals(Loss.FUSED_LINEAR, gpt2, Config(precision=Precision.BF16))[0]
    # liger-kernel 0.8.5 patches granite but its patch raises NotImplementedError for the fused loss, and it patches
    # qwen3_5 with it (tests/graphs/test_architectures.py calls both patch functions): the same graph under each name.
    assert "model type 'granite'" in refusals(Loss.FUSED_LINEAR, dataclasses.replace(graph, model_type="granite"),
                                              config)[0]
    assert refusals(Loss.FUSED_LINEAR, dataclasses.replace(graph, model_type="qwen3_5"), config) == []
