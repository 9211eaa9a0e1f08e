"""Mistake: a post-accumulate hook that all-reduces its argument, the parameter, not its gradient.

Symptom: the gradients are never averaged, so after the first optimizer step each replica has
moved its own way. The property checks catch it at step 0: the replicas' gradients differ.

Why: `Tensor.register_post_accumulate_grad_hook(hook)` calls `hook(param)`, handing over the
parameter, after its gradient was accumulated into `param.grad`. A hook written as if it got the
gradient (as `register_hook` would give) averages the weights instead. The weights are equal
everywhere (construction broadcast them), so averaging them changes nothing, and each rank then
steps on its own, unaveraged gradient: the replicas part. Later backwards average weights that
have drifted, which pulls them together mid-backward and apart again at the next step: not SGD
on the global batch, whatever it is.

How torch avoids it: its reducer never hands a hook the parameter; its communication hooks
receive a GradBucket of gradients. In your own DDP: reduce `param.grad`.

This is rung 2 (OverlapDDP) with one line changed: `param` where it said `param.grad`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd import Variable

from miniddp.steps import OverlapDDP


class AveragesWeights(OverlapDDP):
    def _on_gradient_ready(self, index: int, param: torch.Tensor) -> None:
        if not self._in_flight:
            Variable._execution_engine.queue_callback(self._finish_backward)
        with torch.no_grad():
            param.mul_(1.0 / self.world_size)  # the mistake: param, not param.grad
            work = dist.all_reduce(param, async_op=True)
        self.all_reduce_count += 1
        self._in_flight.append((index, work))
