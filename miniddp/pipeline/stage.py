"""One stage of a pipeline: a slice of the model on one rank, and what it keeps for backward.

Vocabulary (the GPipe paper's and torch.distributed.pipelining's): the model is cut into
*stages*; a batch is cut into m *microbatches*; the *activation* of microbatch i at stage s is
what stage s receives from stage s-1 (its input) and hands to stage s+1 (its output).

Where stages run: with W ranks in the pipeline's group and v stages a rank (v = 1 for GPipe
and 1F1B; v >= 2 *interleaves*, Narayanan et al., 2021), there are v W stages and stage s runs
on rank s % W, torch's layout:

    rank r holds stages r, r + W, .., r + (v - 1) W       (W = 2, v = 2: rank 0 holds 0 and 2)

The V schedules (v_schedules.py) place the second round mirrored instead, stage s on rank
2W - 1 - s: rank r holds r and 2W - 1 - r. The check below accepts either round; the schedule,
which knows its layout, tells its stages where their neighbours are (`ranks_of_stages`, as
torch's schedules set `stage_index_to_group_rank`).

Each rank builds its v stages in that order, i = 0 .. v-1: building a stage is a collective
(every rank states the stage it builds, below), so a rank building another stage than its
neighbours is refused on every rank, naming the rank and the fix, instead of a hang later.

A stage does these things for a schedule (schedule.py), in whatever order the schedule says:

    forward(i, inputs)     run the slice on microbatch i's inputs; keep inputs and output
    backward(i, g)         backpropagate g (the gradients of the loss with respect to the
                           outputs, received from stage s+1; on the last stage, the loss itself)
                           through what forward(i) kept, accumulating the parameters' .grad;
                           return the inputs' gradients, for stage s-1; drop what was kept
    backward_input(i, g)   the same input gradients, and nothing else: .grad is not touched
    backward_weight(i)     later, the parameters' part of the same backward, then drop

(the last two are the zero-bubble split, miniddp/pipeline/interleaved.py). What a stage keeps
between forward and its backward is the memory a schedule is judged by: `peak_held` counts the
microbatches whose activations were held at once during the last step.

A stage's inputs and outputs are tuples of tensors (a lone tensor is a tuple of one), called as
`submodule(*inputs)`. Every floating-point input of every stage but the first is a fresh leaf
(`detach().requires_grad_()`): autograd then stops at the stage's border, and `input.grad` after
backward is what goes upstream. An integer or bool input (a mask) is passed as it came, and no
gradient goes back for it (p2p.py).

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

That backward ends waiting for the all-reduce (the wrapper's end-of-backward callback), and the
stage before needs this stage's input gradients to run its own last backward. Sent after the
wait, they would chain the stages' all-reduces one after the other (measured on the link:
(pp, dp) = (2, 4), a 4-block GPT at alpha=2ms,100mbit, 155 ms a step where one all-reduce
would take 100). So when it is the rank's last action, the schedule hands that backward an
`early` callback: hooks on the stage's inputs send their gradients the moment autograd has
them (`_SentEarly`), and the all-reduces of all stages travel together.

Every parameter of the stage is marked as this stage's (miniddp/placement.py): clipping's norm
adds the stages' parts, and a checkpoint keeps each stage's state apart.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from miniddp.job.agree import gather_rows
from miniddp.job.env import HOW_TO_LAUNCH, size_and_rank_in
from miniddp.pipeline.p2p import as_tuple, carries_gradient
from miniddp.placement import Stage, mark, placement_of

Activation = tuple[torch.Tensor, ...]  # what crosses a border (p2p.py)
ONE_GROUP_EACH = (
    'give each rank the group of its own pipeline, e.g. mesh["pp"].get_group(), '
    "or group=None for a pipeline over the whole job"
)


@dataclass
class Held:
    """What forward(i) keeps for backward(i): the stage's inputs (leaves where they carry a
    gradient), its output as the submodule returned it, on the last stage the loss backward
    starts from; after backward_input, the gradients it started from."""

    inputs: Activation
    output: torch.Tensor | Activation
    weights: list[torch.Tensor]  # the parameters this forward computed with: the graph's leaves
    loss: torch.Tensor | None = None
    output_grads: Activation | None = None

    def root(self, output_grads: Activation | None) -> tuple[list[torch.Tensor], list | None]:
        """Where backward starts: the loss (its gradient 1), or the outputs that carry a
        gradient and theirs, less those that do not depend on anything that learns (a float
        mask made without the parameters: its gradient, zeros, leads nowhere)."""
        if self.loss is not None:
            return [self.loss], None
        pairs = [
            (out, grad)
            for out, grad in zip(_differentiable(as_tuple(self.output)), output_grads, strict=True)
            if out.requires_grad
        ]
        return [out for out, _ in pairs], [grad for _, grad in pairs]

    def differentiable_inputs(self) -> list[torch.Tensor]:
        return _differentiable(self.inputs)

    def input_grads(self, grads: list[torch.Tensor | None]) -> Activation:
        """The gradient sent upstream for each input that carries one: zeros for an input the
        stage did not use, as torch's pipelining sends."""
        inputs = self.differentiable_inputs()
        return tuple(
            torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads, strict=True)
        )


def _differentiable(tensors: Activation) -> list[torch.Tensor]:
    return [t for t in tensors if carries_gradient(t.dtype)]


class PipelineStage:
    """`submodule` as stage `stage_index` of `num_stages`, on rank `stage_index % W` of
    `group`, W ranks, or where a V places it (torch's `PipelineStage` arguments).
    `input_args`, an example of this stage's input microbatch (a tensor, or a tuple of them),
    fixes the shapes of what it receives; without it, the previous stage sends them once,
    with its first activation."""

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device | str,
        group: dist.ProcessGroup | None = None,
        input_args: torch.Tensor | Activation | None = None,
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
        self.group_size, self.rank = size_and_rank_in(group, "pipeline", ONE_GROUP_EACH)
        # Whether each stage built in this round (this one and its W - 1 peers) has an example.
        self.examples = _check_stages_agree(
            stage_index, num_stages, input_args is not None, group, self.device
        )
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.input_example = None if input_args is None else as_tuple(input_args)
        self.data_parallel = hasattr(submodule, "no_sync")  # MiniDDP or torch's DDP inside
        self.fully_sharded = _fully_sharded(submodule)
        self.held: dict[int, Held] = {}
        self.peak_held = 0
        # Where every stage runs: torch's loop, s % W, unless a V schedule sets its own.
        self.ranks_of_stages = [s % self.group_size for s in range(num_stages)]
        for param in submodule.parameters():
            mark(param, stage=Stage(group, stage_index, num_stages, self.rank))

    def rank_of(self, stage_index: int) -> int:
        """The rank of the group that runs stage `stage_index`."""
        return self.ranks_of_stages[stage_index]

    def forward(
        self, microbatch: int, inputs: Activation, keep: bool = True
    ) -> torch.Tensor | Activation:
        """Run the slice on microbatch `microbatch`'s inputs, `submodule(*inputs)`; returns the
        output. `keep`: hold what its backward needs (not in a forward-only run). With data
        parallelism inside, no forward arms the reduction (above)."""
        if keep and not self.is_first:
            inputs = tuple(
                x.detach().requires_grad_() if carries_gradient(x.dtype) else x for x in inputs
            )
        no_sync = self.submodule.no_sync() if self.data_parallel else contextlib.nullcontext()
        with no_sync:
            output = self.submodule(*inputs)
        if keep:
            # Read now: a wrapper computing in copies of its parameters (ComputeInCopies) holds
            # the copies, the graph's leaves, until this forward's backward; later they may be
            # back to the masters, which the graph never saw (backward_weight).
            weights = [p for p in self.submodule.parameters() if p.requires_grad]
            self.held[microbatch] = Held(inputs, output, weights)
            self.peak_held = max(self.peak_held, len(self.held))
        return output

    def keep_loss(self, microbatch: int, loss: torch.Tensor) -> None:
        """On the last stage, backward starts from the loss, not from the output."""
        self.held[microbatch].loss = loss

    def backward(
        self,
        microbatch: int,
        output_grads: Activation | None,
        last: bool = False,
        early: Callable[[Activation], None] | None = None,
    ) -> Activation | None:
        """Backpropagate through what forward(microbatch) kept; the gradients of the inputs that
        carry one, for stage s-1 (None on the first stage, or when `early` took them). `last`:
        the step's last backward, the one that all-reduces under data parallelism; there
        `early`, if given, gets the input gradients before the all-reduce is waited for."""
        held = self.held.pop(microbatch)
        sent = None
        if last and self.data_parallel:
            _arm_reduction(self.submodule, held.output)
            if early is not None and not self.is_first:
                sent = _SentEarly(held, early)
        roots, grads = held.root(output_grads)
        try:
            if roots:  # from the loss: d loss/d loss = 1
                torch.autograd.backward(roots, grad_tensors=grads)
        finally:
            if sent is not None:
                sent.remove()
        if self.is_first or (sent is not None and sent.done):
            return None
        return held.input_grads([x.grad for x in held.differentiable_inputs()])

    def backward_input(self, microbatch: int, output_grads: Activation | None) -> Activation | None:
        """d loss / d inputs alone: `autograd.grad` with respect to the input leaves computes
        only the gradients on the path to them, and `.grad` of no parameter; `retain_graph`
        keeps the graph for backward_weight. The first stage has no input gradient: nothing
        runs."""
        held = self.held[microbatch]
        held.output_grads = output_grads
        inputs = held.differentiable_inputs()
        if self.is_first or not inputs:
            return None if self.is_first else ()
        roots, grads = held.root(output_grads)
        found = torch.autograd.grad(roots, inputs, grads, retain_graph=True, allow_unused=True)
        return held.input_grads(list(found))

    def backward_weight(self, microbatch: int, last: bool = False) -> None:
        """d loss / d parameters, into .grad, from the same roots and gradients as
        backward_input: `autograd.backward(..., inputs=parameters)` accumulates only the
        parameters' .grad, then frees the graph and what forward kept. The parameters are those
        forward computed with (under ComputeInCopies, the bf16 copies: their hooks fold each
        gradient into its fp32 master, as one whole backward does). `last`: the step's last
        weight gradient, the one that all-reduces under data parallelism (backward_input
        touches no .grad, so no hook of the wrapper fires before it)."""
        held = self.held.pop(microbatch)
        if last and self.data_parallel:
            _arm_reduction(self.submodule, held.output)
        roots, grads = held.root(held.output_grads)
        if held.weights and roots:
            torch.autograd.backward(roots, grad_tensors=grads, inputs=held.weights)

    def start_step(self) -> None:
        if self.held:
            unfinished = sorted(self.held)
            raise RuntimeError(
                f"stage {self.stage_index} still holds microbatches {unfinished} from a step "
                "that raised: build a new PipelineStage and schedule to start again"
            )
        self.peak_held = 0


class _SentEarly:
    """Hooks on a stage's inputs for its last backward under data parallelism: once autograd
    has the gradient of every input that carries one, `send` gets them all, while the backward
    goes on to its end and the all-reduce's wait. An input the stage did not use gets no
    gradient, so no hook completes: backward then returns the gradients as usual."""

    def __init__(self, held: Held, send: Callable[[Activation], None]) -> None:
        self.held, self.send, self.done = held, send, False
        self.inputs = held.differentiable_inputs()
        self.arrived: dict[int, torch.Tensor] = {}
        hooks = (partial(self._arrive, k) for k in range(len(self.inputs)))
        self.handles = [x.register_hook(hook) for x, hook in zip(self.inputs, hooks)]

    def _arrive(self, k: int, grad: torch.Tensor) -> None:
        self.arrived[k] = grad
        if len(self.arrived) == len(self.inputs):
            self.send(self.held.input_grads([self.arrived[j] for j in range(len(self.inputs))]))
            self.done = True

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _fully_sharded(submodule: nn.Module) -> bool:
    """Does fully_shard hold parameters of `submodule`? MiniDDP's marks each piece it keeps (a
    DataShard with no owner: every rank of the group holds one, miniddp/placement.py); torch's
    makes the modules it shards FSDPModules."""
    pieces = (placement_of(p).data for p in submodule.parameters())
    return any(data is not None and data.owner is None for data in pieces) or any(
        isinstance(module, FSDPModule) for module in submodule.modules()
    )


def _arm_reduction(wrapper: nn.Module, output: torch.Tensor | Activation) -> None:
    """Make the coming backward through `output` all-reduce, as a synced forward would have;
    unless the user is accumulating over steps, inside the wrapper's own `no_sync()`."""
    if not wrapper.require_backward_grad_sync:
        return
    if isinstance(wrapper, DistributedDataParallel):  # torch's, armed as torch's pipelining does
        wrapper.reducer.prepare_for_backward(list(as_tuple(output)))
    else:
        wrapper.prepare_for_backward(output)


def _check_stages_agree(
    stage_index: int,
    num_stages: int,
    has_example: bool,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> dict[int, bool]:
    """Every rank of the group tells the others the stage it builds and the stage count, so a
    mistake on one rank is refused on all of them, instead of leaving the others waiting for a
    message; and whether it was given an example of its input. The W stages built together
    are one *round* i: stages i W .. i W + W - 1, stage i W + r on rank r, or, in an odd round,
    mirrored, stage i W + W - 1 - r on rank r (the V schedules' second stage, 2W - 1 - r).
    Returns, for each stage of the round, whether it has an example."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    row = [stage_index, num_stages, int(has_example)]
    claims = gather_rows(row, "the stages' check", group, device)
    problems = []
    round_ = claims[0][0] // size  # rank 0's: the others build the same round, the same way
    mirrored = round_ % 2 == 1 and size > 1 and claims[0][0] == round_ * size + size - 1
    for each_rank, (index, count, _) in enumerate(claims):
        if count < size or count % size:
            problems.append(
                f"rank {each_rank} says num_stages={count}, but the pipeline's group has "
                f"{size} ranks: every rank holds the same number v of stages, so num_stages "
                f"must be a multiple of {size} (v * {size}; or give PipelineStage the group of "
                "this pipeline's ranks)"
            )
        elif count != claims[0][1]:
            problems.append(
                f"rank {each_rank} says num_stages={count}, rank 0 says {claims[0][1]}: "
                "give every stage the same num_stages"
            )
        elif index != round_ * size + (size - 1 - each_rank if mirrored else each_rank) or not (
            0 <= index < count
        ):
            problems.append(
                f"rank {each_rank} says stage_index={index}: stage s runs on rank s % {size} "
                f"of the group, and each rank builds its stages in order, rank r's i-th being "
                f"r + i * {size}: pass stage_index=dist.get_rank(group) + i * {size} "
                f"({each_rank + round_ * size} in round i = {round_}, the one rank 0 builds); "
                f"or, for a V schedule, rank r's second stage {2 * size - 1} - r on every rank"
            )
    if size == 1 and num_stages > 1:
        problems.append(
            f"one rank holds all {num_stages} stages: a pipeline needs at least 2 ranks "
            "(stage s + 1 on another rank than stage s)"
        )
    if problems:
        raise ValueError(
            f"The pipeline's stages disagree (seen on rank {rank}):\n  " + "\n  ".join(problems)
        )
    return {index: bool(example) for index, _, example in claims}
