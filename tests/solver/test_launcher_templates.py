"""The emitted Python files: byte for byte what the emitters wrote before the scripts became template modules
(digests of frozen plans covering the script's branches, tests/solver/template_golden.py)."""

from __future__ import annotations

import pytest

from tests.solver import template_golden


@pytest.mark.parametrize("case", sorted(template_golden.CASES))
def test_emitted_python_files_match_the_golden_digests(case: str):
    assert template_golden.digests(case) == template_golden.stored()["digests"][case]


def test_golden_cases_cover_every_pipeline_schedule_and_launcher_python_file():
    """The cases reach each branch the digests are meant to guard (a case list that lost one would pass quietly)."""
    decisions = [template_golden.plan(case).decisions for case in template_golden.CASES]
    files = {file for digests in template_golden.stored()["digests"].values() for file in digests}
    assert {str(d.pp_schedule) for d in decisions if d.pp > 1} == {str(s) for s in template_golden.Schedule}
    assert {str(d.loss) for d in decisions} == {str(loss) for loss in template_golden.Loss}
    assert {str(d.engine) for d in decisions} >= {"fsdp2", "ddp"}
    assert any(d.lora and d.lora.quantization for d in decisions) and any(d.tp > 1 for d in decisions)
    assert any(d.activation_offload for d in decisions) and any(d.compile for d in decisions)
    assert files == {"train_fitplan.py", "fitplan_torchtitan.py", "fitplan_checkpointing.py"}
