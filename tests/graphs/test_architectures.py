"""The architecture table (graphs/data/architectures.json) against the libraries that state its facts: transformers'
registries and its models built on the meta device, torchtitan's model registry, liger-kernel's patch table and
patch functions, and the bundled catalog. The lowerings' own tests (test_titan.py, test_megatron.py) and the
pipeline script's composition test (tests/solver/test_torchrun_pipeline.py) run every type the table lowers or cuts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from graphs import catalog_ids, load_entry
from graphs.architectures import (
    architecture,
    flagged,
    has_flag,
    liger_fused_linear,
    liger_patched,
    load_architectures,
    megatron_kind,
    pipeline_classes,
    supported,
    table_from_json,
    titan_family,
    titan_lowering,
)

ROOT = Path(__file__).resolve().parents[2]
TYPES = list(load_architectures())
# Config classes whose defaults transformers 5.24 cannot build a model from (head_dim or the key/value heads left
# None): the smallest fields that make them build, unrelated to the facts checked.
BUILDABLE = {"hunyuan_v1_dense": {"head_dim": 128}, "hunyuan_v1_moe": {"head_dim": 128},
             "ministral": {"head_dim": 128}, "nemotron": {"num_key_value_heads": 48}}
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
# Per-head query/key norm attribute pairs in transformers' attention modules (Qwen3, Gemma 3, ...; HunYuan).
QK_NORM_NAMES = (("q_norm", "k_norm"), ("query_layernorm", "key_layernorm"))
VALID = {"_source": "test", "architectures": {"llama": {"classes": {"value": ["LlamaForCausalLM"], "_source": "s"}}}}


def default_config(model_type: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **BUILDABLE.get(model_type, {}))


def meta_model(model_type: str) -> torch.nn.Module:
    """transformers' causal LM of `model_type` with its config class's defaults, on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(default_config(model_type))


def per_head_qk_norm(decoder: torch.nn.Module) -> bool:
    """Whether some self-attention module holds a learned norm of head_dim elements for both queries and keys."""
    for module in decoder.modules():
        head_dim = getattr(module, "head_dim", None)
        if not isinstance(head_dim, int) or "Cross" in type(module).__name__:
            continue
        for names in QK_NORM_NAMES:
            norms = [getattr(module, name, None) for name in names]
            if all(isinstance(getattr(n, "weight", None), torch.Tensor) and n.weight.numel() == head_dim
                   for n in norms):
                return True
    return False


def qkv_bias_only(decoder: torch.nn.Module) -> bool:
    """Whether q, k and v projections carry a bias and no other linear layer of the decoder does."""
    projections = [[getattr(m, p) for p in ("q_proj", "k_proj", "v_proj")] for m in decoder.modules()
                   if all(isinstance(getattr(m, p, None), torch.nn.Linear) for p in ("q_proj", "k_proj", "v_proj"))]
    qkv = {id(linear) for group in projections for linear in group}
    others = [m for m in decoder.modules() if isinstance(m, torch.nn.Linear) and id(m) not in qkv]
    return bool(projections) and all(linear.bias is not None for group in projections for linear in group) \
        and all(m.bias is None for m in others)


def position_tables(model: torch.nn.Module, config: Any) -> list[str]:
    """Names of the tables indexed by position: embeddings (other than the tokens') and 2-D buffers with
    max_position_embeddings rows (OPT and BioGPT add 2 offset rows); square buffers are causal masks."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if not isinstance(limit, int):
        return []
    tokens = model.get_input_embeddings()
    tables = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding) and m is not tokens
              and limit <= m.num_embeddings <= limit + 2]
    return tables + [n for n, b in model.named_buffers() if b.dim() == 2 and limit <= b.shape[0] <= limit + 2
                     and b.shape[0] != b.shape[1]]


def test_every_model_type_is_a_transformers_config():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    assert len(TYPES) >= 40  # the table loaded
    assert [t for t in TYPES if t not in CONFIG_MAPPING_NAMES] == []


def test_classes_are_transformers_causal_lm_classes():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LM

    for model_type, record in load_architectures().items():
        names = CAUSAL_LM.get(model_type, ())
        assert record.classes.value == ((names,) if isinstance(names, str) else tuple(names)), model_type


def test_every_catalog_model_has_a_record():
    missing = {load_entry(model_id).config_dict().get("model_type") for model_id in catalog_ids()} - set(TYPES)
    assert missing == set()


def test_liger_patched_types_are_the_decoders_liger_kernels_patch_table_holds():
    """liger-kernel 0.8.5's MODEL_TYPE_TO_APPLY_LIGER_FN, restricted to the types transformers builds as causal LMs
    (its vision-language keys have none): every one, and nothing else."""
    pytest.importorskip("liger_kernel")
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL_LM

    decoders = {t for t in MODEL_TYPE_TO_APPLY_LIGER_FN if t in CAUSAL_LM}
    assert set(supported("liger")) == decoders
    for model_type in decoders:  # each source names the patch function
        assert MODEL_TYPE_TO_APPLY_LIGER_FN[model_type].__name__ in architecture(model_type).liger.source


def test_liger_fused_linear_is_what_each_patch_function_accepts():
    """Each patch function called with fused_linear_cross_entropy=True (its other kernels off) in a fresh process,
    as transformers' use_liger_kernel calls it with fitplan's liger_kernel_config: granite's raises
    NotImplementedError, the others patch."""
    pytest.importorskip("liger_kernel")
    probe = (
        "import inspect, json, sys\n"
        "from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN as FN\n"
        "out = {}\n"
        "for t in json.loads(sys.argv[1]):\n"
        "    params = inspect.signature(FN[t]).parameters\n"
        "    off = {k: False for k, p in params.items() if p.default is True and k != 'fused_linear_cross_entropy'}\n"
        "    try:\n"
        "        FN[t](fused_linear_cross_entropy=True, **off)\n"
        "        out[t] = True\n"
        "    except NotImplementedError:\n"
        "        out[t] = False\n"
        "print(json.dumps(out))\n")
    patched = list(supported("liger"))
    done = subprocess.run([sys.executable, "-c", probe, json.dumps(patched)], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    accepted = json.loads(done.stdout.strip().splitlines()[-1])
    assert accepted == {t: liger_fused_linear(t) for t in patched}
    assert not accepted["granite"] and accepted["llama"]  # the check tells the two apart


def test_torchtitan_families_are_in_torchtitans_model_registry():
    """Each family is one of torchtitan 0.3.0's models with a `model_registry`; a type lowered with its MoE layers
    has an MoE flavour there, and it is exactly the types whose transformers config has experts."""
    pytest.importorskip("torchtitan")
    import importlib

    from torchtitan.models import _supported_models

    for model_type in supported("torchtitan"):
        lowering = titan_lowering(model_type)
        assert lowering is not None and lowering.family in _supported_models
        module = importlib.import_module(f"torchtitan.models.{lowering.family}")
        flavours = getattr(module, f"{lowering.family}_configs")
        moe = any(layer.moe is not None for flavour in flavours for layer in module.model_registry(flavour).model.layers
                  if hasattr(layer, "moe"))
        experts = any(getattr(default_config(model_type), f, 0) for f in EXPERT_FIELDS)
        assert (lowering.moe, lowering.moe and moe) == (experts, experts), model_type


def test_megatron_kinds_follow_the_transformers_configs_experts():
    lowered = supported("megatron")
    assert {"llama", "mixtral"} <= set(lowered) and megatron_kind("mistral") is None
    for model_type in lowered:
        experts = any(getattr(default_config(model_type), f, 0) for f in EXPERT_FIELDS)
        assert megatron_kind(model_type) == ("moe" if experts else "dense"), model_type


@pytest.mark.parametrize("model_type", TYPES)
def test_layout_flags_match_the_transformers_model_built_on_meta(model_type):
    """Per-head query/key norm, bias on q/k/v only, a position table and (for the pipeline types) the layout the
    torchrun script cuts, read from transformers' own model with its config class's defaults."""
    model = meta_model(model_type)
    decoder = model.get_decoder()
    assert has_flag(model_type, "qk_norm") == per_head_qk_norm(decoder)
    assert has_flag(model_type, "qkv_bias_only") == qkv_bias_only(decoder)
    assert has_flag(model_type, "fixed_positions") == bool(position_tables(model, default_config(model_type)))
    if has_flag(model_type, "pipeline_stages"):
        assert [hasattr(model.model, n) for n in ("embed_tokens", "layers", "norm")] + [hasattr(model, "lm_head")] \
            == [True] * 4


def test_pipeline_classes_are_the_classes_of_the_pipeline_types():
    assert pipeline_classes() == tuple(c for t in flagged("pipeline_stages") for c in architecture(t).classes.value)
    assert "LlamaForCausalLM" in pipeline_classes() and "Gemma2ForCausalLM" not in pipeline_classes()


def test_a_model_type_the_table_does_not_hold_has_no_support():
    for unknown in ("starcoder2", "", None, ["llama"]):
        assert architecture(unknown) is None and titan_family(unknown) is None and megatron_kind(unknown) is None
        assert not liger_patched(unknown) and not has_flag(unknown, "fixed_positions")
    assert titan_family("llama") == "llama3" and liger_patched("granite") and not liger_fused_linear("granite")


@pytest.mark.parametrize("edit, message", [
    (lambda t: t["architectures"]["llama"]["classes"].pop("_source"), "_source"),
    (lambda t: t["architectures"]["llama"]["classes"].update(_source=""), "_source"),
    (lambda t: t["architectures"]["llama"]["classes"].update(value=[]), "value"),
    (lambda t: t["architectures"]["llama"].update(qk_norm={"value": True}), "qk_norm._source"),
    (lambda t: t["architectures"]["llama"].update(torchtitan={"family": "llama2", "_source": "s"}), "family"),
    (lambda t: t["architectures"]["llama"].update(megatron={"kind": "hybrid", "_source": "s"}), "kind"),
    (lambda t: t["architectures"]["llama"].update(rope=True), "rope"),
])
def test_a_malformed_table_is_refused_naming_the_field(edit, message):
    table = json.loads(json.dumps(VALID))
    assert table_from_json(json.dumps(table), origin="t.json")["llama"].classes.value == ("LlamaForCausalLM",)
    edit(table)
    with pytest.raises(ValueError, match=r"architecture table t\.json is malformed") as refused:
        table_from_json(json.dumps(table), origin="t.json")
    assert message in str(refused.value)


def test_a_table_that_is_not_json_is_refused():
    with pytest.raises(ValueError, match="is malformed"):
        table_from_json("{", origin="t.json")
