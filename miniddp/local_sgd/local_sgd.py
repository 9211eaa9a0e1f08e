"""Local SGD: every replica trains alone for H optimizer steps, then the replicas average their
parameters (Lin et al., 2018, "Don't use large mini-batches, use local SGD").

DDP averages gradients after every step, so a slow link between replicas sets the pace of every
step. Local SGD sends the same number of bytes (one parameter vector) but once every H steps:
H times less traffic, paid in how far the replicas drift apart between two averages.

Usage, with torchft's shape (its `LocalSGD` takes a Manager too; here the group is enough):

    with LocalSGD(model, sync_every=H, process_group=group):
        for x, y in batches:
            optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()

Inside `with`, every `step()` of an optimizer over the model's parameters is counted (a global
optimizer hook, so the optimizer need not be named); after the H-th the parameters are averaged,
sum over the group then divided by W, torchft's order. torch's `PostLocalSGDOptimizer` with a
`PeriodicModelAverager(period=H, warmup_steps=H - 1)` averages after the same steps (its counter
starts at 0 and averages at steps warmup, warmup + H, ...), dividing before the sum: at W = 2
the two are bitwise equal, since halving is exact.
"""

from __future__ import annotations

from types import TracebackType

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from miniddp.local_sgd.checks import check_replica_group, check_sync_every, trainable
from miniddp.local_sgd.exchange import Exchange


class LocalSGD:
    """Average `model`'s parameters over `process_group` after every `sync_every` optimizer
    steps taken inside `with`. `algorithm` and `dtype` choose the all-reduce and the precision
    the parameters travel in (exchange.py)."""

    def __init__(
        self,
        model: nn.Module,
        sync_every: int,
        process_group: dist.ProcessGroup | None = None,
        *,
        algorithm: str = "gloo",
        dtype: torch.dtype | None = None,
    ) -> None:
        check_sync_every(sync_every)
        named = trainable(model)
        check_replica_group(named, process_group)
        self.model = model
        self.sync_every = sync_every
        self.params = [p for _, p in named]
        self._ids = {id(p) for p in self.params}
        self.exchange = Exchange(process_group, algorithm, dtype)
        self.local_step = 0  # optimizer steps since the last average
        self.syncs = 0
        self._hook = None

    def __enter__(self) -> LocalSGD:
        if self._hook is not None:
            raise RuntimeError("this LocalSGD is already in use: enter it once")
        self._hook = register_optimizer_step_post_hook(self._after_step)
        self.exchange.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.exchange.close()

    def _after_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        steps_ours = any(
            id(p) in self._ids for group in optimizer.param_groups for p in group["params"]
        )
        if not steps_ours:
            return
        self.local_step += 1
        if self.local_step >= self.sync_every:
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Every replica's parameters become their average over the group."""
        pending = self.exchange.start([p.detach() for p in self.params])
        averages = self.exchange.wait(pending)
        for param, average in zip(self.params, averages):
            param.copy_(average)
        self.local_step = 0
        self.syncs += 1
