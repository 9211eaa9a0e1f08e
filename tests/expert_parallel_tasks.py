"""What the ranks of the test pool run for tests/test_expert_parallel.py.

Every rank builds the same MoE (one seed) and the same whole batch, computes one process's
answer on all of it (the reference), then the same MoE split over the ranks, each rank on its
own tokens, `torch.chunk(batch, W)[rank]`, and reports how its part compares.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from miniddp.collectives import all_reduce
from miniddp.expert_parallel import ExpertParallel, MoE, all_reduce_gradients
from miniddp.mesh import init_device_mesh
from miniddp.models import GPT, GPTConfig, MoEConfig, moe_aux_loss
from miniddp.tensor_parallel import parallelize_module


@dataclass(frozen=True)
class Spec:
    dim: int = 16
    hidden_dim: int = 24
    num_experts: int = 8
    top_k: int = 2
    tokens: int = 12  # per rank
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01
    seed: int = 0
    empty_rank: int | None = None  # a rank with no tokens at all
    one_expert: bool = False  # a gate that sends every token to expert 0 first


def build(spec: Spec) -> tuple[MoE, torch.Tensor, torch.Tensor, list[int]]:
    """The MoE, the whole batch x and the output's gradient dy, and each rank's token count."""
    torch.manual_seed(spec.seed)
    moe = MoE(
        spec.dim,
        spec.hidden_dim,
        spec.num_experts,
        spec.top_k,
        capacity_factor=spec.capacity_factor,
        aux_loss_coef=spec.aux_loss_coef,
    )
    if spec.one_expert:
        with torch.no_grad():
            moe.router.gate.weight[0] += 100.0
    counts = [0 if r == spec.empty_rank else spec.tokens for r in range(dist.get_world_size())]
    x = torch.randn(sum(counts), spec.dim)
    if spec.one_expert:
        x = x.abs()  # all positive, so the raised row wins for every token
    return moe, x, torch.randn(sum(counts), spec.dim), counts


def run(moe: MoE, x: torch.Tensor, dy: torch.Tensor, share: float) -> dict[str, torch.Tensor]:
    """Forward, and backward of (y . dy) * share + aux_loss; the output and every gradient."""
    y = moe(x)
    ((y * dy).sum() * share + moe.aux_loss).backward()
    grads = {name: p.grad.clone() for name, p in moe.named_parameters()}
    return {"y": y.detach(), "aux": moe.aux_loss.detach(), **grads}


def dropless(spec: Spec) -> dict[str, object]:
    """EP against one process: which results are the same bits, and the router's difference."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    moe, x, dy, counts = build(spec)
    reference = run(moe, x, dy, 1.0)
    reference_counts = moe.tokens_per_expert.clone()
    moe.zero_grad()
    parallelize_module(moe.experts, dist.group.WORLD, ExpertParallel())
    mine = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
    ours = run(moe, x[mine], dy[mine], 1.0)
    router = ours["router.gate.weight"]
    all_reduce(router)
    expert_chunk = {
        w: reference[f"experts.{w}"].chunk(world_size)[rank] for w in ("w1", "w2", "w3")
    }
    return {
        "y": torch.equal(ours["y"], reference["y"][mine]),
        **{w: torch.equal(ours[f"experts.{w}"], expert_chunk[w]) for w in expert_chunk},
        "router": (router - reference["router.gate.weight"]).abs().max().item(),
        "aux": (ours["aux"] - reference["aux"]).abs().item(),
        "tokens_per_expert": torch.equal(moe.tokens_per_expert, reference_counts),
    }


def capacity_per_group(spec: Spec) -> dict[str, object]:
    """EP with a capacity factor against one process applying the MoE to each rank's tokens in
    turn; and the fewest rows any expert kept in any group (the hazard: fewer than 4 is not
    comparable bit for bit, parallel.py)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    moe, x, _, _ = build(spec)
    outputs, dropped, fewest = [], 0, None
    with torch.no_grad():
        for group in x.chunk(world_size):
            outputs.append(moe(group))
            dropped += moe.dropped
            choices = moe.router(group).experts
            kept = choices[moe.within_capacity(choices)]
            per_expert = torch.bincount(kept, minlength=spec.num_experts).min().item()
            fewest = per_expert if fewest is None else min(fewest, per_expert)
        parallelize_module(moe.experts, dist.group.WORLD, ExpertParallel())
        ours = moe(x.chunk(world_size)[rank])
    return {
        "y": torch.equal(ours, outputs[rank]),
        "dropped": (moe.dropped, dropped),
        "fewest kept rows": fewest,
    }


def with_data_parallel(spec: Spec) -> dict[str, object]:
    """A (dp, ep) = (2, 2) mesh: each rank a quarter of the batch; the experts split over ep,
    gradients summed as gradients.py says, against one process on the whole batch."""
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    moe, x, dy, _ = build(spec)
    reference = run(moe, x, dy, 1.0)
    moe.zero_grad()
    parallelize_module(moe.experts, mesh["ep"], ExpertParallel())
    moe.routing_group = dist.group.WORLD  # every rank routes: the aux loss over all of them
    # Each ep group must see its tokens in rank order: dp row d holds quarters 2d and 2d+1.
    mine = x.chunk(4)[rank], dy.chunk(4)[rank]
    ours = run(moe, *mine, 1.0)
    all_reduce_gradients(
        moe,
        data_parallel_group=dist.group.WORLD,
        expert_data_parallel_group=mesh["dp"].get_group(),
    )
    ep_rank = mesh["ep"].get_local_rank()
    differences = {
        "y": (ours["y"] - reference["y"].chunk(4)[rank]).abs().max().item(),
        "aux": (ours["aux"] - reference["aux"]).abs().item(),
    }
    for name, param in moe.named_parameters():
        expected = reference[name]
        if name.startswith("experts."):
            expected = expected.chunk(2)[ep_rank]
        differences[name] = (param.grad - expected).abs().max().item()
    return differences


def refusal(case: str) -> str:
    """The message each rank gets for one kind of bad input, "accepted" if none."""
    try:
        if case == "top_k > num_experts":
            MoE(8, 8, 4, 5)
        elif case == "top_k < 1":
            MoE(8, 8, 4, 0)
        elif case == "capacity_factor <= 0":
            MoE(8, 8, 4, 1, capacity_factor=0.0)
        elif case == "capacity_factor < 0":
            MoE(8, 8, 4, 1, capacity_factor=-1.0)
        elif case == "capacity_factor nan":
            MoE(8, 8, 4, 1, capacity_factor=float("nan"))
        elif case == "experts not divisible by ep":
            parallelize_module(MoE(8, 8, 3, 1).experts, dist.group.WORLD, ExpertParallel())
        elif case == "a group without this rank":
            group = dist.new_group([0])
            parallelize_module(MoE(8, 8, 4, 1).experts, group, ExpertParallel())
        elif case == "not the experts":
            parallelize_module(MoE(8, 8, 4, 1), dist.group.WORLD, ExpertParallel())
        elif case == "split twice":
            moe = MoE(8, 8, 4, 1)
            parallelize_module(moe, dist.group.WORLD, {"experts": ExpertParallel()})
            parallelize_module(moe.experts, dist.group.WORLD, ExpertParallel())
        elif case == "wrong width":
            MoE(8, 8, 4, 1)(torch.zeros(3, 7))
    except (ValueError, TypeError) as error:
        return str(error)
    return "accepted"


def gpt_with_experts(seed: int) -> dict[str, object]:
    """Chapter 12's GPT with experts in every other block, its experts split over the ranks,
    each rank its own windows: the logits and the experts' gradients against one process on
    every window (dropout off: a mask drawn per rank is another mask)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=20, context=16, width=32, layers=2, heads=2, dropout=0.0)
    model = GPT(replace(config, moe=MoEConfig(num_experts=4, top_k=2)))
    windows = torch.randint(0, 20, (2 * world_size, 16))
    weights = torch.randn(2 * world_size, 16, 20)

    def run(tokens: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, dict]:
        model.zero_grad()
        logits = model(tokens)
        ((logits * g).sum() + moe_aux_loss(model)).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    reference_logits, reference = run(windows, weights)
    for block in model.blocks:
        if isinstance(block.mlp, MoE):
            parallelize_module(block.mlp.experts, dist.group.WORLD, ExpertParallel())
    mine = slice(2 * rank, 2 * rank + 2)
    logits, grads = run(windows[mine], weights[mine])
    experts = {n: g for n, g in grads.items() if ".experts." in n}
    others = {n: g for n, g in grads.items() if n not in experts}
    for grad in others.values():
        all_reduce(grad)
    return {
        "logits": torch.equal(logits, reference_logits[mine]),
        "experts": all(
            torch.equal(g, reference[n].chunk(world_size)[rank]) for n, g in experts.items()
        ),
        "others": max(  # relative: the embeddings' gradients are sums of hundreds of terms
            ((g - reference[n]).abs().max() / reference[n].abs().max()).item()
            for n, g in others.items()
        ),
        "expert blocks": sum(isinstance(b.mlp, MoE) for b in model.blocks),
    }
