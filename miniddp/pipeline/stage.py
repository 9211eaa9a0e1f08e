"""One stage of a pipeline: a slice of the model on one rank, and what it keeps for backward.

Vocabulary (the GPipe paper's and torch.distributed.pipelining's): the model is cut into p
*stages*, stage s on rank s of the pipeline's process group; a batch is cut into m
*microbatches*; the *activation* of microbatch i at stage s is what stage s receives from stage
s-1 (its input) and hands to stage s+1 (its output).

A stage does two things for a schedule (schedule.py), in whatever order the schedule says:

    forward(i, x)     run the slice on microbatch i's input; keep input and output for backward
    backward(i, g)    backpropagate g (the gradient of the loss with respect to the output,
                      received from stage s+1; on the last stage, the loss itself) through
                      what forward(i) kept, accumulating the parameters' .grad, and return the
                      gradient with respect to the input, for stage s-1; then drop what was kept

What it keeps between the two is the memory a schedule is judged by: `peak_held` counts the
microbatches whose activations were held at once during the last step.

The input of every stage but the first is a fresh leaf (`detach().requires_grad_()`): autograd
then stops at the stage's border, and `input.grad` after backward is what goes upstream.

Data parallelism inside a stage (DP x PP): a submodule wrapped in MiniDDP (or torch's DDP)
decides at FORWARD time whether the coming backward all-reduces, and a pipeline runs the last
microbatch's forward long before its backward, with other microbatches' backwards in between:
a synced last forward would arm the reduction for the NEXT backward, another microbatch's. So
every forward runs inside `no_sync()`, and right before the last microbatch's backward the stage
arms the wrapper by hand: `prepare_for_backward(output)`, the name of the reducer call torch's
pipelining makes for the same reason (`ddp.reducer.prepare_for_backward`). That one backward
then all-reduces the gradients of all m microbatches. Nothing runs twice: the gradient is the
gradient of the loss that was computed, dropout's masks and BatchNorm's m updates included.
Inside the user's own `no_sync()` (accumulating over several steps) the stage arms nothing.
As in torch, buffers are not broadcast between the replicas (no forward is synced).

Every parameter of the stage is marked as this stage's (miniddp/placement.py): clipping's norm
adds the stages' parts, and a checkpoint keeps each stage's state apart.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp.job.env import HOW_TO_LAUNCH
from miniddp.pipeline.step_checks import gather_rows
from miniddp.placement import Stage, mark


@dataclass
class Held:
    """What forward(i) keeps for backward(i): the stage's input leaf, its output, and on the
    last stage the loss backward starts from."""

    input: torch.Tensor
    output: torch.Tensor
    loss: torch.Tensor | None = None


class PipelineStage:
    """`submodule` as stage `stage_index` of `num_stages`, on rank `stage_index` of `group`
    (torch's `PipelineStage` arguments). `input_args`, an example of this stage's input
    microbatch, fixes the shape of what it receives; without it, the previous stage sends the
    shape once, with its first activation."""

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device | str,
        group: dist.ProcessGroup | None = None,
        input_args: torch.Tensor | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                f"A PipelineStage needs a process group, and none exists. {HOW_TO_LAUNCH}"
            )
        self.submodule = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group = group
        has_example = _check_stages_agree(
            stage_index, num_stages, input_args is not None, group, self.device
        )
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.input_example = input_args
        # Whether the next stage was given an example of its input: then no shape is sent to it.
        self.next_knows_its_shape = not self.is_last and has_example[stage_index + 1]
        self.data_parallel = hasattr(submodule, "no_sync")  # MiniDDP or torch's DDP inside
        self.held: dict[int, Held] = {}
        self.peak_held = 0
        for param in submodule.parameters():
            mark(param, stage=Stage(group, stage_index, num_stages))

    def forward(self, microbatch: int, x: torch.Tensor) -> torch.Tensor:
        """Run the slice on microbatch `microbatch` and keep what its backward needs; returns
        the output. With data parallelism inside, no forward arms the reduction (above)."""
        if not self.is_first:
            x = x.detach().requires_grad_()
        no_sync = self.submodule.no_sync() if self.data_parallel else contextlib.nullcontext()
        with no_sync:
            output = self.submodule(x)
        self.held[microbatch] = Held(x, output)
        self.peak_held = max(self.peak_held, len(self.held))
        return output

    def keep_loss(self, microbatch: int, loss: torch.Tensor) -> None:
        """On the last stage, backward starts from the loss, not from the output."""
        self.held[microbatch].loss = loss

    def backward(
        self, microbatch: int, output_grad: torch.Tensor | None, last: bool = False
    ) -> torch.Tensor | None:
        """Backpropagate through what forward(microbatch) kept; the input's gradient, if any.
        `last`: the step's last backward, the one that all-reduces under data parallelism."""
        held = self.held.pop(microbatch)
        if last and self.data_parallel:
            _arm_reduction(self.submodule, held.output)
        if held.loss is not None:
            torch.autograd.backward(held.loss)  # d loss / d loss = 1
        else:
            torch.autograd.backward(held.output, grad_tensors=output_grad)
        return None if self.is_first else held.input.grad

    def start_step(self) -> None:
        if self.held:
            unfinished = sorted(self.held)
            raise RuntimeError(
                f"stage {self.stage_index} still holds microbatches {unfinished} from a step "
                "that raised: build a new PipelineStage and schedule to start again"
            )
        self.peak_held = 0


def _arm_reduction(wrapper: nn.Module, output: torch.Tensor) -> None:
    """Make the coming backward through `output` all-reduce, as a synced forward would have;
    unless the user is accumulating over steps, inside the wrapper's own `no_sync()`."""
    if not wrapper.require_backward_grad_sync:
        return
    if isinstance(wrapper, DistributedDataParallel):  # torch's, armed as torch's pipelining does
        wrapper.reducer.prepare_for_backward([output])
    else:
        wrapper.prepare_for_backward(output)


def _check_stages_agree(
    stage_index: int,
    num_stages: int,
    has_example: bool,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> list[bool]:
    """Every rank of the group tells the others its stage index and stage count, so a mistake on
    one rank is refused on all of them, instead of leaving the others waiting for a message; and
    whether it was given an example of its input. Returns the latter, per rank."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    row = [stage_index, num_stages, int(has_example)]
    claims = gather_rows(row, "the stages' check", group, device)
    problems = []
    for each_rank, (index, count, _) in enumerate(claims):
        if count != size:
            problems.append(
                f"rank {each_rank} says num_stages={count}, but the pipeline's group has "
                f"{size} ranks: one stage per rank, so num_stages must be {size} (or give "
                "PipelineStage the group of this pipeline's ranks)"
            )
        elif index != each_rank:
            problems.append(
                f"rank {each_rank} says stage_index={index}: stage s runs on rank s of the "
                f"group, so pass stage_index=dist.get_rank(group) ({each_rank})"
            )
    if problems:
        raise ValueError(
            f"The pipeline's stages disagree (seen on rank {rank}):\n  " + "\n  ".join(problems)
        )
    return [bool(example) for _, _, example in claims]
