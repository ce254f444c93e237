"""Launch gloo ranks on CPU as the tests need them: a test module as `world` worker processes (`run_ranks`), or an
emitted training script as torchrun starts it (`torchrun`).

The ranks are forked from one server process per test worker that has already imported torch, transformers and
fitplan (`multiprocessing`'s forkserver with those modules preloaded), as a PyTorch DataLoader forks its workers: a
fresh interpreter per rank spent ~4.5 s of a 2-core machine's CPU importing them, and `python -m
torch.distributed.run` ~2.4 s more for its agent, in every launch. Each rank then starts as torchrun starts a worker:
its own environment (torchrun's rank variables, the caller's environment, `OMP_NUM_THREADS=1`), working directory,
`sys.argv`, the script run as `__main__`, stdout and stderr in a log file; one rank failing stops the others, as
torchrun's agent does. tests/solver/test_end_to_end.py still launches through the real torchrun and accelerate."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.process
import os
import runpy
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# gloo ranks sometimes abort while tearing down (a joinable std::thread destroyed: SIGABRT with this line) on a
# loaded machine, after or during destroy_process_group. The records are deterministic, so a launch whose every
# failed rank died that way is run once more from a fresh rendezvous.
TEARDOWN_ABORT = "terminate called without an active exception"
# What the server imports once (a module that fails to import is skipped by multiprocessing).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch.distributed.pipelining", "torch.utils.checkpoint", "transformers",
           "transformers.models.llama.modeling_llama", "graphs", "costmodels", "tests.gloo"]


@dataclass(frozen=True)
class Finished:
    """A launch's outcome as `subprocess.run` reports one: the first failed rank's exit code (else 0; -9: stopped)
    and every rank's log, rank 0 first."""
    returncode: int
    stdout: str
    stderr: str = ""


@dataclass(frozen=True)
class Ended:
    """One rank's end: its exit code (None: stopped after another failed or at the timeout) and its log."""
    rank: int
    code: int | None
    log: str


def run_ranks(module: str, args: list[str], *, world: int, folder: Path, timeout: float,
              env: dict[str, str] | None = None) -> list[dict]:
    """`python -m module *args rank` for every rank (all stopped after `timeout` seconds); each writes
    `folder/rank{rank}.json`, returned in rank order. A failed rank raises with the tail of its log; a teardown
    abort (`TEARDOWN_ABORT`) is relaunched once. The rendezvous file store must live under `folder` as `store*`."""
    for attempt in range(2):
        failed = [end for end in launch(("module", module), [[*args, str(rank)] for rank in range(world)],
                                        [env or {}] * world, cwd=REPO, timeout=timeout) if end.code != 0]
        if not (failed and all(TEARDOWN_ABORT in end.log for end in failed)) or attempt:
            break
        for stale in [*folder.glob("store*"), *folder.glob("rank*.json")]:
            stale.unlink()
    if failed:
        raise RuntimeError(f"gloo workers failed: {[(end.rank, end.code, end.log[-3000:]) for end in failed]}")
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(world)]


def torchrun(script: Path, *args: str, ranks: int, timeout: float = 240, env: dict[str, str] | None = None,
             cwd: Path | None = None) -> Finished:
    """`torchrun --standalone --nproc_per_node ranks script *args`: every rank gets the variables torchrun's agent
    sets (rank, world, a free local rendezvous port) and runs `script` as `__main__`. A teardown abort, or a
    rendezvous port taken meanwhile, is launched once more."""
    for attempt in range(2):
        port = free_port()
        ended = launch(("script", str(script)), [list(args)] * ranks,
                       [{**(env or {}), **torchrun_variables(rank, ranks, port)} for rank in range(ranks)],
                       cwd=cwd or Path.cwd(), timeout=timeout)
        failed = [end for end in ended if end.code != 0]
        if not (failed and all(TEARDOWN_ABORT in end.log or "Address already in use" in end.log
                               for end in failed)) or attempt:
            break
    code = failed[0].code if failed else 0
    return Finished(-9 if code is None else code, "".join(end.log for end in ended))


def torchrun_variables(rank: int, world: int, port: int) -> dict[str, str]:
    """The environment torchrun's agent gives worker `rank` of a single-node, `--standalone` job."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
            "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
            "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(target: tuple[str, str], argv: list[list[str]], envs: list[dict[str, str]], *, cwd: Path,
           timeout: float) -> list[Ended]:
    """Start rank i as `target` ("script" or "module", its path or name) with `argv[i]` and the caller's environment
    updated with `envs[i]`; wait for every rank (`_wait`)."""
    context = _context()
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs_dir:
        logs = [Path(logs_dir) / f"rank{rank}.log" for rank in range(len(argv))]
        procs = [context.Process(target=_rank_main, args=(target, argv[rank], {**environment, **envs[rank]},
                                                          str(cwd), str(logs[rank])))
                 for rank in range(len(argv))]
        for proc in procs:
            proc.start()
        stopped = _wait(procs, timeout)
        return [Ended(rank, None if rank in stopped else proc.exitcode, logs[rank].read_text(errors="replace"))
                for rank, proc in enumerate(procs)]


def _wait(procs: list[multiprocessing.process.BaseProcess], timeout: float) -> set[int]:
    """Until every rank has ended; after one fails, or at the timeout, the others are stopped (their ranks
    returned)."""
    deadline = time.monotonic() + timeout
    running = dict(enumerate(procs))
    while running:
        left = deadline - time.monotonic()
        ended = multiprocessing.connection.wait([p.sentinel for p in running.values()], timeout=max(0.0, left))
        running = {rank: p for rank, p in running.items() if p.sentinel not in ended}
        for proc in procs:
            proc.join(0)
        if left <= 0 or any(p.exitcode not in (None, 0) for p in procs):
            break
    for proc in running.values():
        proc.kill()
    for proc in procs:
        proc.join()
    return set(running)


def _context() -> multiprocessing.context.ForkServerContext:
    """The forkserver context, its server started (once per test worker) with the ranks' thread count."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # read by the libraries the server imports
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if threads is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = threads
    return context


def _rank_main(target: tuple[str, str], argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """One rank, in a process forked from the server: as a fresh `python script` or `python -m module` would."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    kind, name = target
    sys.argv = [name, *argv]
    if kind == "script":
        sys.path.insert(0, str(Path(name).parent))
        runpy.run_path(name, run_name="__main__")
    else:
        runpy.run_module(name, run_name="__main__", alter_sys=True)
