"""FITPLAN_AUTO_COMPILE (solver/search/pin_rules.auto_compile): "off" pins an unpinned --compile off and says so in
the plan's assumptions; a user's own pin, and the default "search", leave the pins as given; any other value is bad
input. FITPLAN_LOWERING_WORKERS (graphs/variant.lowering_workers) sets how many processes lower at once."""

from __future__ import annotations

import os

import pytest

from graphs import FitplanError
from graphs.variant import lowering_workers
from solver.search.pin_rules import AUTO_COMPILE_SETTING, prepared
from solver.search.pins import Pins


def test_off_pins_an_unpinned_compile_off_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AUTO_COMPILE_SETTING, "off")
    pins, notes = prepared(Pins.of(engine="fsdp2"), allow_savers=False, lora=None)
    assert pins.allowed("compile") == (False,)
    assert pins.value("engine") is not None  # the caller's pins kept
    assert any(AUTO_COMPILE_SETTING in note for note in notes)


@pytest.mark.parametrize("setting", ["off", "search", None])
def test_a_users_compile_pin_is_kept(monkeypatch: pytest.MonkeyPatch, setting: str | None) -> None:
    if setting is None:
        monkeypatch.delenv(AUTO_COMPILE_SETTING, raising=False)
    else:
        monkeypatch.setenv(AUTO_COMPILE_SETTING, setting)
    pins, notes = prepared(Pins.of(compile="on"), allow_savers=False, lora=None)
    assert pins.allowed("compile") == (True,)
    assert not any(AUTO_COMPILE_SETTING in note for note in notes)


@pytest.mark.parametrize("setting", ["search", None])
def test_search_leaves_compile_to_the_solver(monkeypatch: pytest.MonkeyPatch, setting: str | None) -> None:
    if setting is None:
        monkeypatch.delenv(AUTO_COMPILE_SETTING, raising=False)
    else:
        monkeypatch.setenv(AUTO_COMPILE_SETTING, setting)
    pins, _ = prepared(Pins.of(), allow_savers=False, lora=None)
    assert pins.allowed("compile") is None


def test_another_value_is_refused_with_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AUTO_COMPILE_SETTING, "no")
    with pytest.raises(FitplanError, match="neither 'search' nor 'off'"):
        prepared(Pins.of(), allow_savers=False, lora=None)


@pytest.mark.parametrize(("setting", "expected"), [("1", 1), ("3", 3), ("0", None), ("many", None), ("", None)])
def test_lowering_workers_setting(monkeypatch: pytest.MonkeyPatch, setting: str, expected: int | None) -> None:
    monkeypatch.setenv("FITPLAN_LOWERING_WORKERS", setting)
    assert lowering_workers() == (expected or os.cpu_count() or 1)
