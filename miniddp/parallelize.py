"""`parallelize(gpt, mesh)`: chapter 12's GPT over a (pp, dp, [cp | ep,] tp) mesh, in one function.

In the spirit of torchtitan's `parallelize_llama`, each parallelism is applied once, in a fixed
order, to what the previous one left:

    1. tensor parallelism   the plan below, over mesh["tp"]: every rank of a TP group keeps its
                            slice of each matrix. First, because the plan names the modules as
                            the whole model names them ("blocks.3.mlp.up"), on every stage alike.
    2. the pipeline split   this rank keeps its stage's layers, contiguous blocks, over
                            mesh["pp"]; the first stage embeds, the last one norms and projects.
    3. data parallelism     MiniDDP (or fully_shard) over mesh["dp"], last: it wraps exactly what
                            this rank holds, shards included (their mark tells it which group
                            it must not average over, miniddp/placement.py).

With a "cp" axis, context parallelism cuts the sequence, not the model: each stage runs its
attention on the ring over mesh["cp"], and step 3 averages over dp x cp (4-D, below).

The plan (Megatron's): in each block, qkv colwise (whole heads: the GPT lays its rows out head
by head) and proj rowwise, the MLP's up colwise and down rowwise; the token embedding rowwise
(its vocabulary rows) and the head colwise (its vocabulary columns), so the logits stay sharded
and go to `vocab_parallel_cross_entropy` ungathered. LayerNorms and positions stay replicated.

The tie. The head's weight IS the token embedding's (models/gpt.py). Under TP both are cut by
vocabulary rows, chunk(E, W, 0), so one shard serves both and the tie survives. Across pipeline
stages it cannot: the first stage embeds and the last projects. As in Megatron, the last stage
keeps a copy, and after each step's backward the two copies' gradients are summed over the pair
{first, last} of each pipeline: both then hold dL/dE of one process (the sum of both uses), take
the same optimizer step, and stay equal. The copy is marked as stage 0's, so clip_grad_norm_
counts it once.

Dropout: every rank of a TP group must draw the same masks for the activations it replicates,
so seed TP ranks alike (the same seed everywhere is simplest). The attention's dropout then
draws per local head, and TP's bits differ from one process's wherever dropout is on; with
dropout 0.0 (chapter 16) every composition trains as one process does, within rounding.

HSDP, as torchtitan names it: a mesh whose "dp" is two axes, ("pp", "dp_replicate", "dp_shard",
"tp"), with data_parallel="fsdp", shards over "dp_shard" and replicates over "dp_replicate"
(fully_shard over the 2-D mesh[("dp_replicate", "dp_shard")]); replica r of the batch is then
dp_replicate_rank · dp_shard + dp_shard_rank.

4-D, torchtitan's order ("pp", "dp", "cp", "tp"): the sequence is the innermost split but TP,
because ring attention talks at every layer (W - 1 K/V hops forward, twice that backward), less
than TP's all-reduces and more than DP's once-a-step average. Every rank of a replica, its pp,
cp and tp ranks alike, is given the replica's whole windows (B, T + 1); `train_step` cuts each
into cp rank r's chunks r and 2cp-1-r of 2cp (load-balanced: equal causal work), inputs and
targets alike, gives the position embedding those chunks' global positions, and runs attention
on the ring (miniddp/context_parallel/model.py's ContextParallel; torchtitan's context_parallel
does the same around its step). Each cp rank's loss is its mean over its B·T/cp tokens, and as
they hold equally many, the whole sequence's mean is their mean: so its gradient is the average
over cp of theirs, and with dp replicas the average over dp x cp: MiniDDP or fully_shard run
over mesh["dp", "cp"]._flatten("dp_cp"), torchtitan's "dp_shard_cp". A parameter replicated
over cp then holds the same gradient on every cp rank, so clip_grad_norm_ counts it once, as a
dp replica (no mark needed). Ring attention has no dropout: cp > 1 needs dropout 0.0.

With an "ep" axis, ("pp", "dp", "ep", "tp"), a GPT with experts (GPTConfig's moe) has them cut
over ep, and every (dp, ep) coordinate is a replica with windows of its own: the experts'
gradients are summed over dp and divided by dp x ep, the rest averaged over dp x ep, and each
MoE's aux loss, global over the replicas, trains the router from inside the backward
(parallelize_experts.py says why each). A GPT with experts on the other meshes keeps them whole,
averaged as any parameter, with the same aux loss.

Mixed precision, `parallelize(..., mixed_precision=MixedPrecision(torch.bfloat16))`: one policy
for both data parallelisms (MiniDDP's `mixed_precision`; fully_shard's MixedPrecisionPolicy with
the same param_dtype and reduce_dtype). The masters stay fp32, and every step casts them to
bf16 for forward and backward, so:

    outside forward/backward   fp32 masters: what the optimizer steps, clip_grad_norm_ reads,
                               the tie sums (GradientsSummedAfterBackward: after backward,
                               each master's .grad is fp32) and a checkpoint saves
    inside                     bf16 parameters, activations, and what crosses between stages
                               (a stage's output is bf16; the borders send what they are given,
                               their header names its dtype, and the gradient coming back is
                               bf16 too); the loss in fp32, from logits cast up (next_character_
                               loss), TP's vocabulary-sharded ones included
    gradients                  each microbatch's bf16 gradient is added into an fp32 sum; the
                               average over "dp" in reduce_dtype (fp32: a sum, then one division)

With dp = 1 there is no DP wrapper to cast, and ComputeInCopies (compute_copies.py) does MiniDDP's
casts and folds without the reduction: the same copies and the same fp32 sums a MiniDDP replica
makes, so a mesh with dp = 1 and one with dp > 1 differ by the average alone. (torch.autocast
would cast per op, and keep some, LayerNorm's, in fp32: other bits than every dp > 1 mesh's.)

TP's all-reduces run in bf16: Megatron's g sums the ranks' partial products, each already rounded
to bf16 by its matmul, and the sum is rounded to bf16 once more (2^-9 relative); f's sums the
input gradients the same way. Megatron does the same. Reducing in fp32 would remove only that
last rounding of the three (each partial, then the sum, then the next op's own) and double the
bytes of the one collective that waits inside every layer: not worth it. So with TP a run is
within rounding of one process in bf16 (tests/test_parallelize_mixed_precision.py measures it),
and without TP every stage computes one process's bits: DP x PP trains bit for bit as one
process does with the same mixed precision, under MiniDDP and fully_shard alike.

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    parts = parallelize(GPT(config), mesh, n_microbatches=4)
    optimizer = torch.optim.AdamW(parts.parameters(), lr=3e-4)
    for windows in batches:                 # this replica's share: (B, T + 1) token ids
        loss = parts.train_step(windows)    # forward, backward, gradients complete
        optimizer.step()
        optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from miniddp.context_parallel import ContextParallel
from miniddp.data_parallel.compute_copies import ComputeInCopies, MixedPrecision
from miniddp.data_parallel.ddp import MiniDDP
from miniddp.expert_parallel import MoE
from miniddp.job.faults import wait_for
from miniddp.mesh import DeviceMesh
from miniddp.models.gpt import GPT, refuse_a_window_longer_than_the_context
from miniddp.parallelize_experts import (
    EP_AXES,
    add_aux_losses_in_backward,
    expert_parameter_names,
    refuse_experts_it_cannot_split,
    split_experts,
)
from miniddp.pipeline import PipelineStage, Schedule1F1B
from miniddp.pipeline.schedule import PipelineSchedule
from miniddp.placement import Stage, carry_over, mark
from miniddp.sharding import MixedPrecisionPolicy, fully_shard
from miniddp.tensor_parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
    vocab_parallel_cross_entropy,
)

AXES = ("pp", "dp", "tp")
HSDP_AXES = ("pp", "dp_replicate", "dp_shard", "tp")  # torchtitan's: "dp" as two axes
CP_AXES = ("pp", "dp", "cp", "tp")  # 4-D: the sequence split too (the docstring)


def tensor_parallel_plan(model: GPT) -> dict[str, ParallelStyle]:
    """Megatron's plan for the GPT, by the names one process gives its modules."""
    plan: dict[str, ParallelStyle] = {"token": RowwiseParallel(), "head": ColwiseParallel()}
    for index, block in enumerate(model.blocks):
        at = f"blocks.{index}"
        plan |= {
            f"{at}.attention.qkv": ColwiseParallel(),
            f"{at}.attention.proj": RowwiseParallel(),
        }
        if not isinstance(block.mlp, MoE):  # experts stay whole over tp (parallelize_experts)
            plan |= {f"{at}.mlp.up": ColwiseParallel(), f"{at}.mlp.down": RowwiseParallel()}
    return plan


class GPTStage(nn.Module):
    """Some of the GPT's layers, under the names they have in one process ("blocks.2.mlp.up"):
    the embeddings on the first stage, the norm and head on the last, blocks in between."""

    def __init__(
        self,
        model: GPT,
        blocks: range,
        first: bool,
        last: bool,
        context: ContextParallel | None = None,
    ) -> None:
        super().__init__()
        self.first, self.last, self.context = first, last, context
        self.context_length = model.config.context  # the longest window it has positions for
        if first:
            self.token, self.position, self.dropout = model.token, model.position, model.dropout
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        if last:
            self.norm, self.head = model.norm, model.head
            if not first:  # the tied matrix: the last stage's own copy (see the docstring)
                self.head.weight = nn.Parameter(model.token.weight.detach().clone())
                carry_over(model.token.weight, self.head.weight)  # a TP shard stays one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # x: token ids (b, T), or (b, T / cp) at the global positions below
            if self.context is None:  # under cp, train_step checked the whole window already
                refuse_a_window_longer_than_the_context(x.shape[1], self.context_length)
                positions = torch.arange(x.shape[1], device=x.device)
            else:
                positions = self.context.positions(x.shape[1], x.device)
            x = self.dropout(self.token(x) + self.position(positions))
        with nullcontext() if self.context is None else self.context.attention():
            for block in self.blocks.values():
                x = block(x)
        return self.head(self.norm(x)) if self.last else x


@dataclass
class ParallelGPT:
    """What this rank trains: its part of the GPT (`model`, for the optimizer and state dict),
    as it runs (`module`: wrapped for DP), and, with a pipeline, its stage and schedule."""

    model: nn.Module
    module: nn.Module
    mesh: DeviceMesh
    schedule: PipelineSchedule | None
    tied: GradientsSummedAfterBackward | None
    context: ContextParallel | None = None  # with cp > 1: how the sequence is cut
    experts: GradientsSummedAfterBackward | None = None  # under MiniDDP with an ep axis
    replica: int = 0  # which of the replicas this rank is: whose windows it trains on
    replicas: int = 1  # dp (HSDP: dp_replicate x dp_shard; with an ep axis: dp x ep)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_character_loss(logits, targets, self.mesh)

    def train_step(self, windows: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of this replica's windows (B, T + 1); gradients complete when it
        returns. The mean loss, on the ranks that compute it (the last stage's). With cp > 1,
        every rank of the replica is given the same whole windows, and each keeps its part."""
        # Every rank checks the whole window: under a pipeline the first stage alone would
        # fail, the others waiting for its activations; under cp, each rank sees a part.
        refuse_a_window_longer_than_the_context(windows.shape[1] - 1, self.model.context_length)
        if self.context is None:
            inputs, targets = windows[:, :-1], windows[:, 1:]
        else:
            inputs, targets = self.context.cut(windows)
        summed = [s for s in (self.tied, self.experts) if s is not None]
        for gradients in summed:
            gradients.set_aside()
        if self.schedule is None:
            loss = self.loss_fn(self.module(inputs), targets)
            loss.backward()
        else:
            stage, losses = self.schedule.stage, []
            if stage.is_first:
                self.schedule.step(inputs)
            elif stage.is_last:
                self.schedule.step(target=targets, losses=losses)
            else:
                self.schedule.step()
            loss = torch.stack(losses).mean() if losses else None
        for gradients in summed:
            gradients.sum_gradients()
        if loss is not None and self.context is not None:
            loss = self.context.mean(loss)  # the whole sequence's, from the cp ranks' parts
        return None if loss is None else loss.detach()


def next_character_loss(
    logits: torch.Tensor, targets: torch.Tensor, mesh: DeviceMesh
) -> torch.Tensor:
    """The mean next-character cross-entropy, from whole or vocabulary-sharded logits, in fp32
    at least (bf16 logits are cast up, as torchtitan does: the loss sums V exponentials and N
    tokens, which bf16's 8 bits would round at each addition; its gradient, softmax - onehot,
    is rounded to bf16 once, on its way back into the head)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp64 stays fp64
    if mesh["tp"].size() > 1:
        return vocab_parallel_cross_entropy(logits, targets, mesh["tp"].get_group())
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class GradientsSummedAfterBackward:
    """Gradients that a step's backward leaves partial on this rank, summed over `group` (then
    divided by `divide_by`) once it ends: the tied embedding over its first and last stage, the
    experts over dp under MiniDDP.

    Only this step's part is summed. Two steps before the optimizer's: after the first, each
    rank holds S1 (summed); summing what the second leaves, S1 + a2 on one rank and S1 + b2 on
    another, would give 2 S1 + a2 + b2. So the earlier sum is set aside before the step (.grad
    zeroed in place: a MiniDDP bucket view stays one), the step leaves a2 and b2 alone, their
    sum goes over the group, and S1 comes back: S1 + (a2 + b2), as one process accumulates.
    `grads` looks the gradients up each time (fully_shard's shards are found anew)."""

    def __init__(
        self,
        grads: Callable[[], list[torch.Tensor | None]],
        group: dist.ProcessGroup,
        what: str,
        divide_by: float = 1.0,
    ) -> None:
        self.grads, self.group, self.what, self.divide_by = grads, group, what, divide_by
        self.earlier: list[torch.Tensor | None] = []  # earlier steps' sums, while a step runs

    def set_aside(self) -> None:
        self.earlier = [None if g is None else g.clone() for g in self.grads()]
        for grad in self.grads():
            if grad is not None:
                grad.zero_()

    def sum_gradients(self) -> None:
        earlier = self.earlier or [None] * len(self.grads())
        for grad, before in zip(self.grads(), earlier):
            if grad is None:
                continue
            if dist.get_world_size(self.group) > 1:
                wait_for(
                    dist.all_reduce(grad, group=self.group, async_op=True), self.what, self.group
                )
            if self.divide_by != 1:
                grad.div_(self.divide_by)
            if before is not None:
                grad.add_(before)
        self.earlier = []


def parallelize(
    model: GPT,
    mesh: DeviceMesh,
    *,
    n_microbatches: int = 4,
    data_parallel: str = "ddp",
    device: torch.device | str | None = None,
    mixed_precision: MixedPrecision | None = None,
) -> ParallelGPT:
    """Split `model` (built alike on every rank) over `mesh`, whose axes are named from
    ("pp", "dp", "tp"), any of them of size 1, from CP_AXES to cut the sequence too, from
    EP_AXES to cut a GPT's experts, or for HSDP from HSDP_AXES; `data_parallel` is "ddp"
    (MiniDDP) or "fsdp"; `mixed_precision` computes in its param_dtype on fp32 masters (the
    module docstring); `device`, where the pipeline's messages land, is the model's own unless
    given. The replicas, each with windows of its own, are dp (HSDP: dp_replicate x dp_shard;
    with ep: dp x ep): `ParallelGPT.replica` of `.replicas`."""
    if mixed_precision is not None and torch.float16 in (
        mixed_precision.param_dtype,
        mixed_precision.reduce_dtype,
    ):
        raise ValueError(
            "parallelize takes no float16 mixed precision: float16 needs a loss scaler "
            "(scaler.scale(loss).backward()), and train_step runs the backward itself, so "
            "small gradients would underflow unseen. Use MixedPrecision(torch.bfloat16), "
            "which needs none"
        )
    names = sorted(mesh.mesh_dim_names)
    hsdp, four_d, five_d = (names == sorted(axes) for axes in (HSDP_AXES, CP_AXES, EP_AXES))
    if names != sorted(AXES) and not (hsdp or four_d or five_d):
        raise ValueError(
            f"parallelize needs a mesh with the axes {AXES} (any may have size 1), {CP_AXES} "
            f"with context parallelism, {EP_AXES} with expert parallelism, or {HSDP_AXES} for "
            f"HSDP, got {mesh.mesh_dim_names}: "
            "init_device_mesh(..., mesh_dim_names=('pp', 'dp', 'tp'))"
        )
    if data_parallel not in ("ddp", "fsdp"):
        raise ValueError(f'data_parallel is "ddp" or "fsdp", got {data_parallel!r}')
    if hsdp and data_parallel != "fsdp":
        raise ValueError(
            "a mesh with ('dp_replicate', 'dp_shard') axes is HSDP, which fully_shard runs: "
            'pass data_parallel="fsdp", or name one "dp" axis for MiniDDP'
        )
    cp = mesh["cp"].size() if four_d else 1
    if cp > 1 and model.config.dropout > 0.0:
        raise ValueError(
            f"context parallelism (cp = {cp}) runs attention on the ring, which has no "
            f"attention dropout, but this GPT's dropout is {model.config.dropout}: build it "
            "with GPTConfig(..., dropout=0.0)"
        )
    ep = mesh["ep"].size() if five_d else 1
    refuse_experts_it_cannot_split(model, ep)
    if hsdp:
        dp_mesh = mesh[("dp_replicate", "dp_shard")]
    elif cp > 1:  # one average over dp x cp (the module docstring); collective, on every rank
        dp_mesh = mesh["dp", "cp"]._flatten("dp_cp")
    elif five_d:  # every (dp, ep) coordinate a replica (parallelize_experts.py)
        dp_mesh = mesh["dp", "ep"]._flatten("dp_ep")
    else:
        dp_mesh = mesh["dp"]
    pp, dp, tp = mesh["pp"].size(), dp_mesh.size(), mesh["tp"].size()  # dp: dp x cp, with cp
    layers, heads = len(model.blocks), model.config.heads
    if heads % tp:
        raise ValueError(
            f"the GPT's {heads} heads do not split over tp = {tp}: tensor parallelism gives "
            f"each rank whole heads (its q, k and v rows), {heads} / {tp} of them. Use a tp "
            f"that divides {heads}, or a model whose heads tp divides"
        )
    if layers < pp:
        raise ValueError(f"{layers} blocks cannot fill {pp} pipeline stages: use pp <= {layers}")
    context = None
    if cp > 1:  # the replica: every rank with this rank's dp coordinate, given the same windows
        replica = mesh["pp", "cp", "tp"]._flatten("pp_cp_tp").get_group()
        context = ContextParallel(mesh["cp"].get_group(), replica)

    # 1. Tensor parallelism, by the whole model's names; under TP the tie is one shard. Then the
    # experts over ep, and each MoE's statistics over the ranks that route other tokens.
    if tp > 1:
        parallelize_module(model, mesh["tp"], tensor_parallel_plan(model))
        model.head.weight = model.token.weight
    if five_d:
        split_experts(model, mesh["ep"])
    if any(isinstance(m, MoE) for m in model.modules()):
        routing = None if dp == 1 else flat_group(dp_mesh)
        add_aux_losses_in_backward(model, routing, dp, n_microbatches if pp > 1 else 1)

    # 2. The pipeline split: contiguous blocks, stage s gets [s L / p, (s + 1) L / p) (with
    # one stage, all of them: the same module, its names one process's).
    index = mesh["pp"].get_local_rank()
    blocks = range(index * layers // pp, (index + 1) * layers // pp)
    part = GPTStage(model, blocks, first=index == 0, last=index == pp - 1, context=context)

    # 3. Data parallelism over "dp" (HSDP: its two axes; with cp, dp x cp; with ep, dp x ep but
    # the experts over dp), around exactly what this rank holds; it casts for mixed precision,
    # and without it (dp = 1) ComputeInCopies does what MiniDDP would.
    module: nn.Module = part
    experts, expert_names = None, expert_parameter_names(part) if five_d else []
    if dp > 1 and data_parallel == "ddp":
        if expert_names:
            MiniDDP._set_params_and_buffers_to_ignore_for_model(part, expert_names)
            params = [part.get_parameter(name) for name in expert_names]
            experts = GradientsSummedAfterBackward(
                lambda: [p.grad for p in params],
                mesh["dp"].get_group(),
                "all-reduce of the experts' gradients over dp",
                divide_by=dp,
            )
        module = MiniDDP(part, process_group=dp_mesh.get_group(), mixed_precision=mixed_precision)
    elif dp > 1:
        policy = None if mixed_precision is None else as_policy(mixed_precision)
        for block in part.blocks.values():
            if expert_names and isinstance(block.mlp, MoE):
                fully_shard(block.mlp.experts, mesh=mesh["dp"], mp_policy=policy)
                block.mlp.experts.set_gradient_divide_factor(dp)
            fully_shard(block, mesh=dp_mesh, mp_policy=policy)
        module = fully_shard(part, mesh=dp_mesh, mp_policy=policy)
    elif mixed_precision is not None:
        module = ComputeInCopies(part, mixed_precision)

    schedule, tied = None, None
    if pp > 1:
        device = next(part.parameters()).device if device is None else device
        stage = PipelineStage(module, index, pp, device, group=mesh["pp"].get_group())
        schedule = Schedule1F1B(stage, n_microbatches, partial(next_character_loss, mesh=mesh))
        tied = _tie_first_and_last_stage(part, mesh)
    replica, replicas = _replica(mesh, hsdp, five_d)
    return ParallelGPT(part, module, mesh, schedule, tied, context, experts, replica, replicas)


def _replica(mesh: DeviceMesh, hsdp: bool, five_d: bool) -> tuple[int, int]:
    """This rank's replica and how many there are: the ranks with other windows."""
    axes = ("dp_replicate", "dp_shard") if hsdp else ("dp", "ep") if five_d else ("dp",)
    replica, replicas = 0, 1
    for axis in axes:
        replica = replica * mesh[axis].size() + mesh[axis].get_local_rank()
        replicas *= mesh[axis].size()
    return replica, replicas


def flat_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group of all of `mesh`'s ranks, one dimension or two (HSDP's)."""
    if mesh.ndim == 1:
        return mesh.get_group()
    return mesh._flatten("_".join(mesh.mesh_dim_names)).get_group()


def as_policy(mixed_precision: MixedPrecision) -> MixedPrecisionPolicy:
    """MiniDDP's MixedPrecision as fully_shard's policy: the same two dtypes, torch's names."""
    return MixedPrecisionPolicy(
        param_dtype=mixed_precision.param_dtype, reduce_dtype=mixed_precision.reduce_dtype
    )


def first_and_last_stage_group(
    grid: torch.Tensor, pp_axis: int, pp_group: dist.ProcessGroup
) -> dist.ProcessGroup:
    """This rank's group of its pipeline's first and last stage's ranks, over the mesh's `grid`
    (with two stages, the pipeline's own group, `pp_group`). new_group is collective, so every
    rank creates all of them, one per pipeline."""
    size = grid.shape[pp_axis]
    mine = pp_group
    for ranks in grid.movedim(pp_axis, -1).reshape(-1, size).tolist():
        if size > 2:
            pair = dist.new_group([ranks[0], ranks[-1]])
            mine = pair if dist.get_rank() in ranks else mine
    return mine


def _tie_first_and_last_stage(
    part: nn.Module, mesh: DeviceMesh
) -> GradientsSummedAfterBackward | None:
    pp_axis = mesh.mesh_dim_names.index("pp")
    pair = first_and_last_stage_group(mesh.mesh, pp_axis, mesh["pp"].get_group())
    what = "all-reduce of the tied embedding's gradient (first + last stage)"
    if part.first:  # fully_shard's shard is looked up at each step
        return GradientsSummedAfterBackward(lambda: [part.token.weight.grad], pair, what)
    if part.last:
        copy = part.head.weight
        mark(copy, stage=Stage(mesh["pp"].get_group(), 0, mesh["pp"].size()))  # stage 0's
        return GradientsSummedAfterBackward(lambda: [part.head.weight.grad], pair, what)
    return None
