"""A command's output files, written all together or not at all: each is first written to a temporary file beside
its target, and only when every one is complete are they moved into place. A failure while writing (a full disk, a
missing matplotlib) removes the temporaries and leaves every target as it was; nothing existing is overwritten
without --force, and two outputs of one command never share a path."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path

from graphs import FitplanError

Writer = Callable[[Path], None]
"""Writes one output's content to the (empty, already created) path it is given."""


def text_writer(text: str) -> Writer:
    """A writer of `text` as UTF-8."""
    return lambda path: path.write_text(text, encoding="utf-8")


def refuse_overwrite(paths: list[Path], *, force: bool) -> None:
    """Raise, naming the files, when any of `paths` exists and --force was not given."""
    existing = sorted({(str(path.parent), path.name) for path in paths if path.exists()})
    if existing and not force:
        folders = {folder: [name for f, name in existing if f == folder] for folder, _ in existing}
        listed = "; ".join(f"{', '.join(names)} in {folder}" for folder, names in folders.items())
        raise FitplanError(f"Refusing to overwrite existing files, so nothing was written: {listed}.",
                           "Pass --force to overwrite them, or choose other output paths.")


def refuse_shared_paths(named: dict[str, Path]) -> None:
    """Raise when two outputs (option name -> path) are one file: the same path once resolved (symlinks, `..`), or
    two names of one existing file (a hard link). The later would silently replace the earlier."""
    seen: dict[Path, str] = {}
    for option, path in named.items():
        resolved = path.resolve()
        other = seen.get(resolved) or next((name for earlier, name in seen.items() if _same_file(earlier, resolved)),
                                           None)
        if other is not None:
            raise FitplanError(f"{other} and {option} both write {path}: one would replace the other, so nothing "
                               "was written.", "Give each output its own path.")
        seen[resolved] = option


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def write_together(outputs: dict[Path, Writer], *, force: bool, executable: frozenset[Path] = frozenset()
                   ) -> list[Path]:
    """Write every output (target -> writer) or none; `executable` targets get the executable bit (as the umask
    allows). Returns the targets written."""
    refuse_overwrite(list(outputs), force=force)
    staged: dict[Path, Path] = {}
    placed: list[Path] = []
    try:
        for target, write in outputs.items():
            staged[target] = _staged(target, write, executable=target in executable)
        for target, temporary in staged.items():
            _place(temporary, target, force=force)
            placed.append(target)
    except BaseException as error:
        for temporary in staged.values():
            temporary.unlink(missing_ok=True)
        if not force:  # the targets already placed were new files: remove them, so that none is written
            for target in placed:
                target.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise FitplanError(f"Cannot write {error.filename or 'the outputs'}: {error.strerror or error}; nothing "
                               "was written.", "Free disk space or choose another folder, then rerun.") from error
        raise
    return placed


def _staged(target: Path, write: Writer, *, executable: bool) -> Path:
    """A complete temporary copy of the output beside `target` (same file system, so the move is a rename); its
    name keeps the target's suffix (matplotlib picks the image format by it)."""
    temporary = target.parent / f".{target.name}.{secrets.token_hex(4)}.tmp{target.suffix}"
    # Created with the mode a new file gets (the umask applies), not mkstemp's 0600.
    os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o777 if executable else 0o666))
    try:
        write(temporary)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return temporary


def _place(temporary: Path, target: Path, *, force: bool) -> None:
    """Move the temporary onto `target`; without --force never over a file that appeared since the check (a hard
    link fails where the target exists, where a rename would replace it)."""
    if force:
        os.replace(temporary, target)
        return
    try:
        os.link(temporary, target)
    except FileExistsError:
        raise FitplanError(f"Refusing to overwrite {target}: it appeared while the outputs were written; nothing "
                           "was written.", "Pass --force to overwrite it, or choose another path.") from None
    except OSError:  # a file system without hard links: check, then rename
        if target.exists():
            raise FitplanError(f"Refusing to overwrite {target}; nothing was written.",
                               "Pass --force to overwrite it, or choose another path.") from None
        os.replace(temporary, target)
        return
    temporary.unlink()
