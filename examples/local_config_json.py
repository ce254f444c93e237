"""Plan a model from a local config.json (no download, no catalog entry): a small Llama-shaped model."""

import json
import tempfile
from pathlib import Path

from solver import solve

config = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
          "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048}
folder = Path(tempfile.mkdtemp()) / "my-model"
folder.mkdir()
(folder / "config.json").write_text(json.dumps(config))
plan = solve(str(folder), "1xL4", seq_len=2048, global_batch=16)
print(plan.inputs.model_source, plan.decisions.summary())
