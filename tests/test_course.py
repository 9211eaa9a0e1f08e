"""The course as a reader meets it: every path, module and chapter the prose names exists.

A file renamed, a module moved or a chapter renumbered leaves its old name behind in the
README, the docs and the chapters' own prose, where no import fails and no test runs it: a
reader follows it and finds nothing. So the names are read out of the text itself:

    paths      miniddp/..., tutorials/..., tests/..., docs/..., scripts/... (and markdown links,
               relative to their file)
    modules    miniddp.x.y, imported by name
    chapters   "chapter 11c", "Chapter 16", "chapters 13 and 14": a tutorials/NN*_*.py each

And every chapter is a lesson that fits one sitting: at most SOURCE_LINES lines of source (what
it prints is counted where it runs, in tests/test_tutorials.py).
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEXTS = sorted(
    [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "tutorials").rglob("*.py")]
    + [REPO / "tutorials" / "README.md"]
)
PATH = re.compile(r"(?<![\w/.$])((?:miniddp|tutorials|tests|docs|scripts)/[\w./*-]*[\w*])")
LINK = re.compile(r"\]\((?!https?:|#)([^)\s#]+)")
MODULE = re.compile(r"(?<![\w/.])(miniddp(?:\.[a-z_][a-z0-9_]*)+)")
CHAPTER = re.compile(r"\b[Cc]hapters? ((?:\d\d[a-z]?(?:, | and | or |-| to )?)+)")
NUMBER = re.compile(r"\d\d[a-z]?")
SOURCE_LINES = 450
CHAPTERS = sorted((REPO / "tutorials").glob("[0-9][0-9]*_*.py"))
# Being made lessons by their owners (#44 item 2), each with why; strict, so that one which
# fits fails here until it leaves the list.
LONGER_FOR_NOW: dict[str, str] = {}


def named(pattern: re.Pattern, text: Path) -> set[str]:
    return set(pattern.findall(text.read_text(encoding="utf-8")))


def chapters_on_disk() -> set[str]:
    return {p.name.split("_")[0] for p in (REPO / "tutorials").glob("[0-9][0-9]*_*.py")}


def missing_paths(text: Path) -> list[str]:
    missing = []
    for name in named(PATH, text):
        name = name.rstrip(".")
        # a glob or a placeholder ("tests/test_*.py", "docs/figures/NN_x.png") names no file
        if any(mark in name for mark in ("*", "NN", "<", "XX")):
            continue
        if not (REPO / name).exists() and not (REPO / name).with_suffix("").exists():
            missing.append(name)
    if text.suffix == ".md":
        for link in named(LINK, text):
            if not (text.parent / link).exists():
                missing.append(link)
    return missing


def importable(name: str) -> bool:
    """A module of that name, or a name a module holds ("miniddp.sharding.clip_grad_norm_",
    "miniddp.MiniDDP.buckets")."""
    parts = name.rstrip(".").split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.util.find_spec(".".join(parts[:cut])) is not None
        except ModuleNotFoundError:  # a parent is no package
            found = False
        if found:
            thing = importlib.import_module(".".join(parts[:cut]))
            for attribute in parts[cut:]:
                if not hasattr(thing, attribute):
                    return False
                thing = getattr(thing, attribute)
            return True
    return False


def missing_modules(text: Path) -> list[str]:
    return sorted(name for name in named(MODULE, text) if not importable(name))


def missing_chapters(text: Path) -> list[str]:
    on_disk = chapters_on_disk()
    numbers = {n for group in named(CHAPTER, text) for n in NUMBER.findall(group)}
    return sorted(numbers - on_disk)


@pytest.mark.parametrize("text", TEXTS, ids=[str(t.relative_to(REPO)) for t in TEXTS])
def test_every_name_in_the_prose_exists(text: Path) -> None:
    problems = {
        "paths": missing_paths(text),
        "modules": missing_modules(text),
        "chapters": missing_chapters(text),
    }
    problems = {kind: names for kind, names in problems.items() if names}
    assert not problems, f"{text.relative_to(REPO)} names what does not exist: {problems}"


@pytest.mark.parametrize(
    "chapter",
    [
        pytest.param(c, marks=pytest.mark.xfail(reason=LONGER_FOR_NOW[c.name], strict=True))
        if c.name in LONGER_FOR_NOW
        else c
        for c in CHAPTERS
    ],
    ids=[c.name for c in CHAPTERS],
)
def test_every_chapter_fits_one_sitting(chapter: Path) -> None:
    lines = len(chapter.read_text(encoding="utf-8").splitlines())
    assert lines <= SOURCE_LINES, (
        f"{chapter.name} is {lines} lines: split it, or move what it needs but does not teach "
        "into the library or a shared tutorial module"
    )


def reading_order(listing: str) -> list[tuple[str, list[str]]]:
    """The parts a listing names, each with its chapters' files, in the order written: the
    README's and tutorials/README.md's tables under "**Part N, title:**", the course map's
    numbered list under "## Reading order"."""
    parts: list[tuple[str, list[str]]] = []
    text = (REPO / listing).read_text(encoding="utf-8")
    if listing == "docs/course_map.md":
        section = text.split("## Reading order", 1)[1].split("\n| ", 1)[0]
        for title, links in re.findall(r"^\d\. \*\*([^:]+):\*\* (.*)$", section, re.M):
            parts.append((title, re.findall(r"tutorials/(\d\d[a-z]?_\w+\.py)", links)))
        return parts
    for line in text.splitlines():
        part = re.match(r"^\*\*Part \d, ([^:]+):\*\*", line)
        if part:
            parts.append((part.group(1), []))
        chapter = re.match(r"^\| \d\d[a-z]? \| `[^`]*?(\d\d[a-z]?_\w+\.py)", line)
        if chapter and parts:
            parts[-1][1].append(chapter.group(1))
    return parts


def test_the_three_reading_orders_agree_and_climb():
    """One reading order, in parts (#44): the README, tutorials/README.md and the course map
    list the same parts with the same chapters, every chapter once, numbers only climbing."""
    orders = {listing: reading_order(listing) for listing in READING_ORDERS}
    readme = orders["README.md"]
    assert [title for title, _ in readme] == PARTS, readme
    for listing, order in orders.items():
        assert order == readme, f"{listing} gives another reading order than the README's"
    files = [name for _, chapters in readme for name in chapters]
    assert sorted(files) == sorted(c.name for c in CHAPTERS), "every chapter, once"
    assert files == sorted(
        files, key=lambda name: (int(name[:2]), name[2] if name[2] != "_" else "")
    )


READING_ORDERS = ("README.md", "tutorials/README.md", "docs/course_map.md")
PARTS = [
    "Data parallelism",
    "Memory",
    "The real model",
    "Model parallelism",
    "Composition and scale",
    "Beyond",
]
