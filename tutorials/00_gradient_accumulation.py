"""Chapter 00: gradient accumulation, the maths that data parallelism is built on.

A batch too big for memory can be cut into k micro-batches whose gradients are added up in
`.grad` before one optimizer step. This script checks, with real numbers, when that gives exactly
the big batch's gradient and when it quietly does not.

    python tutorials/00_gradient_accumulation.py

Under `torchrun` only rank 0 runs the chapter; it needs no process group, so the others just exit.
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Callable

import torch
from common import say_prose, section
from torch import nn

MICRO_BATCH_SIZE = 4
MICRO_BATCHES = 3
# float64 rounding on sums of a dozen terms of size ~1 is ~1e-16; 1e-12 leaves ample margin
# while still catching any real mistake, which would be of the size of the gradient itself.
TOLERANCE = 1e-12


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()


Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def gradient(model: nn.Module, micro_batches: list[Batch], loss_of: LossFn) -> torch.Tensor:
    """Run backward once per micro-batch, letting `.grad` add them up; return the flat sum."""
    model.zero_grad(set_to_none=True)
    for inputs, targets in micro_batches:
        loss_of(model(inputs), targets).backward()
    return torch.cat([parameter.grad.flatten() for parameter in model.parameters()])


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def k_times_gradient_step_errors(k: int) -> tuple[float, float]:
    """How far one step lands when the gradient is k times too big: (SGD, Adam).

    Adam's update is m / (sqrt(v) + eps); a k-times gradient makes it k m / (k sqrt(v) + eps)
    = m / (sqrt(v) + eps / k): the same step with eps k times smaller.
    """
    inputs = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    errors = []
    for optimizer_class in (torch.optim.SGD, torch.optim.Adam):
        landed = []
        for scale in (1, k):
            model = make_model()
            optimizer = optimizer_class(model.parameters(), lr=1e-2)
            (scale * model(inputs).square().mean()).backward()
            optimizer.step()
            landed.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        errors.append(max_difference(*landed))
    return errors[0], errors[1]


def main() -> None:
    model = make_model()
    batch_size = MICRO_BATCH_SIZE * MICRO_BATCHES
    inputs = torch.randn(batch_size, 3, dtype=torch.float64)
    targets = torch.randn(batch_size, 1, dtype=torch.float64)
    whole_batch = [(inputs, targets)]
    micro_batches = list(
        zip(inputs.split(MICRO_BATCH_SIZE), targets.split(MICRO_BATCH_SIZE), strict=True)
    )
    mse_mean = nn.MSELoss(reduction="mean")
    mse_sum = nn.MSELoss(reduction="sum")
    k = MICRO_BATCHES
    print(
        f"Model: 3 -> 8 -> 1 MLP in float64, {batch_size} samples = {k} micro-batches of "
        f"{MICRO_BATCH_SIZE}."
    )

    section("Claim 1: k micro-batches, each mean loss divided by k, equal one big batch")
    reference = gradient(model, whole_batch, mse_mean)
    accumulated = gradient(model, micro_batches, lambda out, y: mse_mean(out, y) / k)
    gap = max_difference(accumulated, reference)
    for name, values in (("big-batch", reference), ("accumulated", accumulated)):
        entries = " ".join(f"{g:+.15f}" for g in values[:3])
        print(f"{name + ' gradient, first 3 entries:':<38} {entries}")
    print(f"max |difference| = {gap:.2e} (tolerance {TOLERANCE:.0e}).")
    print(
        textwrap.dedent("""\
        Not exactly zero: the same terms are summed in a different order, and floating-point
        addition is not associative. The big batch's mean is (1/12) sum of 12 losses; each
        micro-batch gives (1/4) sum of 4, and dividing by k=3 turns 1/4 into 1/12.""")
    )
    assert gap < TOLERANCE

    section("Claim 2: forget the division and the gradient is k times too big")
    undivided = gradient(model, micro_batches, mse_mean)
    ratio = undivided / reference
    print(
        f"undivided / big-batch, per entry: min {ratio.min().item():.12f}, "
        f"max {ratio.max().item():.12f}"
    )
    assert max_difference(undivided, k * reference) < TOLERANCE
    sgd_error, adam_error = k_times_gradient_step_errors(k)
    say_prose(f"""\
        That is k = {k}. With SGD the step is {k} times longer, as if the learning rate were {k}x:
        one SGD step from the same weights lands {sgd_error:.1e} away from the right one.
        Adam divides by the gradient's running RMS, so a k-times gradient barely moves its
        step: {adam_error:.1e} away. The error moves instead to what the scale still touches:
        eps acts k times smaller, Adam's weight_decay (added to the gradient) k times weaker
        (AdamW's, applied to the weights, is untouched), and clip_grad_norm_ sees a k-times
        norm, so it clips as if max_norm were k times smaller.""")
    assert adam_error < 1e-3 * sgd_error

    section("Claim 3: with reduction='sum', do not divide")
    reference_sum = gradient(model, whole_batch, mse_sum)
    accumulated_sum = gradient(model, micro_batches, mse_sum)
    print(
        f"sum-loss: max |accumulated - big batch| = "
        f"{max_difference(accumulated_sum, reference_sum):.2e}"
    )
    print("A sum over the batch is the sum of the sums over the micro-batches: nothing to fix.")
    print(
        f"Sum gradient / mean gradient = {(reference_sum / reference).mean().item():.6f}"
        f" = batch size {batch_size}."
    )
    print(
        textwrap.dedent("""\
        Mean keeps the gradient's size (and a good learning rate) independent of the batch
        size; sum weights every sample the same however the samples are grouped, which is
        what you want when you normalise once at the end, e.g. by a token count.""")
    )
    assert max_difference(accumulated_sum, reference_sum) < TOLERANCE
    assert max_difference(reference_sum, batch_size * reference) < TOLERANCE

    section("Unequal micro-batches: the mean of means is not the mean")
    sizes = [6, 4, 2]
    uneven = list(zip(inputs.split(sizes), targets.split(sizes), strict=True))
    naive = gradient(model, uneven, lambda out, y: mse_mean(out, y) / len(sizes))
    weighted = gradient(model, uneven, lambda out, y: mse_mean(out, y) * len(y) / batch_size)
    say_prose(f"""\
        sizes {sizes}: each mean loss / {len(sizes)} gives every micro-batch the same weight,
        so the 2 samples of the last one count as much as the 6 of the first.""")
    print(f"max |naive - big batch|    = {max_difference(naive, reference):.2e}  (wrong)")
    print(
        f"max |weighted - big batch| = {max_difference(weighted, reference):.2e}  "
        f"(weight n_i / N = {[f'{n}/{batch_size}' for n in sizes]})"
    )
    print("Equivalently: use reduction='sum' and divide once by the total N.")
    assert max_difference(naive, reference) > 1e3 * TOLERANCE
    assert max_difference(weighted, reference) < TOLERANCE

    section("Looking ahead: data parallelism is the same sum")
    say_prose(f"""\
        Give each of W = {k} ranks one micro-batch instead of running them one after another.
        Each rank computes its mean-loss gradient; an all-reduce averages them over the ranks.
        That average is our division by k: (1/W) sum over ranks. Chapter 02 and MiniDDP do
        exactly this.""")
    per_rank = [gradient(model, [batch], mse_mean) for batch in micro_batches]
    averaged = torch.stack(per_rank).mean(dim=0)
    print(
        f"average of {k} per-rank gradients vs big batch: max |difference| = "
        f"{max_difference(averaged, reference):.2e}"
    )
    # Ranks holding the uneven micro-batches above: the all-reduce still weighs each by 1/W.
    naive_ranks = torch.stack([gradient(model, [b], mse_mean) for b in uneven]).mean(dim=0)
    scale = len(sizes) / batch_size  # rank r's mean loss times W n_r / N
    weighted_ranks = torch.stack(
        [gradient(model, [b], lambda out, y: mse_mean(out, y) * len(y) * scale) for b in uneven]
    ).mean(dim=0)
    naive_gap, weighted_gap = (max_difference(g, reference) for g in (naive_ranks, weighted_ranks))
    say_prose(f"""\
        The uneven-size caveat comes back with ranks. Give W = {k} ranks the micro-batches of
        sizes {sizes}: the all-reduce weighs each rank by 1/W, and the average misses the
        big-batch gradient by {naive_gap:.1e}. Scaling each rank's mean loss by W n_r / N
        brings that to {weighted_gap:.1e}. Chapter 02's DistributedSampler gives every rank the
        same count, so equal sizes are the default; but it gets there by padding, repeating the
        first indices of the (shuffled) list until N divides by W, so a padded epoch counts
        those samples twice (drop_last=True drops the tail instead, and those samples are not
        seen that epoch). Where ranks count different numbers of tokens, sum the loss and divide
        by the all-reduced total.""")

    section("Final check")
    assert max_difference(averaged, reference) < TOLERANCE
    assert max_difference(accumulated, reference) < TOLERANCE
    assert max_difference(undivided, k * reference) < TOLERANCE
    assert max_difference(accumulated_sum, reference_sum) < TOLERANCE
    assert max_difference(weighted, reference) < TOLERANCE < max_difference(naive, reference)
    assert weighted_gap < TOLERANCE < 1e-3 * naive_gap
    print(
        textwrap.dedent("""\
        Verified: mean loss / k accumulates to the big-batch gradient; without / k it is k times
        larger; sum loss needs no division; uneven micro-batches need n_i / N weights; averaging
        over ranks equals accumulating, uneven ranks need W n_r / N.""")
    )


if __name__ == "__main__":
    if os.environ.get("RANK", "0") != "0":
        sys.exit(0)
    main()
