"""Collective microbenchmarks for `fitplan measure`: all-reduce, all-gather and reduce-scatter across the local
devices, one process per device (NCCL on GPUs, gloo on CPU), each at a few sizes with warm-up and repeats."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from costmodels.profile import CollectivePoint, Timing
from graphs import FitplanError

OPS = ("all_reduce", "all_gather", "reduce_scatter")
# Generous for a few sizes even on 2 shared cores; a hung collective fails the run instead of hanging it.
LAUNCH_TIMEOUT = 300


def measure_collectives(*, device: str, ranks: int, sizes: tuple[int, ...], warmup: int,
                        repeats: int) -> list[CollectivePoint]:
    """Each op at each size (bytes of the full buffer) on `ranks` processes; the slowest rank's median counts."""
    sizes = tuple(4 * max(ranks, size // 4 // ranks * ranks) for size in sizes)  # whole fp32 elements per rank
    with tempfile.TemporaryDirectory(prefix="fitplan-collectives-") as folder:
        spec = Path(folder, "spec.json")
        spec.write_text(json.dumps({"device": device, "ranks": ranks, "sizes": list(sizes), "warmup": warmup,
                                    "repeats": repeats, "store": os.path.join(folder, "store")}))
        _launch(spec, ranks)
        per_rank = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(ranks)]
    return [_point(op, ranks, size, [rank[f"{op}:{size}"] for rank in per_rank]) for op in OPS for size in sizes]


def _launch(spec: Path, ranks: int) -> None:
    """Run this module as `ranks` worker processes (a fresh interpreter each, whatever the caller's main module)."""
    # One thread per rank: the ranks share the host's cores (on CPU they are the devices).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "solver.hardware.measure_collectives", str(spec), str(rank)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(ranks)]
    logs = []
    try:
        logs = [proc.communicate(timeout=LAUNCH_TIMEOUT)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [(rank, log[-1500:]) for rank, (proc, log) in enumerate(zip(procs, logs, strict=False))
              if proc.returncode != 0]
    if failed or len(logs) < ranks:
        raise FitplanError(f"The collective benchmark failed on rank {failed[0][0] if failed else '?'}: "
                           f"{failed[0][1] if failed else 'timed out'}",
                           "Check that the devices are free and torch.distributed works here.")


def _point(op: str, ranks: int, size: int, seconds: list[list[float]]) -> CollectivePoint:
    """The point for one (op, size): per repeat, the slowest rank finishes the collective."""
    slowest = [max(times) for times in zip(*seconds, strict=True)]
    median = statistics.median(slowest)
    return CollectivePoint(op=op, ranks=ranks, nbytes=size, time=Timing(
        median=median, spread=(max(slowest) - min(slowest)) / median if median else 0.0, repeats=len(slowest)))


def _worker(spec_path: str, rank: int) -> None:
    """One rank: time every op and size; writes `rank{rank}.json` of seconds per repeat beside the spec."""
    import torch
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())

    cuda = spec["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{spec['store']}", rank=rank,
                            world_size=spec["ranks"], timeout=timedelta(seconds=120))
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    results: dict[str, list[float]] = {}
    try:
        for op in OPS:
            for size in spec["sizes"]:
                results[f"{op}:{size}"] = _times(_call(op, size, spec["ranks"], device), spec, cuda)
    finally:
        dist.destroy_process_group()
    Path(spec_path).parent.joinpath(f"rank{rank}.json").write_text(json.dumps(results))


def _call(op: str, size: int, ranks: int, device: object) -> Callable[[], object]:
    """A closure running `op` once on a `size`-byte full buffer of fp32 elements."""
    import torch
    import torch.distributed as dist

    elements = size // 4
    full = torch.ones(elements, device=device)
    part = torch.ones(elements // ranks, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    calls = {"all_reduce": lambda: dist.all_reduce(full), "all_gather": lambda: gather(full, part),
             "reduce_scatter": lambda: scatter(part, full)}
    return calls[op]


def _times(call: Callable[[], object], spec: dict, cuda: bool) -> list[float]:
    """Seconds of each timed repeat after `warmup` untimed calls; a barrier lines the ranks up first."""
    import torch
    import torch.distributed as dist

    for _ in range(spec["warmup"]):
        call()
    times = []
    for _ in range(spec["repeats"]):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        call()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return times


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]))
