"""A caller's live DeepSpeed ZeRO-3 context (transformers' HfDeepSpeedConfig, set by `TrainingArguments(deepspeed=)`)
makes transformers build every model under `deepspeed.zero.Init`; fitplan's lowering builds its meta model outside
it (graphs/fake.build_model) and leaves the caller's context as it was."""

from __future__ import annotations

import pytest
from transformers import AutoConfig
from transformers.integrations import deepspeed as hf_deepspeed

from graphs.fake import build_model
from tests.graphs.tiny_configs import tiny_values

ZERO3 = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
         "zero_optimization": {"stage": 3}}  # batch sizes that DeepSpeed's own check refuses on one process


@pytest.fixture
def zero3_context():
    pytest.importorskip("deepspeed")
    context = hf_deepspeed.HfDeepSpeedConfig(ZERO3)  # registers itself as the process's config
    assert hf_deepspeed.is_deepspeed_zero3_enabled()
    yield context
    hf_deepspeed.unset_hf_deepspeed_config()


def test_a_model_is_built_plainly_under_a_callers_zero3_context(zero3_context):
    values = tiny_values("llama")
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    model = build_model(config, dtype="bfloat16", attention="sdpa")
    assert all(p.device.type == "meta" and not hasattr(p, "ds_id") for p in model.parameters())
    assert hf_deepspeed.is_deepspeed_zero3_enabled()  # the caller's context is kept
    assert hf_deepspeed.deepspeed_config() is zero3_context.config
