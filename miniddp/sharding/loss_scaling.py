"""float16 under sharding: torch.amp.GradScaler, with its overflow check made the job's.

bfloat16 has float32's 8 exponent bits; float16 has 5 (largest value 65504; below 6e-5
precision fades, below 6e-8 a value is 0), so small gradients underflow. A loss scaler
multiplies the loss by S before backward, so every gradient is S times larger and clear of
the underflow, divides them by S before the optimizer steps, and skips the step (S halved) when
a gradient overflowed to inf or NaN; after N steps without one, S doubles again.

    scaler = ShardedGradScaler("cpu")          # or "cuda"; torch.amp.GradScaler's options
    scaler.scale(loss).backward()
    scaler.step(optimizer)                     # unscales, and skips the step on inf/NaN
    scaler.update()

Under MiniDDP every rank holds the same averaged gradients, so each finds the same inf, and
torch.amp.GradScaler serves as it is. Sharded, it does not: under fully_shard or ZeRO-2 a rank
checks only its shards, and an overflow in one rank's shard would make that rank skip its step
while the others take theirs, and the replicas of one parameter part forever. So the scaler
adds the ranks' findings (an all-reduce MAX of one number over the job, or `process_group`),
and every rank skips, or steps, together, with the same S. torch's FSDP2 gets the same from its
DTensor gradients, whose inf check all-reduces over their mesh.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from miniddp.job.faults import wait_for


class ShardedGradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler whose inf/NaN check covers every rank of `process_group` (None:
    the whole job), for gradients each rank holds a different part of."""

    def __init__(
        self, device: str = "cuda", *, process_group: dist.ProcessGroup | None = None, **options
    ) -> None:
        super().__init__(device, **options)
        self.process_group = process_group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide this rank's gradients by the scale and look for inf/NaN in them (torch's),
        then agree with the other ranks: an overflow anywhere is an overflow everywhere."""
        super().unscale_(optimizer)
        if not self.is_enabled():
            return
        found_per_device = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        found = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for each in found_per_device.values():
            found = torch.maximum(found, each.to(found.device))
        work = dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.process_group, async_op=True)
        wait_for(work, "the loss scaler's all-reduce of its inf/NaN check", self.process_group)
        if not found_per_device:  # no gradient here: still take part, and skip with the others
            found_per_device[self._scale.device] = found.clone()
        for each in found_per_device.values():
            each.copy_(found.to(each.device))
