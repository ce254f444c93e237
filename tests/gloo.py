"""Run a test module as `world` gloo worker processes (one per rank) and collect each rank's JSON record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_ranks(module: str, args: list[str], *, world: int, folder: Path, timeout: float,
              env: dict[str, str] | None = None) -> list[dict]:
    """`python -m module *args rank` for every rank (all killed after `timeout` seconds); each writes
    `folder/rank{rank}.json`, returned in rank order. A failed rank raises with the tail of its log."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [subprocess.Popen([sys.executable, "-m", module, *args, str(rank)], cwd=REPO, env=environment,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(world)]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [(rank, proc.returncode, log[-3000:]) for rank, (proc, log) in enumerate(zip(procs, logs, strict=True))
              if proc.returncode != 0]
    if failed:
        raise RuntimeError(f"gloo workers failed: {failed}")
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(world)]
