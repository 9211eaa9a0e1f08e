"""Mistake: all-reduce with SUM, then divide by W, instead of multiplying by 1/W before.

Symptom: with 3 ranks (any W not a power of two) some gradients differ from torch's DDP in the
last bit. The training is just as right, up to rounding, but no longer bit for bit torch's, and
bitwise equality is what lets a test tell "the same algorithm" from "a close one". The property
checks catch it at W = 3: "not torch's bits".

Why: floating-point rounding. torch's DDP copies each gradient into its bucket multiplied by the
float 1/W, then all-reduces with SUM: fl(sum(fl(g_r * fl(1/W)))). Dividing after the sum
computes fl(fl(sum(g_r)) / W). In exact arithmetic both are the mean; in floating point the
roundings fall in different places. With W = 2, 1/2 is exact and halving is exact, so the two
agree bit for bit; with W = 3, 1/3 is not a binary fraction and they don't.

How torch avoids it: it fixes the recipe (scale while copying into the bucket, then SUM), and so
does every rung of the ladder. Its built-in `allreduce_hook` divides before the all-reduce too.

This is rung 4 (TorchLayoutDDP), its hook copying without the 1/W and its end of backward
dividing instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Variable

from miniddp.steps import TorchLayoutDDP


class DividesAfterSum(TorchLayoutDDP):
    def _on_gradient_ready(self, index: int, param: torch.Tensor) -> None:
        if not self._arrived:
            Variable._execution_engine.queue_callback(self._finish_backward)
        self._arrived.add(index)
        if not self.has_rebuilt_buckets:
            self._ready_order.append(index)
        bucket, view = self._slot[index]
        view.copy_(param.grad)  # the mistake, part 1: no 1/W here ...
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch_ready_buckets()

    def _finish_backward(self) -> None:
        super()._finish_backward()
        for param in self.params:
            param.grad.div_(dist.get_world_size())  # ... part 2: the sum divided by W
