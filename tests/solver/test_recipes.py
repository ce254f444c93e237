"""Published training recipes (examples/recipes/, issue 35): each is solved as the job it describes, and the plan is
at least as fast as the recipe's own configuration priced by the same cost model (`solver.estimate` with the recipe's
knobs pinned, on the lowering its launcher runs); every file the plan's launcher emits is read back by that
runtime's own parser (the readers of test_launcher_matrix.py and test_torchtitan_launcher.py, plus bash, PEFT and
transformers for the files beside them).

Only configurations are read from the recipes' sources: no published throughput or memory figure is compared.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from benchmarks.recipes import RECIPES, Recipe, load, plan, recipe_config, recipe_estimate, recipes
from graphs import FitplanError
from graphs.catalog import catalog_ids
from solver.plan.capability import LAUNCHERS
from solver.plan.launchers import emit
from solver.plan.record import Plan
from solver.search.risk import RISK_WORTH
from solver.search.tables import TICK_SECONDS
from tests.solver import test_launcher_matrix as matrix
from tests.solver.test_launchers import write
from tests.solver.test_torchtitan_launcher import parse  # noqa: F401  (the fixture torchtitan's check needs)

ALL = recipes()
NAMES = [r.name for r in ALL]
# A commit-pinned source: the configuration read is the one at that commit.
PINNED = re.compile(r"https://github\.com/[\w.-]+/[\w.-]+/blob/[0-9a-f]{40}/\S+")


def test_at_least_ten_recipes_each_a_catalog_model_with_a_commit_pinned_source():
    assert len(ALL) >= 10
    catalog = set(catalog_ids())
    for recipe in ALL:
        assert recipe.model in catalog, recipe.name
        assert PINNED.fullmatch(recipe.source), recipe.source
        assert recipe.launcher in LAUNCHERS, recipe.name
        assert set(recipe.fixed) <= set(recipe.recipe), recipe.name  # what it fixes, it also configures
    # the set spans the methods and the runtimes the issue names
    assert {r.method for r in ALL} == {"full", "lora", "qlora"}
    assert {"torchtitan", "torchrun", "accelerate", "megatron", "axolotl"} <= {r.launcher for r in ALL}


def test_a_recipe_file_without_its_source_is_refused(tmp_path):
    values = json.loads((RECIPES / f"{NAMES[0]}.json").read_text())
    del values["source"]
    path = tmp_path / f"{NAMES[0]}.json"
    path.write_text(json.dumps(values))
    with pytest.raises(ValueError, match="source"):
        load(path)


@pytest.fixture(scope="module")
def solved() -> dict[str, tuple[Recipe, Plan, Any]]:
    """Each recipe's plan and the estimate of its own configuration, computed once per module on first use."""

    class Lazy(dict):
        def __missing__(self, name: str) -> tuple[Recipe, Plan, Any]:
            recipe = next(r for r in ALL if r.name == name)
            self[name] = (recipe, plan(recipe, time_limit=30), recipe_estimate(recipe))
            return self[name]

    return Lazy()


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_plan_is_at_least_as_fast_as_the_recipe_under_the_same_cost_model(name, solved):
    recipe, found, own = solved[name]
    d = found.decisions
    assert recipe.launcher in found.launchers
    # what the recipe fixes, the plan keeps
    for knob, value in recipe.fixed.items():
        got = getattr(d, knob)
        assert (got.value if hasattr(got, "value") else got) in (value if isinstance(value, list) else [value]), knob
    assert found.inputs.seq_len == recipe.seq_len and found.inputs.global_batch == recipe.global_batch
    assert d.micro_batch * d.grad_accum * d.dp == recipe.global_batch
    assert (d.lora is None) == (recipe.method == "full")
    # the recipe's configuration is a point of the plan's space (its dp, its global batch), priced the same way
    config = recipe_config(recipe)
    assert config["micro_batch"] * config["grad_accum"] * config["dp"] == recipe.global_batch
    # the search's integer ticks round each layer's time: the fresh estimate may differ by a tick per layer; a plan
    # that traded speed for the estimate's error (solver/search/risk.py) may be up to RISK_WORTH slower
    slack = TICK_SECONDS * (len(d.checkpoint) + 2)
    traded = any(n.startswith("memory risk:") and "keeps that error free" in n for n in found.inputs.assumed)
    assert found.estimate.time.step_time <= own.time.step_time * (1 + RISK_WORTH * traded) + slack, (
        f"{name}: plan {found.estimate.time.step_time:.4f} s ({d.summary()}) slower than the recipe's "
        f"{own.time.step_time:.4f} s")


def parse_with_runtime(launcher: str, found: Plan, files: dict[str, str], folder: Path, monkeypatch,
                       parse) -> None:  # noqa: F811
    """The launcher's main files through its runtime's parser, every decided value checked."""
    cluster = found.inputs.cluster
    if launcher == "torchtitan":
        config = parse(write(files, folder))
        par, train = config.parallelism, config.training
        d = found.decisions
        # under a pipeline, a step's micro-batches are torchtitan's local batch split in microbatch-size pieces
        local = d.micro_batch * (d.grad_accum if d.pp > 1 else 1)
        assert (par.tensor_parallel_degree, train.local_batch_size, train.seq_len) == (d.tp, local,
                                                                                     found.inputs.seq_len)
        assert d.pp == 1 or (par.pipeline_parallel_degree, par.pipeline_parallel_microbatch_size) == (d.pp,
                                                                                                   d.micro_batch)
        assert train.global_batch_size == found.inputs.global_batch
        assert config.compile.enable is d.compile
        return
    # the launcher-matrix readers were written for its 8-GPU, 16-layer plan: here each recipe's own world
    monkeypatch.setattr(matrix, "WORLD", cluster.nodes * cluster.gpus_per_node)
    monkeypatch.setattr(matrix, "LAYERS", len(found.decisions.checkpoint))
    matrix.check_expressed(launcher, found, matrix.READERS[launcher](found, files, folder, monkeypatch))


def parse_companions(found: Plan, files: dict[str, str], folder: Path) -> None:
    """The files beside the main ones: launch scripts through bash, Python through the compiler, PEFT's and
    transformers' configs through their own loaders."""
    write(files, folder)
    for name, text in files.items():
        if name.endswith(".sh"):
            subprocess.run(["bash", "-n", str(folder / name)], check=True)
        elif name.endswith(".py"):
            compile(text, name, "exec")
        elif name.endswith(".json"):
            json.loads(text)
    if "adapter_config.json" in files:
        from peft import LoraConfig

        adapter = LoraConfig.from_pretrained(str(folder))
        assert adapter.r == found.decisions.lora.rank
    if "quantization_config.json" in files:
        from transformers import BitsAndBytesConfig

        quantized = BitsAndBytesConfig.from_dict(json.loads(files["quantization_config.json"]))
        assert quantized.load_in_4bit and quantized.bnb_4bit_quant_type == found.decisions.lora.quantization


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_every_file_the_plan_emits_parses_in_its_runtimes_own_parser(name, solved, tmp_path, monkeypatch,
                                                                      parse):  # noqa: F811
    from accelerate.state import AcceleratorState

    recipe, found, _ = solved[name]
    files = emit(found, recipe.launcher)
    assert files
    with monkeypatch.context() as patch:
        parse_with_runtime(recipe.launcher, found, files, tmp_path / "main", patch, parse)
    AcceleratorState._reset_state(reset_partial_state=True)
    parse_companions(found, files, tmp_path / "all")


def test_recipe_estimate_refuses_a_launcher_that_cannot_run_the_recipe():
    recipe = next(r for r in ALL if r.launcher == "axolotl")
    wrong = Recipe(**{**{f: getattr(recipe, f) for f in Recipe.__slots__},
                      "recipe": {**recipe.recipe, "precision": "bf16-mixed"}})
    with pytest.raises(FitplanError, match="axolotl"):
        recipe_estimate(wrong)
