"""Megatron-LM builds the model from its own flags: the emitted shape flags must describe the Hugging Face model.

Megatron's argument parser (megatron/training/arguments.py) is not in the megatron-core wheel, so flag names are
checked against `megatron.KNOWN_FLAGS` (copied from that file) and the values against the transformers model
itself, built on the meta device: its norm classes, MLP projections, rotary module, tied weights and biases. Given
Megatron-LM's source ($MEGATRON_LM_SOURCE, tests/solver/megatron_args.py), its own parser and TransformerConfig
read the same values.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphs import FitplanError, resolve
from solver import solve
from solver.plan.launchers import emit, megatron
from tests.solver import megatron_args

MODELS = ["meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.2-1B", "gpt2", "Qwen/Qwen2.5-0.5B", "Qwen/Qwen3-8B",
          "meta-llama/Meta-Llama-3-8B"]
# The run's own settings the launch script passes (`megatron.RUN_SETTINGS`), as a user sets them.
RUN = {"--data-path": "/data/corpus_text_document", "--lr": "2e-05", "--train-iters": "100", "--save": "/ckpt",
       "--save-interval": "50"}


def flag_values(arguments: list[str]) -> dict[str, str | bool]:
    values: dict[str, str | bool] = {}
    for i, token in enumerate(arguments):
        if token.startswith("--"):
            following = arguments[i + 1] if i + 1 < len(arguments) else "--"
            values[token] = True if following.startswith("--") else following
    return values


def reference_model(name: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    values = resolve(name).as_dict()
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        return config, AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", MODELS)
def test_megatron_shape_flags_describe_the_transformers_model(name, tmp_path, monkeypatch):
    plan = solve(name, "8xH100", launcher="megatron", seq_len=1024, global_batch=64, time_limit=10)
    arguments = megatron.arguments(plan)
    assert [a for a in arguments if a.startswith("--") and a not in megatron.KNOWN_FLAGS] == []
    flags = flag_values(arguments)
    config, model = reference_model(name)
    text = config.get_text_config()
    layers = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
    block = layers[0]
    linears = {n.rsplit(".", 1)[-1]: m for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
    conv1d = [m for m in block.modules() if type(m).__name__ == "Conv1D"]  # GPT-2's projections
    assert int(flags["--num-layers"]) == len(layers) == text.num_hidden_layers
    assert int(flags["--hidden-size"]) == text.hidden_size
    assert int(flags["--num-attention-heads"]) == text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    assert int(flags.get("--num-query-groups", text.num_attention_heads)) == kv
    assert ("--group-query-attention" in flags) == (kv != text.num_attention_heads)
    up = linears.get("up_proj") or linears.get("c_fc")
    ffn = up.out_features if up is not None else conv1d[-2].weight.shape[1]
    assert int(flags["--ffn-hidden-size"]) == ffn
    assert ("--swiglu" in flags) == ("gate_proj" in linears)
    norms = {type(m).__name__ for m in block.modules() if "norm" in type(m).__name__.lower()}
    assert flags["--normalization"] == ("RMSNorm" if any("RMSNorm" in n for n in norms) else "LayerNorm")
    rotary = any("Rotary" in type(m).__name__ for m in model.modules())
    assert flags["--position-embedding-type"] == ("rope" if rotary else "learned_absolute")
    if rotary:
        theta = getattr(text, "rope_theta", None) or text.rope_parameters["rope_theta"]
        assert int(flags["--rotary-base"]) == int(theta)
        # RoPE scaling as transformers builds it (issue 35 item 6): Llama 3.1/3.2 scale, Meta-Llama-3 does not
        rope = text.rope_parameters or {}
        llama3 = rope.get("rope_type") == "llama3"
        assert ("--use-rope-scaling" in flags) is llama3
        if llama3:
            assert float(flags["--rope-scaling-factor"]) == rope["factor"]
    # dropout as the model trains (issue 35 item 11): Megatron's own default is 0.1
    assert float(flags["--attention-dropout"]) == float(getattr(text, "attention_dropout", None) or
                                                       getattr(text, "attn_pdrop", 0.0))
    assert float(flags["--hidden-dropout"]) == float(getattr(text, "hidden_dropout", None) or
                                                    getattr(text, "resid_pdrop", 0.0))
    assert ("--qk-layernorm" in flags) == any(n.endswith(("q_norm", "k_norm")) for n, _ in block.named_modules())
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert ("--untie-embeddings-and-output-weights" in flags) == (not tied)
    if linears:
        assert ("--disable-bias-linear" in flags) == (linears["o_proj"].bias is None and
                                                      linears["down_proj"].bias is None)
        assert ("--add-qkv-bias" in flags) == (linears["q_proj"].bias is not None and linears["o_proj"].bias is None)
    else:
        assert "--disable-bias-linear" not in flags and all(m.bias is not None for m in conv1d)
    assert int(flags["--seq-length"]) == plan.inputs.seq_len <= int(flags["--max-position-embeddings"])
    assert flags["--tokenizer-model"] == name
    assert int(flags["--micro-batch-size"]) * plan.decisions.grad_accum * plan.decisions.dp == \
        int(flags["--global-batch-size"]) == plan.inputs.global_batch
    assert emit(plan, "megatron")["megatron_args.txt"].split() == arguments
    if megatron_args.available():
        import shlex

        launch = shlex.split(emit(plan, "megatron")["megatron_launch.sh"].splitlines()[-1])
        env = dict(w.split("=", 1) for w in launch[1:launch.index("torchrun")]) if launch[0] == "env" else {}
        run = [word for flag, value in RUN.items() for word in (flag, value)]
        args, core = megatron_args.validate(tmp_path, [*arguments, *run], world=8, capability=megatron_args.H100,
                                            env=env, monkeypatch=monkeypatch)
        assert (args.use_rope_scaling, args.lr, args.train_iters, args.save) == \
            ("--use-rope-scaling" in flags, 2e-05, 100, "/ckpt")
        assert (core.attention_dropout, core.hidden_dropout) == \
            (float(flags["--attention-dropout"]), float(flags["--hidden-dropout"]))
        assert (core.num_layers, core.hidden_size, core.ffn_hidden_size, core.num_attention_heads) == \
            (text.num_hidden_layers, text.hidden_size, ffn, text.num_attention_heads)
        assert (core.num_query_groups or core.num_attention_heads) == kv
        assert (core.gated_linear_unit, core.add_bias_linear, core.qk_layernorm) == \
            ("--swiglu" in flags, "--disable-bias-linear" not in flags, "--qk-layernorm" in flags)


def test_a_plan_without_a_shape_is_refused_with_a_way_out():
    import dataclasses

    plan = solve("gpt2", "8xH100", launcher="megatron", seq_len=1024, global_batch=64, time_limit=10)
    old = dataclasses.replace(plan, inputs=dataclasses.replace(plan.inputs, shape=None))
    with pytest.raises(FitplanError, match="Re-plan"):
        emit(old, "megatron")


def test_a_llama_config_without_rope_theta_gets_rotary_positions_at_the_default_base(tmp_path):
    """Issue 38 item 15: config.json may leave rope_theta out; transformers then rotates with LlamaConfig's base
    (10,000), and Megatron must too, not learn absolute positions."""
    from transformers import AutoConfig

    from tests.graphs.reference import write_config
    from tests.graphs.tiny_configs import tiny_values

    values = {k: v for k, v in tiny_values("llama").items() if k not in ("rope_theta", "rope_scaling")}
    folder = write_config(tmp_path / "tiny-llama", values)
    plan = solve(str(folder), "8xH100", launcher="megatron", seq_len=256, global_batch=16, time_limit=5)
    flags = flag_values(megatron.arguments(plan))
    assert flags["--position-embedding-type"] == "rope" and "--use-rope-scaling" not in flags
    assert float(flags["--rotary-base"]) == AutoConfig.for_model("llama").rope_parameters["rope_theta"] == 10000.0


def test_rope_scaling_megatron_cannot_build_keeps_it_off_the_launchers():
    from solver.plan.record import RopeScaling

    llama31 = RopeScaling(kind="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_positions=8192)
    assert megatron.rope_scaling_problem(llama31) is None
    assert megatron.rope_scaling_problem(RopeScaling(kind="linear", factor=2.0)) is None
    assert "fixes" in megatron.rope_scaling_problem(dataclasses.replace(llama31, original_max_positions=4096))
    assert "yarn" in megatron.rope_scaling_problem(RopeScaling(kind="yarn", factor=40.0))
