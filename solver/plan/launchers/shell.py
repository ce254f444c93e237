"""Shell text in emitted launch scripts: every word quoted, descriptions only as comment lines.

Model paths and names are user input (a local folder may be called `x;touch PWNED`), so no value is ever pasted
into a command line unquoted. Per-node values (`$NODE_RANK`, `$MASTER_ADDR`) must still expand on each node:
they are `Env` words, built only from validated variable names, safe defaults and escaped literal text, and
always written inside double quotes.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")
_DEFAULT = re.compile(r"[A-Za-z0-9._:/-]*")
# Inside double quotes only these characters keep a special meaning (bash manual, "Double Quotes").
_ESCAPED = re.compile(r'([\\"$`])')


@dataclass(frozen=True, slots=True)
class Env:
    """One shell word that expands environment variables and nothing else (see `env`, `joined`)."""

    text: str
    """The word's body, already safe between double quotes."""

    def quoted(self) -> str:
        return f'"{self.text}"'


def env(name: str, default: str | None = None) -> Env:
    """`"${NAME}"`, or `"${NAME:-default}"` so that a one-node run needs no variables set."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not an environment variable name (A-Z, 0-9, _)")
    if default is None:
        return Env(f"${{{name}}}")
    if not _DEFAULT.fullmatch(default):
        raise ValueError(f"default {default!r} for ${name} must be letters, digits or ._:/-")
    return Env(f"${{{name}:-{default}}}")


def joined(*parts: Env | str) -> Env:
    """One word of `Env` parts and literal text (escaped), e.g. joined(env("MASTER_ADDR"), ":", env("PORT"))."""
    return Env("".join(p.text if isinstance(p, Env) else _ESCAPED.sub(r"\\\1", p) for p in parts))


def command_line(argv: Sequence[str | Env]) -> str:
    """`argv` as one POSIX shell line that runs exactly these words (each quoted where needed; `Env` words
    expand their variables only)."""
    return " ".join(w.quoted() if isinstance(w, Env) else shlex.quote(w) for w in argv)


def option(name: str, value: str | Env) -> list[str | Env]:
    """`--name value` as argv words; `--name=value` when the value starts with '-', so argparse keeps it a value."""
    if isinstance(value, Env):
        return [name, value]
    return [f"{name}={value}"] if value.startswith("-") else [name, value]


def comment(text: str) -> str:
    """`text` as shell comment lines: a newline in it starts a new `# ` line, never a command."""
    return "".join(f"# {line}\n" for line in text.splitlines() or [""])


def launch_script(argv: Sequence[str | Env], *, about: str, environment: Mapping[str, str], forward: bool = False,
                  notes: str = "", required: Mapping[str, str] | None = None) -> str:
    """A bash script that sets `environment`, runs `argv` and says which plan it belongs to; with `forward`, the
    script's own arguments are passed on to the training script ("$@"); `required` names the variables the user
    must set (name: what it holds), checked before anything starts."""
    line = command_line(argv) + (' "$@"' if forward else "")
    return "#!/usr/bin/env bash\n" + comment(about) + (comment(notes) if notes else "") + exports(environment) + \
        "".join(require(name, what) for name, what in (required or {}).items()) + line + "\n"


# A `required` description is fitplan's own text, but it sits inside `${NAME:?...}`, where bash expands it: only
# characters with no meaning there.
_MESSAGE = re.compile(r"[A-Za-z0-9 ._,:/()+=-]*")


def require(name: str, what: str) -> str:
    """A line that stops the script, naming the variable and what it holds, when `$NAME` is unset or empty."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not an environment variable name (A-Z, 0-9, _)")
    if not _MESSAGE.fullmatch(what):
        raise ValueError(f"the description of ${name} must be letters, digits, spaces or ._,:/()+=-: {what!r}")
    return f': "${{{name}:?set {name}: {what}}}"\n'


def exports(environment: Mapping[str, str]) -> str:
    """`export NAME=value` lines (names checked, values quoted)."""
    lines = []
    for name, value in environment.items():
        if not _NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not an environment variable name (A-Z, 0-9, _)")
        lines.append(f"export {name}={shlex.quote(value)}\n")
    return "".join(lines)
