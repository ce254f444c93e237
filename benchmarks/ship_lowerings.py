"""Write the lowerings fitplan ships (graphs/shipped/): every variant the default searches of the catalog's most used
models lower, and those the published recipes of examples/recipes/ lower, under the library versions installed here
(their cache keys hold those versions).

Run from the repository root: `python benchmarks/ship_lowerings.py` (several minutes: each variant is traced on fake
tensors). The searches run against an empty cache, so what they lower is exactly what they need; each entry is
then copied, compressed, into graphs/shipped/ under its cache key. Old shipped entries are removed first.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# The catalog's most used models (issue: "Llama 3.x 1B/8B/70B, Qwen2.5 7B, Mistral 7B").
MODELS = ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", "Qwen/Qwen2.5-7B",
          "mistralai/Mistral-7B-v0.1")
# The clusters of the default searches: the README's, and the most common node type; LoRA on one GPU.
SEARCHES = (("8xA100", {}), ("8xH100", {}), ("1xA100", {"lora_rank": 16}))


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="fitplan-ship-") as folder:
        os.environ["FITPLAN_CACHE_DIR"] = folder
        from graphs import LoraSpec
        from graphs.cache import load_cached, ship, shipped_dir
        from solver import Infeasible, solve

        for old in shipped_dir().glob("*.json.gz"):
            old.unlink()
        for model in MODELS:
            for gpus, options in SEARCHES:
                started = time.perf_counter()
                lora = LoraSpec(rank=options["lora_rank"]) if "lora_rank" in options else None
                with contextlib.suppress(Infeasible):  # the lowerings were made before the search: they are shipped
                    solve(model, gpus, lora=lora, time_limit=30)
                print(f"{model} on {gpus}{' LoRA' if lora else ''}: {time.perf_counter() - started:.0f} s",
                      file=sys.stderr)
        # The published recipes' jobs (examples/recipes/, tests/solver/test_recipes.py): their variants too, so that
        # their test reads shipped lowerings.
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks/
        from benchmarks.recipes import plan, recipe_estimate, recipes

        for recipe in recipes():
            started = time.perf_counter()
            with contextlib.suppress(Infeasible):
                plan(recipe)
                recipe_estimate(recipe)
            print(f"recipe {recipe.name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        written = 0
        for entry in sorted(Path(folder, "lower").glob("*.json")):
            graph = load_cached(entry.stem)
            if graph is not None:
                ship(entry.stem, graph)
                written += 1
        size = sum(path.stat().st_size for path in shipped_dir().glob("*.json.gz"))
        print(json.dumps({"entries": written, "bytes": size}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
