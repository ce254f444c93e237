"""Lower a model through megatron-core's GPT layers with the local (non-Transformer-Engine) spec (Megatron launcher).

A Llama-style catalog config becomes megatron-core's `TransformerConfig` (RMSNorm, SwiGLU, RoPE, GQA) and a
`GPTModel` built from `get_gpt_layer_local_spec`, on meta, traced on fake CPU tensors with the HF path's recorder
and fit (`probe`, `fit`), as `titan.py` does. Checkpoint modes are Megatron's own: `recompute_granularity="full"`
(uniform, one layer per checkpoint: `tensor_parallel.checkpoint` around the layer, as
`TransformerBlock._checkpointed_forward` runs it) and `"selective"` (the attention core only,
`SelfAttention._checkpointed_attention_forward`). What is priced is the local spec as it runs without TE or apex,
megatron-core 0.16; each correction or choice is named where it is applied:
- the local spec's attention is `DotProductAttention`, which materialises the scores: a baddbmm into megatron's
  persistent global buffer ((b*heads, s, s), kept for the whole run: `_global_buffer_bytes`), the softmax in fp32
  (`attention_softmax_in_fp32`) saving its fp32 output, a bf16 copy saved by the probs @ V bmm, and a causal
  (s, s) bool mask saved by `masked_fill_`. This is what runs on GPUs too (no flash attention in the local spec);
  selective recompute frees exactly these, which is why it pays here and not under flash attention;
- megatron's fused kernels are off (`masked_softmax_fusion`, `bias_activation_fusion`, `apply_rope_fusion`,
  `cross_entropy_loss_fusion`, `gradient_accumulation_fusion`): the softmax and RoPE fusions need apex/TE
  extensions, and TE's fused LayerNorm/SwiGLU/RoPE/cross-entropy are not in the local spec. A plan run with them
  on saves less than priced here;
- the norms are `torch.nn.RMSNorm` (`WrappedTorchNorm`), which on GPUs runs the fused `_fused_rms_norm` kernel
  (saves input, fp32 rstd, weight): `titan.cuda_rms_norm` applies that autograd formula on CPU;
- parameters are in the compute dtype, as megatron's `Float16Module` casts the whole model (`module.bfloat16()`);
- megatron's RoPE table (`RotaryEmbedding.forward`, lru-cached per length, fp32 (s, head_dim)) lives for the run;
- CPU-only quirks of megatron-core 0.16 (`_cpu_runtime`): `torch.cuda.current_device()` for new tensors, the CUDA
  RNG tracker around dropout (p = 0 for Llama) and in `CheckpointFunction`, `get_default_causal_mask` on "cuda".
Megatron-LM runs this spec with `--transformer-impl local` (its default is Transformer Engine) and these fusions
off (`--no-masked-softmax-fusion --no-bias-swiglu-fusion --no-rope-fusion --no-gradient-accumulation-fusion`);
dropout is the HF config's (0 for Llama and Qwen2; Megatron-LM's flag defaults are 0.1). Qwen3 adds megatron's
`qk_layernorm`; in Mixtral and Qwen3-MoE every MLP is megatron-core's `MoELayer` as the Megatron launcher runs it,
its data-dependent routing answered on fake tensors as `megatron_moe.py` explains.
The loss is megatron's `vocab_parallel_cross_entropy` (fp32 upcast of the logits) summed over tokens. Tensor
parallelism is measured by a widened probe like the other lowerings (no sequence parallelism, loss replicated).

`kernels="te"` lowers the same layers as a default Megatron-LM run executes them on GPUs (the Megatron launcher
emits no `--transformer-impl local`): Transformer Engine's flash attention (no scores, no global buffer, no mask),
megatron's fused SwiGLU and TE's fused RoPE, each in the CPU form `te_kernels.py` gives with its citation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .architectures import has_flag, megatron_kind, supported
from .errors import UnsupportedModel
from .fit import Probes, model_wide_bytes, segment_costs
from .graph import LayerGraph, ModelDims
from .layer import Checkpoint, MoE, ParamTensor
from .lowering_keys import PROBE_BATCH, PROBE_SEQ, WIDEN_FACTOR, megatron_key
from .megatron_moe import (
    DroplessRouting,
    every_layer_routed,
    moe_runtime,
    moe_settings,
    step_state,
)
from .poly import Poly
from .probe import Recording, TraceSlot, model_wide
from .recorder import Recorder, ScopeTracker, marking_recompute
from .sources import ResolvedModel, resolve

# The attention a megatron-lowered graph records, by kernel set: the local spec's unfused DotProductAttention, or
# Transformer Engine's flash attention (`te_kernels.FlashCoreAttention`).
MEGATRON_ATTENTION = "megatron-local"
TE_ATTENTION = "te-flash"
KERNELS = {"local": MEGATRON_ATTENTION, "te": TE_ATTENTION}
# Megatron's recompute granularities: none, "full" (uniform, one layer each) and "selective" (attention core).
MEGATRON_MODES = (Checkpoint.NONE, Checkpoint.FULL, Checkpoint.SELECTIVE)
# HF model types lowered as megatron-core Llama-style GPT models (RMSNorm, SwiGLU, RoPE, GQA), dense or with MoE
# layers: the architecture table's `megatron` records (graphs/data/architectures.json, which says why Mistral is
# left out). Kept as a name because solver/api.py imports it.
MEGATRON_TYPES = supported("megatron")
# megatron-core's TP layers: ColumnParallelLinear shards output rows, RowParallelLinear input columns.
_TP_STYLES = {"linear_qkv": ("colwise", 0), "linear_fc1": ("colwise", 0), "output_layer": ("colwise", 0),
              "linear_proj": ("rowwise", 1), "linear_fc2": ("rowwise", 1),
              "word_embeddings": ("embedding_rowwise", 0)}


def lower_megatron(model: str, *, dtype: str = "bfloat16", use_cache: bool = True,
                   kernels: str = "local") -> LayerGraph:
    """Lower `model` (catalog id, local path or cached Hub id) through megatron-core's GPTModel (local spec), with
    the local spec's own kernels or (`kernels="te"`) the GPU kernels a default Megatron-LM run uses."""
    return lower_megatron_resolved(resolve(model), dtype=dtype, use_cache=use_cache, kernels=kernels)


@functools.lru_cache(maxsize=16)
def lower_megatron_resolved(resolved: ResolvedModel, *, dtype: str = "bfloat16", use_cache: bool = True,
                            kernels: str = "local") -> LayerGraph:
    from .cache import cached_or_lowered

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r} must be float32, bfloat16 or float16")
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r} must be one of {', '.join(KERNELS)}")
    key = megatron_key(resolved, dtype=dtype, kernels=kernels)

    def traced() -> LayerGraph:
        with megatron_runtime(kernels):
            return _measure(resolved, dtype=dtype, kernels=kernels)

    return cached_or_lowered(key, traced, use_cache=use_cache)


def _package_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def _measure(resolved: ResolvedModel, *, dtype: str, kernels: str) -> LayerGraph:
    from .assemble import assemble, dims_of
    from .measure import Study, _versions, transformers_config

    config = transformers_config(resolved)
    dims = dims_of(config)
    text = config.get_text_config()
    windowed = getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True)
    kind = megatron_kind(config.model_type)
    if kind is None or bool(dims.experts) != (kind == "moe") or windowed or not every_layer_routed(text):
        raise UnsupportedModel(f"megatron-core's local GPT spec is not lowered for {config.model_type!r} "
                               f"({resolved.id})", f"The Megatron lowering runs {', '.join(MEGATRON_TYPES)} (without a "
                               "sliding window).")
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    torch_dtype = getattr(torch, dtype)
    # Megatron's GPT layers are all alike (one kind); the trace model has one layer per slot.
    kinds = [0] * dims.layers
    slots = [TraceSlot(None, Checkpoint.NONE)] + [TraceSlot(0, m) for m in MEGATRON_MODES]
    model = build_megatron(config, layers=len(slots), dtype=torch_dtype, kernels=kernels)
    params = _param_tensors(build_megatron(config, layers=dims.layers, dtype=torch_dtype, kernels=kernels), dtype)
    trace = trace_model(config, slots, dtype=torch_dtype, fake=fake, base=model, kernels=kernels)
    wide = trace_model(config, slots, dtype=torch_dtype, fake=fake, widen=WIDEN_FACTOR, kernels=kernels)

    def run(b: int, s: int, traced: torch.nn.Module = trace) -> Recording:
        with fake:
            return run_megatron_pass(traced, slots, b=b, s=s, vocab=dims.vocab)

    probes = Probes(run(PROBE_BATCH, PROBE_SEQ), run(PROBE_BATCH, 2 * PROBE_SEQ), run(PROBE_BATCH, 3 * PROBE_SEQ),
                    run(2 * PROBE_BATCH, PROBE_SEQ), run(PROBE_BATCH, PROBE_SEQ, wide))
    costs = segment_costs(probes, module_held=bool(dims.experts))
    itemsize = torch.finfo(torch_dtype).bits // 8
    wide_bytes = model_wide_bytes(probes)
    wide_bytes["shared"] = wide_bytes["shared"] + rope_table_bytes(dims.head_dim)
    if kernels == "local":
        wide_bytes["shared"] = wide_bytes["shared"] + global_buffer_bytes(dims.heads, itemsize)
    block = model.decoder.layers[0]
    study = Study(architecture=type(model).__name__, layer_class=type(block).__name__, attention=KERNELS[kernels],
                  dims=dims, itemsize=itemsize, params=params, kinds=kinds,
                  slot_scopes={(s.kind, s.mode): f"layers.{j}" for j, s in enumerate(slots) if s.kind is not None},
                  costs=costs, rowwise_modules=[2] * dims.layers, moe=_moe(params, dims),
                  model_wide=wide_bytes, widened=True, tp_degrees=_tp_degrees(dims),
                  versions=(*_versions(), ("megatron-core", _package_version("megatron-core"))))
    graph = assemble(resolved, study, dtype=dtype, autocast=None, lora=None)
    return dataclasses.replace(graph, runtime="megatron")


def rope_table_bytes(head_dim: int) -> Poly:
    """megatron's RoPE table: fp32 (s, 1, 1, head_dim), lru-cached by `RotaryEmbedding.forward` for the run."""
    return Poly.of({(0, 1, 0): 4 * head_dim})


def global_buffer_bytes(heads: int, itemsize: int) -> Poly:
    """`DotProductAttention`'s baddbmm input: megatron's global memory buffer of (b*heads/t, s, s) in the
    compute dtype, allocated at the first layer and kept (`parallel_state.get_global_memory_buffer`)."""
    return Poly.of({(1, 2, 1): heads * itemsize})


def _tp_degrees(dims: ModelDims) -> tuple[int, ...]:
    """TP degrees megatron-core accepts: they divide the attention heads and the query groups."""
    return tuple(t for t in (1, 2, 4, 8, 16, 32, 64) if dims.heads % t == 0 and dims.kv_heads % t == 0)


def megatron_config(config: Any, *, layers: int, dtype: torch.dtype = torch.bfloat16,
                    granularity: str | None = None, widen: int = 1, kernels: str = "local") -> Any:
    """megatron-core's TransformerConfig for a Llama-style transformers config (`widen` multiplies the heads,
    query groups and FFN width, keeping the head size); `granularity` is `recompute_granularity`; `kernels="te"`
    turns on the SwiGLU and RoPE fusions a default Megatron-LM run uses (call inside `megatron_runtime("te")`)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from .assemble import dims_of

    fused = kernels == "te"

    text = config.get_text_config()
    dims = dims_of(config)
    expert_ffn = int(getattr(text, "moe_intermediate_size", 0) or dims.intermediate)
    moe = moe_settings(text, experts=dims.experts, top_k=dims.top_k, ffn_hidden=expert_ffn * widen) \
        if dims.experts else {}
    return TransformerConfig(**moe,
        num_layers=layers, hidden_size=dims.hidden, ffn_hidden_size=dims.intermediate * widen,
        num_attention_heads=dims.heads * widen, num_query_groups=dims.kv_heads * widen, kv_channels=dims.head_dim,
        normalization="RMSNorm", layernorm_epsilon=float(getattr(text, "rms_norm_eps", 1e-5)),
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=bool(getattr(text, "attention_bias", False) or has_flag(config.model_type, "qkv_bias_only")),
        qk_layernorm=has_flag(config.model_type, "qk_norm"),
        hidden_dropout=0.0, attention_dropout=float(getattr(text, "attention_dropout", 0.0)),
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        recompute_granularity=granularity, recompute_method="uniform" if granularity == "full" else None,
        recompute_num_layers=1 if granularity == "full" else None,
        # The unfused paths, or TE's fusions: see the module docstring.
        masked_softmax_fusion=False, bias_activation_fusion=fused, apply_rope_fusion=fused,
        cross_entropy_loss_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, use_cpu_initialization=True, perform_initialization=False)


def build_megatron(config: Any, *, layers: int, dtype: torch.dtype = torch.bfloat16, granularity: str | None = None,
                   widen: int = 1, max_seq: int | None = None, kernels: str = "local") -> torch.nn.Module:
    """megatron-core's GPTModel with the local layer spec on the meta device (call inside `megatron_runtime`); with
    `kernels="te"` its core attention is TE's flash attention in CPU form."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from .assemble import dims_of
    from .titan import _llama_scaling, _rope_theta

    text = config.get_text_config()
    scaling = _llama_scaling(text)
    spec = get_gpt_layer_local_spec(num_experts=dims_of(config).experts or None, moe_grouped_gemm=False,
                                    qk_layernorm=has_flag(config.model_type, "qk_norm"), normalization="RMSNorm")
    if kernels == "te":
        from .te_kernels import FlashCoreAttention

        spec.submodules.self_attention.submodules.core_attention = FlashCoreAttention
    settings = megatron_config(config, layers=layers, dtype=dtype, granularity=granularity, widen=widen,
                               kernels=kernels)
    with torch.device("meta"):
        model = GPTModel(settings,
                         spec, vocab_size=int(text.vocab_size),
                         max_sequence_length=max_seq or int(getattr(text, "max_position_embeddings", 8192)),
                         position_embedding_type="rope", rotary_base=int(_rope_theta(text)),
                         rope_scaling=bool(scaling), rope_scaling_factor=scaling.get("scaling_factor", 8.0),
                         share_embeddings_and_output_weights=bool(getattr(text, "tie_word_embeddings", False)))
    model.train()
    return model


class FullRecompute(torch.nn.Module):
    """One layer under Megatron's full uniform recompute (`recompute_num_layers=1`): `tensor_parallel.checkpoint`
    around the layer with the arguments `TransformerBlock._checkpointed_forward` passes."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.layer_number = layer.layer_number

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None, context: Any = None,
                context_mask: Any = None, rotary_pos_emb: Any = None, padding_mask: Any = None, **_: Any) -> Any:
        from megatron.core import tensor_parallel

        def run(hidden: Any, mask: Any, ctx: Any, ctx_mask: Any, rope: Any, padding: Any) -> Any:
            return self.layer(hidden_states=hidden, attention_mask=mask, context=ctx, context_mask=ctx_mask,
                              rotary_pos_emb=rope, attention_bias=None, inference_context=None,
                              packed_seq_params=None, padding_mask=padding)

        return tensor_parallel.checkpoint(run, False, hidden_states, attention_mask, context, context_mask,
                                          rotary_pos_emb, padding_mask)


def trace_model(config: Any, slots: list[TraceSlot], *, dtype: torch.dtype, fake: FakeTensorMode,
                widen: int = 1, base: torch.nn.Module | None = None, kernels: str = "local") -> torch.nn.Module:
    """A GPTModel with one layer per slot, on fake tensors: FULL slots wrapped in `FullRecompute`, SELECTIVE ones
    taken from a model built with `recompute_granularity="selective"` (its attention checkpoints the core)."""
    model = base or build_megatron(config, layers=len(slots), dtype=dtype, widen=widen, kernels=kernels)
    selective = build_megatron(config, layers=len(slots), dtype=dtype, granularity="selective", widen=widen,
                               kernels=kernels)
    stack = torch.nn.ModuleList()
    for j, slot in enumerate(slots):
        layer = (selective if slot.mode is Checkpoint.SELECTIVE else model).decoder.layers[j]
        stack.append(FullRecompute(layer) if slot.mode is Checkpoint.FULL else layer)
    model.decoder.layers = stack
    to_fake(model, fake, dtype)
    return model


def to_fake(model: torch.nn.Module, mode: FakeTensorMode, dtype: torch.dtype) -> None:
    """Fake parameters in the compute dtype (megatron's `Float16Module` casts every parameter); buffers keep theirs."""
    memo: dict[int, torch.Tensor] = {}
    for sub in model.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                if id(param) not in memo:
                    meta = param.detach().to(device="meta", dtype=dtype)
                    memo[id(param)] = torch.nn.Parameter(
                        mode.fake_tensor_converter.from_meta_and_device(mode, meta, torch.device("cpu")))
                sub._parameters[name] = memo[id(param)]


def prepare_step(model: torch.nn.Module, *, b: int, s: int) -> list[torch.Tensor]:
    """Make what megatron keeps for the whole run before the recorded pass: the RoPE table, the local
    attention's global buffer and an MoE model's aux-loss state (`megatron_moe.step_state`), under the fake mode;
    returns them so the recorder treats them as existing."""
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer

    model.rotary_pos_emb.forward.cache_clear()
    table = [model.rotary_pos_emb(s), *step_state(model)]
    parallel_state._GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()
    attention = next((m for m in model.modules() if type(m).__name__ == "DotProductAttention"), None)
    if attention is None:  # TE's flash attention uses no global buffer
        return table
    dtype = next(p for p in model.decoder.parameters()).dtype
    heads = attention.num_attention_heads_per_partition
    buffer = parallel_state.get_global_memory_buffer().get_tensor((b * heads, s, s), dtype, "mpu")
    return [*table, buffer]


def megatron_loss(model: torch.nn.Module, b: int, s: int, vocab: int) -> torch.Tensor:
    """One step's loss as megatron's GPT training computes it: per-token cross-entropy from `GPTModel.forward`
    with labels (fp32 `vocab_parallel_cross_entropy`), summed."""
    tokens = torch.randint(0, vocab, (b, s))
    labels = torch.randint(0, vocab, (b, s))
    positions = torch.arange(s).repeat(b, 1)
    return model(tokens, positions, None, labels=labels).sum()


def run_megatron_pass(model: torch.nn.Module, slots: list[TraceSlot], *, b: int, s: int, vocab: int) -> Recording:
    """Record one training pass: GPTModel forward with labels, the summed loss, backward."""
    from .titan import cuda_rms_norm

    for param in model.parameters():
        param.grad = None
    kept = prepare_step(model, b=b, s=s)
    recorder = Recorder([*model.parameters(), *model.buffers(), *kept])
    layers = list(model.decoder.layers)
    scopes: dict[torch.nn.Module, str] = {}
    for j, layer in enumerate(layers):
        scopes[layer] = f"layers.{j}"
        if isinstance(layer, FullRecompute):
            scopes[layer.layer] = f"layers.{j}"
    scopes[model.output_layer] = "head"
    tracker = ScopeTracker(recorder, scopes, dynamic={model.embedding, model.decoder.final_layernorm},
                           head=model.output_layer)
    boundary: list[int | None] = []

    def note_boundary(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not boundary and isinstance(hidden, torch.Tensor):
            boundary.append(recorder.storage_index(hidden))

    handle = layers[0].register_forward_pre_hook(note_boundary, with_kwargs=True)
    with routing(model), marking_recompute(recorder, *_recomputed(layers)), cuda_rms_norm(), recorder:
        with tracker.active():
            with recorder.saving():
                loss = megatron_loss(model, b, s, vocab)
            tracker.enter_backward()
            loss.backward()
        del loss
    handle.remove()
    recorder.mark_grads(model.parameters())
    lifetimes = model_wide(recorder, slots, boundary[0] if boundary else None)
    names = {"embedding": tracker.dynamic_names.get(id(model.embedding), "embed"),
             "decoder": tracker.dynamic_names.get(id(model.decoder.final_layernorm), "norm")}
    return Recording(b, s, recorder.ops, recorder.storages, lifetimes, names)


def routing(model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
    """`DroplessRouting` for a model with MoE layers (enter it inside the fake mode and outside any recorder or
    memory tracker), else nothing."""
    experts = model.config.num_moe_experts
    return DroplessRouting(experts, model.config.moe_router_topk) if experts else contextlib.nullcontext()


def _recomputed(layers: list[torch.nn.Module]) -> tuple[list[torch.nn.Module], dict[torch.nn.Module, str]]:
    """What a checkpoint reruns in backward: the whole layer under full recompute, the attention core under
    selective recompute. torch 2.13's ModTracker never runs its pre-backward hook for the output of megatron's
    reentrant `CheckpointFunction`, so a fully recomputed layer names its own backward scope when its rerun starts
    (the first thing `CheckpointFunction.backward` does)."""
    targets: list[torch.nn.Module] = []
    owners: dict[torch.nn.Module, str] = {}
    for j, layer in enumerate(layers):
        if isinstance(layer, FullRecompute):
            targets.append(layer.layer)
            owners[layer.layer] = f"layers.{j}"
        elif layer.self_attention.checkpoint_core_attention:
            targets.append(layer.self_attention.core_attention)
    return targets, owners


@contextlib.contextmanager
def megatron_runtime(kernels: str = "local") -> Iterator[None]:
    """`cpu_runtime`, with TE's kernels in CPU form installed for `kernels="te"`."""
    with cpu_runtime():
        if kernels == "local":
            yield
        else:
            from .te_kernels import te_kernels

            with te_kernels():
                yield


def one_rank_group() -> None:
    """The default process group as one rank on torch's fake backend: no gloo context. Code that keeps its groups
    referenced after `destroy_process_group` (megatron-core's parallel state, a device mesh) would otherwise leave
    each gloo context's polling threads running: 17 contexts (51 threads) per megatron lowering.
    `FakeStore` comes from torch's private testing package; importing it registers the "fake" backend."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)


@contextlib.contextmanager
def cpu_runtime() -> Iterator[None]:
    """megatron-core 0.16 on a CPU-only torch, one rank: a 1-rank group (torch's fake backend) with model parallel
    state when none exists, and its CUDA-only calls redirected: `torch.cuda.current_device()` (RoPE, global
    buffer), the CUDA RNG states saved by `CheckpointFunction` and forked around dropout, the causal mask
    built on "cuda" (`get_default_causal_mask`) and the MoE dispatcher's (`megatron_moe.moe_runtime`).
    Everything is restored on exit."""
    import warnings

    import torch.distributed as dist

    with warnings.catch_warnings():  # megatron-core warns on import that TE and apex are absent (it falls back)
        warnings.filterwarnings("ignore", category=UserWarning)
        from megatron.core import parallel_state
        from megatron.core.fusions import fused_softmax
        from megatron.core.tensor_parallel import random as mrandom

    started = not dist.is_initialized()
    saved = (torch.cuda.current_device, mrandom._get_all_rng_states, mrandom._set_all_rng_states,
             fused_softmax.get_default_causal_mask)
    with warnings.catch_warnings(), moe_runtime():
        warnings.filterwarnings("ignore", category=UserWarning)
        if started:
            one_rank_group()
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
        tracker = mrandom.get_cuda_rng_tracker()
        tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
        torch.cuda.current_device = lambda: "cpu"
        mrandom._get_all_rng_states = lambda: (None, None, None)
        mrandom._set_all_rng_states = lambda *states: None
        fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()
        try:
            yield
        finally:
            (torch.cuda.current_device, mrandom._get_all_rng_states, mrandom._set_all_rng_states,
             fused_softmax.get_default_causal_mask) = saved
            del tracker.fork
            if started:
                parallel_state.destroy_model_parallel()
                dist.destroy_process_group()


def _param_tensors(model: torch.nn.Module, dtype: str) -> list[ParamTensor]:
    """Every parameter once, owned by its graph node, with megatron-core's TP split. The experts of an MoE layer
    (`SequentialMLP`: one `linear_fc1` and `linear_fc2` per expert) are recorded as one (experts, out, in) stack
    per projection, as transformers' fused experts are, so that expert parallelism shards them alike
    (`costmodels.expert_parallel.is_expert_stack`); TP splits a stack's `out` (fc1) or `in` (fc2)."""
    itemsize = torch.finfo(getattr(torch, dtype)).bits // 8
    tensors, seen = [], set()
    stacks: dict[str, list[tuple[int, ...]]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        seen.add(id(param))
        parts = fqn.split(".")
        if ".experts.local_experts." in fqn:
            head, _, tail = fqn.partition(".local_experts.")
            stacks.setdefault(f"{head}.{tail.partition('.')[2]}", []).append(tuple(int(d) for d in param.shape))
            continue
        if parts[0] == "embedding":
            node = "embed"
        elif parts[0] == "output_layer":
            node = "head"
        elif parts[1] == "final_layernorm":
            node = "norm"
        else:
            node = f"layers.{parts[2]}"
        style, dim = _TP_STYLES.get(parts[-2], ("replicate", None))
        tensors.append(ParamTensor(name=fqn, node=node, shape=tuple(int(d) for d in param.shape), trainable=True,
                                   itemsize=itemsize, tp_style=style, tp_dim=dim))
    for name, shapes in stacks.items():
        if len(set(shapes)) != 1 or len(shapes[0]) != 2:
            raise UnsupportedModel(f"megatron-core experts of unequal or non-matrix shapes in {name}: {shapes}")
        style, dim = _TP_STYLES.get(name.split(".")[-2], ("replicate", None))
        tensors.append(ParamTensor(name=name, node=f"layers.{name.split('.')[2]}", shape=(len(shapes), *shapes[0]),
                                   trainable=True, itemsize=itemsize, tp_style=style,
                                   tp_dim=None if dim is None else dim + 1))
    return tensors


def _moe(params: list[ParamTensor], dims: ModelDims) -> dict[int, MoE]:
    """The MoE facts of the (one) layer kind: its routed experts' parameter elements."""
    return dims.moe_by_kind({0: sum(p.numel for p in params if p.node == "layers.0" and len(p.shape) == 3)})


__all__ = ["KERNELS", "MEGATRON_MODES", "MEGATRON_TYPES", "TE_ATTENTION", "build_megatron", "cpu_runtime",
           "lower_megatron", "megatron_config", "megatron_runtime", "routing", "run_megatron_pass", "trace_model"]
