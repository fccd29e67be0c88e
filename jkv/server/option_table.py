"""The README's tables of server flags and options, generated from `build_parser()` and
`jkv.config.OPTIONS` so that they cannot drift (a test compares the README's with these).

    python -m jkv.server.option_table               # print them
    python -m jkv.server.option_table --write README.md  # replace the ones there

A row is a flag, its default and the first clause of its help: a help that starts with what
the setting is gives the table its words, and a help's `default: ...` clause its default.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

from jkv.config import OPTIONS
from jkv.server.flags import build_parser, flag_names

SERVER_HEADER = "server flag | default | what"
OPTION_HEADER = "option | default | what"
_RULE = "---|---|---"
_CLAUSE_END = re.compile(r"; |: |\. | \(|, ")
_DEFAULT_CLAUSE = re.compile(r"\bdefault: ", re.IGNORECASE)


def _first_clause(text: str) -> str:
    return _CLAUSE_END.split(text, maxsplit=1)[0].rstrip(".")


def _size(n: int) -> str:
    """A byte count as the size text byte flags take (512MiB, 64GiB), exact."""
    for unit in ("GiB", "MiB", "KiB"):
        scale = {"GiB": 1 << 30, "MiB": 1 << 20, "KiB": 1 << 10}[unit]
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _value(value: Any, name: str) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None:
        return "none"
    if isinstance(value, int) and name.endswith("_bytes"):
        return f"`{_size(value)}`"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`"


def _row(action: argparse.Action, help_text: str) -> str:
    stated = _DEFAULT_CLAUSE.search(help_text)
    default = (_first_clause(help_text[stated.end():]) if stated
               else _value(action.default, action.dest))
    cells = (f"`{action.option_strings[0]}`", flag_names(default, "`"),
             flag_names(_first_clause(help_text), "`"))
    return " | ".join(c.replace("|", "\\|") for c in cells)


def tables() -> str:
    """The server's own flags, then the options (`LLM` keywords as well), as two markdown
    tables separated by a blank line."""
    helps = {o.name: o.help for o in OPTIONS}  # the option's own words, not its --help note
    server, options = [SERVER_HEADER, _RULE], [OPTION_HEADER, _RULE]
    for action in build_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        if action.dest in helps:
            options.append(_row(action, helps[action.dest]))
        else:
            server.append(_row(action, action.help or ""))
    return "\n".join(server) + "\n\n" + "\n".join(options) + "\n"


def replace_tables(text: str) -> str:
    """`text` (a README) with its tables, from the server table's header to the end of the
    options table, replaced by `tables()`; ValueError if it has none."""
    start, header = text.find(SERVER_HEADER), text.find(OPTION_HEADER)
    if start < 0 or header < start:
        raise ValueError("no option tables to replace (their header rows are missing)")
    end = text.find("\n\n", header)
    end = len(text) if end < 0 else end + 1
    return text[:start] + tables() + text[end:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jkv.server.option_table",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", metavar="README", type=Path,
                        help="replace the tables in this file instead of printing them")
    args = parser.parse_args(argv)
    if args.write is None:
        sys.stdout.write(tables())
        return
    try:
        args.write.write_text(replace_tables(args.write.read_text()))
    except (OSError, ValueError) as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
