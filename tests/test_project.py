"""The promises the README makes to a new user: its first commands are the ones CI runs, and
MiniDDP's whole life is in one file."""

import ast
import re
from pathlib import Path

from torch import nn
from torch.distributed.algorithms.join import Joinable

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1 : lines.index("```", lines.index("```bash") + 1)]
    return [line.split("  #")[0].strip() for line in block]


def test_readme_starts_with_the_two_commands():
    assert (ROOT / "README.md").read_text().splitlines()[2] == "```bash"
    run, test = readme_commands()
    assert run.endswith("./launch.sh") and "torch==2.13.0" in run
    assert test.endswith("python -m pytest -q") and "'.[test]'" in test


def test_ci_runs_the_readmes_test_command():
    ci_lines = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci_lines[-1] == readme_commands()[1]


CHAPTERS = sorted(path.name for path in (ROOT / "tutorials").glob("[0-9][0-9]*_*.py"))


def test_every_chapter_is_in_the_reading_order_and_the_course_map():
    """Each list of chapters names every chapter, in the order of their numbers, which is the
    ladder's order: a chapter never uses a rung a later chapter teaches."""
    for listing in ("tutorials/README.md", "README.md", "docs/course_map.md"):
        text = (ROOT / listing).read_text()
        missing = [chapter for chapter in CHAPTERS if chapter not in text]
        assert not missing, f"{listing} does not name {missing}"
        first_mention = sorted(CHAPTERS, key=text.index)
        if listing != "docs/course_map.md":  # the map follows the course's topics instead
            assert first_mention == CHAPTERS, f"{listing} lists the chapters out of order"


def test_the_ladder_s_chapters_teach_the_rungs_in_order():
    """Chapter after chapter, the rungs they teach ("rung N" in their first line) only climb."""
    taught = []
    for chapter in CHAPTERS:
        first_line = (ROOT / "tutorials" / chapter).read_text().splitlines()[0]
        for numbers in re.findall(r"rungs? ((?:\d(?:, | and )?)+)", first_line):  # "rungs 6 and 7"
            taught += [int(n) for n in re.findall(r"\d", numbers)]
    assert taught == sorted(taught) and set(taught) == set(range(1, 8)), taught


def test_every_method_miniddp_calls_on_itself_is_in_ddp_py():
    """A reader of ddp.py opens no other file to know what a forward or a backward does: what
    MiniDDP calls on `self` is defined in its class, or is nn.Module's or Joinable's (no mixin:
    the observer is held, not inherited). Helpers it owns are called on themselves
    (`self.observer.note()`)."""
    tree = ast.parse((ROOT / "miniddp" / "data_parallel" / "ddp.py").read_text())
    (miniddp,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MiniDDP"]
    own = {node.name for node in miniddp.body if isinstance(node, ast.FunctionDef)}
    inherited = set(dir(nn.Module)) | set(dir(Joinable))
    called = {
        node.func.attr
        for node in ast.walk(miniddp)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    }
    held = {"module"}  # the wrapped model, called as a function: `self.module(*inputs)`
    assert called - held - own - inherited == set()
    assert {"_sync_buffers", "_set_static_graph", "_rebuild_buckets"} <= called & own
