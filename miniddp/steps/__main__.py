"""`python -m miniddp.steps`: list the rungs, show one, or diff two.

python -m miniddp.steps list        each rung: number, class, file, its one idea
python -m miniddp.steps show 3      rung 3's source
python -m miniddp.steps diff 2 3    what rung 3 adds to rung 2, as a unified diff
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import sys
from pathlib import Path

from miniddp.steps import LADDER

ROOT = Path(__file__).resolve().parents[2]  # the folder holding the miniddp package


def source_path(number: int) -> Path:
    return Path(inspect.getfile(LADDER[number - 1]))


def label(number: int) -> str:
    """The rung's file as the repository names it, e.g. miniddp/steps/overlap.py."""
    path = source_path(number)
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def idea(number: int) -> str:
    """The first line of the rung's module docstring: the one idea it adds."""
    doc = inspect.getmodule(LADDER[number - 1]).__doc__ or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def listing() -> str:
    rows = [f"{n}  {cls.__name__:<15} {label(n):<29} {idea(n)}" for n, cls in enumerate(LADDER, 1)]
    return "\n".join(rows)


def diff(a: int, b: int) -> str:
    before = source_path(a).read_text().splitlines(keepends=True)
    after = source_path(b).read_text().splitlines(keepends=True)
    return "".join(difflib.unified_diff(before, after, label(a), label(b)))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m miniddp.steps",
        description="The ladder of DDPs: each rung one idea more than the one before.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="each rung: number, class, file, its idea")
    show = commands.add_parser("show", help="print a rung's source")
    show.add_argument("rung", type=int)
    compare = commands.add_parser("diff", help="the unified diff between two rungs' files")
    compare.add_argument("rungs", type=int, nargs=2, metavar="RUNG")
    args = parser.parse_args(argv)
    asked = [args.rung] if args.command == "show" else args.rungs if args.command == "diff" else []
    for number in asked:
        if not 1 <= number <= len(LADDER):
            parser.error(
                f"there is no rung {number}: rungs are numbered 1 to {len(LADDER)} "
                "(python -m miniddp.steps list names them)"
            )
    if args.command == "list":
        print(listing())
    elif args.command == "show":
        print(source_path(args.rung).read_text(), end="")
    else:
        print(diff(*args.rungs), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
