"""The knob record (`costmodels.knobs`) is the one declaration of every knob: the cost modules it names are the
ones that read it, and Config, the pins, the plan's decisions, the CLI and the JSON schema all follow it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import costmodels
from costmodels import Config
from costmodels.knobs import declared, readers
from solver.cli.app import app
from solver.cli.knob_options import estimate_parameters, solve_parameters
from solver.plan.record import Decisions, Plan, json_schema
from solver.search.pins import KNOBS, Pins, pinned_kind

COSTMODELS = Path(costmodels.__file__).parent


def test_every_knob_is_read_by_some_cost_module():
    # derived from the code (`costmodels.knobs.readers`): a knob that nothing reads would change no cost
    found = readers()
    for name in KNOBS:
        assert found.get(name), f"{name}: no costmodels module reads it"


def test_the_derived_readers_follow_the_code():
    # states.py reads the ZeRO stage and the optimizer from its Config parameter; the memory model the micro-batch
    found = readers()
    assert "states" in found["zero"] and "states" in found["optimizer"] and "memory" in found["micro_batch"]
    assert "compilation" in found["compile"]


def test_decisions_are_the_config_knobs_plus_what_only_the_plan_records():
    plan_knobs = declared(Decisions)
    assert list(plan_knobs)[:len(KNOBS)] == list(KNOBS)
    assert set(plan_knobs) - set(KNOBS) == {"lora", "attention", "dataloader_num_workers", "dataloader_pin_memory"}


def test_the_json_schema_describes_every_decision_with_its_knob_help():
    properties = json_schema()["$defs"]["Decisions"]["properties"]
    for name, knob in declared(Decisions).items():
        assert properties[name]["description"] == knob.knob.help


def test_cli_options_are_generated_for_every_knob():
    solve_names = {p.name for p in solve_parameters()}
    assert solve_names == {n for n, k in KNOBS.items() if k.knob.pin != "derived"}
    assert {p.name for p in estimate_parameters()} == set(KNOBS)
    help_text = CliRunner().invoke(app, ["solve", "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"}).output
    for name, knob in KNOBS.items():
        if knob.knob.pin != "derived":
            assert knob.option in help_text, name


def _two_values(name: str) -> tuple[object, object]:
    kind = pinned_kind(KNOBS[name])
    if kind is bool:
        return True, False
    if kind is int:
        return KNOBS[name].knob.low + 1, KNOBS[name].knob.low
    if kind is float:
        return 0.5, 1.0
    members = list(kind)
    return members[-1], members[0]


@pytest.mark.parametrize("name", [n for n, k in KNOBS.items() if k.knob.pin != "derived"])
def test_every_pinnable_knob_pins_by_its_name_or_option_and_refuses_a_wrong_type(name):
    first, second = _two_values(name)
    as_text = ("on" if first else "off") if isinstance(first, bool) else str(getattr(first, "value", first))
    pins = Pins.of(**{name: as_text})
    assert pins.value(name) == first and pins.allows(name, first) and not pins.allows(name, second)
    option = KNOBS[name].option[2:].replace("-", "_")
    assert Pins.of(**{option: first}).allowed(name) == (first,)
    assert Pins.of(**{name: "auto"}).allowed(name) is None
    with pytest.raises(ValueError, match=name):
        Pins.of(**{name: "not-a-value"})


def test_a_set_knob_takes_several_values_and_a_derived_one_none():
    pins = Pins.of(precision=("bf16-mixed", "fp8"), optimizers="adamw")
    assert [p.value for p in pins.allowed("precision")] == ["bf16-mixed", "fp8"]
    assert pins.value("precision") is None and pins.value("optimizer").value == "adamw"
    with pytest.raises(ValueError, match="derived"):
        Pins.of(dp=2)
    with pytest.raises(ValueError, match="unknown knob"):
        Pins.of(pipeline=2)


def test_config_files_are_parsed_by_the_record(tmp_path):
    from solver.api import config_from

    config = config_from({"tp": "2", "engine": "fsdp2", "zero": 3, "checkpoint": ["full", "none"],
                          "compile": True}, layers=2)
    assert config == Config(tp=2, engine=config.engine, zero=3, checkpoint=config.checkpoint, compile=True)
    assert [m.value for m in config.checkpoint] == ["full", "none"]


@pytest.mark.compile_search  # the 1.x plan was solved with torch.compile searched
def test_explain_reads_a_1x_plan_with_its_old_pin_names(tmp_path):
    from solver.api import solve

    plan = solve("gpt2", "1xA10G", seq_len=256, global_batch=4, precision=("bf16-mixed",), optimizers="adamw",
                 time_limit=5)
    data = plan.to_json()
    assert data["inputs"]["pins"] == {"precision": ["bf16-mixed"], "optimizer": ["adamw"]}
    data["schema_version"] = "1.2"
    data["inputs"]["pins"] = {"precisions": ["bf16-mixed"], "optimizers": ["adamw"], "offload": "none",
                              "compile": "auto"}
    old = Plan.from_json(json.loads(json.dumps(data)))
    assert old.inputs.pins == {"precision": ["bf16-mixed"], "optimizer": ["adamw"], "optimizer_offload": "none"}
    assert old.decisions == plan.decisions
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    result = CliRunner().invoke(app, ["explain", str(path)])
    assert result.exit_code == 0, result.output
