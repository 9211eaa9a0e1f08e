"""`python -m miniddp.steps`: list the rungs, show one, or diff two.

python -m miniddp.steps list        each rung: number, class, file, its one idea
python -m miniddp.steps show 3      rung 3's source
python -m miniddp.steps diff 2 3    what rung 3 adds to rung 2, as a unified diff
python -m miniddp.steps diff --code 2 3    only the hunks that change code, not just prose

MiniDDP, the top rung, lives in several files (ddp.py and the modules it is built from), so a
diff that reaches it compares definition by definition: each of the rung's classes and functions
against MiniDDP's definition of the same name, wherever that lives (`diff 7 8`).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

from miniddp.steps import LADDER

ROOT = Path(__file__).resolve().parents[2]  # the folder holding the miniddp package
# The files MiniDDP's own code lives in, ddp.py first. (What they import from elsewhere, the
# event recorder that every rung uses too, the faults and the launch help, is not MiniDDP's.)
MINIDDP_SOURCES = [
    "miniddp/data_parallel/ddp.py",
    "miniddp/data_parallel/bucket.py",
    "miniddp/data_parallel/layout.py",
    "miniddp/data_parallel/autograd_graph.py",
    "miniddp/data_parallel/default_hooks.py",
    "miniddp/data_parallel/static_graph.py",
    "miniddp/same_model.py",
]


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
    says in its own words): each hunk then holds code changes only, with their context. A diff
    that reaches MiniDDP compares definitions (`definition_diff`)."""
    if LADDER[b - 1] is LADDER[-1] or LADDER[a - 1] is LADDER[-1]:
        return definition_diff(a, b, code_only)
    before, after = (source_path(n).read_text() for n in (a, b))
    return file_diff(before, after, label(a), label(b), code_only)


def file_diff(
    before: str,
    after: str,
    old_label: str,
    new_label: str,
    code_only: bool = False,
    old_lines: tuple[int, int] | None = None,
    new_lines: tuple[int, int] | None = None,
) -> str:
    """The unified diff of two sources, or of one line range of each (from 1, inclusive; the
    hunks then carry the files' own line numbers), optionally without prose-only changes."""
    old_all, new_all = before.splitlines(keepends=True), after.splitlines(keepends=True)
    (o1, o2), (n1, n2) = old_lines or (1, len(old_all)), new_lines or (1, len(new_all))
    old, new = old_all[o1 - 1 : o2], new_all[n1 - 1 : n2]
    old_prose = {i - o1 + 1 for i in prose_lines(before)} if code_only else set()
    new_prose = {i - n1 + 1 for i in prose_lines(after)} if code_only else set()
    segments: list[list[tuple]] = [[]]  # runs of opcodes between two prose-only changes
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, old, new).get_opcodes():
        prose_only = set(range(i1, i2)) <= old_prose and set(range(j1, j2)) <= new_prose
        if tag != "equal" and code_only and prose_only:
            segments.append([])
        else:
            segments[-1].append((tag, i1, i2, j1, j2))
    hunks = [
        unified_hunk(group, old, new, o1 - 1, n1 - 1)
        for codes in segments
        for group in grouped(codes)
    ]
    return f"--- {old_label}\n+++ {new_label}\n" + "".join(hunks) if hunks else ""


@dataclass(frozen=True)
class Definition:
    """One top-level class, function or named constant of a file, with its lines (from 1)."""

    name: str
    path: str  # as the repository names it
    first: int
    last: int


def definitions(path: str) -> list[Definition]:
    """The top-level definitions of a file in their order: classes, functions (from their
    first decorator) and assigned names; not the docstring or the imports."""
    found = []
    for node in ast.parse((ROOT / path).read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            found.append(Definition(node.name, path, first, node.end_lineno))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    found.append(Definition(target.id, path, node.lineno, node.end_lineno))
    return found


def imports(path: str) -> list[str]:
    """A file's top-level imports, one imported name a line (`from x import y`)."""
    lines = []
    for node in ast.parse((ROOT / path).read_text()).body:
        if isinstance(node, ast.Import):
            lines += [f"import {ast.unparse(alias)}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            lines += [f"from {node.module} import {ast.unparse(alias)}" for alias in node.names]
    return lines


def module_of(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def rung_files(number: int) -> list[str]:
    """The files a rung's code lives in: its own, or MiniDDP's."""
    return MINIDDP_SOURCES if LADDER[number - 1] is LADDER[-1] else [label(number)]


def side(number: int) -> str:
    return "MiniDDP's files" if LADDER[number - 1] is LADDER[-1] else label(number)


def title(number: int) -> str:
    if LADDER[number - 1] is not LADDER[-1]:
        return label(number)
    return (
        f"MiniDDP ({MINIDDP_SOURCES[0]} and the {len(MINIDDP_SOURCES) - 1} files it is built from)"
    )


def definition_diff(a: int, b: int, code_only: bool = False) -> str:
    """Rung `a` against rung `b`, one of them MiniDDP, definition by definition: each of `a`'s
    definitions against `b`'s of the same name wherever it lives (the wrapper classes against
    each other), in `a`'s order, each labelled with its file; first the imports from outside
    MiniDDP's files, and the names of the definitions the same in both or only on one side.
    What a rung imports from MiniDDP's files (`bucket_caps`) is the same object on both sides,
    and is left out, as are the module docstrings: each file's own introduction."""
    files = {n: rung_files(n) for n in (a, b)}
    shared = shared_names(files[a] + files[b])
    wrapper = {LADDER[a - 1].__name__: LADDER[b - 1].__name__}
    theirs = {d.name: d for path in files[b] for d in definitions(path) if d.name not in shared}
    same, only_ours, changed = [], [], [import_diff(a, b)]
    for ours in (d for path in files[a] for d in definitions(path) if d.name not in shared):
        counterpart = theirs.pop(wrapper.get(ours.name, ours.name), None)
        if counterpart is None:
            only_ours.append(ours.name)
            continue
        hunks = file_diff(
            (ROOT / ours.path).read_text(),
            (ROOT / counterpart.path).read_text(),
            f"{ours.path}: {ours.name}",
            f"{counterpart.path}: {counterpart.name}",
            code_only,
            (ours.first, ours.last),
            (counterpart.first, counterpart.last),
        )
        changed.append(hunks) if hunks else same.append(ours.name)
    summary = [
        f"# rung {a}, {title(a)} -> rung {b}, {title(b)}: definition by definition",
        "# the same in both: " + ", ".join(same or ["nothing"]),
    ]
    if only_ours:
        summary.append(f"# only in {side(a)}: {', '.join(only_ours)}")
    for path in files[b]:
        names = [d.name for d in theirs.values() if d.path == path]
        if names:
            summary.append(f"# only in {path}: {', '.join(names)}")
    return "".join(line + "\n" for line in summary) + "".join(changed)


def import_diff(a: int, b: int) -> str:
    """What each side imports from outside MiniDDP's files (and the ladder's own shared.py),
    one imported name a line: the libraries and the project's infrastructure it uses."""
    own = {module_of(path) for path in MINIDDP_SOURCES} | {"miniddp.steps"}
    lines = []
    for number in (a, b):
        found = {line for path in rung_files(number) for line in imports(path)}
        lines.append(sorted(line for line in found if line.split()[1] not in own))
    removed = [f"-{line}\n" for line in lines[0] if line not in lines[1]]
    added = [f"+{line}\n" for line in lines[1] if line not in lines[0]]
    if not (removed or added):
        return ""
    head = f"--- {side(a)}: imports from elsewhere\n+++ {side(b)}: imports from elsewhere\n"
    return head + "".join(removed + added)


def shared_names(paths: list[str]) -> set[str]:
    """The names a rung imports from MiniDDP's files, with what they use there (`bucket_caps`
    and the constants it reads): the same objects on both sides of a diff."""
    homes = {module_of(path): path for path in MINIDDP_SOURCES}
    shared: set[str] = set()
    for path in (p for p in paths if p not in MINIDDP_SOURCES):
        for node in ast.parse((ROOT / path).read_text()).body:
            if not (isinstance(node, ast.ImportFrom) and node.module in homes):
                continue
            home = homes[node.module]
            defined = {d.name: d for d in definitions(home)}
            wanted = [alias.name for alias in node.names]
            while wanted:
                name = wanted.pop()
                if name in shared or name not in defined:
                    continue
                shared.add(name)
                lines = (ROOT / home).read_text().splitlines(keepends=True)
                source = "".join(lines[defined[name].first - 1 : defined[name].last])
                wanted += [n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)]
    return shared


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


def unified_hunk(
    group: list[tuple], old: list[str], new: list[str], old_offset: int = 0, new_offset: int = 0
) -> str:
    """One hunk of a unified diff, as `difflib.unified_diff` writes it; the offsets place
    `old` and `new` in their files, for the line numbers."""

    def span(start: int, stop: int) -> str:
        length = stop - start
        return f"{start + (length > 0)},{length}" if length != 1 else str(start + 1)

    old_span = span(old_offset + group[0][1], old_offset + group[-1][2])
    new_span = span(new_offset + group[0][3], new_offset + group[-1][4])
    out = [f"@@ -{old_span} +{new_span} @@\n"]
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
