"""The runtime decides how a 4-bit base is held: axolotl's loader calls PEFT's `prepare_model_for_kbit_training`
(outside FSDP and ZeRO-3) and casts norms and embeddings back; the Trainer/accelerate launchers' files do not call
it, and a user's own script may (`--kbit-preparation`). `solve` and `estimate` price a QLoRA configuration on the
lowering its runtime leaves (the lowerings themselves equal PEFT's own preparation: tests/graphs/test_quantized.py)."""

from __future__ import annotations

import pytest

from graphs import FitplanError, LoraSpec, variant
from solver.api import estimate
from solver.search.route import KBIT_NOTE, NO_KBIT_NOTE
from tests.graphs.reference import write_config
from tests.graphs.tiny_configs import tiny_values

pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.slow

QLORA = LoraSpec(rank=8, alpha=16, quantization="nf4", double_quant=True)
DDP = {"engine": "ddp", "precision": "bf16-mixed", "micro_batch": 2, "grad_accum": 1, "dp": 1}


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> str:
    # GPT-2's ln_1/ln_2/ln_f and wte/wpe are named like neither axolotl's norms nor its embedding modules: they stay
    # fp32 after its cast back, so its prepared lowering differs from the plain one.
    return str(write_config(tmp_path_factory.mktemp("gpt2"), tiny_values("gpt2")))


def _priced(monkeypatch, model: str, config: dict, launcher: str | None, **options):
    """The variant `estimate` lowered for the configuration, and the estimate."""
    seen: list[variant.Variant] = []
    original = variant._lower
    monkeypatch.setattr(variant, "_lower", lambda resolved, v: seen.append(v) or original(resolved, v))
    result = estimate(model, "1xH100", config, seq_len=128, lora=QLORA, launcher=launcher, **options)
    return seen[-1], result


def test_axolotl_qlora_is_priced_on_peft_kbit_preparation(gpt2, monkeypatch):
    prepared, axolotl = _priced(monkeypatch, gpt2, DDP, "axolotl")
    plain, trainer = _priced(monkeypatch, gpt2, DDP, "hf")
    assert prepared.kbit == ("norm", "embed_tokens", "lm_head")
    assert plain.kbit is None
    assert prepared.lora == plain.lora == QLORA
    # fp32 embeddings and norms: more parameter bytes, and a wider residual stream saved for backward.
    assert axolotl.memory.parameters > trainer.memory.parameters
    assert axolotl.memory.activations > trainer.memory.activations


@pytest.mark.parametrize(("engine", "zero", "kbit"), [("ddp", 0, ("norm", "embed_tokens", "lm_head")),
                                                    ("deepspeed", 2, ("norm", "embed_tokens", "lm_head")),
                                                    ("deepspeed", 3, None), ("fsdp2", 3, None)])
def test_axolotl_prepares_outside_fsdp_and_zero3(gpt2, engine, zero, kbit):
    # axolotl 0.19 loaders/model.py `_prepare_model_for_quantization` skips PEFT's preparation under DeepSpeed ZeRO-3
    # and FSDP (fitplan's estimator refuses those engines for a 4-bit base today; the route follows axolotl anyway).
    from costmodels.config import Config, Engine, Precision
    from graphs import resolve
    from solver.search.route import Route, variant_for

    config = Config(precision=Precision.BF16_MIXED, engine=Engine(engine), zero=zero)
    route = Route(resolved=resolve(gpt2), lora=QLORA, axolotl=True)
    assert variant_for(config, route, megatron=False).kbit == kbit
    assert variant_for(config, Route(resolved=resolve(gpt2), lora=QLORA), megatron=False).kbit is None


@pytest.mark.parametrize("launcher", [None, "hf", "accelerate"])
def test_kbit_preparation_prices_a_script_that_calls_peft_on_the_base(gpt2, monkeypatch, launcher):
    # A user's own script (reading the hf/accelerate files, or none) that calls PEFT's preparation and casts nothing
    # back: every 16-bit parameter outside the 4-bit layers in fp32.
    prepared, theirs = _priced(monkeypatch, gpt2, DDP, launcher, kbit_preparation=True)
    plain, trainer = _priced(monkeypatch, gpt2, DDP, launcher)
    assert prepared.kbit == () and plain.kbit is None
    assert theirs.memory.parameters > trainer.memory.parameters
    assert theirs.memory.activations > trainer.memory.activations
    assert KBIT_NOTE in theirs.notes and NO_KBIT_NOTE in trainer.notes


@pytest.mark.parametrize(("lora", "launcher", "phrase"), [
    (None, None, "this run has none"),
    (LoraSpec(rank=8), None, "this run has none"),
    (QLORA, "axolotl", "casts norms and embeddings back"),
    (QLORA, "trl", "runs its own loader"),
])
def test_kbit_preparation_is_refused_where_no_script_of_the_user_runs_it(gpt2, lora, launcher, phrase):
    with pytest.raises(FitplanError, match=phrase):
        estimate(gpt2, "1xH100", DDP, seq_len=128, lora=lora, launcher=launcher, kbit_preparation=True)


def test_a_plan_for_a_script_that_prepares_the_base_is_priced_recorded_and_run_so(gpt2, tmp_path):
    import json
    import math

    from costmodels import Config
    from solver.api import solve
    from solver.cli.commands import estimate_report
    from solver.cli.validation import validate_plan
    from solver.plan.record import Plan

    plan = solve(gpt2, "1xH100", seq_len=128, global_batch=4, lora=QLORA, kbit_preparation=True, time_limit=5,
                 precision="bf16-mixed")  # in fp32 the preparation has nothing to upcast
    assert plan.decisions.lora.kbit_preparation and plan.decisions.lora.spec() == QLORA
    assert plan.launchers and set(plan.launchers) <= {"hf", "accelerate"}  # axolotl prepares the base its own way
    assert KBIT_NOTE in plan.estimate.notes
    config = {name: getattr(plan.decisions, name) for name in Config.__dataclass_fields__}
    batch = plan.decisions.micro_batch * plan.decisions.grad_accum * plan.decisions.dp
    prepared = estimate(gpt2, "1xH100", config, seq_len=128, global_batch=batch, lora=QLORA, kbit_preparation=True)
    plain = estimate(gpt2, "1xH100", config, seq_len=128, global_batch=batch, lora=QLORA)
    assert prepared.memory == plan.estimate.memory
    assert math.isclose(prepared.time.step_time, plan.estimate.time.step_time)
    assert plain.memory.parameters < plan.estimate.memory.parameters
    # Written and read back, the plan is estimated as it was planned: for a script that prepares the base.
    path = tmp_path / "plan.json"
    path.write_text(plan.dumps())
    assert Plan.from_json(json.loads(path.read_text())).decisions.lora.kbit_preparation
    report = estimate_report(gpt2, "1xH100", path, {}, seq_len=None)
    assert report.estimate.memory == plan.estimate.memory and KBIT_NOTE in report.estimate.notes
    assert validate_plan(plan).memory == plan.estimate.memory  # what --emit/explain of a plan file check


@pytest.mark.parametrize(("options", "phrase"), [({"launcher": "axolotl"}, "casts norms and embeddings back"),
                                                 ({"lora": LoraSpec(rank=8)}, "this run has none")])
def test_solve_refuses_kbit_preparation_where_no_script_of_the_user_runs_it(gpt2, options, phrase):
    from solver.api import solve

    with pytest.raises(FitplanError, match=phrase):
        solve(gpt2, "1xH100", seq_len=128, global_batch=4, kbit_preparation=True, time_limit=5,
              **{"lora": QLORA, **options})
