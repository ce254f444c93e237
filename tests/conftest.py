"""Suite-wide guards."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.file_order import Timeline

# The suite searches without torch.compile unless a test is about it (`compile_search`): an unpinned search then lowers
# no compiled variant, which halves the cold lowering a test pays (solver/search/pin_rules.AUTO_COMPILE_SETTING).
# Lowerings run in the test's own process: the xdist workers already fill the cores (graphs/variant.lowering_workers).
os.environ.setdefault("FITPLAN_AUTO_COMPILE", "off")
os.environ.setdefault("FITPLAN_LOWERING_WORKERS", "1")
_SEEDED = pytest.StashKey[str]()
_timeline: Timeline | None = None  # the controller's (pytest_configure)


def pytest_configure(config: pytest.Config) -> None:
    """Seed the run's lowering cache from the suite's store once, in the controller, before any xdist worker starts
    (tests/lowering_store.py): a stale store seeds nothing and the run lowers afresh."""
    if hasattr(config, "workerinput"):
        return
    from graphs.cache import cache_dir
    from tests.lowering_store import REFRESH, STORE, seed

    global _timeline
    from tests.file_order import Timeline

    _timeline = Timeline()
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # the files' order is `pytest_collection_modifyitems`'s
    written = seed(cache_dir())
    config.stash[_SEEDED] = (f"lowering store: {written} lowerings seeded into {cache_dir()}" if written is not None
                             else f"lowering store {STORE.name} is stale (graphs/ or a lowering library changed), "
                                  f"so this run lowers afresh; after a cold run refresh it: {REFRESH}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (tests/file_order.py); every worker sorts alike, as xdist requires."""
    from tests.file_order import load_seconds, longest_first

    items[:] = longest_first(items, load_seconds())


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _timeline is not None:
        _timeline.add(report)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if _SEEDED in config.stash:
        terminalreporter.write_line(config.stash[_SEEDED])
    if _timeline is not None:
        if summary := _timeline.summary():
            terminalreporter.write_line(summary)
        if target := os.environ.get("FITPLAN_TEST_TIMES"):
            _timeline.write(Path(target))

# Native threads of a gloo process group's context (`comm` names as Linux shows them). A group that stays
# referenced after `destroy_process_group` keeps them polling: megatron-core's groups did, thousands per xdist
# worker, until the CPU spent its time in the kernel and the suite ran twice as long (graphs/megatron.cpu_runtime).
GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")


def gloo_threads() -> int:
    """Live gloo threads of this process (0 where /proc is not there to ask)."""
    count = 0
    for task in Path("/proc/self/task").glob("*/comm"):
        try:
            name = task.read_text().strip()
        except OSError:  # the thread ended while listed
            continue
        count += name.startswith(GLOO_THREADS)
    return count


@pytest.fixture(autouse=True, scope="module")
def no_leaked_gloo_groups() -> Iterator[None]:
    """Fail a test module that leaves gloo process groups alive in the pytest process."""
    before = gloo_threads()
    yield
    left = gloo_threads() - before
    if left > 0:
        pytest.fail(f"this module left {left} gloo threads running: a process group it created is still "
                    "referenced after destroy_process_group (run world-size-1 code on the 'fake' backend, or "
                    "start ranks as tests/gloo.py does)", pytrace=False)


@pytest.fixture(autouse=True, scope="module")
def no_leaked_deepspeed_config() -> Iterator[None]:
    """Forget, after each module, a ZeRO-3 `TrainingArguments` the module left alive: transformers keeps it as a
    process-wide weak reference and then builds every model under `deepspeed.zero.Init` with that config's batch
    sizes, so a later module's plain `from_config` failed DeepSpeed's batch assertion (an order-dependent failure)."""
    yield
    if (deepspeed := sys.modules.get("transformers.integrations.deepspeed")) is not None:
        deepspeed.unset_hf_deepspeed_config()


@pytest.fixture(autouse=True, scope="module")
def compile_search_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """A module marked `compile_search` (its module-scoped fixtures included) sees the product's default: an unpinned
    --compile is searched."""
    with pytest.MonkeyPatch.context() as patch:
        if request.node.get_closest_marker("compile_search") is not None:
            patch.setenv("FITPLAN_AUTO_COMPILE", "search")
        yield


@pytest.fixture(autouse=True)
def compile_search(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """One test marked `compile_search` sees the product's default (`compile_search_module`)."""
    if request.node.get_closest_marker("compile_search") is not None:
        monkeypatch.setenv("FITPLAN_AUTO_COMPILE", "search")
