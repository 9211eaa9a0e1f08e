"""What one rank sees wrong by itself, before a step: its stages, its order, its inputs.

A rank knows only its own part of the pipeline: the stages it was given, the order its
schedule makes, and the batch (first stage) or target (last) it was handed. Each function here
looks at that part alone and names the first problem it finds, as step_checks.Problem and its
numbers; step_checks then gathers every rank's findings and raises the same error on all of
them, so that no stage is left waiting for one that refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miniddp.pipeline.actions import Action, order_problem
from miniddp.pipeline.stage import PipelineStage
from miniddp.pipeline.step_checks import Found, Problem


def stages_problem(
    stages: Sequence[PipelineStage],
    schedule_name: str,
    stages_per_rank_at_most: int | None,
    splits_backward: bool,
) -> str | None:
    """What is wrong with the stages this rank gave its schedule (None: nothing)."""
    first = stages[0]
    size, v = first.group_size, len(stages)
    if any(s.group is not first.group or s.num_stages != first.num_stages for s in stages):
        return "its stages belong to different pipelines (groups or num_stages differ)"
    most = stages_per_rank_at_most
    if most is not None and first.num_stages > size * most:
        return (
            f"{schedule_name} runs one stage a rank, and there are "
            f"{first.num_stages} stages on {size} ranks: use ScheduleInterleaved1F1B"
        )
    expected = [first.rank + i * size for i in range(first.num_stages // size)]
    if [s.stage_index for s in stages] != expected:
        return (
            f"it was given stages {[s.stage_index for s in stages]} (v = {v}); rank "
            f"{first.rank} holds stages {expected}, every one of them, in that order"
        )
    if any(s.data_parallel for s in stages) and splits_backward:
        return (
            "a data-parallel stage (MiniDDP inside) runs under ScheduleGPipe, Schedule1F1B "
            "or ScheduleInterleaved1F1B, its backward whole, or under the V schedules "
            "(ScheduleZBVZeroBubble, ScheduleDualPipeV)"
        )
    if splits_backward and any(s.fully_sharded for s in stages):
        return (
            f"a fully_shard'ed stage cannot run under {schedule_name}: fully_shard gathers a "
            "unit's weights for one whole backward and reduces their gradients when it ends, "
            "and the zero-bubble split runs that backward in two passes (the inputs' gradients, "
            "later the weights'), so the stage would not train. Use ScheduleInterleaved1F1B, "
            "which trains it"
        )
    return None


def rank_problem(
    stages: Sequence[PipelineStage],
    order: list[Action],
    m: int,
    args: tuple[torch.Tensor, ...],
    target: torch.Tensor | None,
    losses: list | None,
    *,
    backward: bool,
    has_loss_fn: bool,
    first_shapes: tuple[tuple[int, ...], ...] | None,
) -> Found:
    """What this rank can see wrong with its own part of a step of m microbatches: its order
    (a learner's schedule may be wrong; then also why, for this rank's message), and the
    step's args, target and losses where its stages are the first or the last.
    `first_shapes`: the first step's microbatch shapes, which every later step must keep."""
    if len(stages) == 1:  # its actions are named as written: F0, not F0@0
        own = stages[0].stage_index
        problem = order_problem([a._replace(stage=None) for a in order if a.stage == own], m)
        strangers = [str(a) for a in order if a.stage != own]
        problem = problem or (f"{strangers[0]} is not this rank's" if strangers else None)
    else:
        problem = order_problem(order, m, [s.stage_index for s in stages])
    if problem is not None:
        return Problem.BAD_ORDER, 0, 0, problem
    if any(stage.is_first for stage in stages):
        if not args:
            return Problem.NO_INPUT, 0, 0
        if not all(isinstance(a, torch.Tensor) and a.dim() > 0 for a in args):
            return Problem.INPUT_NOT_TENSORS, 0, 0
        size = next((a.shape[0] for a in args if a.shape[0] % m), None)
        if size is not None:
            return Problem.INPUT_NOT_DIVISIBLE, size, m
        shapes = microbatch_shapes(args, m)
        if first_shapes is not None and shapes != first_shapes:
            return Problem.INPUT_SHAPE_CHANGED, shapes[0][0], first_shapes[0][0]
    elif args:
        return Problem.INPUT_NOT_ON_FIRST, 0, 0
    if any(stage.is_last for stage in stages):
        if target is not None and not has_loss_fn:
            return Problem.TARGET_WITHOUT_LOSS_FN, 0, 0
        if target is None and backward:
            return Problem.NO_TARGET, 0, 0
        if target is not None and target.shape[0] % m:
            return Problem.TARGET_NOT_DIVISIBLE, target.shape[0], m
        if losses is not None and target is None:
            return Problem.NO_LOSSES_TO_FILL, 0, 0
    return Problem.NONE, 0, 0


def microbatch_shapes(args: tuple[torch.Tensor, ...], m: int) -> tuple[tuple[int, ...], ...]:
    """The shape of each argument's microbatch, the batch's tensors split m ways along dim 0."""
    return tuple((a.shape[0] // m, *a.shape[1:]) for a in args)
