"""argparse types that check a value where it is read, so a bad option is refused by argparse
in the launcher process: at once, once, naming the option, the value and what would do. Found
after the relaunch, the same mistake costs every rank its start-up and ends in a traceback each
(`--iters 0` ran for 22 s into "no median for empty data").

    parser.add_argument("--iters", type=whole_number(at_least=1), default=30)
    parser.add_argument("--json", type=writable_file)      # its folder must exist
    parser.add_argument("--trace-dir", type=writable_folder)  # or one that can be made

Every benchmark takes the same two, `--iters N` and `--json PATH`: add_iters_and_json. Those
that time over the simulated link take `--link` (add_link_option), whose default is read from
$MINIDDP_LINK after parsing, so that a bad value there is named as the variable's; those that
compare links take it repeated (add_links_option, links_to_run).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from miniddp.observe.link import ENVIRONMENT_VARIABLE, EXAMPLE, BadLink, Link


def whole_number(at_least: int) -> Callable[[str], int]:
    """An int >= `at_least`; argparse prefixes its refusal with the option's name."""

    def read(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a whole number; give one >= {at_least}"
            ) from None
        if value < at_least:
            raise argparse.ArgumentTypeError(
                f"{value} is too small; give a whole number >= {at_least}"
            )
        return value

    return read


def _cannot_write_in(folder: Path) -> str | None:
    """Why no file can be made in `folder`, or None: found by making one (and removing it), for
    permission bits say nothing to root, nor of a read-only file system."""
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as error:
        return f"no file can be made in {str(folder)!r} ({error.strerror.lower()})"
    return None


def writable_folder(text: str) -> str:
    """A folder to write files in, or to make: its first existing ancestor takes new files."""
    folder = Path(text).absolute()
    existing = next(path for path in (folder, *folder.parents) if path.exists())
    if not existing.is_dir():
        problem = f"{str(existing)!r} is a file, not a folder"
    else:
        problem = _cannot_write_in(existing)
    if problem:
        raise argparse.ArgumentTypeError(
            f"cannot write files in {text!r}: {problem}; give a folder you can write to (it is "
            f"made if missing), e.g. /tmp/miniddp"
        )
    return text


def writable_file(text: str) -> str:
    """A file to write once the run is done, checked now: the run should not end in an error."""
    path = Path(text).absolute()
    if path.is_dir():
        problem = f"{text!r} is a folder"
    elif not path.parent.is_dir():
        problem = f"there is no folder {str(path.parent)!r}"
    else:
        problem = _cannot_write_in(path.parent)
    if problem:
        raise argparse.ArgumentTypeError(
            f"cannot write the file {text!r}: {problem}; give a file name in a folder you can "
            f"write to, e.g. /tmp/report.json"
        )
    return text


def add_iters_and_json(
    parser: argparse.ArgumentParser, iters: int, what: str = "timed steps", least: int = 1
) -> None:
    """`--iters` (how many `what`, at least `least`) and `--json PATH`, as every bench has."""
    parser.add_argument(
        "--iters",
        type=whole_number(at_least=least),
        default=iters,
        help=f"{what} (default {iters})",
    )
    parser.add_argument(
        "--json", metavar="PATH", type=writable_file, help="also write the results here"
    )


def add_gpt_options(parser: argparse.ArgumentParser, layers: int = 2) -> None:
    """The shape of chapter 12's GPT a bench builds: width, blocks, heads, vocabulary and the
    tokens of a window, at the benches' small defaults."""
    count = whole_number(at_least=1)
    parser.add_argument("--width", type=count, default=64, help="the GPT's width (default 64)")
    parser.add_argument("--layers", type=count, default=layers, help=f"blocks (default {layers})")
    parser.add_argument("--heads", type=count, default=4, help="attention heads (default 4)")
    parser.add_argument("--vocab", type=count, default=64, help="vocabulary (default 64)")
    parser.add_argument("--length", type=count, default=32, help="tokens per window (default 32)")


def add_link_option(parser: argparse.ArgumentParser, used_for: str, without: str) -> None:
    """`--link`: a simulated link (miniddp/observe/link.py) for `used_for`; not given,
    $MINIDDP_LINK's, else none (`without`). Call link_or_environment after parse_args."""
    parser.add_argument(
        "--link",
        type=Link.parse,
        default=argparse.SUPPRESS,  # not given: read by link_or_environment
        help=f"a simulated link for {used_for}, e.g. {EXAMPLE} (default: "
        f"${ENVIRONMENT_VARIABLE}, else none: {without})",
    )


def add_links_option(parser: argparse.ArgumentParser, crossing: str) -> None:
    """`--link`, repeatable: the benches that compare the bare machine with a slow link run
    each link given, by default none and then alpha=1ms,bandwidth=1gbit. `crossing` says what
    crosses it."""
    parser.add_argument(
        "--link",
        type=Link.parse,
        action="append",
        help=f"'none' or e.g. alpha=1ms,bandwidth=1gbit ({crossing} crosses it); repeat to run "
        "several (default: none, then alpha=1ms,bandwidth=1gbit)",
    )


def links_to_run(args: argparse.Namespace) -> list[Link | None]:
    """The links add_links_option's `--link` asked for, or its default pair."""
    return args.link or [None, Link.parse("alpha=1ms,bandwidth=1gbit")]


def link_or_environment(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Set args.link from $MINIDDP_LINK when --link was not given (None when neither is)."""
    if "link" not in args:
        try:
            args.link = Link.parse(os.environ.get(ENVIRONMENT_VARIABLE))
        except BadLink as error:
            parser.error(f"${ENVIRONMENT_VARIABLE} (the default of --link): {error}")
