"""The ladder (miniddp/steps/): its command, and a smoke check that every rung trains like
torch's DDP. The full property tests over `LADDER` live in tests/test_ddp_equivalence.py.

What the pool's ranks run is a module-level function of this file, next to its test (the workers
import `tests.test_steps`): mostly a rung of the ladder and torch's DDP, trained side by side on
the same awkward little model and the same data."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

import miniddp.data_parallel.default_hooks as default_hooks
from miniddp import MiniDDP
from miniddp.steps import CLAIMS, LADDER
from miniddp.steps.__main__ import main as steps_main
from tests.harness.pool import RankFailure


def steps_command(*args: str) -> subprocess.CompletedProcess:
    """`python -m miniddp.steps ARGS`, run by its `main` in this process: the same parser and
    output, without the new interpreter's 3 s of importing torch (the list test runs the
    real command)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            returncode = steps_main(list(args))
        except SystemExit as refused:  # argparse's error(): the message is on stderr
            returncode = refused.code
    command = ["python", "-m", "miniddp.steps", *args]
    return subprocess.CompletedProcess(command, returncode, out.getvalue(), err.getvalue())


def test_list_names_every_rung_in_order_with_its_file():
    command = [sys.executable, "-m", "miniddp.steps", "list"]
    listing = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0, listing.stderr
    rows = listing.stdout.splitlines()
    assert len(rows) == len(LADDER) == 8
    for number, (row, cls) in enumerate(zip(rows, LADDER), start=1):
        assert row.split()[:2] == [str(number), cls.__name__]
    assert "miniddp/steps/naive_ddp.py" in rows[0] and "miniddp/data_parallel/ddp.py" in rows[7]


def test_diff_shows_what_one_rung_adds_to_the_previous():
    result = steps_command("diff", "2", "3")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == ["--- miniddp/steps/overlap.py", "+++ miniddp/steps/buckets.py"]
    added = [line for line in lines if line.startswith("+") and not line.startswith("+++")]
    removed = [line for line in lines if line.startswith("-") and not line.startswith("---")]
    assert any("def assign_buckets" in line for line in added)
    assert any("class OverlapDDP" in line for line in removed)


# What MiniDDP adds to rung 7, each with the names its code is written in. Every hunk of
# `diff 7 8` must change a line naming one of them, and every definition only MiniDDP has must
# be one of them: a hunk that only writes rung 7's idea another way (a renamed attribute, a
# method moved, a loop spelt differently) fails the test.
PRODUCTION_EXTRAS = {
    "same-model checks, and what a wrapper refuses at once": [
        *("check_wrappable", "verify_same_model_on_every_rank", "_first_difference"),
        *("broadcast_from_rank0", "settings", "HOW_TO_LAUNCH"),
        *("_shards_of_one_tensor_parallel_group", "placement_of", "group_ranks"),
    ],
    "a pipeline's stage arms the backward of a forward run in no_sync": [
        *("prepare_for_backward", "require_backward_grad_sync"),
    ],
    "named faults: the one wait seam": ["wait_for", "_wait"],
    "Join": [
        *("Join", "Joinable", "JoinHook", "ShadowsTraining", "_tell_join_this_rank_trains"),
        *("_sync_buffers", "_buffers_to_sync", "_divide_by_initial_world_size"),
        *("last_on_any_rank", "resend_last", "joined_forward", "joined_backward"),
        *("copy_model_from", "any_rank_syncs", "highest_rank_where"),
    ],
    "static_graph": [
        *("static_graph", "_static_graph", "StaticGraph", "GRAPH_CHANGED", "warnings"),
        "FINDS_UNUSED_ITSELF",
        "_static_graph_first_backward_ends",
    ],
    "a process group of its own": ["process_group", "group"],
    # Rung 7 hands a bucket its all-reduce at launch. MiniDDP's all-reduce needs the wrapper's
    # group and the named faults' wait seam: each bucket holds them in its reducer.
    "the reducer that carries the group and the wait seam": ["Reducer", "reducer", "_reducer"],
    # (and rung 7's refusal of a missing gradient moves before the launches, to abandon them)
    "reentrant and second backwards, an unfinished backward": [
        *("SYNCED", "REDUCING", "_marked_ready", "_abandon_unfinished_backward", "no_gradient"),
        *("gradient_after_sync", "gradient_twice", "no_gradient_unlike_the_first"),
        *("not_mixed_precision", "refusals"),
        *("when_backward_reaches", "not synced", '"backward", "start"', "TYPE_CHECKING"),
    ],
    "a module wrapped again hands its hooks over": [
        *("_hooks", "hook_every_parameter", "_HOOKS_OF", "weakref"),
    ],
    "bucket_state and describe, for checkpoints and printing": [
        *("describe", "describe_layout", "BucketInfo", "dataclass", "nbytes", "load_state"),
    ],
    "the speed tricks of miniddp/data_parallel/bucket.py": [
        *("_small", "small_gradient_numel", "_copy_small_gradients", "_copy_all", "averaged"),
        *("_small_runs", "_runs_of_small_gradients"),
    ],
    "mixed precision: fp32 masters, bf16 copies, buckets in reduce_dtype": [
        *("mixed_precision", "MixedPrecision", "ComputeCopies", "_copies", "_leaves"),
        *("reduce_dtype", "divide_after_sum", "in_flight"),
    ],
    "comm hooks over this project's own all-reduces": ["all_reduce_hook", "collectives"],
    # The rungs mix in EventRecorder and note through it (miniddp/observe/events.py says why);
    # the core a learner reads holds one observer that instruments attach from outside.
    "instruments observe from outside": ["observer", "NO_OBSERVER", "Observer"],
    "torch 2.13's arguments (miniddp/data_parallel/arguments.py)": [
        *("init_sync", "device_mesh", "group_of", "buffer_sync", "forward_sync_buffers"),
        *("skip_all_reduce_unused_params", "skip", "skipped", "broadcast_buffers"),
        "join_with_skipped_buckets",
    ],
}
EXTRAS = {name for names in PRODUCTION_EXTRAS.values() for name in names}
RUNGS_MIXIN = "EventRecorder"  # what the rungs note events through; MiniDDP holds an observer
# Rung 7's definitions, and the file MiniDDP defines each one in.
MINIDDP_HOMES = {
    "Bucket": "miniddp/data_parallel/bucket.py",
    "assign_buckets": "miniddp/data_parallel/layout.py",
    "initial_layout": "miniddp/data_parallel/layout.py",
    "BucketLayout": "miniddp/data_parallel/layout.py",
    "ParameterUsage": "miniddp/data_parallel/autograd_graph.py",
    "parameters_not_reached": "miniddp/data_parallel/autograd_graph.py",
    "find_tensors": "miniddp/data_parallel/autograd_graph.py",
    "CommHook": "miniddp/data_parallel/default_hooks.py",
    "GradBucket": "miniddp/data_parallel/default_hooks.py",
    "Phase": "miniddp/data_parallel/ddp.py",
    "MiniDDP": "miniddp/data_parallel/ddp.py",
}


# Rung 7's methods that MiniDDP moved out of the wrapper, and where each went: rung 7 hands a
# full bucket its wrapper's `_all_reduce`; MiniDDP's bucket holds its reducer (bucket.py), which
# carries the group and the wait seam the production all-reduce needs (default_hooks.py).
MOVED = {"_all_reduce": "Reducer.all_reduce"}


def moved_away(lines: list[str]) -> bool:
    """The run only removes one of rung 7's methods in MOVED, and its new home defines it."""
    code = [line for line in lines if line[1:].strip()]
    first = re.match(r"-    def (\w+)\(", code[0]) if code else None
    if not first or any(line[0] != "-" for line in lines) or first[1] not in MOVED:
        return False
    owner, method = MOVED[first[1]].split(".")
    return callable(getattr(getattr(default_hooks, owner), method, None))


def names_an_extra(lines: list[str]) -> bool:
    return any(
        re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", line)
        for line in lines
        for name in EXTRAS
    )


def changes_by_definition(diff: str) -> list[tuple[str, list[str]]]:
    """(the `+++` label, the lines) of each run of changed lines in a definition-by-definition
    diff: finer than a hunk, so that an unrelated change cannot hide next to an extra."""
    changes, previous = [], ""
    for line in diff.splitlines():
        if line.startswith("+++ "):
            changes.append((line[4:], []))
        elif line[:1] in "+-" and not line.startswith("--- "):
            if previous[:1] not in "+-" or previous.startswith("+++ "):
                changes.append((changes[-1][0], []))
            changes[-1][1].append(line)
        previous = line
    return [(label, lines) for label, lines in changes if lines]


@pytest.mark.parametrize("code_only", [True, False], ids=["code", "whole"])
def test_diff_from_the_top_rung_shows_only_what_production_adds(code_only):
    """Rung 7's code is MiniDDP's core, written the same way: `diff 7 8` compares each of rung
    7's definitions with MiniDDP's namesake, wherever it lives, and shows only the extras."""
    result = steps_command("diff", *(["--code"] if code_only else []), "7", "8")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("# rung 7, miniddp/steps/comm_hooks.py -> rung 8, MiniDDP")
    same = lines[1].removeprefix("# the same in both: ").split(", ")
    assert {"assign_buckets", "initial_layout", "parameters_not_reached", "GradBucket"} <= set(same)
    only = dict(row[2:].split(": ") for row in lines[2:] if row.startswith("# only in "))
    assert "only in miniddp/steps/comm_hooks.py" not in only  # nothing of rung 7 goes missing
    for place, names in only.items():
        assert set(names.split(", ")) <= EXTRAS, place
    changes = changes_by_definition(result.stdout)
    assert len(changes) > 10  # the extras are there
    for label, changed in changes:
        if label.endswith("imports from elsewhere"):  # rung 7 needs nothing more, but its mixin
            removed = [line for line in changed if line[0] == "-"]
            assert removed in ([], [f"-from miniddp.observe.events import {RUNGS_MIXIN}"]), changed
        else:
            path, name = label.split(": ")
            assert MINIDDP_HOMES[name] == path, label
        assert names_an_extra(changed) or moved_away(changed), f"a change in {label}: {changed}"


@pytest.mark.parametrize(
    "before, after, added, removed",
    [
        (4, 5, "def no_sync", "class TorchLayoutDDP"),
        (5, 6, "def parameters_not_reached", "class NoSyncDDP"),
        (6, 7, "def register_comm_hook", "class UnusedParametersDDP"),
    ],
)
def test_each_rung_above_torchs_layout_adds_its_idea(before, after, added, removed):
    lines = steps_command("diff", str(before), str(after)).stdout.splitlines()
    assert any(line.startswith("+") and added in line for line in lines)
    assert any(line.startswith("-") and removed in line for line in lines)


def test_diff_code_leaves_out_the_changes_that_are_only_prose():
    """What chapters print: the docstring's new story is told by the chapter itself."""
    everything = steps_command("diff", "4", "5").stdout
    code = steps_command("diff", "--code", "4", "5").stdout
    assert "+++ miniddp/steps/no_sync.py" in code and "+    def no_sync" in code
    assert "+Why the forward decides" in everything and "Why the forward decides" not in code
    changed = [line for line in code.splitlines()[2:] if line[:1] in "+-"]
    kept = [line for line in everything.splitlines()[2:] if line[:1] in "+-"]
    assert set(changed) < set(kept)


@pytest.mark.parametrize("args", [("diff", "0", "3"), ("show", "9"), ("diff", "1", "x")])
def test_a_bad_rung_number_is_refused_with_the_valid_range(args):
    result = steps_command(*args)
    assert result.returncode != 0
    assert "1 to 8" in result.stderr or "invalid int value" in result.stderr


def test_show_prints_the_rungs_source():
    result = steps_command("show", "1")
    assert result.returncode == 0 and "class NaiveDDP" in result.stdout


def test_every_rung_claims_a_subset_of_the_known_claims():
    for cls in LADDER:
        assert {"batchnorm", "mixed-dtypes"} <= cls.claims <= CLAIMS, cls.__name__
    assert "torch-layout" in LADDER[3].claims and "torch-layout" not in LADDER[2].claims


def test_from_torchs_layout_up_each_rung_claims_what_it_adds_and_keeps_the_rest():
    added = [
        {"no-sync"},
        {"find-unused-parameters"},
        {"comm-hook", "gradient-as-bucket-view"},
        set(),  # MiniDDP adds what production needs, no new claim: the top rung's claims
    ]
    for below, above, new in zip(LADDER[3:], LADDER[4:], added):
        assert above.claims == below.claims | new, above.__name__
    assert LADDER[-1].claims == CLAIMS


class Scrambled(nn.Module):
    """Layers registered in one order and used in another, so gradients arrive in neither
    registration order nor its reverse; BatchNorm statistics; optionally a float64 layer."""

    def __init__(self, seed: int, mixed_dtypes: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.head = nn.Linear(16, 3)
        self.first = nn.Linear(6, 16)
        self.norm = nn.BatchNorm1d(16)
        self.middle = nn.Linear(16, 16)
        self.wide = nn.Linear(16, 16).double() if mixed_dtypes else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.middle(self.norm(torch.tanh(self.first(x)))))
        if self.wide is not None:
            hidden = torch.tanh(self.wide(hidden.double())).float()
        return self.head(hidden)


def train(
    wrap: Callable[[nn.Module], nn.Module], mixed_dtypes: bool, steps: int, backwards_per_step: int
) -> dict:
    """Train one replica; gradients after each synchronized backward, state after each step.

    Each rank builds its model from its own seed: the wrapper must start every rank from
    rank 0's weights. Several backwards between optimizer steps accumulate into `.grad`.
    """
    rank = dist.get_rank()
    net = Scrambled(seed=rank, mixed_dtypes=mixed_dtypes)
    model = wrap(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    grads, states = [], []
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(backwards_per_step):
            data = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
            x, y = torch.randn(5, 6, generator=data), torch.randn(5, 3, generator=data)
            nn.functional.mse_loss(model(x), y).backward()
            if hasattr(model, "finish_gradient_synchronization"):  # torch's DDP has none
                model.finish_gradient_synchronization()
            grads.append([p.grad.clone() for p in net.parameters()])
        optimizer.step()
        states.append([t.clone() for t in net.state_dict().values()])
    return {"grads": grads, "states": states, "layout": bucket_layout(model, net)}


def bucket_layout(model: nn.Module, net: nn.Module) -> list[list[str]] | None:
    """Buckets in launch order, as parameter names; None for a rung without buckets."""
    if isinstance(model, DistributedDataParallel):
        name_of = {id(p): n for n, p in net.named_parameters()}
        buckets = model.reducer._get_zeros_like_grad_buckets()
        return [[name_of[id(p)] for p in bucket.parameters()] for bucket in buckets]
    if isinstance(model, MiniDDP):
        return [list(info.param_names) for info in model.buckets]
    if hasattr(model, "buckets"):  # indices: `param_indices` from rung 3 on, as in MiniDDP
        indices = [getattr(b, "param_indices", b.params) for b in model.buckets]
        return [[model.param_names[i] for i in bucket] for bucket in indices]
    return None


def rung_and_torch(
    rung: int, bucket_cap_mb: float | None, mixed_dtypes: bool = False, steps: int = 3
) -> dict:
    """Rung `rung` (numbered from 1) and torch's DDP, with the same cap, one after the other."""
    cls = LADDER[rung - 1]
    return {
        "rung": train(lambda m: cls(m, bucket_cap_mb=bucket_cap_mb), mixed_dtypes, steps, 2),
        "torch": train(
            lambda m: DistributedDataParallel(m, bucket_cap_mb=bucket_cap_mb),
            mixed_dtypes,
            steps,
            2,
        ),
    }


def assert_same_training(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        ours, theirs = result["rung"], result["torch"]
        for kind in ("grads", "states"):
            assert len(ours[kind]) == len(theirs[kind])
            for step, (mine, reference) in enumerate(zip(ours[kind], theirs[kind])):
                for i, (a, b) in enumerate(zip(mine, reference)):
                    assert torch.equal(a, b), f"rank {rank}: {kind}[{step}][{i}] differs"


@pytest.mark.parametrize("rung", range(1, len(LADDER) + 1))
@pytest.mark.parametrize("mixed_dtypes", [False, True])
def test_every_rung_trains_bitwise_like_torchs_ddp_on_two_ranks(rank_pools, rung, mixed_dtypes):
    """On 2 ranks a + b = b + a: any correct rung gives torch's bits, whatever its layout."""
    results = rank_pools(2).run(rung_and_torch, rung, 0.0015, mixed_dtypes, timeout=120)
    assert_same_training(results)


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("bucket_cap_mb", [None, 0.0015, 0.0001])
@pytest.mark.parametrize("rung", [4, 7])
def test_torch_layout_is_torchs_layout_and_bits_at_three_and_four_ranks(
    rank_pools, rung, world_size, bucket_cap_mb
):
    """With 3+ ranks gloo's bits depend on each gradient's offset in its bucket: rung 4 has
    torch's layout, and the rungs above keep it."""
    results = rank_pools(world_size).run(rung_and_torch, rung, bucket_cap_mb, False, timeout=120)
    for result in results:
        assert result["rung"]["layout"] == result["torch"]["layout"]
    assert_same_training(results)


class WithExtraLayer(nn.Module):
    """`extra` takes part in the loss only on the ranks in `used_on`."""

    def __init__(self, used_on: tuple[int, ...]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(4, 2)
        self.extra = nn.Linear(4, 2)
        self.use_extra = dist.get_rank() in used_on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x) + (self.extra(x) if self.use_extra else 0)


def backward_with_extra_layer(rung: int, used_on: tuple[int, ...]) -> str:
    """One backward of a rung whose `extra` layer some ranks (or none) do not use."""
    model = LADDER[rung - 1](WithExtraLayer(used_on))
    model(torch.randn(3, 4)).sum().backward()
    model.finish_gradient_synchronization()
    return "synchronized"


RUNGS = range(1, len(LADDER))  # the ladder's own rungs; MiniDDP has tests of its own


@pytest.mark.parametrize("rung", RUNGS)
def test_a_parameter_unused_on_every_rank_is_named_on_every_rank(pool2, rung):
    outcomes = pool2.run_expecting_errors(backward_with_extra_layer, rung, ())
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, RankFailure), f"rank {rank} did not raise"
        assert outcome.type_name == "RuntimeError"
        for phrase in ("extra.weight", "extra.bias", "find_unused_parameters=True"):
            assert phrase in outcome.message
    assert pool2.alive  # every rank issued the same collectives: the pool is still in step


@pytest.mark.parametrize("rung", [1, 3, 4, 5, 6, 7])
def test_a_parameter_unused_on_one_rank_only_raises_there_without_a_hang(pool2, rung):
    """That rank sends zeros in its place, so the ranks stay in step, then refuses. (Rung 2
    launches in gradient-ready order and cannot stay in step: see overlap.py.)"""
    outcomes = pool2.run_expecting_errors(backward_with_extra_layer, rung, (1,))
    assert isinstance(outcomes[0], RankFailure) and "extra.weight" in outcomes[0].message
    assert outcomes[1] == "synchronized"
    assert pool2.alive


def all_reduces_per_micro_step(rung: int, micro_steps: int) -> tuple[list[list[int]], int]:
    """After one plain step (the buckets' rebuild), two optimizer steps of `micro_steps`
    micro-steps, all but the last inside no_sync(): the all-reduces each micro-step launched,
    and the number of buckets."""
    model = LADDER[rung - 1](Scrambled(seed=0, mixed_dtypes=False), bucket_cap_mb=0.0015)
    x, y = torch.randn(5, 6), torch.randn(5, 3)
    for _ in range(2):  # the first records the order, the second's forward rebuilds
        nn.functional.mse_loss(model(x), y).backward()
    counts = []
    for _ in range(2):
        per_micro_step = []
        for micro in range(micro_steps):
            before = model.all_reduce_count
            last = micro == micro_steps - 1
            with contextlib.nullcontext() if last else model.no_sync():
                nn.functional.mse_loss(model(x), y).backward()
            per_micro_step.append(model.all_reduce_count - before)
        counts.append(per_micro_step)
    return counts, len(model.buckets)


@pytest.mark.parametrize("rung", [5, 6, 7])
def test_no_sync_skips_the_all_reduces_of_all_but_the_last_micro_step(pool2, rung):
    """Three micro-steps per optimizer step, the first two inside no_sync(); one step to learn
    the gradient order, so the buckets are rebuilt before the counted ones."""
    for counts, buckets in pool2.run(all_reduces_per_micro_step, rung, 3):
        assert counts == [[0, 0, buckets]] * 2, counts


def hook_registered_twice() -> None:
    model = LADDER[6](nn.Linear(2, 2))
    model.register_comm_hook(None, allreduce_hook)
    model.register_comm_hook(None, allreduce_hook)


def hook_registered_after_a_backward() -> None:
    model = LADDER[6](nn.Linear(2, 2))
    model(torch.randn(3, 2)).sum().backward()
    model.register_comm_hook(None, allreduce_hook)


@pytest.mark.parametrize(
    "register, phrase",
    [
        pytest.param(hook_registered_twice, "only be called once", id="twice"),
        pytest.param(hook_registered_after_a_backward, "before the first", id="after_a_backward"),
    ],
)
def test_a_comm_hook_registered_twice_or_late_is_refused(
    pool2, register: Callable[[], None], phrase: str
):
    """Rung 7's comm hook registered twice, or after training began."""
    for outcome in pool2.run_expecting_errors(register, timeout=60):
        assert isinstance(outcome, RankFailure) and outcome.type_name == "RuntimeError"
        assert phrase in outcome.message


def no_trainable(rung: int) -> None:
    LADDER[rung - 1](nn.Linear(2, 2).requires_grad_(False))


def cap_zero(rung: int) -> None:
    LADDER[rung - 1](nn.Linear(2, 2), bucket_cap_mb=0)


def cap_text(rung: int) -> None:
    LADDER[rung - 1](nn.Linear(2, 2), bucket_cap_mb="25")


BAD_CONSTRUCTION = [
    (no_trainable, "ValueError", "no parameter that requires grad", RUNGS),
    (cap_zero, "ValueError", "bucket_cap_mb must be a positive", range(3, len(LADDER))),
    (cap_text, "ValueError", "got '25'", range(3, len(LADDER))),
]


@pytest.mark.parametrize(
    "construct, rung, error, phrase",
    [
        pytest.param(construct, rung, error, phrase, id=f"{construct.__name__}-{rung}")
        for construct, error, phrase, rungs in BAD_CONSTRUCTION
        for rung in rungs
    ],
)
def test_bad_construction_raises_on_every_rank(
    pool2, construct: Callable[[int], None], rung: int, error: str, phrase: str
):
    """Building a rung from one kind of bad input: every rank raises."""
    for outcome in pool2.run_expecting_errors(construct, rung, timeout=60):
        assert isinstance(outcome, RankFailure) and outcome.type_name == error
        assert phrase in outcome.message
