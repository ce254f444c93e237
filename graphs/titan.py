"""Lower a model through torchtitan's own model code and activation-checkpoint policies (the torchtitan launcher).

A catalog config becomes torchtitan's `Llama3Model` / `Qwen3Model` config, built on meta and traced on fake CPU
tensors like the HF path (`probe`, `fit`), with each trace layer wrapped by torchtitan's own `FullAC` or
`SelectiveAC` (op-level SAC). Corrections for what the CPU cannot run, each named where it is applied:
- attention runs as torchtitan's SDPA module (CPU flash kernel) instead of compiled FlexAttention, which has no
  CPU backward; both keep q, k, v, the output and an fp32 (b, h, s) logsumexp for backward
  (torch/_higher_order_ops/flex_attention.py `FlexAttentionAutogradOp`), and under SAC the CPU kernel is treated
  as the GPU kernel torchtitan's save list names (`sac.GPU_EQUIVALENT_OPS`). FlexAttention's block mask (a few
  int32 tensors of (s/128)^2 elements, under 0.2 MiB at 8k tokens) is left out;
- torchtitan's norms are `nn.RMSNorm`, whose `F.rms_norm` runs the fused `_fused_rms_norm` kernel on GPUs and
  saves only its input, the fp32 per-row rstd and the weight (aten `derivatives.yaml`; `rms_norm_symint` in
  aten/src/ATen/native/layer_norm.cpp dispatches there unless the weight's dtype differs); the CPU build
  decomposes it and saves fp32 intermediates. `cuda_rms_norm` runs the kernel's autograd formula instead;
- the loss is torchtitan's: `ChunkedLossWrapper` (its shipped Llama 3 jobs; LM head and cross-entropy per
  sequence chunk, each chunk's backward run inside the loss call, so the head has no cost of its own and the loss
  node's forward holds the head's backward too) or the plain `cross_entropy_loss` (sum, fp32 upcast).
Where the plan compiles (`compiled`), blocks without checkpointing are traced as torch.compile trains them
(`compiled.compile_forward`, checked against a real Inductor compile of a torchtitan block on CPU); MoE blocks and
the compiled loss stay eager (upper bounds: compiling only lowers what is saved).
Tensor parallelism is measured like the HF path's, by a widened probe (torchtitan's TP plan is plain column- and
row-wise); the embedding, head and loss are priced replicated, as on the HF path (no loss parallelism).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .architectures import supported, titan_lowering
from .errors import UnsupportedModel
from .fake import to_fake
from .fit import Probes, first_backward, model_wide_bytes, segment_costs, storage_polys
from .graph import LayerGraph, ModelDims
from .layer import Checkpoint, ModeCost, MoE, ParamTensor
from .lowering_keys import PROBE_BATCH, PROBE_SEQ, WIDEN_FACTOR, titan_key
from .poly import Poly
from .probe import MODEL_WIDE, Recording, TraceSlot, model_wide
from .recorder import ScopeTracker, marking_recompute
from .sac import SacRecorder, observing
from .sources import ResolvedModel, resolve
from .structure import layer_signature

# The attention a torchtitan-lowered graph records (its models attend with FlexAttention); a plan priced on it
# carries it, so launchers that run the HF code can tell (`solver.plan.launchers.support`). No HF name equals it.
TITAN_ATTENTION = "flex"

# The checkpoint modes torchtitan runs: none, `FullAC` and `SelectiveAC` (op-level SAC).
TITAN_MODES = (Checkpoint.NONE, Checkpoint.FULL, Checkpoint.OP_SELECTIVE)
LOSSES = ("chunked", "plain")
# `ChunkedLossWrapper.Config.num_chunks` default (torchtitan/components/loss.py, 0.3.0); seq_len must divide by it.
LOSS_CHUNKS = 8
# torchtitan's TP plan (decoder_sharding.py): column-wise projections shard their output rows, row-wise ones
# their input columns; the embedding is sharded on the vocabulary.
_TP_STYLES = {"wqkv": ("colwise", 0), "w1": ("colwise", 0), "w3": ("colwise", 0), "lm_head": ("colwise", 0),
              "wo": ("rowwise", 1), "w2": ("rowwise", 1), "tok_embeddings": ("embedding_rowwise", 0)}


def lower_titan(model: str, *, dtype: str = "bfloat16", loss: str = "chunked", use_cache: bool = True,
                compiled: bool = False) -> LayerGraph:
    """Lower `model` (catalog id, local path or cached Hub id) through torchtitan's model code, with its
    chunked (`LOSS_CHUNKS` chunks) or plain cross-entropy loss; `compiled`: the blocks as torchtitan's
    `[compile]` trains them (`trace_model`)."""
    return lower_titan_resolved(resolve(model), dtype=dtype, loss=loss, use_cache=use_cache, compiled=compiled)


@functools.lru_cache(maxsize=16)
def lower_titan_resolved(resolved: ResolvedModel, *, dtype: str = "bfloat16", loss: str = "chunked",
                         use_cache: bool = True, compiled: bool = False) -> LayerGraph:
    from .assemble import eager_work
    from .cache import cached_or_lowered

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r} must be float32, bfloat16 or float16")
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r} must be one of {LOSSES}")
    key = titan_key(resolved, dtype=dtype, loss=loss, compiled=compiled)

    def traced() -> LayerGraph:
        graph = _measure(resolved, dtype=dtype, loss=loss, compiled=compiled)
        if compiled:  # the memory as compiled, the work as eager (the time model fuses it: costmodels/compilation.py)
            graph = eager_work(graph, lower_titan_resolved(resolved, dtype=dtype, loss=loss, use_cache=use_cache))
        return graph

    return cached_or_lowered(key, traced, use_cache=use_cache)


def _measure(resolved: ResolvedModel, *, dtype: str, loss: str, compiled: bool) -> LayerGraph:
    from .assemble import assemble, dims_of
    from .measure import Study, _versions, transformers_config

    config = transformers_config(resolved)
    dims = dims_of(config)
    lowering = titan_lowering(config.model_type)  # graphs/data/architectures.json
    if lowering is None or (dims.experts and not lowering.moe):
        raise UnsupportedModel(f"torchtitan has no model for {config.model_type!r} ({resolved.id})",
                               f"fitplan lowers torchtitan's {', '.join(supported('torchtitan'))} models.")
    family = lowering.family
    if compiled and dims.experts:
        raise UnsupportedModel(f"torchtitan's compiled MoE blocks are not traced ({resolved.id})",
                               "A compiled MoE plan is priced on its eager blocks (compiling saves memory).")
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model = build_titan(titan_config(config, family=family, layers=dims.layers))
    kinds = _kinds(model)
    slots = [TraceSlot(None, Checkpoint.NONE)] + [TraceSlot(k, m) for k in sorted(set(kinds)) for m in TITAN_MODES]
    params = _param_tensors(model, dtype)
    trace = trace_model(model, kinds, slots, compiled=compiled)
    to_fake(trace, fake, param_dtype=getattr(torch, dtype))

    def run(b: int, s: int) -> Recording:
        with fake:
            return run_titan_pass(trace, slots, b=b, s=s, vocab=dims.vocab, loss=loss)

    base = run(PROBE_BATCH, PROBE_SEQ)
    # torchtitan shards MoE experts under TP with its own expert-tensor-parallel plan (moe_sharding.py), which
    # the widened probe does not model: its MoE models are lowered for TP 1 (their `tp_degrees`).
    widened = None if dims.experts else _widened_run(config, family, dims, kinds, slots, fake, dtype=dtype, loss=loss,
                                                     compiled=compiled)
    probes = Probes(base, run(PROBE_BATCH, 2 * PROBE_SEQ), run(PROBE_BATCH, 3 * PROBE_SEQ),
                    run(2 * PROBE_BATCH, PROBE_SEQ), widened)
    costs = segment_costs(probes)
    if loss == "chunked":
        costs["loss"] = chunked_loss_cost(probes, costs["loss"])
    wide = model_wide_bytes(probes)
    block = next(iter(model.layers.values()))
    study = Study(architecture=type(model).__name__, layer_class=type(block).__name__, attention=TITAN_ATTENTION,
                  dims=dims, itemsize=torch.finfo(getattr(torch, dtype)).bits // 8, params=params, kinds=kinds,
                  slot_scopes={(s.kind, s.mode): f"layers.{j}" for j, s in enumerate(slots) if s.kind is not None},
                  costs=costs, rowwise_modules=[_rowwise(layer) for layer in model.layers.values()],
                  moe=_moe(model, kinds, dims),
                  model_wide=wide, widened=probes.widened is not None,
                  tp_degrees=_tp_degrees(dims) if probes.widened is not None else (1,),
                  versions=(*_versions(), ("torchtitan", _package_version("torchtitan"))))
    graph = assemble(resolved, study, dtype=dtype, autocast=None, lora=None)
    return dataclasses.replace(_with_runtime(graph), layer_buffers=rope_cache_bytes(model))


def _with_runtime(graph: LayerGraph) -> LayerGraph:
    return dataclasses.replace(graph, runtime="torchtitan")


def chunked_loss_cost(probes: Probes, cost: ModeCost) -> ModeCost:
    """The chunked loss node as engines must see it: the LM head's weight gradient appears during its forward
    (each chunk's backward runs there) and stays allocated from then on, so it counts in the forward peak from
    its first chunk and among the node's gradients; `saved` is only what is still alive for backward."""
    from .fit import _segment_memory, _timeline, segments

    line = _timeline(probes.base, storage_polys(probes))
    _, _, fresh_peak, grads, _ = _segment_memory(line, segments(probes.base)[("loss", False)])
    return dataclasses.replace(cost, saved=kept_after_forward(probes, "loss"), fwd_peak=fresh_peak,
                               grads=cost.grads + grads)


def kept_after_forward(probes: Probes, scope: str) -> Poly:
    """Bytes `scope` saved that are still alive when backward starts: the chunked loss runs each chunk's
    backward inside its forward, which frees that chunk's saved logits again."""
    rec = probes.base
    end = first_backward(rec)  # backward starts: what is still alive
    sizes = storage_polys(probes)
    kept = Poly()
    for i, st in enumerate(rec.storages):
        if st.savers == [scope] and i not in rec.global_storages and (st.free_after is None or st.free_after > end):
            kept = kept + sizes[i]
    return kept


def _package_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _widened_run(config: Any, family: str, dims: ModelDims, kinds: list[int], slots: list[TraceSlot],
                 fake: FakeTensorMode, *, dtype: str, loss: str, compiled: bool) -> Recording | None:
    """The base probe on the model with `WIDEN_FACTOR` times the heads and FFN width, or None when its
    parameters did not grow exactly where torchtitan's TP plan shards them."""
    plain = build_titan(titan_config(config, family=family, layers=dims.layers))
    wide = build_titan(titan_config(config, family=family, layers=dims.layers, widen=WIDEN_FACTOR))
    before = {p.name: p for p in _param_tensors(plain, dtype)}
    after = {p.name: p for p in _param_tensors(wide, dtype)}
    grew = before.keys() == after.keys() and all(
        after[n].numel == before[n].numel * (WIDEN_FACTOR if p.tp_dim is not None and p.node.startswith("layers.")
                                             else 1) for n, p in before.items())
    if not grew:
        return None
    trace = trace_model(wide, kinds, slots, compiled=compiled)
    to_fake(trace, fake, param_dtype=getattr(torch, dtype))
    with fake:
        return run_titan_pass(trace, slots, b=PROBE_BATCH, s=PROBE_SEQ, vocab=dims.vocab, loss=loss)


def _tp_degrees(dims: ModelDims) -> tuple[int, ...]:
    """TP degrees torchtitan accepts: they must divide the query and key/value heads
    (`Decoder.Config.update_from_config`)."""
    return tuple(t for t in (1, 2, 4, 8, 16, 32, 64) if dims.heads % t == 0 and dims.kv_heads % t == 0)


def titan_config(config: Any, *, family: str, layers: int, widen: int = 1) -> Any:
    """torchtitan's model config for a transformers config: the same shapes, norms, RoPE and tying (`widen`
    multiplies the heads and FFN width, keeping the head size)."""
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config

    from .assemble import dims_of

    text = config.get_text_config()
    dims = dims_of(config)
    eps = float(getattr(text, "rms_norm_eps", 1e-5))
    theta = float(_rope_theta(text))
    max_seq = int(getattr(text, "max_position_embeddings", 8192))
    if family == "llama3":
        rope = ComplexRoPE.Config(dim=dims.head_dim, max_seq_len=max_seq, theta=theta, **_llama_scaling(text))
        (model_cls, block_cls), qk_norm = _llama_classes(), None
    else:
        rope = CosSinRoPE.Config(dim=dims.head_dim, max_seq_len=max_seq, theta=theta)
        model_cls, block_cls = _qwen3_classes()
        qk_norm = RMSNorm.Config(normalized_shape=dims.head_dim, eps=eps)
    norm = RMSNorm.Config(normalized_shape=dims.hidden, eps=eps)
    init = {"weight": torch.nn.init.normal_}
    blocks = [block_cls.Config(
        attention_norm=norm, ffn_norm=norm,
        attention=make_gqa_config(dim=dims.hidden, n_heads=dims.heads * widen, n_kv_heads=dims.kv_heads * widen,
                                  head_dim=dims.head_dim,
                                  wqkv_param_init=init, wo_param_init=init,
                                  inner_attention=ScaledDotProductAttention.Config(), fuse_qkv=True, rope=rope,
                                  qk_norm=qk_norm),
        **({"moe": _moe_config(text, dims.hidden, widen)} if _sparse(text, i) else
           {"feed_forward": make_ffn_config(dim=dims.hidden, hidden_dim=dims.intermediate * widen,
                                            w1_param_init=init, w2w3_param_init=init)}))
        for i in range(layers)]
    return model_cls.Config(dim=dims.hidden, vocab_size=dims.vocab,
                            enable_weight_tying=bool(getattr(text, "tie_word_embeddings", False)),
                            tok_embeddings=Embedding.Config(num_embeddings=dims.vocab, embedding_dim=dims.hidden),
                            norm=norm, lm_head=Linear.Config(in_features=dims.hidden, out_features=dims.vocab),
                            layers=blocks)


def _sparse(text: Any, index: int) -> bool:
    """Whether decoder layer `index` of a Qwen3-MoE config is an MoE layer (transformers Qwen3MoeDecoderLayer:
    not in `mlp_only_layers`, and every `decoder_sparse_step`-th layer)."""
    experts = int(getattr(text, "num_experts", 0) or 0)
    step = int(getattr(text, "decoder_sparse_step", 1) or 1)
    return experts > 0 and index not in (getattr(text, "mlp_only_layers", None) or []) and (index + 1) % step == 0


def _moe_config(text: Any, hidden: int, widen: int) -> Any:
    """torchtitan's MoE block for a Qwen3-MoE config, as its own Qwen3-MoE flavours build it
    (`_build_qwen3_moe_layers`: softmax top-k router, routed experts with the standard all-to-all dispatcher, the
    default auxiliary-loss-free load-balancing buffers); `route_norm` is the config's `norm_topk_prob`."""
    from torchtitan.models.common.config_utils import (
        make_moe_config,
        make_routed_experts_config,
        make_router_config,
    )

    experts, top_k = int(text.num_experts), int(text.num_experts_per_tok)
    init = torch.nn.init.normal_
    return make_moe_config(
        num_experts=experts,
        router=make_router_config(dim=hidden, num_experts=experts, gate_param_init={"weight": init}, top_k=top_k,
                                  score_func="softmax", route_norm=bool(getattr(text, "norm_topk_prob", False))),
        routed_experts=make_routed_experts_config(dim=hidden, hidden_dim=int(text.moe_intermediate_size) * widen,
                                                  num_experts=experts, top_k=top_k,
                                                  param_init={"w1_EFD": init, "w2_EDF": init, "w3_EFD": init},
                                                  comm_backend="standard"))


def _moe(model: torch.nn.Module, kinds: list[int], dims: ModelDims) -> dict[int, MoE]:
    """Per layer kind with routed experts, their count, top-k and parameter elements."""
    blocks = list(model.layers.values())
    return dims.moe_by_kind({kind: sum(p.numel() for name, p in blocks[kinds.index(kind)].named_parameters()
                                       if "routed_experts." in name) for kind in set(kinds)})


def _llama_classes() -> tuple[Any, Any]:
    from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock

    return Llama3Model, Llama3TransformerBlock


def _qwen3_classes() -> tuple[Any, Any]:
    from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock

    return Qwen3Model, Qwen3TransformerBlock


def _rope_theta(text: Any) -> float:
    params = getattr(text, "rope_parameters", None) or {}
    return params.get("rope_theta") or getattr(text, "rope_theta", None) or 10000.0


def _llama_scaling(text: Any) -> dict[str, Any]:
    """Llama 3.1's RoPE frequency scaling in torchtitan's field names (none for other Llamas)."""
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if params.get("rope_type") != "llama3":
        return {}
    return {"scaling": "llama", "scaling_factor": float(params["factor"]),
            "low_freq_factor": float(params["low_freq_factor"]),
            "high_freq_factor": float(params["high_freq_factor"]),
            "original_max_position_embeddings": int(params["original_max_position_embeddings"])}


def build_titan(config: Any) -> torch.nn.Module:
    """Instantiate the torchtitan model on the meta device (no memory, no init)."""
    with torch.device("meta"):
        model = config.build()
    model.train()
    return model


def _kinds(model: torch.nn.Module) -> list[int]:
    seen: dict[tuple[Any, ...], int] = {}
    return [seen.setdefault(layer_signature(layer), len(seen)) for layer in model.layers.values()]


def trace_model(model: torch.nn.Module, kinds: list[int], slots: list[TraceSlot], *,
                compiled: bool = False) -> torch.nn.Module:
    """Swap the decoder stack for one block per slot, each wrapped by torchtitan's own checkpoint policy; with
    `compiled`, the blocks without one run as torch.compile trains them (`compiled.compile_forward`: torchtitan's
    `apply_compile` compiles each block on its own, after activation checkpointing wraps it; a checkpointed block
    saves its input either way, as on the HF path)."""
    import copy

    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    from .compiled import compile_forward

    blocks = list(model.layers.values())
    stack = torch.nn.ModuleDict()
    for j, slot in enumerate(slots):
        kind = kinds[0] if slot.kind is None else slot.kind
        block = copy.deepcopy(blocks[kinds.index(kind)])
        if slot.mode is Checkpoint.FULL:
            block = FullAC(FullAC.Config())._wrap_block(block, base_fqn=f"layers.{j}")
        elif slot.mode is Checkpoint.OP_SELECTIVE:
            block = SelectiveAC(SelectiveAC.Config())._wrap_block(block, base_fqn=f"layers.{j}")
        elif compiled:
            compile_forward(block)
        stack[str(j)] = block
    trace = copy.copy(model)
    trace._modules = dict(model._modules)
    trace._modules["layers"] = stack
    return trace


def run_titan_pass(model: torch.nn.Module, slots: list[TraceSlot], *, b: int, s: int, vocab: int,
                   loss: str = "chunked") -> Recording:
    """Record one training pass as torchtitan's trainer runs it: model(tokens, positions), its loss (chunked
    or plain cross-entropy, sum), backward."""
    for param in model.parameters():
        param.grad = None
    recorder = SacRecorder([*model.parameters(), *model.buffers()])
    layers = list(model.layers.values())
    scopes: dict[torch.nn.Module, str] = {}
    for j, layer in enumerate(layers):
        scopes[layer] = f"layers.{j}"
        inner = getattr(layer, "_checkpoint_wrapped_module", None)
        if inner is not None:
            scopes[inner] = f"layers.{j}"
    if loss == "plain":  # the chunked loss runs the head chunk by chunk inside the loss scope
        scopes[model.lm_head] = "head"
    tracker = ScopeTracker(recorder, scopes, dynamic={model.tok_embeddings, model.norm}, head=model.lm_head)
    boundary: list[int | None] = []

    def note_boundary(module: torch.nn.Module, args: Any) -> None:
        if not boundary and args and isinstance(args[0], torch.Tensor):
            boundary.append(recorder.storage_index(args[0]))

    handle = layers[0].register_forward_pre_hook(note_boundary)
    with marking_recompute(recorder, _recomputed(layers)), observing(recorder), cuda_rms_norm(), recorder, _quiet():
        tokens = torch.randint(0, vocab, (b, s))
        labels = torch.randint(0, vocab, (b, s))
        # torchtitan's dataloaders always emit per-document positions (torchtitan/hf_datasets/text_datasets.py).
        positions = torch.arange(s).repeat(b, 1)
        with tracker.active(), recorder.saving():
            out = titan_forward(model, tokens, positions, loss=loss)
            total = titan_loss(model, out, labels) if loss == "plain" else None
        if total is None:
            # Outside the module tracker: its grad hooks on each chunk's head input would keep every chunk alive.
            recorder.scope = "loss"
            with recorder.saving():
                total = titan_loss(model, out, labels, chunked=True)
        del out
        with tracker.active():
            tracker.enter_backward()
            total.backward()
        del total, tokens, labels, positions
    handle.remove()
    recorder.mark_grads(model.parameters())
    lifetimes = model_wide(recorder, slots, boundary[0] if boundary else None)
    names = {"tok_embeddings": tracker.dynamic_names.get(id(model.tok_embeddings), "embed"),
             "norm": tracker.dynamic_names.get(id(model.norm), "norm")}
    return Recording(b, s, recorder.ops, recorder.storages, lifetimes, names)


def titan_forward(model: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor, *, loss: str) -> Any:
    """The model's forward as torchtitan's trainer calls it: logits, or the final hidden states when the loss is
    chunked (the trainer sets `_skip_lm_head`; the loss then runs the head)."""
    model._skip_lm_head = loss == "chunked"
    try:
        return model(tokens, positions, None)
    finally:
        model._skip_lm_head = False


def titan_loss(model: torch.nn.Module, out: torch.Tensor, labels: torch.Tensor, *, chunked: bool = False) -> Any:
    """torchtitan's loss (sum reduction): `ChunkedLossWrapper` with `LOSS_CHUNKS` chunks on the hidden states, or
    plain `cross_entropy_loss` on the logits."""
    from torchtitan.components.loss import ChunkedLossWrapper, cross_entropy_loss

    if not chunked:
        return cross_entropy_loss(out, labels)
    wrapper = ChunkedLossWrapper.Config(num_chunks=LOSS_CHUNKS).build()
    wrapper.set_lm_head(model.lm_head)
    return wrapper(out, labels)[0]


def _recomputed(layers: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The blocks a checkpointed layer reruns in backward: the module its checkpoint wrapper wraps."""
    return [inner for layer in layers if (inner := getattr(layer, "_checkpoint_wrapped_module", None)) is not None]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="torch.utils.checkpoint")
        yield


class _FusedRMSNorm(torch.autograd.Function):
    """`_fused_rms_norm` with the autograd formula of its GPU kernel: save input, rstd and weight."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, shape: list[int], eps: float | None) -> Any:
        with torch.no_grad():
            out, rstd = torch.ops.aten._fused_rms_norm(x, shape, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        ctx.shape = shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, rstd, weight = ctx.saved_tensors
        grad_x, grad_w = torch.ops.aten._fused_rms_norm_backward(grad, x, ctx.shape, rstd, weight,
                                                                  [ctx.needs_input_grad[0], ctx.needs_input_grad[1]])
        return grad_x, grad_w, None, None


@contextlib.contextmanager
def cuda_rms_norm() -> Iterator[None]:
    """`F.rms_norm` saving what the GPU kernel saves, where `rms_norm_symint` picks the fused kernel (a weight
    of the input's dtype, real input); anything else keeps the composite, as on GPUs."""
    functional = torch.nn.functional
    original = functional.rms_norm

    def rms_norm(x: torch.Tensor, shape: Any, weight: torch.Tensor | None = None, eps: float | None = None) -> Any:
        if weight is None or weight.dtype != x.dtype or x.is_complex():
            return original(x, shape, weight, eps)
        return _FusedRMSNorm.apply(x, weight, list(shape), eps)

    functional.rms_norm = rms_norm
    try:
        yield
    finally:
        functional.rms_norm = original


def rope_cache_bytes(model: torch.nn.Module) -> Poly:
    """Bytes of one decoder layer's RoPE cache as a polynomial in s (the layers' mean): torchtitan's trainer
    rebuilds each layer's cache for `training.seq_len` positions (`Decoder.Config.update_from_config`), FSDP
    leaves buffers unsharded, and a pipeline stage keeps only its own layers' (`_pipeline_module_split` deletes
    the others). Module buffers: held once for the run, not per micro-batch."""
    per_position = 0
    for name, buffer in model.named_buffers():
        if name.endswith("rope.cache"):
            per_position += buffer.nbytes // buffer.shape[0]
    return Poly.of({(0, 1, 0): Fraction(per_position, len(model.layers))})


def _param_tensors(model: torch.nn.Module, dtype: str) -> list[ParamTensor]:
    """Every parameter once, owned by its graph node, with torchtitan's TP split."""
    itemsize = torch.finfo(getattr(torch, dtype)).bits // 8
    tensors, seen = [], set()
    for fqn, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        seen.add(id(param))
        parts = fqn.split(".")
        node = {"tok_embeddings": "embed", "norm": "norm", "lm_head": "head"}.get(parts[0], "")
        node = node or f"layers.{parts[1]}"
        module = parts[-2] if len(parts) > 1 else parts[0]
        style, dim = _TP_STYLES.get(module, ("replicate", None))
        tensors.append(ParamTensor(name=fqn, node=node, shape=tuple(int(d) for d in param.shape), trainable=True,
                                   itemsize=itemsize, tp_style=style, tp_dim=dim))
    return tensors


def _rowwise(layer: torch.nn.Module) -> int:
    """Row-parallel projections in a block (`wo`, `w2`): each all-reduces its output under TP."""
    return sum(1 for name, _ in layer.named_modules() if name.rpartition(".")[2] in ("wo", "w2"))


__all__ = ["MODEL_WIDE", "TITAN_MODES", "build_titan", "lower_titan", "run_titan_pass",
           "titan_config", "trace_model"]
