"""A learner's ring all-reduce (`--ring FILE.py:FUNCTION`) or ZeRO-1 optimizer (`--zero1
FILE.py:CLASS`): checked up front, then run on the ranks beside the reference it must equal.

Up front, as `--ddp` is (your_ddp.py): a wrong file, name or signature is named before the rank
pool starts, once, not as one remote traceback per rank.

On the ranks, each exercise runs where its reference runs, so the tests that hold miniddp's own
code to its promise hold the learner's to the same one:

- the ring (tests/test_collectives.py): the learner's `all_reduce(peers, flat, op)` gets the
  same `Peers` that miniddp/collectives/ring.py gets, so every message it sends is counted and
  logged, and its result is compared with torch.distributed's all_reduce;
- ZeRO-1 (tests/test_sharding.py): the learner's class trains the same model under MiniDDP as
  torch.distributed.optim.ZeroRedundancyOptimizer does, and reports whose Adam state it keeps.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import pytest
import torch
import torch.distributed as dist

from miniddp import collectives
from miniddp.collectives.peers import Peers
from tests.collective_tasks import Case, make_input
from tests.harness.your_ddp import load_named
from tests.sharding_tasks import ShardSpec, build_model, param_groups, train
from tests.workloads import load_implementation

RING_EXAMPLE = "tutorials/exercises/ring.py:all_reduce"
ZERO1_EXAMPLE = "tutorials/exercises/zero1.py:ZeroRedundancyOptimizer"


def ring_option(option: str) -> str:
    """--ring FILE.py:FUNCTION, checked: a function callable as FUNCTION(peers, flat, op)."""
    where, found = load_named(option, "--ring", RING_EXAMPLE, "FUNCTION")
    if not callable(found) or inspect.isclass(found):
        raise pytest.UsageError(
            f"--ring {option}: {where.rpartition(':')[2]} is a {type(found).__name__}; the "
            "tests call a function all_reduce(peers, flat, op), as miniddp/collectives/ring.py's"
        )
    try:
        inspect.signature(found).bind(None, None, None)
    except TypeError as error:
        raise pytest.UsageError(
            f"--ring {option}: {inspect.signature(found)} cannot be called as "
            f"(peers, flat, op) ({error}); write all_reduce(peers, flat, op)"
        ) from None
    return where


def zero1_option(option: str) -> str:
    """--zero1 FILE.py:CLASS, checked: CLASS(params, optimizer_class, **defaults) with step()."""
    where, found = load_named(option, "--zero1", ZERO1_EXAMPLE, "CLASS")
    if not inspect.isclass(found):
        raise pytest.UsageError(
            f"--zero1 {option}: it names a {type(found).__name__}, not a class; the tests build "
            "CLASS(params, torch.optim.AdamW, lr=..., weight_decay=...)"
        )
    try:
        inspect.signature(found).bind([], torch.optim.AdamW, lr=0.01, weight_decay=0.01)
    except TypeError as error:
        raise pytest.UsageError(
            f"--zero1 {option}: {found.__name__}{inspect.signature(found)} cannot be called as "
            f"CLASS(params, torch.optim.AdamW, lr=..., weight_decay=...) ({error})"
        ) from None
    if not callable(getattr(found, "step", None)):
        raise pytest.UsageError(f"--zero1 {option}: {found.__name__} has no step()")
    return where


@functools.cache
def _learners(where: str) -> Any:
    """Loaded once per worker: a hypothesis run calls the same function hundreds of times."""
    return load_implementation(where)


def run_ring(case: Case, where: str) -> dict[str, torch.Tensor]:
    """A rank's part: the learner's ring and torch's all_reduce on this rank's input."""
    values = make_input(case, dist.get_rank())
    op = getattr(dist.ReduceOp, case.op)
    yours = values.clone()
    _learners(where)(Peers(None, "all_reduce/yours"), yours, op)
    reference = values.clone()
    dist.all_reduce(reference, getattr(dist.ReduceOp, "SUM" if case.op == "AVG" else case.op))
    return {"yours": yours, "torch": reference}


def count_ring(where: str, numel: int) -> dict[str, Any]:
    """A rank's part: one float32 SUM of ones through the learner's ring, every message it sent
    (step, src, dst, bytes) and what arrived, as miniddp's own ring is counted."""
    values = torch.ones(numel)
    collectives.traffic.reset()
    with collectives.record_messages() as log:
        _learners(where)(Peers(None, "all_reduce/yours"), values, dist.ReduceOp.SUM)
    return {
        **vars(collectives.traffic),
        "messages": [(m.step, m.src, m.dst, m.nbytes) for m in log],
        "result": values,
    }


def zero1_against_torch(spec: ShardSpec, where: str) -> dict[str, Any]:
    """A rank's part: torch's ZeroRedundancyOptimizer and the learner's class, each over AdamW
    under MiniDDP on the same model and data; the parameters after every step, and the indices
    of the parameters whose Adam state each keeps on this rank."""
    runs = {"torch": train(spec, "torch")}
    model = build_model(spec)
    options = {"lr": spec.lr, "weight_decay": spec.weight_decay}
    yours = _learners(where)(param_groups(model, spec), torch.optim.AdamW, **options)
    runs["yours"] = train(spec, "yours", model, yours)
    kept = {}
    for kind, run in runs.items():
        local = getattr(run["optimizer"], "optim", None)
        index = {p: i for i, p in enumerate(run["model"].parameters())}
        kept[kind] = None if local is None else sorted(index[p] for p in local.state)
    return {"params": {kind: run["params"] for kind, run in runs.items()}, "kept": kept}
