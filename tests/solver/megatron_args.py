"""Megatron-LM's own argument checks on emitted flags: its `parse_args`, `validate_args` and
`core_transformer_config_from_args` (megatron/training/arguments.py), run from a Megatron-LM source tree at the
tag of the installed megatron-core, since the megatron-core wheel leaves megatron/training out.

The source comes from $MEGATRON_LM_SOURCE: a Megatron-LM checkout, or its git directory (the tag
core_v<megatron-core version> is read from it); without it the checks skip. Only what validation does not read is
stood in:
- megatron/training/__init__.py (it imports the trainer, which needs Megatron-LM's RL and data packages): the
  package is opened without it, with the three names training/utils.py takes from it;
- `six`, which only the BERT tokenizer module imports;
- the CUDA device queries (this host has no GPU): they answer with the plan's GPU's compute capability;
- Transformer Engine, which Megatron-LM's default --transformer-impl runs on the GPU nodes and this host lacks:
  TransformerConfig's TE version checks answer as installed, and its fused RoPE kernel's presence is stood in.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tarfile
import types
from functools import cache
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest

SOURCE = "MEGATRON_LM_SOURCE"
H100 = (9, 0)  # compute capability of the plans' GPU
PACKAGES = ("megatron/training", "megatron/legacy")


def _tag() -> str:
    from importlib.metadata import version

    return f"core_v{version('megatron-core')}"


@cache
def _source_root(scratch: str) -> Path | None:
    """A folder holding megatron/training and megatron/legacy at the installed megatron-core's tag, or None."""
    given = os.environ.get(SOURCE)
    if not given:
        return None
    path = Path(given)
    if (path / "megatron" / "training" / "arguments.py").is_file():
        return path
    archive = subprocess.run(["git", "--git-dir", str(path), "archive", _tag(), *PACKAGES], capture_output=True,
                             check=False)
    if archive.returncode:
        pytest.fail(f"${SOURCE}={given} is neither a Megatron-LM checkout nor a git directory with tag {_tag()}: "
                    f"{archive.stderr.decode(errors='replace')[:300]}")
    root = Path(scratch) / _tag()
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(root, filter="data")
    return root


def available() -> bool:
    """Whether Megatron-LM's source is given ($MEGATRON_LM_SOURCE)."""
    return bool(os.environ.get(SOURCE))


def load(scratch: Path) -> types.ModuleType:
    """Megatron-LM's megatron.training.arguments module, or a skip naming how to provide it."""
    root = _source_root(str(scratch))
    if root is None:
        pytest.skip(f"Megatron-LM's megatron/training is not in the megatron-core wheel: set ${SOURCE} to a "
                    f"Megatron-LM checkout at {_tag()} or its git directory")
    if "megatron.training.arguments" in sys.modules:
        return sys.modules["megatron.training.arguments"]
    import megatron

    training = str(root / "megatron" / "training")
    if str(root / "megatron") not in megatron.__path__:
        sys.path.append(str(root))  # after site-packages: megatron.core stays the installed one
    sys.modules.setdefault("six", types.ModuleType("six"))
    package = types.ModuleType("megatron.training")
    package.__path__ = [training]
    sys.modules["megatron.training"] = package
    global_vars = importlib.import_module("megatron.training.global_vars")
    for name in ("get_args", "get_timers", "get_adlr_autoresume"):
        setattr(package, name, getattr(global_vars, name))
    return importlib.import_module("megatron.training.arguments")


def validate(scratch: Path, arguments: list[str], *, world: int, capability: tuple[int, int], env: dict[str, str],
             monkeypatch) -> Any:
    """Megatron-LM's parsed and validated arguments for `arguments` as rank 0 of `world` processes, with the
    launch script's environment `env`, and the TransformerConfig it builds from them."""
    module = load(scratch)
    import megatron.core.models.common.embeddings.rope_utils as rope_utils
    import megatron.core.transformer.transformer_config as transformer_config
    import torch

    monkeypatch.setattr(transformer_config, "is_te_min_version", lambda version, check_equality=True: True)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", object())
    monkeypatch.setattr(module, "get_device_arch_version", lambda: capability[0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *arguments])
    args = module.parse_args()
    module.validate_args(args, {})
    return args, module.core_transformer_config_from_args(args)


def megatron_stage_layers(config: Any, pp: int, v: int) -> tuple[int, ...]:
    """Decoder layers megatron-core builds for each global stage (stage s = chunk s // pp of rank s mod pp)."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        return tuple(layout.layout[s % pp][s // pp].count(LayerType.decoder) for s in range(pp * v))
    return tuple(get_num_layers_to_build(config, vp_stage=s // pp if v > 1 else None, pp_rank=s % pp)
                 for s in range(pp * v))
