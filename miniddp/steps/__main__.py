"""`python -m miniddp.steps`: list the rungs, show one, or diff two.

python -m miniddp.steps list        each rung: number, class, file, its one idea
python -m miniddp.steps show 3      rung 3's source
python -m miniddp.steps diff 2 3    what rung 3 adds to rung 2, as a unified diff
python -m miniddp.steps diff --code 2 3    only the hunks that change code, not just prose
"""

from __future__ import annotations

import argparse
import ast
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
    names = max(len(cls.__name__) for cls in LADDER)
    files = max(len(label(n)) for n in range(1, len(LADDER) + 1))
    rows = [
        f"{n}  {cls.__name__:<{names}} {label(n):<{files}} {idea(n)}"
        for n, cls in enumerate(LADDER, 1)
    ]
    return "\n".join(rows)


def diff(a: int, b: int, code_only: bool = False) -> str:
    """The unified diff from rung `a`'s file to rung `b`'s; with `code_only`, without the
    changes that touch nothing but docstrings, comments and blank lines (the prose a chapter
    says in its own words): each hunk then holds code changes only, with their context."""
    before, after = (source_path(n).read_text() for n in (a, b))
    old, new = before.splitlines(keepends=True), after.splitlines(keepends=True)
    if not code_only:
        return "".join(difflib.unified_diff(old, new, label(a), label(b)))
    old_prose, new_prose = prose_lines(before), prose_lines(after)
    segments: list[list[tuple]] = [[]]  # runs of opcodes between two prose-only changes
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new).get_opcodes():
        prose_only = set(range(i1, i2)) <= old_prose and set(range(j1, j2)) <= new_prose
        if tag != "equal" and prose_only:
            segments.append([])
        else:
            segments[-1].append((tag, i1, i2, j1, j2))
    hunks = [unified_hunk(group, old, new) for codes in segments for group in grouped(codes)]
    return f"--- {label(a)}\n+++ {label(b)}\n" + "".join(hunks) if hunks else ""


def grouped(codes: list[tuple], context: int = 3) -> list[list[tuple]]:
    """Opcodes cut into hunks with `context` equal lines around each change, as
    `difflib.SequenceMatcher.get_grouped_opcodes` cuts a whole file's."""
    groups, group = [], []
    for index, (tag, i1, i2, j1, j2) in enumerate(codes):
        if tag == "equal" and index == 0:  # leading context: its last lines only
            i1, j1 = max(i1, i2 - context), max(j1, j2 - context)
        if tag == "equal" and index == len(codes) - 1:  # trailing context: its first lines
            i2, j2 = min(i2, i1 + context), min(j2, j1 + context)
        if tag == "equal" and i2 - i1 > 2 * context:  # a long equal run ends the hunk
            group.append((tag, i1, i1 + context, j1, j1 + context))
            groups.append(group)
            group = []
            i1, j1 = i2 - context, j2 - context
        group.append((tag, i1, i2, j1, j2))
    groups.append(group)
    return [g for g in groups if any(tag != "equal" for tag, *_ in g)]


def prose_lines(source: str) -> set[int]:
    """Indices (from 0) of the lines that are docstring, comment or blank."""
    lines = source.splitlines()
    prose = {i for i, line in enumerate(lines) if not line.strip() or line.lstrip().startswith("#")}
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if not isinstance(body, list) or not body or not isinstance(body[0], ast.Expr):
            continue
        if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            prose.update(range(body[0].lineno - 1, body[0].end_lineno))
    return prose


def unified_hunk(group: list[tuple], old: list[str], new: list[str]) -> str:
    """One hunk of a unified diff, as `difflib.unified_diff` writes it."""

    def span(start: int, stop: int) -> str:
        length = stop - start
        return f"{start + (length > 0)},{length}" if length != 1 else str(start + 1)

    out = [f"@@ -{span(group[0][1], group[-1][2])} +{span(group[0][3], group[-1][4])} @@\n"]
    for tag, i1, i2, j1, j2 in group:
        if tag == "equal":
            out += [" " + line for line in old[i1:i2]]
            continue
        out += ["-" + line for line in old[i1:i2]]
        out += ["+" + line for line in new[j1:j2]]
    return "".join(line if line.endswith("\n") else line + "\n" for line in out)


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
    compare.add_argument(
        "--code", action="store_true", help="only the hunks that change code, not just prose"
    )
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
        print(diff(*args.rungs, code_only=args.code), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
