"""Reading the user's input files (config.json, plans, cluster and configuration files) without trusting them.

A path may name a device (/dev/zero), a FIFO or a huge file, and JSON may nest deeper than Python's recursion
limit: each is refused with a message naming the file, before anything is read into memory.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

from .errors import MalformedConfig

# The largest input file read: a Hugging Face config.json is a few KiB (the largest catalog one, DeepSeek-V3's,
# is 1.7 KiB) and a plan a few dozen; 16 MiB leaves room for configs that embed id2label tables.
MAX_INPUT_BYTES = 16 * 2**20
# The deepest nesting accepted: config.json nests text_config.rope_scaling (3 levels), a plan 4.
MAX_JSON_DEPTH = 32


class UnreadableFile(MalformedConfig):
    """An input file that is missing, not a regular file, too large, not UTF-8 or not valid JSON."""


def read_text(path: Path, *, what: str, limit: int = MAX_INPUT_BYTES) -> str:
    """The UTF-8 text of the regular file `path`, at most `limit` bytes; `what` names it in messages."""
    try:
        info = path.stat()
    except OSError as err:
        raise UnreadableFile(f"Cannot read {what} {path}: {err.strerror or err}.",
                             "Check the path and its permissions.") from err
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file (a device, FIFO or socket)"
        raise UnreadableFile(f"{what} {path} is {kind}.", f"Give the path of a {what} file.")
    if info.st_size > limit:
        raise UnreadableFile(f"{what} {path} is {info.st_size:,} bytes; at most {limit:,} are read.",
                             f"A {what} is a few KiB; check that this is the right file.")
    try:
        with path.open("rb") as handle:
            data = handle.read(limit + 1)  # the file may grow after stat
        if len(data) > limit:
            raise UnreadableFile(f"{what} {path} is over {limit:,} bytes.",
                                 f"A {what} is a few KiB; check that this is the right file.")
        return data.decode("utf-8")
    except OSError as err:
        raise UnreadableFile(f"Cannot read {what} {path}: {err.strerror or err}.",
                             "Check the path and its permissions.") from err
    except UnicodeDecodeError as err:
        raise UnreadableFile(f"{what} {path} is not UTF-8 text ({err.reason} at byte {err.start}).",
                             f"Give a JSON {what}.") from err


def parse_json(text: str, *, where: str) -> Any:
    """JSON values of `text`, refusing invalid JSON, nesting deeper than `MAX_JSON_DEPTH` and huge integers."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise UnreadableFile(f"{where} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}.",
                             "Fix the JSON.") from err
    except RecursionError as err:
        raise UnreadableFile(f"{where} nests deeper than {MAX_JSON_DEPTH} levels.", "Fix the JSON.") from err
    except ValueError as err:  # e.g. an integer of more than 4300 digits (sys.get_int_max_str_digits)
        raise UnreadableFile(f"{where} holds a value Python refuses: {err}.", "Fix the JSON.") from err
    check_depth(value, where=where)
    return value


def check_depth(value: Any, *, where: str, limit: int = MAX_JSON_DEPTH) -> None:
    """Refuse data nested deeper than `limit` (YAML, or JSON already parsed)."""
    level, frontier, seen = 0, [value], set()
    while frontier:
        level += 1
        if level > limit:
            raise UnreadableFile(f"{where} nests deeper than {limit} levels.", "Fix the file's nesting.")
        children: list[Any] = []
        for item in frontier:
            if id(item) in seen:  # YAML aliases share objects: walk each once (no "billion laughs" blow-up)
                continue
            seen.add(id(item))
            if isinstance(item, dict):
                children.extend(item.values())
            elif isinstance(item, list):
                children.extend(item)
        frontier = children


def parse_yaml(text: str, *, where: str) -> Any:
    """YAML values of `text` (safe types only), refusing aliases: shared references ("billion laughs") expand
    exponentially in any later walk or message. A fitplan input never needs them."""
    import yaml

    class _NoAliases(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                raise UnreadableFile(f"{where} uses a YAML alias (*name); fitplan reads plain values only.",
                                     "Write the values out instead of referring to an anchor.")
            return super().compose_node(parent, index)

    try:
        value = yaml.load(text, Loader=_NoAliases)  # a SafeLoader subclass: safe types only
    except yaml.YAMLError as err:
        raise UnreadableFile(f"{where} is not valid YAML: {err}", "Fix the YAML.") from err
    except RecursionError as err:
        raise UnreadableFile(f"{where} nests deeper than {MAX_JSON_DEPTH} levels.", "Fix the YAML.") from err
    check_depth(value, where=where)
    return value
