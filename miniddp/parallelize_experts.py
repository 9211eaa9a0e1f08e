"""The GPT's experts on parallelize's mesh: the fifth axis, "ep", and the auxiliary loss in a step.

EP_AXES = ("pp", "dp", "ep", "tp"), ep between dp and tp as torchtitan carves it out of its data
parallelism. Every rank with its own (dp, ep) coordinate is a replica: it routes windows of its
own, the replica numbered dp_rank · ep + ep_rank of dp · ep. Each MoE block's experts are cut
over mesh["ep"] (ExpertParallel: rank e keeps chunk(E, ep, 0)[e]); everything else, the routers
included, is whole on every rank of a stage, tp's shards aside. The experts stay whole over tp:
each tp rank routes the same tokens (the residual stream is replicated there) and runs its
experts on them again, redundant work that keeps the plan simple (Megatron's expert-tensor
parallelism would cut them too).

Which gradient is averaged over which ranks. Each replica's loss L_r is the mean over its own
tokens, and one process's loss on the whole batch is their mean over the R = dp · ep replicas,
so its gradient is (1 / R) sum_r dL_r:

    a replicated parameter holds dL_r on rank r: the average over the R replicas, as any data
        parallelism averages (MiniDDP or fully_shard over mesh["dp", "ep"]._flatten("dp_ep"))
    an expert on rank (d, e) holds sum over e' of dL_(d, e') already: the combine's all-to-all
        brought home the gradient of every token its ep group sent it. What is missing are the
        other dp coordinates' tokens, on the ranks with the same experts (the expert-data-
        parallel group, mesh["dp"]): summed over dp and divided by R = dp · ep. The mean over
        dp alone would leave the gradient ep times one process's; the average over dp x ep
        would add different experts together.

So MiniDDP leaves the experts out (torch's params-to-ignore), and after the step's backward
they are summed over dp and divided by R (parallelize's GradientsSummedAfterBackward);
fully_shard shards them as units of their own over mesh["dp"] whose reduce-scatter sums and
divides by R (torch's set_gradient_divide_factor; torchtitan's way).

The auxiliary loss. One process adds, for each MoE block, aux_loss_coef · E sum_i f_i P_i of the
whole batch (router.py). With routing_group set to the R replicas' ranks its value is the whole
batch's on every rank, and its gradient on rank r is r's part: the parts summed over r are one
process's. The replicas' gradients are then averaged, not summed, so each rank's part is scaled
by R; under a pipeline each microbatch's loss counts 1 / m, and its aux loss too, so R / m.
The loss never sees it: a pipeline's middle stages have no loss to add it to. Instead the
gradient enters where the aux loss was made, in backward, through AuxLossInBackward on each
MoE's output (Megatron's MoEAuxLossAutoScaler, DeepSeek's AddAuxiliaryLoss). One process
running the same microbatches, each the replicas' microbatches side by side, gets the same
gradients, within rounding (tests/test_parallelize_ep.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from miniddp.expert_parallel import ExpertParallel, GroupedExperts, MoE
from miniddp.tensor_parallel import parallelize_module

EP_AXES = ("pp", "dp", "ep", "tp")  # 5-D with cp is not built: ep and cp both cut the tokens


def split_experts(model: nn.Module, ep_mesh: Any) -> None:
    """Cut every MoE's experts over `ep_mesh` (ExpertParallel: parallel.py); of size 1, none."""
    for module in model.modules():
        if isinstance(module, MoE) and ep_mesh.size() > 1:
            parallelize_module(module.experts, ep_mesh, ExpertParallel())


def refuse_experts_it_cannot_split(model: nn.Module, ep: int) -> None:
    """What parallelize cannot do with experts, said on every rank before any collective."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if ep > 1 and not moes:
        raise ValueError(
            f"the mesh has an ep axis of size {ep}, but this GPT has no experts to split: "
            "build it with GPTConfig(..., moe=MoEConfig(num_experts, top_k)), or use ep = 1"
        )
    for moe in moes:
        if moe.num_experts % ep:
            raise ValueError(
                f"{moe.num_experts} experts cannot be split evenly over ep = {ep}: choose a "
                f"number of experts that {ep} divides, or an ep that divides {moe.num_experts}"
            )


def expert_parameter_names(model: nn.Module) -> list[str]:
    return [
        f"{name}.{role}" if name else role
        for name, module in model.named_modules()
        if isinstance(module, GroupedExperts)
        for role, _ in module.named_parameters()
    ]


class AuxLossInBackward(torch.autograd.Function):
    """The identity on an MoE's output, whose backward also starts the aux loss's backward, with
    gradient `scale`: the aux loss trains the router as if added, times scale, to the loss."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> Any:
        ctx.scale, ctx.like = scale, aux_loss
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, torch.full_like(ctx.like, ctx.scale), None


def add_aux_losses_in_backward(
    model: nn.Module, routing_group: dist.ProcessGroup | None, replicas: int, microbatches: int
) -> None:
    """Every MoE of `model`: statistics over `routing_group` (the replicas' ranks, None for one),
    and its aux loss's gradient, scaled by replicas / microbatches, in each backward."""
    scale = replicas / microbatches

    def in_backward(moe: MoE, _: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if not moe.aux_loss.requires_grad:
            return None  # no_grad, or a router that is frozen: nothing to train
        return AuxLossInBackward.apply(output, moe.aux_loss, scale)

    for module in model.modules():
        if isinstance(module, MoE):
            module.routing_group = routing_group
            module.register_forward_hook(in_backward)
