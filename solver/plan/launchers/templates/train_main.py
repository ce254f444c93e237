# fitplan: template only
"""`main` of the emitted training script: the process group, the model built and wrapped as the plan decides, and
the training loop with its report. The last part of train_fitplan.py."""
# ANN001, ANN201: emitted script code, without annotations (see this package's docstring).
# ruff: noqa: ANN001, ANN201

import contextlib
import json
import os
import resource
import time

import torch
import torch.distributed as dist

from .memory_savers import OffloadActivations, apply_chunked_output, forward_loss, keep_head_on_device
from .pipeline_stages import train_pipeline
from .train_fitplan import (
    MIXED,
    PLAN,
    apply_checkpointing,
    apply_float8,
    apply_fsdp,
    apply_liger,
    apply_tensor_parallel,
    batches,
    build,
    clip_gradients,
    decoder_layers,
    local_bytes,
    loss_scaler,
    materialize,
    on_meta,
    optimizer_for,
    parse,
    saved_bytes,
    sync_gradients,
)

# fitplan: end template only



def main():
    args = parse()
    d = PLAN["decisions"]
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = d["precision"] == "tf32"
        torch.backends.cudnn.allow_tf32 = d["precision"] == "tf32"
    if d["pp"] > 1:
        train_pipeline(args, device, cuda)
    else:
        model, vocab, offload = prepared_model(args, device, cuda)
        train(args, model, vocab, offload, device, cuda)
    dist.barrier()  # no rank tears its process group down while another still talks to it
    dist.destroy_process_group()


def prepared_model(args, device, cuda):
    """The model as the plan runs it: built, patched (Liger, chunked loss, offload), checkpointed, converted to
    fp8, tensor-parallel, sharded or wrapped, compiled; with its vocabulary size and the offloading hooks."""
    from torch.distributed.device_mesh import init_device_mesh

    d = PLAN["decisions"]
    # Hybrid sharding (dp_replicate > 1): FSDP2 on a 2-D (replicate, shard) mesh, replicas outermost as priced.
    replicas = d.get("dp_replicate", 1)
    mesh = init_device_mesh("cuda" if cuda else "cpu", (replicas, d["dp"] // replicas, d["tp"]),
                            mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    torch.manual_seed(0)
    model = build(args, device)
    vocab = model.config.vocab_size  # read before DDP wraps the model (the wrapper has no .config)
    if d.get("loss") == "fused-linear":
        apply_liger(model)
    if d.get("loss") == "chunked":
        apply_chunked_output(model)
    offload = OffloadActivations(device) if d.get("activation_offload") else None
    if offload is not None:
        keep_head_on_device(model)
    apply_checkpointing(model)
    if d["precision"] == "fp8":
        apply_float8(model)
    if d["tp"] > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if d["engine"] == "fsdp2":
        apply_fsdp(model, mesh["dp_replicate", "dp_shard"] if replicas > 1 else mesh["dp_shard"])
        if on_meta():
            materialize(model, args, device)
    elif d["dp"] > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    model.train()
    if d["compile"]:
        for layer in decoder_layers(model):  # per block, as torchtitan compiles
            layer.compile()
    return model, vocab, offload


def train(args, model, vocab, offload, device, cuda):
    """The training loop: accumulation, loss scaling, clipping, the optimizer step; with --report, one JSON per
    rank of its bytes, peaks and step times."""
    d = PLAN["decisions"]
    optimizer = optimizer_for(model, args.lr)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (args.warmup_steps + 1)))
    scaler = loss_scaler(device)
    half = MIXED.get(d["precision"])
    autocast = half is not None and d["engine"] == "ddp"
    data = batches(vocab, args, device)
    saved, offloaded, seconds, norms, lrs = [0], None, [], [], []
    params = grads = 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        started = time.perf_counter()
        for micro in range(d["grad_accum"]):
            ids, labels = next(data)
            context = torch.autocast(device.type, dtype=half) if autocast else contextlib.nullcontext()
            watch = saved_bytes(model, (ids, labels), saved) if args.report and step + micro == 0 else \
                contextlib.nullcontext()
            with sync_gradients(model, micro == d["grad_accum"] - 1):
                with context, watch:
                    loss = forward_loss(model, ids, labels, offload) / d["grad_accum"]
                if offload is not None and offloaded is None:
                    offloaded = offload.moved  # one micro-batch's bytes sent to the host
                (scaler.scale(loss) if scaler else loss).backward()
        params = sum(local_bytes(p) for p in model.parameters())
        grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        lrs.append(optimizer.param_groups[0]["lr"])
        norms += optimizer_step(args, model, optimizer, scaler)
        warmup.step()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        if dist.get_rank() == 0:
            print(f"step {step + 1}: loss {loss.item() * d['grad_accum']:.4f}", flush=True)
    if args.report:
        report(args, optimizer, scaler, cuda, {"param_bytes": params, "grad_bytes": grads,
                                              "saved_activation_bytes": saved[0],
                                              "offloaded_activation_bytes": offloaded, "step_seconds": seconds,
                                              "grad_norms": norms, "learning_rates": lrs})


def optimizer_step(args, model, optimizer, scaler):
    """Unscale, clip (its norm returned in a list, empty when not clipped) and step, then free the gradients."""
    norms = []
    if scaler:
        scaler.unscale_(optimizer)  # clip the true gradients
    if args.max_grad_norm > 0 and not PLAN["decisions"].get("optimizer_in_backward"):  # none left to clip
        norms.append(clip_gradients(model, args.max_grad_norm))
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norms


def report(args, optimizer, scaler, cuda, measured):
    """This rank's JSON report: what the loop measured, the optimizer states' bytes and the memory peaks."""
    # `step` counters count as device state where the implementation keeps them there (fused AdamW); the
    # foreach kernels keep them on the host (torch `_get_scalar_dtype`, capturable=False).
    on_device = bool(optimizer.defaults.get("fused"))
    states = sum(local_bytes(v) for state in optimizer.state.values() for k, v in state.items()
                 if torch.is_tensor(v) and (k != "step" or on_device))
    rank = dist.get_rank()
    os.makedirs(args.report, exist_ok=True)
    with open(os.path.join(args.report, f"rank{rank}.json"), "w") as handle:
        json.dump({"rank": rank, **measured, "optimizer_bytes": states,
                   "loss_scale": scaler.get_scale() if scaler else None,
                   "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                   "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                   "peak_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None}, handle)


if __name__ == "__main__":
    main()
