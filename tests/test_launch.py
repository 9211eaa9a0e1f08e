"""launch.sh refuses a bad setting or a missing script at once, with a usage error, before torch
is even imported (torchrun itself took ~5 s to end in a bare AssertionError, and ~7 s, having
started every worker, in a ChildFailedError for a script that does not exist). A chapter's bad
simulated link is refused once, by launch.sh, rather than once per rank."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SETTINGS = ("NPROC", "NNODES", "NODE_RANK", "MAX_RESTARTS", "MASTER_PORT", "MINIDDP_LINK")


def launch(*args: str, **settings: str) -> subprocess.CompletedProcess[str]:
    """./launch.sh ARGS with these settings and no others of its own from this environment."""
    env = {name: value for name, value in os.environ.items() if name not in SETTINGS}
    env.update(settings)
    return subprocess.run(
        ["./launch.sh", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def assert_refused_once(launcher: subprocess.CompletedProcess[str], message: str) -> None:
    assert launcher.returncode == 2, launcher.stdout + launcher.stderr
    assert launcher.stderr.count(message) == 1, launcher.stderr
    assert launcher.stdout == ""  # torchrun's command line is never printed: it never ran
    assert "Traceback" not in launcher.stderr


@pytest.mark.parametrize("nproc", ["0", "-1", "two", "1.5", " 2"])
def test_launch_sh_refuses_nproc_that_is_not_a_positive_integer(nproc: str) -> None:
    launcher = launch("tutorials/02_naive_ddp.py", NPROC=nproc)
    message = f"NPROC is the number of processes per node, a positive integer (got '{nproc}')"
    assert_refused_once(launcher, message)
    assert "see ./launch.sh --help" in launcher.stderr


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"NNODES": "0"}, "NNODES is the number of nodes in the job, a positive integer (got '0')"),
        ({"NNODES": "two"}, "NNODES is the number of nodes in the job, a positive integer"),
        (
            {"NNODES": "2", "NODE_RANK": "2"},
            "NODE_RANK is this node's index, 0 to 1 with NNODES=2 (got '2')",
        ),
        ({"NODE_RANK": "-1"}, "NODE_RANK is this node's index, 0 to 0 with NNODES=1 (got '-1')"),
        (
            {"MAX_RESTARTS": "-1"},
            "MAX_RESTARTS is how many times torchrun may restart the "
            "workers, a whole number >= 0 (got '-1')",
        ),
        ({"MAX_RESTARTS": "2.5"}, "a whole number >= 0 (got '2.5')"),
    ],
)
def test_launch_sh_refuses_a_bad_setting(settings: dict[str, str], message: str) -> None:
    assert_refused_once(launch("tutorials/02_naive_ddp.py", **settings), message)


def test_launch_sh_refuses_a_script_that_does_not_exist() -> None:
    launcher = launch("tutorials/02_naive.py", "--steps", "3")
    assert_refused_once(launcher, f"there is no file 'tutorials/02_naive.py' (looked in {REPO})")
    assert "give the path of a Python script, e.g. tutorials/02_naive_ddp.py" in launcher.stderr
    assert_refused_once(launch("tutorials"), "'tutorials' is a folder")


@pytest.mark.parametrize(
    "args, settings, message",
    [
        (
            ["--iters", "2", "--link", "alpha=200us,bandwidth=0"],
            {},
            "launch.sh: --link: cannot read the link 'alpha=200us,bandwidth=0': bandwidth=0 is "
            "zero; bandwidth must be a rate > 0",
        ),
        (
            ["--link=alpha=200,bandwidth=1gbit"],
            {},
            "launch.sh: --link: cannot read the link 'alpha=200,bandwidth=1gbit': alpha=200 has "
            "no unit",
        ),
        ([], {"MINIDDP_LINK": "fast"}, "launch.sh: $MINIDDP_LINK: cannot read the link 'fast'"),
    ],
)
def test_launch_sh_reads_a_chapters_link_once_before_torchrun(
    args: list[str], settings: dict[str, str], message: str
) -> None:
    launcher = launch("tutorials/04_overlap.py", *args, **settings)
    assert_refused_once(launcher, message)
    assert "'alpha=200us,bandwidth=1gbit'" in launcher.stderr  # a valid link to copy
