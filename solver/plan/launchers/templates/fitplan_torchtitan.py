# fitplan: template only
# The config module the torchtitan launcher emits (solver/plan/launchers/torchtitan.py), the same text for every
# plan: __JOB_FILE__ and __TORCHTITAN__ are filled with the job file's name and torchtitan's version.
# ANN001/ANN201: emitted script code, without annotations (see this package's docstring). I001: tomllib is standard
# library from Python 3.11, which this module needs; ruff's target (3.10) would file it with the third-party imports.
# ruff: noqa: ANN001, ANN201, I001
# fitplan: end template only
"""torchtitan config module emitted by fitplan: the job in __JOB_FILE__ (next to this file)
as the Trainer.Config torchtitan __TORCHTITAN__ runs. The same text for every plan: the plan is in the TOML file.

Run: torchrun ... -m torchtitan.train --module fitplan_torchtitan --config fitplan [--section.key value ...]
torchtitan's ConfigManager imports this module, calls fitplan(), then applies command-line overrides on top.
"""

import dataclasses
import importlib
import tomllib
from pathlib import Path

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.components.quantization import Float8LinearConverter
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, MemoryBudgetAC, SelectiveAC
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.trainer import Trainer

JOB_FILE = Path(__file__).with_name("__JOB_FILE__")
CONVERTERS = {"float8": Float8LinearConverter}
ACTIVATION_CHECKPOINT = {"none": None, "full": FullAC.Config, "selective": SelectiveAC.Config,
                         "memory_budget": MemoryBudgetAC.Config}


def load(path=JOB_FILE):
    with open(path, "rb") as file:
        return tomllib.load(file)


def model_spec(model, compile_config):
    """The flavour from torchtitan's own model registry, with the named converters (float8) applied and the
    model's own RoPE scaling on every layer."""
    registry = importlib.import_module(f"torchtitan.models.{model['name']}").model_registry
    compiled = compile_config.enable and "model" in compile_config.components
    converters = [CONVERTERS[name].Config(model_compile_enabled=compiled, **model.get(name, {}))
                  for name in model["converters"]]
    spec = registry(model["flavor"], converters=converters or None)
    for layer in spec.model.layers:  # as torchtitan's own Decoder.Config.update_from_config sets max_seq_len
        attention = getattr(layer, "attention", None)
        if attention is not None and model.get("rope"):
            attention.rope = dataclasses.replace(attention.rope, **model["rope"])
    return spec


def optimizer(section):
    kwargs = {"lr": section["lr"], "betas": tuple(section["betas"]), "eps": section["eps"],
              "weight_decay": section["weight_decay"]}
    return OptimizersContainer.Config(
        implementation=section["implementation"],
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name=section["name"], optimizer_kwargs=kwargs)])


def loss(section, spec):
    """The planned loss: "chunked" is ChunkedLossWrapper over the LM head (torchtitan's own llama3/qwen3 jobs),
    "cross_entropy" the plain CrossEntropyLoss over full logits."""
    plain = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))
    return ChunkedLossWrapper.Config(loss_fn=plain) if section["name"] == "chunked" else plain


def fitplan():
    job = load()
    compile_config = CompileConfig(**job["compile"])
    spec = model_spec(job["model"], compile_config)
    policy = ACTIVATION_CHECKPOINT[job["activation_checkpoint"]["mode"]]
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path=job["hf_assets_path"],
        loss=loss(job["loss"], spec),
        optimizer=optimizer(job["optimizer"]),
        lr_scheduler=LRSchedulersContainer.Config(**job["lr_scheduler"]),
        training=TrainingConfig(**job["training"]),
        parallelism=ParallelismConfig(**job["parallelism"]),
        activation_checkpoint=None if policy is None else policy(),
        compile=compile_config,
        dataloader=HuggingFaceTextDataLoader.Config(**job["dataloader"]),
    )
