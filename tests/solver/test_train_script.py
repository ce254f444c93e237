"""The emitted train_fitplan.py trains as a training loop should: fp16 loss scaling, one gradient all-reduce per
optimizer step under DDP, gradient clipping, and the learning rate and warm-up as arguments."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from solver import solve
from solver.cli.commands import emit_files
from tests.gloo import torchrun
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

RANKS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_config(tmp_path_factory.mktemp("tiny-llama"), tiny_values("llama"))


def emitted_script(model_dir: Path, folder: Path, **pins) -> tuple[object, Path]:
    plan = solve(str(model_dir), f"{RANKS}xCPU", seq_len=32, global_batch=4, time_limit=5, offload="none",
                 param_offload="none", **pins)
    emit_files(plan, "torchrun", folder)
    return plan, folder / "train_fitplan.py"


def run(script: Path, model_dir: Path, report: Path, *extra: str, timeout: float = 240) -> tuple[list[dict],
                                                                                               list[float]]:
    """The emitted script under torchrun on RANKS gloo processes for two steps: each rank's report and the losses
    it printed."""
    done = torchrun(script, "--model", str(model_dir), "--from-config", "--steps", "2", "--report", str(report),
                    *extra, ranks=RANKS, timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    reports = [json.loads((report / f"rank{rank}.json").read_text()) for rank in range(RANKS)]
    return reports, [float(x) for x in re.findall(r"loss (\S+)", done.stdout)]


@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_fp16_plan_scales_the_loss_clips_and_warms_up(engine, model_dir, tmp_path):
    plan, script = emitted_script(model_dir, tmp_path / "out", engine=engine, precision=("fp16-mixed",),
                                  micro_batch=1, grad_accum=2)
    assert plan.decisions.precision.value == "fp16-mixed" and plan.decisions.grad_accum == 2
    reports, losses = run(script, model_dir, tmp_path / "r", "--lr", "0.004", "--warmup-steps", "3",
                          "--max-grad-norm", "0.5")
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    for report in reports:
        assert report["loss_scale"] is not None and report["loss_scale"] > 1  # dynamic scaling, 2**16 at start
        assert report["learning_rates"] == pytest.approx([0.001, 0.002])  # lr * (step + 1) / (warmup + 1)
        assert len(report["grad_norms"]) == 2 and all(math.isfinite(n) for n in report["grad_norms"])
    assert reports[0]["grad_norms"] == pytest.approx(reports[1]["grad_norms"])  # the global norm, on every rank


@pytest.mark.distributed
def test_bf16_plan_has_no_loss_scaler_and_clipping_can_be_turned_off(model_dir, tmp_path):
    _, script = emitted_script(model_dir, tmp_path / "out", engine="ddp", tp=1, precision=("bf16-mixed",))
    reports, losses = run(script, model_dir, tmp_path / "r", "--max-grad-norm", "0")
    assert len(losses) == 2
    assert all(r["loss_scale"] is None and r["grad_norms"] == [] for r in reports)
    assert reports[0]["learning_rates"] == pytest.approx([2e-5, 2e-5])  # the plan's default, no warm-up


def test_ddp_syncs_gradients_only_on_the_last_micro_batch(model_dir, tmp_path, monkeypatch):
    _, script = emitted_script(model_dir, tmp_path / "out", engine="ddp")
    spec = importlib.util.spec_from_file_location("train_fitplan", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        with module.sync_gradients(ddp, last=False):
            assert ddp.require_backward_grad_sync is False
            ddp(torch.ones(2, 4)).sum().backward()
        with module.sync_gradients(ddp, last=True):
            assert ddp.require_backward_grad_sync is True
        plain = torch.nn.Linear(4, 4)  # FSDP2 / single rank: nothing to skip
        with module.sync_gradients(plain, last=False):
            pass
    finally:
        dist.destroy_process_group()


def peak_rss_growth(model_dir: Path, folder: Path, engine: str, baseline: int | None = None,
                    **pins) -> tuple[int, object]:
    """Peak resident bytes of the largest rank after building and sharding (no step), less `baseline`."""
    pins = {"precision": ("fp32",), **pins}
    plan, script = emitted_script(model_dir, folder, engine=engine, tp=1, pp=1, **pins)  # DDP: whole model
    report = folder / "report"
    reports, _ = run_steps(script, model_dir, report, 0)
    return max(r["peak_rss_bytes"] for r in reports) - (baseline or 0), plan


def run_steps(script: Path, model_dir: Path, report: Path, steps: int) -> tuple[list[dict], str]:
    done = torchrun(script, "--model", str(model_dir), "--from-config", "--steps", str(steps), "--report",
                    str(report), ranks=RANKS, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return [json.loads((report / f"rank{rank}.json").read_text()) for rank in range(RANKS)], done.stdout


@pytest.mark.distributed
def test_fsdp2_script_never_holds_the_unsharded_model(model_dir, tmp_path):
    """FSDP2 builds on the meta device and allocates only its shard: each rank's peak memory grows by about half
    the fp32 model on two ranks, while DDP (which needs the whole model) grows by at least the whole of it."""
    from tests.graphs.tiny_configs import tiny_values

    big = write_config(tmp_path / "big", {**tiny_values("llama"), "hidden_size": 512, "intermediate_size": 2048,
                                          "num_hidden_layers": 8, "vocab_size": 32000, "head_dim": 64,
                                          "num_attention_heads": 8, "num_key_value_heads": 4})
    baseline, _ = peak_rss_growth(model_dir, tmp_path / "tiny", "fsdp2")
    sharded, plan = peak_rss_growth(big, tmp_path / "fsdp2", "fsdp2", baseline)
    whole = plan.estimate.memory.parameters * RANKS  # fp32 parameters of the unsharded model
    assert whole > 150 * 2**20
    replicated, _ = peak_rss_growth(big, tmp_path / "ddp", "ddp", baseline)
    assert replicated >= 0.9 * whole, (replicated, whole)  # the control: holding the model shows in the measure
    assert sharded < 0.75 * whole, (sharded, whole)


@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_lora_plan_runs_as_emitted_and_holds_the_priced_parameters(engine, model_dir, tmp_path):
    # The frozen base loads in bf16 and PEFT's fp32 adapters train beside it: FSDP2 takes the mixed dtypes (its
    # uniform-dtype rule is over trainable parameters), and each rank holds the parameter bytes the plan priced.
    from graphs import LoraSpec

    plan, script = emitted_script(model_dir, tmp_path / "out", engine=engine, precision=("bf16-mixed",),
                                  lora=LoraSpec(rank=8, alpha=16))
    reports, losses = run(script, model_dir, tmp_path / "r")
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert reports[0]["param_bytes"] == plan.estimate.memory.parameters


BIG = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 8, "vocab_size": 32000, "head_dim": 64,
       "num_attention_heads": 8, "num_key_value_heads": 4}


@pytest.mark.distributed
def test_fsdp2_lora_script_builds_on_meta_and_never_holds_the_unsharded_base(model_dir, tmp_path):
    """Issue 35 item 10: an FSDP2 LoRA plan builds base and adapters on the meta device, shards, then fills its
    shards, as full fine-tuning does: each rank grows by about half the base on two ranks (the whole of it before)."""
    from graphs import LoraSpec

    lora = {"lora": LoraSpec(rank=8, alpha=16), "precision": ("bf16-mixed",)}
    big = write_config(tmp_path / "big", {**tiny_values("llama"), **BIG})
    baseline, _ = peak_rss_growth(model_dir, tmp_path / "tiny", "fsdp2", **lora)
    sharded, plan = peak_rss_growth(big, tmp_path / "fsdp2", "fsdp2", baseline, **lora)
    whole = plan.estimate.memory.parameters * RANKS  # the 16-bit base (and the adapters) of the unsharded model
    assert whole > 75 * 2**20
    replicated, _ = peak_rss_growth(big, tmp_path / "ddp", "ddp", baseline, **lora)
    assert replicated >= 0.9 * whole, (replicated, whole)  # the control: holding the model shows in the measure
    assert sharded < 0.75 * whole, (sharded, whole)


def saved_model(folder: Path) -> Path:
    """The tiny Llama with seeded random weights saved as a checkpoint (what --model loads without --from-config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = tiny_values("llama")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values)).save_pretrained(folder)
    return folder


def token_file(path: Path, vocab: int, documents: int = 40) -> Path:
    """JSON Lines of token ids: documents of different lengths, which the script packs into rows."""
    generator = torch.Generator().manual_seed(7)
    lines = [json.dumps({"input_ids": torch.randint(0, vocab, (9 + 5 * (i % 4),), generator=generator).tolist()})
             for i in range(documents)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.distributed
def test_fsdp2_lora_loads_the_checkpoint_into_its_shards_as_ddp_holds_it(tmp_path):
    """The FSDP2 LoRA script loads base and adapters after sharding: on the same --data rows its first loss is the
    one DDP computes from the whole loaded model (the adapters' B = 0: the base's loss, whatever A's init)."""
    from graphs import LoraSpec

    model = saved_model(tmp_path / "model")
    data = token_file(tmp_path / "tokens.jsonl", tiny_values("llama")["vocab_size"])
    first = {}
    for engine in ("ddp", "fsdp2"):
        _, script = emitted_script(model, tmp_path / engine, engine=engine, precision=("fp32",),
                                   lora=LoraSpec(rank=8, alpha=16), micro_batch=1, grad_accum=2)
        done = torchrun(script, "--model", str(model), "--data", str(data), "--steps", "1", ranks=RANKS, timeout=300)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        assert "random tokens" not in done.stdout
        first[engine] = float(re.findall(r"loss (\S+)", done.stdout)[0])
    assert first["fsdp2"] == pytest.approx(first["ddp"], rel=1e-4)  # fp32: only the reduction order differs


@pytest.mark.distributed
def test_without_data_the_script_says_it_runs_a_smoke_test_and_a_bad_record_stops_it(model_dir, tmp_path):
    """Issue 35 item 9: random tokens are a smoke test, said as the run starts; --data's records are checked."""
    _, script = emitted_script(model_dir, tmp_path / "out", engine="ddp")
    args = ["--model", str(model_dir), "--from-config", "--steps", "1"]
    done = torchrun(script, *args, ranks=RANKS, timeout=300)
    assert done.returncode == 0 and "smoke test" in done.stdout, (done.stdout + done.stderr)[-4000:]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2, 3]}\n{"tokens": [4]}\n')
    done = torchrun(script, *args, "--data", str(bad), ranks=RANKS, timeout=300)
    assert done.returncode != 0 and "bad.jsonl:2: a record needs input_ids or text" in done.stdout + done.stderr
