"""QLoRA and DoRA decisions end to end: the CLI's --lora-quantization/--double-quant/--use-dora reach the lowering
(priced by the bitsandbytes/PEFT lowering that tests/graphs/test_quantized.py checks against real runs), the plan's
LoRA decision, and the HF/accelerate files, which transformers' own BitsAndBytesConfig and PEFT's own LoraConfig
read back; launchers that cannot load them, and engines that would shard a packed base, are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from costmodels import Config, Engine, InvalidConfig, Precision
from graphs import FitplanError, LoraSpec
from solver.api import estimate, solve
from solver.cli.app import app
from solver.plan.launchers import emit
from solver.plan.record import Plan
from solver.search.diagnose import Infeasible
from solver.search.route import NO_KBIT_NOTE

MODEL, GPUS = "Qwen/Qwen2.5-0.5B", "1xL4"
WORKLOAD = {"seq_len": 512, "global_batch": 4}
QDORA = LoraSpec(rank=16, alpha=32, quantization="nf4", double_quant=True, use_dora=True)


@pytest.fixture(scope="module")
def plan():
    return solve(MODEL, GPUS, **WORKLOAD, lora=QDORA, time_limit=5)


def test_the_plan_records_the_quantized_dora_adapters_and_prices_the_packed_base(plan):
    lora = plan.decisions.lora
    assert (lora.quantization, lora.double_quant, lora.use_dora) == ("nf4", True, True)
    assert lora.spec() == QDORA
    assert Plan.from_json(json.loads(plan.dumps())).decisions.lora == lora  # written and read back whole
    assert (plan.decisions.engine, plan.decisions.tp) == (Engine.DDP, 1)
    assert set(plan.launchers) == {"hf", "accelerate", "axolotl"}
    config = Config(**{name: getattr(plan.decisions, name) for name in Config.__dataclass_fields__})
    again = estimate(MODEL, GPUS, config, seq_len=WORKLOAD["seq_len"], global_batch=WORKLOAD["global_batch"],
                     lora=QDORA)
    assert again.memory == plan.estimate.memory
    plain = estimate(MODEL, GPUS, config, seq_len=WORKLOAD["seq_len"], global_batch=WORKLOAD["global_batch"],
                     lora=LoraSpec(rank=16, alpha=32, use_dora=True))
    # 4-bit packed (plus double-quantized scales) against 16-bit frozen weights: well under half the bytes
    assert again.memory.parameters < 0.5 * plain.memory.parameters


def test_the_plan_says_it_priced_no_kbit_preparation(plan):
    # Its hf/accelerate files leave the script to the user, who may call PEFT's prepare_model_for_kbit_training:
    # the note says what was priced and how to price the other (tests/solver/test_kbit_route.py).
    assert NO_KBIT_NOTE in plan.estimate.notes


@pytest.mark.parametrize("launcher", ["hf", "accelerate"])
def test_emitted_quantization_and_adapter_configs_parse_with_transformers_and_peft(plan, launcher, tmp_path):
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    files = emit(plan, launcher)
    bnb = BitsAndBytesConfig.from_dict(json.loads(files["quantization_config.json"]))
    assert bnb.load_in_4bit and not bnb.load_in_8bit
    assert (bnb.bnb_4bit_quant_type, bnb.bnb_4bit_use_double_quant) == ("nf4", True)
    assert bnb.bnb_4bit_compute_dtype == {Precision.BF16_MIXED: torch.bfloat16, Precision.FP16_MIXED: torch.float16,
                                          }.get(plan.decisions.precision, torch.float32)
    (tmp_path / "adapter_config.json").write_text(files["adapter_config.json"])
    adapters = LoraConfig.from_pretrained(str(tmp_path))
    assert (adapters.r, adapters.lora_alpha, adapters.use_dora) == (16, 32, True)


def test_launchers_that_cannot_load_qlora_or_dora_refuse_it(plan):
    for launcher in ("torchrun", "deepspeed"):
        with pytest.raises(FitplanError, match="QLoRA"):
            emit(plan, launcher)
    with pytest.raises(FitplanError, match="cannot load QLoRA/DoRA"):
        solve(MODEL, GPUS, **WORKLOAD, lora=QDORA, launcher="torchrun", time_limit=5)


def test_a_quantized_base_is_refused_under_sharding_engines():
    qlora = LoraSpec(rank=8, alpha=16, quantization="nf4")
    with pytest.raises(InvalidConfig, match="DDP with tp=1"):
        estimate(MODEL, "2xL4", {"engine": "fsdp2", "zero": 3, "dp": 2, "micro_batch": 1}, seq_len=256, lora=qlora)


def test_cli_takes_the_qlora_flags_and_refuses_them_without_adapters():
    common = ["estimate", "--model", MODEL, "--gpus", GPUS, "--seq-len", "512", "--json"]
    quantized = CliRunner().invoke(app, [*common, "--lora-rank", "8", "--lora-quantization", "nf4", "--double-quant"])
    plain = CliRunner().invoke(app, [*common, "--lora-rank", "8"])
    assert quantized.exit_code == 0 == plain.exit_code, quantized.output
    assert json.loads(quantized.stdout)["memory"]["parameters"] < json.loads(plain.stdout)["memory"]["parameters"]
    for flags, message in ((["--use-dora"], "--use-dora needs --lora-rank"),
                           (["--lora-rank", "8", "--double-quant"], "--double-quant needs --lora-quantization")):
        result = CliRunner().invoke(app, [*common, *flags])
        assert result.exit_code == 2 and message in result.stderr, result.output


@pytest.mark.slow
def test_emitted_hf_files_train_a_tiny_quantized_model_on_cpu(tmp_path):
    """The files the QLoRA example writes, used as its last line says, run two real Trainer steps: bitsandbytes'
    4-bit layers load from quantization_config.json, PEFT's adapters from adapter_config.json, and
    TrainingArguments' optim builds bitsandbytes' paged 8-bit AdamW (on CPU bitsandbytes falls back to unpaged
    states; the sizes are the same). Only what a CPU run cannot do is overridden: no bf16 autocast, no compile,
    no worker processes, two steps."""
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments

    from tests.graphs.tiny_configs import tiny_values

    plan = solve(MODEL, GPUS, **WORKLOAD, lora=LoraSpec(rank=8, alpha=16, quantization="nf4", double_quant=True),
                 optimizers="paged-adamw-8bit", launcher="hf", time_limit=5)
    files = emit(plan, "hf")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    fields = dict(tiny_values("llama"))
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "base")
    quantization = BitsAndBytesConfig.from_dict(json.loads((tmp_path / "quantization_config.json").read_text()))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=quantization,
                                                 dtype=torch.bfloat16, device_map="cpu")
    model = get_peft_model(model, LoraConfig.from_pretrained(str(tmp_path)))
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    kwargs = {**json.loads(files["training_args.json"]), "output_dir": str(tmp_path / "run"), "use_cpu": True,
              "bf16": False, "torch_compile": False, "dataloader_num_workers": 0, "dataloader_pin_memory": False,
              "max_steps": 2, "report_to": [], "per_device_train_batch_size": 1, "gradient_accumulation_steps": 1}
    ids = torch.randint(0, config.vocab_size, (4, 16))
    data = [{"input_ids": row, "labels": row} for row in ids]
    trainer = Trainer(model=model, args=TrainingArguments(**kwargs), train_dataset=data)
    result = trainer.train()
    built = trainer.optimizer.optimizer  # transformers builds bitsandbytes' AdamW(optim_bits=8, is_paged=True)
    assert isinstance(built, bnb.optim.AdamW) and built.is_paged and built.args.optim_bits == 8
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))


@pytest.mark.slow
def test_allow_lora_takes_the_faster_of_lora_and_qlora_when_full_fine_tuning_cannot_fit():
    """Qwen2.5-7B on one 16 GB T4. With 8 GiB of host RAM, 16-bit LoRA (15 GB of frozen fp16 weights, nowhere to
    offload them) cannot fit and QLoRA does. With the node's default RAM, 16-bit LoRA fits only by streaming its
    frozen base from the host, and QLoRA is the faster: each is taken against the same request solved with that
    adapter alone, and the plan says what it gave up. Compile is pinned off in every solve: the choice is the same
    comparison either way, and the compiled LoRA and QLoRA lowerings were most of the test's four minutes."""
    request = {"seq_len": 1024, "global_batch": 16, "time_limit": 30, "compile": "off"}
    tight = solve("Qwen/Qwen2.5-7B", "1xT4", **request, allow_lora=True, cluster_options={"cpu_ram_gib": 8})
    lora = tight.decisions.lora
    assert (lora.quantization, lora.double_quant, lora.rank) == ("nf4", True, 16)
    assert any("16-bit LoRA does not fit" in line for line in tight.inputs.assumed)
    with pytest.raises(FitplanError):  # what the fallback gave up: the same request without QLoRA
        solve("Qwen/Qwen2.5-7B", "1xT4", **request, lora=LoraSpec(), cluster_options={"cpu_ram_gib": 8})
    chosen = solve("Qwen/Qwen2.5-7B", "1xT4", **request, allow_lora=True)
    alone = {kind: solve("Qwen/Qwen2.5-7B", "1xT4", **request, lora=spec) for kind, spec in
             (("lora", LoraSpec()), ("qlora", LoraSpec(quantization="nf4", double_quant=True)))}
    fastest = min(alone, key=lambda kind: alone[kind].estimate.time.step_time)
    assert chosen.decisions.lora == alone[fastest].decisions.lora
    assert chosen.estimate.time.step_time == alone[fastest].estimate.time.step_time
    other = "qlora" if fastest == "lora" else "lora"
    assert any(f"{alone[other].estimate.time.step_time:.3g} s per step" in line for line in chosen.inputs.assumed)
    roomy = solve("Qwen/Qwen2.5-0.5B", "1xT4", seq_len=512, global_batch=4, allow_lora=True, compile="off",
                  time_limit=5)
    assert roomy.decisions.lora is None  # no fallback where full fine-tuning fits


@pytest.mark.slow
def test_allow_lora_says_when_neither_lora_nor_qlora_fits():
    """Qwen2.5-7B at 32,768 tokens on a T4: the activations alone outgrow the card, so no adapter helps; the error
    says that all three were tried and gives QLoRA's (the leanest) numbers. Compile is pinned off, as in the test
    above (whose eager lowerings it shares): the refusal is not about it."""
    with pytest.raises(Infeasible, match=r"Neither full fine-tuning nor 16-bit LoRA nor QLoRA fits\. With QLoRA: "
                                          r"Nothing fits") as refusal:
        solve("Qwen/Qwen2.5-7B", "1xT4", seq_len=32768, global_batch=1, allow_lora=True, compile="off", time_limit=60)
    assert refusal.value.diagnosis and "--seq-len" in refusal.value.hint
    # QLoRA runs under DDP only: more GPUs would each hold the whole quantized model
    assert "not more GPUs: a quantized (QLoRA) base" in refusal.value.hint
    assert "shard" not in refusal.value.hint
