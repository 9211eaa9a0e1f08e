"""Pipeline parallelism from scratch: a model cut into stages, one per rank, fed microbatches.

    stage = PipelineStage(model_slice, stage_index=rank, num_stages=world_size, device=device)
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=loss_fn)   # or ScheduleGPipe
    if stage.is_first:
        schedule.step(x)                                   # the batch goes in here
    elif stage.is_last:
        schedule.step(target=y, losses=losses)             # the loss comes out here
    else:
        schedule.step()
    optimizer.step()                                       # each stage steps its own slice

The same calls as torch.distributed.pipelining, on torch.distributed's send and receive:

    actions.py      F i and B i, and what makes a list of them one stage's order
    stage.py        a slice of the model and what it keeps between forward and backward
    p2p.py          activations forward, gradients backward, and the shape sent once
    schedule.py     one step, as an order of forwards and backwards; checks; 1/m scaling;
                    the orders, GPipe and 1F1B, their bubble and their memory
    step_checks.py  bad input refused on every stage
    timeline.py     the recorded step as blocks: the picture, the bubble, in ASCII too; and
                    FixedCost, a layer that takes a fixed time, to measure a schedule
"""

from miniddp.pipeline.actions import Action
from miniddp.pipeline.schedule import PipelineSchedule, Schedule1F1B, ScheduleGPipe
from miniddp.pipeline.stage import PipelineStage
from miniddp.pipeline.timeline import FixedCost

__all__ = [
    "Action",
    "FixedCost",
    "PipelineSchedule",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleGPipe",
]
