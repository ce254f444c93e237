"""The bundled model catalog: coverage, native transformers builds, published counts and name lookup."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from graphs.catalog import CatalogEntry, catalog_ids, closest_ids, load_entry
from graphs.errors import UnknownModel

REQUIRED_IDS = [
    *(f"meta-llama/Llama-2-{s}-hf" for s in ("7b", "13b", "70b")),
    "meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-70B",
    *(f"meta-llama/Llama-3.1-{s}" for s in ("8B", "70B", "405B")),
    "meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-3B",
    "mistralai/Mistral-7B-v0.1", "mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x22B-v0.1",
    *(f"Qwen/Qwen2.5-{s}" for s in ("0.5B", "1.5B", "7B", "14B", "32B", "72B")),
    "Qwen/Qwen3-8B", "Qwen/Qwen3-32B", "Qwen/Qwen3-30B-A3B",
    *(f"google/gemma-2-{s}" for s in ("2b", "9b", "27b")),
    "microsoft/phi-2", "microsoft/Phi-3-mini-4k-instruct",
    "tiiuae/falcon-7b", "tiiuae/falcon-40b",
    "EleutherAI/pythia-1b", "EleutherAI/gpt-neox-20b",
    "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl",
    *(f"facebook/opt-{s}" for s in ("125m", "350m", "1.3b", "2.7b", "6.7b", "13b", "30b", "66b")),
    *(f"bigscience/bloom-{s}" for s in ("560m", "1b1", "3b", "7b1")),
    "Salesforce/codegen-350M-mono", "Salesforce/codegen-2B-mono",
    "deepseek-ai/DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V3",
]
WITH_PUBLISHED_COUNT = [i for i in catalog_ids() if load_entry(i).published_params is not None]


def transformers_config(entry: CatalogEntry) -> PretrainedConfig:
    fields = entry.config_dict()
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def fake_param_count(entry: CatalogEntry) -> int:
    """Unique parameters of the causal LM transformers builds, on fake tensors (tied weights counted once)."""
    with FakeTensorMode():
        model = AutoModelForCausalLM.from_config(transformers_config(entry), dtype=torch.bfloat16)
    return sum(p.numel() for p in model.parameters())


def matches_figure(count: int, value: int, digits: int) -> bool:
    """True when `value`, published with `digits` significant digits, is `count` rounded or truncated."""
    unit = 10 ** (len(str(value)) - digits)
    return value in ((count + unit // 2) // unit * unit, count // unit * unit)


def test_catalog_has_at_least_40_models_and_every_required_family():
    ids = catalog_ids()
    assert len(ids) >= 40
    assert ids == sorted(ids)
    assert [i for i in REQUIRED_IDS if i not in ids] == []


@pytest.mark.parametrize("model_id", catalog_ids())
def test_catalog_entry_builds_native_transformers_config_for_its_architecture(model_id):
    entry = load_entry(model_id)
    config = transformers_config(entry)
    assert entry.source and all(isinstance(f, str) for f in entry.uncertain)
    assert config.model_type == entry.config["model_type"]
    # The published architecture is the class transformers builds natively (no trust_remote_code).
    assert MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__ == entry.config["architectures"][0]


def test_rounded_figure_match_accepts_rounding_and_truncation():
    assert matches_figure(6_738_415_616, 6_740_000_000, 3)  # rounded: Llama-2-7B "6.74B"
    assert matches_figure(14_770_033_664, 14_700_000_000, 3)  # truncated: Qwen2.5-14B card "14.7B"
    assert not matches_figure(32_763_876_352, 32_500_000_000, 3)  # Qwen2.5-32B card "32.5B" matches neither


@pytest.mark.parametrize("model_id", WITH_PUBLISHED_COUNT)
def test_catalog_param_counts_match_published_counts(model_id):
    entry = load_entry(model_id)
    built = fake_param_count(entry)
    if entry.published_params_exact:
        assert built == entry.published_params
    else:
        # Publishers round or truncate ("2.7B" for CodeGen's 2.78B): either reading of the digits is accepted.
        assert matches_figure(built, entry.published_params, entry.published_params_digits)


def test_load_entry_accepts_any_case_and_the_bare_name_after_the_org():
    assert load_entry("META-LLAMA/llama-2-7B-HF").id == "meta-llama/Llama-2-7b-hf"
    assert load_entry("Llama-2-7b-hf").id == "meta-llama/Llama-2-7b-hf"
    assert load_entry("qwen3-30b-a3b").id == "Qwen/Qwen3-30B-A3B"
    assert load_entry("gpt2-XL").id == "gpt2-xl"


def test_load_entry_unknown_name_raises_unknown_model_with_closest_ids_in_hint():
    with pytest.raises(UnknownModel) as caught:
        load_entry("llama-2-7b")
    assert "meta-llama/Llama-2-7b-hf" in closest_ids("llama-2-7b")
    assert all(i in caught.value.hint for i in closest_ids("llama-2-7b"))
    with pytest.raises(UnknownModel):
        load_entry("no-such-model-anywhere")


def test_closest_ids_returns_at_most_n_catalog_ids():
    close = closest_ids("opt-1b", n=3)
    assert 0 < len(close) <= 3 and set(close) <= set(catalog_ids())


def test_entry_config_is_read_only_and_config_dict_is_an_independent_copy():
    entry = load_entry("meta-llama/Llama-3.1-8B")
    fields = entry.config_dict()
    fields["rope_scaling"]["factor"] = 1.0
    assert entry.config["rope_scaling"]["factor"] == 8.0
    with pytest.raises(TypeError):
        entry.config["hidden_size"] = 1  # type: ignore[index]
    assert hash(entry) == hash(load_entry("llama-3.1-8b"))
