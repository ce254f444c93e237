"""Every example runs offline as a script and prints its result."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))
EXPECTED = {"plan_llama8b_deepspeed.py": "zero_optimization", "plan_llama70b_two_nodes.py": "MFU",
            "plan_qwen7b_lora_24gb.py": "LoRA", "cheapest_cluster_sweep.py": "fits",
            "estimate_fixed_config.py": "device peak", "local_config_json.py": "local",
            "choose_gpus.py": "cheapest within", "plan_qwen7b_qlora_24gb.py": "QLoRA r=16 nf4"}


@pytest.mark.slow
@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_runs_offline_and_prints_its_result(example):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert EXPECTED[example.name] in result.stdout
    assert "Traceback" not in result.stderr
