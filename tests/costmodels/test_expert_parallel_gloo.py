"""Expert parallelism against real torch.distributed runs over gloo on CPU, 4 ranks: dispatch and combine bytes of
all_to_all_single moving the routed tokens of a tiny MoE layer (ep=4, and ep=2 in two groups), and the per-rank
states of a tiny Mixtral whose experts are split over ep=2 ranks and sharded by FSDP2 over the expert-data-parallel
ranks as torchtitan shards them (experts on the dp_shard_mod_ep mesh, the rest on all ranks).

One launch runs this file as 4 worker processes; each writes what it moved and holds, and the tests compare it with
`expert_parallel.dispatch_bytes` and `states.model_states`.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.gloo import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
WORLD = 4
EXPERTS, TOP_K, HIDDEN = 8, 2, 32
MICRO_BATCH, SEQ = 2, 24
# Ample for two tiny all-to-alls on two shared cores; a hung collective fails the launch, not the suite.
LAUNCH_TIMEOUT = 120


def route(tokens: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """Each token's top-k experts (the MoE router: softmax over the logits, top-k)."""
    return torch.topk(torch.softmax(tokens.float() @ router.float().T, dim=-1), TOP_K, dim=-1).indices


def exchange(tokens: torch.Tensor, experts: torch.Tensor, ep: int, group) -> dict:
    """Dispatch each (token, expert) pair to the rank that holds the expert and combine it back; bytes moved."""
    owner = (experts // (EXPERTS // ep)).flatten()  # rank within the ep group; experts rank * E / ep onward
    order = torch.argsort(owner, stable=True)
    send = tokens.repeat_interleave(TOP_K, dim=0)[order].contiguous()  # the permuted tokens
    splits = torch.bincount(owner, minlength=ep)
    incoming = torch.empty_like(splits)
    dist.all_to_all_single(incoming, splits, group=group)
    received = send.new_empty((int(incoming.sum()), HIDDEN))
    dist.all_to_all_single(received, send, incoming.tolist(), splits.tolist(), group=group)
    back = send.new_empty(send.shape)
    dist.all_to_all_single(back, received, splits.tolist(), incoming.tolist(), group=group)
    assert torch.equal(back, send)  # combine returns every pair to its token's rank
    size = send.element_size()
    return {"dispatch_sent": send.numel() * size, "dispatch_received": received.numel() * size,
            "combine_sent": received.numel() * size, "combine_received": back.numel() * size}


def fsdp2_expert_states(rank: int, *, ep: int) -> dict:
    """Rank `rank`'s parameter and AdamW bytes of the tiny Mixtral with its experts split over `ep` ranks (adjacent,
    as Megatron's tp-ep-dp order places them at tp=1) and FSDP2-sharded over the expert-data-parallel ranks, every
    other tensor over all ranks; placements by fitplan's `fsdp_shard_dim`, as the emitted script passes it."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from costmodels.zero import fsdp_shard_dim
    from tests.graphs.tiny_configs import tiny_values

    fields = dict(tiny_values("mixtral"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields),
                                             dtype=torch.float32)
    world = init_device_mesh("cpu", (WORLD,))
    experts_mesh = DeviceMesh("cpu", torch.arange(WORLD).reshape(WORLD // ep, ep), mesh_dim_names=("edp", "ep"))
    edp = experts_mesh["edp"]
    for layer in model.model.layers:
        stack = layer.mlp.experts
        for name, param in list(stack.named_parameters(recurse=False)):
            local = param.shape[0] // ep
            part = param.detach()[rank % ep * local:(rank % ep + 1) * local].clone()
            setattr(stack, name, torch.nn.Parameter(part))
        fully_shard(stack, mesh=edp, shard_placement_fn=lambda p: Shard(fsdp_shard_dim(tuple(p.shape), edp.size())))
        fully_shard(layer, mesh=world, shard_placement_fn=lambda p: Shard(fsdp_shard_dim(tuple(p.shape), WORLD)))
    fully_shard(model, mesh=world, shard_placement_fn=lambda p: Shard(fsdp_shard_dim(tuple(p.shape), WORLD)))
    params = list(model.parameters())
    by_mesh: dict[object, list] = {}
    for p in params:
        p.grad = torch.zeros_like(p)
        by_mesh.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    opt = torch.optim.AdamW([{"params": group} for group in by_mesh.values()], lr=1e-3, foreach=True)
    opt.step()

    def nbytes(t: torch.Tensor) -> int:
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    return {"params": sum(nbytes(p) for p in params),
            "optimizer": sum(nbytes(opt.state[p][k]) for p in params for k in ("exp_avg", "exp_avg_sq"))}


def worker(store: str, rank: int) -> None:
    """One rank: ep=4 over the world, then ep=2 in groups {0, 1} and {2, 3}; writes `rank{rank}.json`."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        router = torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(0))
        tokens = torch.randn(MICRO_BATCH * SEQ, HIDDEN, generator=torch.Generator().manual_seed(1 + rank))
        tokens = tokens.to(torch.bfloat16)
        experts = route(tokens, router)
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        results = {"ep4": exchange(tokens, experts, 4, None), "ep2": exchange(tokens, experts, 2, pairs[rank // 2]),
                   "fsdp2": fsdp2_expert_states(rank, ep=2)}
    finally:
        dist.destroy_process_group()
    (Path(store).parent / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("ep_gloo")
    return run_ranks("tests.costmodels.test_expert_parallel_gloo", [str(folder / "store")], world=WORLD,
                     folder=folder, timeout=LAUNCH_TIMEOUT)


def _layer_and_config(ep: int):
    from costmodels import Config, Engine
    from graphs import Layer, MoE, ParamTensor, Role

    stack = ParamTensor(name="mlp.experts.gate_up_proj", node="layers.0", shape=(EXPERTS, 2 * 64, HIDDEN),
                        trainable=True, itemsize=2, tp_style="packed_colwise", tp_dim=1)
    layer = Layer(name="layers.0", role=Role.DECODER, index=0, kind=0, params=(stack,),
                  moe=MoE(experts=EXPERTS, top_k=TOP_K, expert_params=stack.numel))
    return layer, Config(engine=Engine.FSDP2, zero=3, dp=WORLD, ep=ep)


@pytest.mark.parametrize("ep", [4, 2])
def test_dispatch_and_combine_bytes_per_rank_equal_the_model(measured, ep):
    # Exact: every rank sends each of its b x s x top_k token-expert pairs once in dispatch (the pairs for its own
    # experts included, as all_to_all_single's send buffer holds them) and receives as many back in combine.
    from costmodels.expert_parallel import dispatch_bytes

    layer, config = _layer_and_config(ep)
    predicted = dispatch_bytes(layer, config, b=MICRO_BATCH, s=SEQ, hidden=HIDDEN, itemsize=2)
    for rank in measured:
        assert rank[f"ep{ep}"]["dispatch_sent"] == predicted
        assert rank[f"ep{ep}"]["combine_received"] == predicted


@pytest.mark.parametrize("ep", [4, 2])
def test_received_bytes_average_the_balanced_share(measured, ep):
    # What the ranks receive sums to what they send: balanced routing gives each rank the b x s x top_k pairs the
    # model prices, and the busiest rank's excess over that is what the routing-imbalance allowance covers.
    from costmodels.expert_parallel import dispatch_bytes

    layer, config = _layer_and_config(ep)
    predicted = dispatch_bytes(layer, config, b=MICRO_BATCH, s=SEQ, hidden=HIDDEN, itemsize=2)
    received = [rank[f"ep{ep}"]["dispatch_received"] for rank in measured]
    assert sum(received) == WORLD * predicted
    assert max(received) > predicted  # a random router is not balanced: the allowance is needed


def test_fsdp2_expert_parallel_state_bytes_equal_every_gloo_rank(measured, tmp_path):
    # Exact: both sides count whole elements of the same shards (the tiny Mixtral's chunks are even here). With every
    # state sharded, EP changes which experts a rank holds more than how many bytes: this checks the layout the
    # runtime builds; the replicated states, where EP divides the bytes, are test_expert_parallel.py's.
    from costmodels import Config, Engine, Optimizer, Precision, lowering_for
    from costmodels.states import model_states
    from graphs import lower
    from tests.graphs.reference import write_config
    from tests.graphs.tiny_configs import tiny_values

    config = Config(engine=Engine.FSDP2, zero=3, dp=WORLD, ep=2, precision=Precision.BF16_MIXED,
                    optimizer=Optimizer.ADAMW)
    dtype, autocast = lowering_for(config)
    graph = lower(str(write_config(tmp_path / "mixtral", tiny_values("mixtral"))), dtype=dtype, autocast=autocast,
                  attention="sdpa", use_cache=False)
    states = model_states(graph, config)
    for rank in measured:
        assert (rank["fsdp2"]["params"], rank["fsdp2"]["optimizer"]) == (states.params, states.optimizer)


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]))
