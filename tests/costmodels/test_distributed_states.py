"""Per-rank model-state bytes against real torch.distributed runs: FSDP2 and DTensor TP over gloo on CPU.

One launch per world size runs this file as N worker processes. Each builds the tiny Llama with real tensors,
takes one AdamW step per case and writes its local bytes to JSON; the tests compare `model_states` exactly.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import AutoConfig, AutoModelForCausalLM

from costmodels import Config, Engine, Optimizer, Precision, lowering_for
from costmodels.states import model_states
from costmodels.terms import ModelStates
from costmodels.zero import fsdp_shard_dim, local_shape, shard_ranks
from graphs import LayerGraph, lower
from tests.gloo import run_ranks
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
MICRO_BATCH, SEQ = 2, 16
# Ample for one tiny step per case on two shared cores; a hung collective fails the launch instead of the suite.
LAUNCH_TIMEOUT = 240


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One real run: how the tiny Llama is parallelised over `world` ranks."""

    name: str
    world: int
    layout: str
    """One of fsdp2 (fully_shard per layer, then the root), tp (DTensor TP from `_tp_plan`), fsdp2+tp (2-D), hsdp
    (fully_shard on a 2-D (replicate, shard) mesh: 2 replicas of 2 shards)."""
    reshard: bool = True
    """FSDP2 `reshard_after_forward` (True is ZeRO-3-like, False ZeRO-2-like)."""
    overrides: tuple[tuple[str, int], ...] = ()
    """Config fields changed from `tiny_values(arch)`."""
    arch: str = "llama"

    def values(self) -> dict:
        return {**tiny_values(self.arch), **dict(self.overrides)}

    def config(self) -> Config:
        tp = {"fsdp2": 1, "tp": self.world, "fsdp2+tp": 2, "hsdp": 1}[self.layout]
        if self.layout == "tp":
            return Config(engine=Engine.DDP, tp=tp, dp=1, precision=Precision.FP32, optimizer=Optimizer.ADAMW,
                          micro_batch=MICRO_BATCH)
        return Config(engine=Engine.FSDP2, zero=3 if self.reshard else 2, tp=tp, dp=self.world // tp,
                      dp_replicate=2 if self.layout == "hsdp" else 1, precision=Precision.BF16_MIXED,
                      optimizer=Optimizer.ADAMW, micro_batch=MICRO_BATCH)


# TP over 4 ranks must divide the KV heads (tiny Llama has 2), so that case uses 4. Vocab 514 makes FSDP2's dim-0
# chunks uneven over 4 ranks (129, 129, 129, 127 rows), so "the largest rank's shard" is tested, not assumed.
CASES = [
    Case(name="fsdp2-w2-reshard", world=2, layout="fsdp2", reshard=True),
    Case(name="fsdp2-w2-keep", world=2, layout="fsdp2", reshard=False),
    Case(name="tp-w2", world=2, layout="tp"),
    Case(name="fsdp2-w4-reshard", world=4, layout="fsdp2", reshard=True),
    Case(name="fsdp2-w4-keep", world=4, layout="fsdp2", reshard=False),
    Case(name="fsdp2-w4-uneven", world=4, layout="fsdp2", reshard=True, overrides=(("vocab_size", 514),)),
    Case(name="tp-w4", world=4, layout="tp", overrides=(("num_key_value_heads", 4),)),
    Case(name="fsdp2+tp-dp2-tp2", world=4, layout="fsdp2+tp", reshard=True),
    # Hybrid sharding (issue 34): two replicas of a two-rank shard group, uneven vocabulary chunks over the group.
    Case(name="hsdp-2x2", world=4, layout="hsdp", reshard=True, overrides=(("vocab_size", 513),)),
    Case(name="hsdp-2x2-keep", world=4, layout="hsdp", reshard=False),
    # Two experts over four ranks: the expert stacks shard on their largest dim, not on dim 0 (2 rows for 4 ranks).
    Case(name="fsdp2-w4-moe", world=4, layout="fsdp2", reshard=True, arch="mixtral",
         overrides=(("num_local_experts", 2), ("num_experts_per_tok", 1))),
]


# --- the reference: real processes --------------------------------------------------------------------------


def launch(world: int, cases: list[Case], folder: Path) -> list[dict]:
    """Run `cases` on `world` gloo ranks (this file as a script) and return each rank's measurements."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = folder / "spec.json"
    spec.write_text(json.dumps({"world": world, "store": str(folder / "store"),
                                "cases": [{**asdict(c), "values": c.values()} for c in cases]}))
    return run_ranks("tests.costmodels.test_distributed_states", [str(spec)], world=world, folder=folder,
                     timeout=LAUNCH_TIMEOUT, env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})


def worker(spec_path: str, rank: int) -> None:
    """One rank: every case in the spec, one training step each; writes `rank{rank}.json` beside the spec."""
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank,
                            world_size=spec["world"], timeout=timedelta(seconds=120))
    try:
        results = {case["name"]: run_case(case, spec["world"]) for case in spec["cases"]}
    finally:
        dist.destroy_process_group()
    (Path(spec_path).parent / f"rank{rank}.json").write_text(json.dumps(results))


def run_case(case: dict, world: int) -> dict:
    """Build, parallelise, step once and measure this rank's local bytes."""
    fields = dict(case["values"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    if case["layout"] == "fsdp2":
        shard_fully(model, init_device_mesh("cpu", (world,)), reshard=case["reshard"])
    elif case["layout"] == "tp":
        parallelize(model, init_device_mesh("cpu", (world,)))
    elif case["layout"] == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        shard_fully(model, mesh, reshard=case["reshard"])
    else:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize(model, mesh["tp"])
        shard_fully(model, mesh["dp"], reshard=case["reshard"])
    opt = torch.optim.AdamW(param_groups(model), lr=1e-3, foreach=True)
    ids = torch.randint(0, config.vocab_size, (MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    return measure(model, opt)


def shard_fully(model, mesh, *, reshard: bool) -> None:
    """FSDP2 as torchtitan applies it: each decoder layer, then the root; bf16 compute, fp32 reduction."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    ranks = mesh.size(mesh.ndim - 1)  # the shard dim (of a 2-D HSDP mesh: the second)

    def placement(param) -> Shard:  # the dim fitplan's rule picks; FSDP2 itself does the chunking measured here
        return Shard(fsdp_shard_dim(tuple(param.shape), ranks))

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard, shard_placement_fn=placement)


def parallelize(model, mesh) -> None:
    """DTensor TP of every entry in the model's own `_tp_plan`, then re-tie the LM head to the embedding.

    `parallelize_module` gives the embedding and the head separate DTensor parameters; transformers keeps tied
    weights tied, and both are `Shard(0)` here, so the head takes the embedding's parameter again.
    """
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
              "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate())}
    parallelize_module(model, mesh, {fqn: styles[style]() for fqn, style in model._tp_plan.items()})
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def param_groups(model) -> list[dict]:
    """DTensor and plain parameters in separate groups: foreach kernels refuse lists that mix them (torch 2.13:
    "got mixed torch.Tensor and DTensor"); TP leaves the norm weights plain."""
    params = list(model.parameters())
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return [{"params": group} for group in groups if group]


def measure(model, opt) -> dict:
    """Local bytes of parameters, gradients and AdamW moments (`step` counters live on the CPU on GPUs too)."""
    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    def nbytes(tensors) -> int:
        return sum(local(t).numel() * local(t).element_size() for t in tensors)

    params = dict(model.named_parameters())  # tied parameters once
    states = [opt.state[p] for p in params.values()]
    return {"params": nbytes(params.values()), "grads": nbytes(p.grad for p in params.values()),
            "optimizer": nbytes(s[k] for s in states for k in ("exp_avg", "exp_avg_sq")),
            "shapes": {name: list(local(p).shape) for name, p in params.items()}}


# --- the tests ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[str, list[dict]]:
    """Each case's measurements, one dict per rank, from one launch per world size."""
    folder = tmp_path_factory.mktemp("gloo")
    results: dict[str, list[dict]] = {}
    for world in sorted({c.world for c in CASES}):
        cases = [c for c in CASES if c.world == world]
        ranks = launch(world, cases, folder / f"world{world}")
        results.update({c.name: [r[c.name] for r in ranks] for c in cases})
    return results


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> dict[str, tuple[LayerGraph, ModelStates]]:
    """Each case's lowered graph and fitplan `ModelStates`, the graph lowered as the case's configuration needs."""
    folder = tmp_path_factory.mktemp("graphs")
    out = {}
    for case in CASES:
        config = case.config()
        dtype, autocast = lowering_for(config)
        # One folder per model variant: `lower` caches in memory on the path, so equal variants lower once.
        variant = "-".join(f"{k}{v}" for k, v in case.overrides) or "base"
        graph = lower(str(write_config(folder / variant, case.values())), dtype=dtype, autocast=autocast,
                      attention="sdpa", use_cache=False)
        out[case.name] = graph, model_states(graph, config)
    return out


def _ranks(measured: dict, case: Case, field: str) -> list[int]:
    return [rank[field] for rank in measured[case.name]]


# All comparisons are exact: both sides count whole elements of the same shards. torch.chunk (FSDP2's dim-0
# split and DTensor `Shard`) gives rank 0 the largest chunk of every tensor, so rank 0 and the maximum over ranks
# must both equal the model's largest-rank figure.


@pytest.mark.parametrize("case", [c for c in CASES if c.layout != "tp"], ids=lambda c: c.name)
def test_fsdp2_state_bytes_equal_largest_gloo_rank(case, measured, expected):
    # The sharded gradients land during backward and zero_grad(set_to_none=True) frees them after the step: they
    # accumulate, none persist between steps.
    states = expected[case.name][1]
    for field, predicted in (("params", states.params), ("grads", states.accumulating_grads),
                             ("optimizer", states.optimizer)):
        ranks = _ranks(measured, case, field)
        assert (ranks[0], max(ranks)) == (predicted, predicted), (field, ranks)
    assert states.grads == 0


@pytest.mark.parametrize("case", [c for c in CASES if c.layout == "tp"], ids=lambda c: c.name)
def test_tensor_parallel_state_bytes_equal_largest_gloo_rank(case, measured, expected):
    # Without data parallelism there are no DDP buckets: every gradient byte is an accumulating one.
    states = expected[case.name][1]
    for field, predicted in (("params", states.params), ("grads", states.accumulating_grads),
                             ("optimizer", states.optimizer)):
        ranks = _ranks(measured, case, field)
        assert (ranks[0], max(ranks)) == (predicted, predicted), (field, ranks)
    assert states.grads == 0


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_local_shapes_equal_gloo_rank0_shards(case, measured, expected):
    # Per tensor, so that a byte mismatch above names the tensors responsible.
    graph, _ = expected[case.name]
    config = case.config()
    predicted = {t.name: list(local_shape(t, tp=config.tp, dp=shard_ranks(config), engine=config.engine))
                 for t in graph.params()}
    assert predicted == measured[case.name][0]["shapes"]


def test_hsdp_replicas_hold_the_same_shard_and_the_estimate_shards_over_one_group(measured, expected):
    # ranks 0 and 2 (1 and 3) hold the same shard in the two replicas; sharding over all four ranks instead (plain
    # FSDP2, what the estimate priced before dp_replicate) would give each a quarter of the states, not a half
    case = next(c for c in CASES if c.name == "hsdp-2x2")
    ranks = measured[case.name]
    assert ranks[0]["shapes"] == ranks[2]["shapes"] and ranks[1]["shapes"] == ranks[3]["shapes"]
    states = expected[case.name][1]
    assert states.optimizer == max(_ranks(measured, case, "optimizer"))
    flat = dataclasses.replace(case.config(), dp_replicate=1)
    assert model_states(expected[case.name][0], flat).optimizer < states.optimizer


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]))
