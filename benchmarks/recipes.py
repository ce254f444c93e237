"""Published training recipes (examples/recipes/*.json) against fitplan's plans for the same job: each recipe's own
configuration is priced pinned (`solver.estimate`), and `solve` plans the job with only what the recipe fixes that is
not the planner's choice (model, GPUs, sequence, batch, method, launcher, precision and optimizer where they change
the training). Prints one row per recipe: the recipe's step, the plan's, and whether the recipe fits.

Run from the repository root: `python benchmarks/recipes.py` (configurations only: no published throughput or
memory figure is read or compared).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "recipes"
METHODS = ("full", "lora", "qlora")


@dataclass(frozen=True, slots=True, kw_only=True)
class Recipe:
    """One published recipe as an input: the job, what it fixes, and its own configuration."""
    name: str
    """The file's stem."""
    source: str
    """Where the configuration was read (a commit-pinned URL)."""
    model: str
    """A catalog model."""
    gpus: str
    """A cluster string."""
    seq_len: int
    global_batch: int
    method: str
    """full, lora or qlora."""
    launcher: str
    """The fitplan launcher that runs what the recipe's runtime runs."""
    lora: dict[str, Any] | None
    """`graphs.LoraSpec` keywords for LoRA and QLoRA."""
    fixed: dict[str, Any]
    """Knobs the recipe fixes that are not the planner's choice (they change the training)."""
    recipe: dict[str, Any]
    """The recipe's own configuration, knob by knob (dp is the rest of the GPUs)."""


def load(path: Path) -> Recipe:
    """A recipe file, checked for the fields every recipe states (ValueError names what is missing)."""
    values = json.loads(path.read_text())
    missing = [k for k in ("source", "model", "gpus", "seq_len", "global_batch", "method", "launcher", "fixed",
                           "recipe", "read", "assumed") if k not in values]
    if missing or values.get("method") not in METHODS or values.get("name") != path.stem:
        raise ValueError(f"{path.name}: missing {missing}, method {values.get('method')!r} or name != file stem")
    if (values["method"] == "full") != (values.get("lora") is None):
        raise ValueError(f"{path.name}: LoRA settings go with method lora/qlora only")
    return Recipe(name=values["name"], source=values["source"], model=values["model"], gpus=values["gpus"],
                  seq_len=values["seq_len"], global_batch=values["global_batch"], method=values["method"],
                  launcher=values["launcher"], lora=values.get("lora"), fixed=values["fixed"],
                  recipe=values["recipe"])


def recipes() -> list[Recipe]:
    return [load(path) for path in sorted(RECIPES.glob("*.json"))]


def lora_spec(recipe: Recipe) -> Any:
    from graphs import LoraSpec

    if recipe.lora is None:
        return None
    values = dict(recipe.lora)
    if "targets" in values:
        values["targets"] = tuple(values["targets"])
    return LoraSpec(**values)


def recipe_config(recipe: Recipe) -> dict[str, Any]:
    """The recipe's configuration with dp as the GPUs left after tp, cp and pp."""
    from solver.api import cluster_from

    cluster = cluster_from(recipe.gpus)
    values = dict(recipe.recipe)
    model_parallel = values.get("tp", 1) * values.get("cp", 1) * values.get("pp", 1)
    values["dp"] = cluster.nodes * cluster.gpus_per_node // model_parallel
    return values


def recipe_estimate(recipe: Recipe) -> Any:
    """fitplan's estimate of the recipe's own configuration, priced on the lowering its launcher runs."""
    from solver import estimate

    return estimate(recipe.model, recipe.gpus, recipe_config(recipe), seq_len=recipe.seq_len,
                    global_batch=recipe.global_batch, lora=lora_spec(recipe), launcher=recipe.launcher)


def plan(recipe: Recipe, *, time_limit: float = 30) -> Any:
    """fitplan's plan for the recipe's job: its launcher, method and fixed knobs pinned, the rest searched
    (memory savers that keep the training allowed)."""
    from solver import solve

    return solve(recipe.model, recipe.gpus, seq_len=recipe.seq_len, global_batch=recipe.global_batch,
                 lora=lora_spec(recipe), launcher=recipe.launcher, allow_savers=True, time_limit=time_limit,
                 deterministic=True, **recipe.fixed)


def main() -> int:
    from costmodels.verdict import fits

    print(f"{'recipe':44} {'recipe step s':>13} {'fits':>5} {'plan step s':>11} {'speed-up':>8}  plan")
    for recipe in recipes():
        mine = recipe_estimate(recipe)
        ours = plan(recipe)
        verdict = fits(mine.memory, _cluster(recipe))
        print(f"{recipe.name:44} {mine.time.step_time:13.3f} {'yes' if verdict.fits else 'no':>5} "
              f"{ours.estimate.time.step_time:11.3f} {mine.time.step_time / ours.estimate.time.step_time:7.2f}x  "
              f"{ours.decisions.summary()}")
    return 0


def _cluster(recipe: Recipe) -> Any:
    from solver.api import cluster_from

    return cluster_from(recipe.gpus)


if __name__ == "__main__":
    sys.exit(main())
