"""DP x PP: 4 ranks as a (pp, dp) = (2, 2) mesh, two pipelines of two stages, each stage's slice
data-parallel with MiniDDP over its copy in the other pipeline, against one process training on
the global batch, and against the same pipelines with the all-reduce written by hand.

Not bitwise against one process: one process averages the loss over all 2 x m x b samples at
once, while here each microbatch's loss / m is summed into .grad and averaged over the two
replicas; the same numbers, added in another order. In float64 that moves the last bits only.

Against the same pipeline without MiniDDP, whose gradients are all-reduced by hand after the
step, it is bitwise, with dropout and BatchNorm in the slices: MiniDDP changes nothing but the
averaging. That is the trap of this composition: MiniDDP (like torch's DDP) decides at FORWARD
time whether a backward all-reduces, and a pipeline runs the last microbatch's forward long
before its backward. A stage that replayed the last forward before its backward drew a second
dropout mask (a gradient of a loss never computed) and counted m + 1 batches in BatchNorm; the
stage now arms the reduction at that backward instead (miniddp/pipeline/stage.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from miniddp import MiniDDP
from miniddp.observe.events import Recorder
from miniddp.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe
from tests.harness.measurements import record_max
from tests.mesh_tasks import mesh_once

WIDTHS = (6, 5, 3)
MICROBATCH, STEPS, LR, REPLICAS = 2, 3, 0.1, 2
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def build_model(layer: str = "") -> nn.Sequential:
    """Two blocks, Linear + Tanh, with `layer` ("dropout", "batchnorm") inside each."""
    torch.manual_seed(0)
    extra = {"dropout": lambda w: nn.Dropout(0.5), "batchnorm": nn.BatchNorm1d}
    blocks = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        inside = [extra[layer](b)] if layer else []
        blocks.append(nn.Sequential(nn.Linear(a, b), *inside, nn.Tanh()))
    return nn.Sequential(*blocks).double()


def global_batch(m: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    size = REPLICAS * m * MICROBATCH
    x = torch.randn(size, WIDTHS[0], generator=generator, dtype=torch.float64)
    return x, torch.randn(size, WIDTHS[-1], generator=generator, dtype=torch.float64)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).pow(2).mean()


def run_step(schedule, stage: PipelineStage, x: torch.Tensor, y: torch.Tensor) -> None:
    schedule.step(x) if stage.is_first else schedule.step(target=y)


def average_by_hand(block: nn.Module, group: dist.ProcessGroup) -> None:
    """What MiniDDP does, written out: sum the replicas' gradients, divide by their number."""
    for param in block.parameters():
        dist.all_reduce(param.grad, group=group)
        param.grad.div_(dist.get_world_size(group))


def train_dp_pp(schedule_name: str, m: int, layer: str = "", by_hand: bool = False) -> dict:
    """On each of the 4 ranks: its stage, data-parallel over the mesh's "dp" axis (MiniDDP, or
    by hand), trained on its replica's half of each global batch. Returns its parameters and
    buffers after STEPS SGD steps, MiniDDP's all-reduces and its bucket count."""
    mesh = mesh_once((2, REPLICAS), ("pp", "dp"))
    stage_index, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    block = build_model(layer)[stage_index]
    dp_group = mesh["dp"].get_group()
    wrapped = block if by_hand else MiniDDP(block, process_group=dp_group)
    stage = PipelineStage(wrapped, stage_index, 2, "cpu", group=mesh["pp"].get_group())
    schedule = SCHEDULES[schedule_name](stage, m, mse)
    optimizer = torch.optim.SGD(block.parameters(), lr=LR)
    torch.manual_seed(100 + dist.get_rank())  # every rank its own dropout masks
    for step in range(STEPS):
        x, y = (t.tensor_split(REPLICAS)[replica] for t in global_batch(m, step))
        run_step(schedule, stage, x, y)
        if by_hand:
            average_by_hand(block, dp_group)
        optimizer.step()
        optimizer.zero_grad()
    return {
        "params": [p.detach().clone() for p in block.parameters()],
        "buffers": {name: b.clone() for name, b in block.named_buffers()},
        "all_reduces": 0 if by_hand else wrapped.all_reduce_count,
        "buckets": 0 if by_hand else len(wrapped.buckets),
    }


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
    for rank, result in enumerate(results):
        stage, replica = divmod(rank, REPLICAS)  # the mesh: rank = 2 * pp + dp
        # One synchronizing backward per step, the last microbatch's: m - 1 backwards stay local.
        assert result["all_reduces"] == STEPS * result["buckets"], f"rank {rank}"
        for index, (ours, reference) in enumerate(zip(result["params"], model[stage].parameters())):
            record_max("DP x PP: |param - one process's|", (ours - reference.detach()).abs().max())
            where = f"stage {stage}, replica {replica}, parameter {index}"
            difference = (ours - reference.detach()).abs().max().item()
            assert difference <= 1e-12, f"{where} differs from one process's by {difference:.3g}"
        copy = results[rank ^ 1]["params"]  # the same stage in the other replica: the same bits
        assert all(torch.equal(a, b) for a, b in zip(result["params"], copy)), f"rank {rank}"


@pytest.mark.parametrize("schedule_name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("layer", ["dropout", "batchnorm"])
def test_with_dropout_or_batchnorm_it_is_bitwise_the_pipeline_averaged_by_hand(
    rank_pools, schedule_name, layer
):
    """The gradient is that of the loss computed (the same dropout masks), and BatchNorm sees
    exactly m batches a step, with each replica's own statistics (torch's DDP inside torch's
    pipelining broadcasts no buffers either: no forward is synced)."""
    m = 4
    pool = rank_pools(4)
    ours = pool.run(train_dp_pp, schedule_name, m, layer)
    by_hand = pool.run(train_dp_pp, schedule_name, m, layer, True)
    for rank, (result, reference) in enumerate(zip(ours, by_hand)):
        for index, (a, b) in enumerate(zip(result["params"], reference["params"])):
            assert torch.equal(a, b), (
                f"rank {rank}'s parameter {index} differs by {(a - b).abs().max():.3g}"
            )
        for name, buffer in reference["buffers"].items():
            assert torch.equal(result["buffers"][name], buffer), f"rank {rank}'s buffer {name}"
        if layer == "batchnorm":
            assert result["buffers"]["1.num_batches_tracked"].item() == STEPS * m


def sends_and_waits(schedule_name: str) -> tuple[int, list[str]]:
    """One step of 2 microbatches, MiniDDP and the schedule heard by one Recorder: this rank's
    stage, and its sends and MiniDDP's waits for its buckets, in the order they happened."""
    mesh = mesh_once((2, REPLICAS), ("pp", "dp"))
    stage_index, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    block = build_model()[stage_index]
    wrapped = MiniDDP(block, process_group=mesh["dp"].get_group())
    stage = PipelineStage(wrapped, stage_index, 2, "cpu", group=mesh["pp"].get_group())
    schedule = SCHEDULES[schedule_name](stage, 2, mse)
    schedule.observer = wrapped.observer = recorder = Recorder()
    run_step(schedule, stage, *(t.tensor_split(REPLICAS)[replica] for t in global_batch(2, 0)))
    heard = [f"{e.kind} {e.name}" for e in recorder.events if e.kind in ("send", "wait")]
    return stage_index, heard


@pytest.mark.parametrize("schedule_name", ["gpipe", "1f1b"])
def test_the_last_stage_sends_its_last_gradient_before_waiting_for_its_all_reduce(
    rank_pools, schedule_name
):
    """The stage before needs that gradient for its own last backward, and so to start its own
    all-reduce: sent after this stage's wait, the stages' all-reduces would run one after the
    other (pipeline/stage.py, `early`)."""
    for stage_index, events in rank_pools(4).run(sends_and_waits, schedule_name):
        if stage_index == 1:
            waits = [k for k, event in enumerate(events) if event.startswith("wait")]
            (sent,) = [k for k, event in enumerate(events) if event.startswith("send gradient 1")]
            assert waits and sent < waits[0], events


def accumulate_over_two_steps(schedule_name: str) -> dict:
    """Two pipeline steps before one optimizer step: the first inside MiniDDP's no_sync (no
    all-reduce), the second reducing everything. Returns .grad and the all-reduces."""
    m = 2
    mesh = mesh_once((2, REPLICAS), ("pp", "dp"))
    stage_index, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    block = build_model()[stage_index]
    wrapped = MiniDDP(block, process_group=mesh["dp"].get_group())
    stage = PipelineStage(wrapped, stage_index, 2, "cpu", group=mesh["pp"].get_group())
    schedule = SCHEDULES[schedule_name](stage, m, mse)
    for step in range(2):
        x, y = (t.tensor_split(REPLICAS)[replica] for t in global_batch(m, step))
        if step == 0:
            with wrapped.no_sync():
                run_step(schedule, stage, x, y)
            local = wrapped.all_reduce_count
        else:
            run_step(schedule, stage, x, y)
    grads = [p.grad.clone() for p in block.parameters()]
    return {"grads": grads, "after_first": local, "all_reduces": wrapped.all_reduce_count}


@pytest.mark.parametrize("schedule_name", ["gpipe", "1f1b"])
def test_accumulating_two_steps_under_no_sync_sums_them_as_one_process(rank_pools, schedule_name):
    results = rank_pools(4).run(accumulate_over_two_steps, schedule_name)
    model = build_model()
    for step in range(2):  # one process: the mean loss of each global batch, accumulated
        mse(model(global_batch(2, step)[0]), global_batch(2, step)[1]).backward()
    for rank, result in enumerate(results):
        stage = rank // REPLICAS
        assert result["after_first"] == 0, f"rank {rank} all-reduced inside no_sync"
        assert result["all_reduces"] > 0
        for index, (ours, param) in enumerate(zip(result["grads"], model[stage].parameters())):
            record_max(
                "DP x PP, two steps: |grad - one process's|", (ours - param.grad).abs().max()
            )
            torch.testing.assert_close(ours, param.grad, rtol=0, atol=1e-12, msg=f"{rank} {index}")


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


INTERLEAVED_WIDTHS = (6, 5, 4, 3, 2)  # four stages, v = 2 on each of the two pipeline ranks


def train_dp_interleaved(m: int, by_hand: bool) -> dict:
    """On each of the 4 ranks of a (pp, dp) = (2, 2) mesh: its two stages s and s + 2, each
    wrapped in its own MiniDDP over "dp" (or averaged by hand), under interleaved 1F1B."""
    from miniddp.pipeline import ScheduleInterleaved1F1B

    mesh = mesh_once((2, REPLICAS), ("pp", "dp"))
    rank, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    model = nn.Sequential(
        *(
            nn.Sequential(nn.Linear(a, b), nn.Tanh())
            for a, b in zip(INTERLEAVED_WIDTHS, INTERLEAVED_WIDTHS[1:])
        )
    ).double()
    dp_group, pp_group = mesh["dp"].get_group(), mesh["pp"].get_group()
    blocks = [model[rank], model[rank + 2]]
    stages = [
        PipelineStage(
            block if by_hand else MiniDDP(block, process_group=dp_group),
            index,
            4,
            "cpu",
            group=pp_group,
        )
        for index, block in zip((rank, rank + 2), blocks)
    ]
    schedule = ScheduleInterleaved1F1B(stages, m, mse)
    optimizer = torch.optim.SGD([p for b in blocks for p in b.parameters()], lr=LR)
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        size = REPLICAS * m * MICROBATCH
        x = torch.randn(size, INTERLEAVED_WIDTHS[0], generator=generator, dtype=torch.float64)
        y = torch.randn(size, INTERLEAVED_WIDTHS[-1], generator=generator, dtype=torch.float64)
        x, y = x.tensor_split(REPLICAS)[replica], y.tensor_split(REPLICAS)[replica]
        schedule.step(x) if rank == 0 else schedule.step(target=y)
        if by_hand:
            for block in blocks:
                average_by_hand(block, dp_group)
        optimizer.step()
        optimizer.zero_grad()
    return {"params": [[p.detach().clone() for p in b.parameters()] for b in blocks]}


def test_miniddp_stages_under_interleaved_1f1b_are_the_pipeline_averaged_by_hand(rank_pools):
    """Two MiniDDP-wrapped stages a rank, each armed at its own last backward: bitwise the same
    pipeline averaged by hand after the step (torch's DDP inside its interleaved 1F1B trains
    too), and so within rounding of one process (the first test above says why not bitwise)."""
    m = 4
    pool = rank_pools(4)
    ours = pool.run(train_dp_interleaved, m, False)
    by_hand = pool.run(train_dp_interleaved, m, True)
    for rank, (result, reference) in enumerate(zip(ours, by_hand)):
        for k, (mine, theirs) in enumerate(zip(result["params"], reference["params"])):
            for a, b in zip(mine, theirs):
                assert torch.equal(a, b), f"rank {rank}'s stage {k}: off by {(a - b).abs().max()}"
    torch.manual_seed(0)
    widths = INTERLEAVED_WIDTHS
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(widths, widths[1:]))
    ).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        size = REPLICAS * m * MICROBATCH
        x = torch.randn(size, widths[0], generator=generator, dtype=torch.float64)
        y = torch.randn(size, widths[-1], generator=generator, dtype=torch.float64)
        mse(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    for rank, result in enumerate(ours):
        pp_rank = rank // REPLICAS
        for k, params in enumerate(result["params"]):
            for ours_p, reference in zip(params, model[pp_rank + 2 * k].parameters()):
                difference = (ours_p - reference.detach()).abs().max().item()
                record_max("DP x interleaved PP: |param - one process's|", difference)
                assert difference <= 1e-12, (rank, k, difference)
