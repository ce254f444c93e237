# fitplan: template only
# The first part of the training script the torchrun launcher emits (solver/plan/launchers/torchrun.py); the
# parts memory_savers.py, pipeline_stages.py and train_main.py follow it in the emitted train_fitplan.py.
# ANN001/ANN201: emitted script code, without annotations (see this package's docstring).
# ruff: noqa: ANN001, ANN201
# fitplan: end template only
"""Training script emitted by fitplan for: __SUMMARY__

Run: torchrun --nproc_per_node N train_fitplan.py [--model PATH_OR_ID] [--data PATH] [--from-config] [--steps S]
Without --data it trains on random tokens for 2 steps: a smoke test of the plan (memory, speed), not training. For a
real run give --data: a JSON Lines file (one {"text": ...} or {"input_ids": [...]} per line) or a folder of a
tokenized dataset (datasets' save_to_disk with an input_ids column), and --steps, --lr.
"""

import argparse
import contextlib
import functools
import json
import os
import resource
import time

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

# fitplan: template only
# The plan's values, which torchrun.emit writes in place of each __NAME__ below (as Python literals; the docstring's
# __SUMMARY__ as text). These defaults only let the template import.
__PLAN__ = "{}"
__MODEL__ = ""
__LR__ = 0.0
__MAX_GRAD_NORM__ = 0.0
__LIGER__ = {}
# memory_savers.py's and training_data.py's, defined after this part in the emitted script (one module there).
DEVICE_WATCHERS = []
token_batches = None
# Imported here for the later parts (pipeline_stages.py, train_main.py), in the emitted module.
_USED_BY_LATER_PARTS = (resource, time)
# fitplan: end template only
PLAN = json.loads(__PLAN__)
MODEL = __MODEL__  # the model the plan is for


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=MODEL, help="local folder / config.json, or a Hub id (default: the plan's)")
    p.add_argument("--data", default=None, help="JSON Lines ({\"text\": ...} or {\"input_ids\": [...]} per line) "
                   "or a tokenized dataset folder (save_to_disk, input_ids); without it: random tokens, a smoke test")
    p.add_argument("--from-config", action="store_true", help="random weights from the config (smoke tests)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps (default 2: a smoke test)")
    p.add_argument("--seq-len", type=int, default=PLAN["seq_len"])
    p.add_argument("--report", default=None, help="folder for a per-rank JSON report of bytes, peaks and step times")
    p.add_argument("--lr", type=float, default=__LR__, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up from lr/(warmup+1) to lr")
    p.add_argument("--max-grad-norm", type=float, default=__MAX_GRAD_NORM__,
                   help="clip the global gradient norm to this (0 turns clipping off)")
    return p.parse_args()


def on_meta():
    """FSDP2 plans build the model on the meta device and allocate only each rank's shard (FSDP2's documented
    pattern: fully_shard, then to_empty, then initialise or load), so no rank ever holds the whole model; a LoRA
    plan attaches its adapters on the meta device too, before sharding, then loads base and adapters together."""
    return PLAN["decisions"]["engine"] == "fsdp2"


# The 16-bit dtype each mixed precision computes in (autocast's under DDP, FSDP2's param_dtype).
MIXED = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16, "fp8": torch.bfloat16}


def model_kwargs():
    """Trained weights stay fp32 under mixed precision (the masters autocast and FSDP2 cast per use); a LoRA base is
    frozen, with no master to keep, so it loads in the 16-bit compute dtype, as the plan prices it."""
    d = PLAN["decisions"]
    weights = torch.bfloat16 if d["precision"] == "bf16" else torch.float32
    if d["lora"]:
        weights = MIXED.get(d["precision"], weights)
    return {"dtype": weights, "attn_implementation": d["attention"]}


def build(args, device):
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = model_kwargs()
    path = args.model if not args.model.endswith(".json") else os.path.dirname(args.model) or "."
    if on_meta():
        with torch.device("meta"):
            return with_adapters(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), **kwargs))
    if args.from_config:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs)
    return with_adapters(model).to(device)


def with_adapters(model):
    """The model with the plan's LoRA adapters attached by PEFT (the model itself without LoRA)."""
    d = PLAN["decisions"]
    if not d["lora"]:
        return model
    from peft import LoraConfig, get_peft_model

    lora = d["lora"]
    targets = "all-linear" if lora["targets"] == ["all-linear"] else lora["targets"]
    # fp32 adapters under mixed precision (PEFT's default upcast), whose fp32 masters autocast or FSDP2 cast per
    # use; pure bf16 trains them in bf16, as it does every other weight.
    return get_peft_model(model, LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], target_modules=targets,
                                            lora_dropout=lora["dropout"], task_type="CAUSAL_LM"),
                          autocast_adapter_dtype=d["precision"] in MIXED)


# Liger's patch as the plan prices it (its fused linear cross-entropy, and the RMSNorm, SwiGLU and RoPE kernels the
# layers were lowered with); the keyword arguments of `_apply_liger_kernel_to_instance`, the call transformers'
# use_liger_kernel makes (liger-kernel 0.8.5).
LIGER_KERNELS = __LIGER__


def apply_liger(model):
    """Patch the model with Liger's kernels: fused linear cross-entropy, RMSNorm, SwiGLU, RoPE (CUDA/Triton only)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under PEFT's wrapper
    _apply_liger_kernel_to_instance(model=base, **LIGER_KERNELS)


def materialize(model, args, device):
    """Allocate this rank's shards of a meta-built, sharded model and fill them: random weights from the config, or
    the checkpoint read on rank 0 and scattered shard by shard (torch.distributed.checkpoint.state_dict)."""
    model.to_empty(device=device)
    rotary = [m for m in model.modules() if "RotaryEmbedding" in type(m).__name__]
    with torch.no_grad():
        if args.from_config:
            model.initialize_weights()  # transformers' per-module init, on each rank's DTensor shards
            for module in model.modules():  # LoRA's own init (B = 0: the adapted model starts as the base)
                for adapter in getattr(module, "active_adapters", ()) if hasattr(module, "lora_A") else ():
                    module.reset_lora_parameters(adapter, True)
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
            from transformers import AutoModelForCausalLM

            # rank 0 reads the checkpoint on the host, with the same adapters attached (their state dict names are
            # the sharded model's), and scatters it
            full = with_adapters(AutoModelForCausalLM.from_pretrained(args.model, **model_kwargs())).state_dict() \
                if dist.get_rank() == 0 else {}
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                       broadcast_from_rank0=True))
            del full
            for module in rotary:  # non-persistent buffers (rotary inv_freq) are not in the checkpoint
                model._init_weights(module)


def decoder_layers(model):
    return next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == len(
        PLAN["decisions"]["checkpoint"]))


def apply_checkpointing(model, layers=None, modes=None):
    """FULL layers are checkpointed whole; SELECTIVE layers recompute only the attention core; OP_SELECTIVE layers
    are checkpointed whole with op-level selective checkpointing (`sac_context`). A pipeline stage passes its own
    `layers` and their `modes`."""
    layers = decoder_layers(model) if layers is None else layers
    modes = PLAN["decisions"]["checkpoint"] if modes is None else modes
    if "full" in modes or "op_selective" in modes:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer, mode in zip(layers, modes, strict=True):
        layer.gradient_checkpointing = mode in ("full", "op_selective")
        if mode == "op_selective":
            layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False,
                                                                   context_fn=sac_context)
        for module in layer.modules():
            module._fitplan_selective = mode == "selective"
    if "selective" in modes:
        selective_attention()


def selective_attention():
    """Wrap transformers' attention functions, once per process (a pipeline rank may build several stages): the
    attention core of layers marked SELECTIVE runs under checkpoint."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    interfaces = type(ALL_ATTENTION_FUNCTIONS)
    if getattr(interfaces, "_fitplan_wrapped", False):
        return
    original = interfaces.get_interface

    def get_interface(self, name, default):
        attention = original(self, name, default)

        def wrapped(module, q, k, v, mask, **kw):
            if getattr(module, "_fitplan_selective", False) and torch.is_grad_enabled():
                return checkpoint(lambda a, b, c, m: attention(module, a, b, c, m, **kw), q, k, v, mask,
                                  use_reentrant=False)
            return attention(module, q, k, v, mask, **kw)
        return wrapped

    interfaces.get_interface = get_interface
    interfaces._fitplan_wrapped = True


# While a report measures a forward (`saved_bytes`): who counts the outputs op-level SAC keeps, which live in its
# cache and never pass autograd's saved-tensor hooks.
SAC_WATCHERS = []


@functools.cache
def sac_save_ops():
    """The ops whose outputs op-level SAC keeps, as torchtitan 0.3.0's `_get_default_save_ops`
    (torchtitan/distributed/activation_checkpoint.py): the partitioner's compute-intensive ops, attention kernels,
    `max` (low-precision scales), linear, topk, and the reduce-scatter / all-to-all collectives."""
    from torch._functorch.partitioners import get_default_op_list

    aten = torch.ops.aten
    ops = {op.default for op in get_default_op_list().compute_intensive_ops}
    ops |= {aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_attention_math.default,
            aten._scaled_dot_product_fused_attention_overrideable.default, aten.max.default,
            torch._higher_order_ops.flex_attention, aten.linear.default, aten.topk.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default,
            torch.ops._c10d_functional.all_to_all_single.default}
    # The CPU build runs SDPA as this kernel, which neither list names; it stands for the GPU flash kernel (same
    # outputs), so a CPU run keeps what a GPU run keeps, as fitplan prices it.
    ops.add(aten._scaled_dot_product_flash_attention_for_cpu.default)
    compiled = getattr(torch._higher_order_ops, "inductor_compiled_code", None)
    return ops | ({compiled} if compiled is not None else set())


def sac_policy(keep):
    """torchtitan 0.3.0's SelectiveAC policy for one checkpointed forward: keep the outputs of `keep`, but
    recompute every second matmul (counted apart in forward and recompute), and keep device-to-host copies."""
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    matmuls = (aten.mm.default, aten.linear.default)
    counts = {"forward": 0, "recompute": 0}

    def decide(ctx, func, *args, **kwargs):
        if func == aten._to_copy.default and "cuda" in str(args[0].device) and str(kwargs.get("device")) == "cpu":
            return CheckpointPolicy.MUST_SAVE
        phase = "recompute" if ctx.is_recompute else "forward"
        if func in matmuls:
            counts[phase] += 1
        if func in keep:
            if func in matmuls and counts[phase] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def policy(ctx, func, *args, **kwargs):
        decision = decide(ctx, func, *args, **kwargs)
        if SAC_WATCHERS and decision is CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
            SAC_WATCHERS[-1](getattr(ctx, "op_output", None))  # torch >= 2.13 hands the policy the output
        return decision

    return policy


def sac_context():
    """`context_fn` of an op-level SAC layer: a fresh policy (its matmul counters at zero) per checkpointed forward."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(sac_policy(sac_save_ops()))


def apply_float8(model):
    """fp8 matmuls in the linear layers through torchao float8, as the plan credits them: converted before
    sharding (torchao's FSDP2 recipe). Without torchao the run stops here rather than silently training in bf16."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as err:
        raise SystemExit(f"This plan trains in fp8 through torchao float8, which is not importable ({err}); "
                         "install torchao (pip install torchao) or re-plan without fp8.") from err

    def convertible(module, name):
        # torchao float8 needs both dimensions divisible by 16; the LM head stays in bf16 (torchao README).
        return isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0 and \
            module.out_features % 16 == 0 and not name.endswith("lm_head")

    convert_to_float8_training(model, module_filter_fn=convertible)


def apply_tensor_parallel(model, mesh):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(),
              "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
              "colwise_gather_output": ColwiseParallel(output_layouts=Replicate())}
    plan = {}
    for pattern, style in (getattr(model, "_tp_plan", None) or {}).items():
        for name, module in model.named_modules():
            parts, names = pattern.split("."), name.split(".")
            if len(parts) == len(names) and all(p in ("*", n) for p, n in zip(parts, names, strict=True)) \
                    and style in styles \
                    and not isinstance(module, torch.nn.Identity):  # a pipeline stage's stand-in norm or head
                plan[name] = styles[style]
    parallelize_module(model, mesh, plan)
    tied, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if getattr(model.config, "tie_word_embeddings", False) and isinstance(tied, torch.nn.Linear) \
            and embedding is not None:
        tied.weight = embedding.weight  # keep tied weights one tensor


def apply_fsdp(model, mesh):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from torch.distributed.tensor import DTensor, Shard

    d = PLAN["decisions"]
    half = MIXED.get(d["precision"])
    policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32) if half else MixedPrecisionPolicy()
    # Pinned host memory needs an accelerator; a CPU (gloo) run offloads to plain memory.
    cpu = d["param_offload"] != "none"
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu else OffloadPolicy()

    def placement(param):
        local = param.to_local() if isinstance(param, DTensor) else param
        return Shard(shard_dim(local.shape, mesh.size(mesh.ndim - 1)))  # the shard dim of an HSDP mesh

    options = dict(mesh=mesh, reshard_after_forward=d["zero"] == 3, mp_policy=policy, offload_policy=offload,
                   shard_placement_fn=placement)
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)


def shard_dim(shape, ranks):
    """Dim 0 unless it has fewer rows than ranks (MoE expert stacks), then the largest dim (fitplan's rule)."""
    if len(shape) == 0 or shape[0] >= ranks:
        return 0
    return max(range(len(shape)), key=lambda d: (shape[d], -d))


def optimizer_for(model, lr):
    params = [p for p in model.parameters() if p.requires_grad]
    if PLAN["decisions"].get("optimizer_in_backward"):
        return InBackward(params, functools.partial(build_optimizer, lr=lr))
    return build_optimizer(params, lr)


class InBackward(torch.optim.Optimizer):
    """Optimizer-in-backward as torchtune runs it (0.6.1 training/memory.py `register_optim_in_bwd_hooks`): one
    optimizer per parameter, stepped and zeroed by the parameter's post-accumulate-grad hook, so no gradient
    outlives its hook (FSDP2 runs the hooks after its reduce-scatter). This object holds the learning rate the
    scheduler sets and the states the report counts; its own step has nothing left to do."""

    def __init__(self, params, build):
        self.each = {param: build([param]) for param in params}
        super().__init__(list(self.each), dict(next(iter(self.each.values())).defaults))
        for param, optimizer in self.each.items():
            param.register_post_accumulate_grad_hook(functools.partial(self._step_one, optimizer))

    def _step_one(self, optimizer, param):
        optimizer.param_groups[0]["lr"] = self.param_groups[0]["lr"]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def step(self, closure=None):
        return None

    @property
    def state(self):
        return {p: s for optimizer in self.each.values() for p, s in optimizer.state.items()}

    @state.setter
    def state(self, value):
        pass  # torch.optim.Optimizer.__init__ assigns an empty one; the states live in the per-parameter optimizers


def build_optimizer(params, lr):
    d = PLAN["decisions"]
    if d["optimizer"] == "adafactor":
        return torch.optim.Adafactor(params, lr=lr)
    if d["optimizer"] == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if d["optimizer"] == "adamw-8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, lr=lr)
    if d["optimizer"] in ("paged-adamw-8bit", "paged-adamw-32bit"):
        import bitsandbytes

        paged = {"paged-adamw-8bit": bitsandbytes.optim.PagedAdamW8bit,
                 "paged-adamw-32bit": bitsandbytes.optim.PagedAdamW32bit}[d["optimizer"]]
        return paged(params, lr=lr)
    # Fused AdamW runs on CUDA and (torch >= 2.4) on the CPU; it keeps each `step` on the parameters' device.
    # Not under FSDP2's fp16 ShardedGradScaler: its found_inf has shape [1], which fused Adam's step update
    # refuses (torch 2.13: "output with shape [] doesn't match the broadcast shape [1]"); same update, foreach.
    fused = d["optimizer"] == "adamw-fused" and not (d["engine"] == "fsdp2" and d["precision"] == "fp16-mixed")
    return torch.optim.AdamW(by_tensor_kind(params), lr=lr, fused=fused or None)


def by_tensor_kind(params):
    """DTensor and plain parameters in separate groups: the fused and foreach kernels refuse a list that mixes
    them (TP leaves norms and, without FSDP2, other small weights plain)."""
    from torch.distributed.tensor import DTensor

    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return [{"params": group} for group in groups if group]


def loss_scaler(device):
    """fp16 needs dynamic loss scaling (fp16's range underflows small gradients); bf16 and fp32 do not. FSDP2's
    sharded gradients need the scaler that agrees on inf/nan across ranks."""
    d = PLAN["decisions"]
    if d["precision"] != "fp16-mixed":
        return None
    if d["engine"] == "fsdp2":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type)
    return torch.amp.GradScaler(device.type)


def sync_gradients(model, last):
    """DDP all-reduces once per optimizer step, on the last micro-batch (what the plan's time counts).
    FSDP2 keeps reduce-scattering every micro-batch: skipping it (set_requires_gradient_sync(False)) would
    hold unsharded gradients until the last one, which the plan's memory does not count."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not last:
        return model.no_sync()
    return contextlib.nullcontext()


def batches(vocab, args, device):
    """This rank's micro-batches (input ids, labels): its data-parallel replica's (`token_batches`); tensor-parallel
    ranks of one replica get the same ones."""
    d = PLAN["decisions"]
    return token_batches(vocab, args, device, size=d["micro_batch"], replica=dist.get_rank() // d["tp"],
                         replicas=d["dp"])


def local_bytes(tensor):
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return tensor.numel() * tensor.element_size()


@contextlib.contextmanager
def saved_bytes(model, batch, found):
    """Adds to found[0] the bytes autograd saves for backward in this forward, and the outputs op-level SAC keeps:
    each storage once, without the parameters (FSDP2's gathered ones included), buffers and the batch; what
    fitplan's activation model counts."""
    def storage(t):
        return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()

    skip, kept = {storage(t)._cdata for t in batch}, []

    def pack(tensor):
        owned = {storage(t)._cdata for t in (*model.parameters(), *model.buffers())}
        st = storage(tensor)
        if st._cdata not in owned and st._cdata not in skip:
            skip.add(st._cdata)
            kept.append(st)  # holds the storage, so its id is not reused within the pass
            found[0] += st.nbytes()
        return tensor

    def keep_output(output):  # what op-level SAC keeps (`sac_policy`), counted like a saved tensor
        for tensor in torch.utils._pytree.tree_leaves(output):
            if isinstance(tensor, torch.Tensor):
                pack(tensor)

    SAC_WATCHERS.append(keep_output)
    DEVICE_WATCHERS.append(pack)  # under activation offload: what stays on the device
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
    finally:
        SAC_WATCHERS.remove(keep_output)
        DEVICE_WATCHERS.remove(pack)


def clip_gradients(model, max_norm):
    """Clip the global gradient norm; returns it. Gradients may be DTensors on different meshes (TP layers on the
    2-D mesh, FSDP2's root on the data-parallel one), which one `clip_grad_norm_` cannot combine: each tensor's
    norm is made whole first, then all are scaled by one plain factor."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norms = [torch.linalg.vector_norm(g.float()) for g in grads]
    norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
    total = float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
    factor = max_norm / (total + 1e-6)
    if factor < 1.0:
        for g in grads:
            g.mul_(factor)
    return total
