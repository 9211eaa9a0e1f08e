"""The idea checks of the two rungs that add torch's options, selected with `--ddp-claims` as
those of tests/harness/idea_checks.py; and, at the end, `check_ideas`, which runs every claim's
check (both files'):

    find-unused-parameters  with find_unused_parameters=True and a head that no rank, or only
                  rank 0, uses: a parameter no rank used keeps .grad None, as torch's (zeros
                  are not None: an optimizer steps a zero gradient, with momentum and weight
                  decay, and skips a None one); one used on any rank gets the average on every
                  rank (torch's bits); and the bucket holding the unused head still launches
                  before backward ends (the parameters the forward's graph never reaches are
                  marked ready at once, not at the end)
    comm-hook     a hook registered with register_comm_hook is called once per bucket, as
                  torch's DDP calls it, with the bucket holding this rank's own gradients,
                  not divided by W (the hook averages); its future's tensor is the result,
                  even when it is not the bucket's own (torch's bits after)
    gradient-as-bucket-view  with gradient_as_bucket_view=True, the .grad tensors of one bucket
                  share its storage, as torch's do, in every step (after the rebuild too)

Each check runs the learner's class and torch's DDP on the same model and data, one after the
other on every rank, and compares what it observes from outside: .grad, the calls of a hook
of the check's own, and the storages of the gradients.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from tests.harness.equivalence import describe, same
from tests.harness.idea_checks import (
    check_buckets,
    check_no_sync,
    check_overlap,
    check_torch_layout,
    launched_before_backward_ended,
    short_timeline,
    train_recording_timeline,
)
from tests.workloads import (
    ModelSpec,
    RandomNet,
    TrainSpec,
    grads_of,
    micro_batch,
    train_both,
    uses_extra,
    wrap,
)

# Two hidden layers and a head beside the head: at this cap (104 bytes) the buckets, laid out in
# registration order as torch's are with find_unused_parameters, put the extra head's bias in
# the bucket launched first, so it cannot launch until the head is marked ready.
UNUSED_SPEC = TrainSpec(
    model=ModelSpec(seed=6, widths=(6, 5)),
    bucket_cap_mb=1e-4,
    accumulation=1,
    steps=2,
    find_unused_parameters=True,
)
# A few parameters per bucket, three steps: the hook sees the first step's one bucket, then the
# rebuilt ones; with gradient_as_bucket_view, .grad must move into the rebuilt buckets.
HOOK_SPEC = TrainSpec(model=ModelSpec(seed=7, widths=(6, 5)), bucket_cap_mb=1e-4, steps=3)
VIEW_SPEC = dataclasses.replace(HOOK_SPEC, gradient_as_bucket_view=True, set_grads_to_none=False)


def check_unused_parameters(rank_pools, implementation: str, world_size: int = 2) -> None:
    """Exercise 7's idea: the usage all-reduce, None where no rank used a parameter, and
    buckets that travel although a parameter in them gets no gradient."""
    idea = (
        "The idea of find_unused_parameters (exercise 7, chapter 05b): every hook notes that "
        "its parameter was used on this rank, one all-reduce of those marks tells every rank "
        "which parameters any rank used, and one no rank used keeps .grad as it was (None "
        "stays None); one used anywhere gets the average, this rank's zeros included."
    )
    for where in ("all_ranks", "some_ranks"):
        model = dataclasses.replace(UNUSED_SPEC.model, unused=where)
        spec = dataclasses.replace(UNUSED_SPEC, model=model, implementation=implementation)
        results = rank_pools(world_size).run(train_both, spec, timeout=120)
        for rank, result in enumerate(results):
            ours, theirs = result["ours"], result["torch"]
            for step, (g_ours, g_theirs) in enumerate(zip(ours["grads"], theirs["grads"])):
                for name, a, b in zip(ours["names"], g_ours, g_theirs):
                    if same(a, b):
                        continue
                    what = describe("gradient", step, name, a, b)
                    if b is None:
                        raise AssertionError(
                            f"find-unused-parameters, rank {rank}: {what}. No rank used "
                            f"'{name}': torch leaves its .grad None, so the optimizer skips it; "
                            f"zeros would still be stepped (momentum, weight decay). {idea}"
                        )
                    if name.startswith("extra_head") and not uses_extra(spec.model, rank):
                        raise AssertionError(
                            f"find-unused-parameters, rank {rank}: {what}. This rank did not "
                            f"use '{name}' but rank 0 did, so torch gives every rank the "
                            f"average. {idea}"
                        )
                    raise AssertionError(
                        f"find-unused-parameters, rank {rank}: {what}, not torch's bits"
                    )
    spec = dataclasses.replace(
        UNUSED_SPEC,
        model=dataclasses.replace(UNUSED_SPEC.model, unused="all_ranks"),
        implementation=implementation,
    )
    for rank, steps in enumerate(
        rank_pools(world_size).run(train_recording_timeline, spec, timeout=120)
    ):
        for step, timeline in enumerate(steps):
            assert launched_before_backward_ended(timeline), (
                f"find-unused-parameters, rank {rank} step {step}: no all-reduce left before "
                "the last gradient was ready: the bucket holding the head that no rank uses "
                "waited for the end of backward, and every later bucket behind it. At the end "
                "of each synced forward, walk the autograd graph back from the output: the "
                "parameters it never reaches get no gradient, so mark them ready at the "
                "backward's first hook (exercise 7, chapter 05b). Timeline: "
                f"{short_timeline(timeline)}"
            )


def train_yours_and_torchs(spec: TrainSpec, with_hook: bool) -> dict:
    """Runs on each rank: the learner's class, then torch's DDP, on the same model and data,
    through `recording_hook` if `with_hook`; for each, step by step, the buckets the hook got,
    the gradients, and which of them share a storage."""
    rank = dist.get_rank()
    observed = {}
    for who in ("yours", "torch"):
        net = RandomNet(spec.model)
        model = wrap(net, spec, use_torch=who == "torch")
        hooked: list[torch.Tensor] = []
        if with_hook:
            model.register_comm_hook(None, recording_hook(hooked))
        optimizer = torch.optim.SGD(net.parameters(), lr=spec.lr, momentum=0.5)
        steps = []
        for step in range(spec.steps):
            x, y = micro_batch(spec, rank, step, 0)
            nn.functional.mse_loss(model(x), y).backward()
            if who == "yours":
                model.finish_gradient_synchronization()
            steps.append(
                {
                    "hooked": hooked[:],
                    "grads": grads_of(net),
                    "storages": gradients_sharing_storage(net),
                }
            )
            hooked.clear()
            optimizer.step()
            optimizer.zero_grad(set_to_none=spec.set_grads_to_none)
        observed[who] = steps
    observed["names"] = [name for name, _ in net.named_parameters()]
    return observed


def gradients_sharing_storage(net: nn.Module) -> list[list[str]]:
    """The parameters grouped by the storage their .grad lives in, in registration order."""
    groups: dict[int, list[str]] = {}
    for name, param in net.named_parameters():
        if param.grad is not None:
            groups.setdefault(param.grad.untyped_storage().data_ptr(), []).append(name)
    return sorted(groups.values())


def recording_hook(buckets: list[torch.Tensor]) -> Callable:
    """A comm hook with torch's protocol that notes each bucket as it arrives, then averages it
    in a tensor of its own, so that only a DDP that takes the future's result gets it."""

    def hook(state, bucket):  # unannotated: torch accepts no annotation but its exact one
        buckets.append(bucket.buffer().detach().clone())
        averaged = bucket.buffer() / dist.get_world_size()
        work = dist.all_reduce(averaged, async_op=True)
        return work.get_future().then(lambda future: future.value()[0])

    return hook


def check_comm_hook(rank_pools, implementation: str, world_size: int = 2) -> None:
    """Exercise 8's idea: the registered hook does each bucket's communication, with torch's
    protocol."""
    spec = dataclasses.replace(HOOK_SPEC, implementation=implementation)
    idea = (
        "The idea of register_comm_hook (exercise 8, chapter 05b): each full bucket goes to "
        "hook(state, bucket) instead of your all-reduce, holding this rank's own gradients, "
        "not yet divided by W (the hook averages), and the tensor of the future the hook "
        "returns is the bucket's result."
    )
    results = rank_pools(world_size).run(train_yours_and_torchs, spec, True, timeout=120)
    for rank, result in enumerate(results):
        for step, (yours, torchs) in enumerate(zip(result["yours"], result["torch"])):
            where = f"comm-hook, rank {rank} step {step}"
            assert len(yours["hooked"]) == len(torchs["hooked"]), (
                f"{where}: your DDP called the registered hook {len(yours['hooked'])} times, "
                f"torch's DDP {len(torchs['hooked'])} times, once per bucket. {idea}"
            )
            for number, (mine, theirs) in enumerate(zip(yours["hooked"], torchs["hooked"])):
                divided = mine.shape == theirs.shape and torch.equal(mine, theirs / world_size)
                assert same(mine, theirs), (
                    f"{where}: hook call {number} got a bucket of {mine.numel()} values, "
                    f"{_values(mine)}; torch's DDP handed over {theirs.numel()}, "
                    f"{_values(theirs)}"
                    f"{': yours were divided by W, and the hook divides again' if divided else ''}"
                    f". {idea}"
                )
            for name, mine, theirs in zip(result["names"], yours["grads"], torchs["grads"]):
                assert same(mine, theirs), (
                    f"comm-hook, rank {rank}: {describe('gradient', step, name, mine, theirs)}, "
                    "not torch's bits through the same hook: is the future's tensor (not the "
                    f"bucket you handed over) what goes back into .grad? {idea}"
                )


def _values(tensor: torch.Tensor) -> str:
    return "[" + ", ".join(f"{v:.6g}" for v in tensor[:3].tolist()) + ", ...]"


def check_gradient_as_bucket_view(rank_pools, implementation: str, world_size: int = 2):
    """Exercise 8's second idea: .grad lives in the bucket, one storage per bucket."""
    spec = dataclasses.replace(VIEW_SPEC, implementation=implementation)
    results = rank_pools(world_size).run(train_yours_and_torchs, spec, False, timeout=120)
    for rank, result in enumerate(results):
        for step, (yours, torchs) in enumerate(zip(result["yours"], result["torch"])):
            assert yours["storages"] == torchs["storages"], (
                f"gradient-as-bucket-view, rank {rank} step {step}: the .grad tensors that share "
                f"a storage are {yours['storages']}, torch's {torchs['storages']} (one storage "
                "per bucket). With gradient_as_bucket_view=True each .grad is its slice of the "
                "bucket (exercise 8, chapter 05b): the first time a gradient is copied in, .grad "
                "becomes that view, autograd then accumulates straight into the bucket, and "
                "after the rebuild the gradients move into the new buckets."
            )
            for name, mine, theirs in zip(result["names"], yours["grads"], torchs["grads"]):
                assert same(mine, theirs), (
                    f"gradient-as-bucket-view, rank {rank}: "
                    f"{describe('gradient', step, name, mine, theirs)}, not torch's bits"
                )


def check_ideas(rank_pools, implementation: str, claims: frozenset[str]) -> list[str]:
    """Run the idea check of every claim that has one; return the names of those run."""
    checks = {
        "overlap": check_overlap,
        "buckets": check_buckets,
        "torch-layout": check_torch_layout,
        "no-sync": check_no_sync,
        "find-unused-parameters": check_unused_parameters,
        "comm-hook": check_comm_hook,
        "gradient-as-bucket-view": check_gradient_as_bucket_view,
    }
    ran = []
    for claim, check in checks.items():
        if claim in claims:
            check(rank_pools, implementation)
            ran.append(claim)
    return ran
