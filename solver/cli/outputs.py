"""Writing a plan's files (`-o`, `--emit`, `--plot`): nothing existing is overwritten without --force, and a
launcher that cannot run the plan is reported while the others still write."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from graphs import FitplanError
from solver.plan.record import Plan


@dataclass(frozen=True, kw_only=True)
class Emitted:
    """What `--emit` produces: file name -> text (plan.json included), and launcher -> why it refused."""
    files: dict[str, str]
    refused: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Targets:
    """Where `solve` writes: the -o plan path, the --emit launchers and folder, the --plot path."""
    output: Path | None = None
    launchers: tuple[str, ...] = ()
    emit_dir: Path = Path("fitplan-out")
    plot: Path | None = None


def launcher_names(emit: str | None) -> tuple[str, ...]:
    """The launchers named in `--emit a,b`, each checked against the emitters (unknown is bad input)."""
    from solver.plan.launchers import EMITTERS

    names = tuple(dict.fromkeys(name.strip() for name in (emit or "").split(",") if name.strip()))
    unknown = [name for name in names if name not in EMITTERS]
    if unknown:
        raise FitplanError(f"Unknown launcher {', '.join(map(repr, unknown))} in --emit",
                           f"Choose from: {', '.join(EMITTERS)}.")
    return names


def emitted(plan: Plan, launchers: tuple[str, ...]) -> Emitted:
    """The files of every launcher that can run `plan`, and the reason each other one refused."""
    from solver.plan.launchers import emit

    files, refused = {"plan.json": plan.dumps() + "\n"}, {}
    for launcher in launchers:
        try:
            files.update(emit(plan, launcher))
        except FitplanError as error:
            refused[launcher] = error.message
    if launchers and len(refused) == len(launchers):
        reasons = " ".join(refused.values())
        raise FitplanError(f"No launcher in --emit can run this plan, so nothing was written. {reasons}",
                           f"Launchers that can run it: {', '.join(plan.launchers) or 'none'}; or re-plan with "
                           "--launcher NAME to restrict the search to what that launcher expresses.")
    return Emitted(files=files, refused=refused)


def refuse_overwrite(paths: list[Path], *, force: bool) -> None:
    """Raise, naming the files, when any of `paths` exists and --force was not given."""
    existing = sorted({(str(path.parent), path.name) for path in paths if path.exists()})
    if existing and not force:
        folders = {folder: [name for f, name in existing if f == folder] for folder, _ in existing}
        listed = "; ".join(f"{', '.join(names)} in {folder}" for folder, names in folders.items())
        raise FitplanError(f"Refusing to overwrite existing files, so nothing was written: {listed}.",
                           "Pass --force to overwrite them, or choose another -o / --emit-dir / --plot path.")


@dataclass(frozen=True, kw_only=True)
class Written:
    """What `write_outputs` did: the files written, and the launchers that refused with their reasons."""
    paths: list[Path]
    refused: dict[str, str]

    def lines(self) -> list[str]:
        refusals = [f"refused {name}: {why}" for name, why in self.refused.items()]
        return [f"wrote {path}" for path in self.paths] + refusals


def write_outputs(plan: Plan, targets: Targets, *, force: bool) -> Written:
    """Write the plan's files after checking all of them, so that a refusal writes nothing."""
    from solver.cli.plot import plot_plan

    result = emitted(plan, targets.launchers) if targets.launchers else Emitted(files={})
    files: dict[Path, str] = {} if targets.output is None else {targets.output: plan.dumps()}
    for name, text in result.files.items():
        files.setdefault(targets.emit_dir / name, text)  # -o may name emit_dir/plan.json too
    plot = [targets.plot] if targets.plot is not None else []
    refuse_overwrite([*files, *plot], force=force)
    for path in [*files, *plot]:
        folder = path.parent
        if folder != targets.emit_dir and not folder.is_dir():
            raise FitplanError(f"Cannot write {path}: folder {folder} does not exist; nothing was written.",
                               "Create the folder first, or write elsewhere.")
    if result.files:
        targets.emit_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path, text in files.items():
        if path.resolve() not in {p.resolve() for p in written}:
            _write(path, text, force=force)
            written.append(path)
    if targets.plot is not None:
        plot_plan(plan, targets.plot)
        written.append(targets.plot)
    return Written(paths=written, refused=result.refused)


def _write(path: Path, text: str, *, force: bool) -> None:
    # Exclusive creation without --force: a file that appeared since the check is still never overwritten.
    with path.open("w" if force else "x") as handle:
        handle.write(text)
