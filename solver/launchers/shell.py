"""Shell text in emitted launch scripts: every word quoted, descriptions only as comment lines.

Model paths and names are user input (a local folder may be called `x;touch PWNED`), so no value is ever pasted
into a command line unquoted.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence


def command_line(argv: Sequence[str]) -> str:
    """`argv` as one POSIX shell line that runs exactly these words (each quoted where needed)."""
    return shlex.join(argv)


def option(name: str, value: str) -> list[str]:
    """`--name value` as argv words; `--name=value` when the value starts with '-', so argparse keeps it a value."""
    return [f"{name}={value}"] if value.startswith("-") else [name, value]


def comment(text: str) -> str:
    """`text` as shell comment lines: a newline in it starts a new `# ` line, never a command."""
    return "".join(f"# {line}\n" for line in text.splitlines() or [""])


def launch_script(argv: Sequence[str], *, about: str) -> str:
    """A bash script that runs `argv` and says which plan it belongs to."""
    return "#!/usr/bin/env bash\n" + comment(about) + command_line(argv) + "\n"
