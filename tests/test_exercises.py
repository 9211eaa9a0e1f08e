"""The exercises in tutorials/exercises/: each stub, as shipped, has its rung's class name,
signature and claims, and fails the checks its rung passes, with a message that says which
exercise to fill in; and the command a learner runs on a stub fails, readably.

One fixed spec (FIXED_SPEC), two ranks: the rungs' random examples are
tests/test_ddp_equivalence.py's job; this file only proves that the stubs are where the
learner starts and the rungs are where the learner can arrive.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest

from miniddp.steps import BucketedDDP, NaiveDDP, OverlapDDP, TorchLayoutDDP
from tests.harness.equivalence import FIXED_SPEC, check_claims
from tests.harness.pool import RankError
from tests.harness.processes import child_env, run_in_own_session, tail
from tests.workloads import load_implementation

REPO = Path(__file__).resolve().parents[1]
EXERCISES = REPO / "tutorials" / "exercises"
# (exercise number, stub file, the rung it rebuilds)
STUBS = [
    (1, "naive.py", NaiveDDP),
    (2, "overlap.py", OverlapDDP),
    (3, "buckets.py", BucketedDDP),
    (4, "torch_layout.py", TorchLayoutDDP),
]


def stub_path(file: str, rung: type) -> str:
    return f"{EXERCISES / file}:{rung.__name__}"


@pytest.mark.parametrize("number, file, rung", STUBS, ids=[file for _, file, _ in STUBS])
def test_a_stub_is_its_rung_with_the_idea_left_out(rank_pools, number, file, rung):
    stub = load_implementation(stub_path(file, rung))
    assert stub.__name__ == rung.__name__
    assert inspect.signature(stub.__init__) == inspect.signature(rung.__init__)
    assert stub.claims == rung.claims
    # It imports and constructs (the failure comes from a TODO inside training, not before),
    # and the checks the rung passes catch it, naming the exercise.
    with pytest.raises(RankError, match=f"NotImplementedError: TODO exercise {number} "):
        check_claims(rank_pools, stub_path(file, rung), 2, FIXED_SPEC)


@pytest.mark.parametrize("rung", [NaiveDDP, OverlapDDP, BucketedDDP, TorchLayoutDDP])
def test_the_rung_passes_what_its_stub_fails(rank_pools, rung):
    check_claims(rank_pools, f"{rung.__module__}:{rung.__name__}", 2, FIXED_SPEC)


def test_the_learners_command_fails_on_a_stub_and_says_why(tmp_path):
    """What a learner types first. -x stops at the fixed example, before hypothesis's search."""
    command = [
        sys.executable, "-m", "pytest", "tests/test_ddp_equivalence.py", "-x", "-q",
        "-p", "no:cacheprovider", "--ddp", "tutorials/exercises/naive.py:NaiveDDP",
    ]  # fmt: skip
    returncode, output = run_in_own_session(command, child_env(tmp_path), timeout=300)
    assert returncode == 1, f"expected failing tests (exit 1), got {returncode}:\n{tail(output)}"
    assert "1 failed" in output, tail(output)
    assert "TODO exercise 1 (tutorials/exercises/naive.py, chapter 02)" in output, tail(output)
