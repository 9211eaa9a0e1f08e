"""DP x PP: 4 ranks as 2 pipelines of 2 stages, each stage's slice data-parallel with MiniDDP
over its copy in the other pipeline (miniddp/pipeline/mesh.py), against one process training
on the global batch.

Not bitwise: one process averages the loss over all 2 x m x b samples at once, while here each
microbatch's mean is summed into .grad, divided by m, and averaged over the two replicas; the
same numbers, added in another order. In float64 that moves the last bits only: 1e-12.

And the trap that makes this worth a test: MiniDDP (like torch's DDP) decides at FORWARD time
whether a backward all-reduces. Running the last microbatch's forward outside no_sync, as one
does for plain accumulation, arms the reduction for the NEXT backward, which in a pipeline is
another microbatch's: MiniDDP then refuses the backward after it. The stage instead runs every
forward inside no_sync, and replays the last one, synced, right before its backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from miniddp import MiniDDP
from miniddp.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe, build_mesh
from tests.harness.measurements import record_max

WIDTHS = (6, 5, 3)
MICROBATCH, STEPS, LR, REPLICAS = 2, 3, 0.1, 2


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(WIDTHS, WIDTHS[1:])]
    return nn.Sequential(*blocks).double()


def global_batch(m: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    size = REPLICAS * m * MICROBATCH
    x = torch.randn(size, WIDTHS[0], generator=generator, dtype=torch.float64)
    return x, torch.randn(size, WIDTHS[-1], generator=generator, dtype=torch.float64)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def train_dp_pp(schedule_name: str, m: int) -> tuple[list[torch.Tensor], int, int]:
    """On each of the 4 ranks: its stage, under MiniDDP on its data-parallel group, trained on
    its replica's half of each global batch. Returns its parameters after STEPS SGD steps, the
    all-reduces MiniDDP launched, and its bucket count."""
    mesh = build_mesh(num_stages=2, replicas=REPLICAS)
    block = build_model()[mesh.stage_index]
    replicated = MiniDDP(block, process_group=mesh.data_parallel_group)
    stage = PipelineStage(replicated, mesh.stage_index, 2, "cpu", group=mesh.pipeline_group)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    schedule = cls(stage, m, mse)
    optimizer = torch.optim.SGD(block.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = (t.tensor_split(REPLICAS)[mesh.replica] for t in global_batch(m, step))
        schedule.step(x) if stage.is_first else schedule.step(target=y)
        optimizer.step()
        optimizer.zero_grad()
    params = [p.detach().clone() for p in block.parameters()]
    return params, replicated.all_reduce_count, len(replicated.buckets)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("schedule_name", ["gpipe", "1f1b"])
def test_two_stages_times_two_replicas_equal_one_process_on_the_global_batch(
    rank_pools, schedule_name, m
):
    results = rank_pools(4).run(train_dp_pp, schedule_name, m)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = global_batch(m, step)
        mse(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    for rank, (params, all_reduces, buckets) in enumerate(results):
        stage, replica = rank % 2, rank // 2
        # One synchronizing backward per step, the last microbatch's: m - 1 backwards stay local.
        assert all_reduces == STEPS * buckets, f"rank {rank}: {all_reduces} all-reduces"
        for index, (ours, reference) in enumerate(zip(params, model[stage].parameters())):
            record_max("DP x PP: |param - one process's|", (ours - reference.detach()).abs().max())
            where = f"stage {stage}, replica {replica}, parameter {index}"
            difference = (ours - reference.detach()).abs().max().item()
            assert difference <= 1e-12, f"{where} differs from one process's by {difference:.3g}"
        copy = results[(rank + 2) % 4][0]  # the same stage in the other replica: the same bits
        assert all(torch.equal(a, b) for a, b in zip(params, copy)), f"rank {rank}'s copy"


def forward_outside_no_sync_too_early() -> str:
    """Plain accumulation's habit, in a pipeline's order: F0 inside no_sync, F1 (the last)
    outside, then B0 and B1. B0 reduces (armed by F1); B1 is refused."""
    model = MiniDDP(nn.Linear(3, 1))
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(dist.get_rank()))
    with model.no_sync():
        first = model(x[:1]).sum()
    last = model(x[1:]).sum()
    first.backward()
    try:
        last.backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_the_last_forward_outside_no_sync_is_refused_at_the_next_backward(pool2):
    for message in pool2.run(forward_outside_no_sync_too_early):
        assert "arrived after this forward's gradients were already synchronized" in message
