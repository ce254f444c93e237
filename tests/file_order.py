"""The order the suite's files reach the xdist workers: the longest first (longest-processing-time scheduling), so
that no long file starts last and keeps one worker busy while the other idles. xdist's own order (most tests first)
put files of few but long tests (torchrun runs, cold lowerings) at the end.

The seconds per file come from a run of the suite (`file_seconds.json`, written by `FITPLAN_TEST_TIMES=PATH
./fitplan test`, then copied here); a file not listed counts as the median one. The figures only order the work: a
stale table slows the run, it never changes what runs.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import pytest

FILE_SECONDS = Path(__file__).with_name("file_seconds.json")


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load_seconds(path: Path = FILE_SECONDS) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def longest_first(items: list[pytest.Item], seconds: dict[str, float]) -> list[pytest.Item]:
    """`items` with whole files ordered by their seconds, longest first; within a file, the collected order."""
    default = statistics.median(seconds.values()) if seconds else 0.0
    first_seen = {}
    for index, item in enumerate(items):
        first_seen.setdefault(file_of(item.nodeid), index)
    return sorted(items, key=lambda item: (-seconds.get(file_of(item.nodeid), default),
                                           first_seen[file_of(item.nodeid)]))


class Timeline:
    """What each file took (every phase of its tests) and when each xdist worker finished its last test, as the
    controller sees the reports arrive."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.files: dict[str, float] = defaultdict(float)
        self.workers: dict[str, float] = {}

    def add(self, report: pytest.TestReport) -> None:
        self.files[file_of(report.nodeid)] += report.duration
        worker = getattr(getattr(report, "node", None), "gateway", None)
        if worker is not None:
            self.workers[worker.id] = time.perf_counter() - self.started

    def summary(self) -> str:
        ends = ", ".join(f"{worker} {seconds:.0f} s" for worker, seconds in sorted(self.workers.items()))
        return f"xdist workers finished after: {ends}" if ends else ""

    def write(self, path: Path) -> None:
        path.write_text(json.dumps({k: round(v, 1) for k, v in sorted(self.files.items())}, indent=0) + "\n")
