"""The exercises in tutorials/exercises/: each stub, as shipped, has its rung's class name,
signature and claims, and fails the checks its rung passes, with a message that says which
exercise to fill in; a class that gets the numbers right but skips the exercise's idea fails
that idea's check, which names it; a bad `--ddp` is refused at once, naming the problem; and
the command a learner runs on a stub fails, readably: the learner's own error first, once.

One fixed spec (FIXED_SPEC), two ranks: the rungs' random examples are
tests/test_ddp_equivalence.py's job; this file only proves that the stubs are where the
learner starts and the rungs are where the learner can arrive. The same for the two exercises
that are not rungs, each held to its reference's checks: the ring all-reduce (`--ring`,
tests/test_collectives.py) and ZeRO-1 (`--zero1`, tests/test_sharding.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import textwrap
from pathlib import Path

import pytest

from miniddp.steps import (
    LADDER,
    BucketedDDP,
    CommHookDDP,
    NaiveDDP,
    OverlapDDP,
    TorchLayoutDDP,
    UnusedParametersDDP,
)
from tests.collective_tasks import Case
from tests.harness.equivalence import FIXED_SPEC, check_claims
from tests.harness.idea_checks import (
    check_buckets,
    check_no_sync,
    check_overlap,
    check_torch_layout_at_default_caps,
    check_torch_layout_from_rank_0s_order,
)
from tests.harness.option_checks import (
    check_comm_hook,
    check_gradient_as_bucket_view,
    check_unused_parameters,
)
from tests.harness.pool import RankError, RankFailure
from tests.harness.processes import child_env, run_in_own_session, tail
from tests.harness.your_code import ring_option, zero1_option
from tests.harness.your_ddp import check_your_ddp, your_error_first
from tests.sharding_tasks import ShardSpec
from tests.test_collectives import check_ring_promise, check_ring_values
from tests.test_sharding import check_zero1_class
from tests.workloads import load_implementation

REPO = Path(__file__).resolve().parents[1]
EXERCISES = REPO / "tutorials" / "exercises"
# (exercise number, stub file, the rung it rebuilds)
STUBS = [
    (2, "naive.py", NaiveDDP),
    (3, "overlap.py", OverlapDDP),
    (4, "buckets.py", BucketedDDP),
    (5, "torch_layout.py", TorchLayoutDDP),
    (7, "unused.py", UnusedParametersDDP),
    (8, "comm_hooks.py", CommHookDDP),
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


@pytest.mark.parametrize("rung", [rung for _, _, rung in STUBS])
def test_the_rung_passes_what_its_stub_fails(rank_pools, rung):
    check_claims(rank_pools, f"{rung.__module__}:{rung.__name__}", 2, FIXED_SPEC)


def test_the_learners_command_fails_on_a_stub_and_says_why(tmp_path):
    """What a learner types first. -x stops at the fixed example, before hypothesis's search."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "tests/test_ddp_equivalence.py",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        "--ddp",
        "tutorials/exercises/naive.py:NaiveDDP",
    ]
    # As in a learner's terminal: with $CI set, pytest's summary repeats every message whole.
    env = child_env(tmp_path, drop=("CI",))
    returncode, output = run_in_own_session(command, env, timeout=300)
    assert returncode == 1, f"expected failing tests (exit 1), got {returncode}:\n{tail(output)}"
    assert "1 failed" in output, tail(output)
    todo = "NotImplementedError: TODO exercise 2 (tutorials/exercises/naive.py, chapter 02)"
    assert output.count(todo) == 1, tail(output)
    assert "tutorials/exercises/naive.py:" in output and "raised on ranks 0, 1" in output, output
    assert "tests/harness/pool.py" not in output, output  # no harness frames


def write_class(tmp_path: Path, source: str) -> str:
    """A learner's file holding `source`; returns its path."""
    path = tmp_path / "mine.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


# A class that passes the property checks without the exercise's idea, and the idea it skips.
RUNG_2_RENAMED = """
    from miniddp.steps.overlap import OverlapDDP

    class BucketedDDP(OverlapDDP):
        "Rung 2 under rung 3's name: one all-reduce per gradient, no buckets."
"""
EQUAL_CAPS = """
    from miniddp.steps.torch_layout import TorchLayoutDDP

    class Mine(TorchLayoutDDP):
        "torch's layout but one cap for every bucket, also at bucket_cap_mb=None."
        def __init__(self, module, *, bucket_cap_mb=None):
            super().__init__(module, bucket_cap_mb=bucket_cap_mb)
            self._layout.first_cap = self._layout.cap
"""
OWN_ORDER = """
    from miniddp.steps import torch_layout

    class TorchLayoutDDP(torch_layout.TorchLayoutDDP):
        "torch's caps, but each rank rebuilds its buckets from its own gradients' order."
        def _rebuild_buckets(self):
            self._layout.rebuild(self._layout.ready_order)
"""
NO_SYNC_THAT_SENDS = """
    import contextlib
    from miniddp.steps.torch_layout import TorchLayoutDDP

    class Mine(TorchLayoutDDP):
        "A no_sync() that changes nothing: every micro-step all-reduces, right but wasteful."
        def no_sync(self):
            return contextlib.nullcontext()
"""


BLOCKING_HOOKS = {
    "dist.all_reduce(grad)": "dist.all_reduce(param.grad)",
    "async_op=True then .wait()": "dist.all_reduce(param.grad, async_op=True).wait()",
}
BLOCKING_OVERLAP = """
    import torch.distributed as dist
    from torch.autograd import Variable
    from miniddp.steps.overlap import OverlapDDP

    class Done:
        def wait(self):
            pass

    class Mine(OverlapDDP):
        "Right numbers, no overlap: each hook waits for its own all-reduce before returning."
        def _on_gradient_ready(self, index, param):
            if not self._in_flight:
                Variable._execution_engine.queue_callback(self._finish_backward)
            param.grad.mul_(1.0 / self.world_size)
            BLOCKING
            self._in_flight.append((index, Done()))
"""
DEFERRED_BUCKETS = """
    from miniddp.steps.buckets import BucketedDDP as Rung3

    class BucketedDDP(Rung3):
        "Rung 3's buckets, every one launched only when backward has ended."
        def _launch_full_buckets(self):
            pass

        def _finish_backward(self):
            Rung3._launch_full_buckets(self)
            super()._finish_backward()
"""
NO_SYNC_AT_BACKWARD = """
    from miniddp.steps.no_sync import NoSyncDDP

    class Mine(NoSyncDDP):
        "no_sync() read by the hooks, at backward time, instead of by the forward."
        def forward(self, *inputs, **kwargs):
            flag, self._require_backward_grad_sync = self._require_backward_grad_sync, True
            try:
                return super().forward(*inputs, **kwargs)
            finally:
                self._require_backward_grad_sync = flag

        def _on_gradient_ready(self, index, param):
            if self._require_backward_grad_sync:
                super()._on_gradient_ready(index, param)
"""


@pytest.mark.parametrize("spelling", list(BLOCKING_HOOKS))
def test_a_hook_that_waits_for_its_all_reduce_fails_the_overlap_claim(
    rank_pools, tmp_path, spelling
):
    """Both blocking spellings give the right gradients and no overlap at all."""
    path = write_class(tmp_path, BLOCKING_OVERLAP.replace("BLOCKING", BLOCKING_HOOKS[spelling]))
    if spelling == "dist.all_reduce(grad)":
        check_claims(rank_pools, f"{path}:Mine", 2, FIXED_SPEC)  # its numbers are right
    with pytest.raises(AssertionError, match=r"idea of overlap \(exercise 3, chapter 02b\)"):
        check_overlap(rank_pools, f"{path}:Mine")


def test_buckets_launched_only_at_the_end_of_backward_fail_the_buckets_claim(rank_pools, tmp_path):
    path = write_class(tmp_path, DEFERRED_BUCKETS)
    with pytest.raises(AssertionError, match="left only after every gradient was ready"):
        check_buckets(rank_pools, f"{path}:BucketedDDP")


def test_a_no_sync_read_at_backward_time_fails_the_no_sync_claim(rank_pools, tmp_path):
    """It passes the old counts (forward and backward both inside no_sync) but not chapter
    05's pitfall, split either way, against torch's DDP."""
    path = write_class(tmp_path, NO_SYNC_AT_BACKWARD)
    with pytest.raises(AssertionError, match=r"decided at forward \(chapter 05\)"):
        check_no_sync(rank_pools, f"{path}:Mine")


def test_rung_2_renamed_fails_the_buckets_claim_which_names_the_idea(rank_pools, tmp_path):
    path = write_class(tmp_path, RUNG_2_RENAMED)
    check_claims(rank_pools, f"{path}:BucketedDDP", 2, FIXED_SPEC)  # its numbers are right
    with pytest.raises(AssertionError, match=r"rung 3's rule gives \d+ buckets.*idea of buckets"):
        check_buckets(rank_pools, f"{path}:BucketedDDP")


def test_one_cap_for_every_bucket_fails_torch_layout_at_the_default_caps(rank_pools, tmp_path):
    path = write_class(tmp_path, EQUAL_CAPS)
    check_claims(rank_pools, f"{path}:Mine", 2, FIXED_SPEC)  # an explicit cap: both equal
    with pytest.raises(AssertionError, match="torch caps the first bucket at 1 MiB"):
        check_torch_layout_at_default_caps(rank_pools, f"{path}:Mine")


def test_a_rebuild_from_each_ranks_own_order_fails_torch_layout(rank_pools, tmp_path):
    """Right on identical ranks, where every rank's order is rank 0's; where the twin layers
    come ready in another order on rank 1, its buckets mix the twins' gradients."""
    path = write_class(tmp_path, OWN_ORDER)
    check_claims(rank_pools, f"{path}:TorchLayoutDDP", 2, FIXED_SPEC)  # its numbers are right
    with pytest.raises(AssertionError, match=r"rank 1: .*rank 0's order.*chapter 03e"):
        check_torch_layout_from_rank_0s_order(rank_pools, f"{path}:TorchLayoutDDP")


def test_a_no_sync_that_still_sends_fails_the_no_sync_claim(rank_pools, tmp_path):
    path = write_class(tmp_path, NO_SYNC_THAT_SENDS)
    with pytest.raises(AssertionError, match="ran inside no_sync\\(\\) and sent \\d+ all-reduces"):
        check_no_sync(rank_pools, f"{path}:Mine")


USAGE_NEVER_SHARED = {
    "every parameter counted as used": "[True] * len(self._here)",
    "only this rank's marks": "[bool(mark) for mark in self._here.tolist()]",
}
RUNG_6_WITHOUT_THE_USAGE_ALL_REDUCE = """
    from miniddp.steps import unused

    class Usage(unused.ParameterUsage):
        "No all-reduce of the marks."
        def on_any_rank(self, device):
            used = USED
            self.clear()
            return used

    class UnusedParametersDDP(unused.UnusedParametersDDP):
        def __init__(self, module, **options):
            super().__init__(module, **options)
            self._usage = Usage(len(self.params))
"""
RUNG_6_WITHOUT_THE_GRAPH_WALK = """
    from miniddp.steps import unused

    class UnusedParametersDDP(unused.UnusedParametersDDP):
        "Right numbers: what got no gradient is filled with zeros when backward ends."
        def _start_reducing(self):
            self._unused_in_forward = []
            super()._start_reducing()
"""


@pytest.mark.parametrize("used", list(USAGE_NEVER_SHARED))
def test_a_rung_6_that_never_all_reduces_usage_fails_the_unused_claim(rank_pools, tmp_path, used):
    """Counted as used everywhere, a head no rank used gets zeros, not None; counted by this
    rank alone, a head rank 0 used stays None on rank 1, not the average."""
    source = RUNG_6_WITHOUT_THE_USAGE_ALL_REDUCE.replace("USED", USAGE_NEVER_SHARED[used])
    path = write_class(tmp_path, source)
    problem = "No rank used 'extra_head" if used.startswith("every") else "rank 0 did"
    with pytest.raises(AssertionError, match=rf"{problem}.*exercise 7, chapter 05b"):
        check_unused_parameters(rank_pools, f"{path}:UnusedParametersDDP")


def test_a_rung_6_without_the_graph_walk_fails_the_unused_claim(rank_pools, tmp_path):
    path = f"{write_class(tmp_path, RUNG_6_WITHOUT_THE_GRAPH_WALK)}:UnusedParametersDDP"
    spec = dataclasses.replace(
        FIXED_SPEC, model=dataclasses.replace(FIXED_SPEC.model, unused="all_ranks")
    )
    check_claims(rank_pools, path, 2, dataclasses.replace(spec, find_unused_parameters=True))
    with pytest.raises(AssertionError, match=r"walk the autograd graph.*chapter 05b"):
        check_unused_parameters(rank_pools, path)


RUNG_7_THAT_SKIPS_ITS_IDEA = {
    # takes the hook and never calls it: every bucket is gloo's all-reduce of the average
    "hook ignored": (
        "def register_comm_hook(self, state, hook):\n    pass",
        r"called the registered hook 0 times, torch's DDP \d+ times",
    ),
    # calls the hook on a bucket already divided by W
    "divided before the hook": (
        "def register_comm_hook(self, state, hook):\n"
        "    super().register_comm_hook(state, hook)\n"
        "    self._divide_by = self.world_size",
        "yours were divided by W, and the hook divides again",
    ),
    # the future's answer dropped: the bucket keeps what went in
    "future's tensor dropped": (
        "def _all_reduce(self, bucket):\n"
        "    future = super()._all_reduce(bucket)\n"
        "    future.wait()\n"
        "    return dist.all_reduce(torch.zeros(1), async_op=True)",
        "is the future's tensor",
    ),
}
RUNG_7 = """
import torch
import torch.distributed as dist
from miniddp.steps import comm_hooks

class CommHookDDP(comm_hooks.CommHookDDP):
    METHOD
"""


@pytest.mark.parametrize("skipped", list(RUNG_7_THAT_SKIPS_ITS_IDEA))
def test_a_rung_7_that_skips_the_hooks_protocol_fails_the_comm_hook_claim(
    rank_pools, tmp_path, skipped
):
    method, problem = RUNG_7_THAT_SKIPS_ITS_IDEA[skipped]
    source = RUNG_7.replace("METHOD", textwrap.indent(method, "    ").strip())
    path = write_class(tmp_path, source)
    with pytest.raises(AssertionError, match=rf"{problem}.*exercise 8, chapter 05b"):
        check_comm_hook(rank_pools, f"{path}:CommHookDDP")


COPIES_IN_AND_OUT = """
    from miniddp.steps import comm_hooks

    class CommHookDDP(comm_hooks.CommHookDDP):
        "Takes gradient_as_bucket_view and ignores it: .grad is copied in and out, as rung 6."
        def __init__(self, module, *, gradient_as_bucket_view=False, **options):
            super().__init__(module, **options)
"""


def test_gradients_copied_out_of_their_buckets_fail_the_bucket_view_claim(rank_pools, tmp_path):
    path = write_class(tmp_path, COPIES_IN_AND_OUT)
    with pytest.raises(AssertionError, match=r"share a storage.*exercise 8, chapter 05b"):
        check_gradient_as_bucket_view(rank_pools, f"{path}:CommHookDDP")


def test_the_rungs_pass_the_idea_checks_of_their_exercises(rank_pools):
    for rung in LADDER[1:]:  # rung 2 (overlap) and every rung above it, MiniDDP included
        check_overlap(rank_pools, f"{rung.__module__}:{rung.__name__}")
    check_buckets(rank_pools, "miniddp.steps.buckets:BucketedDDP")
    check_torch_layout_at_default_caps(rank_pools, "miniddp.steps.torch_layout:TorchLayoutDDP")
    for rung in LADDER[3:]:  # rung 4 (torch's layout) and every rung above it
        check_torch_layout_from_rank_0s_order(rank_pools, f"{rung.__module__}:{rung.__name__}")
    check_no_sync(rank_pools, "miniddp.data_parallel.ddp:MiniDDP")
    for rung in LADDER[5:]:  # rung 6 (unused parameters) and every rung above it
        check_unused_parameters(rank_pools, f"{rung.__module__}:{rung.__name__}")
    for rung in LADDER[6:]:  # rung 7 (comm hooks) and MiniDDP
        check_comm_hook(rank_pools, f"{rung.__module__}:{rung.__name__}")
        check_gradient_as_bucket_view(rank_pools, f"{rung.__module__}:{rung.__name__}")


@pytest.mark.parametrize(
    "source, name, problem",
    [
        ("class A:\n    pass\n", "B", "defines no B; it defines: A"),
        ("def f(:\n", "A", "mine.py:1: SyntaxError"),
        ("import not_a_module_anywhere\n", "A", "raised ModuleNotFoundError"),
        ("A = 3\n", "A", "A is a int, not a class"),
        ("class A:\n    def __init__(self, module):\n        pass\n", "A", "cannot be called"),
        (
            "class A:\n    def __init__(self, m, *, bucket_cap_mb=None):\n        pass\n",
            "A",
            "has no finish_gradient_synchronization()",
        ),
    ],
    ids=["no-such-class", "syntax-error", "import-fails", "not-a-class", "signature", "protocol"],
)
def test_a_bad_ddp_option_is_refused_naming_the_problem(tmp_path, source, name, problem):
    path = write_class(tmp_path, source)
    with pytest.raises(pytest.UsageError, match=re.escape(problem)):
        check_your_ddp(f"{path}:{name}")


def test_a_missing_file_is_named_as_missing_not_as_a_bad_format(tmp_path):
    with pytest.raises(pytest.UsageError, match="there is no file nonexistent.py"):
        check_your_ddp("nonexistent.py:X")
    with pytest.raises(pytest.UsageError, match="takes FILE.py:CLASS"):
        check_your_ddp("naive:NaiveDDP")


def test_the_bad_option_stops_pytest_at_once_with_one_line(tmp_path):
    command = [
        sys.executable,
        "-m",
        "pytest",
        "tests/test_ddp_equivalence.py",
        "-q",
        "-p",
        "no:cacheprovider",
        "--ddp",
        "nonexistent.py:X",
    ]
    returncode, output = run_in_own_session(command, child_env(tmp_path), timeout=120)
    assert returncode == 4, tail(output)  # pytest's usage error
    assert "ERROR: --ddp nonexistent.py:X: there is no file nonexistent.py" in output, output
    assert "Traceback" not in output, output


def test_the_learners_error_is_shown_once_with_its_line(tmp_path):
    path = tmp_path / "mine.py"
    raised = textwrap.dedent(f"""\
        Traceback (most recent call last):
          File "/repo/tests/harness/pool.py", line 97, in _attempt
            return pickle.dumps(("ok", work()))
          File "{path}", line 12, in finish_gradient_synchronization
            raise NotImplementedError("TODO")
        NotImplementedError: TODO
    """)
    failure = RankFailure("NotImplementedError", "TODO", raised)
    short = your_error_first({0: failure, 1: failure}, path)
    assert short.count("NotImplementedError: TODO") == 1, short
    assert "mine.py:12, in finish_gradient_synchronization" in short, short
    assert "raised on ranks 0, 1" in short and "pool.py" not in short, short
    elsewhere = RankFailure("RuntimeError", "x", raised.replace(str(path), "/other.py"))
    assert your_error_first({0: elsewhere}, path) is None  # not the learner's: the full report


# What a learner might write for exercise 6: no_sync() sets a flag, each forward reads it (and
# refreshes the buffers only after a synced forward), the hook obeys what the forward decided.
NO_SYNC_SOLVED = """
    import contextlib
    import torch
    from miniddp.steps.torch_layout import TorchLayoutDDP

    class NoSyncDDP(TorchLayoutDDP):
        claims = TorchLayoutDDP.claims | {"no-sync"}
        wants_sync = syncing = True

        def __init__(self, module, *, bucket_cap_mb=None, broadcast_buffers=True):
            super().__init__(module, bucket_cap_mb=bucket_cap_mb)
            self.broadcast_buffers = broadcast_buffers

        @contextlib.contextmanager
        def no_sync(self):
            self.wants_sync = False
            try:
                yield
            finally:
                self.wants_sync = True

        def forward(self, *inputs, **kwargs):
            after_synced = self.syncing
            self.syncing = self.wants_sync and torch.is_grad_enabled()
            if after_synced and self.broadcast_buffers:
                return super().forward(*inputs, **kwargs)
            if self._layout.rebuild_due and torch.is_grad_enabled():
                self._rebuild_buckets()
            return self.module(*inputs, **kwargs)

        def _on_gradient_ready(self, index, param):
            if self.syncing:
                super()._on_gradient_ready(index, param)
"""
NO_SYNC_CLAIMS = frozenset({"batchnorm", "mixed-dtypes", "torch-layout", "no-sync"})


def test_the_no_sync_stub_fails_and_a_solution_passes_its_claims(rank_pools, tmp_path):
    stub = f"{EXERCISES / 'no_sync.py'}:NoSyncDDP"
    assert load_implementation(stub).claims == NO_SYNC_CLAIMS
    with pytest.raises(RankError, match="NotImplementedError: TODO exercise 6 "):
        check_claims(rank_pools, stub, 2, FIXED_SPEC, NO_SYNC_CLAIMS)
    solved = f"{write_class(tmp_path, NO_SYNC_SOLVED)}:NoSyncDDP"
    check_claims(rank_pools, solved, 3, FIXED_SPEC, NO_SYNC_CLAIMS)  # torch's bits at W = 3
    check_no_sync(rank_pools, solved)


# The same solution with the buffer rule skipped: rank 0's buffers broadcast before every
# forward, inside no_sync too. Its gradients are right; only its BatchNorm statistics are not
# torch's, so the exercise's own command must put BatchNorm in the model to catch it.
NO_SYNC_SKIPS_THE_BUFFER_RULE = NO_SYNC_SOLVED.replace(
    "if after_synced and self.broadcast_buffers:", "if self.broadcast_buffers:"
)


def test_the_no_sync_exercises_command_catches_a_solution_that_skips_the_buffer_rule(
    rank_pools, tmp_path
):
    docstring = (EXERCISES / "no_sync.py").read_text()
    claims = frozenset(re.search(r"--ddp-claims ([\w,-]+)", docstring).group(1).split(","))
    assert NO_SYNC_SKIPS_THE_BUFFER_RULE != NO_SYNC_SOLVED
    wrong = f"{write_class(tmp_path, NO_SYNC_SKIPS_THE_BUFFER_RULE)}:NoSyncDDP"
    with pytest.raises(AssertionError, match="running_mean' differs from torch's"):
        check_claims(rank_pools, wrong, 2, FIXED_SPEC, claims)


# Exercises 1 and 9, checked where their references are: the ring by tests/test_collectives.py's
# checks (`--ring`), ZeRO-1 by tests/test_sharding.py's against torch's (`--zero1`).
RING_STUB = f"{EXERCISES / 'ring.py'}:all_reduce"
ZERO1_STUB = f"{EXERCISES / 'zero1.py'}:ZeroRedundancyOptimizer"
FIXED_RING = Case("all_reduce", numel=10, dtype="float32", op="SUM", seed=1)


def test_the_ring_stub_fails_with_its_todo_and_the_reference_passes(rank_pools):
    assert ring_option(RING_STUB) == RING_STUB  # its file and signature pass the up-front check
    with pytest.raises(RankError, match="NotImplementedError: TODO exercise 1 "):
        check_ring_values(rank_pools, RING_STUB, 2, FIXED_RING)
    reference = "miniddp.collectives.ring:all_reduce"
    check_ring_values(rank_pools, reference, 3, FIXED_RING)
    check_ring_promise(rank_pools, reference, 3)


def test_a_reduce_then_broadcast_fails_the_rings_promise_naming_it(rank_pools):
    """Right numbers, no ring: the tree sends whole tensors, and at W = 3 rank 1 sends to 0."""
    tree = "miniddp.collectives.tree:all_reduce"
    check_ring_values(rank_pools, tree, 2, FIXED_RING)
    with pytest.raises(AssertionError, match="a ring's message is one of W = 2 chunks"):
        check_ring_promise(rank_pools, tree, 2)
    with pytest.raises(AssertionError, match="only to its right neighbour"):
        check_ring_promise(rank_pools, tree, 3)


def test_the_zero1_stub_fails_with_its_todo_and_the_reference_passes(rank_pools):
    assert zero1_option(ZERO1_STUB) == ZERO1_STUB
    with pytest.raises(RankError, match="NotImplementedError: TODO exercise 9 "):
        check_zero1_class(rank_pools, ZERO1_STUB, 2, ShardSpec(steps=2))
    check_zero1_class(rank_pools, "miniddp.sharding:ZeroRedundancyOptimizer", 3, ShardSpec())


EVERY_STATE_EVERYWHERE = """
    from torch.optim import Optimizer

    class Mine(Optimizer):
        "Plain AdamW under ZeRO's name: torch's bits, and all of Adam's state on every rank."
        def __init__(self, params, optimizer_class, **defaults):
            params = list(params)
            super().__init__(params, defaults)
            self.optim = optimizer_class(params, **defaults)

        def step(self, closure=None):
            return self.optim.step(closure)
"""


def test_every_state_on_every_rank_fails_the_zero1_check_naming_the_idea(rank_pools, tmp_path):
    path = write_class(tmp_path, EVERY_STATE_EVERYWHERE)
    with pytest.raises(AssertionError, match="keeps and steps the state of its own share"):
        check_zero1_class(rank_pools, f"{path}:Mine", 2, ShardSpec(steps=2))


@pytest.mark.parametrize(
    "check, source, name, problem",
    [
        (ring_option, "class all_reduce:\n    pass\n", "all_reduce", "the tests call a function"),
        (ring_option, "def all_reduce(flat):\n    pass\n", "all_reduce", "(peers, flat, op)"),
        (ring_option, "def ring(p, f, o):\n    pass\n", "all_reduce", "it defines: ring"),
        (zero1_option, "def Z(params):\n    pass\n", "Z", "not a class"),
        (zero1_option, "class Z:\n    def __init__(self, params):\n        pass\n", "Z", "cannot"),
    ],
    ids=["ring-class", "ring-signature", "ring-missing", "zero1-function", "zero1-signature"],
)
def test_a_bad_ring_or_zero1_option_is_refused_naming_the_problem(
    tmp_path, check, source, name, problem
):
    path = write_class(tmp_path, source)
    with pytest.raises(pytest.UsageError, match=re.escape(problem)):
        check(f"{path}:{name}")
