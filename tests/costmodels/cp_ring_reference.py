"""torch's own ring attention on gloo ranks: the reference of tests/costmodels/test_context_parallel.py.

Each of cp worker processes holds its load-balanced shard (chunks r and 2 cp - 1 - r) of a tiny Llama's attention
inputs and runs torch 2.13's `_templated_ring_attention` forward and backward (the code torch's context_parallel
dispatches SDPA to) with the CPU flash kernels and the p2p rotation. It records the bytes its all-to-all permutes
send, the attention FLOPs of every kernel call (torch's `sdpa_flop_count` formulas, a causal call at half, as the
kernels skip the masked half), and the peak of the bytes allocated during each pass. Only torch is imported here,
so the workers start fast.
"""

from __future__ import annotations

import json
import os
import sys
import weakref
from datetime import timedelta
from fractions import Fraction
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

from tests.gloo import run_ranks

REPO = Path(__file__).resolve().parents[2]
# The tiny Llama's attention (tests/graphs/tiny_configs.py): 4 query and 2 key/value heads of 32.
B, S, HEADS, KV_HEADS, HEAD_DIM = 2, 64, 4, 2, 32
LAUNCH_TIMEOUT = 300  # 4 ranks on a loaded 2-core machine (a CI run beside other work timed out at 120 s)
# A causal kernel computes half of the scores torch's formulas count (costmodels.compute.CAUSAL_FRACTION).
CAUSAL = Fraction(1, 2)
aten = torch.ops.aten


# --- the reference: real processes --------------------------------------------------------------------------


class Recorder(TorchDispatchMode):
    """Bytes sent by all-to-all permutes, and the peak of the bytes allocated while it is active."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank, self.sent, self.live, self.peak, self.refs = rank, 0, 0, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            tensor, splits = args[0], args[2]  # (input, output_split_sizes, input_split_sizes, group)
            rows = sum(n for dst, n in enumerate(splits) if dst != self.rank)
            self.sent += rows * tensor[0:1].numel() * tensor.element_size()
            # Wait here: gloo's work object holds the buffers until its background thread finishes, so an async
            # permute would free them at a time that varies run to run (the peak moved by up to 20%).
            torch.ops._c10d_functional.wait_tensor.default(out)
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        if key not in self.refs:
            self.refs[key] = 0
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(tensor, self._release, key, nbytes)

    def _release(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= nbytes


def run_rank(rank: int, cp: int) -> dict[str, object]:
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    ring._cp_options.rotate_method = ring._RotateMethod.ALL_TO_ALL  # p2p hops (Megatron/TE's ring)
    torch.manual_seed(0)
    full = [torch.randn(B, h, S, HEAD_DIM, dtype=torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS)]

    def shard(x: torch.Tensor) -> torch.Tensor:
        chunks = x.chunk(2 * cp, dim=2)
        return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=2).contiguous()

    q, k, v = (shard(x) for x in full)
    flops = {"forward": Fraction(0), "backward": Fraction(0)}

    def forward_op(q_, k_, v_, is_causal=False, **kwargs):
        flops["forward"] += flop_counter.sdpa_flop_count(q_.shape, k_.shape, v_.shape) * (
            CAUSAL if is_causal else 1)
        return aten._scaled_dot_product_flash_attention_for_cpu(q_, k_, v_, is_causal=is_causal, **kwargs)

    def backward_op(*, query, key, value, out, logsumexp, is_causal, grad_out, **kwargs):
        flops["backward"] += flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape,
                                                                   value.shape) * (CAUSAL if is_causal else 1)
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, query, key, value, out, logsumexp,
                                                                         0.0, is_causal)

    group = dist.group.WORLD
    with Recorder(rank) as fwd:
        out, lse = ring._templated_ring_attention(group, 2, forward_op, q, k, v, is_causal=True)
    grad = torch.randn_like(out)
    with Recorder(rank) as bwd:
        ring._templated_ring_attention_backward(group, 2, backward_op, grad, "grad_out", q, k, v, out, lse, True)
    with Recorder(rank) as local_fwd:  # local attention on the same shard: what the lowering already counts
        local_out, local_lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)
    with Recorder(rank) as local_bwd:
        aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, local_out, local_lse, 0.0, True)
    return {"sent": [fwd.sent, bwd.sent], "flops": [str(flops["forward"]), str(flops["backward"])],
            "extra": [fwd.peak - local_fwd.peak, bwd.peak - local_bwd.peak]}


class RingAttention(torch.autograd.Function):
    """Causal attention over the context-parallel group as torch's CP dispatcher runs SDPA: the ring forward and
    backward, saving what the CPU flash kernel's autograd node saves (q, k, v, output, log-sum-exp)."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        from torch.distributed.tensor.experimental._context_parallel import _attention as ring

        out, lse = ring._templated_ring_attention(dist.group.WORLD, 2, aten._scaled_dot_product_flash_attention_for_cpu,
                                                  q, k, v, is_causal=True, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor.experimental._context_parallel import _attention as ring

        def op(*, query, key, value, out, logsumexp, is_causal, grad_out, **kwargs):
            return aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, query, key, value, out, logsumexp, 0.0, is_causal, scale=ctx.scale)

        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring._templated_ring_attention_backward(dist.group.WORLD, 2, op, grad.contiguous(), "grad_out",
                                                             q, k, v, out, lse, True)
        return dq, dk, dv, None


def ring_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-interface entry for `RingAttention` (K, V unrepeated, as SDPA with enable_gqa)."""
    out = RingAttention.apply(query, key.contiguous(), value.contiguous(), scaling)
    return out.transpose(1, 2).contiguous(), None


def run_model_rank(rank: int, cp: int, config_dir: str) -> dict[str, object]:
    """Saved bytes per decoder layer of one training step of the tiny Llama on this rank's load-balanced shard of
    every sequence (positions of chunks r and 2 cp - 1 - r), with ring attention across the ranks."""
    import transformers.masking_utils as masking_utils
    from transformers import AttentionInterface, AttentionMaskInterface, AutoConfig, AutoModelForCausalLM

    AttentionInterface.register("ring", ring_attention)
    AttentionMaskInterface.register("ring", lambda *args, **kwargs: None)  # causal inside the kernel
    masking_utils.find_packed_sequence_indices = lambda position_ids: None  # shards are not packed sequences
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(config_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="ring")
    model.train()
    ids = torch.randint(0, config.vocab_size, (B, S))
    chunks = torch.arange(S).chunk(2 * cp)
    positions = torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])
    local = ids[:, positions]
    layers = model.model.layers
    existing = {p.untyped_storage()._cdata for p in model.parameters()}
    existing |= {b.untyped_storage()._cdata for b in model.buffers()}
    existing |= {local.untyped_storage()._cdata}
    stack, owner, nbytes, keep = ["outside"], {}, {}, []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in existing and storage._cdata not in owner:
            owner[storage._cdata], nbytes[storage._cdata] = stack[-1], storage.nbytes()
            keep.append(storage)
        return tensor

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: stack.append(f"layer{i}"))
        layer.register_forward_hook(lambda m, a, o: stack.pop() and None)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=local, labels=local, position_ids=positions.unsqueeze(0), use_cache=False).loss
    loss.backward()
    return {"layer_saved": [sum(n for k, n in nbytes.items() if owner[k] == f"layer{i}") for i in range(len(layers))]}


def run_ulysses_rank(rank: int, cp: int) -> dict[str, object]:
    """Bytes this rank sends through DeepSpeed-Ulysses' own `DistributedAttention` (its q, k, v and output
    all-to-alls, sequence shards to head shards and back) in one forward and backward of the tiny Llama's
    attention shapes, counted at every `all_to_all_single` call (each sends all but its own 1/cp share)."""
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (`build_shm_op`, ~6 min of C++ on 2 cores;
    # a run killed meanwhile leaves a lock every later build waits on forever). The all-to-alls counted here go
    # through torch.distributed either way: the op is left out.
    # (`deepspeed.comm.torch` as an attribute is torch itself, star-exported by deepspeed.comm: the module is read
    # from sys.modules.)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(cp))
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)  # wraps the gloo group
    sent, phase = [0, 0], [0]
    original = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):  # DeepSpeed passes `input=` by name
        sent[phase[0]] += input.numel() * input.element_size() * (cp - 1) // cp
        return original(output, input, *args, **kwargs)

    def local(q, k, v, *args, **kwargs):  # (b, s, heads, d) as Ulysses hands them over
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                               v.transpose(1, 2), is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)

    dist.all_to_all_single = counting
    try:
        attention = DistributedAttention(local, dist.group.WORLD, scatter_idx=2, gather_idx=1)
        q, k, v = (torch.randn(B, S // cp, h, HEAD_DIM, dtype=torch.bfloat16, requires_grad=True)
                   for h in (HEADS, KV_HEADS, KV_HEADS))
        out = attention(q, k, v, 0)
        phase[0] = 1
        out.float().sum().backward()
    finally:
        dist.all_to_all_single = original
    return {"sent": sent}


def worker(spec_path: str, rank: int) -> None:
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=spec["cp"],
                            timeout=timedelta(seconds=60))
    try:
        if spec.get("model"):
            result = run_model_rank(rank, spec["cp"], spec["model"])
        elif spec.get("ulysses"):
            result = run_ulysses_rank(rank, spec["cp"])
        else:
            result = run_rank(rank, spec["cp"])
    finally:
        dist.destroy_process_group()
    (Path(spec_path).parent / f"rank{rank}.json").write_text(json.dumps(result))


def launch(folder: Path, cp: int, *, model: Path | None = None, ulysses: bool = False) -> list[dict]:
    """Run the ring (given a model config folder, a model step; with `ulysses`, DeepSpeed's all-to-all attention)
    on `cp` gloo ranks (this file as a script) and return each rank's record."""
    spec = folder / "spec.json"
    spec.write_text(json.dumps({"store": str(folder / "store"), "cp": cp, "model": str(model) if model else None,
                                "ulysses": ulysses}))
    return run_ranks("tests.costmodels.cp_ring_reference", [str(spec)], world=cp, folder=folder,
                     timeout=LAUNCH_TIMEOUT)


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]))
