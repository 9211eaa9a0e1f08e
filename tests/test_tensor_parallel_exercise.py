"""The tensor-parallel exercise (tutorials/exercises/tensor_parallel.py): as shipped, its f and g
fail the tests miniddp.tensor_parallel passes, naming the exercise; the library's own f and g,
loaded through the same seam a learner's file goes through, pass them; and the command the
learner types fails on the stub, readably.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import tensor_parallel_tasks as tasks
from tests.harness.pool import RankError
from tests.harness.processes import child_env, run_in_own_session, tail
from tests.tensor_parallel_tasks import TPSpec

REPO = Path(__file__).resolve().parents[1]
STUB = str(REPO / "tutorials" / "exercises" / "tensor_parallel.py")
ANSWER = str(REPO / "miniddp" / "tensor_parallel" / "layers.py")


def test_the_stub_fails_naming_the_exercise(pool2):
    with pytest.raises(RankError, match="NotImplementedError: TODO exercise 10 "):
        pool2.run(tasks.with_f_and_g, STUB, tasks.all_reduces_of_one_step, TPSpec())


def test_the_answer_passes_through_the_learners_seam(pool2):
    spec = TPSpec(model="block", bias=False)
    for report in pool2.run(tasks.with_f_and_g, ANSWER, tasks.largest_differences, spec):
        assert report["bitwise"]["grads"] == [] and report["bitwise"]["params"] == []
        assert max(report["ours"].values()) <= 1e-5


@pytest.mark.slow  # 10 s; the stub's failure is checked in-process too
def test_the_learners_command_fails_on_the_stub_and_says_why(tmp_path):
    command = [
        *(sys.executable, "-m", "pytest", "tests/test_tensor_parallel.py", "-x", "-q"),
        *("-p", "no:cacheprovider", "-k", "one_block"),
    ]
    env = child_env(tmp_path, **{tasks.LEARNERS_F_AND_G: STUB})
    returncode, output = run_in_own_session(command, env, 240)
    assert returncode == 1, tail(output)
    assert "TODO exercise 10 " in output, tail(output)
