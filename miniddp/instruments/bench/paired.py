"""Interleaved, paired timing: the only figures worth trusting on a shared machine.

Every variant runs once per iteration, in an order rotated by one each iteration, with a barrier
before each step, so the variants share the machine's background load; then each variant's time
is compared with its reference's from the same iteration, and the median of those ratios is
reported with a 95% interval that assumes nothing about the distribution.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from miniddp.instruments.bench.workloads import Workload

# The project's goal, for every benchmark: as fast as torch's own implementation within noise.
# At 60 paired iterations the 95% interval of a median ratio is about +-3% on a quiet machine,
# so a median up to 1.05 is a tie with torch, and a tie is enough.
SAME_SPEED_AS_TORCH = 1.05


def step(model: nn.Module, params: list[nn.Parameter], workload: Workload) -> None:
    """One training step minus the optimizer: `.grad` ends averaged over the ranks."""
    for param in params:
        param.grad = None
    workload.loss(model, workload.batch).backward()
    finish = getattr(model, "finish_gradient_synchronization", None)  # torch's DDP has none
    if finish is not None:
        finish()
    if workload.batch[0].is_cuda:
        torch.cuda.synchronize()  # the step ends when the GPU is done, not when it was told


def rotated(names: list[str], iteration: int) -> list[str]:
    """The order for one iteration: every variant takes every position equally often."""
    shift = iteration % len(names)
    return names[shift:] + names[:shift]


def time_interleaved(
    models: dict[str, nn.Module], workload: Workload, iters: int, warmup: int = 3
) -> dict[str, dict[str, list[float]]]:
    """Per variant, this rank's wall and CPU seconds of each timed iteration."""
    names = list(models)
    params = {
        name: [p for p in model.parameters() if p.requires_grad] for name, model in models.items()
    }
    for _ in range(warmup):  # the first step records the gradient order; the second rebuilds
        for name in names:
            step(models[name], params[name], workload)
    times: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in names}
    for iteration in range(iters):
        for name in rotated(names, iteration):
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            step(models[name], params[name], workload)
            times[name]["cpu"].append(time.process_time() - cpu)
            times[name]["wall"].append(time.perf_counter() - wall)
    return times


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """Median over iterations of ours/theirs, each pair measured in the same iteration."""
    return statistics.median(a / b for a, b in zip(ours, theirs))


def paired_ratio_interval(ours: list[float], theirs: list[float]) -> tuple[float, float]:
    """A 95% confidence interval for `paired_ratio`, assuming nothing about the distribution.

    The true median lies between the k-th smallest and k-th largest of n ratios with 95%
    confidence when k = n/2 - 0.98 sqrt(n) (the binomial count of ratios below the median,
    approximated by a normal). A target closer to the median than this is not settled by the run.
    """
    ratios = sorted(a / b for a, b in zip(ours, theirs))
    n = len(ratios)
    below = max(0, math.floor(n / 2 - 0.98 * math.sqrt(n)))
    return ratios[below], ratios[n - 1 - below]
