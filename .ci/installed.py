"""Exit 0 when .venv already holds this clone's fitplan install, so `.ci/setup` can skip pip (the fast path).

Run with `.venv/bin/python .ci/installed.py`; `--stamp` first records a finished install. The install counts
as current when all of these hold:
- `.venv/.fitplan-installed` holds the digest of `pyproject.toml` and `.ci/setup` written by the last full
  install (so a changed requirement or install recipe triggers a reinstall);
- every requirement of `fitplan[dev]` is installed at a version its specifier accepts (metadata only: fast);
- torch, OR-Tools and fitplan's own packages can be found, and fitplan is the editable install of this clone (a
  `.venv` copied from another checkout would otherwise run that checkout's code).
Nothing is imported: importing torch alone costs ~2 s, and `./fitplan` runs this before every command (`--help`
included); a broken install still fails loudly at the command's own import.
"""

from __future__ import annotations

import hashlib
import sys
from importlib import metadata, util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAMP = ROOT / ".venv" / ".fitplan-installed"
EXTRA = "dev"


def digest(root: Path = ROOT) -> str:
    """The SHA-256 of the inputs that decide what `.ci/setup` installs."""
    sha = hashlib.sha256()
    for name in ("pyproject.toml", ".ci/setup"):
        sha.update((root / name).read_bytes())
    return sha.hexdigest()


def missing_requirements(requirements: list[str] | None = None) -> list[str]:
    """Requirements (default: installed fitplan's, base + dev extra) absent or at a version outside their specifier."""
    from packaging.requirements import Requirement

    texts = (metadata.requires("fitplan") or []) if requirements is None else requirements
    bad = []
    for text in texts:
        requirement = Requirement(text)
        if requirement.marker and not requirement.marker.evaluate({"extra": EXTRA}):
            continue
        try:
            found = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            bad.append(f"{requirement} (not installed)")
            continue
        if not requirement.specifier.contains(found, prereleases=True):
            bad.append(f"{requirement} (found {found})")
    return bad


def problems() -> list[str]:
    """Why the install is not current (empty when it is)."""
    if not STAMP.is_file() or STAMP.read_text().strip() != digest():
        return ["pyproject.toml or .ci/setup changed since the last install (or none finished)"]
    try:
        bad = missing_requirements()
    except (metadata.PackageNotFoundError, ImportError) as err:
        return [f"fitplan is not installed: {err}"]
    if bad:
        return bad
    for module in ("torch", "ortools", "graphs", "costmodels", "solver"):
        if util.find_spec(module) is None:
            return [f"{module} cannot be found"]
    where = Path(util.find_spec("solver").origin or "").resolve().parent.parent
    if where != ROOT:
        return [f"fitplan in .venv is installed from {where}, not from this clone"]
    return []


def main(argv: list[str]) -> int:
    if argv == ["--stamp"]:
        STAMP.write_text(digest() + "\n")
    elif argv:
        print("usage: installed.py [--stamp]", file=sys.stderr)
        return 2
    found = problems()
    for line in found:
        print(f"setup: install not current: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
