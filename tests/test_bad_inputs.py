"""The bad-input corpus (issue 17): every option of every command, malformed cluster strings and files, hostile
config.json files, malformed plans and contradicting pins. Each case is a command line, the exit code it must
end with and a phrase its message must contain. None may end in an internal error (exit 1), hang (each runs under
a SIGALRM timeout) or be accepted silently (exit 0).

The cases run in process with typer's CliRunner: one process imports torch once, and every case that reaches a
model uses gpt2 or Llama-3.2-1B (lowered once, then cached) or fails before lowering.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graphs import LayerGraph
from graphs.cache import load_cached, store_cached
from graphs.catalog import load_entry
from graphs.files import MAX_INPUT_BYTES
from graphs.positions import sequence_note
from solver.cli.app import app
from solver.cli.options import Bounded
from tests.graphs.tiny_configs import tiny_values

CASE_SECONDS = 60
BOX = str.maketrans({c: " " for c in "│╭╮╰╯─"})  # rich panel borders around click's usage errors

GPT2 = ["--model", "gpt2", "--gpus", "1xA100", "--seq-len", "512", "--global-batch", "8"]
SOLVE = ["solve", *GPT2]
ESTIMATE = ["estimate", "--model", "gpt2", "--gpus", "1xA100", "--seq-len", "512"]
LLAMA = ["solve", "--model", "meta-llama/Llama-3.2-1B", "--gpus", "8xA100", "--seq-len", "512", "--global-batch", "8"]
CHOOSE = ["choose", "--model", "gpt2", "--tokens", "2e9"]
NO_CONFIG = "No configuration is possible"  # pins that leave no configuration (solver.search.diagnose)


@dataclass(frozen=True)
class Case:
    """One bad input: argv ("{d}" is the folder of the corpus files), the exit code, a phrase of the message."""

    name: str
    args: tuple[str, ...]
    code: int
    phrase: str


def case(name: str, args: list[str], code: int, phrase: str) -> Case:
    return Case(name, tuple(args), code, phrase)


def model(file: str) -> list[str]:
    """A solve of the local config `file` in the corpus folder."""
    return ["solve", "--model", f"{{d}}/{file}", "--gpus", "1xA100", "--seq-len", "64", "--global-batch", "8"]


def cluster(file: str) -> list[str]:
    return ["solve", "--model", "gpt2", "--gpus", f"{{d}}/{file}", "--seq-len", "512", "--global-batch", "8"]


def explain(file: str) -> list[str]:
    return ["explain", f"{{d}}/{file}"]


def config(file: str) -> list[str]:
    return [*ESTIMATE, "--config", f"{{d}}/{file}"]


NUMBERS = [  # solve's numeric options: parsed with a range (solver.search.bounds), refused with option, value, range
    case("seq-len-zero", [*SOLVE, "--seq-len", "0"], 2, "'--seq-len': Value error, 0 is out of range"),
    case("seq-len-negative", [*SOLVE, "--seq-len", "-1"], 2, "allowed: 1 to 2,097,152"),
    case("seq-len-ten-million-llama", [*LLAMA, "--seq-len", "10000000"], 2, "10000000 is out of range"),
    case("seq-len-word", [*SOLVE, "--seq-len", "long"], 2, "'long' is not an integer"),
    case("seq-len-fraction", [*SOLVE, "--seq-len", "1.5"], 2, "'1.5' is not an integer"),
    case("seq-len-beyond-gpt2-positions", [*SOLVE, "--seq-len", "2048"], 2, "exceeds gpt2's n_positions=1024"),
    case("seq-len-beyond-opt-positions", ["solve", "--model", "facebook/opt-125m", "--gpus", "1xA100", "--seq-len",
                                          "4096"], 2, "max_position_embeddings=2048"),
    case("global-batch-zero", [*SOLVE, "--global-batch", "0"], 2, "'--global-batch'"),
    case("global-batch-1e12-integer", [*SOLVE, "--global-batch", "1000000000000"], 2, "allowed: 1 to 1,048,576"),
    case("global-batch-1e12-float", [*SOLVE, "--global-batch", "1e12"], 2, "'1e12' is not an integer"),
    case("global-batch-beyond-int64", [*SOLVE, "--global-batch", "9" * 30], 2, "is out of range"),
    case("tokens-per-step-zero", ["solve", "--model", "gpt2", "--gpus", "1xA100", "--tokens-per-step", "0"], 2,
         "'--tokens-per-step'"),
    case("tokens-per-step-and-global-batch", [*SOLVE, "--tokens-per-step", "4096"], 2, "not both"),
    case("tp-zero", [*SOLVE, "--tp", "0"], 2, "'--tp'"),
    case("tp-huge", [*SOLVE, "--tp", "4096"], 2, "allowed: 1 to 1,024"),
    case("tp-3-of-llama-heads", [*LLAMA, "--tp", "3"], 2, NO_CONFIG),
    case("tp-16-beyond-a-node", ["solve", "--model", "gpt2", "--gpus", "8xA100", "--seq-len", "512",
                                 "--global-batch", "8", "--tp", "16"], 2, NO_CONFIG),
    case("zero-5", [*SOLVE, "--zero", "5"], 2, "allowed: 0 to 3"),
    case("zero-negative", [*SOLVE, "--zero", "-1"], 2, "'--zero'"),
    case("micro-batch-zero", [*SOLVE, "--micro-batch", "0"], 2, "'--micro-batch'"),
    case("micro-batch-beyond-batch", [*SOLVE, "--micro-batch", "16"], 2, "--micro-batch 16 does not divide"),
    case("micro-batch-not-dividing", [*SOLVE, "--micro-batch", "3"], 2, "--micro-batch 3 does not divide "
         "--global-batch 8"),
    case("grad-accum-zero", [*SOLVE, "--grad-accum", "0"], 2, "'--grad-accum'"),
    case("grad-accum-huge", [*SOLVE, "--grad-accum", "9999999"], 2, "allowed: 1 to 1,048,576"),
    case("headroom-one", [*SOLVE, "--headroom", "1"], 2, "at least 0 and less than 1"),
    case("headroom-negative", [*SOLVE, "--headroom", "-0.1"], 2, "'--headroom'"),
    case("headroom-nan", [*SOLVE, "--headroom", "nan"], 2, "nan is out of range"),
    case("headroom-above-one", [*SOLVE, "--headroom", "1.5"], 2, "1.5 is out of range"),
    case("time-limit-zero", [*SOLVE, "--time-limit", "0"], 2, "more than 0 and at most 3,600"),
    case("time-limit-negative", [*SOLVE, "--time-limit", "-5"], 2, "-5 is out of range"),
    case("time-limit-nan", [*SOLVE, "--time-limit", "nan"], 2, "nan is out of range"),
    case("time-limit-inf", [*SOLVE, "--time-limit", "inf"], 2, "inf is out of range"),
    case("time-limit-a-year", [*SOLVE, "--time-limit", "31536000"], 2, "'--time-limit'"),
    case("time-limit-word", [*SOLVE, "--time-limit", "soon"], 2, "'soon' is not a number"),
    case("input-tokens-negative", [*SOLVE, "--input-tokens-per-s", "-5"], 2, "'--input-tokens-per-s'"),
    case("input-tokens-zero", [*SOLVE, "--input-tokens-per-s", "0"], 2, "more than 0"),
    case("input-tokens-nan", [*SOLVE, "--input-tokens-per-s", "nan"], 2, "nan is out of range"),
    case("input-tokens-inf", [*SOLVE, "--input-tokens-per-s", "inf"], 2, "inf is out of range"),
]

CHOICES = [  # enumerations, lists and text options of solve
    case("engine-unknown", [*SOLVE, "--engine", "tpu"], 2, "'--engine'"),
    case("engine-ddp-with-zero-3", [*SOLVE, "--engine", "ddp", "--zero", "3"], 2, "engine=ddp has no ZeRO stage"),
    case("engine-fsdp2-with-zero-1", [*SOLVE, "--engine", "fsdp2", "--zero", "1"], 2, "engine=fsdp2"),
    case("offload-unknown", [*SOLVE, "--offload", "disk"], 2, "'--offload'"),
    case("offload-params-unknown", [*SOLVE, "--offload-params", "ram"], 2, "'--offload-params'"),
    case("checkpoint-unknown", [*SOLVE, "--checkpoint", "some"], 2, "'some' is not one of"),
    case("precision-unknown", [*SOLVE, "--precision", "fp64"], 2, "precision='fp64': Input should be 'fp32'"),
    case("precision-fp8-on-a100", [*SOLVE, "--precision", "fp8"], 2, "supports none of the allowed precisions"),
    case("precision-bf16-on-t4", ["solve", "--model", "gpt2", "--gpus", "1xT4", "--precision", "bf16-mixed"], 2,
         "supports none of the allowed precisions"),
    case("precision-too-long", [*SOLVE, "--precision", "bf16," * 100], 2, "too long"),
    case("optimizer-unknown", [*SOLVE, "--optimizers", "lion"], 2, "optimizer='lion': Input should be 'adamw'"),
    case("launcher-unknown", [*SOLVE, "--launcher", "slurm"], 2, "'slurm' is not one of"),
    case("attention-unknown", [*SOLVE, "--attention", "flash"], 2, "'flash' is not one of"),
    case("compile-unknown", [*SOLVE, "--compile", "maybe"], 2, "'maybe' is not one of"),
    case("emit-unknown-launcher", [*SOLVE, "--emit", "slurm"], 2, "Unknown launcher 'slurm'"),
    case("emit-list-too-long", [*SOLVE, "--emit", "hf," * 100], 2, "too long"),
    case("output-into-missing-folder", [*SOLVE, "-o", "{d}/missing/plan.json"], 2, "missing"),
    case("allow-lora-with-value", [*SOLVE, "--allow-lora", "yes"], 2, "unexpected extra argument(s) (yes)"),
    case("force-with-value", [*SOLVE, "--force", "no"], 2, "unexpected extra argument(s) (no)"),
    case("json-with-value", [*SOLVE, "--json", "1"], 2, "unexpected extra argument(s) (1)"),
    case("emit-dir-is-a-file", [*SOLVE, "--emit", "hf", "--emit-dir", "{d}/invalid.json"], 2, "{d}/invalid.json"),
    case("plot-into-missing-folder", [*SOLVE, "--plot", "{d}/missing/memory.png"], 2, "does not exist"),
    case("output-and-plot-one-path", [*SOLVE, "-o", "{d}/same.png", "--plot", "{d}/same.png"], 2,
         "-o and --plot both write"),
    case("output-is-an-emitted-file", [*SOLVE, "-o", "{d}/empty_folder/ds_config.json", "--emit", "deepspeed",
                                       "--emit-dir", "{d}/empty_folder"], 2, "-o and --emit (ds_config.json) both"),
    case("output-over-an-input-file", [*SOLVE, "-o", "{d}/invalid.json"], 2, "Refusing to overwrite"),
    case("choose-plot-over-existing-file", [*CHOOSE, "--plot", "{d}/invalid.json"], 2, "Refusing to overwrite"),
    case("measure-output-over-existing-file", ["measure", "-o", "{d}/invalid.json"], 2, "Refusing to overwrite"),
    case("unknown-option", [*SOLVE, "--pipeline", "2"], 2, "No such option"),
    case("missing-model", ["solve", "--gpus", "1xA100"], 2, "Missing option '--model'"),
    case("unknown-command", ["frobnicate"], 2, "No such command 'frobnicate'"),
]

LORA = [
    case("lora-rank-zero", [*SOLVE, "--lora-rank", "0"], 2, "'--lora-rank': Value error, 0 is out of range"),
    case("lora-rank-negative", [*SOLVE, "--lora-rank", "-3"], 2, "allowed: 1 to 4,096"),
    case("lora-rank-huge", [*SOLVE, "--lora-rank", "5000"], 2, "5000 is out of range"),
    case("lora-alpha-negative", [*SOLVE, "--lora-rank", "8", "--lora-alpha", "-1"], 2, "'--lora-alpha'"),
    case("lora-alpha-zero", [*SOLVE, "--lora-rank", "8", "--lora-alpha", "0"], 2, "allowed: 1 to 65,536"),
    case("lora-alpha-without-rank", [*SOLVE, "--lora-alpha", "16"], 2, "--lora-alpha needs --lora-rank"),
    case("lora-targets-without-rank", [*SOLVE, "--lora-targets", "q_proj"], 2, "needs --lora-rank"),
    case("lora-targets-shell", [*SOLVE, "--lora-rank", "8", "--lora-targets", "q_proj;rm -rf ~"], 2,
         "is not a module name"),
    case("lora-targets-empty", [*SOLVE, "--lora-rank", "8", "--lora-targets", ","], 2, "is not a module name"),
    case("estimate-lora-rank-zero", [*ESTIMATE, "--lora-rank", "0"], 2, "'--lora-rank'"),
    case("estimate-lora-rank-huge", [*ESTIMATE, "--lora-rank", "100000"], 2, "allowed: 1 to 4,096"),
]

CLUSTERS = [  # --gpus strings and cluster files
    case("gpus-zero-count", ["solve", "--model", "gpt2", "--gpus", "0xA100"], 2, "zero count"),
    case("gpus-unknown-type", ["solve", "--model", "gpt2", "--gpus", "8xFOO"], 2, "FOO"),
    case("gpus-empty", ["solve", "--model", "gpt2", "--gpus", ""], 2, "Cannot read cluster ''"),
    case("gpus-count-only", ["solve", "--model", "gpt2", "--gpus", "8x"], 2, "Cannot read cluster '8x'"),
    case("gpus-leading-x", ["solve", "--model", "gpt2", "--gpus", "x8xA100"], 2, "Cannot read cluster"),
    case("gpus-partial-node", ["solve", "--model", "gpt2", "--gpus", "12xH100"], 2, "not a whole number"),
    case("gpus-billions", ["solve", "--model", "gpt2", "--gpus", "99999999999x8xH100"], 2, "at most 131,072"),
    case("gpus-too-long", ["solve", "--model", "gpt2", "--gpus", "8x" + "A" * 300], 2, "too long"),
    case("gpus-slow-regex", ["solve", "--model", "gpt2", "--gpus", "a" + " " * 250 + "!"], 2, "Cannot read cluster"),
    case("gpus-control-characters", ["solve", "--model", "gpt2", "--gpus", "8xA100\n"], 2, "control characters"),
    case("cluster-file-missing", cluster("absent.json"), 2, "Cannot read cluster file"),
    case("cluster-file-invalid-json", cluster("cluster_invalid.json"), 2, "is not valid JSON or YAML"),
    case("cluster-file-list", cluster("cluster_list.json"), 2, "must hold a mapping"),
    case("cluster-file-both-forms", cluster("cluster_both.json"), 2, "exactly one of 'gpus' and 'gpu'"),
    case("cluster-file-unknown-key", cluster("cluster_unknown.json"), 2, "unknown key 'racks'"),
    case("cluster-file-negative-nodes", cluster("cluster_negative.yaml"), 2, "nodes"),
    case("cluster-file-deep-yaml", cluster("cluster_deep.yaml"), 2, "nests deeper than 32 levels"),
    case("cluster-file-yaml-bomb", cluster("cluster_bomb.yaml"), 2, "uses a YAML alias"),
    case("cluster-file-fifo", cluster("fifo.json"), 2, "not a regular file"),
    case("cluster-file-oversize", cluster("oversize.json"), 2, f"at most {MAX_INPUT_BYTES:,} are read"),
    case("cluster-file-directory", cluster("folder.json"), 2, "is a directory"),
    case("cluster-file-infinite-ram", cluster("cluster_inf_ram.yaml"), 2, "cpu_ram_gib: Input should be a finite"),
    case("cluster-file-json-infinity", cluster("cluster_inf_nvme.json"), 2, "nvme_gbps: Input should be a finite"),
    case("cluster-file-huge-ram", cluster("cluster_huge_ram.json"), 2, "less than or equal to 65536 (got 1e+300)"),
    case("cluster-file-huge-cores", cluster("cluster_huge_cores.json"), 2, "cpu_cores: Input should be less than"),
    case("cluster-file-billion-nodes", cluster("cluster_nodes.json"), 2, "nodes: Input should be less than"),
    case("cluster-file-nan-fabric", cluster("cluster_nan.json"), 2, "inter_node_gbps: Input should be a finite"),
]

CONFIGS = [  # --model as a local path: hostile or malformed config.json files
    case("model-empty", ["solve", "--model", "", "--gpus", "1xA100"], 2, "The model name is empty"),
    case("model-unknown", ["solve", "--model", "llama-9000", "--gpus", "1xA100"], 2, "Unknown model 'llama-9000'"),
    case("model-control-characters", ["solve", "--model", "gpt2\x1b[31m", "--gpus", "1xA100"], 2,
         "control characters"),
    case("model-too-long", ["solve", "--model", "m" * 5000, "--gpus", "1xA100"], 2, "too long"),
    case("model-dev-zero", ["solve", "--model", "/dev/zero", "--gpus", "1xA100"], 2, "not a regular file"),
    case("model-fifo", model("fifo.json"), 2, "not a regular file"),
    case("model-folder-without-config", model("empty_folder"), 2, "without a config.json"),
    case("model-oversize", model("oversize.json"), 2, f"at most {MAX_INPUT_BYTES:,} are read"),
    case("model-not-utf8", model("latin1.json"), 2, "is not UTF-8 text"),
    case("model-invalid-json", model("invalid.json"), 2, "is not valid JSON"),
    case("model-json-list", model("list.json"), 2, "must hold a JSON object"),
    case("model-deep-arrays", model("deep_arrays.json"), 2, "nests deeper than 32 levels"),
    case("model-deep-objects", model("deep_objects.json"), 2, "nests deeper than 32 levels"),
    case("model-huge-hidden-size", model("huge_hidden.json"), 2, "'hidden_size' must be an integer from 1 to"),
    case("model-5000-digit-integer", model("digits.json"), 2, "holds a value Python refuses"),
    case("model-billion-layers", model("billion_layers.json"), 2, "'num_hidden_layers' must be an integer from 1"),
    case("model-hidden-size-string", model("hidden_string.json"), 2, "got '4096'"),
    case("model-hidden-size-negative", model("hidden_negative.json"), 2, "got -1"),
    case("model-hidden-size-bool", model("hidden_bool.json"), 2, "got True"),
    case("model-vocab-zero", model("vocab_zero.json"), 2, "'vocab_size' must be an integer"),
    case("model-heads-not-dividing", model("heads_7.json"), 2, "is not a multiple of the 7 attention heads"),
    case("model-more-heads-than-hidden", model("heads_many.json"), 2, "at most one head per hidden unit"),
    case("model-kv-heads-not-dividing", model("kv_heads_3.json"), 2, "num_key_value_heads=3 must divide"),
    case("model-hidden-not-divisible-by-heads", model("llama_hidden_130.json"), 2, "transformers rejects"),
    case("model-type-missing", model("no_type.json"), 2, "'model_type' is missing"),
    case("model-type-unknown", model("mystery.json"), 2, "is not an architecture transformers knows"),
    case("model-remote-code", model("remote.json"), 2, "remote code"),
    case("model-huge-nested-integer", model("huge_nested.json"), 2, "'rope_scaling.factor'"),
    case("model-huge-intermediate", model("huge_intermediate.json"), 2, "'intermediate_size'"),
    case("model-intermediate-zero", model("intermediate_zero.json"), 2, "'intermediate_size' must be a positive"),
    case("model-head-dim-zero", model("head_dim_zero.json"), 2, "'head_dim' must be a positive integer"),
    case("model-ffn-dim-negative", model("ffn_negative.json"), 2, "'ffn_dim' must be a positive integer"),
    case("model-kv-heads-zero", model("kv_heads_0.json"), 2, "'num_key_value_heads' must be a positive"),
    case("model-experts-per-token-zero", model("moe_top_0.json"), 2, "'num_experts_per_tok' must be a positive"),
    case("model-experts-per-token-beyond-experts", model("moe_top_9.json"), 2, "num_experts_per_tok=9 exceeds"),
    case("model-expert-groups-not-dividing", model("moe_groups_3.json"), 2, "n_group=3 must divide"),
    case("model-positions-negative", model("positions_negative.json"), 2,
         "'max_position_embeddings' must be a positive integer"),
    case("model-positions-zero-gpt2", model("gpt2_zero_positions.json"), 2, "'n_positions' must be a positive"),
    case("model-seq-beyond-local-positions", [*model("gpt2_64_positions.json")[:-4], "--seq-len", "128"], 2,
         "n_positions=64"),
]

ESTIMATES = [
    case("estimate-tp-zero", [*ESTIMATE, "--tp", "0"], 2, "'--tp'"),
    case("estimate-dp-zero", [*ESTIMATE, "--dp", "0"], 2, "'--dp'"),
    case("estimate-zero-4", [*ESTIMATE, "--zero", "4"], 2, "allowed: 0 to 3"),
    case("estimate-micro-batch-zero", [*ESTIMATE, "--micro-batch", "0"], 2, "'--micro-batch'"),
    case("estimate-grad-accum-negative", [*ESTIMATE, "--grad-accum", "-1"], 2, "'--grad-accum'"),
    case("estimate-seq-len-zero", [*ESTIMATE, "--seq-len", "0"], 2, "'--seq-len'"),
    case("estimate-seq-len-beyond-positions", [*ESTIMATE, "--seq-len", "2048"], 2, "n_positions=1024"),
    case("estimate-ddp-zero-3", [*ESTIMATE, "--engine", "ddp", "--zero", "3"], 2, "engine=ddp has no ZeRO stage"),
    case("estimate-ddp-offload", [*ESTIMATE, "--engine", "ddp", "--offload", "cpu"], 2, "cannot offload"),
    case("estimate-ranks-beyond-gpus", [*ESTIMATE, "--tp", "3", "--dp", "1"], 2, "but the cluster has 1 GPUs"),
    case("estimate-fp8-on-a100", [*ESTIMATE, "--precision", "fp8"], 2, "no fp8 support"),
    case("estimate-checkpoint-unknown", [*ESTIMATE, "--checkpoint", "half"], 2, "'--checkpoint'"),
    case("estimate-engine-unknown", [*ESTIMATE, "--engine", "tpu"], 2, "'tpu' is not one of"),
    case("estimate-offload-unknown", [*ESTIMATE, "--offload", "disk"], 2, "'disk' is not one of"),
    case("estimate-offload-params-unknown", [*ESTIMATE, "--offload-params", "ram"], 2, "'ram' is not one of"),
    case("estimate-kbit-preparation-without-4-bit", [*ESTIMATE, "--lora-rank", "8", "--kbit-preparation"], 2,
         "this run has none"),
    case("estimate-kbit-preparation-without-adapters", [*ESTIMATE, "--kbit-preparation"], 2, "needs --lora-rank"),
    case("estimate-kbit-preparation-under-axolotl", [*ESTIMATE, "--lora-rank", "8", "--lora-quantization", "nf4",
                                                     "--kbit-preparation", "--launcher", "axolotl"], 2,
         "runs its own loader"),
    case("estimate-precision-unknown", [*ESTIMATE, "--precision", "fp64"], 2, "'fp64' is not one of"),
    case("estimate-optimizer-unknown", [*ESTIMATE, "--optimizer", "lion"], 2, "'lion' is not one of"),
    case("estimate-json-with-value", [*ESTIMATE, "--json", "1"], 2, "unexpected extra argument(s) (1)"),
    case("estimate-dp-huge", [*ESTIMATE, "--dp", "9" * 25], 2, "'--dp'"),
    case("estimate-does-not-fit", ["estimate", "--model", "gpt2", "--gpus", "1xT4", "--precision", "fp16-mixed",
                                   "--micro-batch", "512", "--seq-len", "1024"], 3, "Does NOT fit"),
    case("estimate-config-missing", config("absent.json"), 2, "Cannot read configuration file"),
    case("estimate-config-invalid-json", config("invalid.json"), 2, "is not valid JSON"),
    case("estimate-config-list", config("list.json"), 2, "must hold an object of Config fields"),
    case("estimate-config-unknown-key", config("config_unknown.json"), 2, "Invalid configuration"),
    case("estimate-config-bad-value", config("config_bad_tp.yaml"), 2, "Invalid configuration"),
    case("estimate-config-fifo", config("fifo.json"), 2, "not a regular file"),
    case("estimate-config-deep-yaml", config("cluster_deep.yaml"), 2, "nests deeper than 32 levels"),
    case("estimate-config-yaml-bomb", config("config_bomb.yaml"), 2, "uses a YAML alias"),
    case("estimate-config-oversize", config("oversize.json"), 2, "are read"),
]

LISTINGS = [
    case("models-filter-too-long", ["models", "x" * 300], 2, "too long"),
    case("models-filter-control", ["models", "llama\x1b"], 2, "control characters"),
    case("models-unknown-option", ["models", "--bogus"], 2, "No such option"),
    case("models-two-filters", ["models", "llama", "qwen"], 2, "unexpected extra argument(s) (qwen)"),
    case("gpus-extra-argument", ["gpus", "extra"], 2, "unexpected extra argument"),
    case("gpus-unknown-option", ["gpus", "--bogus"], 2, "No such option"),
]

PLANS = [  # explain PLAN: plan files that are not plans this fitplan wrote
    case("explain-missing-argument", ["explain"], 2, "Missing argument"),
    case("explain-two-plans", [*explain("list.json"), "{d}/invalid.json"], 2, "unexpected extra argument"),
    case("explain-absent", explain("absent.json"), 2, "Cannot read plan file"),
    case("explain-directory", explain("empty_folder"), 2, "is a directory"),
    case("explain-invalid-json", explain("invalid.json"), 2, "is not valid JSON"),
    case("explain-list", explain("list.json"), 2, "schema_version None"),
    case("explain-future-schema", explain("plan_future.json"), 2, "schema_version '3.0' is not one this fitplan"),
    case("explain-newer-minor-schema", explain("plan_minor.json"), 2, "schema_version '2.99'"),
    case("explain-schema-number", explain("plan_number.json"), 2, "schema_version 1"),
    case("explain-schema-missing", explain("plan_unversioned.json"), 2, "schema_version None"),
    case("explain-not-a-plan", explain("plan_truncated.json"), 2, "is not a fitplan plan"),
    case("explain-deep", explain("deep_objects.json"), 2, "nests deeper than 32 levels"),
    case("explain-fifo", explain("fifo.json"), 2, "not a regular file"),
    case("explain-oversize", explain("oversize.json"), 2, "are read"),
    case("explain-not-utf8", explain("latin1.json"), 2, "is not UTF-8 text"),
]

TAMPERED = [  # plans edited by hand: refused against the model and cluster they name, as estimate --config does
    case("explain-dp-billion", explain("plan_dp_billion.json"), 2, "= 1000000000 ranks, but the cluster has 1 GPUs"),
    case("explain-one-checkpoint-for-12-layers", explain("plan_one_checkpoint.json"), 2,
         "checkpoint lists 1 modes but the model has 12 layers"),
    case("explain-tp-beyond-heads", explain("plan_tp_5.json"), 2, "does not run on the model and cluster it names"),
    case("check-cpu-dp-billion", ["check", "{d}/plan_dp_billion.json", "--device", "cpu"], 2,
         "a CPU check starts at most 16 processes"),
    case("check-cpu-one-checkpoint", ["check", "{d}/plan_one_checkpoint.json", "--device", "cpu"], 2,
         "checkpoint lists 1 modes"),
]

OTHER_COMMANDS = [  # the numeric options of choose, check and measure (issue 38: every one has a range)
    case("choose-max-gpus-hundred-million", [*CHOOSE, "--max-gpus", "100000000"], 2, "allowed: 1 to 1,024"),
    case("choose-max-gpus-zero", [*CHOOSE, "--max-gpus", "0"], 2, "'--max-gpus'"),
    case("choose-tokens-zero", ["choose", "--model", "gpt2", "--tokens", "0"], 2, "'--tokens'"),
    case("choose-tokens-inf", ["choose", "--model", "gpt2", "--tokens", "inf"], 2, "inf is out of range"),
    case("choose-tokens-huge", ["choose", "--model", "gpt2", "--tokens", "1e30"], 2, "at most 1e+16"),
    case("choose-budget-negative", [*CHOOSE, "--budget", "-5"], 2, "'--budget'"),
    case("choose-budget-nan", [*CHOOSE, "--budget", "nan"], 2, "nan is out of range"),
    case("choose-time-limit-zero", [*CHOOSE, "--time-limit", "0"], 2, "more than 0 and at most 3,600"),
    case("choose-time-limit-a-year", [*CHOOSE, "--time-limit", "31536000"], 2, "'--time-limit'"),
    case("choose-seq-len-zero", [*CHOOSE, "--seq-len", "0"], 2, "'--seq-len'"),
    case("choose-global-batch-huge", [*CHOOSE, "--global-batch", "1000000000000"], 2, "allowed: 1 to 1,048,576"),
    case("choose-lora-rank-zero", [*CHOOSE, "--lora-rank", "0"], 2, "'--lora-rank'"),
    case("choose-deadline-centuries", [*CHOOSE, "--deadline", "99999999h"], 2, "is out of range"),
    case("choose-gpu-types-too-long", [*CHOOSE, "--gpu-types", "H100," * 100], 2, "too long"),
    case("check-steps-zero", ["check", "{d}/plan_dp_billion.json", "--steps", "0"], 2, "'--steps'"),
    case("check-steps-huge", ["check", "{d}/plan_dp_billion.json", "--steps", "100000"], 2, "allowed: 1 to 1,000"),
    case("check-nproc-zero", ["check", "{d}/plan_dp_billion.json", "--nproc", "0"], 2, "'--nproc'"),
    case("measure-ranks-zero", ["measure", "--ranks", "0"], 2, "'--ranks'"),
    case("measure-ranks-huge", ["measure", "--ranks", "1000000"], 2, "allowed: 1 to 1,024"),
    case("measure-cpu-ranks-beyond-cap", ["measure", "--device", "cpu", "--ranks", "64", "-o", "{d}/profile.json"],
         2, "a CPU measurement starts at most 16 processes"),
]

PINS = [  # pins that contradict each other or the cluster
    case("pins-mb-ga-not-batch", [*SOLVE, "--micro-batch", "2", "--grad-accum", "2"], 2, NO_CONFIG),
    case("pins-param-offload-zero-2", [*SOLVE, "--offload-params", "cpu", "--zero", "2"], 2,
         "The pins --zero 2 --offload-params cpu contradict each other: param_offload=cpu needs ZeRO-3"),
    case("pins-ddp-offload", [*SOLVE, "--engine", "ddp", "--offload", "cpu"], 2, "engine=ddp cannot offload"),
    case("pins-fsdp2-nvme", [*SOLVE, "--engine", "fsdp2", "--offload", "nvme"], 2, "NVMe offload needs DeepSpeed"),
    case("pins-fsdp2-uneven-offload", [*SOLVE, "--engine", "fsdp2", "--offload", "cpu", "--offload-params", "none"],
         2, "must equal param_offload"),
    case("pins-ddp-param-offload", [*SOLVE, "--engine", "ddp", "--offload-params", "cpu"], 2, "needs ZeRO-3"),
    case("pins-mb-ga-product", [*SOLVE, "--micro-batch", "2", "--grad-accum", "3"], 2,
         "--micro-batch 2 x --grad-accum 3 = 6 does not divide --global-batch 8"),
    case("pins-grad-accum-beyond-batch", [*SOLVE, "--grad-accum", "16"], 2, "--grad-accum 16 does not divide"),
    case("pins-nvme-without-nvme", [*SOLVE, "--offload", "nvme"], 2, NO_CONFIG),
    case("pins-megatron-fsdp2", [*SOLVE, "--launcher", "megatron", "--engine", "fsdp2"], 2, NO_CONFIG),
    case("pins-torchrun-deepspeed", [*SOLVE, "--launcher", "torchrun", "--engine", "deepspeed"], 2, NO_CONFIG),
    case("pins-hf-selective", [*SOLVE, "--launcher", "hf", "--checkpoint", "selective"], 2,
         "cannot run selective recompute"),
    case("pins-fsdp2-zero-0", [*SOLVE, "--engine", "fsdp2", "--zero", "0"], 2, "engine=fsdp2"),
]

CASES = NUMBERS + CHOICES + LORA + CLUSTERS + CONFIGS + ESTIMATES + LISTINGS + PLANS + TAMPERED + OTHER_COMMANDS + PINS


def write(folder: Path, name: str, content: object) -> None:
    text = content if isinstance(content, str) else json.dumps(content)
    (folder / name).write_text(text)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The corpus files: hostile config.json files, cluster files, configuration files and plans."""
    d = tmp_path_factory.mktemp("corpus")
    llama, gpt2 = tiny_values("llama"), tiny_values("gpt2")
    configs = {
        "invalid.json": "{not json", "list.json": [1, 2],
        "deep_arrays.json": "[" * 100_000 + "]" * 100_000,
        "deep_objects.json": '{"a":' * 40 + "1" + "}" * 40,
        "huge_hidden.json": {**llama, "hidden_size": 10**40},
        "digits.json": '{"model_type": "llama", "hidden_size": ' + "9" * 5000 + "}",
        "billion_layers.json": {**llama, "num_hidden_layers": 10**9},
        "hidden_string.json": {**llama, "hidden_size": "4096"},
        "hidden_negative.json": {**llama, "hidden_size": -1},
        "hidden_bool.json": {**llama, "hidden_size": True},
        "vocab_zero.json": {**llama, "vocab_size": 0},
        "heads_7.json": {**gpt2, "n_head": 7},
        "heads_many.json": {**gpt2, "n_head": 256},
        "kv_heads_3.json": {**llama, "num_key_value_heads": 3},
        "llama_hidden_130.json": {**llama, "hidden_size": 130},
        "no_type.json": {k: v for k, v in llama.items() if k != "model_type"},
        "mystery.json": {**llama, "model_type": "mystery"},
        "remote.json": {**llama, "model_type": "my_remote_arch", "auto_map": {"AutoConfig": "x.Config"}},
        "huge_nested.json": {**llama, "rope_scaling": {"rope_type": "linear", "factor": 2**40}},
        "huge_intermediate.json": {**llama, "intermediate_size": 2**40},
        "gpt2_64_positions.json": {**gpt2, "n_positions": 64, "n_ctx": 64},
        "intermediate_zero.json": {**llama, "intermediate_size": 0},
        "head_dim_zero.json": {**llama, "head_dim": 0},
        "ffn_negative.json": {**tiny_values("opt"), "ffn_dim": -256},
        "kv_heads_0.json": {**llama, "num_key_value_heads": 0},
        "moe_top_0.json": {**tiny_values("qwen3_moe"), "num_experts_per_tok": 0},
        "moe_top_9.json": {**tiny_values("qwen3_moe"), "num_experts_per_tok": 9},
        "moe_groups_3.json": {**tiny_values("deepseek_v3"), "n_group": 3},
        "positions_negative.json": {**llama, "max_position_embeddings": -1},
        "gpt2_zero_positions.json": {**gpt2, "n_positions": 0},
        "cluster_invalid.json": "{gpus: ", "cluster_list.json": ["8xA100"],
        "cluster_both.json": {"gpus": "8xA100", "gpu": "A100"},
        "cluster_unknown.json": {"gpus": "8xA100", "racks": 2},
        "cluster_negative.yaml": "gpu: A100\nnodes: -1\n",
        "cluster_deep.yaml": "a:\n" + "".join("  " * i + "- \n" for i in range(1, 40)),
        "cluster_bomb.yaml": "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
            for i in range(12)) + "gpus: 8xA100\nbomb: *m\n",
        "cluster_inf_ram.yaml": "gpus: 8xA100\ncpu_ram_gib: .inf\n",
        "cluster_inf_nvme.json": '{"gpus": "8xA100", "nvme_gbps": Infinity}',
        "cluster_huge_ram.json": {"gpus": "8xA100", "cpu_ram_gib": 1e300},
        "cluster_huge_cores.json": {"gpus": "8xA100", "cpu_cores": 10**20},
        "cluster_nodes.json": {"gpu": "H100", "nodes": 10**9, "gpus_per_node": 8},
        "cluster_nan.json": '{"gpus": "2x8xH100", "inter_node_gbps": NaN}',
        "config_unknown.json": {"tp": 1, "pipeline": 2},
        "config_bad_tp.yaml": "tp: two\n",
        "config_bomb.yaml": "a: &a [none, none, none, none]\n" + "".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
            for i in range(12)) + "checkpoint: *m\n",
        "plan_future.json": {"schema_version": "3.0", "decisions": {}},
        "plan_minor.json": {"schema_version": "2.99"},
        "plan_number.json": {"schema_version": 1},
        "plan_unversioned.json": {"decisions": {"tp": 1}},
        "plan_truncated.json": {"schema_version": "1.0", "inputs": {"model": "gpt2"}},
    }
    for name, content in configs.items():
        write(d, name, content)
    for name, content in tampered_plans().items():
        write(d, name, content)
    (d / "latin1.json").write_bytes('{"model_type": "llama", "name": "caf\xe9"}'.encode("latin-1"))
    (d / "empty_folder").mkdir()
    (d / "folder.json").mkdir()
    os.mkfifo(d / "fifo.json")  # reading it would block forever: it must be refused unread
    with (d / "oversize.json").open("wb") as handle:  # sparse: costs no disk
        handle.truncate(MAX_INPUT_BYTES + 1)
    return d


def tampered_plans() -> dict[str, dict]:
    """A plan of gpt2 on one A100, edited by hand: dp=10^9, one checkpoint mode for 12 layers, tp=5 on one GPU."""
    from solver import solve

    plan = solve("gpt2", "1xA100", seq_len=512, global_batch=8, time_limit=10).to_json()
    edited = {"dp_billion": {"dp": 10**9}, "one_checkpoint": {"checkpoint": plan["decisions"]["checkpoint"][:1]},
              "tp_5": {"tp": 5}}
    return {f"plan_{name}.json": {**plan, "decisions": {**plan["decisions"], **change}}
            for name, change in edited.items()}


@pytest.fixture(autouse=True)
def _no_logging_errors(monkeypatch):
    """transformers' log handler keeps the stderr of the CliRunner run that first lowered a model; in a later run
    that stream is closed and logging would print a "--- Logging error ---" traceback into that run's output (an
    artefact of running many commands in one process, never of the real CLI)."""
    monkeypatch.setattr(logging, "raiseExceptions", False)


def normalized(text: str) -> str:
    """The output with rich's wrapping and panel borders undone."""
    return " ".join(text.translate(BOX).split())


class CaseTimeout(BaseException):
    """Raised by SIGALRM; a BaseException so no `except Exception` in the CLI can swallow it."""


def within_timeout(call, seconds: int = CASE_SECONDS):
    """`call()`, interrupted by SIGALRM after `seconds` (a hang fails the case instead of the whole run)."""
    def expire(signum, frame):
        raise CaseTimeout(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        return call()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run(args: list[str]):
    return within_timeout(lambda: CliRunner().invoke(app, args))


def test_corpus_holds_at_least_120_distinct_cases():
    assert len(CASES) >= 120
    assert len({c.name for c in CASES}) == len(CASES)
    assert len({c.args for c in CASES}) == len(CASES)
    assert all(c.code in (2, 3) and c.phrase for c in CASES)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGALRM and mkfifo are POSIX")
@pytest.mark.parametrize("bad", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_refused_with_exit_code_and_message(bad: Case, corpus: Path):
    args = [part.replace("{d}", str(corpus)) for part in bad.args]
    result = run(args)
    message = normalized(result.output)
    assert result.exit_code != 1, f"internal error: {result.output[-2000:]}"
    assert result.exit_code == bad.code, result.output[-2000:]
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # handled, never an escaped exception
    assert "Traceback" not in result.output
    assert normalized(bad.phrase).replace("{d}", str(corpus)) in message, message[-1500:]


def test_every_numeric_option_of_every_command_has_a_range():
    import typing

    import typer.main

    for name, command in typer.main.get_command(app).commands.items():
        for param in command.params:
            kinds = set(typing.get_args(param.type_descriptor.annotation)) or {param.type_descriptor.annotation}
            if kinds & {int, float}:
                assert isinstance(param.type_descriptor.parameter_info.parser, Bounded), (name, param.name)


def test_help_of_every_command_shows_ranges_and_whole_option_names():
    for command in (["solve"], ["estimate"], ["models"], ["gpus"], ["explain"], []):
        result = run([*command, "--help"])
        assert result.exit_code == 0, result.output
        assert "…" not in result.output, result.output  # rich's ellipsis: a truncated option name or help
    solve_help = normalized(run(["solve", "--help"]).output)
    for option, allowed in (("--seq-len", "[1 to 2,097,152]"), ("--time-limit", "[more than 0 and at most 3,600]"),
                            ("--input-tokens-per-s", "[more than 0 and at most 1e+12]"),
                            ("--headroom", "[at least 0 and less than 1]"), ("--lora-alpha", "[1 to 65,536]")):
        assert option in solve_help and allowed in solve_help


@pytest.mark.parametrize(("kind", "low", "high", "flags", "accepted", "refused"), [
    (int, 1, 8, {}, ["1", "8", " 5"], ["0", "9", "-1", "1.0", "1e3", "", "x"]),
    (float, 0, 1, {"hi_open": True}, ["0", "0.999", "1e-9"], ["1", "-0.0001", "nan", "inf", "-inf", "x"]),
    (float, 0, 3600, {"lo_open": True}, ["1e-3", "3600", "60"], ["0", "3600.01", "nan", "1e400"]),
])
def test_bounded_parser_accepts_exactly_its_range(kind, low, high, flags, accepted, refused):
    parse = Bounded(kind, low, high, **flags)
    for text in accepted:
        value = parse(text)
        assert isinstance(value, kind) and low <= value <= high and math.isfinite(value)
    for text in refused:
        with pytest.raises(ValueError, match="allowed"):
            parse(text)


def test_sequence_beyond_positions_refused_for_fixed_tables_and_assumed_for_rotary():
    gpt2 = load_entry("gpt2").config_dict()
    llama = load_entry("meta-llama/Llama-3.2-1B").config_dict()
    assert sequence_note(gpt2, 1024, location="gpt2") is None
    with pytest.raises(Exception, match="n_positions=1024"):
        sequence_note(gpt2, 1025, location="gpt2")
    assert sequence_note(llama, 131072, location="llama") is None
    note = sequence_note(llama, 131073, location="llama")
    assert note is not None and "max_position_embeddings=131072" in note and "rope_scaling" in note


def test_cache_entry_with_wrong_inner_type_or_edited_is_a_miss(tmp_path, monkeypatch):
    from graphs import lower

    graph = lower("gpt2")  # cached in the shared cache by the cases above
    monkeypatch.setenv("FITPLAN_CACHE_DIR", str(tmp_path))
    store_cached("intact", graph)
    assert load_cached("intact").to_json() == graph.to_json()  # the exact round trip is a hit
    good = graph.to_json()
    wrong = {"kind_modes": {"0": 5}, "versions": [1], "tp_degrees": "12", "nodes": [{"name": 1}], "dims": [1],
             "lora": "x", "inputs": "abc", "nodes_none": None}
    stored = json.loads((tmp_path / "lower" / "intact.json").read_text())
    for key, value in wrong.items():  # with the intact entry's digest: its graph changed
        entry = tmp_path / "lower" / f"{key}.json"
        entry.write_text(json.dumps({**stored, "graph": {**good, key.removesuffix("_none"): value}}))
        assert load_cached(key) is None, key
    (tmp_path / "lower" / "truncated.json").write_text(json.dumps(stored)[:100])
    assert load_cached("truncated") is None
    (tmp_path / "lower" / "bare.json").write_text(json.dumps(good))  # an entry without its digest
    assert load_cached("bare") is None
    # One number changed: the entry parses and loads as a graph, and is a miss.
    edited = {**good, "dims": {**good["dims"], "hidden": good["dims"]["hidden"] + 1}}
    assert LayerGraph.from_json(edited).dims.hidden == graph.dims.hidden + 1
    (tmp_path / "lower" / "edited.json").write_text(json.dumps({**stored, "graph": edited}))
    assert load_cached("edited") is None


@pytest.mark.parametrize("name", ["/dev/zero", "{d}/fifo.json", "{d}/oversize.json", "{d}/deep_arrays.json"])
def test_profile_from_a_device_fifo_or_huge_file_is_refused_unread(name: str, corpus: Path):
    from costmodels.profile import InvalidProfile, load_profile

    with pytest.raises(InvalidProfile, match=r"not a regular file|are read|nests deeper"):
        within_timeout(lambda: load_profile(name.replace("{d}", str(corpus))))



def test_cache_entry_swapped_for_a_fifo_or_grown_past_the_limit_is_a_miss(tmp_path, monkeypatch):
    """The entry is checked on the opened file, not the path: a FIFO swapped in after a check of the path (here: a
    path check that says "regular file") is a miss, never a hang."""
    import graphs.cache as cache

    monkeypatch.setenv("FITPLAN_CACHE_DIR", str(tmp_path))
    (tmp_path / "lower").mkdir()
    os.mkfifo(tmp_path / "lower" / "fifo.json")
    monkeypatch.setattr(Path, "is_file", lambda self: True)  # the race: the path looked like a file a moment ago
    assert within_timeout(lambda: load_cached("fifo"), seconds=10) is None
    with (tmp_path / "lower" / "huge.json").open("wb") as handle:  # sparse
        handle.truncate(cache.MAX_ENTRY_BYTES + 1)
    assert load_cached("huge") is None


def test_cache_write_interrupted_or_failing_leaves_no_temporary_file(tmp_path, monkeypatch):
    import graphs.cache as cache
    from graphs import lower

    graph = lower("gpt2")
    monkeypatch.setenv("FITPLAN_CACHE_DIR", str(tmp_path))
    for failure in (KeyboardInterrupt, OSError(28, "No space left on device"), RecursionError):
        def fail(*args, failure=failure, **kwargs):
            raise failure

        monkeypatch.setattr(cache.json, "dump", fail)
        try:
            store_cached("entry", graph)
        except BaseException as error:  # an interruption propagates; a full disk is skipped
            assert not isinstance(error, OSError)
        assert list((tmp_path / "lower").iterdir()) == [], failure


def test_stale_cache_temporaries_are_removed_at_first_use_and_live_ones_kept(tmp_path, monkeypatch):
    import time

    import graphs.cache as cache

    monkeypatch.setenv("FITPLAN_CACHE_DIR", str(tmp_path))
    folder = tmp_path / "lower"
    folder.mkdir()
    stale, live = folder / "dead-writer.tmp", folder / "live-writer.tmp"
    stale.write_text("{")
    live.write_text("{")
    old = time.time() - cache.STALE_TEMPORARY_SECONDS - 60
    os.utime(stale, (old, old))
    assert load_cached("absent") is None  # a lookup, no write: the process's first use of the folder
    assert not stale.exists() and live.exists()


CUSTOM_GPU = """gpu:
  id: my-accel
  name: My Accelerator
  vendor: nvidia
  arch: hopper
  memory_gib: 96
  hbm_bandwidth_gbps: 4000
  tflops_dense: {fp32: 60, tf32: 400, fp16: 800, bf16: 800, fp8: 1600}
  intra_node: {kind: nvlink4, uni_gbps: 450, nvswitch: true}
  host_link: {pcie_gen: 5, uni_gbps: 63}
nodes: 1
gpus_per_node: 1
cpu_ram_gib: 256
cpu_cores: 16
"""


def test_explain_accepts_intact_plans_on_catalog_and_custom_gpus(tmp_path, monkeypatch, corpus):
    """The check against the model and cluster refuses edited plans only: an intact plan explains, also one made
    on a custom GPU of a cluster file (read again from that file)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "custom.yml").write_text(CUSTOM_GPU)
    solved = run(["solve", "--model", "gpt2", "--gpus", "custom.yml", "--seq-len", "512", "--global-batch", "8",
                  "-o", "plan.json"])
    assert solved.exit_code == 0, solved.output
    for plan in ("plan.json", str(corpus / "plan_dp_billion.json")):
        intact = plan if plan == "plan.json" else "intact.json"
        if plan != "plan.json":  # the corpus's edited plan with its dp restored
            data = json.loads(Path(plan).read_text())
            (tmp_path / intact).write_text(json.dumps({**data, "decisions": {**data["decisions"], "dp": 1}}))
        result = run(["explain", intact])
        assert result.exit_code == 0, result.output
    (tmp_path / "custom.yml").unlink()
    assert run(["explain", "plan.json"]).exit_code == 2
