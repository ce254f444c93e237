"""Writing a plan's files (`-o`, `--emit`, `--plot`): all together or none (`staging`), nothing existing overwritten
without --force, no two outputs on one path, and a launcher that cannot run the plan reported while the others
still write."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

from graphs import FitplanError
from solver.plan.record import Plan
from solver.plan.staging import Writer, refuse_overwrite, refuse_shared_paths, text_writer, write_together


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


@dataclass(frozen=True, kw_only=True)
class Written:
    """What `write_outputs` did: the files written, and the launchers that refused with their reasons."""
    paths: list[Path]
    refused: dict[str, str]

    def lines(self) -> list[str]:
        refusals = [f"refused {name}: {why}" for name, why in self.refused.items()]
        return [f"wrote {path}" for path in self.paths] + refusals


def target_paths(targets: Targets, emitted_names: tuple[str, ...] = ()) -> dict[str, Path]:
    """Each output by the option that names it: -o, --plot and every file --emit writes (-o may name the emit
    folder's plan.json: that is the one plan, written once)."""
    named = {} if targets.output is None else {"-o": targets.output}
    for name in emitted_names:
        path = targets.emit_dir / name
        if not (name == "plan.json" and targets.output is not None and path.resolve() == targets.output.resolve()):
            named[f"--emit ({name})"] = path
    if targets.plot is not None:
        named["--plot"] = targets.plot
    return named


def check_targets(targets: Targets, *, force: bool) -> None:
    """Refuse, before any solving, the outputs known up front (-o, --plot) that share a path or exist without
    --force; the emitted files are known, and checked, once the plan is."""
    named = target_paths(targets)
    refuse_shared_paths(named)
    refuse_overwrite(list(named.values()), force=force)


def write_outputs(plan: Plan, targets: Targets, *, force: bool) -> Written:
    """Write the plan's files together (`staging.write_together`): after checking all of them, all or none."""
    from solver.cli.plot import plot_plan

    result = emitted(plan, targets.launchers) if targets.launchers else Emitted(files={})
    named = target_paths(targets, tuple(result.files))
    refuse_shared_paths(named)
    kept = set(named.values())  # without the emit folder's plan.json where -o names it
    writers: dict[Path, Writer] = {targets.emit_dir / name: text_writer(text) for name, text in result.files.items()
                                   if targets.emit_dir / name in kept}
    if targets.output is not None:
        writers[targets.output] = text_writer(plan.dumps())
    if targets.plot is not None:
        writers[targets.plot] = lambda path: plot_plan(plan, path)
    for path in writers:
        if path.parent != targets.emit_dir and not path.parent.is_dir():
            raise FitplanError(f"Cannot write {path}: folder {path.parent} does not exist; nothing was written.",
                               "Create the folder first, or write elsewhere.")
    refuse_overwrite(list(writers), force=force)  # before the emit folder is created
    created = bool(result.files) and not targets.emit_dir.exists()
    if result.files:
        targets.emit_dir.mkdir(parents=True, exist_ok=True)
    scripts = frozenset(path for path in writers if path.suffix == ".sh")
    try:
        return Written(paths=write_together(writers, force=force, executable=scripts), refused=result.refused)
    except BaseException:
        if created:  # nothing was written: not even the folder stays
            with contextlib.suppress(OSError):
                targets.emit_dir.rmdir()
        raise
