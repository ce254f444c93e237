"""Run a test module as `world` gloo worker processes (one per rank) and collect each rank's JSON record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# gloo ranks sometimes abort while tearing down (a joinable std::thread destroyed: SIGABRT with this line) on a
# loaded machine, after or during destroy_process_group. The records are deterministic, so a launch whose every
# failed rank died that way is run once more from a fresh rendezvous.
TEARDOWN_ABORT = "terminate called without an active exception"


def run_ranks(module: str, args: list[str], *, world: int, folder: Path, timeout: float,
              env: dict[str, str] | None = None) -> list[dict]:
    """`python -m module *args rank` for every rank (all killed after `timeout` seconds); each writes
    `folder/rank{rank}.json`, returned in rank order. A failed rank raises with the tail of its log; a teardown
    abort (`TEARDOWN_ABORT`) is relaunched once. The rendezvous file store must live under `folder` as `store*`."""
    for attempt in range(2):
        failed = _launch(module, args, world=world, timeout=timeout, env=env)
        teardown_only = failed and all(TEARDOWN_ABORT in log for _, _, log in failed)
        if not teardown_only or attempt:
            break
        for stale in [*folder.glob("store*"), *folder.glob("rank*.json")]:
            stale.unlink()
    if failed:
        raise RuntimeError(f"gloo workers failed: {failed}")
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(world)]


def _launch(module: str, args: list[str], *, world: int, timeout: float,
            env: dict[str, str] | None) -> list[tuple[int, int | None, str]]:
    """(rank, exit code, log tail) of every rank that failed."""
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
    return [(rank, proc.returncode, log[-3000:]) for rank, (proc, log) in enumerate(zip(procs, logs, strict=True))
            if proc.returncode != 0]
