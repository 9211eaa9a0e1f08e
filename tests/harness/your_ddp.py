"""A learner's own DDP class, given as `--ddp FILE.py:CLASS`: checked up front, and its failures
shown as the learner's own error first.

Up front, because otherwise a wrong file, class or signature surfaces only after the rank pool
has started (5-8 s), as one remote traceback per rank. `check_your_ddp` loads the file in the
test process and names the problem: no such file, a syntax error (with its file:line), an
import that fails, no such class, not a class, a constructor that cannot be called the way
the tests call it, a missing `finish_gradient_synchronization`.

`your_error_first` shortens a failure of the learner's class: what the ranks raised is usually
the same error, raised in the learner's file, under some 20 lines of harness frames per rank.
It shows that error once, with its file:line, and says which ranks raised it.
"""

from __future__ import annotations

import inspect
import os
import re
import traceback
from pathlib import Path
from typing import Any

import pytest

EXAMPLE = "tutorials/exercises/naive.py:NaiveDDP"
PROTOCOL = "CLASS(module, *, bucket_cap_mb=None), a forward, and finish_gradient_synchronization()"


def load_named(option: str, flag: str, example: str, what: str = "NAME") -> tuple[str, Any]:
    """(absolute "path.py:NAME", the object) for a usable FILE.py:NAME given to `flag` (--ddp,
    --ring, --zero1); else pytest.UsageError naming the problem and the fix."""
    where, colon, name = option.rpartition(":")
    if not colon or not where.endswith(".py") or not name.isidentifier():
        raise pytest.UsageError(
            f"{flag} takes FILE.py:{what}, e.g. {example}; got {option!r}, which is not of that "
            "form"
        )
    path = Path(where).resolve()
    if not path.is_file():
        raise pytest.UsageError(f"{flag} {option}: there is no file {where} (looked for {path})")
    source = path.read_text()
    try:
        compile(source, str(path), "exec")
    except SyntaxError as error:
        raise pytest.UsageError(
            f"{flag} {option}: {where}:{error.lineno}: SyntaxError: {error.msg}"
        ) from None
    from tests.workloads import load_implementation

    try:
        found = load_implementation(f"{path}:{name}")
    except AttributeError:
        defined = re.findall(r"^(?:def|class) (\w+)", source, flags=re.MULTILINE)
        raise pytest.UsageError(
            f"{flag} {option}: {where} defines no {name}; it defines: "
            f"{', '.join(defined) or 'nothing'}"
        ) from None
    except Exception as error:  # the learner's module raised while importing
        raise pytest.UsageError(
            f"{flag} {option}: importing {where} raised {type(error).__name__}: {error}, at "
            f"{_deepest_frame_in(traceback.extract_tb(error.__traceback__), path)}"
        ) from None
    return f"{path}:{name}", found


def check_your_ddp(option: str) -> str:
    """Return "absolute/path.py:CLASS" for a usable --ddp value; else raise pytest.UsageError
    naming the problem and the fix."""
    where, found = load_named(option, "--ddp", EXAMPLE, "CLASS")
    path, _, name = where.rpartition(":")
    if not inspect.isclass(found):
        raise pytest.UsageError(
            f"--ddp {option}: {name} is a {type(found).__name__}, not a class; the tests build "
            f"{PROTOCOL}"
        )
    try:
        inspect.signature(found).bind(object(), bucket_cap_mb=None)
    except TypeError as error:
        raise pytest.UsageError(
            f"--ddp {option}: {name}{inspect.signature(found)} cannot be called as "
            f"{name}(module, bucket_cap_mb=...) ({error}); the tests build {PROTOCOL}"
        ) from None
    if not callable(getattr(found, "finish_gradient_synchronization", None)):
        raise pytest.UsageError(
            f"--ddp {option}: {name} has no finish_gradient_synchronization(); the tests call it "
            "after every synced backward (make it do nothing if backward already waited)"
        )
    return where


def _deepest_frame_in(frames: traceback.StackSummary, path: Path) -> str:
    mine = [f for f in frames if Path(f.filename).resolve() == path] or list(frames)
    return f"{mine[-1].filename}:{mine[-1].lineno}" if mine else "an unknown line"


FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>.+)$')


def your_error_first(failures: dict, path: Path) -> str | None:
    """The ranks' failures (RankFailure by rank) as one short report led by the learner's own
    error and its file:line; None if the error was not raised from the learner's file."""
    by_error: dict[tuple[str, str, str], list[int]] = {}
    for rank, failure in sorted(failures.items()):
        where = _learners_frame(failure.traceback, path)
        if where is None:
            return None
        by_error.setdefault((where, failure.type_name, failure.message), []).append(rank)
    parts = []
    for (where, type_name, message), ranks in by_error.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        parts.append(f"{where}\n{type_name}: {message}\n(raised on {who})")
    return "\n\n".join(parts)


def _learners_frame(formatted: str, path: Path) -> str | None:
    """The last frame of a formatted traceback inside the learner's file, with its line."""
    lines = formatted.splitlines()
    found = None
    for number, line in enumerate(lines):
        match = FRAME.match(line)
        if match and Path(match["file"]).resolve() == path:
            code = lines[number + 1].strip() if number + 1 < len(lines) else ""
            shown = os.path.relpath(match["file"])
            found = f"{shown}:{match['line']}, in {match['function']}\n    {code}"
    return found
