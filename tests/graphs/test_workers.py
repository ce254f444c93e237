"""Worker processes start only where a spawned worker would not re-run the caller's script (graphs/workers.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ASK = "from graphs.workers import main_is_guarded; print(main_is_guarded())"


def answer(args: list[str], cwd: Path) -> str:
    done = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, check=True,
                          env={"PYTHONPATH": str(ROOT)})
    return done.stdout.strip()


@pytest.mark.parametrize(("script", "guarded"), [
    (f"{ASK}\n", "False"),  # top-level work: a worker would run it again
    (f"def main():\n    {ASK}\n\n\nif __name__ == \"__main__\":\n    main()\n", "True"),
])
def test_a_script_is_safe_only_behind_a_main_guard(tmp_path, script, guarded):
    (tmp_path / "job.py").write_text(script)
    assert answer(["job.py"], tmp_path) == guarded


def test_no_script_and_a_package_run_with_dash_m_are_safe(tmp_path):
    assert answer(["-c", ASK], tmp_path) == "True"
    package = tmp_path / "job"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(f"{ASK}\n")  # unguarded, but multiprocessing skips a package's __main__
    assert answer(["-m", "job"], tmp_path) == "True"
