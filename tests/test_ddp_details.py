"""Three of torch's DDP behaviours that a seeded bug in MiniDDP once got past the whole suite
with, each now checked against torch's DDP doing the same training on the same data:

- with find_unused_parameters=True there is no rebuild, so the first layout is the only one,
  and at the default caps its first bucket is capped at 1 MiB (a model under 1 MiB never shows);
- the buckets are rebuilt from rank 0's gradient-ready order, also when rank 0 has none of its
  own (it joined before any backward) and the others do;
- a parameter used in some steps and not others has `.grad` None in the steps it is unused
  (with zero_grad(set_to_none=True)), never zeros, so momentum sees what torch's sees.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join

from miniddp import MiniDDP
from tests.workloads import bucket_layout


class TwoBranches(nn.Module):
    """A trunk of wide layers (over 1 MiB of gradients) and a small branch used on even steps."""

    def __init__(self, width: int = 300) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])
        self.branch = nn.Linear(width, width)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        hidden = self.trunk(x)
        return self.branch(hidden) if self.step % 2 == 0 else hidden


WRAPPERS = {"torch": nn.parallel.DistributedDataParallel, "miniddp": MiniDDP}


def train_with_a_sometimes_unused_branch(wrapper: str) -> dict:
    net = TwoBranches()
    model = WRAPPERS[wrapper](net, find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    generator = torch.Generator().manual_seed(10 + dist.get_rank())
    grad_is_none, layouts = [], []
    for _ in range(4):
        model(torch.randn(4, 300, generator=generator)).square().mean().backward()
        grad_is_none.append([p.grad is None for p in model.parameters()])
        layouts.append(bucket_layout(model, net))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {
        "grad_is_none": grad_is_none,
        "layouts": layouts,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def test_find_unused_parameters_layouts_grads_and_weights_are_torchs(pool2):
    for rank, result in enumerate(pool2.run(both, train_with_a_sometimes_unused_branch)):
        ours, theirs = result["miniddp"], result["torch"]
        assert ours["layouts"] == theirs["layouts"], f"rank {rank}: bucket layouts differ"
        # 1.8 MB of gradients: two buckets, because the first is capped at 1 MiB (under one
        # 25 MiB cap they would be one).
        assert [len(layout) for layout in ours["layouts"]] == [2] * 4, ours["layouts"][0]
        assert ours["grad_is_none"] == theirs["grad_is_none"], f"rank {rank}: .grad None-ness"
        assert ours["grad_is_none"][0][-2:] == [True, True]  # the branch, unused in step 1
        for mine, reference in zip(ours["params"], theirs["params"]):
            assert torch.equal(mine, reference), f"rank {rank}: weights differ"


def layout_after_rank_0_joined_first(wrapper: str) -> list[list[str]]:
    """Rank 0 has no batch; rank 1 trains three steps with several buckets, in an order that
    is not registration order (the trunk is used backwards)."""
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    model = WRAPPERS[wrapper](net, bucket_cap_mb=0.0003)
    generator = torch.Generator().manual_seed(5)
    with Join([model]):
        for _ in range(3 if dist.get_rank() == 1 else 0):
            model(torch.randn(4, 8, generator=generator)).sum().backward()
    return bucket_layout(model, net)


def test_every_rank_rebuilds_from_rank_0s_order_even_when_rank_0_saw_no_backward(pool2):
    for rank, result in enumerate(pool2.run(both, layout_after_rank_0_joined_first)):
        assert result["miniddp"] == result["torch"], f"rank {rank}: bucket layouts differ"
        assert len(result["torch"]) > 2


def both(task) -> dict:
    return {wrapper: task(wrapper) for wrapper in WRAPPERS}
