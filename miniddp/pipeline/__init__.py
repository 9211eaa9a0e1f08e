"""Pipeline parallelism from scratch: a model cut into stages, on ranks, fed microbatches.

    stage = PipelineStage(model_slice, stage_index=rank, num_stages=world_size, device=device)
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)   # or ScheduleGPipe
    if stage.is_first:
        schedule.step(x)                                   # the batch goes in here
    elif stage.is_last:
        schedule.step(target=y, losses=losses)             # the loss comes out here
    else:
        schedule.step()
    optimizer.step()                                       # each stage steps its own slice

Validation is forward only, with the same calls: schedule.eval(x), eval(target=y, losses=losses),
eval() (torch's name; no backward, no .grad touched). A schedule built with loss_fn=None runs
forward only in step() too.

A stage may take and return a tuple of tensors (a hidden state and its mask): step(x, mask)
on the first stage, and each stage is called as submodule(*what the previous one returned).

Interleaved, rank r holds v stages r, r + W, .., and its schedule takes them all:

    stages = [PipelineStage(chunks[rank + i * W], rank + i * W, v * W, device) for i in range(v)]
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=8, loss_fn=loss_fn)
    # or ScheduleInterleavedZeroBubble; then step() as above, on the ranks of the first and
    # last stage (ranks 0 and W - 1)

In a V, rank r holds stages r and 2W - 1 - r, so rank 0 holds the first and the last:

    stages = [PipelineStage(chunks[s], s, 2 * W, device) for s in (rank, 2 * W - 1 - rank)]
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=8, loss_fn=loss_fn)  # or DualPipeV
    schedule.step(x, target=y, losses=losses) if rank == 0 else schedule.step()

The same calls as torch.distributed.pipelining, on torch.distributed's send and receive:

    actions.py      F i, B i (or I i and W i) at a stage, and what makes a rank's order
    stage.py        a slice of the model and what it keeps between forward and backward
    p2p.py          activations forward, gradients backward, and the shape sent once
    borders.py      what crosses a stage's borders at each action, under which tag
    microbatches.py the batch split into m microbatches, the outputs merged back
    schedule.py     one step, as an order of forwards and backwards; forward only; 1/m
                    scaling; the orders, GPipe and 1F1B, their bubble and their memory
    interleaved.py  v stages a rank, and the backward split in two: interleaved 1F1B and
                    zero bubble, their orders, bubble and memory
    v_schedules.py  two stages a rank in a V, r and 2W - 1 - r: ZB-V and DualPipeV
    rank_checks.py  what one rank sees wrong by itself: its stages, order, inputs
    step_checks.py  bad input refused on every stage
    bubble.py       the recorded step as blocks: the picture, the bubble, in ASCII too; and
                    FixedCost, a layer that takes a fixed time, to measure a schedule
"""

from miniddp.pipeline.actions import Action
from miniddp.pipeline.bubble import FixedCost
from miniddp.pipeline.interleaved import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble
from miniddp.pipeline.schedule import PipelineSchedule, Schedule1F1B, ScheduleGPipe
from miniddp.pipeline.stage import PipelineStage
from miniddp.pipeline.v_schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

__all__ = [
    "Action",
    "FixedCost",
    "PipelineSchedule",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
]
