"""Chapter 12's replicas: one GPT trained under several designs at once, and how they compare.

Each design is a Replica: the same GPT from the same weights, wrapped (or sharded) its own way,
with its own AdamW. The chapter steps them in lockstep on the same windows and dropout seeds, and
after every optimizer step an Agreement notes whether each one's loss and parameters are still
bitwise MiniDDP's, and if not, how far apart they are.

    miniddp       MiniDDP + AdamW: the run the chapter is about
    torch         torch's DistributedDataParallel + AdamW
    one-process   no wrapper, rank 0 alone, on the whole global batch with accumulation
    zero1         MiniDDP + miniddp.ZeroRedundancyOptimizer(AdamW)
    zero2         the same, with the reduce-scatter hook: each rank keeps its share's gradients
    zero3         miniddp.fully_shard on every block, then on the root; AdamW on the shards

Clipping needs the norm of all the gradients. Under DDP, one process and ZeRO-1 every rank holds
every averaged gradient, and torch's clip_grad_norm_ computes it. Under ZeRO-2 and fully_shard a
rank holds only its share: miniddp.sharding.clip_grad_norm_ adds the shares' squares over the
ranks, a sum in another order, so those two match MiniDDP within rounding once clipping acts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from common import fmt_bytes, say, say_all_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp import MiniDDP, ZeroRedundancyOptimizer, full_state_dict, fully_shard
from miniddp.models.gpt import GPT, GPTConfig, parameter_groups
from miniddp.sharding import Formula, ddp_buckets, measure_memory, reduce_scatter_hook
from miniddp.sharding import clip_grad_norm_ as sharded_clip_grad_norm_

DESIGNS = ("miniddp", "torch", "one-process", "zero1", "zero2", "zero3")
BETAS = (0.9, 0.95)  # nanoGPT's: a shorter memory for the second moment than Adam's 0.999


@dataclass
class Replica:
    """One way of training the GPT: what forward is called on, the GPT inside, its optimizer,
    how to skip gradient sync, and how to clip; plus the losses it recorded."""

    name: str
    model: nn.Module
    module: GPT
    optimizer: torch.optim.Optimizer
    no_sync: Callable[[], AbstractContextManager]
    clip: Callable[[float], torch.Tensor]
    train_losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0  # spent in its training steps, for its tokens per second

    def parameters(self) -> dict[str, torch.Tensor]:
        """Every full parameter by name (a collective under fully_shard: it gathers them)."""
        return full_state_dict(self.module) if self.name == "zero3" else self.module.state_dict()


def build_gpt(config: GPTConfig, seed: int) -> GPT:
    """The same initial weights on every rank and in every replica: a seeded, forked RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(config)


def build_replica(
    design: str, config: GPTConfig, seed: int, lr: float, weight_decay: float
) -> Replica:
    """A fresh GPT under `design` (one of DESIGNS), with AdamW and the two parameter groups."""
    module = build_gpt(config, seed)
    params = list(module.parameters())
    if design == "zero3":
        for block in module.blocks:
            fully_shard(block)  # the blocks first, then the root for the embeddings and norm
        fully_shard(module)
        params = list(module.parameters())  # now this rank's shards
    groups = parameter_groups(module, weight_decay)
    if design in ("zero1", "zero2"):
        optimizer = ZeroRedundancyOptimizer(groups, torch.optim.AdamW, lr=lr, betas=BETAS)
    else:
        optimizer = torch.optim.AdamW(groups, lr=lr, betas=BETAS)
    # ZeRO-2 and fully_shard: a rank holds only its share of the gradients, so the norm is a
    # sum over the ranks. Everywhere else every rank holds them all: torch's own clipping.
    clip = sharded_clip_grad_norm_ if design in ("zero2", "zero3") else nn.utils.clip_grad_norm_

    def clip_mine(max_norm: float) -> torch.Tensor:
        return clip(params, max_norm)

    if design == "zero3":
        return Replica(design, module, module, optimizer, _no_gradient_sync(module), clip_mine)
    if design == "one-process":
        return Replica(design, module, module, optimizer, nullcontext, clip_mine)
    model = DistributedDataParallel(module) if design == "torch" else MiniDDP(module)
    if design == "zero2":
        model.register_comm_hook(optimizer, reduce_scatter_hook)
    return Replica(design, model, module, optimizer, model.no_sync, clip_mine)


def _no_gradient_sync(module: nn.Module) -> Callable[[], AbstractContextManager]:
    """fully_shard's no_sync(): backward keeps full gradients, the next synced one reduces."""

    @contextmanager
    def no_sync():
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    return no_sync


@dataclass
class Agreement:
    """How a replica compares with MiniDDP's after each step: bitwise, else the largest gap."""

    steps: int = 0
    bitwise_steps: int = 0
    largest_loss_gap: float = 0.0
    largest_parameter_gap: float = 0.0

    def record(self, losses: tuple[float, float], ours: dict, theirs: dict) -> None:
        pairs = [(ours[name], theirs[name]) for name in ours]
        bitwise = losses[0] == losses[1] and all(torch.equal(a, b) for a, b in pairs)
        gap = max((a.double() - b.double()).abs().max().item() for a, b in pairs)
        self.steps += 1
        self.bitwise_steps += bitwise
        self.largest_loss_gap = max(self.largest_loss_gap, abs(losses[0] - losses[1]))
        self.largest_parameter_gap = max(self.largest_parameter_gap, gap)

    @property
    def bitwise(self) -> bool:
        return self.bitwise_steps == self.steps

    def on_every_rank(self) -> Agreement:
        """The worst over every rank (a collective)."""
        mine = [self.bitwise_steps, -self.largest_loss_gap, -self.largest_parameter_gap]
        worst = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MIN)
        return Agreement(self.steps, int(worst[0].item()), -worst[1].item(), -worst[2].item())

    def __str__(self) -> str:
        exact = "bit for bit after every one" if self.bitwise else "not bit for bit"
        return (
            f"{self.steps} steps, {exact} (largest loss gap {self.largest_loss_gap:.1e}, "
            f"parameter gap {self.largest_parameter_gap:.1e})"
        )


def params_sha256(parameters: dict[str, torch.Tensor]) -> str:
    """A fingerprint of the exact bits of every parameter, in state-dict order."""
    digest = hashlib.sha256()
    for name, tensor in parameters.items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def ascii_curves(curves: dict[str, list[float]], width: int = 60, height: int = 12) -> str:
    """Loss against step: '*' for the first curve, 'o' for the second, '#' where they share
    a cell (one curve exactly on top of the other is all '#')."""
    longest = max(len(values) for values in curves.values())
    low = min(min(values) for values in curves.values())
    high = max(max(values) for values in curves.values())
    grid = [[" "] * width for _ in range(height)]
    for mark, values in zip("*o", curves.values()):
        for column in range(width):
            chunk = values[column * longest // width : (column + 1) * longest // width]
            if chunk:
                row = round((high - sum(chunk) / len(chunk)) / (high - low + 1e-12) * (height - 1))
                grid[row][column] = mark if grid[row][column] in (" ", mark) else "#"
    lines = [
        f"{high - (high - low) * r / (height - 1):6.2f} |{''.join(row)}"
        for r, row in enumerate(grid)
    ]
    lines.append(f"{'':6} +{'-' * width}\n{'':8}step 1{longest:>{width - 6}}")
    legend = ", ".join(f"{mark} {name}" for mark, name in zip("*o", curves))
    return "\n".join(lines + [f"{'':8}{legend}" + (", # both" if len(curves) > 1 else "")])


def say_memory(replica: Replica, psi: int, world: int) -> bool:
    """Each rank's bytes after the last step, by kind, beside the formula's (chapter 08);
    whether they are equal on this rank. Every rank must call it."""
    params = list(replica.module.parameters())
    mine = params  # under fully_shard: this rank's padded shards
    if isinstance(replica.optimizer, ZeroRedundancyOptimizer):
        rank = replica.optimizer.rank
        mine = [p for p in params if replica.optimizer.owner_of(p) == rank]
    measured = measure_memory(params, replica.optimizer, ddp_buckets(replica.model))
    formula = Formula(replica.name, psi, len(mine), world)
    expected = formula.expected(sum(p.numel() for p in mine))
    kinds = ("parameters", "gradients", "buckets", "optimizer_state")
    line = "  ".join(f"{kind} {fmt_bytes(getattr(measured, kind))}" for kind in kinds)
    line += f"  = {fmt_bytes(measured.total)}"
    if measured != expected:
        formula = "  ".join(f"{kind} {fmt_bytes(getattr(expected, kind))}" for kind in kinds)
        line += f"\n    but the formula says {formula}"
    say(f"{replica.name}: each rank's bytes after the last step, counted from the storages:")
    say_all_ranks(f"{line}{'' if measured != expected else ': the formula, to the byte'}")
    ddp = Formula("ddp", psi, len(params), world).expected()
    say(f"plain DDP's formula for the same model: {fmt_bytes(ddp.total)} on every rank")
    return measured == expected
