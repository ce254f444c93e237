"""Plans for a dataset's lengths (issue 14): padding plans memory on the longest micro-batch the data can make,
packing on full rows, and the plan says what share of its tokens is real (`costmodels.packing`, whose figures are
checked against brute force and transformers' collator in tests/costmodels/test_packing.py)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from costmodels.packing import Lengths, packed, padded
from solver import solve
from solver.cli.app import app

MODEL, GPUS = "gpt2", "1xA100"
LENGTHS = Lengths.of({120: 40, 300: 20, 512: 4})
OPTIONS = {"global_batch": 16, "time_limit": 5}


def test_padding_plans_on_the_longest_sequence_the_data_holds():
    plan = solve(MODEL, GPUS, seq_len=1024, dataset_lengths=LENGTHS, **OPTIONS)
    same = solve(MODEL, GPUS, seq_len=512, **OPTIONS)
    assert plan.inputs.seq_len == 512
    assert plan.decisions == same.decisions
    assert plan.estimate.memory.device_peak == same.estimate.memory.device_peak
    share = padded(LENGTHS, 1024, plan.decisions.micro_batch).useful_fraction
    assert f"{share:.1%} of computed tokens are real" in plan.advice[-1]
    assert any("the longest in the dataset lengths" in line for line in plan.inputs.assumed)


@pytest.mark.parametrize("packing", ["wrapped", "bfd"])
def test_packing_plans_full_rows_and_says_how_full_they_are(packing):
    plan = solve(MODEL, GPUS, seq_len=1024, dataset_lengths=LENGTHS, packing=packing, **OPTIONS)
    assert plan.inputs.seq_len == 1024
    batching = packed(LENGTHS, 1024, packing)
    assert f"{batching.useful_fraction:.1%} of computed tokens are real" in plan.advice[-1]
    assert f"{batching.sequences_per_row:.2f} sequences per row" in plan.advice[-1]


def test_cli_reads_the_lengths_file_and_refuses_packing_without_it(tmp_path):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps({str(n): c for n, c in LENGTHS.counts}))
    runner = CliRunner()
    ok = runner.invoke(app, ["solve", "--model", MODEL, "--gpus", GPUS, "--seq-len", "1024", "--global-batch",
                             "16", "--dataset-lengths", str(lengths), "--packing", "bfd", "--json"])
    assert ok.exit_code == 0, ok.output
    assert any("best-fit decreasing" in line for line in json.loads(ok.stdout)["advice"])
    refused = runner.invoke(app, ["solve", "--model", MODEL, "--gpus", GPUS, "--packing", "wrapped"])
    assert refused.exit_code == 2 and "needs --dataset-lengths" in refused.output
    lengths.write_text('{"512": -3}')
    bad = runner.invoke(app, ["solve", "--model", MODEL, "--gpus", GPUS, "--dataset-lengths", str(lengths)])
    assert bad.exit_code == 2 and "count -3" in bad.output
