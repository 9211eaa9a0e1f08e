"""Not a training bug, a lesson in bit-reproducibility: where the 1/W goes changes the last bits.

What you see: with 3 ranks (any W not a power of two) some gradients differ from torch's DDP in
the last bit. Training is just as right: the mean is the mean, up to rounding. What is lost is
bitwise equality with torch's DDP, and that is what lets a test tell "the same algorithm" from
"a close one", and a rerun reproduce a run exactly. The property checks see it at W = 3: "not
torch's bits".

Why: floating-point rounding. Three recipes for the mean of the g_r, equal in exact arithmetic:

    torch's reducer      fl(sum_r fl(g_r * fl(1/W)))   scale while copying into the bucket, SUM
    torch's allreduce_hook  fl(sum_r fl(g_r / W))      the hook divides the bucket, then SUM
    this file            fl(fl(sum_r g_r) / W)         SUM, then divide

They round in different places. With W = 2 every one is exact up to the sum's own rounding
(1/2 and halving are exact), so all three agree bit for bit; with W = 3, 1/3 is not a binary
fraction and no two of them agree everywhere. Even torch's own two differ: g * fl(1/3) and g / 3
disagree in the last bit for about a third of float32 values (tests/test_mistakes.py), so torch's
DDP with its default `allreduce_hook` registered is not bitwise torch's DDP without a hook. Its
comment gives the reason it divides first: to avoid overflow in fp16, not to match the reducer.

The lesson: "bit for bit" is a property of a recipe, not of the maths. To reproduce a result
exactly, fix where every scaling happens and the order of every sum, as the ladder does (scale
while copying, as torch's reducer, then SUM).

This is rung 4 (TorchLayoutDDP), its `_mark_ready` copying without the 1/W and its end of backward
dividing instead.
"""

from __future__ import annotations

import torch.distributed as dist

from miniddp.steps import TorchLayoutDDP


class DividesAfterSum(TorchLayoutDDP):
    def _mark_ready(self, index: int) -> None:
        self._marked_ready[index] = True
        bucket, position = self._layout.slot[index]
        bucket.add(position, divide_by=1)  # the mistake, part 1: no 1/W here ...
        if bucket.is_full:
            self._launch_full_buckets()

    def _finish_backward(self) -> None:
        super()._finish_backward()
        for param in self.params:
            param.grad.div_(dist.get_world_size())  # ... part 2: the sum divided by W
