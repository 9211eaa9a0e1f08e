"""At the sizes users train at, on a busy machine: no false alarm, and still torch's bits.

Every other test's collectives are tiny and finish within one look of the fault watcher
(miniddp/job/faults.py polls every 0.1 s). A 100 MB all-reduce on a loaded machine takes several
looks, and the moment a collective completes just after a look timed out is exactly where a
watcher can mistake "late" for "failed". So here: 100 MB collectives and a 25M-parameter model
at torch's default bucket caps (one 25 MiB bucket after a 1 MiB first one) and at one 100 MB
bucket, with a CPU-burning process competing for the cores. These assert correctness only;
speed under load is `python -m miniddp.bench soak`'s job.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import miniddp.job.faults as faults
from miniddp import MiniDDP
from tests.harness.cpu_hog import cpu_hog

ALL_REDUCE_NUMEL = 25_000_000  # float32: 100 MB
WIDTH, DEPTH = 2048, 6  # 6 x (2048 x 2048 + 2048) = 25.2M parameters, 100.7 MB of float32


def large_all_reduces(count: int, poll_s: float) -> int:
    """`count` async 100 MB all-reduces, each waited through the seam; returns how many were
    exact. A short `poll_s` multiplies the looks per collective, so the late-completion race
    gets many chances to strike in a few seconds."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    expected = world_size * (world_size + 1) / 2  # every rank adds rank + 1
    data = torch.empty(ALL_REDUCE_NUMEL)
    previous, faults.POLL_S = faults.POLL_S, poll_s
    exact = 0
    try:
        for index in range(count):
            data.fill_(rank + 1)
            work = dist.all_reduce(data, async_op=True)
            faults.wait_for(work, f"all-reduce #{index} (100 MB)")
            exact += bool(data.eq(expected).all())
    finally:
        faults.POLL_S = previous
    return exact


# The 1 ms poll (30 all-reduces, 7 s) under -m slow: the default poll runs the same path.
@pytest.mark.parametrize(
    "poll_s",
    [faults.POLL_S, pytest.param(0.001, marks=pytest.mark.slow)],
    ids=["default-poll", "1ms-poll"],
)
def test_100mb_all_reduces_on_a_busy_machine_raise_nothing(pool2, poll_s):
    count = 8 if poll_s == faults.POLL_S else 30
    with cpu_hog():
        exact = pool2.run(large_all_reduces, count, poll_s, timeout=90)
    assert exact == [count, count]


def big_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


def train_a_few_steps(model: nn.Module, steps: int = 3) -> list[float]:
    """A real loop's step: AdamW, clipping, a rank-specific batch; returns the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for _ in range(steps):
        x = torch.randn(8, WIDTH, generator=generator)
        loss = model(x).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def big_model_against_torch(bucket_cap_mb: float | None) -> dict:
    """Train the 25M-parameter model with torch's DDP and with MiniDDP at the same cap; return
    which parameters differ in any bit, and both loss curves."""
    cap = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    reference = nn.parallel.DistributedDataParallel(big_model(), **cap)
    torch_losses = train_a_few_steps(reference)
    ours = MiniDDP(big_model(), **cap)
    our_losses = train_a_few_steps(ours)
    differ = [
        name
        for (name, theirs), mine in zip(reference.module.named_parameters(), ours.parameters())
        if not torch.equal(theirs, mine)
    ]
    return {
        "differ": differ,
        "torch": torch_losses,
        "miniddp": our_losses,
        "buckets": len(ours.buckets),
    }


# One 100 MB bucket under -m slow: the default caps' buckets take the same path, more of them.
@pytest.mark.parametrize(
    "bucket_cap_mb",
    [None, pytest.param(100.0, marks=pytest.mark.slow)],
    ids=["default-caps", "cap-100MB"],
)
def test_25m_parameter_model_is_bitwise_torchs_on_a_busy_machine(pool2, bucket_cap_mb):
    with cpu_hog():
        results = pool2.run(big_model_against_torch, bucket_cap_mb, timeout=120)
    for rank, result in enumerate(results):
        assert result["differ"] == [], f"rank {rank}: parameters differ from torch's DDP"
        assert result["miniddp"] == result["torch"], f"rank {rank}: losses differ"
    # A bucket closes once it reaches its cap, and each weight is 16.8 MB. Default caps, in the
    # rebuilt (backward) order: the last layer alone (1 MiB first cap), then two layers per
    # 25 MiB bucket, then the first layer: 4 buckets. At 100 MB: all 100.7 MB in one.
    assert results[0]["buckets"] == (4 if bucket_cap_mb is None else 1)
