"""Chapter 09: the classic DDP mistakes, each symptom next to its fix.

    torchrun --nproc_per_node=2 tutorials/09_mistakes.py

tutorials/mistakes/ holds eleven classic DDP bugs, each a rung of the ladder or the training
loop with one change, and tests/test_mistakes.py proves that the property tests catch every one
of them. This chapter runs six, each next to its fix:

1. no broadcast at construction, with ranks seeded differently: the replicas never meet;
2. a hook that all-reduces the parameter instead of its gradient: the replicas drift apart;
3. the loss not divided by the accumulation steps: gradients k times too large;
4. no_sync() around backward only: right numbers, k times the communication;
5. a parameter that gets no gradient: torch's DDP is silent for a step, MiniDDP names it;
6. buckets launched in the order they filled: ranks whose gradients come in another order sum
   one bucket with another.

Each section prints the mistake's one-line summary and its code, measures the symptom on the
mistake and on the fix, and asserts that the symptom is there, and gone with the fix.
"""

from __future__ import annotations

import inspect
import textwrap

import torch
import torch.distributed as dist
from common import (
    end_chapter,
    make_model,
    say,
    say_prose,
    section,
    step_batches,
    train_steps,
)
from mistakes import (
    correct_loop,
    hook_averages_weights,
    loss_not_divided,
    no_construction_broadcast,
    no_sync_backward_only,
    ready_order,
    unused_parameter,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp import MiniDDP
from miniddp.job.env import init_distributed
from miniddp.steps import BucketedDDP, NaiveDDP, OverlapDDP

STEPS = 3
BATCH = 8  # samples per rank per step (or micro-step)
K = 4  # micro-steps per optimizer step, in sections 3 and 4
# float32 rounding is ~1e-7 relative; a few steps of a small MLP stay far below this.
TOLERANCE = 1e-5


def spread(tensors: list[torch.Tensor]) -> float:
    """The largest difference between any two ranks' copies of `tensors` (0: all identical)."""
    flat = torch.cat([t.detach().flatten() for t in tensors])
    highest, lowest = flat.clone(), flat.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    return (highest - lowest).max().item()


def show(mistake, code) -> None:
    """The mistake's summary line, then its `code` (the one change is marked "the mistake")."""
    say(f"{mistake.__name__.split('.')[-1]}.py: {mistake.__doc__.splitlines()[0]}")
    say(textwrap.indent(textwrap.dedent(inspect.getsource(code)).strip(), "  "))


def model_seeded(seed: int) -> nn.Module:
    return make_model(seed=seed, dtype=torch.float32)


def replicas_after_training(wrapper: type, seed: int, rank: int) -> float:
    """Train a model built from `seed` in `wrapper` for STEPS steps; how far its replicas are
    apart."""
    model = wrapper(model_seeded(seed))
    world_size = dist.get_world_size()
    train_steps(model, step_batches(STEPS, BATCH, world_size, rank))
    return spread(list(model.parameters()))


def accumulated_step(train_step, rank: int) -> tuple[list[torch.Tensor], int]:
    """One optimizer step of K micro-steps through `train_step` (a loop of tutorials/mistakes/)
    on MiniDDP; the gradients it stepped on, and the all-reduces it issued."""
    model = model_seeded(0)
    ddp = MiniDDP(model)
    micro_batches = step_batches(K, BATCH, dist.get_world_size(), rank)
    train_step(ddp, torch.optim.SGD(model.parameters(), lr=0.1), micro_batches)
    return [p.grad.clone() for p in model.parameters()], ddp.all_reduce_count


def one_process_gradient() -> list[torch.Tensor]:
    """The gradient of the mean loss over all K x W micro-batches, in one process."""
    model = model_seeded(0)
    global_batches = step_batches(K, BATCH, dist.get_world_size(), None)
    inputs, targets = (torch.cat(t) for t in zip(*global_batches))
    nn.functional.mse_loss(model(inputs), targets).backward()
    return [p.grad for p in model.parameters()]


def scale(got: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """The factor s minimizing |got - s * expected|: 1 when right, K when k times too large."""
    g, e = torch.cat([t.flatten() for t in got]), torch.cat([t.flatten() for t in expected])
    return (g @ e / (e @ e)).item()


def unused_parameter_under(wrapper: type, rank: int) -> tuple[float | None, str]:
    """Two steps of SpareHead (a head registered, never used) in `wrapper`: how far the ranks'
    gradients are apart after the first backward, if it returned, and what was raised."""
    net = unused_parameter.SpareHead()
    model = wrapper(net)
    gap = None
    for step in range(2):
        g = torch.Generator().manual_seed(10 * rank + step)
        x, y = torch.randn(BATCH, 4, generator=g), torch.randn(BATCH, 1, generator=g)
        try:
            nn.functional.mse_loss(model(x), y).backward()
        except RuntimeError as error:
            return gap, str(error)
        gap = spread([p.grad for p in net.parameters() if p.grad is not None])
    return gap, "nothing"


def gradients_apart_with_rank_ordered_branches(wrapper: type, rank: int) -> float:
    """One backward of RankOrderedBranches (odd ranks run its two branches in the other order)
    in `wrapper`, a bucket per weight: how far the ranks' averaged gradients are apart."""
    torch.manual_seed(0)
    net = ready_order.RankOrderedBranches()
    model = wrapper(net, bucket_cap_mb=1e-6)  # 1 byte: every weight in a bucket of its own
    x = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(rank))
    nn.functional.mse_loss(model(x), torch.zeros(BATCH, 4)).backward()
    return spread([p.grad for p in net.parameters()])


def main() -> None:
    env = init_distributed()
    rank, world_size = env.rank, env.world_size
    say(f"Chapter 09: six classic DDP mistakes on {world_size} ranks, each next to its fix")

    section("1. No broadcast at construction, ranks seeded differently")
    show(no_construction_broadcast, no_construction_broadcast.NoConstructionBroadcast)
    seed = rank  # as a script that seeds each rank for its own data augmentation
    mistake = replicas_after_training(no_construction_broadcast.NoConstructionBroadcast, seed, rank)
    fix = replicas_after_training(NaiveDDP, seed, rank)
    say(f"Replicas apart after {STEPS} steps: {mistake:.3g} (the mistake), {fix:.3g} (rung 1).")
    say(
        textwrap.dedent("""\
        Averaged gradients move every replica by the same step, from where each one started: the
        mistake keeps the gap it began with. Rung 1 copies rank 0's weights first.""")
    )
    assert mistake > 0.01 and fix == 0

    section("2. A hook that all-reduces the parameter, not its gradient")
    show(hook_averages_weights, hook_averages_weights.AveragesWeights)
    mistake = replicas_after_training(hook_averages_weights.AveragesWeights, 0, rank)
    fix = replicas_after_training(OverlapDDP, 0, rank)
    say(f"Replicas apart after {STEPS} steps: {mistake:.3g} (the mistake), {fix:.3g} (rung 2).")
    say(
        textwrap.dedent("""\
        register_post_accumulate_grad_hook hands the hook the parameter. Averaging the equal
        weights changes nothing; each rank then steps on its own gradient, and they part.""")
    )
    assert mistake > 1e-4 and fix == 0

    section(f"3. The loss not divided by the {K} accumulation steps")
    show(loss_not_divided, loss_not_divided.train_step)
    reference = one_process_gradient()
    mistaken_grads, _ = accumulated_step(loss_not_divided.train_step, rank)
    fixed_grads, fixed_all_reduces = accumulated_step(correct_loop.train_step, rank)
    mistake, fix = scale(mistaken_grads, reference), scale(fixed_grads, reference)
    say(
        f"Gradient / one process's on the global batch: {mistake:.4f} (the mistake), "
        f"{fix:.4f} (the fix)."
    )
    say_prose(f"""\
        .grad adds up {K} mean gradients; their mean needs each micro-step's loss divided by {K}
        (correct_loop.py). DDP averages over ranks, never over micro-steps.""")
    assert abs(mistake - K) < 1e-4 and abs(fix - 1) < 1e-4

    section("4. no_sync() around backward only")
    show(no_sync_backward_only, no_sync_backward_only.train_step)
    mistaken_grads, mistaken_all_reduces = accumulated_step(no_sync_backward_only.train_step, rank)
    gap = max((a - b).abs().max().item() for a, b in zip(mistaken_grads, fixed_grads))
    say(
        f"All-reduces in one optimizer step of {K} micro-steps: {mistaken_all_reduces} (the "
        f"mistake), {fixed_all_reduces} (the fix); the gradients are {gap:.1e} apart."
    )
    say(
        textwrap.dedent("""\
        DDP decided at each forward, outside no_sync(), that its backward would all-reduce.
        Averaging is linear, so the extra rounds cost time, not correctness.""")
    )
    assert mistaken_all_reduces == K * fixed_all_reduces and gap < TOLERANCE

    section("5. A parameter that gets no gradient, find_unused_parameters=False")
    show(unused_parameter, unused_parameter.SpareHead)
    torch_gap, torch_raised = unused_parameter_under(DistributedDataParallel, rank)
    _, ours_raised = unused_parameter_under(MiniDDP, rank)
    say_prose(f"""\
        torch's DDP: the first backward returns quietly with the ranks' gradients {torch_gap:.3g}
        apart (nothing was averaged: spare_head's bucket never filled); the second forward raises:
            {torch_raised.split(". ")[0]}. ...
        MiniDDP raises at the end of the first backward:
            {ours_raised.split(". ")[0]}. ...""")
    assert torch_gap > 0 and "Expected to have finished reduction" in torch_raised
    assert "spare_head.weight" in ours_raised and "find_unused_parameters=True" in ours_raised

    section("6. Buckets launched in the order they filled, not in bucket order")
    show(ready_order, ready_order.LaunchesInReadyOrder)
    mistake = gradients_apart_with_rank_ordered_branches(ready_order.LaunchesInReadyOrder, rank)
    fix = gradients_apart_with_rank_ordered_branches(BucketedDDP, rank)
    say(
        f"Ranks' averaged gradients apart after one backward: {mistake:.3g} (the mistake), "
        f"{fix:.3g} (rung 3)."
    )
    say(
        textwrap.dedent("""\
        The odd ranks run the two branches in the other order, so their backward fills the other
        bucket first. A collective pairs with the other ranks' calls by its place in the
        sequence, not by its name: launched as they fill, rank 0's first all-reduce (one weight's
        bucket) is summed with rank 1's first (the other weight's). Both are 4 x 4, so nothing
        complains: each rank gets a wrong average, a different one. Rung 3 launches strictly in
        bucket order, a full bucket waiting for the earlier ones, so every rank's k-th
        all-reduce is bucket k.""")
    )
    assert mistake > 1e-3 and fix == 0

    dist.barrier()  # every rank has passed its own checks
    say()
    say_prose(f"""\
        Verified on {world_size} ranks: each of the six mistakes shows its symptom (replicas
        apart, gradients x{K}, {K}x the all-reduces, a silent step, buckets mixed up) and each
        fix removes it.""")
    end_chapter()


if __name__ == "__main__":
    main()
