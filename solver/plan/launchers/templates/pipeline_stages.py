# fitplan: template only
"""The pipeline part of the emitted training script (issue 13): torch.distributed.pipelining stages cut from the
HF model, the plan's schedule class, and the per-rank report of what a steady-state step holds. The third part of
train_fitplan.py; what it reads of the plan is `PLAN["pipeline"]` (`torchrun_pipeline.pipeline_spec`)."""
# ANN001/ANN201: emitted script code, without annotations (see this package's docstring).
# ruff: noqa: ANN001, ANN201

import contextlib
import json
import os
import resource
import time

import torch
import torch.distributed as dist

from .train_fitplan import (
    PLAN,
    apply_checkpointing,
    apply_tensor_parallel,
    build_optimizer,
    local_bytes,
    model_kwargs,
)
from .training_data import token_batches

# fitplan: end template only


# --- pipeline parallelism (torch.distributed.pipelining) ------------------------------------------------------


def stage_model(args, stage, device):
    """Global stage `stage` of the model: built on the meta device, cut to its decoder layers (the embedding on the
    first stage, the final norm and head on the last; identities elsewhere, so a stage passes its hidden states
    on), then allocated and filled. Returns (the HF model, its decoder layers, the first layer's global index)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    pipe = PLAN["pipeline"]
    path = args.model if not args.model.endswith(".json") else os.path.dirname(args.model) or "."
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), **model_kwargs())
    if type(model).__name__ not in pipe["architectures"]:
        raise SystemExit(f"This script cuts pipeline stages from {', '.join(pipe['architectures'])} only, not "
                         f"{type(model).__name__}.")
    start = sum(pipe["split"][:stage])
    last = stage == len(pipe["split"]) - 1
    base = model.model
    base.layers = torch.nn.ModuleList(list(base.layers)[start:start + pipe["split"][stage]])
    if stage > 0:
        base.embed_tokens = None  # the stage takes hidden states as inputs_embeds
    if not last:
        base.norm, model.lm_head = torch.nn.Identity(), torch.nn.Identity()  # unused: the stage returns hidden states
    model.to_empty(device=device)
    with torch.no_grad():
        if args.from_config:
            model.initialize_weights()
        else:
            load_stage(model, args.model, start)
        for module in model.modules():  # non-persistent buffers (rotary inv_freq) are not in the checkpoint
            if "RotaryEmbedding" in type(module).__name__:
                model._init_weights(module)
    return model, base.layers, start


def load_stage(model, source, start):
    """Fill a stage from the checkpoint's safetensors files, reading only its own tensors (layer i of the stage is
    the model's layer start + i; a tied head reads the embedding)."""
    import glob
    import re

    from safetensors import safe_open

    folder = source if os.path.isdir(source) else __import__("huggingface_hub").snapshot_download(
        source, allow_patterns=["*.safetensors", "*.json"])
    wanted = {}
    for name, tensor in model.state_dict().items():
        original = re.sub(r"^model\.layers\.(\d+)\.", lambda m: f"model.layers.{int(m.group(1)) + start}.", name)
        wanted[original] = tensor
    if "lm_head.weight" in wanted and getattr(model.config, "tie_word_embeddings", False):
        wanted.setdefault("model.embed_tokens.weight", wanted.pop("lm_head.weight"))
    for file in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(file, "pt") as handle:
            for key in set(handle.keys()) & set(wanted):
                wanted.pop(key).copy_(handle.get_tensor(key))
    if wanted:
        raise SystemExit(f"The checkpoint in {folder} lacks these tensors of the stage under the model's own names "
                         f"(a checkpoint transformers converts on loading?): {sorted(wanted)[:5]}")


class StageModule(torch.nn.Module):
    """One pipeline stage as torch.distributed.pipelining runs it: token ids (first stage) or hidden states in,
    hidden states out (the decoder's own output, never a view: the zero-bubble input step detaches it in place),
    or the last stage's logits, under the plan's autocast."""

    def __init__(self, model, first, last):
        super().__init__()
        self.model, self.first, self.last = model, first, last

    def forward(self, x):
        d = PLAN["decisions"]
        half = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(d["precision"])
        context = torch.autocast(x.device.type, dtype=half) if half else contextlib.nullcontext()
        inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        with context:
            if self.last:
                return self.model(**inputs, use_cache=False).logits
            return self.model.model(**inputs, use_cache=False).last_hidden_state


def tie_stages(stages, pp_rank, pp_group_of):
    """A tied embedding and head on different pipeline ranks are two copies (Megatron's output-layer copy): the
    last stage starts from the first's weight and their gradients are summed every step (under tensor parallelism
    both are sharded by vocabulary rows, so the local shards pair up). Returns the function that
    sums them and the copy on this rank, which the global norm counts once (None, None: nothing to sync)."""
    pipe = PLAN["pipeline"]
    first, last = pipe["stage_ranks"][0], pipe["stage_ranks"][-1]
    config = next(iter(stages.values()))[0].config
    if not getattr(config, "tie_word_embeddings", False):
        return None, None
    by_stage = {stage: model for stage, (model, _, _) in stages.items()}
    if first == last:
        if 0 in by_stage and len(pipe["split"]) - 1 in by_stage:
            by_stage[len(pipe["split"]) - 1].lm_head.weight = by_stage[0].model.embed_tokens.weight
        return None, None
    group = pp_group_of(first, last)
    if pp_rank not in (first, last):
        return None, None
    weight = (by_stage[0].model.embed_tokens if pp_rank == first else by_stage[len(pipe["split"]) - 1].lm_head).weight
    with torch.no_grad():
        dist.broadcast(local(weight.data), src=dist.get_global_rank(group, 0), group=group)

    def sync():
        if weight.grad is None:
            return
        if hasattr(weight, "placements") and weight.grad.placements != weight.placements:
            # torch 2.13 leaves the TP embedding's gradient replicated: shard it as the weight, as the head's is
            weight.grad = weight.grad.redistribute(weight.device_mesh, weight.placements)
        dist.all_reduce(local(weight.grad), group=group)
    return sync, (weight if pp_rank == last else None)


def pipeline_mesh(device):
    """The (pp, dp, tp) mesh, pipeline outermost as fitplan prices it, and a function giving the group of two
    pipeline ranks at this rank's data- and tensor-parallel index (every rank creates every group, as new_group
    requires)."""
    from torch.distributed.device_mesh import init_device_mesh

    d = PLAN["decisions"]
    mesh = init_device_mesh(device.type, (d["pp"], d["dp"], d["tp"]), mesh_dim_names=("pp", "dp", "tp"))
    inner = d["dp"] * d["tp"]
    mine = mesh["dp"].get_local_rank() * d["tp"] + mesh["tp"].get_local_rank()

    def pair_group(a, b):
        groups = [dist.new_group([a * inner + j, b * inner + j]) for j in range(inner)]
        return groups[mine]
    return mesh, pair_group


def pipeline_batches(vocab, args, device, dp_rank):
    """One data-parallel replica's batches, the same on each of its pipeline ranks: the step's micro_batch x
    grad_accum sequences, split by the schedule into grad_accum micro-batches (`token_batches`)."""
    d = PLAN["decisions"]
    return token_batches(vocab, args, device, size=d["micro_batch"] * d["grad_accum"], replica=dp_rank,
                         replicas=d["dp"])


class HeldBytes:
    """Saved-tensor hooks counting the distinct storages autograd holds (a storage saved twice once; parameters,
    buffers and the batch never), released with their last saved copy, and the peak of their bytes."""

    def __init__(self, modules, batch):
        owned = [t for m in modules for t in (*m.parameters(), *m.buffers())]
        self.skip = {local(t).untyped_storage().data_ptr() for t in (*owned, *batch)}
        self.refs, self.held, self.peak = {}, 0, 0

    def pack(self, tensor):
        import weakref

        storage = local(tensor).untyped_storage()  # a DTensor's (tensor parallelism) local shard
        if storage.data_ptr() in self.skip or storage.nbytes() == 0:
            return tensor
        key = (storage.data_ptr(), storage.nbytes())
        if self.refs.get(key, 0) == 0:
            self.held += key[1]
            self.peak = max(self.peak, self.held)
        self.refs[key] = self.refs.get(key, 0) + 1
        box = SavedBox(tensor.detach())  # an alias keeps the storage, not the grad_fn (no reference cycle)
        weakref.finalize(box, self.release, key)
        return box

    @staticmethod
    def unpack(packed):
        return packed.tensor if isinstance(packed, SavedBox) else packed

    def release(self, key):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.held -= key[1]


def local(tensor):
    """The plain tensor behind a DTensor (its local shard) or an async collective's result (waited for)."""
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return tensor.trigger_wait() if hasattr(tensor, "trigger_wait") else tensor


class SavedBox:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor):
        self.tensor = tensor


def train_pipeline(args, device, cuda):
    """The plan's pipeline: this rank's stages (each in DDP over its data-parallel group, or averaged after the step
    under zero-bubble schedules), the plan's schedule with grad_accum micro-batches, an optimizer over its stages'
    parameters, and (with --report) what a steady-state step holds."""
    from torch.distributed.pipelining import PipelineStage, schedules

    d, pipe = PLAN["decisions"], PLAN["pipeline"]
    mesh, pair_group = pipeline_mesh(device)
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    mine = [s for s, r in enumerate(pipe["stage_ranks"]) if r == pp_rank]
    last = len(pipe["split"]) - 1
    built, modules, (sync_tied, tied_copy) = stage_modules(args, device, mesh, pair_group, mine)
    stages = [PipelineStage(module, s, len(pipe["split"]), device, group=mesh["pp"].get_group())
              for s, module in zip(mine, modules, strict=True)]
    vocab = built[mine[0]][0].config.vocab_size
    loss_model = built[last][0] if last in built else None

    def loss_fn(logits, labels):  # the loss transformers computes from labels (ForCausalLMLoss), per micro-batch
        return loss_model.loss_function(logits=logits, labels=labels, vocab_size=vocab)

    schedule_class = getattr(schedules, pipe["schedule"])
    schedule = schedule_class(stages[0] if len(stages) == 1 else stages, d["grad_accum"], loss_fn=loss_fn)
    params = list({id(p): p for m in modules for p in m.parameters() if p.requires_grad}.values())
    optimizer = build_optimizer(params, args.lr)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (args.warmup_steps + 1)))
    data = pipeline_batches(vocab, args, device, dp_rank)
    seconds, norms, lrs, step_losses, held = [], [], [], [], None
    for step in range(args.steps):
        started = time.perf_counter()
        ids, labels = next(data)
        inputs = (ids,) if 0 in mine else ()
        target = {"target": labels} if last in mine else {}
        losses = [] if last in mine else None
        watch = HeldBytes(modules, (ids, labels)) if args.report and step == min(1, args.steps - 1) else None
        hooks = torch.autograd.graph.saved_tensors_hooks(watch.pack, watch.unpack) if watch else \
            contextlib.nullcontext()
        with hooks:
            schedule.step(*inputs, losses=losses, return_outputs=False, **target)
        if watch:
            held = watch
        if d["dp"] > 1 and pipe["split_backward"]:
            average_gradients(params, mesh["dp"].get_group())
        if sync_tied:
            sync_tied()
        lrs.append(optimizer.param_groups[0]["lr"])
        if args.max_grad_norm > 0:
            norms.append(clip_pipeline(params, args.max_grad_norm, mesh["pp"].get_group(), tied_copy))
        optimizer.step()
        warmup.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        if losses:
            step_losses.append(torch.stack(losses).mean().item())
            if dp_rank == 0 and mesh["tp"].get_local_rank() == 0:  # one replica's last stage prints
                print(f"step {step + 1}: loss {step_losses[-1]:.4f}", flush=True)
    if args.report:
        report_pipeline(args, modules, optimizer, held, mine, {"step_seconds": seconds, "grad_norms": norms,
                                                                "learning_rates": lrs, "losses": step_losses})


def stage_modules(args, device, mesh, pair_group, mine):
    """This rank's stages built (from rank 0's weights under tensor parallelism), their tied weights joined across
    stages, checkpointed, compiled and wrapped: the built parts, the stage modules, and the tying's hooks."""
    d, pipe = PLAN["decisions"], PLAN["pipeline"]
    last = len(pipe["split"]) - 1
    torch.manual_seed(0)
    built = {s: stage_model(args, s, device) for s in mine}
    for model, _, _ in built.values() if d["tp"] > 1 else ():
        apply_tensor_parallel(model, mesh["tp"])  # from tensor-parallel rank 0's weights (src_data_rank=0)
    tying = tie_stages(built, mesh["pp"].get_local_rank(), pair_group)
    modules = []
    for s, (model, layers, start) in built.items():
        apply_checkpointing(model, layers, d["checkpoint"][start:start + len(layers)])
        if d["compile"]:
            for layer in layers:
                layer.compile()
        module = StageModule(model, first=s == 0, last=s == last).train()
        if d["dp"] > 1 and not pipe["split_backward"]:
            module = torch.nn.parallel.DistributedDataParallel(module, process_group=mesh["dp"].get_group())
        modules.append(module)
    return built, modules, tying


def average_gradients(params, group):
    """Average the step's gradients over the data-parallel group, tensor by tensor, after the last backward: under
    a zero-bubble schedule, whose split input and weight steps DDP's reducer does not follow (torch 2.13 fails with
    "Expected to have finished reduction in the prior iteration")."""
    for param in params:
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)
            param.grad.div_(group.size())


def clip_pipeline(params, max_norm, group, tied_copy):
    """Clip the global gradient norm over every pipeline rank's stages (a tied head's copy counted once)."""
    grads = [p.grad for p in params if p.grad is not None]
    counted = [p.grad for p in params if p.grad is not None and p is not tied_copy]
    square = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    for g in counted:
        norm = torch.linalg.vector_norm(g.float())
        square += (norm.full_tensor() if hasattr(norm, "full_tensor") else norm) ** 2  # TP shards made whole
    dist.all_reduce(square, group=group)
    total = float(square.sqrt())
    factor = max_norm / (total + 1e-6)
    if factor < 1.0:
        for g in grads:
            g.mul_(factor)
    return total


def report_pipeline(args, modules, optimizer, held, mine, steps):
    """This rank's JSON report: its stages, parameter and optimizer-state bytes, the peak of the saved bytes it held
    in the measured step and what was left after it, and the per-step values in `steps`."""
    rank = dist.get_rank()
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    states = sum(local_bytes(v) for state in optimizer.state.values() for k, v in state.items()
                 if torch.is_tensor(v) and (k != "step" or optimizer.defaults.get("fused")))
    os.makedirs(args.report, exist_ok=True)
    with open(os.path.join(args.report, f"rank{rank}.json"), "w") as handle:
        json.dump({"rank": rank, "stages": mine, "param_bytes": sum(local_bytes(p) for p in params),
                   "optimizer_bytes": states, "held_saved_peak_bytes": held.peak if held else None,
                   "held_saved_left_bytes": held.held if held else None, **steps,
                   "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}, handle)
