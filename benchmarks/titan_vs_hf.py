"""Activation bytes of one decoder layer, per checkpoint mode, traced through HF's and torchtitan's model code.

The case from issue 10: Llama-3.1-8B at 8192 tokens, micro-batch 2, which torchtitan trains with op-level SAC on
8 H100s (FSDP2, bf16 compute). Prints per-layer saved bytes for every mode each runtime lowers, the whole
model's activations (all layers in that mode, plus embedding, final norm, head and loss), and the allocated peak
`costmodels.estimator` gives for FSDP2 ZeRO-3 bf16-mixed AdamW on 8xH100. HF "selective" is the attention core
(Megatron's selective recompute); "op_selective" is torchtitan's op-level SAC policy on either runtime.
Usage: FITPLAN_CACHE_DIR=/tmp/fitplan-cache HF_HUB_OFFLINE=1 python benchmarks/titan_vs_hf.py [--model ID]
"""

from __future__ import annotations

import argparse

from costmodels import Config, Engine, Optimizer, Precision, Workload, estimate, parse_cluster
from graphs import Checkpoint, LayerGraph, Role, lower
from graphs.titan import lower_titan

GIB = 1024**3


def activation_bytes(graph: LayerGraph, mode: Checkpoint, *, b: int, s: int) -> tuple[int, int]:
    """(one decoder layer's saved bytes, the whole model's saved bytes incl. model-wide tensors) in `mode`."""
    layers = graph.decoder_layers()
    per_layer = layers[0].cost(mode).saved(b, s)
    rest = sum(node.cost().saved(b, s) for node in graph.nodes() if node.role is not Role.DECODER)
    during_pass = graph.checkpoint_shared if mode is not Checkpoint.NONE else graph.forward_shared
    wide = graph.inputs + graph.shared + during_pass
    return int(per_layer), int(sum(layer.cost(mode).saved(b, s) for layer in layers) + rest + wide(b, s))


def allocated_peak(graph: LayerGraph, mode: Checkpoint, *, b: int, s: int, gpus: str) -> int:
    cluster = parse_cluster(gpus)
    config = Config(tp=1, dp=cluster.world_size, engine=Engine.FSDP2, zero=3, micro_batch=b, grad_accum=1,
                    precision=Precision.BF16_MIXED, optimizer=Optimizer.ADAMW,
                    checkpoint=(mode,) * graph.dims.layers)
    workload = Workload(seq_len=s, global_batch=b * cluster.world_size)
    return estimate(graph, cluster, workload, config).memory.allocated_peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="meta-llama/Llama-3.1-8B")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--gpus", default="8xH100")
    args = parser.parse_args()
    b, s = args.micro_batch, args.seq_len
    runtimes = {"hf": lower(args.model, dtype="bfloat16", op_selective=True),
                "torchtitan": lower_titan(args.model, dtype="bfloat16")}
    print(f"{args.model}, micro-batch {b} x {s} tokens, bf16 (binary GiB)")
    print(f"{'runtime':11} {'checkpoint':13} {'per layer':>10} {'all activations':>16} "
          f"{'allocated peak ' + args.gpus:>24}")
    for name, graph in runtimes.items():
        for mode in graph.checkpoint_modes():
            layer, total = activation_bytes(graph, mode, b=b, s=s)
            peak = allocated_peak(graph, mode, b=b, s=s, gpus=args.gpus)
            print(f"{name:11} {mode.value:13} {layer / GIB:10.3f} {total / GIB:16.2f} {peak / GIB:24.2f}")


if __name__ == "__main__":
    main()
